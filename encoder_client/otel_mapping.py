"""The declarative mapping of the OpenTelemetry bridge: which instrument feeds which ESA channel.

A mapping is a dict, or a JSON or YAML file holding one, with ``version: 1`` and a list of
``rules`` of kind ``category`` (an attribute's value -> a histogram channel), ``buckets`` (a
numeric histogram -> a bucket-index channel) or ``state`` (a boolean state over periods -> a
longitudinal channel), each optionally with ``match`` and ``crowd``. A channel appears in at
most one rule (one contribution per channel and epoch). :func:`bind` checks the rules against
the verified signed config and raises :class:`MappingError` naming the rule and the field.

Format and example: docs/otel.md, "The mapping".
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping as MappingABC
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.mechanisms import UnknownMechanismError, ValueKind, build_device
from encoder_client._client import Client
from encoder_client._errors import ChannelError, EsaError

#: An attribute value as OpenTelemetry allows it (scalars, or sequences of them).
AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int]
Scalar = str | bool | int | float


class MappingError(EsaError, ValueError):
    """A mapping that does not validate, or does not fit the signed collection config."""


def text(value: object) -> str:
    """The text form an attribute value is compared by: booleans as ``true``/``false`` (as in
    JSON and YAML), numbers and strings as Python prints them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def hash_bin(value: str, k: int) -> int:
    """The bin a hashed value lands in: the first 8 bytes of SHA-256(UTF-8 value), big-endian,
    modulo ``k``. Public, so the analyzer side can name the bins of candidate values."""
    digest = hashlib.sha256(value.encode()).digest()
    return int.from_bytes(digest[:8], "big") % k


class _Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    channel: str = Field(min_length=1)
    instrument: str = Field(min_length=1)
    match: dict[str, Scalar] = Field(default_factory=dict)
    crowd: str | None = None


