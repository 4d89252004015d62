"""Issue 17 item 4: ``esa audit``'s order and metadata checks still pass against a replicated
shuffler trust domain.

One trust domain, ``shuffler-1``, as ``esa up --replicas 2 --database-url-template`` starts it
(:func:`services.cli.launcher.up`): two replica processes on one PostgreSQL database behind
HAProxy, forwarding to an ``esa audit sink`` instead of the analyzer (the sink keeps the audit
channel's parts and relays the rest, and the analyzer's signed config, to the analyzer, as
docs/audit.md stages an audit). The audit (:func:`services.tools.audit.runner.run_audit`)
runs against the HAProxy URL: HAProxy hashes each canary's token, so the canaries land on both
replicas; the admin close reaches one replica and the other learns it from the database; the
groups are dealt by whichever replica takes their advisory lock first, and either may forward
their parts.

Every order and metadata finding must pass: positions independent of send order across both
replicas' intake (3 statistical checks at p < 1e-7 each), and every part with the documented
fields and headers, one fragment size, a valid signature of the trust domain's one key, and no
fragment twice (a group dealt by both replicas would repeat its fragments). From the same run,
the public surface (unauthenticated probes carry no token to hash on, so HAProxy spreads them
over both replicas: their answers must not differ), the crowd threshold, release at close and
the intake refusals must pass too, and randomized deletion (2 statistical checks). Wrongly
failing: below 5 × 1e-7 < 1e-6 (Bonferroni).

``intake.revoked_token`` included: the auditor revokes at the replica its admin token hashes to
and at once sends with the revoked token, which hashes to either replica; the other replica has
not reloaded its revocations yet, and refuses it because the insert reads the shared
``revoked`` table (:func:`shuffler.store_backends._checks_among`). Before that, about half the
runs saw the contribution accepted, one more in the first canary group than the auditor counts.
The arrival-pattern timing and privacy-game findings are covered on one process by
``tests/tools/test_audit.py``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common.wire import ChannelConfig
from runtime import haproxy
from services.cli import launcher
from services.tools.audit.runner import AuditConfig, run_audit
from tests.support import TEST_SHUFFLER_SETTINGS, own_headers, own_token
from tests.tools.test_audit import CHANNEL, FAST, GROUP_SIZE, TOKEN, audit_sink

REPLICAS = 2
#: The audit channel of test_audit (7 declared crowds, min_crowd 5), as ``esa up`` writes it,
#: with room for honest k-RAPPOR reports (the analyzer refuses a max_fragments that would
#: refuse them; the canaries carry fewer).
AUDIT_CHANNEL = ChannelConfig(
    mechanism="krappor", params={"k": 20, "eps": 4.0}, **{**CHANNEL, "max_fragments": 8}
)
#: Checks every replicated run must pass (``check`` of :class:`~checks.Finding`).
ASSERTED = ("order", "metadata", "surface", "crowd", "intake", "deletion")


@dataclass
class Audited:
    """The replicated deployment by service name, and the sink its shuffler-1 forwards to."""

    services: dict[str, launcher.Service]
    sink: str


@pytest.fixture
def replicated(tmp_path: Path, postgres_template: str) -> Iterator[Audited]:
    """``shuffler-1`` as 2 replicas on one PostgreSQL behind HAProxy, forwarding to an audit
    sink that relays to the deployment's analyzer every channel but the audit channel, and the
    analyzer's signed config (as docs/audit.md stages an audit: the replicas keep following
    their analyzer)."""
    try:
        haproxy.binary()
    except haproxy.HaproxyError as error:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(error))
        pytest.skip(str(error))
    base = launcher.free_base_port(launcher.scaled_ports(1, REPLICAS, 1))
    relay = ("--relay", f"http://127.0.0.1:{base}", "--keep-channel", AUDIT_CHANNEL.id)
    (tmp_path / "sink").mkdir()
    with audit_sink(tmp_path / "sink", *relay) as sink:
        overrides = {
            **TEST_SHUFFLER_SETTINGS,
            **{f"ESA_SHUFFLER_{k.upper()}": v for k, v in FAST.items()},
            "ESA_SHUFFLER_ANALYZER_URL": sink,
        }
        services = launcher.up(
            tmp_path / "var",
            1,
            base,
            timeout=90,
            database_template=postgres_template,
            replicas=REPLICAS,
            channels=[AUDIT_CHANNEL],
            overrides=overrides,
        )
        try:
            by_name = {service.name: service for service in services}
            assert {f"shuffler-1.r{i}" for i in range(1, REPLICAS + 1)} <= set(by_name)
            yield Audited(by_name, sink)
        finally:
            launcher.stop(services)


def test_order_and_metadata_checks_pass_against_two_replicas_behind_haproxy(
    replicated: Audited, tmp_path: Path
) -> None:
    var = tmp_path / "var"
    config = AuditConfig(
        shuffler_url=replicated.services["haproxy:shuffler-1"].url,
        sink_url=replicated.sink,
        sink_token=TOKEN,
        channel_id=AUDIT_CHANNEL.id,
        admin_token=own_token(var, "shuffler-1"),  # the trust domain's own
        skew_seconds=0.2,  # sink and auditor share this machine's clock
        group_size=GROUP_SIZE,  # every full group released but with probability ~2e-9
    )
    result = run_audit(config)
    verdicts = {f"{f.check}.{f.name}": f for f in result.findings}
    failed = {
        name: finding.detail
        for name, finding in verdicts.items()
        if finding.check in ASSERTED and not finding.passed
    }
    assert failed == {}
    assert "intake.revoked_token" in verdicts and any(n.startswith("deletion.") for n in verdicts)
    assert verdicts["timing.release_at_close"].passed, verdicts["timing.release_at_close"].detail
    assert len([n for n in verdicts if n.startswith("order.")]) == 3
    assert len([n for n in verdicts if n.startswith("metadata.")]) == 6
    # every full canary group was released once: 6 batches (the small group withheld)
    assert result.summary["batches"] == len(AUDIT_CHANNEL.crowds) - 1
    # HAProxy spread the canaries over both replicas (each token hashed on its own).
    for replica in range(1, REPLICAS + 1):
        assert _received(replicated.services[f"shuffler-1.r{replica}"].url, var) > 0, replica


def _received(url: str, var: Path) -> float:
    """A replica's ``esa_shuffler_contributions_received`` (its own process's counter), read
    with its trust domain's own metrics token."""
    headers = own_headers(var, "shuffler-1", launcher.METRICS_TOKEN_FILE)
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    found = re.search(r"^esa_shuffler_contributions_received_total (\S+)$", text, re.MULTILINE)
    assert found is not None, text[:500]
    return float(found.group(1))
