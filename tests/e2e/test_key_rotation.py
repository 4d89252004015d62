"""Every key rotates while the deployment runs (real processes: an analyzer and two shufflers
started as ``esa up`` starts them, each party with its own tokens): the analyzer's HPKE and
config-signing keys and shuffler-1's HPKE and signing keys are rotated with ``esa keys rotate``
under a running ``esa loadtest`` whose contributions were all sealed to the old keys. The load
test's own verification then finds nothing lost and nothing counted twice (acknowledged =
received at the analyzer + deleted + held), the release certified, and no batch refused:
shuffler-1 made no batch before its new signing key was active (the load test closes the epoch
at its end), and the analyzer verified every part of it with that key, following the succession.
A device whose config predates the rotations, sending to shuffler-1's retired HPKE key, gets
409 ``config_outdated`` and recovers by itself: it fetches the config again, follows both
successions from the keys it pins, moves its pins, and its next report is taken."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.collection import ANALYZER_PARTY, TrustAnchors, shuffler_party
from common.wire import MAX_EPOCH_SECONDS
from encoder_client import Client
from runtime.conservation import LEDGER_CONTRIBUTIONS
from services.cli import launcher
from services.tools.credentials import Credentials
from services.tools.loadtest import verify

from ..support import LOADTEST_PAGES as PAGES
from ..support import Deployment, key_deployment, wait_until

#: A channel only the stale device reports on (epochs of a year: no boundary is crossed).
SEARCH = PAGES.model_copy(update={"id": "search", "epoch_seconds": MAX_EPOCH_SECONDS})
DEVICES = 900


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """``esa up`` with two shufflers, each party with its own tokens under ``var/keys``."""
    with key_deployment(tmp_path_factory.mktemp("rotation"), [PAGES, SEARCH]) as running:
        yield running


def _esa(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _keys(deployment: Deployment, party: str) -> list[dict[str, object]]:
    """``party``'s keys, read with its own admin token."""
    url = deployment.analyzer.url if party == "analyzer" else _url(deployment, party)
    token = (deployment.var / "keys" / party / launcher.ADMIN_TOKEN_FILE).read_text().strip()
    listed = httpx.get(url + "/v1/admin/keys", headers={"Authorization": f"Bearer {token}"})
    assert listed.status_code == 200, listed.text
    keys: list[dict[str, object]] = listed.json()["keys"]
    return keys


def _url(deployment: Deployment, party: str) -> str:
    return next(s.url for s in deployment.shufflers if s.spec.name == party)


def _published(deployment: Deployment, party: str, kind: str) -> str:
    return next(
        str(k["key_id"]) for k in _keys(deployment, party) if k["kind"] == kind and k["published"]
    )