class CategoryRule(_Rule):
    """An attribute's value becomes a value of a histogram channel (k-RAPPOR, report fragments,
    k-RR, Balcer–Cheu): vocabulary index or hash. Reported: the epoch's most frequent value."""

    kind: Literal["category"] = "category"
    attribute: str = Field(min_length=1)
    values: tuple[str, ...] | None = None
    hash: bool = False

    @field_validator("values")
    @classmethod
    def _distinct(cls, values: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if values is not None and (not values or len(set(values)) != len(values)):
            raise ValueError("values must be a non-empty list of distinct strings")
        return values

    @model_validator(mode="after")
    def _one_source(self) -> CategoryRule:
        if (self.values is None) == (not self.hash):
            raise ValueError("give exactly one of values (a vocabulary) or hash: true")
        return self


class BucketRule(_Rule):
    """A numeric histogram instrument becomes a bucket index of a histogram channel: bucket i
    holds measurements in ``(boundaries[i-1], boundaries[i]]`` (OpenTelemetry's explicit
    buckets). Reported: the bucket of the epoch's median measurement, or its most frequent."""

    kind: Literal["buckets"] = "buckets"
    boundaries: tuple[float, ...] | None = None
    report: Literal["median", "mode"] = "median"

    @field_validator("boundaries")
    @classmethod
    def _increasing(cls, bounds: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if bounds is not None and any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"boundaries must increase strictly, got {list(bounds)}")
        return bounds


class StateRule(_Rule):
    """A boolean state over periods becomes a longitudinal channel's state (Erlingsson et al.
    2019): the state of an epoch is the one observed most in it (ties and silent epochs keep
    the previous state); period ``t`` is the channel's epoch ``first_epoch + t - 1``.

    With ``attribute``, a data point says "true" when its attribute value is one of
    ``true_values``; without, when its value is not zero (a gauge or up-down counter level)."""

    kind: Literal["state"] = "state"
    attribute: str | None = None
    true_values: tuple[Scalar, ...] = (True,)
    first_epoch: int = Field(ge=0)


Rule = Annotated[CategoryRule | BucketRule | StateRule, Field(discriminator="kind")]


class MappingSpec(BaseModel):
    """The whole mapping document."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    rules: tuple[Rule, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_rule_per_channel(self) -> MappingSpec:
        seen: set[str] = set()
        for i, rule in enumerate(self.rules):
            if rule.channel in seen:
                raise ValueError(
                    f"rule {i}: channel {rule.channel!r} is already fed by an earlier rule "
                    "(one contribution per channel and epoch)"
                )
            seen.add(rule.channel)
        return self


def load_mapping(source: MappingSpec | MappingABC[str, Any] | str | Path) -> MappingSpec:
    """A validated mapping from a dict, a :class:`MappingSpec` or a ``.json``/``.yaml`` file.

    Raises:
        MappingError: unreadable file, bad syntax, or a rule that does not validate (the
            message names the rule index and the field).
    """
    if isinstance(source, MappingSpec):
        return source
    if isinstance(source, str | Path):
        source = _read(Path(source))
    try:
        return MappingSpec.model_validate(source)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'mapping'}: {e['msg']}" for e in error.errors()
        )
        raise MappingError(f"OpenTelemetry mapping does not validate: {problems}") from error


def _read(path: Path) -> Any:
    try:
        raw = path.read_text()
    except OSError as error:
        raise MappingError(f"cannot read mapping file {str(path)!r}: {error}") from error
    if path.suffix.lower() not in (".yaml", ".yml"):
        try:
            return json.loads(raw)
        except ValueError as error:
            raise MappingError(f"mapping file {str(path)!r} is not JSON: {error}") from error
    import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise MappingError(f"mapping file {str(path)!r} is not YAML: {error}") from error


@dataclass(frozen=True)
class BoundRule:
    """A rule checked against the signed config: its channel's domain, epoch and crowd."""

    rule: CategoryRule | BucketRule | StateRule
    domain: int
    epoch_seconds: int
    crowd: str

    @property
    def channel(self) -> str:
        return self.rule.channel

    def category_bin(self, value: object) -> int | None:
        """The bin of an attribute value (category rules), None when outside the domain."""
        assert isinstance(self.rule, CategoryRule)
        if isinstance(value, list | tuple):
            return None
        if self.rule.values is None:
            return hash_bin(text(value), self.domain)
        try:
            return self.rule.values.index(text(value))
        except ValueError:
            return None

    def matches(self, attributes: MappingABC[str, object]) -> bool:
        """Whether a data point's attributes satisfy the rule's ``match``."""
        return all(
            key in attributes and text(attributes[key]) == text(want)
            for key, want in self.rule.match.items()
        )


def bind(spec: MappingSpec, client: Client) -> list[BoundRule]:
    """Check every rule against the client's verified collection config.

    Raises:
        MappingError: an unknown channel or crowd, a channel whose mechanism takes another kind
            of value, or a vocabulary or bucket list larger than the channel's domain.
    """
    return [_bind(i, rule, client) for i, rule in enumerate(spec.rules)]


def _bind(i: int, rule: CategoryRule | BucketRule | StateRule, client: Client) -> BoundRule:
    where = f"rule {i} (channel {rule.channel!r})"
    try:
        config = client.channel(rule.channel)
        crowd = client.crowd(rule.channel, rule.crowd)
        mechanism = build_device(config)
        domain = mechanism.domain_size()
    except (ChannelError, UnknownMechanismError, TypeError, ValueError) as error:
        raise MappingError(f"{where}: {error}") from error
    want = ValueKind.STATE if isinstance(rule, StateRule) else ValueKind.CATEGORY
    if mechanism.value_kind is not want:
        raise MappingError(
            f"{where}: a {rule.kind} rule needs a channel of {want} values, but "
            f"{config.mechanism} takes {mechanism.value_kind} values"
        )
    needed = 0
    if isinstance(rule, CategoryRule) and rule.values is not None:
        needed = len(rule.values)
    elif isinstance(rule, BucketRule) and rule.boundaries is not None:
        needed = len(rule.boundaries) + 1
    if needed > domain:
        raise MappingError(
            f"{where}: {needed} {'values' if isinstance(rule, CategoryRule) else 'buckets'} "
            f"do not fit the channel's domain of {domain}"
        )
    return BoundRule(rule, domain, config.epoch_seconds, crowd)
