"""Pydantic models of everything that crosses HTTP (docs/protocol.md, "Routes").

Bytes travel as standard base64 strings inside JSON. Batches are signed over their exact body
bytes, so :meth:`Batch.body` is the one serialization both sides use.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IDENTIFIER = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
#: Largest epoch, count or bin index accepted anywhere: JSON's largest safe integer (I-JSON,
#: RFC 7493 §2.2: every parser reads it exactly, so the OpenAPI ``maximum`` means what it says),
#: and it fits a signed 64-bit column on every database; a larger number is a 400, never a
#: storage error.
MAX_INT = 2**53 - 1
#: A crowd id (docs/protocol.md, "Channels, epochs and crowds"): empty (the channel's one
#: natural crowd) or a lower-case identifier; a channel declares at most :data:`MAX_CROWDS`.
CROWD = re.compile(r"^(?:[a-z0-9][a-z0-9_.-]{0,63})?$")
MAX_CROWDS = 64
#: Longest epoch a channel may have (366 days): a replaced HPKE key keeps opening for the
#: longest epoch served, so a longer one would keep old keys for years (runtime.keys).
MAX_EPOCH_SECONDS = 366 * 86_400


def b64(data: bytes) -> str:
    """Standard base64 text."""
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    """Strict base64 decoding.

    Raises:
        ValueError: if ``text`` is not valid base64.
    """
    return base64.b64decode(text, validate=True)


class WireModel(BaseModel):
    """Base of every model here: its validator is built when it first validates, not when
    this module loads (pydantic's ``defer_build``), so a process pays only for the models it
    uses: a device validates a config, never a ledger (docs/sdk.md, "What importing costs")."""

    model_config = ConfigDict(defer_build=True)


def _identifier(value: str, what: str) -> str:
    if not IDENTIFIER.fullmatch(value):
        raise ValueError(f"{what} must match {IDENTIFIER.pattern}, got {value!r}")
    return value


class ErrorBody(WireModel):
    """Every error response: a machine-readable code and a human-readable detail."""

    error: str
    detail: str


class Receipt(WireModel):
    """202 body: an opaque receipt for the stored contribution."""

    receipt: str


class EnrollResponse(WireModel):
    """A bearer client token: ``client id . HMAC`` (verifiable without a lookup)."""

    client_token: str


class ChannelPolicy(WireModel):
    """What a shuffler needs to know about a channel (ESA-revisited §V, Algorithm 3).

    Epoch length, the release threshold ``min_crowd``, randomized deletion's ``eps_cr`` and
    ``delta_cr`` (Theorem V.1), the fragment counts a contribution may carry (equal bounds make
    every batch's crowd exact), the padded ``payload_size`` every fragment must have, and the
    declared ``crowds`` (ESA-revisited §V's natural crowds; others get ``400 unknown_crowd``).
    A group is evaluated only when its epoch closes, whole; a ``max_batch`` key is accepted and
    ignored. Fields: docs/protocol-notes.md, "Channel policy".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    epoch_seconds: int = Field(3600, ge=1, le=MAX_EPOCH_SECONDS)
    min_crowd: int = Field(100, ge=1)
    eps_cr: float = Field(0.5, gt=0)
    delta_cr: float = Field(1e-9, gt=0, lt=1)
    max_fragments: int = Field(64, ge=1, le=65535)
    min_fragments: int = Field(0, ge=0, le=65535)
    payload_size: int = Field(16, ge=8, le=1024)
    crowds: tuple[str, ...] = Field(("",), min_length=1, max_length=MAX_CROWDS)
    #: The first epoch the channel no longer takes (set when it is retired at runtime; its
    #: releases and ledger stay): shufflers answer ``409 channel_retired`` from it on.
    retired_from_epoch: int | None = Field(None, ge=0, le=MAX_INT)

    @model_validator(mode="before")
    @classmethod
    def _drop_max_batch(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_batch" in data:
            return {k: v for k, v in data.items() if k != "max_batch"}
        return data

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return _identifier(value, "channel id")

    @model_validator(mode="after")
    def _check_fragments(self) -> ChannelPolicy:
        if self.min_fragments > self.max_fragments:
            raise ValueError(
                f"min_fragments={self.min_fragments} is above max_fragments={self.max_fragments}"
            )
        return self

    @field_validator("crowds")
    @classmethod
    def _check_crowds(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for crowd in value:
            if not CROWD.fullmatch(crowd):
                raise ValueError(f"crowd ids must match {CROWD.pattern}, got {crowd[:80]!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"crowd ids must be distinct, got {list(value)}")
        return value

    def policy(self) -> ChannelPolicy:
        """The part shufflers enforce (of a subclass that states more, such as a channel's
        config or its privacy terms)."""
        return ChannelPolicy(**{k: getattr(self, k) for k in ChannelPolicy.model_fields})

    def takes(self, epoch: int) -> bool:
        """Whether the channel takes contributions for ``epoch`` (not retired by then)."""
        return self.retired_from_epoch is None or epoch < self.retired_from_epoch

    def changed_fields(self, other: ChannelPolicy) -> list[str]:
        """The fields ``other`` sets differently, besides its retirement: a live channel's
        parameters never change (a changed one is a new channel)."""
        mine, theirs = self.model_dump(), other.model_dump()
        return sorted(
            k
            for k in set(mine) | set(theirs)
            if k != "retired_from_epoch" and mine.get(k) != theirs.get(k)
        )


class DeviceBudget(WireModel):
    """A device's local-ε budget, enforced by the SDK itself (ESA-revisited §II: the guarantee
    that holds even when a shuffler colludes with the analyzer is the local one).

    Spend is the basic composition of every report's local ε in the replacement notion
    (:attr:`common.mechanisms.LocalPrivacy.replacement`), an upper bound whatever the
    mechanism. A report is refused when it would take the lifetime total above
    ``lifetime_eps`` or the total of reports whose epochs started in the last
    ``window_seconds`` above ``window_eps``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    lifetime_eps: float | None = Field(None, gt=0)
    window_eps: float | None = Field(None, gt=0)
    window_seconds: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_window(self) -> DeviceBudget:
        if (self.window_eps is None) != (self.window_seconds is None):
            raise ValueError("window_eps and window_seconds go together")
        if self.lifetime_eps is None and self.window_eps is None:
            raise ValueError("a budget needs lifetime_eps, or window_eps with window_seconds")
        return self


class ChannelConfig(ChannelPolicy):
    """A channel as the analyzer configures it and clients fetch it.

    Attributes:
        mechanism: A registered mechanism name (:mod:`common.mechanisms.registry`; built in:
            ``krappor, rfrag, longitudinal, zsum, krr``).
        params: The mechanism's parameters (validated by the mechanism's ``parse_params``
            where the channel is used: the analyzer at start, the SDK at first report).
        delta: δ for certifying releases.
        budget: Per-device local-ε budget of this channel (enforced by the SDK), if any.
    """

    mechanism: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    params: dict[str, Any]
    delta: float = Field(1e-9, gt=0, lt=1)
    display: Literal["histogram", "image", "series"] = "histogram"
    budget: DeviceBudget | None = None
    image_shape: tuple[int, int] | None = None
    title: str = Field("", max_length=200)


class ShufflerInfo(WireModel):
    """A shuffler as a device uses it, read from the shuffler's own signed descriptor (never
    from the analyzer's word): its URL, current HPKE key and key id, Ed25519 signing key."""

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


class HpkeKey(WireModel):
    """One live HPKE key: base64 raw X25519 public key and its key id in hex."""

    model_config = ConfigDict(frozen=True)

    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    public_key: str


class ShufflerDescriptor(WireModel):
    """What a shuffler vouches for about itself, signed with its own Ed25519 key (docs/protocol.md,
    "Shuffler descriptor"; DAP's aggregators serve their own HPKE configs the same way): its
    id, the URL devices send to, its live HPKE keys (the current one first) and its signing
    key, valid from ``issued_at`` until ``expires_at`` (unix seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    id: str
    url: str = Field(min_length=1, max_length=2048)
    keys: list[HpkeKey] = Field(min_length=1, max_length=8)
    signing_key: str
    issued_at: int = Field(ge=0, le=MAX_INT)
    expires_at: int = Field(ge=0, le=MAX_INT)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return _identifier(value, "shuffler id")

    def info(self) -> ShufflerInfo:
        """The shuffler as a device sends to it (its current key)."""
        current = self.keys[0]
        return ShufflerInfo(
            id=self.id,
            url=self.url,
            public_key=current.public_key,
            key_id=current.key_id,
            signing_key=self.signing_key,
        )


#: Who a key succession speaks for: the analyzer, or one shuffler (``shuffler/<id>``).
PARTY = r"^(?:analyzer|shuffler/[a-z0-9][a-z0-9_.-]{0,63})$"
#: Most successions a signed document carries (a verifier refuses longer chains).
MAX_SUCCESSIONS = 32


class Succession(WireModel):
    """A signing key handing over to the next one (rotation without re-pinning): ``party``'s
    key ``from_key`` names ``to_key`` (both base64 raw Ed25519) as its successor at
    ``issued_at``, signed by ``from_key`` over :data:`common.collection.SUCCESSION_CONTEXT`
    and the canonical statement (:func:`common.collection.sign_succession`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    party: str = Field(pattern=PARTY)
    from_key: str = Field(max_length=64)
    to_key: str = Field(max_length=64)
    issued_at: int = Field(ge=0, le=MAX_INT)
    signature: str = Field(max_length=128)

    def statement(self) -> dict[str, Any]:
        """What the old key signs: everything but the signature."""
        return self.model_dump(exclude={"signature"})


class SignedDescriptor(WireModel):
    """A shuffler's ``GET /v1/descriptor``: the descriptor as JSON and the shuffler's Ed25519
    signature over its canonical bytes (:func:`common.collection.sign_descriptor`), by the
    key its ``successions`` lead to from the one a verifier pins (none: the pinned key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    descriptor: dict[str, Any]
    signature: str
    successions: tuple[Succession, ...] = Field((), max_length=MAX_SUCCESSIONS)


class ShufflerEntry(WireModel):
    """One shuffler in the analyzer's registry: where its descriptor is served and the Ed25519
    key the analyzer pins for it (batches and descriptors must verify with it). ``descriptor``
    optionally seeds the signed descriptor; the analyzer refreshes it from ``url``.
    ``descriptor_file`` names a descriptor the shuffler published (its own folder, read-only to
    the analyzer) to take both from, when no ``signing_key`` is given. Other keys of older
    registries are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    url: str
    signing_key: str = ""
    descriptor: SignedDescriptor | None = None
    descriptor_file: str | None = None

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return _identifier(value, "shuffler id")


#: Most fragments in one batch part (the protocol's limit: the analyzer refuses more and sizes
#: its body cap from it): ~50k sealed fragments is a few MB of JSON, which an analyzer stores in
#: well under a second, so no part can time out however big its group.
PART_FRAGMENTS = 50_000


class Batch(WireModel):
    """One signed part of a shuffled batch: nothing but counts and sealed fragments.

    A group is evaluated and shuffled whole (ESA-revisited Algorithm 3), then its shuffled
    sequence is cut into ``parts`` consecutive parts; ``n_contributions`` is the whole group's
    count in every part. Order inside the shuffled sequence carries nothing, so the parts are
    delivered and stored independently, each idempotent per (``batch_id``, ``part``); a release
    uses the batch only when all its parts are in.
    """

    model_config = ConfigDict(extra="forbid")

    batch_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    part: int = Field(0, ge=0)
    parts: int = Field(1, ge=1)
    shuffler_id: str = Field(pattern=IDENTIFIER.pattern)
    channel_id: str = Field(pattern=IDENTIFIER.pattern)
    crowd_id: str = Field(pattern=CROWD.pattern)
    epoch: int = Field(ge=0, le=MAX_INT)
    n_contributions: int = Field(ge=0, le=MAX_INT)
    fragments: list[str] = Field(max_length=PART_FRAGMENTS)

    @model_validator(mode="after")
    def _check_part(self) -> Batch:
        if self.part >= self.parts:
            raise ValueError(f"part must be < parts, got part={self.part}, parts={self.parts}")
        return self

    def body(self) -> bytes:
        """The exact bytes that are signed and sent."""
        return self.model_dump_json().encode()


# --- the signed collection config (analyzer ``GET /v1/config``) ----------------------------


class AnalyzerInfo(WireModel):
    """Where the analyzer is and the keys fragments are sealed to (newest first)."""

    model_config = ConfigDict(frozen=True)

    url: str
    keys: list[HpkeKey] = Field(min_length=1)
    signing_key: str


class CollectionConfig(WireModel):
    """What a device needs to report (docs/protocol.md, "Collection config"): signed by the analyzer
    and valid until ``expires_at`` (unix seconds). Shufflers appear only as their own signed
    descriptors, which the analyzer passes on and cannot alter (a device verifies each with the
    key it pins for that shuffler). ``device_budget`` caps a device's local ε over all channels
    together. Version 2: fragments are bound to channel, epoch and crowd."""

    model_config = ConfigDict(frozen=True)

    version: Literal[2] = 2
    #: Numbers the changes of the channel list (added, retired) at the analyzer: never goes
    #: down, so a shuffler or device never adopts an older list than one it adopted.
    revision: int = Field(0, ge=0, le=MAX_INT)
    issued_at: int = Field(ge=0, le=MAX_INT)
    expires_at: int = Field(ge=0, le=MAX_INT)
    analyzer: AnalyzerInfo
    shufflers: list[SignedDescriptor]
    channels: list[ChannelConfig]
    device_budget: DeviceBudget | None = None

    def channel(self, channel_id: str) -> ChannelConfig | None:
        """The channel named ``channel_id``, if configured."""
        return next((c for c in self.channels if c.id == channel_id), None)


class SignedConfig(WireModel):
    """``GET /v1/config`` of the analyzer: the config as JSON and an Ed25519 signature over its
    canonical bytes (:func:`common.collection.canonical`), by the key its ``successions`` lead
    to from the one a device pins (none: the pinned key)."""

    config: dict[str, Any]
    signature: str
    successions: tuple[Succession, ...] = Field((), max_length=MAX_SUCCESSIONS)


# --- shuffler answers -------------------------------------------------------------------------


class ShufflerConfig(WireModel):
    """A shuffler's ``GET /v1/config``: its public identity and the channel policies it
    enforces."""

    id: str
    public_key: str
    key_id: str
    signing_key: str
    channels: list[ChannelPolicy]


class CloseRequest(WireModel):
    """``POST /v1/admin/close``: evaluate this channel's groups of ``epoch`` now."""

    model_config = ConfigDict(extra="forbid")

    channel_id: str
    epoch: int = Field(ge=0, le=MAX_INT)

    @field_validator("epoch", mode="before")
    @classmethod
    def _json_integer(cls, value: Any) -> Any:
        # JSON Schema's integer (what the OpenAPI says): 7 or 7.0, never false or "7".
        if isinstance(value, bool | str):
            raise ValueError("must be an integer")
        return value


class CloseResult(WireModel):
    """What closing an epoch did: groups evaluated, and batches forwarded, left for a retry, or
    refused for good by the analyzer."""

    groups_evaluated: int
    forwarded: int
    retried: int
    failed: int


class RevokeRequest(WireModel):
    """``POST /v1/admin/revoke``: refuse this client's token from now on."""

    model_config = ConfigDict(extra="forbid")

    #: Printable ASCII (client ids are hex); a control character is refused 400 here rather
    #: than failing in the database.
    client_id: str = Field(min_length=1, max_length=128, pattern=r"^[!-~]+$")


class RevokeResult(WireModel):
    """The client id that is now revoked."""

    revoked: str


class RequeueRequest(WireModel):
    """``POST /v1/admin/requeue``: take up again the batch parts set aside (a shuffler: parts
    the analyzer refused; the analyzer: parts quarantined after failed openings), of one batch
    or (``batch_id`` null) of all, once their cause is fixed."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")


class RequeueResult(WireModel):
    """How many parts were taken up again."""

    requeued: int


# --- key rotation (each party's ``/v1/admin/keys``) -------------------------------------------

#: The keys a party rotates: its HPKE key (what devices seal to) or its Ed25519 signing key.
KeyKind = Literal["hpke", "signing"]


class KeyInfo(WireModel):
    """One of a party's keys: its kind, id (an HPKE key id, or a signing key's fingerprint:
    8 bytes of SHA-256, hex), public key (base64), state and times (unix seconds). ``pending``:
    loaded by every replica, not yet published; ``active``: in use (``published``: the one
    devices are told to use, or the signer); ``retired``: no longer opens or signs anything."""

    kind: KeyKind
    key_id: str
    public_key: str
    state: Literal["pending", "active", "retired"]
    published: bool
    created_at: float
    activates_at: float
    retires_at: float | None


class KeyList(WireModel):
    """``GET /v1/admin/keys``: every key of the party, oldest first, and the successions its
    signing keys made (what its signed documents carry)."""

    party: str
    keys: list[KeyInfo]
    successions: list[Succession]


class RotateKeyRequest(WireModel):
    """``POST /v1/admin/keys/rotate``: make a new key of this kind; it is published once every
    replica has loaded it, and the key it replaces keeps working through its overlap."""

    model_config = ConfigDict(extra="forbid")

    key: KeyKind


class RetireKeyRequest(WireModel):
    """``POST /v1/admin/keys/retire``: retire an HPKE key now, before its overlap ends (a key
    thought compromised): what is sealed to it is refused or fails to open from then on."""

    model_config = ConfigDict(extra="forbid")

    key: Literal["hpke"]
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")


class KeyChange(WireModel):
    """What a rotation or retirement did: the key made (or retired) and every key after it."""

    key: KeyInfo
    keys: KeyList


# --- analyzer answers -------------------------------------------------------------------------


class BatchAck(WireModel):
    """The analyzer's answer to ``POST /v1/batches``: the part is durably stored (201 the first
    time, 200 for a known (``batch_id``, ``part``), counted once); it is opened and accumulated
    in the background, so fragment counts are not known yet when it is acknowledged."""

    batch_id: str
    part: int = 0
    duplicate: bool
    fragments: int | None = None
    invalid: int | None = None


class Bound(WireModel):
    """A certified (ε, δ) or a lower bound, as :meth:`common.accounting.BoundResult.as_dict`
    writes it."""

    method: str
    eps: float
    delta: float
    neighbouring: str
    valid_regime: bool
    kind: str
    note: str
    inputs: dict[str, Any]


class LocalBound(WireModel):
    """Local ε of one report under each notion (docs/accounting.md, "Neighbouring notions")."""

    removal: float
    replacement: float
    eps_l_inf: float | None = None
    eps_l1: float | None = None
    note: str = ""


class CrowdCheckBody(WireModel):
    """What the analyzer verified of the crowds its shufflers claimed, over a release's
    complete batches: the claimed and the verified contributions (what the certificate and the
    estimate rest on), the fragments that failed to open or parse, the batches whose
    fragments verify fewer contributions than claimed, and those of them withheld because
    they verify fewer than the channel's ``min_crowd`` (no release rests on them)."""

    batches: int
    claimed: int
    verified: int
    invalid_fragments: int
    short_batches: int
    withheld_batches: int = 0


class ReleaseBody(WireModel):
    """``GET /v1/channels/{id}/estimate``: estimates over ``epochs`` (inclusive) with standard
    errors, 95% intervals and the certified central (ε, δ) of the crowds received."""

    channel_id: str
    epochs: tuple[int, int]
    n: int
    bins: list[int]
    values: list[float]
    std_errors: list[float]
    ci95: list[tuple[float, float]]
    note: str
    certificate: Bound
    other_notion: Bound | None
    with_randomized_deletion: Bound | None
    lower_bound: Bound | None
    local: LocalBound | None
    crowds: dict[str, int]
    crowd_check: CrowdCheckBody | None = None
    #: The paper's truncated estimate of the same ``bins`` (Balcer–Cheu Figure 1 reports bins at
    #: or below the crowd as 0), beside the unbiased ``values``; absent for other mechanisms.
    truncated_values: list[float] | None = None


class ReleaseRequest(WireModel):
    """``POST /v1/channels/{id}/releases``: the epochs to publish (``epoch`` alone, or
    ``[epoch_from, epoch_to]``; a missing end is the last epoch received)."""

    model_config = ConfigDict(extra="forbid")

    epoch: int | None = Field(None, ge=0, le=MAX_INT)
    epoch_from: int | None = Field(None, ge=0, le=MAX_INT)
    epoch_to: int | None = Field(None, ge=0, le=MAX_INT)
    top: int | None = Field(None, ge=1, le=MAX_INT)


class LedgerRow(WireModel):
    """One epoch of a channel in the privacy ledger: charged once, at the crowds received
    (the worst crowd of the epoch when devices were split into several)."""

    epoch: int
    crowd_id: str
    n: int
    certificate: Bound
    other_notion: Bound
    crowds: dict[str, int]
    batches: int
    charged_at: float
    #: How the epoch enters the lifetime: the mechanism's dominating pair at ``n``, or its
    #: (ε, δ) certificate (mechanisms without a pair: Balcer–Cheu, report fragments).
    composed_as: Literal["pair", "certificate"] = "certificate"


class PublishedRelease(WireModel):
    """A release published with ``POST /v1/channels/{id}/releases`` (costs no privacy: it is
    post-processing of the epochs already charged)."""

    id: int
    epochs: tuple[int, int]
    n: int
    certificate: Bound
    released_at: float


class DeltaSplitBody(WireModel):
    """How the lifetime δ is divided (:class:`common.accounting.lifetime.DeltaSplit`)."""

    certificates: float
    pld_pairs: float
    pld_truncation: float
    basic_per_part: float
    advanced_per_step: float
    advanced_slack: float


class Lifetime(WireModel):
    """The lifetime (ε, δ) of one device that took part in every epoch composed
    (:class:`common.accounting.lifetime.LifetimeResult`; ε null when nothing is certified)."""

    eps: float | None
    delta: float
    method: str
    neighbouring: str
    eps_pld: float | None
    eps_basic: float | None
    eps_advanced: float | None
    advanced_rule: str
    delta_split: DeltaSplitBody
    epochs: int
    parts: int
    pair_parts: int
    discretization: float
    note: str


class BudgetLimit(WireModel):
    """One local-ε cap of the signed config (:class:`DeviceBudget`) against what one device
    that reported in every epoch so far has charged to it (the SDK's rule; null: unbounded)."""

    scope: Literal["channel", "device"]
    span: Literal["lifetime", "window"]
    eps: float
    window_seconds: int | None = None
    spent: float | None
    left: float
    exhausted: bool


class BudgetInUse(WireModel):
    """The device-side budget in use: local ε per report (replacement notion; across channels
    the largest), reports of a device in every epoch so far, their total (basic composition, as
    the SDK charges) and the caps they count against (a window cap: the most spent in any one
    window). Null ε: no local privacy (reports that reveal the value, e.g. Balcer–Cheu)."""

    local_eps: float | None
    reports: int
    spent: float | None
    limits: list[BudgetLimit]
    note: str


class Ledger(WireModel):
    """``GET /v1/channels/{id}/privacy``: each epoch's certificate, the lifetime of a device in
    every epoch so far (null before any epoch is charged), the same as an add/remove statement
    with randomized deletion, the device-side budget in use and the releases published."""

    channel_id: str
    epochs: list[LedgerRow]
    lifetime: Lifetime | None
    releases: list[PublishedRelease]
    note: str
    with_randomized_deletion: Lifetime | None = None
    device_budget: BudgetInUse | None = None


class PrivacyOverview(WireModel):
    """``GET /v1/privacy``: the lifetime of a device that took part in every epoch of every
    channel (null before any epoch is charged)."""

    channels: list[str]
    epochs: int
    lifetime: Lifetime | None
    note: str
    with_randomized_deletion: Lifetime | None = None
    device_budget: BudgetInUse | None = None


class ChannelSummary(ChannelConfig):
    """A configured channel and the epochs received so far (``[first, last]`` or null)."""

    epochs: tuple[int, int] | None


class ChannelList(WireModel):
    """``GET /v1/channels``: the channels (retired ones too) and the config revision."""

    channels: list[ChannelSummary]
    revision: int = 0


class ChannelChange(WireModel):
    """An admin's change to the channel list: the channel as now published, the config
    revision that carries it, and whether anything changed (adding the same channel again,
    or retiring a retired one, changes nothing)."""

    channel: ChannelConfig
    revision: int
    changed: bool


class EpochCloseRequest(WireModel):
    """``POST /v1/admin/channels/{id}/close``: close every epoch of the channel up to
    ``epoch`` at the analyzer now, as its close timeout would (an operator's call, once every
    shuffler has forwarded what it will)."""

    model_config = ConfigDict(extra="forbid")

    epoch: int = Field(ge=0, le=MAX_INT)


class ClosedGroup(WireModel):
    """One (crowd, epoch) group closed for good, with the shufflers whose complete batches its
    releases rest on."""

    epoch: int
    crowd_id: str
    shufflers: list[str]


class EpochsClosed(WireModel):
    """What a close did: the groups it closed (none: every group up to ``epoch`` was settled
    already, or still has a part waiting for the opener)."""

    channel_id: str
    epoch: int
    closed: list[ClosedGroup]
