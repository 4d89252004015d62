"""Batches as a shuffler sends them (wire version 2), for e2e tests that post parts to a real
analyzer themselves: every fragment a real k-RAPPOR report sealed for the analyzer and bound
to the batch's channel, epoch and crowd (:class:`common.envelope.FragmentContext`), as many
as ``n_contributions`` honest devices produce; the part signed with the shuffler's key and
sent with the ``ESA-Shuffler`` header that names it."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from common.envelope import FragmentContext, load_x25519_public, seal_fragment, sign
from common.mechanisms import krappor
from common.preauth import PREAUTH_HEADER, preauth_header
from common.randomness import RandomSource, default_source
from common.wire import ChannelConfig, b64


def analyzer_key(analyzer_url: str) -> X25519PublicKey:
    """The analyzer's HPKE key from its config (the tests that call this forge batches
    with the shufflers' keys; what a device would trust is not what they test)."""
    config = httpx.get(analyzer_url + "/v1/config", timeout=30).raise_for_status().json()
    return load_x25519_public(
        base64.b64decode(config["config"]["analyzer"]["keys"][0]["public_key"])
    )


def krappor_reports(
    values: Iterable[int],
    params: krappor.KRapporParams,
    context: FragmentContext,
    payload_size: int,
    key: X25519PublicKey,
    rng: RandomSource | None = None,
) -> list[tuple[bytes, ...]]:
    """One tuple of sealed fragments per value: what one device's contribution carries."""
    return [
        tuple(
            seal_fragment(f, context, payload_size, key)
            for f in krappor.KRappor().encode_value(params, int(v), rng)
        )
        for v in values
    ]


@dataclass(frozen=True)
class FreshReports:
    """k-RAPPOR reports whose fragments are sealed afresh each time one is taken (the
    analyzer counts a repeated sealed fragment once: a pool of sealed reports reused across
    contributions would be counted as repeats)."""

    reports: list[tuple[bytes, ...]]
    context: FragmentContext
    payload_size: int
    key: X25519PublicKey

    @classmethod
    def of(
        cls, analyzer_url: str, channel: ChannelConfig, epoch: int, values: Iterable[int]
    ) -> FreshReports:
        """Reports of ``values`` (k = 20, ε = 4) for ``channel`` at ``epoch``, default crowd."""
        params = krappor.KRapporParams(k=20, eps=4.0)
        rng, mechanism = default_source(), krappor.KRappor()
        encoded = [tuple(mechanism.encode_value(params, int(v), rng)) for v in values]
        context = FragmentContext(channel.id, epoch, "")
        return cls(encoded, context, channel.payload_size, analyzer_key(analyzer_url))

    def __len__(self) -> int:
        return len(self.reports)

    def __getitem__(self, index: int) -> tuple[bytes, ...]:
        return tuple(
            seal_fragment(f, self.context, self.payload_size, self.key) for f in self.reports[index]
        )


def fragments(reports: Iterable[tuple[bytes, ...]]) -> list[str]:
    """The reports' fragments, base64, as a batch lists them."""
    return [b64(f) for report in reports for f in report]


def post_part(
    analyzer_url: str,
    body: bytes,
    signer: Ed25519PrivateKey,
    shuffler_id: str,
    timeout: float = 30,
) -> httpx.Response:
    """POST one batch part as shuffler ``shuffler_id`` sends it."""
    return httpx.post(
        analyzer_url + "/v1/batches",
        content=body,
        headers={
            "ESA-Signature": b64(sign(body, signer)),
            "ESA-Shuffler": shuffler_id,
            PREAUTH_HEADER: preauth_header(shuffler_id, body, signer, time.time()),
            "Content-Type": "application/json",
        },
        timeout=timeout,
    )
