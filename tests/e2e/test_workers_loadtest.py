"""``esa loadtest --keys`` verifies a longitudinal channel served by two analyzer workers
on one PostgreSQL database behind HAProxy (``esa up --analyzer-workers 2``), with real processes.

A longitudinal phase counts as received at the analyzer the fragments it opened meanwhile (one
per contribution). The shuffler forwards one batch part per epoch as each epoch ends; HAProxy
hands them to the workers round-robin (nothing else reaches the analyzer during the phase, so
the first three alternate and each worker gets at least one), and the worker that stored a part
is woken to open it at once (the other only polls every second), so each one's own counter
(``esa_analyzer_fragments_opened_total``) holds its share only. Verification read that counter
from whichever worker answered the scrape and reported a false FAIL (lost = the other worker's
share); it now reads the database's fragment ledger (``esa_analyzer_ledger_fragments``), the
same at every worker: the run passes, both workers opened parts, and the counter of either one
alone would not have balanced the books.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import launcher
from services.tools.credentials import Credentials
from services.tools.loadtest import verify
from tests.support import LOADTEST_SERIES as ABROAD
from tests.support import TEST_SHUFFLER_SETTINGS

DEVICES = 300
OPENED = "esa_analyzer_fragments_opened_total"


@pytest.fixture
def deployment(tmp_path: Path, postgres_template: str) -> Iterator[dict[str, launcher.Service]]:
    """One trust domain (shuffler-1, one replica), and the analyzer as two workers behind
    HAProxy, serving the longitudinal channel only."""
    services = launcher.up(
        tmp_path / "var",
        1,
        launcher.free_base_port(launcher.scaled_ports(1, 1, 2)),
        timeout=90,
        database_template=postgres_template,
        workers=2,
        channels=[ABROAD],
        overrides=TEST_SHUFFLER_SETTINGS,
    )
    try:
        yield {service.name: service for service in services}
    finally:
        launcher.stop(services)


def _loadtest(analyzer: str, var: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``esa loadtest`` with each party's own tokens (``--keys var/keys``): the longitudinal
    channel alone, as fast as it goes."""
    return subprocess.run(
        [
            sys.executable, "-m", "services.cli", "loadtest",
            "--analyzer-url", analyzer, "--trust", str(var / "trust.json"),
            "--keys", str(var / "keys"),
            "--out", str(out), "--no-live", "--drain-timeout", "60",
            "--channel", ABROAD.id, "--devices", str(DEVICES), "--max",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip


def test_loadtest_verifies_a_longitudinal_channel_opened_by_two_workers(
    deployment: dict[str, launcher.Service], tmp_path: Path
) -> None:
    workers = [deployment["analyzer.w1"].url, deployment["analyzer.w2"].url]
    shuffler = [deployment["haproxy:shuffler-1"].url]
    # Each party's own tokens at its URLs (the analyzer's /metrics is open; its workers'
    # URLs are no party's: no token there).
    parties = {"analyzer": deployment["haproxy:analyzer"].url, "shuffler-1": shuffler[0]}
    tokens = Credentials.from_keys(tmp_path / "var" / "keys", parties)
    counted = {url: verify.scrape(url, tokens)[OPENED] for url in workers}
    before = verify.shuffler_state(shuffler, tokens)
    done = _loadtest(deployment["haproxy:analyzer"].url, tmp_path / "var", tmp_path / "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verification: PASS" in done.stdout
    summary = json.loads((tmp_path / "out" / "loadtest.json").read_text())
    run, check = summary["series"][ABROAD.id], summary["verification"]
    totals = check["conservation"]["totals"]
    assert totals["lost"] == 0 and totals["shufflers_acknowledged"] == run["accepted"] > DEVICES
    assert check["problems"] == []
    received = totals["received_at_analyzer"]
    assert check["channels"][ABROAD.id]["received"] == received > 0

    # The ledger, from either worker: every part opened, by whichever worker.
    ledgers = [verify.analyzer_fragments(url, tokens, ABROAD.id) for url in workers]
    assert ledgers[0] == ledgers[1] == {"opened": received, "invalid": 0}
    # Both workers opened parts: each one's own counter holds its share only.
    shares = [int(verify.scrape(url, tokens)[OPENED] - counted[url]) for url in workers]
    assert min(shares) > 0 and max(shares) < received and sum(shares) == received, shares
    # What verification read before the fix (one worker's counter, whichever answered the
    # scrape) leaves the other worker's share unaccounted for: a false FAIL.
    after = verify.shuffler_state(shuffler, tokens)
    for share in shares:
        old = verify.conservation(before, after, run["accepted"], share)
        assert old["lost"] == received - share > 0
        assert verify.conservation_problems(old)
