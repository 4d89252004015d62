"""The one interface every LDP mechanism implements, and what crosses it.

Modelled on libprio-rs's ``Vdaf`` trait: a mechanism encodes on the device, accumulates and
estimates on the analyzer, states its local privacy and the typed privacy description
accounting certifies. The SDK, the analyzer and the tools are generic over it and never
branch on a mechanism's name; a new mechanism is one module plus one
:func:`common.mechanisms.registry.register` call. Every ε names its neighbouring notion:
removal (against the "no data" report, ESA-revisited Definition II.4) or replacement.

Roles of each method: docs/mechanisms.md, "The interface".
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from common.accounting import (
    BoundResult,
    Certification,
    Epoch,
    LocalRandomizer,
    basic_composition,
    certify,
    compose_with_deletion,
)
from common.accounting.lifetime import mechanism_epoch
from common.mechanisms._estimates import Estimate, FloatArray
from common.randomness import RandomSource

#: Device state a mechanism keeps between reports (persisted by the SDK as JSON).
DeviceState = dict[str, Any]


class Accumulator(Protocol):
    """Sufficient statistics of a channel that merge across batches and persist."""

    @property
    def n(self) -> int:
        """Contributions (or users) the statistics are based on."""
        ...

    def merge(self, other: Self) -> Self:
        """Sum of two accumulators of the same channel."""
        ...

    def to_bytes(self) -> bytes:
        """Pickle-free serialization."""
        ...


P = TypeVar("P")
A = TypeVar("A", bound=Accumulator)


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


@dataclass(frozen=True)
class Received(Generic[A]):
    """What the analyzer holds for one (epoch, shuffler): batch sizes and their statistics.

    Attributes:
        epoch: The epoch.
        shuffler_id: The shuffler whose batches these are.
        batches: ``n_contributions`` of each batch received (each shuffled separately).
        accumulator: The merged statistics of those batches.
        source: The shuffler's position among the registered ones.
    """

    epoch: int
    shuffler_id: str
    batches: tuple[int, ...]
    accumulator: A
    source: BatchContext


@dataclass(frozen=True)
class ReleaseCertificate:
    """A release's privacy statements over the crowds it was computed from.

    Attributes:
        certified: The certificate in the mechanism's natural notion.
        other: The same release in the other neighbouring notion.
        lower: A lower bound where one is known (never certified).
        crowds: The crowds the certificate relies on, by ``"<epoch>/<batch>"``.
        epochs: Epochs composed.
    """

    certified: BoundResult
    other: BoundResult
    lower: BoundResult | None
    crowds: dict[str, int]
    epochs: int

    def with_deletion(self, eps_cr: float, delta_cr: float) -> BoundResult:
        """Add/remove guarantee including randomized deletion (ESA-revisited Theorem V.1).

        Each composed epoch's batch carries a crowd count made (ε_cr, δ_cr)-DP by
        Algorithm 3, composed by basic composition over the epochs.
        """
        replacement = self.certified if self.certified.neighbouring == "replacement" else self.other
        return compose_with_deletion(replacement, eps_cr * self.epochs, delta_cr * self.epochs)


#: How often an honest batch's crowd may be cut by :meth:`FragmentCount.verified_crowd` (its
#: fragments falling so far below their mean that a smaller crowd explains them better): once
#: in 10^9 batches, and then by a few contributions only.
CROWD_CHECK_ALPHA = 1e-9


@dataclass(frozen=True, slots=True)
class FragmentCount:
    """How many fragments one contribution to one shuffler carries: what the analyzer can
    verify of the crowd a shuffler claims for its batch.

    Attributes:
        minimum, maximum: Bounds that hold for every honest contribution (equal when the
            mechanism fixes the count, e.g. one k-RR report per contribution).
        mean, variance: The count's law when it is random but data-independent in
            distribution (PROTOCOL.md, "Fixed sizes"); None when nothing more is known.
    """

    minimum: int
    maximum: int
    mean: float | None = None
    variance: float | None = None

    @classmethod
    def exactly(cls, count: int) -> FragmentCount:
        """A mechanism whose every contribution carries ``count`` fragments."""
        return cls(count, count, float(count), 0.0)

    @property
    def fixed(self) -> bool:
        """Whether the count is the same for every contribution."""
        return self.minimum == self.maximum

    def largest_crowd(self, valid: int, alpha: float = CROWD_CHECK_ALPHA) -> int | None:
        """The largest crowd whose honest contributions could have carried as few as ``valid``
        valid fragments except with probability ``alpha`` (None: no bound).

        Bernstein's inequality for the lower tail of a sum of n independent counts in
        ``[minimum, maximum]`` with this mean and variance: P(S_n <= nμ - t) <=
        exp(-t² / (2(nσ² + b t / 3))) with b = μ - minimum; a crowd n is ruled out when that
        bound at t = nμ - valid is below ``alpha``. The exponent grows with n, so the largest
        crowd not ruled out is found by bisection.
        """
        bounds = [valid // self.minimum] if self.minimum > 0 else []
        if self.mean is not None and self.variance is not None and self.mean > 0:
            bounds.append(self._bernstein_crowd(valid, alpha))
        return min(bounds) if bounds else None

    def _bernstein_crowd(self, valid: int, alpha: float) -> int:
        mean, var = float(self.mean or 0.0), float(self.variance or 0.0)
        spread, limit = mean - self.minimum, math.log(1.0 / alpha)

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

    def verified_crowd(self, claimed: int, valid: int, invalid: int) -> int:
        """The crowd a batch's certificate and estimate may rest on.

        A shuffler's ``claimed`` crowd, less the contributions the fragments that failed to
        open or parse can have filled (one per :attr:`maximum` of them: a contribution carries
        no more, so a client that sends garbage costs an honest batch one contribution, not
        one per fragment), and no more than the valid fragments can come from
        (:meth:`largest_crowd`, which is what holds a lying shuffler to its fragments); at
        least 1 while any valid fragment is in, since its contribution then reaches the
        release; none when no fragment is valid (nothing of the batch reaches a release).
        """
        if valid == 0:
            return 0
        crowd = claimed - (math.ceil(invalid / self.maximum) if self.maximum else invalid)
        largest = self.largest_crowd(valid)
        if largest is not None:
            crowd = min(crowd, largest)
        return max(crowd, 1)


@dataclass(frozen=True, slots=True)
class PrivacyDescription:
    """A channel's reports for accounting: the privacy argument and the ε0 it is taken at."""

    randomizer: LocalRandomizer
    eps0: float

    def certify(self, n: int, delta: float) -> Certification:
        """The certificate of one shuffled batch of ``n`` contributions."""
        return certify(self.randomizer, self.eps0, n, delta)

    def epoch(
        self,
        n: int,
        delta: float,
        *,
        deletion: tuple[float, float] | None = None,
        replacement: bool = False,
    ) -> Epoch | None:
        """One epoch at crowd ``n`` as its tightest dominating pair at ``delta`` (None when
        the argument has none), as :func:`common.accounting.lifetime.mechanism_epoch`."""
        return mechanism_epoch(
            self.randomizer, self.eps0, n, delta, deletion=deletion, replacement=replacement
        )


