"""The one interface every LDP mechanism implements, and what crosses it.

Modelled on libprio-rs's ``Vdaf`` trait: a mechanism encodes on the device, accumulates and
estimates on the analyzer, states its local privacy and the typed privacy description
accounting certifies. The SDK, the analyzer and the tools are generic over it and never
branch on a mechanism's name; a new mechanism is one module plus one
:func:`common.mechanisms.registry.register` call. Every ε names its neighbouring notion:
removal (against the "no data" report, ESA-revisited Definition II.4) or replacement.

:class:`Mechanism` is the device facet (:class:`common.mechanisms.device.DeviceMechanism`:
parameters, encoding, state, fragment counts, local privacy) plus the analyzer's and the
privacy facets, which load numpy and :mod:`common.accounting`; a device imports the first
only. Roles of each method: docs/mechanisms.md, "The interface".
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
from common.mechanisms.device import BatchContext, BoundDevice, DeviceMechanism, P


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


A = TypeVar("A", bound=Accumulator)
#: The training facet's parameters and accumulators, which it only takes (:class:`Training`).
P_in = TypeVar("P_in", contravariant=True)
A_in = TypeVar("A_in", contravariant=True)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingStep:
    """One server step of an iterative mechanism (ESA-revisited Algorithm 5, lines 4–6).

    Attributes:
        theta: The new model θ_{t+1} (θ_t unchanged when ``used`` is 0).
        used: Reports of round t the step used (m).
        refused: Reports naming another round (a stale or forged model): left out.
        contributions: Contributions in the batches consumed.
        gradient_norm: L2 norm of the noisy gradient g_t (0 when nothing was used).
    """

    theta: FloatArray
    used: int
    refused: int
    contributions: int
    gradient_norm: float


class Training(Protocol[P_in, A_in]):
    """The facet an iterative mechanism offers the analyzer (:meth:`Mechanism.training`): the
    model devices train at is published in the channel's ``params``, and each step folds the
    reports of the current round into the next model. The analyzer keeps the round, θ and the
    steps taken, for any mechanism that offers it; it never names one."""

    def initial_model(self, params: P_in) -> FloatArray:
        """θ_0."""
        ...

    def step(
        self, params: P_in, theta: FloatArray, round_: int, accumulators: Sequence[A_in]
    ) -> TrainingStep:
        """θ_{t+1} from the reports of round ``round_`` in ``accumulators``."""
        ...

    def model_params(self, round_: int, theta: FloatArray) -> dict[str, Any]:
        """The keys the signed config adds to the channel's ``params`` for round ``round_``."""
        ...


@dataclass(frozen=True, slots=True)
class BoundTraining(Generic[P, A]):
    """A mechanism's :class:`Training` facet with one channel's parameters bound."""

    facet: Training[P, A]
    params: P

    def initial_model(self) -> FloatArray:
        """θ_0."""
        return self.facet.initial_model(self.params)

    def step(self, theta: FloatArray, round_: int, accumulators: Sequence[A]) -> TrainingStep:
        """θ_{t+1} from the reports of round ``round_`` (:meth:`Training.step`)."""
        return self.facet.step(self.params, theta, round_, accumulators)

    def model_params(self, round_: int, theta: FloatArray) -> dict[str, Any]:
        """What the signed config publishes in the channel's ``params`` at round ``round_``."""
        return self.facet.model_params(round_, theta)


class NoDataError(LookupError):
    """Nothing received that a release could be computed from (the message says what)."""


