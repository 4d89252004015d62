"""What the analyzer may believe of a shuffler's claimed crowd: every mechanism's declared
fragment count law (:meth:`Mechanism.fragment_count`) against its encoder on a seeded
population, and :meth:`FragmentCount.verified_crowd` on honest and inflated batches.

A mechanism that declares a mean too high would cut honest crowds (the analyzer certifies
less than it received); one that declares it too low, or a maximum too small, lets a shuffler
inflate its crowd or gets honest batches refused as ``inconsistent_counts``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from common.mechanisms import (
    BatchContext,
    FragmentCount,
    SeededSource,
    StateUpdate,
    get,
    names,
)
from common.mechanisms.base import CROWD_CHECK_ALPHA
from common.mechanisms.ldpsgd import GradientReport
from common.randomness import RandomSource

#: Shufflers of the population: report fragments route rows r to shuffler r mod K.
SHUFFLERS = 3


@dataclass(frozen=True)
class Example:
    """A channel's parameters and a value generator, one population per mechanism."""

    params: dict[str, Any]
    #: (device index, rng) -> the device's value; two populations per mechanism (below).
    skewed: Callable[[int, RandomSource], Any]
    spread: Callable[[int, RandomSource], Any]
    devices: int = 3000


def _gradient(constant: bool) -> Callable[[int, RandomSource], Any]:
    def value(i: int, rng: RandomSource) -> Any:
        if constant:
            return GradientReport(0, np.array([1.0, 0.0, 0.0]))
        return GradientReport(0, np.array([rng.random() - 0.5 for _ in range(3)]))

    return value


def _state(changed: bool | None) -> Callable[[int, RandomSource], Any]:
    def value(i: int, rng: RandomSource) -> Any:
        return StateUpdate(1, changed if changed is not None else rng.random() < 0.5)

    return value


#: Every built-in mechanism: what its channel might configure, and two value populations
#: (everyone the same value, values spread over the domain): the count must not depend on
#: the data (PROTOCOL.md, "Fixed sizes").
EXAMPLES: dict[str, Example] = {
    "krappor": Example({"k": 40, "eps": 1.5}, lambda i, r: 0, lambda i, r: i % 40),
    "krr": Example({"k": 16, "eps": 2.0}, lambda i, r: 3, lambda i, r: i % 16),
    "rfrag": Example(
        {"k": 24, "eps_b": 2.0, "eps_f": 1.0, "tau": 4}, lambda i, r: 5, lambda i, r: i % 24
    ),
    "zsum": Example(
        {"d": 8, "eps": 1.0, "delta": 0.5, "n": 1000}, lambda i, r: 0, lambda i, r: i % 8
    ),
    "longitudinal": Example(
        {"d": 8, "k": 1, "eps": 1.0}, _state(False), _state(None), devices=6000
    ),
    "ldp-sgd": Example({"dim": 3, "eps": 1.0, "tau": 3}, _gradient(True), _gradient(False)),
}


def test_every_built_in_mechanism_has_an_example() -> None:
    built_in = {n for n in names() if type(get(n)).__module__.startswith("common.mechanisms")}
    assert built_in == set(EXAMPLES)


def _population(name: str, example: Example, population: str, seed: int) -> dict[int, list[int]]:
    """Fragments per contribution, by the shuffler index each contribution reaches."""
    mechanism = get(name)
    params = mechanism.parse_params(example.params)
    value_of = example.skewed if population == "skewed" else example.spread
    rng = SeededSource(seed)
    counts: dict[int, list[int]] = {i: [] for i in range(SHUFFLERS)}
    for device in range(example.devices):
        state = mechanism.new_state(params, rng)
        encoded = mechanism.encode(params, value_of(device, rng), state, rng, SHUFFLERS)
        for slot, fragments in encoded.routes:
            # a free route goes to any shuffler: its law is every shuffler's
            index = device % SHUFFLERS if slot is None else slot % SHUFFLERS
            counts[index].append(len(fragments))
    return counts


