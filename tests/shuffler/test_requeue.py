"""Nothing stuck: a batch the analyzer refused a part of is set aside (ledger state
``in_batches_refused``) until its shuffler's admin requeues it, over real processes.

A real shuffler forwards to a real analyzer whose channel config differs from the shuffler's
(its ``min_crowd`` is above any batch of this test): every part is refused for real (422
``below_min_crowd``) and never re-sent on its own. ``POST /v1/admin/requeue`` needs the admin
token; a requeue while the cause persists is refused again and stays set aside. Once the
analyzer runs with the shuffler's config, ``POST /v1/admin/requeue {batch_id}`` sends one batch
and ``esa admin requeue`` (a subprocess) every other one; the analyzer stores and opens every
fragment, and the shuffler's ledger accounts for every contribution throughout.

The contributions are what a device sends: enrolled tokens, one k-RR report each, its fragment
sealed to the analyzer key of the collection config verified with pinned keys (bound to channel,
epoch and crowd), inside a contribution sealed to the key the shuffler's own descriptor vouches
for."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, select

from common.collection import TrustAnchors, VerifiedConfig, verify_collection
from common.envelope import (
    Contribution,
    FragmentContext,
    load_or_create_ed25519,
    load_x25519_public,
    new_nonce,
    seal_contribution,
    seal_fragment,
)
from common.mechanisms import krr
from common.randomness import default_source
from common.wire import MAX_EPOCH_SECONDS, Batch, ChannelConfig
from services.cli import launcher
from shuffler import tables

from ..support import (
    ADMIN_HEADERS,
    ServiceProcess,
    analyzer_process,
    registry_entry,
    shuffler_process,
    unopened_parts,
    wait_until,
)

pytestmark = pytest.mark.system  # starts real processes

ROOT = Path(__file__).resolve().parents[2]
#: k-RR, exactly one fragment per contribution; one epoch for the whole test; two crowds, so
#: two groups (two batches) in that epoch.
CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krr",
    params={"k": 4, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=5,
    eps_cr=1.0,
    delta_cr=1e-6,
    min_fragments=1,
    max_fragments=1,
    crowds=("", "eu"),
    delta=1e-8,
)
#: The analyzer's differing config: no batch here reaches its min_crowd.
STRICT = CHANNEL.model_copy(update={"min_crowd": 10_000})
#: Contributions per crowd: Algorithm 3 keeps n - c + Laplace(2/ε_cr), c = (2/ε_cr) ln(2/δ_cr)
#: ≈ 29 here, so 80 keep ~51 and a group falls below min_crowd (5) with probability ~1e-10
#: (at 40 it was ~2.5% per group: the test then found one batch instead of two).
PER_CROWD = 80
LEDGER = re.compile(r'^esa_shuffler_ledger_contributions\{state="([a-z_0-9]+)"\} (\S+)$', re.M)


@dataclass
class Setup:
    tmp: Path
    shuffler: ServiceProcess
    analyzer: ServiceProcess

    def ledger(self) -> dict[str, float]:
        text = httpx.get(self.shuffler.url + "/metrics", headers=ADMIN_HEADERS, timeout=10).text
        return {state: float(value) for state, value in LEDGER.findall(text)}

    def counter(self, name: str) -> float:
        text = httpx.get(self.shuffler.url + "/metrics", headers=ADMIN_HEADERS, timeout=10).text
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        assert found is not None, name
        return float(found.group(1))

    def batches(self) -> dict[str, tuple[str, int, int]]:
        """The shuffler's batches by crowd: (batch id, contributions, parts), from its database
        (part 0's signed body names the crowd)."""
        engine = create_engine(f"sqlite:///{self.tmp / 'shuffler-1' / 'db.sqlite'}")
        b, p = tables.batches.c, tables.part_bodies.c
        with engine.connect() as conn:
            rows = conn.execute(
                select(b.batch_id, b.n_contributions, b.parts, p.body)
                .join(tables.part_bodies, p.batch_id == b.batch_id)
                .where(p.part == 0)
            ).all()
        engine.dispose()
        return {
            Batch.model_validate_json(body).crowd_id: (str(batch_id), int(n), int(parts))
            for batch_id, n, parts, body in rows
        }

    def requeue(self, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            self.shuffler.url + "/v1/admin/requeue",
            json=body,
            headers=ADMIN_HEADERS if headers is None else headers,
            timeout=120,
        )


def _channels(channel: ChannelConfig) -> str:
    return json.dumps([channel.model_dump(mode="json")])


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    signer = load_or_create_ed25519(tmp_path / "shuffler-1" / "keys" / "signing.pem")
    shuffler = shuffler_process(
        tmp_path, "shuffler-1", [CHANNEL.policy().model_dump(mode="json")], part_fragments="8"
    )
    analyzer = analyzer_process(
        tmp_path,
        [STRICT.model_dump(mode="json")],
        [registry_entry("shuffler-1", shuffler.url, signer)],
        opening_processes="1",
    )
    shuffler.env["ESA_SHUFFLER_ANALYZER_URL"] = analyzer.url
    shuffler.start()
    try:
        analyzer.start()
        assert analyzer.service is not None
        launcher.wait_config(analyzer.service, 60)
        yield Setup(tmp_path, shuffler, analyzer)
    finally:
        analyzer.stop()
        shuffler.stop()


def _verified(setup: Setup) -> VerifiedConfig:
    """The collection config as a device takes it: verified with the pinned keys."""
    keys = setup.tmp / "analyzer" / "keys"
    trust = TrustAnchors(
        load_or_create_ed25519(keys / "signing.pem").public_key(),
        {
            "shuffler-1": load_or_create_ed25519(
                setup.tmp / "shuffler-1" / "keys" / "signing.pem"
            ).public_key()
        },
    )
    document = httpx.get(setup.analyzer.url + "/v1/config", timeout=10).json()
    return verify_collection(document, trust, time.time())


def _contribute(setup: Setup, config: VerifiedConfig, crowd: str, epoch: int) -> None:
    shuffler = config.shufflers[0]
    assert shuffler.url == setup.shuffler.url  # the URL the shuffler vouches for
    outer = load_x25519_public(base64.b64decode(shuffler.public_key))
    inner = load_x25519_public(base64.b64decode(config.analyzer.keys[0].public_key))
    params = krr.KRRParams(**CHANNEL.params)
    context = FragmentContext(CHANNEL.id, epoch, crowd)
    with httpx.Client(base_url=setup.shuffler.url, timeout=30) as client:
        for value in range(PER_CROWD):
            token = client.post("/v1/enroll").raise_for_status().json()["client_token"]
            fragments = tuple(
                seal_fragment(f, context, CHANNEL.payload_size, inner)
                for f in krr.KRR().encode_value(params, value % 4, default_source())
            )
            blob = seal_contribution(
                Contribution(
                    channel_id=CHANNEL.id,
                    crowd_id=crowd,
                    epoch=epoch,
                    nonce=new_nonce(),
                    fragments=fragments,
                ),
                shuffler.id,
                outer,
            )
            sent = client.post(
                "/v1/contributions",
                content=blob,
                headers={
                    "Authorization": f"Bearer {token}",
                    "Content-Type": "application/octet-stream",
                },
            )
            assert sent.status_code == 202, sent.text


def _esa_admin_requeue(setup: Setup, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "admin", "requeue", "--url", setup.shuffler.url,
         *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_refused_batches_wait_for_an_admin_requeue_and_are_then_delivered(setup: Setup) -> None:
    config = _verified(setup)
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    for crowd in CHANNEL.crowds:
        _contribute(setup, config, crowd, epoch)
    acknowledged = PER_CROWD * len(CHANNEL.crowds)

    # The close releases both groups and forwards them at once: the analyzer refuses every part.
    closed = httpx.post(
        setup.shuffler.url + "/v1/admin/close",
        json={"channel_id": CHANNEL.id, "epoch": epoch},
        headers=ADMIN_HEADERS,
        timeout=120,
    )
    assert closed.status_code == 200, closed.text
    batches = setup.batches()
    assert set(batches) == set(CHANNEL.crowds)
    kept = sum(n for _, n, _ in batches.values())
    parts = sum(p for _, _, p in batches.values())
    assert min(p for _, _, p in batches.values()) >= 2, batches
    answer = closed.json()  # the close's own forwarding round (the background one runs too)
    assert answer["groups_evaluated"] == 2 and answer["forwarded"] == 0
    assert 0 < answer["failed"] <= parts
    failed = "esa_shuffler_batches_failed_total"
    wait_until(lambda: setup.counter(failed) == parts, timeout=30)
    refused = setup.ledger()
    assert refused["in_batches_refused"] == kept > 0
    assert refused["in_batches_unforwarded"] == refused["in_batches_forwarded"] == 0
    assert sum(refused.values()) == acknowledged
    assert "below_min_crowd" in setup.shuffler.log_path.read_text()
    time.sleep(1.0)  # several forwarding rounds (0.2 s): a refused part is never re-sent alone
    assert setup.counter(failed) == parts

    # The admin token is required, checked before the body.
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refusal = setup.requeue({}, headers)
        assert refusal.status_code == 401 and refusal.json()["error"] == "bad_admin_token"
        assert setup.requeue({"batch_id": "nope"}, headers).status_code == 401
    bodies: list[dict[str, object]] = [{"batch_id": "nope"}, {"batch_id": "A" * 32}, {"x": 1}]
    for body in bodies:
        invalid = setup.requeue(body)
        assert invalid.status_code == 400 and invalid.json()["error"] == "invalid_request", body
    assert setup.requeue({"batch_id": "0" * 32}).json() == {"requeued": 0}
    assert setup.ledger()["in_batches_refused"] == kept  # nothing was requeued

    # Requeued while the analyzer still refuses: sent at once, refused again, set aside again.
    assert setup.requeue({}).json() == {"requeued": parts}
    wait_until(lambda: setup.counter(failed) == 2 * parts, timeout=30)
    assert setup.ledger()["in_batches_refused"] == kept
    time.sleep(1.0)
    assert setup.counter(failed) == 2 * parts

    # The operator fixes the analyzer's config; one batch by id, then the rest by the CLI.
    setup.analyzer.stop()
    setup.analyzer.env["ESA_ANALYZER_CHANNELS"] = _channels(CHANNEL)
    setup.analyzer.start()
    assert setup.analyzer.service is not None
    launcher.wait_config(setup.analyzer.service, 60)
    first_id, first_n, first_parts = batches[""]
    assert setup.requeue({"batch_id": first_id}).json() == {"requeued": first_parts}
    wait_until(lambda: setup.ledger()["in_batches_forwarded"] == first_n, timeout=30)
    assert setup.ledger()["in_batches_refused"] == kept - first_n  # the other one waits

    wrong = _esa_admin_requeue(setup, "--admin-token", "wrong")
    assert wrong.returncode == 1 and "answered HTTP 401" in wrong.stderr, wrong.stderr
    done = _esa_admin_requeue(setup, "--admin-token", "development")
    assert done.returncode == 0, done.stderr
    other = batches["eu"][2]
    assert done.stdout.strip() == f"{setup.shuffler.url}: {other} part(s) requeued"
    wait_until(lambda: setup.ledger()["in_batches_forwarded"] == kept, timeout=30)
    delivered = setup.ledger()
    assert delivered["in_batches_refused"] == delivered["in_batches_unforwarded"] == 0
    assert sum(delivered.values()) == acknowledged
    again = _esa_admin_requeue(setup, "--admin-token", "development", "--batch", first_id)
    assert again.stdout.strip() == f"{setup.shuffler.url}: 0 part(s) requeued of batch {first_id}"

    # The analyzer stored every part and opened every fragment (one per kept contribution).
    wait_until(lambda: unopened_parts(setup.analyzer.url) == 0, timeout=60)
    metrics = httpx.get(setup.analyzer.url + "/metrics", timeout=10).text
    opened = re.search(
        r'^esa_analyzer_ledger_fragments\{(?=[^}]*channel="homepage")(?=[^}]*state="opened")'
        r"[^}]*\} (\S+)$",
        metrics,
        re.M,
    )
    assert opened is not None and float(opened.group(1)) == kept, metrics[-3000:]
