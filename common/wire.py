"""Pydantic models of everything that crosses HTTP (PROTOCOL.md, "HTTP endpoints").

Bytes travel as standard base64 strings inside JSON. Batches are signed over their exact body
bytes, so :meth:`Batch.body` is the one serialization both sides use.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IDENTIFIER = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def b64(data: bytes) -> str:
    """Standard base64 text."""
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    """Strict base64 decoding.

    Raises:
        ValueError: if ``text`` is not valid base64.
    """
    return base64.b64decode(text, validate=True)


def _identifier(value: str, what: str) -> str:
    if not IDENTIFIER.match(value):
        raise ValueError(f"{what} must match {IDENTIFIER.pattern}, got {value!r}")
    return value


class ErrorBody(BaseModel):
    """Every error response: a machine-readable code and a human-readable detail."""

    error: str
    detail: str


class Receipt(BaseModel):
    """202 body: an opaque receipt for the stored contribution."""

    receipt: str


class EnrollResponse(BaseModel):
    """A bearer client token: ``client id . HMAC`` (verifiable without a lookup)."""

    client_token: str


class ChannelPolicy(BaseModel):
    """What a shuffler needs to know about a channel (ESA-revisited §V, Algorithm 3).

    Attributes:
        id: Channel id (lower-case identifier).
        epoch_seconds: Epoch length; a client's epoch is ``floor(unix time / epoch_seconds)``.
        min_crowd: Batches below this many contributions are never released.
        eps_cr, delta_cr: Randomized report deletion parameters (Theorem V.1).
        max_fragments: Most fragments one contribution may carry.
        max_batch: Contributions per batch before a group is evaluated early.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    epoch_seconds: int = Field(3600, ge=1)
    min_crowd: int = Field(100, ge=1)
    eps_cr: float = Field(0.5, gt=0)
    delta_cr: float = Field(1e-9, gt=0, lt=1)
    max_fragments: int = Field(64, ge=1, le=65535)
    max_batch: int = Field(1_000_000, ge=1)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return _identifier(value, "channel id")

    @model_validator(mode="after")
    def _check_batch(self) -> ChannelPolicy:
        if self.max_batch < self.min_crowd:
            raise ValueError(f"max_batch={self.max_batch} must be >= min_crowd={self.min_crowd}")
        return self


class ChannelConfig(ChannelPolicy):
    """A channel as the analyzer configures it and clients fetch it.

    Attributes:
        mechanism: One of ``krappor, rfrag, longitudinal, zsum, krr``.
        params: The mechanism's parameters (validated by the mechanism module).
        delta: δ for certifying releases.
        payload_size: Padded inner plaintext size (all fragments of the channel).
    """

    mechanism: Literal["krappor", "rfrag", "longitudinal", "zsum", "krr"]
    params: dict[str, Any]
    delta: float = Field(1e-9, gt=0, lt=1)
    payload_size: int = Field(16, ge=8, le=1024)
    display: Literal["histogram", "image", "series"] = "histogram"
    image_shape: tuple[int, int] | None = None
    title: str = ""

    def policy(self) -> ChannelPolicy:
        """The part shufflers enforce."""
        return ChannelPolicy(**{k: getattr(self, k) for k in ChannelPolicy.model_fields})


class ShufflerInfo(BaseModel):
    """A shuffler's public identity (its ``GET /v1/config`` and the registry entry)."""

    model_config = ConfigDict(frozen=True)

    id: str
    url: str
    public_key: str
    key_id: str
    signing_key: str

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return _identifier(value, "shuffler id")


class Batch(BaseModel):
    """A shuffled, signed batch: nothing but counts and sealed fragments."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    shuffler_id: str
    channel_id: str
    crowd_id: str
    epoch: int = Field(ge=0)
    n_contributions: int = Field(ge=0)
    fragments: list[str]

    def body(self) -> bytes:
        """The exact bytes that are signed and sent."""
        return self.model_dump_json().encode()
