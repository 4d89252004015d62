"""The contract every registered mechanism keeps, checked through the one interface the SDK,
the analyzer and the tools use (:class:`common.mechanisms.Mechanism`, found by name in the
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

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from common.mechanisms import (
    BatchContext,
    MechanismError,
    Received,
    SeededSource,
    StateUpdate,
    get,
    names,
)
from common.mechanisms.ldpsgd import GradientReport

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
    params: Any
    fragments: list[bytes]
    accumulator: Any


def _run(name: str, devices: int = DEVICES) -> _Run:
    case, mechanism = CASES[name], get(name)
    params = mechanism.parse_params(case.params)
    rng = SeededSource(7)
    fragments: list[bytes] = []
    for i in range(devices):
        state = mechanism.new_state(params, rng)
        encoded = mechanism.encode(params, case.value(i), state, rng, 1)
        report = [f for _, route in encoded.routes for f in route]
        assert len(report) <= mechanism.fragment_limit(params)
        fragments += report
    accumulator = mechanism.new_accumulator(params)
    invalid = mechanism.accumulate(params, accumulator, fragments, devices, SOURCE)
    assert invalid == 0
    return _Run(mechanism, params, fragments, accumulator)


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request: pytest.FixtureRequest) -> _Run:
    return _run(request.param, DEVICES if CASES[request.param].histogram else 300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_parameters_and_values_are_refused_by_name(name: str) -> None:
    case, mechanism = CASES[name], get(name)
    with pytest.raises(ValueError, match=re.escape(f"{case.bad}={case.bad_params[case.bad]!r}")):
        mechanism.parse_params(case.bad_params)
    params = mechanism.parse_params(case.params)
    rng = SeededSource(1)
    with pytest.raises(MechanismError):
        mechanism.encode(params, case.outside, mechanism.new_state(params, rng), rng, 1)


def test_fragments_have_the_channels_size(run: _Run) -> None:
    assert run.fragments
    assert {len(f) for f in run.fragments} == {2 + run.mechanism.payload_size}


def test_garbage_is_chaff_and_changes_nothing(run: _Run) -> None:
    before = run.accumulator.to_bytes()
    size = 2 + run.mechanism.payload_size
    garbage = [b"\xff" * size, b"", b"\x00" * (size + 3)]
    copy = run.mechanism.load_accumulator(run.params, before)
    assert run.mechanism.accumulate(run.params, copy, garbage, 0, SOURCE) == len(garbage)
    assert copy.to_bytes() == before


def test_accumulators_survive_serialization_and_merge(run: _Run) -> None:
    data = run.accumulator.to_bytes()
    loaded = run.mechanism.load_accumulator(run.params, data)
    assert loaded.to_bytes() == data and loaded.n == run.accumulator.n
    empty = run.mechanism.new_accumulator(run.params)
    assert run.accumulator.merge(empty).to_bytes() == data
    doubled = run.accumulator.merge(loaded)
    assert doubled.n == 2 * run.accumulator.n


def test_the_estimate_holds_the_truth(run: _Run) -> None:
    name = run.mechanism.name
    if not CASES[name].histogram:
        pytest.skip(f"{name}: its estimator is checked against the truth in its own test module")
    truth = np.bincount([CASES[name].value(i) for i in range(DEVICES)], minlength=8)
    estimate = run.mechanism.estimate(run.params, run.accumulator)
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
        certificate = run.mechanism.certify(run.params, 1e-8, [received]).certified
        local = run.mechanism.local_privacy(run.params)
        same = local.removal if certificate.neighbouring == "removal" else local.replacement
        assert certificate.kind == "upper" and certificate.eps <= same + 1e-12
        certified.append(certificate.eps)
    assert certified[1] <= certified[0]
