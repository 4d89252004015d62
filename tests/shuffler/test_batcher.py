"""Algorithm 3 of ESA-revisited follows its law; the shuffle is uniform; groups fall due on time.

Statistical tests of the law seed the injected randomness (deterministic); the shuffle test
runs on the OS CSPRNG on purpose, since the CSPRNG is what it checks.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scipy import stats

from common.envelope import verify
from common.randomness import SeededSource, laplace
from common.wire import Batch, ChannelPolicy
from shuffler.batcher import Batcher, GroupStatus, due, randomized_deletion
from shuffler.records import GroupKey, pack_fragments

POLICY = ChannelPolicy(id="homepage", min_crowd=20, eps_cr=0.5, delta_cr=1e-3, max_batch=1000)
KEY = GroupKey("homepage", "", 7)


def _laplace_cdf(x: float, scale: float) -> float:
    return 0.5 * math.exp(x / scale) if x < 0 else 1.0 - 0.5 * math.exp(-x / scale)


def test_outcome_is_exactly_algorithm_3_of_the_noise_drawn() -> None:
    """Same seed, same draw: recompute n̂ from the Laplace value and check every branch."""
    scale = 2.0 / POLICY.eps_cr
    offset = scale * math.log(2.0 / POLICY.delta_cr)
    seen = set()
    for seed in range(3_000):
        n = 20 + seed % 30
        outcome = randomized_deletion(n, POLICY, SeededSource(seed))
        n_hat = max(n + laplace(SeededSource(seed), scale) - offset, 0.0)
        if n_hat > n:
            assert (outcome.status, outcome.kept, outcome.deleted) == (GroupStatus.ABORTED, 0, n)
        elif math.floor(n_hat) < POLICY.min_crowd:
            assert (outcome.status, outcome.kept, outcome.deleted) == (GroupStatus.HELD, 0, 0)
        else:
            assert outcome.status is GroupStatus.RELEASED
            assert outcome.kept == math.floor(n_hat) >= POLICY.min_crowd
            assert outcome.deleted == n - outcome.kept
        seen.add(outcome.status)
    assert seen == set(GroupStatus)


def test_deleted_counts_follow_algorithm_3() -> None:
    """floor(n + L - c) = n - m  <=>  c - m <= L < c - m + 1, with L ~ Laplace(2/ε_cr)."""
    n, groups = 200, 20_000
    scale = 2.0 / POLICY.eps_cr
    offset = scale * math.log(2.0 / POLICY.delta_cr)
    rng = SeededSource(20_240_601)
    outcomes = [randomized_deletion(n, POLICY, rng) for _ in range(groups)]
    released = Counter(o.deleted for o in outcomes if o.status is GroupStatus.RELEASED)
    aborted = sum(o.status is GroupStatus.ABORTED for o in outcomes)
    expected_abort = 1.0 - _laplace_cdf(offset, scale)
    assert abs(aborted / groups - expected_abort) < 5 * math.sqrt(expected_abort / groups) + 1e-4
    cells = sorted(released)
    probs = np.array(
        [_laplace_cdf(offset - m + 1, scale) - _laplace_cdf(offset - m, scale) for m in cells]
    )
    observed = np.array([released[m] for m in cells], dtype=float)
    keep = probs * groups >= 5
    chi2 = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(probs[keep] * groups, probs[~keep].sum() * groups)
    expected *= chi2.sum() / expected.sum()
    # Seeded: deterministic. A wrong Laplace scale or offset gives p far below 1e-6.
    assert stats.chisquare(chi2, expected).pvalue > 1e-6


def test_no_group_below_min_crowd_is_ever_released() -> None:
    rng = SeededSource(1)
    for n in range(0, 60):
        for _ in range(200):
            outcome = randomized_deletion(n, POLICY, rng)
            assert outcome.status is not GroupStatus.RELEASED or outcome.kept >= POLICY.min_crowd


def test_negative_group_size_is_refused() -> None:
    with pytest.raises(ValueError, match="n=-1"):
        randomized_deletion(-1, POLICY, SeededSource(0))


def test_released_batch_is_signed_and_keeps_whole_contributions() -> None:
    key = Ed25519PrivateKey.generate()
    batcher = Batcher("shuffler-1", key, SeededSource(3))
    policy = ChannelPolicy(id="homepage", min_crowd=5, eps_cr=5.0, delta_cr=0.1)
    blobs = [pack_fragments([bytes([i, 0]) * 36, bytes([i, 1]) * 36]) for i in range(50)]
    evaluation = batcher.evaluate(KEY, blobs, policy)
    assert evaluation.deletion.status is GroupStatus.RELEASED and evaluation.batch is not None
    batch = Batch.model_validate_json(evaluation.batch.body)
    assert verify(
        evaluation.batch.body, base64.b64decode(evaluation.batch.signature), key.public_key()
    )
    assert batch.n_contributions == evaluation.deletion.kept == evaluation.batch.n_contributions
    owners = Counter(base64.b64decode(f)[0] for f in batch.fragments)
    assert len(owners) == evaluation.deletion.kept and set(owners.values()) == {2}


def test_marked_fragment_lands_uniformly() -> None:
    """Chi-square over 2,400 sealed batches: where does contribution 0's fragment end up?"""
    batcher = Batcher("shuffler-1", Ed25519PrivateKey.generate())  # the OS CSPRNG
    size, batches = 12, 2_400
    survivors = [bytes([0, 2]) + bytes([i]) * 70 for i in range(size)]
    packed = [pack_fragments([fragment]) for fragment in survivors]
    bodies = [batcher.seal(KEY, list(packed)).body for _ in range(batches)]
    marked = base64.b64encode(survivors[0]).decode()
    positions = Counter(json.loads(body)["fragments"].index(marked) for body in bodies)
    observed = np.array([positions[i] for i in range(size)], dtype=float)
    # Unseeded on purpose (the shuffle must use the CSPRNG): false failure 1e-6 per run; a
    # biased or order-keeping shuffle gives p ~ 0 over 2,400 batches.
    assert stats.chisquare(observed).pvalue > 1e-6
    first_positions = Counter(json.loads(body)["fragments"][0] for body in bodies)
    assert len(first_positions) == size  # arrival order does not survive


def test_groups_fall_due_when_their_epoch_closes_or_a_part_is_full() -> None:
    policy = ChannelPolicy(id="c", epoch_seconds=100, min_crowd=5, max_batch=10)
    assert due(policy, epoch=5, count=3, now=550.0, grace=2.0, closed_upto=-1) is None
    assert due(policy, epoch=5, count=10, now=550.0, grace=2.0, closed_upto=-1) is False
    assert due(policy, epoch=5, count=3, now=601.0, grace=2.0, closed_upto=-1) is None
    assert due(policy, epoch=5, count=3, now=602.0, grace=2.0, closed_upto=-1) is True
    assert due(policy, epoch=5, count=3, now=550.0, grace=2.0, closed_upto=5) is True
