"""Load-test tooling speed (issue 14): generation per core, our asyncio driver against Locust,
and the run phase against three local shufflers.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/loadtest.py`` (``--help``). Prints
the "Load test" section of docs/benchmarks.md as Markdown (append it by hand).

1. Generation: ``esa loadtest``'s prepare phase (services/tools/loadtest/prepare.py) with ONE
   worker process for a k-RAPPOR channel (homepage, ~31 fragments) and a k-RR channel (one
   fragment): reports encoded + sealed per second and contributions (outer envelope) sealed per
   second on one core.
2. Generator ceiling: the same prepared requests (homepage-sized bodies) replayed for
   ``--seconds`` against benchmarks/trivial_app.py (answers 202 without work) by the asyncio
   driver (services/tools/loadgen.py) and by a minimal Locust ``FastHttpUser`` (one process
   each, the same number of connections/users): requests/s and client CPU µs per request.
3. Run phase against 1 analyzer + 3 shufflers (``esa up`` settings, SQLite): fresh outer-sealed
   contributions (distinct client tokens issued with each shuffler's secret, a new nonce each),
   as fast as answered, by each generator: offered and accepted per second; and one shuffler
   alone with benchmarks/shuffler.py's body (6 fragments of 72 bytes) for its ingest figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import machine

from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS, DELETION
from services.tools.loadtest.prepare import Plan, prepare
from shuffler.intake import TokenAuthority

HERE = Path(__file__).resolve().parent
LOCUSTFILE = """
import os, pickle, itertools
from locust import constant, task
from locust.contrib.fasthttp import FastHttpUser
from locust.exception import StopUser

with open(os.environ["ESA_LOCUST_REQUESTS"], "rb") as handle:
    REQUESTS = pickle.load(handle)
NEXT = itertools.cycle(REQUESTS) if os.environ.get("ESA_LOCUST_CYCLE") else iter(REQUESTS)


class Device(FastHttpUser):
    wait_time = constant(0)
    host = "http://127.0.0.1"

    @task
    def contribute(self):
        try:
            url, token, body = next(NEXT)
        except StopIteration:
            raise StopUser()
        headers = {"Authorization": "Bearer " + token, "Content-Type": "application/octet-stream"}
        self.client.post(url + "/v1/contributions", data=body, headers=headers, name="ingest")
