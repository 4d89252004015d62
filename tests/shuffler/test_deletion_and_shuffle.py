"""Randomized deletion follows Algorithm 3's law; the shuffle is uniform (both CSPRNG)."""

from __future__ import annotations

import base64
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
from scipy import stats
from sqlalchemy import select

from common.wire import ChannelPolicy
from shuffler import storage
from shuffler.core import randomized_deletion

from .test_core import make_core

POLICY = ChannelPolicy(id="homepage", min_crowd=20, eps_cr=0.5, delta_cr=1e-3, max_batch=1000)


def _laplace_cdf(x: float, scale: float) -> float:
    return 0.5 * math.exp(x / scale) if x < 0 else 1.0 - 0.5 * math.exp(-x / scale)


def test_deleted_counts_follow_algorithm_3() -> None:
    """floor(n + L - c) = n - m  <=>  c - m <= L < c - m + 1, with L ~ Laplace(2/ε_cr)."""
    n, groups = 200, 20_000
    scale = 2.0 / POLICY.eps_cr
    offset = scale * math.log(2.0 / POLICY.delta_cr)
    outcomes = [randomized_deletion(n, POLICY) for _ in range(groups)]
    assert all(
        o.status == "released" or o.kept < POLICY.min_crowd or o.status == "aborted"
        for o in outcomes
    )
    released = Counter(o.deleted for o in outcomes if o.status == "released")
    aborted = sum(o.status == "aborted" for o in outcomes)
    expected_abort = 1.0 - _laplace_cdf(offset, scale)
    assert abs(aborted / groups - expected_abort) < 5 * math.sqrt(expected_abort / groups) + 1e-4
    cells = sorted(released)
    probs = np.array(
        [_laplace_cdf(offset - m + 1, scale) - _laplace_cdf(offset - m, scale) for m in cells]
    )
    observed = np.array([released[m] for m in cells], dtype=float)
    keep = probs * groups >= 5
    tail_obs = observed[~keep].sum()
    tail_exp = probs[~keep].sum() * groups
    chi2 = np.append(observed[keep], tail_obs)
    expected = np.append(probs[keep] * groups, tail_exp)
    expected *= chi2.sum() / expected.sum()
    # The CSPRNG is the point, so no seed: false failure 1e-6 per run; a wrong Laplace scale
    # or offset gives p far below that at 20,000 groups.
    assert stats.chisquare(chi2, expected).pvalue > 1e-6


def test_no_group_below_min_crowd_is_ever_released() -> None:
    for n in range(1, 60):
        for _ in range(200):
            outcome = randomized_deletion(n, POLICY)
            assert outcome.status != "released" or outcome.kept >= POLICY.min_crowd


def test_marked_fragment_lands_uniformly(tmp_path: Path) -> None:
    """Chi-square over 2,400 real batches: where does contribution 0's fragment end up?"""
    core, _ = make_core(f"sqlite:///{tmp_path / 'shuffle.db'}", tmp_path)
    size, batches = 12, 2_400
    survivors = [bytes([0, 2]) + bytes([i]) * 70 for i in range(size)]
    from shuffler.core import pack_fragments

    packed = [pack_fragments([fragment]) for fragment in survivors]
    with core.engine.begin() as conn:
        for epoch in range(batches):
            core._store_batch(conn, "homepage", "", epoch, list(packed), 0.0)
        bodies = conn.execute(select(storage.batches.c.body)).scalars().all()
    marked = base64.b64encode(survivors[0]).decode()
    positions = Counter(json.loads(body)["fragments"].index(marked) for body in bodies)
    observed = np.array([positions[i] for i in range(size)], dtype=float)
    # Unseeded on purpose (the shuffle must use the CSPRNG): false failure 1e-6 per run; a
    # biased or order-keeping shuffle gives p ~ 0 over 2,400 batches.
    assert stats.chisquare(observed).pvalue > 1e-6
    first_positions = Counter(json.loads(body)["fragments"][0] for body in bodies)
    assert len(first_positions) == size  # arrival order does not survive
