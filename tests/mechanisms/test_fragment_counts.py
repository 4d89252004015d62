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
from common.mechanisms.device import CROWD_CHECK_ALPHA
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
#: the data (docs/protocol.md, "Fixed sizes").
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


@pytest.mark.parametrize("n", [25, 200, 1000])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_verified_crowd_of_an_honest_batch_is_a_lower_bound_close_to_the_truth(
    name: str, n: int
) -> None:
    """Honest batches from the mechanism's own encoder: the verified crowd never exceeds the
    true crowd (a bound that fails once in 10^9 batches; the seeds fix these), and from a few
    hundred contributions on it is within a few percent of it (exact for a fixed count)."""
    for seed in range(3):
        law, valid = _honest_batch(name, EXAMPLES[name], n, seed=100 * n + seed)
        verified = law.verified_crowd(n, valid, 0)
        assert 1 <= verified <= n, (name, n, seed, valid, verified)
        if law.fixed:
            assert verified == n
        elif n >= 1000:
            assert verified >= 0.88 * n, (name, n, verified)
        # one fragment that failed to open costs at most one contribution of the claim
        assert law.verified_crowd(n, valid, 1) <= min(verified, n - 1)


def test_the_lower_bound_holds_at_its_stated_confidence() -> None:
    """At alpha = 0.05 the bound may exceed the truth in about 5% of honest batches, never
    much more: 400 seeded k-RAPPOR batches of 50 (real encoder) exceed it in fewer than 10%
    (a binomial(400, 0.05) count passes 40 with probability ~4e-6; the seeds fix it), and at
    the deployed alpha none does."""
    mechanism = get("krappor")
    params = mechanism.parse_params({"k": 64, "eps": 2.0})
    law = mechanism.fragment_count(params, BatchContext(0, 1))
    rng, above, above_deployed = SeededSource(46), 0, 0
    for _ in range(400):
        valid = sum(len(mechanism.encode(params, 7, None, rng, 1).routes[0][1]) for _ in range(50))
        above += law.smallest_crowd(valid, alpha=0.05) > 50
        above_deployed += law.smallest_crowd(valid) > 50
    assert above < 40 and above_deployed == 0


def test_thirty_krappor_fragments_do_not_vouch_for_a_million_contributions() -> None:
    """A shuffler that sends 30 real fragments and claims 1,000,000 contributions (to certify a
    release on a huge crowd) gets its batch counted as what the fragments prove."""
    mechanism = get("krappor")
    params = mechanism.parse_params({"k": 40, "eps": 1.5})
    law = mechanism.fragment_count(params, BatchContext(0, SHUFFLERS))
    assert law.mean is not None and 5 < law.mean < 15  # about 8.4 fragments per report
    verified = law.verified_crowd(1_000_000, 30, 0)
    assert 1 <= verified <= math.ceil(30 / law.mean)  # at most what 30 fragments carry


def test_a_claim_above_its_fragments_at_a_small_crowd_verifies_only_the_fragments() -> None:
    """30 real k-RAPPOR contributions claimed as 59 (to pass a ``min_crowd`` of 50): the
    verified crowd is at most 30, whatever the claim."""
    mechanism = get("krappor")
    params = mechanism.parse_params({"k": 64, "eps": 2.0})
    law = mechanism.fragment_count(params, BatchContext(0, 1))
    rng = SeededSource(30)
    for _ in range(20):
        valid = sum(len(mechanism.encode(params, 3, None, rng, 1).routes[0][1]) for _ in range(30))
        assert law.verified_crowd(59, valid, 0) <= 30 < 50


def test_the_bound_catches_a_modest_inflation() -> None:
    """An honest batch of 2,000 claimed as 3,000: the verified crowd stays at most 2,000."""
    law, valid = _honest_batch("krappor", EXAMPLES["krappor"], 2000, seed=5)
    assert 0.9 * 2000 <= law.verified_crowd(3000, valid, 0) <= 2000