"""


class Cycle:
    """A source that replays the same requests forever (for a server that keeps nothing)."""

    def __init__(self, requests: list[loadgen.Request]) -> None:
        self._it: Iterator[loadgen.Request] = iter(())
        self.requests = requests

    def next(self, now: float) -> loadgen.Request | None:
        for request in self._it:
            return request
        self._it = iter(self.requests)
        return next(self._it)


class Once:
    """A source that sends each request once."""

    def __init__(self, requests: list[loadgen.Request]) -> None:
        self._it = iter(requests)

    def next(self, now: float) -> loadgen.Request | None:
        return next(self._it, None)


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def generation(var: Path, url: str, key: str, devices: int) -> dict[str, Any]:
    """Prepare phase with one worker: reports and contributions sealed per second."""
    found = {}
    for channel in ("homepage", "pages"):
        plan = Plan(url, key, devices, 10, var / f"gen-{channel}", (channel,), workers=1)
        prepared = prepare(plan)
        found[channel] = {k: round(v) for k, v in prepared.timings.items()}
    return found


def bodies(
    var: Path, urls: list[str], count: int, fragments: int, size: int
) -> list[loadgen.Request]:
    """``count`` fresh contributions for the homepage channel's current epoch, spread over the
    shufflers: distinct client tokens (issued with each shuffler's own secret), new nonces,
    ``fragments`` inner fragments of ``size`` bytes (the shuffler never opens them)."""
    import httpx

    keys, authorities = [], []
    for i, url in enumerate(urls):
        answer = httpx.get(url + "/v1/config", timeout=30).json()
        keys.append((answer["id"], load_x25519_public(base64.b64decode(answer["public_key"]))))
        secret = (var / "keys" / f"shuffler-{i + 1}" / launcher.TOKEN_SECRET_FILE).read_text()
        authorities.append(TokenAuthority(secret.strip().encode()))
    epoch = int(time.time() // 3600)
    out = []
    for n in range(count):
        index = n % len(urls)
        sid, public = keys[index]
        inner = tuple(os.urandom(size) for _ in range(fragments))
        body = seal_contribution(
            Contribution("homepage", "", epoch, new_nonce(), inner), sid, public
        )
        out.append(loadgen.Request(index, authorities[index].issue(), body))
    return out


def driver_run(
    urls: list[str], source: loadgen.Source, seconds: float, connections: int
) -> dict[str, Any]:
    """Our asyncio driver as fast as answered: rate, accepted, CPU µs per request."""
    driver = loadgen.Driver(urls, max(1, connections // len(urls)))
    cpu = _cpu()
    spent = asyncio.run(driver.run(source, None, seconds, until_empty=True))
    used = _cpu() - cpu
    return {
        "offered_per_s": round(driver.sent / spent),
        "accepted_per_s": round(driver.stats.accepted / spent),
        "accepted": driver.stats.accepted,
        "errors": driver.stats.errors,
        "client_cpu_us": round(used / max(1, driver.sent) * 1e6),
    }


def locust_run(
    tmp: Path,
    urls: list[str],
    requests: list[loadgen.Request],
    seconds: float,
    users: int,
    cycle: bool,
) -> dict[str, Any]:
    """A minimal Locust FastHttpUser replaying the same requests (one process, headless)."""
    data = tmp / "locust-requests.pkl"
    data.write_bytes(pickle.dumps([(urls[r.shuffler], r.token, r.body) for r in requests]))
    locustfile = tmp / "locustfile.py"
    locustfile.write_text(LOCUSTFILE)
    env = {**os.environ, "ESA_LOCUST_REQUESTS": str(data), "ESA_LOCUST_CYCLE": "1" if cycle else ""}
    start_children = os.times().children_user + os.times().children_system
    subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(locustfile),
            "--headless",
            "-u",
            str(users),
            "-r",
            str(users),
            "--run-time",
            f"{int(seconds)}s",
            "--csv",
            str(tmp / "locust"),
            "--only-summary",
            "--loglevel",
            "ERROR",
            "--stop-timeout",
            "5",
        ],
        env=env,
        check=False,
        capture_output=True,
        timeout=seconds + 120,
    )
    used = os.times().children_user + os.times().children_system - start_children
    with (tmp / "locust_stats.csv").open() as handle:
        row = next(r for r in csv.DictReader(handle) if r["Name"] == "Aggregated")
    count, failures = int(row["Request Count"]), int(row["Failure Count"])
    rate = float(row["Requests/s"])
    return {
        "offered_per_s": round(rate),
        "accepted_per_s": round(rate * (count - failures) / max(1, count)),
        "accepted": count - failures,
        "failures": failures,
        "client_cpu_us": round(used / max(1, count) * 1e6),
    }


def ceiling(
    tmp: Path, requests: list[loadgen.Request], seconds: float, connections: int
) -> dict[str, Any]:
    """Both generators against the trivial app (it keeps nothing: the same bodies again)."""
    import httpx

    port = launcher.free_base_port(1)
    app = subprocess.Popen([sys.executable, str(HERE / "trivial_app.py"), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        same = [loadgen.Request(0, r.token, r.body) for r in requests]
        ours = driver_run([url], Cycle(same), seconds, connections)
        theirs = locust_run(tmp, [url], same, seconds, connections, cycle=True)
    finally:
        app.terminate()
        app.wait()
    return {"driver": ours, "locust": theirs}


def main() -> None:
    import importlib.util

    if importlib.util.find_spec("locust") is None:
        raise SystemExit("the comparison needs Locust: .venv/bin/pip install 'locust>=2.20'")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15, help="length of each timed run")
    parser.add_argument("--connections", type=int, default=96, help="connections / Locust users")
    parser.add_argument("--contributions", type=int, default=20_000, help="fresh bodies per run")
    parser.add_argument("--devices", type=int, default=400, help="devices of the generation step")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    pages = DEFAULT_CHANNELS[0].model_copy(
        update={
            "id": "pages",
            "mechanism": "krr",
            "params": {"k": 16, "eps": 2.0},
            "max_fragments": 4,
            "min_crowd": 20,
            **DELETION,
        }
    )
    results: dict[str, Any] = {"machine": machine(pinned=False), "load_before": load}
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        var = tmp / "var"
        specs = launcher.prepare(
            var, 3, launcher.free_base_port(4), channels=[DEFAULT_CHANNELS[0], pages]
        )
        services = launcher.start_all(specs, var / "logs")
        try:
            url, key = services[0].url, (var / "analyzer.pub").read_text().strip()
            urls = [s.url for s in services[1:]]
            results["generation"] = generation(var, url, key, args.devices)
            print(results["generation"], flush=True)
            homepage_body = bodies(var, urls, 200, 31, 72)
            results["body_bytes"] = len(homepage_body[0].body)
            results["ceiling"] = ceiling(tmp, homepage_body, args.seconds, args.connections)
            print(results["ceiling"], flush=True)
            fresh = bodies(var, urls, args.contributions, 31, 72)
            results["deployment_driver"] = driver_run(
                urls, Once(fresh), args.seconds * 4, args.connections
            )
            print(results["deployment_driver"], flush=True)
            fresh = bodies(var, urls, args.contributions, 31, 72)
            results["deployment_locust"] = locust_run(
                tmp, urls, fresh, args.seconds * 4, args.connections, cycle=False
            )
            print(results["deployment_locust"], flush=True)
        finally:
            launcher.stop(services)
    results["load_after"] = os.getloadavg()[0]
    print(results)


if __name__ == "__main__":
    main()
