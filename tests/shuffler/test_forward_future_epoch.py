"""A batch part refused 422 ``future_epoch`` (this shuffler's clock, or an admin close of the
next epoch, ahead of the analyzer's by more than its ``epoch_skew_seconds``) is retried by the
forwarder, not kept for a requeue: it heals once the analyzer's clock reaches the epoch. Other
422s (the part's content) stay permanent. Real analyzer process, real HTTP (shuffler/forwarder.py;
docs/shuffler.md, "Forwarding")."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from common.envelope import FragmentContext, load_or_create_ed25519, load_or_create_x25519, sign
from common.mechanisms import krappor
from common.preauth import preauth_header
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig, b64
from shuffler.forwarder import Outcome, post_part
from shuffler.records import DuePart

from ..e2e.forge import fragments, krappor_reports
from ..support import analyzer_process, registry_entry, wait_until

pytestmark = [pytest.mark.system, pytest.mark.slow]

EPOCH_SECONDS = 2
CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 20, "eps": 4.0},
    min_crowd=50,
    max_fragments=20,
    delta=1e-8,
    payload_size=16,
    epoch_seconds=EPOCH_SECONDS,
)


def _part(key: X25519PublicKey, epoch: int, n: int, signer: Ed25519PrivateKey) -> DuePart:
    """A whole batch of ``n`` real k-RAPPOR contributions for ``epoch``, signed."""
    context = FragmentContext(CHANNEL.id, epoch, "")
    values = np.random.default_rng(epoch).integers(0, 20, size=n)
    params = krappor.KRapporParams(k=20, eps=4.0)
    reports = krappor_reports(values, params, context, 16, key, SeededSource(n))
    body = Batch(
        batch_id=secrets.token_hex(16),
        part=0,
        parts=1,
        shuffler_id="shuffler-1",
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=n,
        fragments=fragments(reports),
    ).body()
    return DuePart(batch_id="b", part=0, body=body, signature=b64(sign(body, signer)), attempts=0)


def test_a_future_epoch_refusal_is_retried_and_heals(tmp_path: Path) -> None:
    signer = load_or_create_ed25519(tmp_path / "s1" / "signing.pem")
    key = load_or_create_x25519(tmp_path / "analyzer" / "keys" / "hpke.pem").public_key()
    registry = [registry_entry("shuffler-1", "http://127.0.0.1:1", signer)]
    analyzer = analyzer_process(
        tmp_path, [CHANNEL.model_dump(mode="json")], registry, epoch_skew_seconds="0"
    ).start()
    url = analyzer.url + "/v1/batches"
    try:
        with httpx.Client(timeout=30) as http:
            epoch = int(time.time() // EPOCH_SECONDS) + 3  # starts 4 to 6 s from now
            part = _part(key, epoch, 50, signer)
            early = post_part(http, url, part, "shuffler-1", _head(part, signer))
            other = _part(key, epoch - 3, 10, signer)
            small = post_part(http, url, other, "shuffler-1", _head(other, signer))
            wait_until(lambda: time.time() >= epoch * EPOCH_SECONDS, 30)
            late = post_part(http, url, part, "shuffler-1", _head(part, signer))
    finally:
        analyzer.stop()
    assert (early.outcome, early.status) == (Outcome.RETRIED, 422), early
    assert "future_epoch" in (early.error or "")
    assert (small.outcome, small.status) == (Outcome.FAILED, 422), small  # below min_crowd
    assert late.outcome is Outcome.FORWARDED, late


def _head(part: DuePart, signer: Ed25519PrivateKey) -> str:
    """The part's ``ESA-Preauth`` head, signed now, as the forwarder sends it."""
    return preauth_header("shuffler-1", part.body, signer, time.time())
