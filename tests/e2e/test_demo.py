"""``esa demo`` end to end: real service processes on PostgreSQL, real SDK devices over HTTP.

This is ``make demo``'s flow (the demo starts its own deployment with the commands and settings
of ``esa up``), with the PostgreSQL backend of docker-compose.yml and a smaller population.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from scipy import stats

from services.cli.launcher import port_free
from services.tools.catalogue import DEFAULT_CHANNELS

from ..services.test_launcher import _base_port


def _demo(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_on_postgresql_reports_estimates_inside_their_intervals(
    tmp_path: Path, postgres_template: str
) -> None:
    base = _base_port()
    done = _demo(
        "--devices", "600",
        "--analyzer-url", f"http://127.0.0.1:{base}",
        "--database-url-template", postgres_template,
        "--report", str(tmp_path / "report.html"),
        "--json", str(tmp_path / "demo.json"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "demo.json").read_text())["channels"]
    assert {r["channel_id"] for r in results} == {c.id for c in DEFAULT_CHANNELS}
    checked = inside = 0
    for r in results:
        assert r["delivered"] >= r["devices"], r  # every device's contribution acknowledged
        assert 0.5 < r["kept"] <= 1.0, r  # randomized deletion removes a few, not most
        # Balcer–Cheu certifies nothing below its declared crowd (n = 2,000 per shuffler).
        if r["central_eps"] is None:  # JSON's "no bound" (ε = ∞)
            assert r["mechanism"] == "zsum", r
        else:
            assert 0 < r["central_eps"] < math.inf and r["method"], r
            assert r["local_eps"] is None or r["central_eps"] <= r["local_eps"] + 1e-9, r
            assert r["add_remove_eps"] is None or r["add_remove_eps"] >= r["central_eps"], r
        checked += len(r["checked"])
        inside += r["inside"]
    # 95% intervals (with the deletion noise) over ~24 checked bins: even at a true coverage
    # of 85% (our normal approximations are rough for small counts) fewer inside than this has
    # probability < 1e-4; estimates of the wrong thing land nowhere near.
    floor = stats.binom.ppf(1e-4, checked, 0.85)
    assert inside >= floor, (inside, checked, results)
    assert f"{inside} of {checked} checked estimates inside" in done.stdout
    report = (tmp_path / "report.html").read_text()
    assert report.count("data:image/png;base64,") == len(DEFAULT_CHANNELS)
    assert f"http://127.0.0.1:{base}/" in done.stdout  # the dashboard URL is printed
    assert all(port_free(base + i) for i in range(4))  # its own deployment is stopped again


def test_demo_uses_a_running_deployment_and_refuses_a_closed_epoch(tmp_path: Path) -> None:
    base = _base_port()
    var = tmp_path / "var"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--var", str(var), "--base-port", str(base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        while "dashboard" not in (line := up.stdout.readline()):
            assert line, "esa up exited"
        args = ["--devices", "500", "--analyzer-url", f"http://127.0.0.1:{base}"]
        args += ["--var", str(var), "--channel", "homepage", "--report", str(tmp_path / "r.html")]
        for _ in range(2):  # once more if the hourly epoch turned between the two runs
            epoch = time.time() // 3600
            first = _demo(*args)
            assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
            assert f"using the deployment at http://127.0.0.1:{base}" in first.stderr
            again = _demo(*args)
            if time.time() // 3600 == epoch:
                break
        assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
        assert "was already closed and released" in again.stderr
        unknown = _demo(*args[:-4], "--channel", "nope")
        assert unknown.returncode == 1 and "unknown channel(s) nope" in unknown.stderr
    finally:
        up.terminate()
        up.wait(30)
