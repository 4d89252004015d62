"""The contract every registered mechanism keeps, checked through the one interface the SDK,
the analyzer and the tools use (a channel's mechanism with its parameters bound,
:func:`common.mechanisms.build`, of :class:`common.mechanisms.Mechanism` found by name in the
registry): one suite, every implementation, as dp_accounting's ``privacy_accountant_test``
runs one suite over every accountant.

A new mechanism registers a :class:`Case` here (the suite fails until it does): parameters, a
device population and, for histograms, the truth its estimate is compared with. Checked:
parameters are validated; a value outside the domain is refused by name; every fragment has
the channel's size and a report no more fragments than the mechanism's limit; garbage is
counted as chaff and changes nothing; accumulators survive serialization and merge; the
estimate of a fixed seeded population is within 6 standard errors of the truth in every bin;
the certified central ε never exceeds the local ε of the same notion.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from common.accounting.hockey_stick import delta_for_eps
from common.mechanisms import (
    BatchContext,
    MechanismError,
    Received,
    SeededSource,
    StateUpdate,
    build,
    build_device,
    get,
    names,
)
from common.mechanisms.ldpsgd import GradientReport
from common.wire import ChannelConfig

DEVICES = 3000
SOURCE = BatchContext(shuffler_index=0, shuffler_count=1)


def _zipf(k: int) -> Callable[[int], int]:
    """The i-th device's value: bin b for a share of devices proportional to 1/(b + 1)."""
    weights = 1.0 / np.arange(1, k + 1)
    edges = np.cumsum(weights / weights.sum()) * DEVICES
    return lambda i: int(np.searchsorted(edges, i, side="right"))


@dataclass(frozen=True)
class Case:
    """What the suite needs to drive one mechanism.

    Attributes:
        params: A channel's ``params`` for it.
        bad_params: Parameters it must refuse, ``bad`` the one whose value is wrong (the
            ValueError names it with its value, ``bad=...``).
        value: The i-th device's value.
        outside: A value outside the domain.
        histogram: Whether the estimate is of the devices' values (checked against the truth).
    """

    params: dict[str, Any]
    bad_params: dict[str, Any]
    bad: str
    value: Callable[[int], Any]
    outside: Any
    histogram: bool = True


