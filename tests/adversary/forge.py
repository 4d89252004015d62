"""What an adversary holds and does in these tests: a party's real keys (read from its key
folder, as its operator could), real encodings of real values, signed batch parts, HTTP.

A malicious shuffler signs whatever it likes with its own signing key; it cannot sign as
another shuffler, and it cannot open fragments (sealed to the analyzer). A malicious analyzer
signs whatever config it likes with its own config-signing key; it cannot sign a shuffler's
descriptor.
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from common.collection import verify_collection
from common.envelope import (
    FragmentContext,
    inner_size,
    load_or_create_ed25519,
    load_x25519_public,
    seal_fragment,
    sign,
)
from common.mechanisms import SeededSource, get
from common.preauth import PREAUTH_HEADER, preauth_header
from common.wire import Batch, ChannelConfig, b64

from ..support import Deployment, unopened_parts, wait_until


@dataclass
class MaliciousShuffler:
    """Shuffler ``shuffler_id`` of a deployment, run by an operator who lies to the analyzer:
    its real signing key, the analyzer's public HPKE key, and the channels' configs."""

    deployment: Deployment
    shuffler_id: str = "shuffler-1"

    def __post_init__(self) -> None:
        keys = self.deployment.var / "keys" / self.shuffler_id
        self.signer: Ed25519PrivateKey = load_or_create_ed25519(keys / "signing.pem")
        document = httpx.get(self.url + "/v1/config", timeout=10).json()
        self.config = verify_collection(document, self.deployment.trust(), time.time())
        analyzer = self.config.analyzer.keys[0].public_key
        self.analyzer_key: X25519PublicKey = load_x25519_public(base64.b64decode(analyzer))
        self.rng = SeededSource(7)

    @property
    def url(self) -> str:
        """The analyzer's URL."""
        return self.deployment.analyzer.url

    def channel(self, channel_id: str) -> ChannelConfig:
        found = self.config.channel(channel_id)
        assert found is not None, channel_id
        return found

    def fragments(
        self, channel_id: str, epoch: int, values: list[int], crowd: str = ""
    ) -> list[str]:
        """Honest fragments: each value encoded by the channel's mechanism as a device does,
        every fragment sealed to the analyzer for (channel, ``epoch``, ``crowd``)."""
        config = self.channel(channel_id)
        mechanism = get(config.mechanism)
        params = mechanism.parse_params(config.params)
        context = FragmentContext(channel_id, epoch, crowd)
        sealed = []
        for value in values:
            encoded = mechanism.encode(params, value, None, self.rng, 3)
            for _, fragments in encoded.routes:
                sealed += [
                    b64(seal_fragment(f, context, config.payload_size, self.analyzer_key))
                    for f in fragments
                ]
        return sealed

    def chaff(self, channel_id: str, count: int) -> list[str]:
        """Fragments of the right size that open for nobody."""
        size = inner_size(self.channel(channel_id).payload_size)
        return [b64(os.urandom(size)) for _ in range(count)]

    def post(
        self,
        channel_id: str,
        epoch: int,
        n: int,
        fragments: list[str],
        *,
        batch_id: str | None = None,
        part: int = 0,
        parts: int = 1,
        crowd: str = "",
    ) -> httpx.Response:
        """One signed part, sent as this shuffler's forwarder sends it."""
        batch = Batch(
            batch_id=batch_id or secrets.token_hex(16),
            part=part,
            parts=parts,
            shuffler_id=self.shuffler_id,
            channel_id=channel_id,
            crowd_id=crowd,
            epoch=epoch,
            n_contributions=n,
            fragments=fragments,
        )
        body = batch.body()
        headers = {
            "ESA-Shuffler": self.shuffler_id,
            "ESA-Signature": b64(sign(body, self.signer)),
            PREAUTH_HEADER: preauth_header(self.shuffler_id, body, self.signer, time.time()),
            "Content-Type": "application/json",
        }
        return httpx.post(self.url + "/v1/batches", content=body, headers=headers, timeout=60)

    def release(self, channel_id: str, epoch: int, settle: bool = True) -> httpx.Response:
        """The analyzer's release of ``epoch``, once every stored part is opened and (with
        ``settle``) the epoch is no longer waiting for shufflers that sent nothing (the test
        deployment closes an epoch long over at once)."""
        wait_until(lambda: unopened_parts(self.url) == 0, timeout=60)
        url = f"{self.url}/v1/channels/{channel_id}/estimate"
        if settle:
            wait_until(lambda: not _open(httpx.get(url, params={"epoch": epoch}, timeout=30)))
        return httpx.get(url, params={"epoch": epoch}, timeout=30)


def _open(response: httpx.Response) -> bool:
    """The answer says the epoch still waits for some shuffler's batch."""
    return response.status_code == 404 and response.json().get("error") == "epoch_open"


def certified(release: dict[str, Any]) -> str:
    """One line a reader can check: the certificate and the crowds behind it."""
    cert, check = release["certificate"], release.get("crowd_check") or {}
    return (
        f"certified ε={cert['eps']:.4g} (δ={cert['delta']:g}, {cert['method']}, "
        f"{cert['neighbouring']}) at crowd {check.get('verified')} verified of "
        f"{check.get('claimed')} claimed, {check.get('invalid_fragments')} invalid fragments"
    )
