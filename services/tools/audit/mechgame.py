"""Check 8 for the default channels' mechanisms: the distinguishing game of
:mod:`~services.tools.audit.game` with canaries that encode with a channel's own mechanism
(k-RAPPOR, report fragments, k-RR, Balcer–Cheu zero-sum) instead of binary RR.

Neighbouring populations differ in the target canary's value (replacement: ``a`` = 0 or ``b`` = 1
after a secret coin, every other canary ``c`` = 2). The view is folded with the mechanism's own
``accumulate`` into ``S_a``, ``S_b``; the distinguishers are ``S_b − S_a ≥ t`` (t from the exact
law, :func:`difference_law`) and "the first fragment naming a or b names b". The Clopper–Pearson
bound (StatDP / DP-Sniper; Steinke, Nasr and Jagielski) is set against the channel's certified
replacement ε from its ``certify``. Longitudinal channels are left out. How the game is built
and why: docs/audit.md, "The privacy game of a default channel's mechanism".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from common.accounting import BoundResult
from common.mechanisms import (
    Accumulator,
    BatchContext,
    BoundMechanism,
    CountAccumulator,
    Received,
    build,
    get,
)
from common.randomness import RandomSource, SeededSource
from common.wire import ChannelConfig
from services.tools.audit.checks import ALPHA, Finding
from services.tools.audit.game import CONFIDENCE, clopper_pearson

FloatArray = npt.NDArray[np.float64]
#: The target's two values (secret 0 and 1) and every other canary's value.
A, B, C = 0, 1, 2
#: Rate bounds of the two distinguishers, jointly at the stated confidence (Bonferroni).
RATES = 4


class GameError(ValueError):
    """A channel whose mechanism the game does not cover, or a malformed saved outcome."""


@dataclass(frozen=True, slots=True)
class MechTrial:
    """One group: the secret, and the view of the released batch (S_a, S_b, first) with
    ``first`` 1 / 0 / −1 when the first fragment naming a or b names b / a / none is there;
    None: no batch released."""

    secret: int
    view: tuple[int, int, int] | None
    n_contributions: int


def _difference(joint: FloatArray) -> tuple[int, FloatArray]:
    """(offset, pmf) of x_b − x_a from the joint law of (x_a, x_b)."""
    rows, cols = joint.shape
    pmf = np.zeros(rows + cols - 1)
    for i in range(rows):
        pmf[rows - 1 - i : rows - 1 - i + cols] += joint[i]
    return -(rows - 1), pmf


def _power(offset: int, pmf: FloatArray, times: int) -> tuple[int, FloatArray]:
    """The law of the sum of ``times`` independent copies (convolution by squaring)."""
    result_offset, result = 0, np.array([1.0])
    while times:
        if times & 1:
            result_offset, result = result_offset + offset, np.convolve(result, pmf)
        times >>= 1
        if times:
            offset, pmf = 2 * offset, np.convolve(pmf, pmf)
    return result_offset, np.clip(result, 0.0, None)


@dataclass(frozen=True)
class MechanismGame:
    """The game for one channel: its mechanism, parameters and δ."""

    channel: str
    mechanism_name: str
    params_json: str
    delta: float

    @classmethod
    def of(cls, config: ChannelConfig) -> MechanismGame:
        """The game of a configured channel.

        Raises:
            GameError: a mechanism the game does not cover (longitudinal: see the module), or
                a domain of fewer than three values.
        """
        game = cls(config.id, config.mechanism, json.dumps(config.params, sort_keys=True),
                   config.delta)  # fmt: skip
        if game.mechanism.bin_count_law(A, (A, B)) is None:
            raise GameError(
                f"channel {config.id!r}: the privacy game covers mechanisms whose reports name "
                f"bins (an exact bin_count_law), not {config.mechanism!r} (a longitudinal "
                "report is a change history across epochs, not one value in one group)"
            )
        if game.mechanism.domain_size() < 3:
            raise GameError(f"channel {config.id!r}: the game needs a domain of >= 3 values")
        return game

    @classmethod
    def named(cls, channel_id: str) -> MechanismGame:
        """The game of a default channel (:data:`services.tools.catalogue.DEFAULT_CHANNELS`).

        Raises:
            GameError: naming the default channels.
        """
        from services.tools.catalogue import DEFAULT_CHANNELS

        config = next((c for c in DEFAULT_CHANNELS if c.id == channel_id), None)
        if config is None:
            known = ", ".join(c.id for c in DEFAULT_CHANNELS if _covered(c))
            raise GameError(f"unknown game channel {channel_id!r}; default channels: {known}")
        return cls.of(config)

    @property
    def mechanism(self) -> BoundMechanism[object, Accumulator]:
        """The channel's mechanism with its parameters bound (built once per game)."""
        return _bound(self.mechanism_name, self.params_json)

    def law(self, value: int) -> FloatArray:
        """Joint law of (fragments naming a, fragments naming b) of one report of ``value``."""
        law = self.mechanism.bin_count_law(value, (A, B))
        assert law is not None, "checked when the game was built"
        return law

    @property
    def fragment_size(self) -> int:
        """Bytes of one mechanism fragment (version, code, payload)."""
        return 2 + self.mechanism.payload_size

    def encode(self, value: int, rng: RandomSource) -> list[bytes]:
        """One report of ``value`` by a new device, every route through the audited shuffler
        (shuffler 0 of 1: report fragments send all τ rows to it)."""
        mechanism = self.mechanism
        encoded = mechanism.encode(value, mechanism.new_state(rng), rng, 1)
        return [fragment for _, fragments in encoded.routes for fragment in fragments]

    def view(self, fragments: Sequence[bytes]) -> tuple[int, int, int]:
        """(S_a, S_b, first) of a released batch's fragments in batch order, folded with the
        mechanism's ``accumulate`` as the analyzer folds them."""
        mechanism, source = self.mechanism, BatchContext(0, 1)
        total = _counts(mechanism.new_accumulator())
        mechanism.accumulate(total, fragments, 0, source)
        first = -1
        if total.counts[A] + total.counts[B] > 0:
            for fragment in fragments:
                single = _counts(mechanism.new_accumulator())
                mechanism.accumulate(single, [fragment], 0, source)
                if single.counts[A] or single.counts[B]:
                    first = int(single.counts[B] > 0)
                    break
        return int(total.counts[A]), int(total.counts[B]), first

    def certified(self, n: int) -> BoundResult:
        """The replacement-notion certificate of one batch of ``n`` from shuffler 0 of 1,
        through the mechanism's ``certify`` as the analyzer calls it."""
        mechanism = self.mechanism
        received = Received(
            epoch=0,
            shuffler_id="audited",
            batches=(n,),
            accumulator=mechanism.new_accumulator(),
            source=BatchContext(0, 1),
        )
        cert = mechanism.certify(self.delta, [received])
        return cert.certified if cert.certified.neighbouring == "replacement" else cert.other

    def describe(self) -> str:
        return f"{self.channel}: {self.mechanism_name} {self.params_json}"


