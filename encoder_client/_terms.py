"""What a device accepts about a channel's privacy: the app's caps, and terms pinned at the
first config naming the channel that a later config may tighten but never relax (docs/sdk.md,
"Pinned privacy terms"; ESA-revisited §II: the local guarantee is the one that holds when a
shuffler colludes with the analyzer)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.collection import VerifiedConfig
from common.terms import ChannelTerms, relaxations
from encoder_client._errors import (
    ChannelError,
    InvalidArgumentError,
    PrivacyCapError,
    PrivacyRelaxedError,
)


def _positive(name: str, value: object) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if not ok or math.isnan(value):  # type: ignore[arg-type]
        raise InvalidArgumentError(f"{name} must be a positive number, not {value!r}")


@dataclass(frozen=True)
class PrivacyCaps:
    """Limits the app sets that no signed config can take the device past.

    Attributes:
        local_eps: Largest local ε (replacement notion, what the device budget counts) of a
            report on any channel; a channel above it is refused (:class:`PrivacyCapError`).
        channel_local_eps: The same, per channel id (overrides ``local_eps`` for that channel).
        lifetime_eps: Largest local ε this device spends over all channels in its lifetime,
            whatever the config's budgets (:class:`BudgetExceededError` past it).
    """

    local_eps: float | None = None
    channel_local_eps: Mapping[str, float] = field(default_factory=dict)
    lifetime_eps: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.channel_local_eps, Mapping):
            raise InvalidArgumentError(
                f"channel_local_eps must map channel ids to numbers, not {self.channel_local_eps!r}"
            )
        for name, value in (("local_eps", self.local_eps), ("lifetime_eps", self.lifetime_eps)):
            if value is not None:
                _positive(name, value)
        for channel, value in self.channel_local_eps.items():
            _positive(f"channel_local_eps[{channel!r}]", value)

    def local_cap(self, channel_id: str) -> float | None:
        """The largest local ε allowed on ``channel_id`` (None: no cap)."""
        return self.channel_local_eps.get(channel_id, self.local_eps)


def _over_cap(terms: ChannelTerms, caps: PrivacyCaps) -> PrivacyCapError | None:
    cap = caps.local_cap(terms.id)
    if cap is None:
        return None
    local = terms.local_privacy()
    value = math.inf if local is None else local.replacement
    if value <= cap:
        return None
    return PrivacyCapError(
        f"channel {terms.id!r}: local ε {value:g} ({terms.mechanism}, replacement notion) is "
        f"above the app's cap {cap:g}; no report is made on it",
        channel_id=terms.id,
        cap=cap,
        value=value,
    )


def _relaxed(old: ChannelTerms, new: ChannelTerms) -> PrivacyRelaxedError | None:
    found = relaxations(old, new)
    if not found:
        return None
    first = found[0]
    return PrivacyRelaxedError(
        f"channel {new.id!r}: the signed config relaxes privacy terms this device accepted "
        f"({'; '.join(r.describe() for r in found)}); no report is made on it under that "
        "config (a channel whose privacy changes needs a new channel id)",
        channel_id=new.id,
        field=first.field,
        old=first.old,
        new=first.new,
    )


def review(
    config: VerifiedConfig, pinned: Mapping[str, ChannelTerms], caps: PrivacyCaps
) -> tuple[dict[str, ChannelTerms], dict[str, ChannelError]]:
    """Each channel of ``config`` against the app's caps and the terms pinned for it: (terms
    to pin: first seen or strictly stronger; refused channels with the error their reports
    raise). Pins are kept for good: waiting out a config's expiry relaxes nothing."""
    pin: dict[str, ChannelTerms] = {}
    refused: dict[str, ChannelError] = {}
    for channel in config.channels:
        terms = ChannelTerms.of(channel, config.device_budget)
        old = pinned.get(channel.id)
        error = _over_cap(terms, caps) or (None if old is None else _relaxed(old, terms))
        if error is not None:
            refused[channel.id] = error
        elif old is None or old.changed_terms(terms):
            pin[channel.id] = terms
    return pin, refused
