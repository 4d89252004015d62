"""The device facet of every LDP mechanism: what a device needs to report, and nothing more.

A mechanism's device facet (:class:`DeviceMechanism`) validates its parameters, encodes a
value into fixed-size fragments, keeps the device state it needs, says how many fragments a
contribution carries (what the analyzer verifies crowds against) and what one report reveals
locally (:class:`LocalPrivacy`, closed forms). The SDK and the shufflers' term checks need only
this facet; the analyzer's accumulation and estimate and the privacy argument accounting
certifies are :class:`common.mechanisms.base.Mechanism`, a subclass. The facets import neither
numpy nor :mod:`common.accounting` (nor scipy) when they load (LDP-SGD's vector arithmetic,
:mod:`common.mechanisms.device._ldpsgd`, loads numpy with its first report), so ``import
encoder_client`` stays small (docs/sdk.md, "What importing costs"; the split:
docs/mechanisms.md, "The interface").

Every ε names its neighbouring notion: removal (against the "no data" report, ESA-revisited
Definition II.4) or replacement.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar

from common.randomness import RandomSource

#: Device state a mechanism keeps between reports (persisted by the SDK as JSON).
DeviceState = dict[str, Any]

P = TypeVar("P")


class ValueKind(StrEnum):
    """What an app hands the SDK for one report.

    ``category``: an integer in ``[0, domain_size)`` (histograms); ``state``: whether a 0/1
    state changed at a period (longitudinal channels, :class:`StateUpdate`).
    """

    CATEGORY = "category"
    STATE = "state"


@dataclass(frozen=True, slots=True)
class StateUpdate:
    """One period of a 0/1 state: ``changed`` says whether it flipped at ``period``."""

    period: int
    changed: bool


class MechanismError(ValueError):
    """A value or device state the mechanism cannot encode (the message names it)."""


class StateConflictError(MechanismError):
    """The saved device state cannot be used (drawn for other parameters, or corrupted).

    Redrawing it would void the mechanism's privacy argument: treat the device as new.
    """


class StaleUpdateError(MechanismError):
    """A state update for a period at or before the last one reported."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """One report, ready to seal.

    Attributes:
        routes: ``(shuffler slot, fragments)`` pairs; slot ``None`` lets the SDK pick a
            shuffler, an integer ``i`` sends to shuffler ``i mod K`` (report fragments).
            Empty when this period has nothing to send.
        state: The device state to persist after this report (``None``: the mechanism keeps
            none).
    """

    routes: tuple[tuple[int | None, tuple[bytes, ...]], ...]
    state: DeviceState | None = None


@dataclass(frozen=True, slots=True)
class BatchContext:
    """Where a batch came from: the shuffler's position among the K registered ones."""

    shuffler_index: int
    shuffler_count: int


#: How often an honest batch's verified crowd may exceed its true crowd
#: (:meth:`FragmentCount.smallest_crowd`: its fragments rising so far above their mean that a
#: larger crowd explains them better): once in 10^9 batches, and then by a few contributions.
CROWD_CHECK_ALPHA = 1e-9


