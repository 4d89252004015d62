"""``esa loadtest --keys`` verifies a trust domain served by two shuffler replicas on one
PostgreSQL database behind HAProxy (``esa up --replicas 2``), with real processes.

HAProxy hashes on the ``Authorization`` header, so the devices' contributions spread over both
replicas while every scrape with the shuffler's metrics token reaches the same one.
Verification read that replica's per-process counters and reported a false FAIL (it saw only
its share acknowledged); it now reads the trust domain's ledger from the database
(``esa_shuffler_ledger_*`` gauges): the run passes, each replica's ``/metrics`` gives the same
domain-wide totals, conservation holds from either, and the per-process counters of one
replica alone would not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.conservation import DELETION_CAUSES
from services.cli import launcher
from services.tools.credentials import Credentials
from services.tools.loadtest import verify
from tests.support import LOADTEST_PAGES as PAGES
from tests.support import TEST_SHUFFLER_SETTINGS, own_token

#: One epoch's load, timed: beside other workers' load the run could reach the next epoch, where
#: every device contributes again, so the module runs after the parallel run (Makefile).
pytestmark = pytest.mark.serial

DEVICES = 300


def _tokens(var: Path, replicas: list[str]) -> Credentials:
    """shuffler-1's own admin and metrics tokens (``var/keys/shuffler-1``) at each replica."""
    admin, metrics = own_token(var, "shuffler-1"), own_token(var, "shuffler-1", "metrics-token")
    return Credentials({url: admin for url in replicas}, {url: metrics for url in replicas})


def _counted(url: str, tokens: Credentials) -> dict[str, float]:
    """One replica's own counters (``esa_shuffler_*_total``: this process's events since it
    started), shaped as :func:`verify.domain_state`: what verification read before the ledger
    gauges."""
    metrics = verify.scrape(url, tokens)
    deleted = 'esa_shuffler_contributions_deleted_total{{cause="{}"}}'
    return {
        "received": metrics["esa_shuffler_contributions_received_total"],
        **{f"deleted_{c}": metrics[deleted.format(c)] for c in DELETION_CAUSES},
        "deleted_late": 0.0,
    }


@pytest.fixture
def deployment(tmp_path: Path, postgres_template: str) -> Iterator[dict[str, launcher.Service]]:
    """One trust domain (shuffler-1) as two replicas behind HAProxy, one analyzer."""
    services = launcher.up(
        tmp_path / "var",
        1,
        launcher.free_base_port(launcher.scaled_ports(1, 2, 1)),
        timeout=90,
        database_template=postgres_template,
        replicas=2,
        channels=[PAGES],
        overrides=TEST_SHUFFLER_SETTINGS,
    )
    try:
        yield {service.name: service for service in services}
    finally:
        launcher.stop(services)


def test_loadtest_verifies_a_trust_domain_of_two_replicas(
    deployment: dict[str, launcher.Service], tmp_path: Path
) -> None:
    replicas = [deployment["shuffler-1.r1"].url, deployment["shuffler-1.r2"].url]
    tokens = _tokens(tmp_path / "var", replicas)
    before = verify.shuffler_state(replicas, tokens)
    counted = {url: _counted(url, tokens) for url in replicas}
    trust, keys = str(tmp_path / "var" / "trust.json"), str(tmp_path / "var" / "keys")
    done = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "loadtest",
            "--analyzer-url", deployment["haproxy:analyzer"].url, "--trust", trust,
            "--keys", keys, "--out", str(tmp_path / "out"), "--no-live",
            "--drain-timeout", "60", "--channel", "pages", "--devices", str(DEVICES), "--max",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verification: PASS" in done.stdout
    check = json.loads((tmp_path / "out" / "loadtest.json").read_text())["verification"]
    totals = check["conservation"]["totals"]
    assert totals["shufflers_acknowledged"] == DEVICES and totals["lost"] == 0
    assert totals["purged_late"] == 0 and check["problems"] == []
    received = totals["received_at_analyzer"]

    after = verify.shuffler_state(replicas, tokens)
    assert after[replicas[0]] == after[replicas[1]]  # the trust domain's, from either replica
    per_process = {url: _counted(url, tokens) for url in replicas}
    shares = [per_process[url]["received"] - counted[url]["received"] for url in replicas]
    assert min(shares) > 0 and sum(shares) == DEVICES  # spread over both replicas
    for url in replicas:
        one = verify.conservation({url: before[url]}, {url: after[url]}, DEVICES, received)
        assert one["shufflers_acknowledged"] == DEVICES and one["lost"] == 0
        assert verify.conservation_problems(one) == []
        # What verification read before the fix: one replica's counters, its share only.
        old = {url: counted[url] | {q: before[url][q] for q in verify.QUEUES}}
        new = {url: per_process[url] | {q: after[url][q] for q in verify.QUEUES}}
        assert verify.conservation_problems(verify.conservation(old, new, DEVICES, received))
