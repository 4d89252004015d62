"""A channel's privacy terms, and which changes to them relax a device's privacy.

What a device or a shuffler accepted about a channel's privacy (its mechanism and parameters,
δ, randomized deletion, crowd and fragment bounds, device budgets) is never relaxed by a later
signed document (docs/protocol-notes.md, "Pinned privacy terms"): a channel whose privacy must
change gets a new channel id. Parameters are ordered through the mechanism's own local privacy
(:meth:`common.mechanisms.DeviceMechanism.local_privacy`), never a list of mechanism names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from common.mechanisms import (
    BatchContext,
    LocalPrivacy,
    UnknownMechanismError,
    build_device,
    get_device,
)
from common.wire import ChannelConfig, ChannelPolicy, DeviceBudget

#: Relative slack when comparing two ε or δ, so that the same number computed twice is equal.
SLACK = 1e-12
#: The local-ε notions a mechanism describes (ESA-revisited Definition II.4, Theorem IV.1),
#: the one device budgets count first.
NOTIONS = ("replacement", "removal", "eps_l_inf", "eps_l1")


class ChannelTerms(ChannelPolicy):
    """Every privacy field of one channel: its shuffler policy, mechanism, parameters, δ, the
    channel's device budget and the config's device-wide budget that applies to it."""

    mechanism: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    params: dict[str, Any]
    delta: float = Field(gt=0, lt=1)
    budget: DeviceBudget | None = None
    device_budget: DeviceBudget | None = None

    @classmethod
    def of(cls, channel: ChannelConfig, device_budget: DeviceBudget | None) -> ChannelTerms:
        """The terms a signed config states for ``channel``."""
        fields = {k: getattr(channel, k) for k in ChannelPolicy.model_fields}
        return cls(
            **fields,
            mechanism=channel.mechanism,
            params=channel.params,
            delta=channel.delta,
            budget=channel.budget,
            device_budget=device_budget,
        )

    def local_privacy(self) -> LocalPrivacy | None:
        """The mechanism's local privacy for these parameters (None: this party does not know
        the mechanism, or the parameters do not validate or cannot be evaluated, e.g. an ε of
        10**400 that overflows a float, so nothing can be ordered). The parameters are another
        party's signed word: any failure to evaluate them refuses this channel alone."""
        try:
            local = build_device(self).local_privacy()
            notions = [float(getattr(local, notion)) for notion in NOTIONS]
        except Exception:
            return None
        return None if any(math.isnan(value) for value in notions) else local

    def verified_crowd(self, claimed: int, fragments: int, source: BatchContext) -> int | None:
        """The crowd the analyzer verifies for an honest batch of ``claimed`` contributions
        carrying ``fragments`` fragments from the shuffler at ``source``
        (:meth:`common.mechanisms.FragmentCount.verified_crowd`, the law as the channel
        accepts it); None when this party cannot evaluate the mechanism."""
        try:
            law = build_device(self).fragment_count(source)
        except Exception:
            return None
        return law.accepting(self.max_fragments).verified_crowd(claimed, fragments, 0)

    def shuffle_only(self) -> bool:
        """Whether the mechanism gives no local privacy by design (all of it from the shuffle:
        :attr:`common.mechanisms.DeviceMechanism.shuffle_only`), never inferred from an
        infinite ε."""
        try:
            return get_device(self.mechanism).shuffle_only
        except UnknownMechanismError:
            return False

    def same_params(self, other: ChannelTerms) -> bool:
        """Whether ``other`` gives the same mechanism parameters: as the mechanism parses them
        where it can (keys that publish data rather than parameters, such as LDP-SGD's current
        model, are not parameters), else as written."""
        if self.mechanism != other.mechanism:
            return False
        try:
            return build_device(self).params == build_device(other).params
        except Exception:
            return self.params == other.params

    def changed_terms(self, other: ChannelTerms) -> list[str]:
        """Every privacy term ``other`` sets differently (retirement is not one)."""
        mine, theirs = self.model_dump(), other.model_dump()
        skip = ("retired_from_epoch", "params")
        changed = [k for k in mine if k not in skip and mine[k] != theirs[k]]
        return sorted(changed if self.same_params(other) else [*changed, "params"])


@dataclass(frozen=True)
class Relaxation:
    """One field of a channel's terms that a later document relaxes, or changes in a way whose
    privacy effect cannot be ordered."""

    field: str
    old: object
    new: object

    def describe(self) -> str:
        """The field with its accepted and offered values."""
        return f"{self.field} {self.old!r} -> {self.new!r}"


def _more(old: float, new: float) -> bool:
    return new > old * (1.0 + SLACK) and not (math.isinf(old) and math.isinf(new))


def _local(old: ChannelTerms, new: ChannelTerms) -> list[Relaxation]:
    """Parameter changes: allowed only when no local ε of the mechanism grows."""
    if old.mechanism != new.mechanism:
        return [Relaxation("mechanism", old.mechanism, new.mechanism)]
    if old.same_params(new):
        return []
    before, after = old.local_privacy(), new.local_privacy()
    if before is None or after is None:
        return [Relaxation("params", old.params, new.params)]
    return [
        Relaxation(f"local ε ({notion})", getattr(before, notion), getattr(after, notion))
        for notion in NOTIONS
        if _more(getattr(before, notion), getattr(after, notion))
    ]


def _budget(name: str, old: DeviceBudget | None, new: DeviceBudget | None) -> list[Relaxation]:
    """A budget may be added or tightened, never lifted, raised or spread over a shorter window."""
    if old is None or old == new:
        return []
    if new is None:
        return [Relaxation(name, old.model_dump(), None)]
    lifted = [
        (f"{name}.{field}", before, after)
        for field, before, after in (
            ("lifetime_eps", old.lifetime_eps, new.lifetime_eps),
            ("window_eps", old.window_eps, new.window_eps),
        )
        if before is not None and (after is None or _more(before, after))
    ]
    if old.window_seconds is not None and (new.window_seconds or 0) < old.window_seconds:
        lifted.append((f"{name}.window_seconds", old.window_seconds, new.window_seconds))
    return [Relaxation(field, before, after) for field, before, after in lifted]


def relaxations(old: ChannelTerms, new: ChannelTerms) -> list[Relaxation]:
    """What ``new`` relaxes of the accepted ``old`` (empty: ``new`` is as strong or stronger).

    Weaker: a different mechanism, parameters with a larger local ε in any notion (or that
    cannot be ordered), a larger δ, ``eps_cr`` or ``delta_cr`` (less randomized deletion,
    ESA-revisited Theorem V.1), a lower ``min_crowd``, shorter epochs, a budget lifted, raised
    or over a shorter window; changed fragment bounds, payload size or crowds cannot be ordered.
    """
    found = _local(old, new)
    for name in ("delta", "eps_cr", "delta_cr"):
        if _more(getattr(old, name), getattr(new, name)):
            found.append(Relaxation(name, getattr(old, name), getattr(new, name)))
    for name in ("min_crowd", "epoch_seconds"):
        if getattr(new, name) < getattr(old, name):
            found.append(Relaxation(name, getattr(old, name), getattr(new, name)))
    for name in ("min_fragments", "max_fragments", "payload_size", "crowds"):
        if getattr(new, name) != getattr(old, name):
            found.append(Relaxation(name, getattr(old, name), getattr(new, name)))
    found += _budget("budget", old.budget, new.budget)
    return found + _budget("device_budget", old.device_budget, new.device_budget)