def test_verified_crowd_rules() -> None:
    exact = FragmentCount.exactly(1)
    assert exact.fixed and exact.smallest_crowd(70) == 70
    assert exact.verified_crowd(100, 70, 30) == 70  # 30 failed: claimed less invalid
    assert exact.verified_crowd(100, 60, 0) == 60  # a fixed count makes the crowd exact
    assert exact.verified_crowd(50, 60, 0) == 50  # never more than the claim
    assert exact.verified_crowd(100, 0, 100) == 0  # nothing opened: nothing to certify
    assert exact.verified_crowd(100, 1, 500) == 1  # one valid report reaches the release
    three = FragmentCount.exactly(3)
    # a fixed count rounds down: 29 fragments prove 9 whole contributions, not 10
    assert three.verified_crowd(10, 30, 0) == 10 and three.verified_crowd(10, 29, 0) == 9
    # bounds only (a mechanism that declares no law): no contribution carries more than 40
    loose = FragmentCount(minimum=0, maximum=40)
    assert loose.smallest_crowd(5) == 0 and loose.verified_crowd(10**6, 5, 2) == 1
    assert loose.verified_crowd(10**6, 400, 2) == 10
    # garbage fills at most one contribution per `maximum` fragments (a client's whole report)
    assert loose.verified_crowd(12, 400, 80) == 10 and loose.verified_crowd(12, 400, 81) == 9
    # one piece (the whole count's range) is looser than independent one-fragment pieces
    whole = FragmentCount(minimum=0, maximum=64, mean=8.39, variance=6.72)
    bits = FragmentCount(minimum=0, maximum=64, mean=8.39, variance=6.72, piece=1)
    assert whole.smallest_crowd(420) < bits.smallest_crowd(420) <= 50


def test_smallest_crowd_grows_with_the_valid_fragments_and_falls_with_alpha() -> None:
    law = get("krappor").fragment_count(
        get("krappor").parse_params({"k": 40, "eps": 1.5}), BatchContext(0, 1)
    )
    found = [law.smallest_crowd(v) for v in (0, 10, 100, 1000, 10_000)]
    assert found == sorted(found) and found[0] == 0
    assert law.mean is not None
    for valid in (100, 1000, 10_000):
        crowd = law.smallest_crowd(valid)
        assert valid // law.maximum <= crowd <= valid / law.mean
        # the looser the test (smaller alpha), the smaller the crowd it proves
        loose = law.smallest_crowd(valid, alpha=CROWD_CHECK_ALPHA / 1e6)
        tight = law.smallest_crowd(valid, alpha=0.01)
        assert loose <= crowd <= tight


def test_a_fixed_law_widened_to_the_channels_max_fragments_still_verifies_exactly() -> None:
    """One k-RR report per contribution on a channel taking up to 4 fragments from any client:
    Bernstein's range term is the law's (0), so 66 honest fragments verify 66 contributions
    (with the channel's maximum as the range they verified 25 and withheld small batches)."""
    law = FragmentCount.exactly(1).accepting(4)
    assert law.maximum == 4 and law.honest_maximum == 1
    assert law.verified_crowd(66, 66, 0) == 66
    assert law.verified_crowd(66, 69, 0) == 66  # a client's extra fragments: never above the claim
    assert law.verified_crowd(66, 40, 0) == 40


@pytest.mark.parametrize("mechanism", ["krappor", "krr"])
def test_a_shuffler_computes_the_crowd_the_analyzer_verifies(mechanism: str) -> None:
    """The shuffler's check before it sends a batch (:meth:`ChannelTerms.verified_crowd`) and
    the analyzer's at completion rest on the same law, widened the same way."""
    from analyzer.channels import ChannelRuntime
    from common.terms import ChannelTerms
    from common.wire import ChannelConfig

    channel = ChannelConfig(
        id="c", mechanism=mechanism, params={"k": 64, "eps": 2.0}, max_fragments=32, delta=1e-8
    )
    runtime = ChannelRuntime.build(channel, ["s-1", "s-2", "s-3"])
    terms = ChannelTerms.of(channel, None)
    for claimed, fragments in [(75, 600), (75, 630), (200, 1500), (60, 60)]:
        analyzer = runtime.fragment_count("s-2").verified_crowd(claimed, fragments, 0)
        assert terms.verified_crowd(claimed, fragments, BatchContext(1, 3)) == analyzer