@dataclass(frozen=True, slots=True)
class FragmentCount:
    """How many fragments one contribution to one shuffler carries: what the analyzer can
    verify of the crowd a shuffler claims for its batch.

    Attributes:
        minimum, maximum: Bounds that hold for every honest contribution (equal when the
            mechanism fixes the count, e.g. one k-RR report per contribution).
        mean, variance: The count's law when it is random but data-independent in
            distribution (docs/protocol.md, "Fixed sizes"); None when nothing more is known.
        piece: When the count is a sum of independent pieces (k-RAPPOR's k bits), the most
            fragments one piece carries: Bernstein's range term, far tighter than the whole
            count's range at small crowds; None: the count is one piece.
        honest_maximum: The most fragments an honest contribution carries (the mechanism's own
            law) when ``maximum`` was widened to what shufflers take from any client: the
            range term of a one-piece count then comes from the law, so a fixed law (one k-RR
            report) verifies its crowd exactly; None: ``maximum`` is the law's.
    """

    minimum: int
    maximum: int
    mean: float | None = None
    variance: float | None = None
    piece: int | None = field(default=None, kw_only=True)
    honest_maximum: int | None = field(default=None, kw_only=True)

    @classmethod
    def exactly(cls, count: int) -> FragmentCount:
        """A mechanism whose every contribution carries ``count`` fragments."""
        return cls(minimum=count, maximum=count, mean=float(count), variance=0.0)

    def accepting(self, max_fragments: int) -> FragmentCount:
        """This law as a channel taking up to ``max_fragments`` fragments from any client
        (what shufflers enforce): ``maximum`` widened, the law's own kept as
        :attr:`honest_maximum`."""
        return replace(self, maximum=max_fragments, honest_maximum=self.maximum)

    @property
    def fixed(self) -> bool:
        """Whether the count is the same for every contribution."""
        return self.minimum == self.maximum

    def smallest_crowd(self, valid: int, alpha: float = CROWD_CHECK_ALPHA) -> int:
        """A lower confidence bound on the crowd behind ``valid`` distinct valid fragments:
        the smallest crowd whose honest contributions carry that many except with probability
        ``alpha``.

        Always at least ``valid // maximum`` (no contribution carries more; rounded down, so
        a batch short of a whole contribution is never counted up; exact for a fixed count).
        With a known mean μ and variance σ², Bernstein's inequality for the upper tail of a sum
        of n independent counts at most ``maximum``: P(S_n >= nμ + t) <= exp(-t² / (2(nσ² +
        b t / 3))) with b = :attr:`piece` (each independent summand of the sum exceeds its
        mean by less), or maximum - μ when the count is one piece, its
        honest maximum when one is known (a client's contribution above the law is no chance
        event to bound: it counts as the contributions its fragments explain, never above the
        claim); a crowd n is ruled out
        when that bound at t = valid - nμ is below ``alpha``. Ruled-out crowds are exactly
        those below a root of a quadratic in n, so the smallest one not ruled out is found by
        bisection. A smaller crowd only makes a certified ε larger: the bound errs on the safe side.
        """
        if self.maximum <= 0:
            return 0
        floor = valid // self.maximum
        if self.fixed or self.mean is None or self.variance is None or self.mean <= 0:
            return floor
        return max(floor, self._bernstein_crowd(valid, alpha))

    def _bernstein_crowd(self, valid: int, alpha: float) -> int:
        mean, var = float(self.mean or 0.0), float(self.variance or 0.0)
        top = self.maximum if self.honest_maximum is None else self.honest_maximum
        spread = float(self.piece) if self.piece is not None else max(0.0, top - mean)
        limit = math.log(1.0 / alpha)

        def ruled_out(n: int) -> bool:
            t = valid - n * mean
            return t > 0 and t * t > 2.0 * limit * (n * var + spread * t / 3.0)

        low, high = -1, math.ceil(valid / mean)  # high is never ruled out (t <= 0 there)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if ruled_out(middle) else (low, middle)
        return high

    def largest_crowd(self, valid: int, alpha: float = CROWD_CHECK_ALPHA) -> int | None:
        """An upper confidence bound on the crowd behind ``valid`` distinct valid fragments
        (None: no bound): the largest crowd whose honest contributions could have carried as
        few except with probability ``alpha``. At most ``valid // minimum`` when every
        contribution carries at least one; with a known mean and variance, Bernstein's
        inequality for the lower tail, P(S_n <= nμ - t) <= exp(-t² / (2(nσ² + b t / 3))), b
        as in :meth:`smallest_crowd` (or μ - minimum); the exponent grows with n, so the
        largest crowd not ruled out is found by bisection."""
        bounds = [valid // self.minimum] if self.minimum > 0 else []
        known = self.mean is not None and self.variance is not None
        if not self.fixed and known and (self.mean or 0.0) > 0:
            bounds.append(self._lower_tail_crowd(valid, alpha))
        return min(bounds) if bounds else None

    def _lower_tail_crowd(self, valid: int, alpha: float) -> int:
        mean, var = float(self.mean or 0.0), float(self.variance or 0.0)
        spread = float(self.piece) if self.piece is not None else max(0.0, mean - self.minimum)
        limit = math.log(1.0 / alpha)

        def ruled_out(n: int) -> bool:
            t = n * mean - valid
            return t > 0 and t * t > 2.0 * limit * (n * var + spread * t / 3.0)

        low, high = 0, max(1, math.ceil(valid / mean))
        while not ruled_out(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if ruled_out(middle) else (middle, high)
        return low

    def estimated_crowd(self, claimed: int, valid: int, invalid: int) -> int:
        """The crowd a batch's estimate rests on (the n its estimator subtracts the noise of):
        the shuffler's claim, less what its invalid fragments can have filled, held within
        the confidence interval its distinct valid fragments give ([:meth:`verified_crowd`,
        :meth:`largest_crowd`]). An honest batch's claim is its true crowd, so its estimate is
        unbiased; the lower bound, which the certificate needs, would bias every bin of a
        debiased histogram by the crowd it leaves out. None of the batch counts without a
        valid fragment."""
        if valid == 0:
            return 0
        crowd = max(claimed - self._filled(invalid), self.verified_crowd(claimed, valid, invalid))
        largest = self.largest_crowd(valid)
        return max(crowd if largest is None else min(crowd, largest), 1)

    def _filled(self, invalid: int) -> int:
        """Contributions ``invalid`` fragments can have filled: one per :attr:`maximum`."""
        return math.ceil(invalid / self.maximum) if self.maximum else invalid

    def verified_crowd(self, claimed: int, valid: int, invalid: int) -> int:
        """The crowd a batch's certificate and ``min_crowd`` check rest on: what its distinct
        valid fragments prove (:meth:`smallest_crowd`), never the claim.

        No more than a shuffler's ``claimed`` crowd less the contributions the fragments that
        failed to open, parse or repeated can have filled (one per :attr:`maximum` of them: a
        contribution carries no more, so a client that sends garbage costs an honest batch one
        contribution, not one per fragment); at least 1 while any valid fragment is in, since
        its contribution then reaches the release; none when no fragment is valid (nothing of
        the batch reaches a release).
        """
        if valid == 0:
            return 0
        return max(min(claimed - self._filled(invalid), self.smallest_crowd(valid)), 1)


@dataclass(frozen=True, slots=True)
class LocalPrivacy:
    """Local ε of one device's report, in both neighbouring notions.

    Attributes:
        removal: ε against the reference "no data" report (ESA-revisited Definition II.4).
        replacement: ε against any other value.
        eps_l_inf: Removal ε when an adversary sees every fragment (ESA-revisited §VII).
        eps_l1: Removal ε when an adversary sees a single fragment.
        note: What the numbers mean for this mechanism.
    """

    removal: float
    replacement: float
    eps_l_inf: float
    eps_l1: float
    note: str = ""


class DeviceMechanism(ABC, Generic[P]):
    """An LDP mechanism as a device sees it: parameters, encoding, state, fragment counts and
    local privacy (the analyzer and privacy facets: :class:`common.mechanisms.base.Mechanism`).

    Class attributes:
        name: Registry name, used in channel configs (``mechanism``).
        code: Wire mechanism code (byte 2 of every inner plaintext, docs/protocol.md).
        payload_size: Bytes of the mechanism payload after the 2-byte frame.
        value_kind: What an app reports (:class:`ValueKind`).
        shuffle_only: The mechanism gives no local privacy by design (a user's own messages
            reveal its value; all of its privacy is the shuffle's, e.g. Balcer–Cheu's
            zero-sum histogram), whatever its parameters; never inferred from an infinite ε.
    """

    name: ClassVar[str]
    code: ClassVar[int]
    payload_size: ClassVar[int]
    value_kind: ClassVar[ValueKind] = ValueKind.CATEGORY
    shuffle_only: ClassVar[bool] = False

    # --- configuration ------------------------------------------------------------------

    @abstractmethod
    def parse_params(self, raw: Mapping[str, Any]) -> P:
        """Validated, immutable parameters from a channel config's ``params``.

        Raises:
            ValueError: naming the bad parameter.
        """

    def bind(self, raw: Mapping[str, Any]) -> BoundDevice[P]:
        """This mechanism with a channel's ``params`` parsed and bound: what callers use, so
        parameters are validated once per channel and no method call passes them again.

        Raises:
            ValueError: naming the bad parameter (TypeError: not a mapping of the right types).
        """
        return BoundDevice(mechanism=self, params=self.parse_params(raw))

    @abstractmethod
    def domain_size(self, params: P) -> int:
        """Bins of an estimate (values for histograms, periods for longitudinal channels)."""

    def fragment_limit(self, params: P) -> int:
        """The most fragments one contribution can carry (default 1), for sizing a channel's
        ``max_fragments``: a contribution above that is refused for good."""
        return 1

    def fragment_count(self, params: P, batch: BatchContext) -> FragmentCount:
        """How many fragments one contribution to the shuffler at ``batch`` carries: what the
        analyzer verifies a batch's claimed crowd against. A fixed count makes the crowd exact
        (a batch whose fragments disagree is refused); a known mean and variance bound it
        statistically (:meth:`FragmentCount.verified_crowd`). The default knows only the
        bounds ``[0, fragment_limit]``."""
        return FragmentCount(minimum=0, maximum=self.fragment_limit(params))

    # --- the device ---------------------------------------------------------------------

    def new_state(self, params: P, rng: RandomSource) -> DeviceState | None:
        """A new device's state for this channel; ``None`` if the mechanism keeps none."""
        return None

    @abstractmethod
    def encode(
        self,
        params: P,
        value: Any,
        state: DeviceState | None,
        rng: RandomSource,
        shufflers: int,
    ) -> Encoded:
        """One report of ``value`` (validated here), with the OS CSPRNG unless a test seeds.

        Raises:
            MechanismError: a value outside the domain, or unusable state.
        """

    @abstractmethod
    def local_privacy(self, params: P) -> LocalPrivacy:
        """What one device's report reveals with no shuffling at all (a closed form: the SDK
        checks it against the app's caps and the pinned terms, and charges it to the device
        budget, at every report)."""


@dataclass(frozen=True, kw_only=True)
class BoundDevice(Generic[P]):
    """A device mechanism with one channel's parameters bound (:meth:`DeviceMechanism.bind`,
    or :func:`common.mechanisms.registry.build_device`): the device role of a channel, its
    methods taking no parameters (as libprio-rs's ``Vdaf`` instances carry theirs).

    Attributes:
        mechanism: The registered mechanism.
        params: Its validated parameters for this channel.
    """

    mechanism: DeviceMechanism[P]
    params: P

    @property
    def name(self) -> str:
        """Registry name."""
        return self.mechanism.name

    @property
    def code(self) -> int:
        """Wire mechanism code."""
        return self.mechanism.code

    @property
    def payload_size(self) -> int:
        """Bytes of the mechanism payload after the 2-byte frame."""
        return self.mechanism.payload_size

    @property
    def value_kind(self) -> ValueKind:
        """What an app reports."""
        return self.mechanism.value_kind

    @property
    def shuffle_only(self) -> bool:
        """No local privacy by design (:attr:`DeviceMechanism.shuffle_only`)."""
        return self.mechanism.shuffle_only

    def domain_size(self) -> int:
        """Bins of an estimate (:meth:`DeviceMechanism.domain_size`)."""
        return self.mechanism.domain_size(self.params)

    def fragment_limit(self) -> int:
        """The most fragments one contribution can carry."""
        return self.mechanism.fragment_limit(self.params)

    def fragment_count(self, batch: BatchContext) -> FragmentCount:
        """How many fragments one contribution to the shuffler at ``batch`` carries."""
        return self.mechanism.fragment_count(self.params, batch)

    def new_state(self, rng: RandomSource) -> DeviceState | None:
        """A new device's state for this channel; ``None`` if the mechanism keeps none."""
        return self.mechanism.new_state(self.params, rng)

    def encode(
        self, value: Any, state: DeviceState | None, rng: RandomSource, shufflers: int
    ) -> Encoded:
        """One report of ``value`` (:meth:`DeviceMechanism.encode`).

        Raises:
            MechanismError: a value outside the domain, or unusable state.
        """
        return self.mechanism.encode(self.params, value, state, rng, shufflers)

    def local_privacy(self) -> LocalPrivacy:
        """What one report reveals with no shuffling (:meth:`DeviceMechanism.local_privacy`)."""
        return self.mechanism.local_privacy(self.params)
