"""The auditor's canary devices: ordinary clients of the audited shuffler whose fragments are
sealed to the auditor's own HPKE key (:func:`common.envelope.seal_fragment`), so that the
auditor, and nobody else, can open them in the batches the shuffler releases.

The shuffler cannot open a fragment (docs/protocol.md, "Sealing"): it sees only the key id a
fragment names, the same for every fragment of the canary-only audit channel, so canaries are
indistinguishable from devices except through what they carry.
Each canary fragment carries a marker: the run tag, the contribution's send sequence number,
the fragment's index and count, the crowd index and a one-bit report for the privacy game
(14 bytes, padded to the channel's ``payload_size`` like every fragment); in the privacy game of
a channel's mechanism (:mod:`~services.tools.audit.mechgame`), followed by the mechanism
fragment a device would send.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from common.envelope import (
    Contribution,
    EnvelopeError,
    FragmentContext,
    KeyRing,
    load_x25519_public,
    new_nonce,
    open_fragment,
    seal_contribution,
    seal_fragment,
)
from common.wire import ShufflerConfig, unb64

MARKER = struct.Struct(">2s4sIBBBB")
MARKER_MAGIC = b"AU"
#: Smallest payload size a marker fits (its bytes and the 2-byte length prefix).
MIN_PAYLOAD = MARKER.size + 2
CONTRIBUTION_TYPE = "application/octet-stream"


def retry_after(response: httpx.Response) -> float:
    """A 429's ``Retry-After`` in seconds, within [0.1, 60]; 1 when it is not a number (the
    audited shuffler is another party's: its header is not trusted to be sane)."""
    try:
        seconds = float(response.headers.get("retry-after", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.1), 60.0) if seconds == seconds else 1.0


@dataclass(frozen=True, slots=True)
class Marker:
    """What one canary fragment says about itself."""

    run: bytes
    seq: int
    index: int
    count: int
    crowd: int
    report: int = 0
    payload: bytes = b""

    def encode(self) -> bytes:
        marker = MARKER.pack(
            MARKER_MAGIC, self.run, self.seq, self.index, self.count, self.crowd, self.report
        )
        return marker + self.payload

    @classmethod
    def decode(cls, data: bytes) -> Marker | None:
        """The marker in an opened fragment (with the mechanism fragment after it, if any),
        or None if it is not one."""
        if len(data) < MARKER.size:
            return None
        magic, run, seq, index, count, crowd, report = MARKER.unpack(data[: MARKER.size])
        if magic != MARKER_MAGIC:
            return None
        return cls(run, seq, index, count, crowd, report, data[MARKER.size :])


@dataclass
class CanaryKey:
    """The auditor's HPKE key for canary fragments (the audit channel's "analyzer" key)."""

    private: X25519PrivateKey
    run: bytes

    @classmethod
    def fresh(cls) -> CanaryKey:
        """A new key and run tag for one audit run."""
        return cls(X25519PrivateKey.generate(), os.urandom(4))

    @property
    def public(self) -> X25519PublicKey:
        return self.private.public_key()

    def read(self, blob: bytes, context: FragmentContext) -> Marker | None:
        """The marker of one of this run's canary fragments sealed for ``context`` (the batch's
        channel, epoch and crowd), or None for any other fragment."""
        try:
            marker = Marker.decode(open_fragment(blob, context, KeyRing.of(self.private)))
        except EnvelopeError:
            return None
        return marker if marker is not None and marker.run == self.run else None


@dataclass(frozen=True, slots=True)
class Sent:
    """One canary contribution as sent: its sequence number, crowd, epoch and fragment count,
    with the blob and token kept for the intake probes."""

    seq: int
    crowd: int
    crowd_id: str
    epoch: int
    fragments: int
    sent_at: float
    blob: bytes
    token: str


class CanaryFleet:
    """Canary devices of one run talking to one shuffler: each contribution from a freshly
    enrolled client, as a real device with one report per epoch would."""

    def __init__(
        self, client: httpx.Client, url: str, config: ShufflerConfig, key: CanaryKey
    ) -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.config = config
        self.key = key
        self.shuffler_key = load_x25519_public(unb64(config.public_key))

    def enroll(self) -> str:
        """A new client token (waits out a 429's ``Retry-After``)."""
        for _ in range(100):
            response = self.client.post(self.url + "/v1/enroll")
            if response.status_code == 429:
                time.sleep(retry_after(response))
                continue
            response.raise_for_status()
            return str(response.json()["client_token"])
        raise RuntimeError("the shuffler kept refusing enrolment (429)")

    def seal(
        self, channel_id: str, payload_size: int, crowd_id: str, epoch: int, markers: list[Marker]
    ) -> bytes:
        """A contribution of ``markers`` sealed for the shuffler (fragments for the auditor)."""
        context = FragmentContext(channel_id, epoch, crowd_id)
        fragments = tuple(
            seal_fragment(m.encode(), context, payload_size, self.key.public) for m in markers
        )
        contribution = Contribution(
            channel_id=channel_id,
            crowd_id=crowd_id,
            epoch=epoch,
            nonce=new_nonce(),
            fragments=fragments,
        )
        return seal_contribution(contribution, self.config.id, self.shuffler_key)

    def post(self, blob: bytes, token: str) -> httpx.Response:
        """POST one sealed contribution with ``token`` (retries a 429 after its wait)."""
        headers = {"Authorization": f"Bearer {token}", "Content-Type": CONTRIBUTION_TYPE}
        for _ in range(50):
            response = self.client.post(
                self.url + "/v1/contributions", content=blob, headers=headers
            )
            if response.status_code != 429:
                return response
            time.sleep(retry_after(response))
        return response

    def send(
        self,
        seq: int,
        channel_id: str,
        payload_size: int,
        crowd: tuple[int, str],
        epoch: int,
        fragments: int,
        report: int = 0,
        payloads: Sequence[bytes] | None = None,
    ) -> Sent:
        """Enroll one canary and send its contribution of ``fragments`` marked fragments, each
        carrying the one-bit ``report`` — or, with ``payloads``, one marked fragment per
        mechanism fragment, carrying it.

        Raises:
            RuntimeError: the shuffler did not acknowledge it (202).
        """
        carried = [b""] * fragments if payloads is None else list(payloads)
        fragments = len(carried)
        markers = [
            Marker(
                run=self.key.run,
                seq=seq,
                index=i,
                count=fragments,
                crowd=crowd[0],
                report=report,
                payload=payload,
            )
            for i, payload in enumerate(carried)
        ]
        blob = self.seal(channel_id, payload_size, crowd[1], epoch, markers)
        token = self.enroll()
        sent_at = time.time()
        response = self.post(blob, token)
        if response.status_code != 202:
            raise RuntimeError(
                f"canary {seq} refused: HTTP {response.status_code} {response.text[:200]}"
            )
        return Sent(
            seq=seq,
            crowd=crowd[0],
            crowd_id=crowd[1],
            epoch=epoch,
            fragments=fragments,
            sent_at=sent_at,
            blob=blob,
            token=token,
        )
