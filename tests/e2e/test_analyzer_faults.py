"""Crash tests of the analyzer's part intake with real processes (issue 11, "Fault tests"),
on SQLite and PostgreSQL.

Parts are forged as a shuffler would send them (signed with a registered shuffler key, named
in the ``ESA-Shuffler`` header, every fragment a real k-RAPPOR report sealed to the batch's
channel, epoch and crowd; one batch per epoch, as one shuffler sends one per group) and
POSTed to an ``esa analyzer serve`` process that is killed: with SIGKILL while parts are
being delivered, and by its own SIGKILL at a failpoint (docs/operations.md, "Failpoints
(testing only)"): after opening a stored part and before folding it in
(``analyzer.fold.after_opening``), and between the commit of a part and its answer
(``analyzer.intake.after_part_committed``). After each restart, every part must count exactly
once: the fragments accumulated equal the fragments sent, and the estimate's n is the sum of
the n_contributions of the complete batches (every one verified by its fragments).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from analyzer.channels import ChannelRuntime
from analyzer.store import AnalyzerStore
from common.envelope import FragmentContext, load_or_create_ed25519, load_or_create_x25519
from common.mechanisms import krappor
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig
from runtime import db, failpoints

from ..support import ServiceProcess, analyzer_process, registry_entry, wait_until
from .forge import fragments, krappor_reports, post_part

CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 20, "eps": 4.0},
    min_crowd=50,
    max_fragments=20,
    delta=1e-8,
    payload_size=16,
)
PARAMS = krappor.KRapporParams(k=20, eps=4.0)
EPOCH = 5


@dataclass
class Analyzer:
    """A running analyzer, its database and the key its shuffler signs parts with."""

    process: ServiceProcess
    database_url: str
    signer: Ed25519PrivateKey
    hpke_public: X25519PublicKey

    def post(self, body: bytes) -> httpx.Response:
        return post_part(self.process.url, body, self.signer, "shuffler-1")

    def arm(self, point: str) -> None:
        """Start with failpoint ``point`` armed: the process SIGKILLs itself on reaching it."""
        self.process.env[failpoints.ENV] = point
        self.process.start()

    def restart(self) -> None:
        """Start again after a crash, with no failpoint armed."""
        self.process.kill()
        self.process.env.pop(failpoints.ENV, None)
        self.process.start()


@pytest.fixture(params=["sqlite", "postgresql"])
def analyzer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Analyzer]:
    url = (
        f"sqlite:///{tmp_path / 'analyzer' / 'db.sqlite'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    signer = load_or_create_ed25519(tmp_path / "s1" / "signing.pem")
    # Registered, its descriptor never fetched (nobody at port 1): batches need only its key.
    registry = [registry_entry("shuffler-1", "http://127.0.0.1:1", signer)]
    analyzer_key = load_or_create_x25519(tmp_path / "analyzer" / "keys" / "hpke.pem")
    process = analyzer_process(
        tmp_path,
        [CHANNEL.model_dump()],
        registry,
        url,
        opening_processes="2",
        opening_chunk="200",
        opening_poll_seconds="0.1",
        # its epochs are long over: a batch delivered across a crash holds its epoch open
        # while its parts keep arriving (within this), so the close never cuts it
        epoch_close_seconds="600",
    )
    running = Analyzer(process, url, signer, analyzer_key.public_key())
    yield running
    running.process.stop()


def _batch(analyzer: Analyzer, n: int, parts: int, seed: int) -> list[bytes]:
    """Epoch ``EPOCH + seed``'s group of ``n`` k-RAPPOR contributions cut into ``parts`` part
    bodies."""
    values = np.random.default_rng(seed).integers(0, 20, size=n)
    context = FragmentContext(CHANNEL.id, EPOCH + seed, "")
    reports = krappor_reports(values, PARAMS, context, 16, analyzer.hpke_public, SeededSource(seed))
    sealed = fragments(reports)
    batch_id, step = secrets.token_hex(16), -(-len(sealed) // parts)
    return [
        Batch(
            batch_id=batch_id,
            part=i,
            parts=parts,
            shuffler_id="shuffler-1",
            channel_id=CHANNEL.id,
            crowd_id="",
            epoch=context.epoch,
            n_contributions=n,
            fragments=sealed[i * step : (i + 1) * step],
        ).body()
        for i in range(parts)
    ]


def _deliver(analyzer: Analyzer, body: bytes) -> int:
    """POST until acknowledged (a shuffler's retry); the status of the acknowledgement."""
    for _ in range(3):
        try:
            response = analyzer.post(body)
        except httpx.TransportError:
            analyzer.restart()
            continue
        assert response.status_code in (200, 201), response.text
        return response.status_code
    raise AssertionError("part never acknowledged")


def _fragments(body: bytes) -> int:
    return len(Batch.model_validate_json(body).fragments)


def _conserved(analyzer: Analyzer, batches: list[list[bytes]]) -> None:
    """Every part counted once: nothing pending, fragments accumulated == fragments sent, n ==
    sum of the groups' n (each batch's verified crowd its claimed one)."""
    headers = [Batch.model_validate_json(parts[0]) for parts in batches]
    epochs = sorted(h.epoch for h in headers)
    store = AnalyzerStore(db.make_engine(analyzer.database_url))
    try:
        wait_until(lambda: not store.pending_parts(), timeout=120)
        runtime = ChannelRuntime.build(CHANNEL, ["shuffler-1"])
        received = store.received(CHANNEL.id, "", epochs[0], epochs[-1])
        loaded = [runtime.mechanism.load_accumulator(s.state) for s in received.states]
        counts = sum(int(a.counts.sum()) for a in loaded)  # type: ignore[attr-defined]
        assert counts == sum(_fragments(b) for parts in batches for b in parts)
        n = sum(h.n_contributions for h in headers)
        for header in headers:  # each batch's verified crowd: a lower bound, never the claim
            (size,) = received.batch_sizes[(header.epoch, "shuffler-1")]
            assert 0 < size <= header.n_contributions
    finally:
        store.engine.dispose()
    span = f"epoch_from={epochs[0]}&epoch_to={epochs[-1]}"
    estimate = httpx.get(f"{analyzer.process.url}/v1/channels/{CHANNEL.id}/estimate?{span}")
    # the certificate rests on the crowd the fragments prove, the estimate on the claims (of
    # the epochs settled so far: the others wait for their close window)
    found = estimate.json()
    if estimate.status_code == 404:  # no epoch settled yet: it waits, nothing is released
        assert found["error"] == "epoch_open", found
        return
    assert estimate.status_code == 200
    assert found["crowd_check"]["verified"] <= found["n"] == found["crowd_check"]["claimed"] <= n
    assert "incomplete" not in estimate.json()["note"]


def test_kill_while_opening_and_while_delivering_counts_every_part_once(
    analyzer: Analyzer,
) -> None:
    analyzer.arm("analyzer.fold.after_opening")
    batches = [_batch(analyzer, 120, 3, seed) for seed in range(3)]
    first = analyzer.process.service
    assert first is not None
    assert analyzer.post(batches[0][0]).status_code == 201
    wait_until(lambda: first.process.poll() is not None, timeout=60)
    analyzer.restart()
    assert analyzer.post(batches[0][0]).status_code == 200
    sent = [body for parts in batches for body in parts][1:]
    for index, body in enumerate(sent):
        if index == len(sent) // 2:
            analyzer.process.kill()
        _deliver(analyzer, body)
    _conserved(analyzer, batches)


def test_crash_between_commit_and_answer_counts_the_part_once(analyzer: Analyzer) -> None:
    analyzer.arm("analyzer.intake.after_part_committed")
    batches = [_batch(analyzer, 100, 2, seed) for seed in (7, 8)]
    with pytest.raises(httpx.TransportError):
        analyzer.post(batches[0][0])
    analyzer.restart()
    assert analyzer.post(batches[0][0]).status_code == 200
    assert [_deliver(analyzer, b) for b in [batches[0][1], *batches[1]]] == [201, 201, 201]
    _conserved(analyzer, batches)
