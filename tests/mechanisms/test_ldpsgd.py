"""LDP-SGD (ESA-revisited §VI, Algorithms 4–5): sampler, wire, estimator constants, privacy."""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import pytest

from common.accounting import KaryRR, certify
from common.mechanisms import BatchContext, MechanismError, Received, SeededSource, get
from common.mechanisms import ldpsgd as m

BATCH = BatchContext(0, 1)


def reference_sphere(seed: bytes, dim: int) -> list[float]:
    """The sampler exactly as documented, re-implemented word by word in plain Python."""
    pairs = (dim + 1) // 2
    stream = hashlib.shake_256(b"esa/ldp-sgd/sphere/v1" + seed).digest(16 * pairs)
    words = struct.unpack(f"<{2 * pairs}Q", stream)
    normals: list[float] = []
    for i in range(pairs):
        u1, u2 = (((w >> 11) + 1) / 2.0**53 for w in words[2 * i : 2 * i + 2])
        r = math.sqrt(-2.0 * math.log(u1))
        normals += [r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)]
    normals = normals[:dim]
    norm = math.sqrt(sum(x * x for x in normals))
    return [x / norm for x in normals]


@pytest.mark.parametrize("dim", [2, 5, 64])
def test_sphere_sampler_is_the_documented_one(dim: int) -> None:
    seeds = [bytes(range(16)), bytes(16), b"\xff" * 16]
    got = m.sphere(seeds, dim)
    for row, seed in zip(got, seeds, strict=True):
        assert row == pytest.approx(reference_sphere(seed, dim), abs=1e-12)
        assert float(np.linalg.norm(row)) == pytest.approx(1.0)


def test_fragment_layout_and_round_trip() -> None:
    params = m.LdpSgdParams(dim=3, eps=1.0, tau=3)
    fragments = m.encode(m.GradientReport(7, np.array([0.1, 0.2, 0.3])), params, SeededSource(1))
    assert len(fragments) == 3
    for fragment in fragments:
        assert len(fragment) == 2 + m.PAYLOAD_SIZE == 23
        assert fragment[:2] == bytes((1, m.MECHANISM_CODE))
        round_, sign, seed = m.parse_fragment(fragment)
        assert round_ == 7 and sign in (1.0, -1.0) and len(seed) == 16
    assert len({m.parse_fragment(f)[2] for f in fragments}) == 3  # fresh seed per report


