"""Who vouches for what a device uses (docs/protocol.md, "Who vouches for what").

The analyzer signs the collection config; each shuffler signs its own descriptor
(:class:`common.wire.ShufflerDescriptor`, over :data:`DESCRIPTOR_CONTEXT`), which the config
carries unchanged, so the analyzer cannot change a shuffler's URL or keys. A device pins one
key per trust domain (:class:`TrustAnchors`, as DAP clients learn each aggregator's config
from that aggregator); :func:`verify_collection` accepts a config only when every listed
shuffler is pinned and vouched for, nothing has expired, and nothing rolls back what the
device has seen. Formats: docs/protocol-notes.md, "Signed documents".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from common.envelope import load_ed25519_public, public_bytes, verify
from common.wire import (
    MAX_SUCCESSIONS,
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    DeviceBudget,
    ShufflerDescriptor,
    ShufflerInfo,
    SignedConfig,
    SignedDescriptor,
    Succession,
    b64,
)

#: Signed before a descriptor's canonical bytes, so no other document a shuffler signs (its
#: batch parts are JSON too) can pass for a descriptor.
DESCRIPTOR_CONTEXT = b"esa/2 shuffler descriptor\n"
#: Signed before a key succession's canonical statement (:func:`sign_succession`), so neither
#: a config, a descriptor nor a batch part can pass for one, nor one for them.
SUCCESSION_CONTEXT = b"esa/1 key succession\n"
#: The party the analyzer's config-signing key speaks for, in successions and lineages; a
#: shuffler's is :func:`shuffler_party`.
ANALYZER_PARTY = "analyzer"
#: What the analyzer publishes (its config-signing key, base64) and the suffix of what a
#: shuffler publishes (its signed descriptor) for the other parties to pin.
ANALYZER_KEY_FILE = "analyzer.pub"
DESCRIPTOR_SUFFIX = ".descriptor.json"
#: How far in the future a document's issue time is believed (clocks differ): a device
#: remembers no later issue time than now plus this, so one document issued in the future (an
#: issuer's clock stepped ahead) cannot lock it out of the honest documents issued after it
#: (the rollback check); a device whose own clock is wrong is not locked out either.
MAX_CLOCK_SKEW_SECONDS = 300
#: Key of the analyzer's config in :attr:`VerifiedConfig.versions`, with the pinned key's
#: fingerprint (``"config/<fingerprint>"``); a shuffler's descriptor is
#: ``"shuffler/<id>/<fingerprint>"`` (no id holds a slash). A document signed by a key pinned
#: later starts its own history, so a key replaced after a mistake cannot keep a device on the
#: old key's documents.
CONFIG = "config"


class CollectionConfigError(ValueError):
    """A collection config or descriptor that is unsigned, mis-signed, tampered with, expired,
    older than one seen before, not pinned, or malformed."""


T = TypeVar("T")


@dataclass(frozen=True)
class Vouched(Generic[T]):
    """A verified document and its signer's lineage: the keys from the one the verifier pinned
    to the one that signed it, each named by its predecessor (:func:`follow_successions`)."""

    value: T
    lineage: tuple[Ed25519PublicKey, ...]

    @property
    def signer(self) -> Ed25519PublicKey:
        """The key that signed the document (where a verifier's pin moves to)."""
        return self.lineage[-1]


def shuffler_party(shuffler_id: str) -> str:
    """The party a shuffler's signing key speaks for (``shuffler/<id>``)."""
    return f"shuffler/{shuffler_id}"


def sign_succession(
    party: str, old: Ed25519PrivateKey, new: Ed25519PublicKey, issued_at: int
) -> Succession:
    """``old`` names ``new`` as ``party``'s next signing key (a rotation): devices and parties
    pinning ``old`` follow it to ``new`` without being re-pinned."""
    statement = {
        "party": party,
        "from_key": b64(public_bytes(old.public_key())),
        "to_key": b64(public_bytes(new)),
        "issued_at": issued_at,
    }
    signature = old.sign(SUCCESSION_CONTEXT + canonical(statement))
    return Succession(**statement, signature=b64(signature))


def follow_successions(
    successions: Sequence[Succession], party: str, pinned: Ed25519PublicKey
) -> tuple[Ed25519PublicKey, ...]:
    """The keys from ``pinned`` to ``party``'s newest: ``successions`` must be one unbroken,
    cycle-free chain of at most :data:`~common.wire.MAX_SUCCESSIONS` links for ``party``, and
    every link from ``pinned`` on signed by its ``from_key``. A chain that does not pass
    through ``pinned`` is refused: once a verifier's pin moved, a fork made later with a stolen
    older key names keys it never reaches.

    Raises:
        CollectionConfigError: naming the party and what is wrong.
    """
    keys = _chain_keys(successions, party, pinned)
    raw = [public_bytes(key) for key in keys]
    start = next((i for i, key in enumerate(raw) if key == public_bytes(pinned)), None)
    if start is None:
        raise CollectionConfigError(
            f"the signing keys of {party[:80]} do not descend from the key pinned for it "
            f"({fingerprint(pinned)}): re-pinned elsewhere, or a fork from an older key"
        )
    for index in range(start, len(successions)):
        link = successions[index]
        raw_signature = _signature(link.signature, f"key succession {index} of {party[:80]}")
        if not verify(SUCCESSION_CONTEXT + canonical(link.statement()), raw_signature, keys[index]):
            raise CollectionConfigError(
                f"key succession {index} of {party[:80]} is not signed by the key it hands over "
                "from (forged or tampered)"
            )
    return tuple(keys[start:])


def _chain_keys(
    successions: Sequence[Succession], party: str, pinned: Ed25519PublicKey
) -> list[Ed25519PublicKey]:
    """The keys a chain of successions names, in order (``[pinned]`` without any), after
    checking its shape: its length, its party, each link starting where the one before ended,
    issue times that never go back, no key twice.

    Raises:
        CollectionConfigError: naming the party and what is wrong.
    """
    if len(successions) > MAX_SUCCESSIONS:
        raise CollectionConfigError(
            f"{len(successions)} key successions for {party[:80]}: at most {MAX_SUCCESSIONS}"
        )
    if not successions:
        return [pinned]
    try:
        keys = [parse_key(successions[0].from_key, f"{party[:80]} succession 0")]
        for index, link in enumerate(successions):
            if link.party != party:
                raise ValueError(f"succession {index} speaks for {link.party[:80]}")
            if index and (link.from_key != successions[index - 1].to_key):
                raise ValueError(f"succession {index} does not start where {index - 1} ended")
            if index and link.issued_at < successions[index - 1].issued_at:
                raise ValueError(f"succession {index} is issued before {index - 1}")
            keys.append(parse_key(link.to_key, f"{party[:80]} succession {index}"))
    except ValueError as error:
        raise CollectionConfigError(f"key successions of {party[:80]}: {error}") from error
    if len({public_bytes(key) for key in keys}) != len(keys):
        raise CollectionConfigError(f"key successions of {party[:80]} name a key twice")
    return keys


def canonical(config: Mapping[str, Any]) -> bytes:
    """The exact bytes that are signed."""
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def sign_config(
    config: CollectionConfig, key: Ed25519PrivateKey, successions: Sequence[Succession] = ()
) -> SignedConfig:
    """The signed document served at ``GET /v1/config``, with the successions that lead from
    the analyzer's first key to ``key``."""
    body = config.model_dump(mode="json")
    signature = b64(key.sign(canonical(body)))
    return SignedConfig(config=body, signature=signature, successions=tuple(successions))


def sign_descriptor(
    descriptor: ShufflerDescriptor,
    key: Ed25519PrivateKey,
    successions: Sequence[Succession] = (),
) -> SignedDescriptor:
    """The signed document a shuffler serves at ``GET /v1/descriptor``, with the successions
    that lead from the shuffler's first key to ``key``."""
    body = descriptor.model_dump(mode="json")
    signature = b64(key.sign(DESCRIPTOR_CONTEXT + canonical(body)))
    return SignedDescriptor(descriptor=body, signature=signature, successions=tuple(successions))


def _signature(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise CollectionConfigError(f"{what} is not signed (missing signature)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise CollectionConfigError(f"{what} signature is not base64") from error


def verify_config(
    document: Mapping[str, Any] | SignedConfig, key: Ed25519PublicKey, now: float
) -> CollectionConfig:
    """The config inside a signed document, if the analyzer's signature holds — by ``key`` (the
    one pinned for the analyzer) or a key its successions lead to from ``key`` — and it has not
    expired (its shufflers' descriptors are not checked here: :func:`verify_collection`).

    Raises:
        CollectionConfigError: naming what is wrong.
    """
    return verify_config_chain(document, key, now).value


def verify_config_chain(
    document: Mapping[str, Any] | SignedConfig, key: Ed25519PublicKey, now: float
) -> Vouched[CollectionConfig]:
    """:func:`verify_config`, with the keys from ``key`` to the signer: a verifier that keeps
    state persists the signer as its pin, so a fork made later from an older key is refused.

    Raises:
        CollectionConfigError: naming what is wrong.
    """
    if isinstance(document, SignedConfig):
        document = document.model_dump()
    config = document.get("config")
    if not isinstance(config, dict):
        raise CollectionConfigError("collection config is not signed (missing config)")
    raw = _signature(document.get("signature"), "collection config")
    successions = _successions(document.get("successions", ()), "collection config")
    lineage = follow_successions(successions, ANALYZER_PARTY, key)
    if not verify(canonical(config), raw, lineage[-1]):
        raise CollectionConfigError(
            "collection config signature does not verify (wrong key or tampered)"
        )
    try:
        parsed = CollectionConfig.model_validate(config)
    except ValidationError as error:
        raise CollectionConfigError(f"collection config is malformed: {error}") from error
    _check_validity("collection config", parsed.issued_at, parsed.expires_at, now)
    return Vouched(parsed, lineage)


def _successions(data: object, what: str) -> tuple[Succession, ...]:
    """The key successions a signed document carries (none when absent).

    Raises:
        CollectionConfigError: they are not a list of successions.
    """
    if not isinstance(data, list | tuple):
        raise CollectionConfigError(f"{what}: successions must be a list")
    if len(data) > MAX_SUCCESSIONS:
        raise CollectionConfigError(
            f"{what}: {len(data)} key successions, at most {MAX_SUCCESSIONS}"
        )
    try:
        return tuple(Succession.model_validate(item) for item in data)
    except ValidationError as error:
        raise CollectionConfigError(f"{what}: a malformed key succession: {error}") from error


def _check_validity(what: str, issued_at: int, expires_at: int, now: float) -> None:
    """Refuse an expired document, or one that expires before it is issued.

    Raises:
        CollectionConfigError: naming ``what`` and the times.
    """
    if now > expires_at:
        raise CollectionConfigError(f"{what} expired at {expires_at}")
    if expires_at < issued_at:
        raise CollectionConfigError(f"{what} expires ({expires_at}) before it is issued")


def believed(versions: Mapping[str, int], now: float) -> dict[str, int]:
    """The issue times a device remembers: none later than ``now`` plus the clock skew."""
    latest = int(now) + MAX_CLOCK_SKEW_SECONDS
    return {name: min(issued, latest) for name, issued in versions.items()}


def descriptor_id(document: SignedDescriptor) -> str:
    """The shuffler id a descriptor names (unverified: only to find the key to check it with)."""
    named = document.descriptor.get("id")
    if not isinstance(named, str):
        raise CollectionConfigError("shuffler descriptor names no shuffler id")
    return named


def verify_descriptor(
    document: SignedDescriptor, key: Ed25519PublicKey, now: float | None
) -> ShufflerDescriptor:
    """The descriptor inside a signed document, if ``key`` (the one pinned for the shuffler it
    names) or a key its successions lead to from ``key`` signed it, it vouches for that same
    signer and it is valid at ``now`` (None: its signature only, e.g. to learn the key of a
    published descriptor).

    Raises:
        CollectionConfigError: naming the shuffler and what is wrong.
    """
    return verify_descriptor_chain(document, key, now).value


def verify_descriptor_chain(
    document: SignedDescriptor, key: Ed25519PublicKey, now: float | None
) -> Vouched[ShufflerDescriptor]:
    """:func:`verify_descriptor`, with the keys from ``key`` to the signer (the key the
    shuffler's batches are signed with now).

    Raises:
        CollectionConfigError: naming the shuffler and what is wrong.
    """
    named = descriptor_id(document)
    name = repr(named[:64])
    lineage = follow_successions(document.successions, shuffler_party(named), key)
    key = lineage[-1]
    raw = _signature(document.signature, f"descriptor of shuffler {name}")
    if not verify(DESCRIPTOR_CONTEXT + canonical(document.descriptor), raw, key):
        raise CollectionConfigError(
            f"descriptor of shuffler {name} is not signed by the key pinned for it "
            "(another party's key, or tampered)"
        )
    try:
        descriptor = ShufflerDescriptor.model_validate(document.descriptor)
    except ValidationError as error:
        raise CollectionConfigError(
            f"descriptor of shuffler {name} is malformed: {error}"
        ) from error
    if descriptor.signing_key != b64(public_bytes(key)):
        raise CollectionConfigError(f"descriptor of shuffler {name} names another signing key")
    if now is not None:
        what = f"descriptor of shuffler {name}"
        _check_validity(what, descriptor.issued_at, descriptor.expires_at, now)
    return Vouched(descriptor, lineage)


def published_key(document: SignedDescriptor) -> tuple[str, Ed25519PublicKey]:
    """The shuffler id and signing key a published descriptor names, once it verifies with
    that very key (a shuffler's own, self-consistent document; whether to pin the key is the
    reader's choice: on one host, what the shuffler wrote to its own public folder).

    Raises:
        CollectionConfigError: it names no usable key, or does not verify with it.
    """
    named = descriptor_id(document)
    try:
        key = parse_key(document.descriptor.get("signing_key"), f"shuffler {named[:64]!r}")
    except ValueError as error:
        raise CollectionConfigError(str(error)) from error
    return verify_descriptor(document, key, now=None).id, key


@dataclass(frozen=True)
class TrustAnchors:
    """The keys a device pins, one per trust domain: the analyzer's config-signing key and
    each shuffler's signing key (``var/trust.json``, written by ``esa up``)."""

    analyzer: Ed25519PublicKey
    shufflers: Mapping[str, Ed25519PublicKey]

    @classmethod
    def from_json(cls, data: object) -> TrustAnchors:
        """Parse ``{"analyzer": base64, "shufflers": {id: base64, ...}}``.

        Raises:
            ValueError: naming what is missing or not an Ed25519 key.
        """
        if not isinstance(data, dict) or not isinstance(data.get("shufflers"), dict):
            raise ValueError('trust anchors must be {"analyzer": key, "shufflers": {id: key}}')
        shufflers = {str(k): parse_key(v, f"shuffler {k!r}") for k, v in data["shufflers"].items()}
        if not shufflers:
            raise ValueError("trust anchors pin no shuffler key")
        return cls(parse_key(data.get("analyzer"), "analyzer"), shufflers)

    @classmethod
    def load(cls, path: Path) -> TrustAnchors:
        """Read a trust file.

        Raises:
            ValueError: the file cannot be read, is not JSON, or holds no usable keys.
        """
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"trust file {str(path)!r}: {error}") from error
        try:
            return cls.from_json(data)
        except ValueError as error:
            raise ValueError(f"trust file {str(path)!r}: {error}") from error

    @classmethod
    def from_published(cls, directory: Path) -> TrustAnchors:
        """The keys the parties published below ``directory``: ``analyzer.pub`` (the
        analyzer's config-signing key, base64) and each ``<id>.descriptor.json`` (a shuffler's
        signed descriptor, its key checked by :func:`published_key`).

        Raises:
            ValueError: no analyzer key, two of them, no shuffler, or a file that is not
                what its name says (naming the file).
        """
        analyzers = sorted(directory.rglob(ANALYZER_KEY_FILE))
        if len(analyzers) != 1:
            raise ValueError(f"{directory}: need one {ANALYZER_KEY_FILE}, found {len(analyzers)}")
        shufflers: dict[str, Ed25519PublicKey] = {}
        for path in sorted(directory.rglob(f"*{DESCRIPTOR_SUFFIX}")):
            try:
                document = SignedDescriptor.model_validate_json(path.read_text())
                named, key = published_key(document)
            except (OSError, ValueError) as error:
                raise ValueError(f"{path}: {error}") from error
            if named in shufflers:
                raise ValueError(f"{path}: a second descriptor of shuffler {named!r}")
            shufflers[named] = key
        if not shufflers:
            raise ValueError(f"{directory}: no shuffler descriptor (*{DESCRIPTOR_SUFFIX})")
        return cls(parse_key(analyzers[0].read_text(), f"analyzer ({analyzers[0]})"), shufflers)

    @classmethod
    def read(cls, path: Path) -> TrustAnchors:
        """A trust file, or a folder of published keys (:meth:`from_published`).

        Raises:
            ValueError: as :meth:`load` or :meth:`from_published`.
        """
        return cls.from_published(path) if path.is_dir() else cls.load(path)

    def roots(self) -> dict[str, str]:
        """The pinned keys (base64) by party (:data:`ANALYZER_PARTY`, :func:`shuffler_party`)."""
        found = {ANALYZER_PARTY: b64(public_bytes(self.analyzer))}
        return found | {shuffler_party(k): b64(public_bytes(v)) for k, v in self.shufflers.items()}

    def to_json(self) -> dict[str, Any]:
        """The form :meth:`from_json` reads."""
        return {
            "analyzer": b64(public_bytes(self.analyzer)),
            "shufflers": {k: b64(public_bytes(v)) for k, v in sorted(self.shufflers.items())},
        }


def fingerprint(key: Ed25519PublicKey) -> str:
    """A short name of a pinned key: the first 8 bytes of SHA-256 of its raw bytes, in hex."""
    return hashlib.sha256(public_bytes(key)).digest()[:8].hex()


def parse_key(text: object, what: str) -> Ed25519PublicKey:
    """A pinned Ed25519 public key from its standard base64 (surrounding whitespace ignored).

    Raises:
        ValueError: naming ``what`` and why it is not such a key.
    """
    if not isinstance(text, str):
        raise ValueError(f"the {what} key must be base64 text, not {type(text).__name__}")
    try:
        raw = base64.b64decode(text.strip(), validate=True)
        return load_ed25519_public(raw)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the {what} key is not a base64 Ed25519 public key: {error}") from error


@dataclass(frozen=True)
class VerifiedConfig:
    """A collection config whose every part was vouched for by the party it speaks for.

    Attributes:
        config: The analyzer-signed config.
        shufflers: The shufflers it lists, as their own descriptors describe them (in the
            config's order: a report-fragment channel routes row r to shuffler r mod K).
        versions: ``issued_at`` of the config and of each descriptor, by document and signing
            key (:data:`CONFIG`), for a device's rollback check (:func:`check_rollback`).
        expires_at: When the first of them expires.
        lineage: Per party (:data:`ANALYZER_PARTY`, :func:`shuffler_party`), the keys (base64)
            from the pinned one to the one that signed its document (:func:`check_moved`).
    """

    config: CollectionConfig
    shufflers: tuple[ShufflerInfo, ...]
    versions: Mapping[str, int]
    expires_at: int
    lineage: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def pins(self) -> dict[str, str]:
        """Per party, the key its document was signed with: where a device's pin moves to."""
        return {party: keys[-1] for party, keys in self.lineage.items()}

    @property
    def analyzer(self) -> AnalyzerInfo:
        """Where the analyzer is and its HPKE keys."""
        return self.config.analyzer

    @property
    def channels(self) -> list[ChannelConfig]:
        """The configured channels."""
        return self.config.channels

    @property
    def device_budget(self) -> DeviceBudget | None:
        """The device-wide local-ε budget, if any."""
        return self.config.device_budget

    def channel(self, channel_id: str) -> ChannelConfig | None:
        """The channel named ``channel_id``, if configured."""
        return self.config.channel(channel_id)


def verify_collection(
    document: Mapping[str, Any] | SignedConfig,
    trust: TrustAnchors,
    now: float,
    seen: Mapping[str, int] | None = None,
    *,
    every_shuffler: bool = True,
) -> VerifiedConfig:
    """Verify the analyzer's config and every shuffler descriptor it carries against the keys
    pinned in ``trust``; refuse anything older than ``seen`` (issue times already accepted)
    and, with ``every_shuffler``, a config that leaves out a pinned shuffler: the analyzer
    would otherwise choose which of them devices use, and a config naming one shuffler sends
    every device's reports there (all of them exposed if it colludes with the analyzer).

    Raises:
        CollectionConfigError: naming the document and what is wrong.
    """
    vouched = verify_config_chain(document, trust.analyzer, now)
    config = vouched.value
    chains = _descriptors(config.shufflers, trust, now)
    descriptors = [chain.value for chain in chains]
    left_out = sorted(set(trust.shufflers) - {d.id for d in descriptors})
    if every_shuffler and left_out:
        raise CollectionConfigError(
            f"the collection config leaves out {', '.join(left_out)}, pinned by this device: "
            "it would send every report to the shufflers it names"
        )
    versions = {f"{CONFIG}/{fingerprint(trust.analyzer)}": config.issued_at}
    for d in descriptors:
        versions[f"shuffler/{d.id}/{fingerprint(trust.shufflers[d.id])}"] = d.issued_at
    check_rollback(versions, seen or {})
    expires = min([config.expires_at, *(d.expires_at for d in descriptors)])
    lineage = {ANALYZER_PARTY: _named(vouched.lineage)}
    lineage |= {shuffler_party(c.value.id): _named(c.lineage) for c in chains}
    shufflers = tuple(d.info() for d in descriptors)
    return VerifiedConfig(
        config=config,
        shufflers=shufflers,
        versions=versions,
        expires_at=expires,
        lineage=lineage,
    )


def _named(keys: Sequence[Ed25519PublicKey]) -> tuple[str, ...]:
    return tuple(b64(public_bytes(key)) for key in keys)


def check_moved(config: VerifiedConfig, moved: Mapping[str, str]) -> None:
    """Refuse a config whose signers do not descend from the keys a device moved its pins to
    (``moved``: per party, base64, what :attr:`VerifiedConfig.pins` said before): a fork made
    with a stolen key the party had already rotated away from.

    Raises:
        CollectionConfigError: naming the party.
    """
    for party, pin in moved.items():
        keys = config.lineage.get(party)
        if keys is not None and pin not in keys:
            raise CollectionConfigError(
                f"the signing keys of {party} do not descend from the key this device moved "
                f"its pin to ({fingerprint(parse_key(pin, party))}): a fork from an older key"
            )


def check_rollback(versions: Mapping[str, int], seen: Mapping[str, int]) -> None:
    """Refuse documents older than ones already accepted.

    Raises:
        CollectionConfigError: naming the document that went back in time.
    """
    for name, issued in versions.items():
        before = seen.get(name)
        if before is not None and issued < before:
            kind, _, rest = name.partition("/")
            what = (
                "collection config"
                if kind == CONFIG
                else f"descriptor of shuffler {rest.split('/')[0]!r}"
            )
            raise CollectionConfigError(
                f"{what} issued at {issued} is older than one this device accepted (issued at "
                f"{before}): a replayed old document"
            )


def _descriptors(
    documents: Sequence[SignedDescriptor], trust: TrustAnchors, now: float
) -> list[Vouched[ShufflerDescriptor]]:
    if not documents:
        raise CollectionConfigError("the collection config lists no shuffler to report to")
    found: list[Vouched[ShufflerDescriptor]] = []
    for document in documents:
        named = descriptor_id(document)
        key = trust.shufflers.get(named)
        if key is None:
            raise CollectionConfigError(
                f"the collection config lists shuffler {named[:64]!r}, whose key this device "
                f"does not pin (pinned: {', '.join(sorted(trust.shufflers))})"
            )
        found.append(verify_descriptor_chain(document, key, now))
    ids = [d.value.id for d in found]
    if len(set(ids)) != len(ids):
        raise CollectionConfigError(f"the collection config lists a shuffler twice: {ids}")
    return found