def _covered(config: ChannelConfig) -> bool:
    return build(config).bin_count_law(A, (A, B)) is not None


@lru_cache(maxsize=64)
def _bound(name: str, params_json: str) -> BoundMechanism[object, Accumulator]:
    return get(name).bind(json.loads(params_json))


def _counts(accumulator: Accumulator) -> CountAccumulator:
    """A histogram's counts (what every mechanism the game covers accumulates)."""
    if not isinstance(accumulator, CountAccumulator):
        raise GameError(f"the game folds bin counts, not a {type(accumulator).__name__}")
    return accumulator


@lru_cache(maxsize=256)
def difference_law(game: MechanismGame, n: int) -> tuple[int, FloatArray, FloatArray]:
    """(offset, law under secret a, law under secret b) of S_b − S_a in a batch of ``n``
    reports: n − 1 of value c and the target's (exact, from the mechanism's encoding law)."""
    others = _power(*_difference(game.law(C)), max(0, n - 1))
    laws = []
    for value in (A, B):
        offset, pmf = _difference(game.law(value))
        laws.append(np.convolve(others[1], pmf))
    return others[0] + offset, laws[0], laws[1]


def _eps_from_counts(
    tp: int, pos: int, fp: int, neg: int, delta: float, confidence: float
) -> float:
    """:func:`services.tools.audit.game.eps_lower` from counts of guesses of 1."""
    if not pos or not neg:
        return 0.0
    tpr_lo, _ = clopper_pearson(tp, pos, confidence)
    _, fpr_hi = clopper_pearson(fp, neg, confidence)
    candidates = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        candidates.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1 - fpr_hi - delta > 0 and tpr_lo < 1:
        candidates.append(math.log((1 - fpr_hi - delta) / (1 - tpr_lo)))
    return max(candidates)