def scaled_mean(params: m.LdpSgdParams, gradient: np.ndarray, reports: int) -> np.ndarray:
    """Mean of the scaled reconstructed reports through the real encode and accumulate."""
    rng = SeededSource(2026)
    fragments = [
        f
        for _ in range(reports // params.tau)
        for f in m.encode(m.GradientReport(0, gradient), params, rng)
    ]
    accumulator = m.LdpSgdAccumulator(params.dim)
    assert m.LdpSgd().accumulate(params, accumulator, fragments, reports // params.tau, BATCH) == 0
    return m.noisy_gradient(params, accumulator.sums[0], accumulator.counts[0])


def hoeffding(params: m.LdpSgdParams, reports: int, failure: float = 1e-6) -> float:
    """Each coordinate of a scaled report lies in [-scale, scale]: two-sided Hoeffding with a
    union bound over the coordinates, failure rate < ``failure``."""
    return params.scale * math.sqrt(2.0 * math.log(2 * params.dim / failure) / reports)


def test_estimator_is_unbiased_with_the_gamma_constant() -> None:
    """E[scale · ẑ] = clipped gradient (Algorithm 5 line 5 with the factor d, module doc);
    the gradient (norm 3) is clipped to L = 1, so the target is x/3."""
    params = m.LdpSgdParams(dim=4, eps=2.0, clip=1.0, tau=2)
    gradient = np.array([2.0, -2.0, 1.0, 0.0])
    reports = 6_000
    mean = scaled_mean(params, gradient, reports)
    target = m.clip_gradient(gradient, 1.0)
    assert np.max(np.abs(mean - target)) < hoeffding(params, reports)
    # The constant as printed (without d) targets x/d: off by far more than the tolerance.
    printed = mean * m.paper_scale(4, 1.0, 2.0) / params.scale
    assert np.max(np.abs(printed - target)) > hoeffding(params, reports)


def test_scale_matches_the_sphere_moment() -> None:
    """scale = L (e^ε+1)/(e^ε-1) / E|v_1|, E|v_1| = Γ(d/2)/(√π Γ((d+1)/2)) on S^{d-1}."""
    for dim in (2, 3, 10, 650):
        params = m.LdpSgdParams(dim=dim, eps=1.5, clip=2.0)
        moment = math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)
        expected = 2.0 * (math.exp(1.5) + 1) / (math.exp(1.5) - 1) / moment
        assert params.scale == pytest.approx(expected, rel=1e-12)
        assert params.scale == pytest.approx(dim * m.paper_scale(dim, 2.0, 1.5), rel=1e-12)


def test_flip_probability() -> None:
    """With x = L·e_1 the unflipped sign is sgn(v_1); the sent sign disagrees w.p. 1/(1+e^ε)."""
    params = m.LdpSgdParams(dim=2, eps=1.0, clip=1.0, tau=1)
    rng = SeededSource(5)
    disagree, total = 0, 4_000
    for _ in range(total):
        (fragment,) = m.encode(m.GradientReport(0, np.array([1.0, 0.0])), params, rng)
        _, sign, seed = m.parse_fragment(fragment)
        disagree += sign != np.sign(m.sphere([seed], 2)[0][0])
    p = 1 / (1 + math.e)
    # Hoeffding at failure 1e-7: |p̂ - p| < sqrt(ln(2e7)/(2n)).
    assert abs(disagree / total - p) < math.sqrt(math.log(2e7) / (2 * total))


def test_accumulator_rounds_serialization_and_chaff() -> None:
    params = m.LdpSgdParams(dim=3, eps=1.0)
    rng = SeededSource(3)
    good = [m.encode(m.GradientReport(r, np.ones(3)), params, rng)[0] for r in (1, 1, 2)]
    bad_sign = good[0][:6] + b"\x02" + good[0][7:]
    accumulator = m.LdpSgdAccumulator(3)
    invalid = m.LdpSgd().accumulate(
        params, accumulator, [*good, bad_sign, good[0][:-1], b""], 4, BATCH
    )
    assert invalid == 3
    assert accumulator.counts == {1: 2, 2: 1} and accumulator.n == 4
    loaded = m.LdpSgdAccumulator.from_bytes(accumulator.to_bytes())
    assert loaded.counts == accumulator.counts and loaded.n == 4
    assert np.allclose(loaded.sums[1], accumulator.sums[1])
    merged = loaded.merge(accumulator)
    assert merged.counts == {1: 4, 2: 2} and merged.n == 8
    assert np.allclose(merged.sums[2], 2 * accumulator.sums[2])
    many = [m.encode(m.GradientReport(r, np.ones(3)), params, rng)[0] for r in range(70)]
    capped = m.LdpSgdAccumulator(3)
    assert m.LdpSgd().accumulate(params, capped, many, 70, BATCH) == 70 - m.MAX_ROUNDS
    with pytest.raises(ValueError, match="dim"):
        accumulator.merge(m.LdpSgdAccumulator(4))


def test_server_step_projects_onto_the_ball() -> None:
    params = m.LdpSgdParams(dim=2, eps=1.0, radius=1.0, learning_rate=2.0)
    theta = m.server_step(params, np.zeros(2), np.array([3.0, 4.0]))
    assert theta == pytest.approx([-0.6, -0.8])
    assert m.server_step(params, np.zeros(2), np.array([0.1, 0.0])) == pytest.approx([-0.2, 0])


def test_certificate_is_binary_rr_and_tau_composes() -> None:
    mechanism = get("ldp-sgd")
    one = mechanism.parse_params({"dim": 10, "eps": 2.0})
    state = m.LdpSgdAccumulator(10)
    received = [
        Received(epoch=0, shuffler_id="s1", batches=(5000, 7000), accumulator=state, source=BATCH)
    ]
    cert = mechanism.certify(one, 1e-6, received)
    expected = certify(KaryRR(k=2), 2.0, 5000, 1e-6)
    assert cert.certified.eps == pytest.approx(expected.certified.eps)
    assert cert.certified.neighbouring == "replacement"
    assert expected.certified.eps < 2.0  # amplified
    three = mechanism.parse_params({"dim": 10, "eps": 2.0, "tau": 3})
    assert mechanism.certify(three, 1e-6, received).certified.eps > cert.certified.eps
    pair = mechanism.epoch_pair(three, 5000, 1e-7)
    assert pair is not None and len(pair.pairs) == 3
    assert pair.pairs[0].clone_prob == pytest.approx(2 / (math.exp(2.0) + 1))


def test_training_eps_and_theorem_reference() -> None:
    params = m.LdpSgdParams(dim=10, eps=2.0, rounds=10)
    small = m.LdpSgd().training_eps(params, 10_000, 1e-6)
    large = m.LdpSgd().training_eps(params, 100_000, 1e-6)
    assert 0 < large < small
    assert m.theorem_vi1(params, 100_000, 1e-6) > 0


def test_local_privacy() -> None:
    local = m.LdpSgd().local_privacy(m.LdpSgdParams(dim=3, eps=1.0, tau=2))
    assert local.replacement == pytest.approx(2.0)
    assert local.eps_l1 == pytest.approx(math.log(2 * math.e / (1 + math.e)))


def test_bad_params_and_values_are_named() -> None:
    mechanism = get("ldp-sgd")
    with pytest.raises(ValueError, match="dim"):
        mechanism.parse_params({"dim": 1, "eps": 1.0})
    with pytest.raises(ValueError, match="eps"):
        mechanism.parse_params({"dim": 3, "eps": 0})
    with pytest.raises(ValueError, match="tau"):
        mechanism.parse_params({"dim": 3, "eps": 1.0, "tau": 0})
    params = mechanism.parse_params({"dim": 3, "eps": 1.0, "round": 4, "theta": "AAAA"})
    rng = SeededSource(1)
    with pytest.raises(MechanismError, match="GradientReport"):
        mechanism.encode(params, 3, None, rng, 1)
    with pytest.raises(MechanismError, match="3 finite"):
        mechanism.encode(params, m.GradientReport(0, np.ones(4)), None, rng, 1)
    with pytest.raises(MechanismError, match="round"):
        mechanism.encode(params, m.GradientReport(-1, np.ones(3)), None, rng, 1)


def test_published_model_round_trip() -> None:
    theta = np.array([0.5, -1.25, 3.0])
    raw = {"dim": 3, "eps": 1.0, **m.model_params(9, theta)}
    round_, got = m.model_from_params(raw, 3)
    assert round_ == 9 and np.array_equal(got, theta)
    with pytest.raises(MechanismError, match="4 values"):
        m.model_from_params(raw, 4)
    with pytest.raises(MechanismError, match="no model"):
        m.model_from_params({"dim": 3}, 3)