class NoDataError(LookupError):
    """Nothing received that a release could be computed from (the message says what)."""


class Mechanism(ABC, Generic[P, A]):
    """An LDP mechanism: device encoding, analyzer accumulation, estimate and privacy.

    Class attributes:
        name: Registry name, used in channel configs (``mechanism``).
        code: Wire mechanism code (byte 2 of every inner plaintext, PROTOCOL.md).
        payload_size: Bytes of the mechanism payload after the 2-byte frame.
        value_kind: What an app reports (:class:`ValueKind`).
        randomizer_type: The :class:`~common.accounting.LocalRandomizer` subclass that
            :meth:`privacy` returns, for tools that fill its fields from flags (``esa
            account --mechanism``); None when no such flags describe the mechanism.
    """

    name: ClassVar[str]
    code: ClassVar[int]
    payload_size: ClassVar[int]
    value_kind: ClassVar[ValueKind] = ValueKind.CATEGORY
    randomizer_type: ClassVar[type[LocalRandomizer] | None] = None

    # --- configuration ------------------------------------------------------------------

    @abstractmethod
    def parse_params(self, raw: Mapping[str, Any]) -> P:
        """Validated, immutable parameters from a channel config's ``params``.

        Raises:
            ValueError: naming the bad parameter.
        """

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
        return FragmentCount(0, self.fragment_limit(params))

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

    # --- the analyzer -------------------------------------------------------------------

    @abstractmethod
    def new_accumulator(self, params: P) -> A:
        """Empty sufficient statistics."""

    @abstractmethod
    def load_accumulator(self, params: P, data: bytes) -> A:
        """Inverse of the accumulator's ``to_bytes``."""

    @abstractmethod
    def accumulate(
        self,
        params: P,
        accumulator: A,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        """Fold one batch's opened fragments in; returns how many were invalid (chaff)."""

    @abstractmethod
    def estimate(self, params: P, accumulator: A) -> Estimate:
        """Debiased estimates with standard errors."""

    @abstractmethod
    def local_privacy(self, params: P) -> LocalPrivacy:
        """What one device's report reveals with no shuffling at all."""

    @abstractmethod
    def privacy(self, params: P) -> PrivacyDescription:
        """The privacy argument that covers one report of this channel in a shuffled batch (a
        mechanism whose device sends several reports per batch composes them in
        :meth:`certify` and :meth:`epoch_pair`)."""

    def bin_count_law(self, params: P, value: int, bins: tuple[int, int]) -> FloatArray | None:
        """Exact joint law of how many fragments of one report of ``value`` name each of two
        bins (entry [i, j]: i name ``bins[0]`` and j name ``bins[1]``), which the shuffler
        audit's distinguishing game is fitted to; None when reports do not name bins."""
        return None

    @abstractmethod
    def certify(
        self, params: P, delta: float, received: Sequence[Received[A]]
    ) -> ReleaseCertificate:
        """Certified central (ε, δ) of a release computed from ``received``.

        Raises:
            NoDataError: nothing in ``received`` a certificate can rest on.
        """

    def epoch_pair(
        self,
        params: P,
        n: int,
        delta: float,
        *,
        deletion: tuple[float, float] | None = None,
        replacement: bool = False,
    ) -> Epoch | None:
        """One epoch for lifetime composition: the shuffled epoch's dominating pair at crowd ``n``.

        The pair of the :meth:`privacy` description (FMT21 Remark 3.5, eq. (20); the blanket pair
        for binary and k-ary RR) at ``delta``, the epoch's share of the lifetime δ; ``n`` is counted
        as :meth:`certify` counts it. ``deletion`` = (ε_cr, δ_cr) gives the add/remove statement
        (ESA-revisited Theorem V.1); ``replacement`` the replacement notion. None: no dominating
        pair (Balcer–Cheu, fragments across batches), so the epoch enters as its certificate.
        """
        return self.privacy(params).epoch(n, delta, deletion=deletion, replacement=replacement)


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


def epoch_batches(received: Sequence[Received[Any]]) -> dict[int, dict[str, int]]:
    """Batch crowds per epoch, keyed ``"<shuffler>#<i>"`` (each batch shuffled alone)."""
    per_epoch: dict[int, dict[str, int]] = {}
    for item in received:
        for i, n in enumerate(item.batches):
            per_epoch.setdefault(item.epoch, {})[f"{item.shuffler_id}#{i}"] = n
    return per_epoch


def compose_epochs(results: Sequence[BoundResult]) -> BoundResult:
    """Basic composition over epochs (one contribution per user per epoch)."""
    if len(results) == 1:
        return results[0]
    total = basic_composition([(r.eps, r.delta) for r in results])
    first = results[0]
    return BoundResult(
        eps=total.eps,
        delta=total.delta,
        method=first.method,
        neighbouring=first.neighbouring,
        inputs=first.inputs,
        valid_regime=all(r.valid_regime for r in results),
        note=f"basic composition over {len(results)} epochs",
    )


def certify_smallest_batch(
    received: Sequence[Received[Any]], certify_at: Callable[[int], Certification]
) -> ReleaseCertificate:
    """Histogram releases: each batch is shuffled alone, so a user's report hides in its own
    batch — certify each epoch at its smallest batch, and compose the epochs."""
    per_epoch = epoch_batches(received)
    if not per_epoch:
        raise NoDataError("no batch received")
    certs = [certify_at(min(c.values())) for c in per_epoch.values()]
    crowds = {f"{e}/{k}": v for e, c in per_epoch.items() for k, v in c.items()}
    return ReleaseCertificate(
        certified=compose_epochs([c.certified for c in certs]),
        other=compose_epochs([c.other_notion for c in certs]),
        lower=certs[0].lower if len(certs) == 1 else None,
        crowds=crowds,
        epochs=len(per_epoch),
    )