@lru_cache(maxsize=512)
def threshold(game: MechanismGame, n: int, per_class: int, delta: float, confidence: float) -> int:
    """The t of the distinguisher S_b − S_a ≥ t with the largest ε lower bound the model
    rates would give at ``per_class`` trials of each secret (never fitted to data)."""
    offset, law_a, law_b = difference_law(game, n)
    fpr = np.cumsum(law_a[::-1])[::-1]  # P(D >= offset + i | a)
    tpr = np.cumsum(law_b[::-1])[::-1]
    useful = np.flatnonzero((tpr > 1e-9) & (fpr < 1 - 1e-9) & (tpr > fpr))
    best, best_score = offset + len(law_a), (-1.0, -1.0)
    for i in useful[:: max(1, len(useful) // 400)]:
        tp, fp = round(tpr[i] * per_class), round(fpr[i] * per_class)
        value = _eps_from_counts(tp, per_class, fp, per_class, delta, confidence)
        # ties (too few trials for any bound) go to the model's largest tpr − fpr
        score = (value, float(tpr[i] - fpr[i]))
        if score > best_score:
            best, best_score = int(offset + i), score
    return best


def _bounds(
    trials: Sequence[MechTrial], thresholds: Mapping[int, int], delta: float, confidence: float
) -> dict[str, float]:
    """ε_lower of both distinguishers, jointly at ``confidence`` (Bonferroni over four rates)."""
    per_rate = 1 - (1 - confidence) / RATES
    pos = [t for t in trials if t.secret == 1]
    neg = [t for t in trials if t.secret == 0]

    def rate(guess: Callable[[MechTrial], bool], group: list[MechTrial]) -> int:
        return sum(1 for t in group if t.view is not None and guess(t))

    def count(t: MechTrial) -> bool:
        assert t.view is not None
        return t.view[1] - t.view[0] >= thresholds[t.n_contributions]

    def first(t: MechTrial) -> bool:
        return t.view is not None and t.view[2] == 1

    return {
        name: _eps_from_counts(
            rate(guess, pos), len(pos), rate(guess, neg), len(neg), delta, per_rate
        )
        for name, guess in (("count", count), ("first", first))
    }


def mechanism_game(trials: Sequence[MechTrial], game: MechanismGame) -> Finding:
    """ε_lower at 95% over both distinguishers beside the certified replacement ε of the
    channel at the smallest released crowd; fails when the bound at confidence 1 − ALPHA
    exceeds it (so a correct shuffler fails with probability below ALPHA)."""
    released = [t.n_contributions for t in trials if t.view is not None]
    if not released:
        return Finding(
            check="privacy",
            name="distinguishing_game",
            passed=True,
            detail="no group released",
        )
    crowd = min(released)
    cert = game.certified(crowd)
    delta, per_class = cert.delta, max(1, len(trials) // 2)
    fit = 1 - (1 - CONFIDENCE) / RATES
    thresholds = {n: threshold(game, n, per_class, delta, fit) for n in set(released)}
    shown = _bounds(trials, thresholds, delta, CONFIDENCE)
    strict = max(_bounds(trials, thresholds, delta, 1 - ALPHA).values())
    lower = max(shown.values())
    detail = (
        f"ε_lower={lower:.3f} at 95% (S_b−S_a ≥ {thresholds[crowd]} at crowd {crowd}: "
        f"{shown['count']:.3f}, first: {shown['first']:.3f}; {strict:.3f} at 1−{ALPHA:g}) over "
        f"{len(trials)} groups vs certified ε={cert.eps:.3f} (replacement, {cert.method}; "
        f"{game.describe()}, crowd {crowd}, δ={delta:g})"
    )
    finding = Finding(
        check="privacy",
        name="distinguishing_game",
        passed=strict <= cert.eps,
        statistic=lower,
        p_value=None,
        detail=detail,
    )
    finding.plot = {"kind": "game", "bounds": shown,
                    "certified": cert.eps if math.isfinite(cert.eps) else None}  # fmt: skip
    return finding


def trials_from(
    batches: Iterable[Any], secrets: Mapping[str, int], game: MechanismGame
) -> list[MechTrial]:
    """One trial per group with a secret: the view of its released fragments (the canary
    markers' payloads) in position order."""
    by_crowd = {b.crowd_id: b for b in batches}
    trials = []
    for crowd, secret in secrets.items():
        batch = by_crowd.get(crowd)
        if batch is None:
            trials.append(MechTrial(secret, None, 0))
            continue
        payloads = [m.payload for _, m in sorted(batch.canaries, key=lambda pm: pm[0])]
        trials.append(MechTrial(secret, game.view(payloads), batch.n_contributions))
    return trials


def simulate(
    game: MechanismGame, n: int, trials: int, seed: int, shuffled: bool = True
) -> list[MechTrial]:
    """Seeded trials through the mechanism's real ``encode`` and a uniform shuffle of all the
    group's fragments (or arrival order, the target first: a shuffler that does not shuffle)."""
    source, rng = SeededSource(seed), np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        secret = int(rng.integers(2))
        fragments = game.encode(secret, source)
        for _ in range(n - 1):
            fragments += game.encode(C, source)
        if shuffled:
            fragments = [fragments[i] for i in rng.permutation(len(fragments))]
        out.append(MechTrial(secret, game.view(fragments), n))
    return out


def outcomes(trials: Sequence[MechTrial], game: MechanismGame, run: str) -> dict[str, Any]:
    """The game's outcome as saved in ``audit.json`` (``summary.game``): enough to pool it."""
    return {
        "channel": game.channel,
        "mechanism": game.mechanism_name,
        "params": json.loads(game.params_json),
        "delta": game.delta,
        "run": run,
        "trials": [
            {
                "secret": t.secret,
                "view": None if t.view is None else list(t.view),
                "n_contributions": t.n_contributions,
            }
            for t in trials
        ],
    }


def load_outcomes(data: Mapping[str, Any]) -> tuple[MechanismGame, str, list[MechTrial]]:
    """(game, run tag, trials) from :func:`outcomes`' dictionary.

    Raises:
        GameError: a field is missing or malformed.
    """
    try:
        config = ChannelConfig(
            id=data["channel"],
            mechanism=data["mechanism"],
            params=data["params"],
            delta=float(data["delta"]),
        )
        trials = [
            MechTrial(
                int(t["secret"]),
                None
                if t["view"] is None
                else (int(t["view"][0]), int(t["view"][1]), int(t["view"][2])),
                int(t["n_contributions"]),
            )
            for t in data["trials"]
        ]
    except (KeyError, TypeError, ValueError) as error:
        raise GameError(f"malformed game outcome: {error!r}") from error
    return MechanismGame.of(config), str(data["run"]), trials


def statistic_eps(game: MechanismGame, n: int, delta: float) -> float:
    """The ε of the pair of laws of S_b − S_a at crowd ``n`` and ``delta`` (hockey-stick
    divergence, both directions, by bisection): what the count distinguisher could show with
    unlimited trials — a lower bound on the exact ε of the mechanism at that crowd."""
    _, law_a, law_b = difference_law(game, n)

    def excess(eps: float) -> float:
        return max(
            float(np.clip(law_b - math.exp(eps) * law_a, 0, None).sum()),
            float(np.clip(law_a - math.exp(eps) * law_b, 0, None).sum()),
        )

    low, high = 0.0, 30.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > delta else (low, middle)
    return high