CASES: dict[str, Case] = {
    "krappor": Case(
        params={"k": 8, "eps": 2.0},
        bad_params={"k": 8, "eps": -1.0},
        bad="eps",
        value=_zipf(8),
        outside=8,
    ),
    "krr": Case(
        params={"k": 8, "eps": 2.0},
        bad_params={"k": 1, "eps": 2.0},
        bad="k",
        value=_zipf(8),
        outside=-1,
    ),
    "rfrag": Case(
        params={"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3},
        bad_params={"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 0},
        bad="tau",
        value=_zipf(8),
        outside=8,
    ),
    "zsum": Case(
        params={"d": 8, "eps": 1.0, "delta": 1e-6, "n": DEVICES},
        bad_params={"d": 8, "eps": 1.0, "delta": 2.0, "n": DEVICES},
        bad="delta",
        value=_zipf(8),
        outside=9,
    ),
    "longitudinal": Case(
        params={"d": 4, "k": 2, "eps": 4.0},
        bad_params={"d": 4, "k": 2, "eps": 0.0},
        bad="eps",
        value=lambda i: StateUpdate(period=1, changed=i % 3 == 0),
        outside=StateUpdate(period=9, changed=True),
        histogram=False,
    ),
    "ldp-sgd": Case(
        params={"dim": 4, "eps": 2.0},
        bad_params={"dim": 1, "eps": 2.0},
        bad="dim",
        value=lambda i: GradientReport(round=0, gradient=np.full(4, 0.1 * (i % 5))),
        outside=GradientReport(round=0, gradient=np.full(3, 0.1)),
        histogram=False,
    ),
}


def test_every_shipped_mechanism_has_a_case() -> None:
    """Every mechanism of :mod:`common.mechanisms` (plugins, such as the toy mechanism a test
    registers, bring their own suite)."""
    shipped = {n for n in names() if type(get(n)).__module__.startswith("common.mechanisms.")}
    assert shipped == set(CASES), "register a Case for every mechanism"


@dataclass
class _Run:
    """One seeded population through a mechanism: its fragments and the accumulator."""

    mechanism: Any
    fragments: list[bytes]
    accumulator: Any


@dataclass(frozen=True)
class _Channel:
    """What :func:`common.mechanisms.build` reads of a channel: its mechanism and params."""

    mechanism: str
    params: dict[str, Any]


def _run(name: str, devices: int = DEVICES) -> _Run:
    mechanism = build(_Channel(name, CASES[name].params))
    rng = SeededSource(7)
    fragments: list[bytes] = []
    for i in range(devices):
        state = mechanism.new_state(rng)
        encoded = mechanism.encode(CASES[name].value(i), state, rng, 1)
        report = [f for _, route in encoded.routes for f in route]
        assert len(report) <= mechanism.fragment_limit()
        fragments += report
    accumulator = mechanism.new_accumulator()
    invalid = mechanism.accumulate(accumulator, fragments, devices, SOURCE)
    assert invalid == 0
    return _Run(mechanism, fragments, accumulator)


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request: pytest.FixtureRequest) -> _Run:
    return _run(request.param, DEVICES if CASES[request.param].histogram else 300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_parameters_and_values_are_refused_by_name(name: str) -> None:
    case = CASES[name]
    with pytest.raises(ValueError, match=re.escape(f"{case.bad}={case.bad_params[case.bad]!r}")):
        build(_Channel(name, case.bad_params))
    with pytest.raises(ValueError, match=re.escape(f"{case.bad}={case.bad_params[case.bad]!r}")):
        build_device(_Channel(name, case.bad_params))
    mechanism, rng = build(_Channel(name, case.params)), SeededSource(1)
    with pytest.raises(MechanismError):
        mechanism.encode(case.outside, mechanism.new_state(rng), rng, 1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bound_mechanism_is_its_mechanism_at_its_parameters(name: str) -> None:
    """The bound mechanism (analyzer, tools) and the bound device facet (SDK) of one channel
    answer as the registered mechanism at the parsed parameters, and stay frozen."""
    mechanism, params = get(name), get(name).parse_params(CASES[name].params)
    channel = ChannelConfig(id="c", mechanism=name, params=CASES[name].params)
    bound, device = build(channel), build_device(channel)
    assert bound.params == device.params == params and bound.mechanism is mechanism
    for each in (bound, device):
        assert each.domain_size() == mechanism.domain_size(params)
        assert each.local_privacy() == mechanism.local_privacy(params)
        assert each.fragment_count(SOURCE) == mechanism.fragment_count(params, SOURCE)
        assert (each.name, each.code) == (name, mechanism.code)
        assert each.value_kind == mechanism.value_kind
        assert each.payload_size == mechanism.payload_size
    reports = []
    for encoder in (bound, device):
        rng = SeededSource(3)
        encoded = encoder.encode(CASES[name].value(1), encoder.new_state(rng), rng, 1)
        reports.append(encoded.routes)
    rng = SeededSource(3)
    state = mechanism.new_state(params, rng)
    expected = mechanism.encode(params, CASES[name].value(1), state, rng, 1)
    assert reports == [expected.routes] * 2  # the state may carry an id of its own
    assert bound.privacy() == mechanism.privacy(params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bound.params = params  # type: ignore[misc]


def test_fragments_have_the_channels_size(run: _Run) -> None:
    assert run.fragments
    assert {len(f) for f in run.fragments} == {2 + run.mechanism.payload_size}


def test_garbage_is_chaff_and_changes_nothing(run: _Run) -> None:
    before = run.accumulator.to_bytes()
    size = 2 + run.mechanism.payload_size
    garbage = [b"\xff" * size, b"", b"\x00" * (size + 3)]
    copy = run.mechanism.load_accumulator(before)
    assert run.mechanism.accumulate(copy, garbage, 0, SOURCE) == len(garbage)
    assert copy.to_bytes() == before


def test_accumulators_survive_serialization_and_merge(run: _Run) -> None:
    data = run.accumulator.to_bytes()
    loaded = run.mechanism.load_accumulator(data)
    assert loaded.to_bytes() == data and loaded.n == run.accumulator.n
    empty = run.mechanism.new_accumulator()
    assert run.accumulator.merge(empty).to_bytes() == data
    doubled = run.accumulator.merge(loaded)
    assert doubled.n == 2 * run.accumulator.n


def test_the_estimate_holds_the_truth(run: _Run) -> None:
    name = run.mechanism.name
    if not CASES[name].histogram:
        pytest.skip(f"{name}: its estimator is checked against the truth in its own test module")
    truth = np.bincount([CASES[name].value(i) for i in range(DEVICES)], minlength=8)
    estimate = run.mechanism.estimate(run.accumulator)
    assert not estimate.clipped and estimate.n == DEVICES
    gap = np.abs(estimate.values - truth)
    assert np.all(gap <= 6 * estimate.std_errors), (estimate.values, truth, estimate.std_errors)


def test_the_certificate_never_exceeds_the_local_eps_and_a_larger_crowd_never_hurts(
    run: _Run,
) -> None:
    certified = []
    for crowd in (500, 5000):
        received = Received(
            epoch=0, shuffler_id="s", batches=(crowd,), accumulator=run.accumulator, source=SOURCE
        )
        certificate = run.mechanism.certify(1e-8, [received]).certified
        local = run.mechanism.local_privacy()
        same = local.removal if certificate.neighbouring == "removal" else local.replacement
        assert certificate.kind == "upper" and certificate.eps <= same + 1e-12
        certified.append(certificate.eps)
    assert certified[1] <= certified[0]


def _index(fragment: bytes) -> int:
    """The uint32 bin index that ends every histogram fragment's payload."""
    return int.from_bytes(fragment[-4:], "big")


@dataclass(frozen=True)
class LawView:
    """Where a description's pair reads one report: ``view`` maps a report's fragments to
    the outcome the pair is about; ``values[0]`` and ``values[1]`` are neighbouring inputs
    and every value is a possible other user's input."""

    view: Callable[[Sequence[bytes]], Hashable]
    values: tuple[int, ...]
    #: What the device is told for value v (default: v itself).
    value_of: Callable[[int], Any] = lambda v: v
    #: Whether the view attains the description's local ε (False: the view is a
    #: post-processing that hides part of it, and only the bounds are checked).
    tight: bool = True


#: Mechanisms whose description carries a dominating pair, read on small cases. LDP-SGD is not
#: read here: a report is a continuous direction and a sign, whose marginal is the same for
#: every gradient; its description (binary RR of the sign at ε given the direction) is the
#: flip rate tested in its own module.
LAW_VIEWS: dict[str, LawView] = {
    # k-RAPPOR: attribute 0's bit (the other attributes are independent post-processing).
    "krappor": LawView(lambda fs: any(_index(f) == 0 for f in fs), (0, 1, 2)),
    # k-RR: the value reported.
    "krr": LawView(lambda fs: _index(fs[0]), (0, 1, 2)),
    # report fragments: which rows carry attribute 0's bit (the τ-tuple at ε_ℓ∞).
    "rfrag": LawView(
        lambda fs: tuple(sorted(int.from_bytes(f[2:4], "big") for f in fs if _index(f) == 0)),
        (0, 1, 2),
    ),
    # longitudinal: the first period's report of a new device, None when its level does not
    # report then; value 1 changes the state (its κ*-th change when κ* = 1), 0 does not. Most
    # devices send nothing or noise at period 1, so the description (binary RR at ε/2 per
    # report) is a bound the view does not attain.
    "longitudinal": LawView(
        lambda fs: fs[0][-1] if fs else None,
        (1, 0),
        value_of=lambda v: StateUpdate(period=1, changed=bool(v)),
        tight=False,
    ),
}
DRAWS = 20_000
#: Standard errors of the confidence band around each empirical probability (the checks
#: are of a fixed seed, so they are deterministic; at 6 σ a correct law never fails them).
BAND = 6.0
#: How far a divergence computed from sampled laws may exceed the truth: at 20,000 draws per
#: input the plug-in divergences of correct descriptions come within 0.006 of their pairs'
#: δ; a description with a wrong ε0 or τ exceeds it by 0.18 or more (measured on k-RAPPOR
#: at 0.8 ε and report fragments claiming τ = 1).
LAW_SLACK = 0.03


#: Draws ``draws`` reports of a value, each by a new device: (mechanism name, what the device
#: is told, draws, seed) -> each report's fragments. The checks below take any sampler: this
#: module's (the Python encoders, seeded), or another SDK's encoders
#: (tests/mechanisms/test_contract_sdk_js.py).
Sampler = Callable[[str, Any, int, int], list[list[bytes]]]


def python_reports(name: str, value: Any, draws: int, seed: int) -> list[list[bytes]]:
    """The Python encoder's reports of ``value``, each by a new device (seeded)."""
    mechanism = get(name)
    params = mechanism.parse_params(CASES[name].params)
    rng = SeededSource(seed)
    reports = []
    for _ in range(draws):
        state = mechanism.new_state(params, rng)
        encoded = mechanism.encode(params, value, state, rng, 1)
        reports.append([f for _, route in encoded.routes for f in route])
    return reports


def _law(
    name: str, value: int, draws: int = DRAWS, sample: Sampler = python_reports
) -> Counter[Hashable]:
    """Outcome counts of ``draws`` reports of ``value``, each by a new device."""
    view = LAW_VIEWS[name]
    reports = sample(name, view.value_of(value), draws, 1000 + value)
    return Counter(view.view(report) for report in reports)


def _band(count: int, draws: int) -> tuple[float, float]:
    """Wilson interval of a probability at ``BAND`` standard errors."""
    p, z2 = count / draws, BAND * BAND
    centre = (p + z2 / (2 * draws)) / (1 + z2 / draws)
    half = BAND * math.sqrt(p * (1 - p) / draws + z2 / (4 * draws * draws)) / (1 + z2 / draws)
    return max(0.0, centre - half), min(1.0, centre + half)


def test_every_pair_described_is_checked_or_excused() -> None:
    for name in sorted(CASES):
        mechanism = get(name)
        description = mechanism.privacy(mechanism.parse_params(CASES[name].params))
        has_pair = any(spec.pair is not None for spec in description.randomizer.methods())
        assert name in LAW_VIEWS or name == "ldp-sgd" or not has_pair, name


def _shuffled(laws: dict[int, dict[Hashable, float]], dataset: Sequence[int]) -> Counter[str]:
    """The law of the shuffled multiset of the dataset's reports (small cases, exactly)."""
    out: Counter[str] = Counter()
    for combo in itertools.product(*(laws[v].items() for v in dataset)):
        out[repr(sorted(repr(y) for y, _ in combo))] += math.prod(p for _, p in combo)
    return out


def _hockey_stick(p: Counter[str], q: Counter[str], eps: float) -> float:
    return sum(max(0.0, p[k] - math.exp(eps) * q[k]) for k in set(p) | set(q))


@pytest.mark.parametrize("name", sorted(LAW_VIEWS))
def test_the_described_pairs_hold_for_the_encoders_law(name: str) -> None:
    """The description's local ε is the largest likelihood ratio of one report of neighbouring
    inputs (bounded and attained), each pair's ε0 bounds it; and each pair at n users
    dominates the shuffled reports of n users the encoder really produces (every choice of
    the others' inputs, n <= 4): the hockey-stick divergence of their laws never exceeds the
    pair's δ(ε) by more than the sampling slack."""
    check_described_pairs(name)


def check_described_pairs(
    name: str, sample: Sampler = python_reports, *, pairs: bool = True
) -> None:
    """:func:`test_the_described_pairs_hold_for_the_encoders_law` for the encoder ``sample``
    draws from; ``pairs`` False checks the likelihood ratios only (each at 6 standard errors,
    so they hold for fresh draws too, where the pairs' plug-in divergences are within
    :data:`LAW_SLACK` only for fixed seeds).

    Raises:
        AssertionError: naming the check the sampled law fails.
    """
    mechanism = get(name)
    description = mechanism.privacy(mechanism.parse_params(CASES[name].params))
    randomizer, eps0 = description.randomizer, description.eps0
    specs = [s for s in randomizer.methods() if s.pair and s.method in randomizer.applicable(None)]
    assert specs, f"{name} describes no dominating pair"
    values = LAW_VIEWS[name].values
    counts = {v: _law(name, v, sample=sample) for v in values}
    laws = {v: {y: c / DRAWS for y, c in counts[v].items()} for v in values}
    x0, x1 = values[0], values[1]
    ceiling, attained = _ratios(counts, x0, x1)
    local = randomizer.local_eps(eps0)
    assert ceiling <= math.exp(local), (name, local, ceiling)
    if LAW_VIEWS[name].tight:
        assert math.exp(local) <= attained, (name, local, attained)
    for spec in specs:
        assert spec.pair is not None
        assert ceiling <= math.exp(spec.pair(eps0, 2).eps0), (name, spec.method, ceiling)
    if not pairs:
        return
    for n in (2, 3, 4):
        for others in itertools.combinations_with_replacement(values, n - 1):
            p, q = _shuffled(laws, (x0, *others)), _shuffled(laws, (x1, *others))
            for spec, eps in itertools.product(specs, np.linspace(0.0, eps0, 6)):
                assert spec.pair is not None
                real = max(_hockey_stick(p, q, eps), _hockey_stick(q, p, eps))
                claimed = delta_for_eps(spec.pair(eps0, n), float(eps), 1e-9)
                assert real <= claimed + LAW_SLACK, (name, spec.method, n, others, eps, real)


def _ratios(counts: dict[int, Counter[Hashable]], x0: int, x1: int) -> tuple[float, float]:
    """The largest likelihood ratio of one report between x0 and x1 that the samples prove
    (lower band over upper band) and the largest they allow (upper over lower)."""
    outcomes = set(counts[x0]) | set(counts[x1])
    band = {(v, y): _band(counts[v][y], DRAWS) for v in (x0, x1) for y in outcomes}
    directions = ((x0, x1), (x1, x0))
    ceiling = max(band[(a, y)][0] / band[(b, y)][1] for a, b in directions for y in outcomes)
    attained = max(
        band[(a, y)][1] / band[(b, y)][0]
        for a, b in directions
        for y in outcomes
        if band[(b, y)][0] > 0
    )
    return ceiling, attained


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_exact_bin_count_law_is_the_encoders(name: str) -> None:
    """What the shuffler audit fits its thresholds to (:meth:`Mechanism.bin_count_law`) is
    the law the encoder samples: every cell inside the samples' 6-σ band."""
    mechanism = get(name)
    if mechanism.bin_count_law(mechanism.parse_params(CASES[name].params), 0, (0, 1)) is None:
        pytest.skip(f"{name}: its reports do not name bins")
    check_bin_count_law(name)


def check_bin_count_law(name: str, sample: Sampler = python_reports) -> None:
    """:func:`test_the_exact_bin_count_law_is_the_encoders` for the encoder ``sample`` draws
    from.

    Raises:
        AssertionError: naming the cell whose sampled frequency is outside its band.
    """
    mechanism = get(name)
    params = mechanism.parse_params(CASES[name].params)
    for value in (0, 1, 2):
        law = mechanism.bin_count_law(params, value, (0, 1))
        assert law is not None and law.sum() == pytest.approx(1.0)
        counts: Counter[tuple[int, int]] = Counter()
        for report in sample(name, value, DRAWS, 2000 + value):
            named = [_index(f) for f in report]
            counts[(named.count(0), named.count(1))] += 1
        assert all(cell[0] < law.shape[0] and cell[1] < law.shape[1] for cell in counts), counts
        for (i, j), p in np.ndenumerate(law):
            low, high = _band(counts[(i, j)], DRAWS)
            assert low <= p <= high, (name, value, (i, j), p, counts[(i, j)])