@pytest.mark.parametrize("population", ["skewed", "spread"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_declared_fragment_count_matches_the_encoders_law(name: str, population: str) -> None:
    mechanism, example = get(name), EXAMPLES[name]
    params = mechanism.parse_params(example.params)
    seed = sorted(EXAMPLES).index(name) * 2 + (population == "spread")
    observed = _population(name, example, population, seed)
    assert sum(map(len, observed.values())) > 0
    for index, counts in observed.items():
        declared = mechanism.fragment_count(params, BatchContext(index, SHUFFLERS))
        if not counts:  # no row of this mechanism reaches this shuffler
            assert declared.maximum == 0
            continue
        sample = np.asarray(counts, dtype=float)
        assert declared.minimum <= sample.min() and sample.max() <= declared.maximum, index
        assert declared.maximum <= mechanism.fragment_limit(params)
        assert declared.mean is not None and declared.variance is not None, (
            f"{name} declares no mean/variance: the analyzer cannot bound its crowds"
        )
        if declared.fixed:
            assert set(counts) == {declared.minimum}
            assert declared.mean == declared.minimum and declared.variance == 0
            continue
        n, var = sample.size, declared.variance
        # sample mean within 5 standard errors (false failure < 1e-6; the seed fixes it)
        assert abs(sample.mean() - declared.mean) < 5 * math.sqrt(var / n), (index, sample.mean())
        # sample variance: standard error about var * sqrt(2 / n) for a near-normal count
        assert abs(sample.var(ddof=1) - var) < 6 * var * math.sqrt(2 / n) + 1e-9, (
            index,
            sample.var(ddof=1),
            var,
        )


def test_free_routes_declare_the_same_law_at_every_shuffler() -> None:
    for name, example in EXAMPLES.items():
        mechanism = get(name)
        params = mechanism.parse_params(example.params)
        encoded = mechanism.encode(
            params,
            example.skewed(0, SeededSource(0)),
            mechanism.new_state(params, SeededSource(0)),
            SeededSource(0),
            SHUFFLERS,
        )
        if all(slot is None for slot, _ in encoded.routes):
            laws = {mechanism.fragment_count(params, BatchContext(i, SHUFFLERS)) for i in range(3)}
            assert len(laws) == 1, name


def _honest_batch(name: str, example: Example, n: int, seed: int) -> tuple[FragmentCount, int]:
    """The count law at shuffler 0 and the fragments ``n`` honest contributions carried."""
    mechanism = get(name)
    params = mechanism.parse_params(example.params)
    devices = n * SHUFFLERS
    while True:  # longitudinal devices send only in periods their level reports
        grown = Example(example.params, example.skewed, example.spread, devices=devices)
        counts = _population(name, grown, "spread", seed)[0]
        if len(counts) >= n:
            break
        devices *= 2
    return mechanism.fragment_count(params, BatchContext(0, SHUFFLERS)), sum(counts[:n])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_honest_batch_verifies_its_whole_claimed_crowd(name: str) -> None:
    law, valid = _honest_batch(name, EXAMPLES[name], 500, seed=11)
    assert law.verified_crowd(500, valid, 0) == 500
    # one fragment that failed to open costs at most one contribution
    assert law.verified_crowd(500, valid, 1) == 499


def test_thirty_krappor_fragments_do_not_vouch_for_a_million_contributions() -> None:
    """A shuffler that sends 30 real fragments and claims 1,000,000 contributions (to certify a
    release on a huge crowd) gets its batch counted as the few dozen the fragments allow."""
    mechanism = get("krappor")
    params = mechanism.parse_params({"k": 40, "eps": 1.5})
    law = mechanism.fragment_count(params, BatchContext(0, SHUFFLERS))
    assert law.mean is not None and 5 < law.mean < 15  # about 8.4 fragments per report
    verified = law.verified_crowd(1_000_000, 30, 0)
    assert 1 <= verified <= 30  # at most a few dozen (30 fragments, ~4 reports' worth)
    assert verified >= math.floor(30 / law.mean)  # never below what the fragments carry
    # and a genuinely small honest batch is not cut
    small, valid = _honest_batch("krappor", EXAMPLES["krappor"], 25, seed=3)
    assert small.verified_crowd(25, valid, 0) == 25


def test_the_bound_is_tight_enough_to_catch_a_modest_inflation() -> None:
    """An honest batch of 2,000 claimed as 3,000: the 1e-9 tail bound rules the claim out."""
    law, valid = _honest_batch("krappor", EXAMPLES["krappor"], 2000, seed=5)
    largest = law.largest_crowd(valid)
    assert largest is not None and 2000 <= largest < 2500
    assert law.verified_crowd(3000, valid, 0) == largest


def test_verified_crowd_rules() -> None:
    exact = FragmentCount.exactly(1)
    assert exact.fixed and exact.largest_crowd(70) == 70
    assert exact.verified_crowd(100, 70, 30) == 70  # 30 failed: claimed less invalid
    assert exact.verified_crowd(100, 60, 0) == 60  # a fixed count makes the crowd exact
    assert exact.verified_crowd(100, 0, 100) == 0  # nothing opened: nothing to certify
    assert exact.verified_crowd(100, 1, 500) == 1  # one valid report reaches the release
    three = FragmentCount.exactly(3)
    assert three.verified_crowd(10, 30, 0) == 10 and three.verified_crowd(10, 29, 0) == 9
    # bounds only (the default for a mechanism that declares no law): no statistical bound
    loose = FragmentCount(0, 40)
    assert loose.largest_crowd(5) is None and loose.verified_crowd(10**6, 5, 2) == 10**6 - 1
    # garbage fills at most one contribution per `maximum` fragments (a client's whole report)
    assert loose.verified_crowd(100, 5, 80) == 98 and loose.verified_crowd(100, 5, 81) == 97
    # a minimum alone bounds the crowd: zsum carries at least the user's own message
    at_least_one = FragmentCount(1, 9)
    assert at_least_one.verified_crowd(100, 40, 0) == 40


def test_largest_crowd_grows_with_the_valid_fragments_and_with_alpha() -> None:
    law = get("krappor").fragment_count(
        get("krappor").parse_params({"k": 40, "eps": 1.5}), BatchContext(0, 1)
    )
    found = [law.largest_crowd(v) for v in (0, 10, 100, 1000, 10_000)]
    bounds = [b for b in found if b is not None]
    assert len(bounds) == len(found) and bounds == sorted(bounds)
    # Bernstein's bound is loose for tiny crowds: no fragment at all still "allows" a dozen or
    # two contributions (each carries none w.p. ~7e-5); never more than that
    assert bounds[0] < 25
    assert law.mean is not None
    for valid in (100, 1000, 10_000):
        crowd = law.largest_crowd(valid)
        assert crowd is not None and crowd >= valid / law.mean
        # the tighter the test (larger alpha), the smaller the crowd it allows
        loose = law.largest_crowd(valid, alpha=CROWD_CHECK_ALPHA / 1e6)
        tight = law.largest_crowd(valid, alpha=0.01)
        assert loose is not None and tight is not None and tight <= crowd <= loose