class Mechanism(DeviceMechanism[P], Generic[P, A]):
    """An LDP mechanism: its device facet (:class:`~common.mechanisms.device.DeviceMechanism`)
    plus analyzer accumulation, estimate and the privacy argument.

    Class attributes (beside the device facet's):
        randomizer_type: The :class:`~common.accounting.LocalRandomizer` subclass that
            :meth:`privacy` returns, for tools that fill its fields from flags (``esa
            account --mechanism``); None when no such flags describe the mechanism.
    """

    randomizer_type: ClassVar[type[LocalRandomizer] | None] = None

    def bind(self, raw: Mapping[str, Any]) -> BoundMechanism[P, A]:
        """This mechanism with a channel's ``params`` parsed and bound, for the analyzer and
        accounting (:class:`BoundMechanism`).

        Raises:
            ValueError: naming the bad parameter (TypeError: not a mapping of the right types).
        """
        return BoundMechanism(mechanism=self, params=self.parse_params(raw))

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

    def bin_count_law(self, params: P, value: int, bins: tuple[int, int]) -> FloatArray | None:
        """Exact joint law of how many fragments of one report of ``value`` name each of two
        bins (entry [i, j]: i name ``bins[0]`` and j name ``bins[1]``), which the shuffler
        audit's distinguishing game is fitted to; None when reports do not name bins."""
        return None

    def training(self) -> Training[P, A] | None:
        """The iterative facet (:class:`Training`) of a mechanism whose devices train a model
        the analyzer publishes; None for the others (every histogram mechanism)."""
        return None

    # --- privacy ------------------------------------------------------------------------

    @abstractmethod
    def privacy(self, params: P) -> PrivacyDescription:
        """The privacy argument that covers one report of this channel in a shuffled batch (a
        mechanism whose device sends several reports per batch composes them in
        :meth:`certify` and :meth:`epoch_pair`)."""

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


@dataclass(frozen=True, kw_only=True)
class BoundMechanism(BoundDevice[P], Generic[P, A]):
    """A whole mechanism with one channel's parameters bound (:meth:`Mechanism.bind`, or
    :func:`common.mechanisms.registry.build`): the device role plus the analyzer's
    accumulation and estimate and the privacy argument, no method taking parameters.

    Attributes:
        mechanism: The registered mechanism.
        params: Its validated parameters for this channel.
    """

    mechanism: Mechanism[P, A]

    def new_accumulator(self) -> A:
        """Empty sufficient statistics."""
        return self.mechanism.new_accumulator(self.params)

    def load_accumulator(self, data: bytes) -> A:
        """Inverse of the accumulator's ``to_bytes``."""
        return self.mechanism.load_accumulator(self.params, data)

    def accumulate(
        self, accumulator: A, fragments: Sequence[bytes], n_contributions: int, batch: BatchContext
    ) -> int:
        """Fold one batch's opened fragments in; returns how many were invalid (chaff)."""
        return self.mechanism.accumulate(
            self.params, accumulator, fragments, n_contributions, batch
        )

    def estimate(self, accumulator: A) -> Estimate:
        """Debiased estimates with standard errors."""
        return self.mechanism.estimate(self.params, accumulator)

    def bin_count_law(self, value: int, bins: tuple[int, int]) -> FloatArray | None:
        """Joint law of one report's fragments naming two bins (:meth:`Mechanism.bin_count_law`)."""
        return self.mechanism.bin_count_law(self.params, value, bins)

    @property
    def training(self) -> BoundTraining[P, A] | None:
        """The channel's iterative facet (:meth:`Mechanism.training`), None if it has none."""
        facet = self.mechanism.training()
        return None if facet is None else BoundTraining(facet, self.params)

    def privacy(self) -> PrivacyDescription:
        """The privacy argument that covers one report in a shuffled batch."""
        return self.mechanism.privacy(self.params)

    def certify(self, delta: float, received: Sequence[Received[A]]) -> ReleaseCertificate:
        """Certified central (ε, δ) of a release computed from ``received``.

        Raises:
            NoDataError: nothing in ``received`` a certificate can rest on.
        """
        return self.mechanism.certify(self.params, delta, received)

    def epoch_pair(
        self,
        n: int,
        delta: float,
        *,
        deletion: tuple[float, float] | None = None,
        replacement: bool = False,
    ) -> Epoch | None:
        """One epoch's dominating pair at crowd ``n`` (:meth:`Mechanism.epoch_pair`)."""
        return self.mechanism.epoch_pair(
            self.params, n, delta, deletion=deletion, replacement=replacement
        )


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