def _loadtest(deployment: Deployment, out: Path) -> subprocess.Popen[str]:
    """``esa loadtest`` on the pages channel, verified with each party's own tokens."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "services.cli", "loadtest",
            "--analyzer-url", deployment.analyzer.url, "--trust", str(deployment.trust_file),
            "--keys", str(deployment.var / "keys"), "--out", str(out), "--no-live",
            "--channel", PAGES.id, "--devices", str(DEVICES), "--rate", "60",
            "--drain-timeout", "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def test_every_key_rotates_under_load_and_a_stale_device_recovers(
    deployment: Deployment, tmp_path: Path
) -> None:
    var, analyzer = deployment.var, deployment.analyzer.url
    shuffler = _url(deployment, "shuffler-1")
    stale = Client(
        analyzer + "/v1/config",
        trust_file=deployment.trust_file,
        state_path=tmp_path / "stale.db",
        background=False,
        weights={"shuffler-1": 1.0},
    )  # its config, and the keys it pins, predate every rotation
    old = {
        (p, k): _published(deployment, p, k)
        for p in ("analyzer", "shuffler-1")
        for k in ("hpke", "signing")
    }

    tokens = Credentials.from_keys(var / "keys", {"shuffler-1": shuffler})
    load = _loadtest(deployment, tmp_path / "out")
    try:
        wait_until(lambda: verify.shuffler_state([shuffler], tokens)[shuffler]["received"] > 0, 90)
        for party in ("analyzer", "shuffler-1"):
            for kind in ("hpke", "signing"):
                where = ("--var", str(var), "--analyzer-url", analyzer)
                assert "new " + kind in _esa("keys", "rotate", party, "--key", kind, *where)
        assert load.poll() is None, "the load ended before the keys were rotated"

        def rotated() -> bool:
            now = {(p, k): _published(deployment, p, k) for p, k in old}
            return all(now[key] != old[key] for key in old)

        wait_until(rotated, timeout=20)  # published while the load runs on
        # shuffler-1 has made no batch yet: every part it sends is signed by its new key.
        ledger = verify.scrape(shuffler, tokens)
        assert load.poll() is None and not any(
            ledger.get(f'{LEDGER_CONTRIBUTIONS}{{state="{state}"}}', 0.0)
            for state in ("in_batches_forwarded", "in_batches_unforwarded", "in_batches_refused")
        ), "shuffler-1 made a batch before its new signing key was active"
        output, _ = load.communicate(timeout=240)
    finally:
        if load.poll() is None:
            load.kill()
    assert load.returncode == 0, output[-4000:]
    assert "verification: PASS" in output, output[-4000:]
    check = json.loads((tmp_path / "out" / "loadtest.json").read_text())["verification"]
    totals = check["conservation"]["totals"]
    assert totals["lost"] == 0 and check["problems"] == []
    assert totals["shufflers_acknowledged"] == DEVICES and totals["pending"] == 0
    assert totals["deleted"].get("refused", 0) == 0  # no batch refused for its signature
    row = check["channels"][PAGES.id]
    assert row["received"] == totals["received_at_analyzer"] > 0
    assert row["central_eps"] is not None and row["central_eps"] < 10, row
    signer = _published(deployment, "shuffler-1", "signing")
    assert signer != old[("shuffler-1", "signing")]
    assert _signers(deployment.analyzer.log_path, "shuffler-1") == {signer}

    listing = _esa("keys", "list", "--var", str(var), "--analyzer-url", analyzer)
    assert listing.count("succession(s)") == 3 and "pending" not in listing

    # The stale device: shuffler-1 retires its old HPKE key early (the overlap would last
    # days); the device's report sealed to it is refused as outdated, and dropped.
    _esa("keys", "retire", "shuffler-1", "--key-id", old[("shuffler-1", "hpke")], "--var", str(var))
    wait_until(lambda: _carries(analyzer, _published(deployment, "shuffler-1", "hpke")), 90)
    stale.histogram(PAGES.id).report(3)
    assert stale.flush() == 0 and stale.state.outbox_size() == 0
    # Its next report fetches the config first, following both successions from its pins.
    stale.histogram(SEARCH.id).report(5)
    assert stale.flush() == 1
    trust = TrustAnchors.load(deployment.trust_file)
    pins = stale.state.pins(trust.roots())
    assert pins[ANALYZER_PARTY] != trust.roots()[ANALYZER_PARTY]
    assert pins[shuffler_party("shuffler-1")] != trust.roots()[shuffler_party("shuffler-1")]
    assert stale._config.analyzer.keys[0].key_id == _published(deployment, "analyzer", "hpke")
    stale.close()


def _carries(analyzer: str, key_id: str) -> bool:
    """Whether the analyzer's config names ``key_id`` as shuffler-1's first HPKE key (it
    fetches descriptors every minute, and at once after a batch fails to verify)."""
    config = httpx.get(analyzer + "/v1/config").json()["config"]
    first = next(d for d in config["shufflers"] if d["descriptor"]["id"] == "shuffler-1")
    return bool(first["descriptor"]["keys"][0]["key_id"] == key_id)


def _signers(log: Path, shuffler_id: str) -> set[str]:
    """The keys (fingerprints) the analyzer verified the parts it stored from ``shuffler_id``
    with, from its log."""
    found = set()
    for line in log.read_text().splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if entry.get("message") == "batch part stored" and entry["shuffler"] == shuffler_id:
            found.add(str(entry["signer"]))
    return found
