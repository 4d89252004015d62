"""The audit's checks over what the sink recorded: each a :class:`Finding` with
pass/fail, its statistic and, for the statistical ones, a p-value.

Statistical checks fail at p < :data:`ALPHA` = 1e-7, so the ten of them together wrongly fail a
correct shuffler with probability below 1e-6 (Bonferroni); the null laws are exact where they
are discrete (kept counts) and normal or Poisson approximations of sums of hundreds of terms
otherwise. A broken shuffler of the kinds the tests run scores p far below 1e-20.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError
from scipy import stats

from common.envelope import FragmentContext, inner_size, verify
from common.wire import Batch, ChannelPolicy
from services.tools.audit.canary import CanaryKey, Marker, Sent

ALPHA = 1e-7
#: The fields a batch body documents (docs/protocol.md, "Batches and parts"), nothing else.
DOCUMENTED_FIELDS = frozenset(Batch.model_fields)
#: Headers a forwarded part may carry: the documented four (``ESA-Preauth`` names only the
#: shuffler, the body's length and digest, and when it was sent, all of which the analyzer
#: sees anyway) and what any HTTP client adds.
ALLOWED_HEADERS = frozenset(
    {"esa-shuffler", "esa-signature", "esa-preauth", "content-type", "content-length"}
    | {"host", "accept"}
    | {"accept-encoding"}
    | {"connection", "user-agent"}
)
#: Cap on one outcome's surprisal (nats) in the exact kept-count test (keeps the grid small).
SURPRISAL_CAP = 60.0
GRID = 0.01
BINS = 10


@dataclass
class Finding:
    """One check's verdict."""

    check: str
    name: str
    passed: bool
    detail: str
    statistic: float | None = None
    p_value: float | None = None
    plot: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def statistical(check: str, name: str, statistic: float, p_value: float, detail: str) -> Finding:
    """A finding that fails at p < :data:`ALPHA`."""
    return Finding(
        check=check,
        name=name,
        passed=bool(p_value >= ALPHA),
        statistic=statistic,
        p_value=p_value,
        detail=detail,
    )


@dataclass
class Part:
    """One recorded POST: its bytes and headers, the batch it parses to, and where this run's
    canary fragments sit in it."""

    seq: int
    received_at: float
    headers: dict[str, str]
    body: bytes
    data: dict[str, Any] | None
    batch: Batch | None
    canaries: list[tuple[int, Marker]] = field(default_factory=list)


@dataclass
class ReassembledBatch:
    """A batch's parts put back together in part order (positions are batch-wide)."""

    batch_id: str
    crowd_id: str
    n_contributions: int
    fragments: int
    canaries: list[tuple[int, Marker]]


def parse_parts(records: Iterable[dict[str, Any]], key: CanaryKey) -> list[Part]:
    """The recorded POSTs, with this run's canary fragments opened."""
    parts = []
    for record in records:
        body = base64.b64decode(record["body"])
        headers = {name.lower(): value for name, value in record["headers"]}
        data: dict[str, Any] | None
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        try:
            batch: Batch | None = Batch.model_validate(
                {k: v for k, v in (data or {}).items() if k in DOCUMENTED_FIELDS}
            )
        except ValidationError:
            batch = None
        part = Part(
            seq=record["seq"],
            received_at=record["received_at"],
            headers=headers,
            body=body,
            data=data,
            batch=batch,
        )
        if batch is not None:
            for position, text in enumerate(batch.fragments):
                context = FragmentContext(batch.channel_id, batch.epoch, batch.crowd_id)
                marker = key.read(base64.b64decode(text), context)
                if marker is not None:
                    part.canaries.append((position, marker))
        parts.append(part)
    return parts


def assemble(parts: Sequence[Part], channel_id: str) -> list[ReassembledBatch]:
    """The batches of ``channel_id``, each part counted once, positions offset by part."""
    by_batch: dict[str, dict[int, Part]] = defaultdict(dict)
    for part in parts:
        if part.batch is not None and part.batch.channel_id == channel_id:
            by_batch[part.batch.batch_id].setdefault(part.batch.part, part)
    batches = []
    for batch_id, pieces in by_batch.items():
        offset, canaries = 0, []
        for index in sorted(pieces):
            piece = pieces[index]
            assert piece.batch is not None
            canaries += [(offset + position, marker) for position, marker in piece.canaries]
            offset += len(piece.batch.fragments)
        first = next(iter(pieces.values())).batch
        assert first is not None
        batches.append(
            ReassembledBatch(
                batch_id=batch_id,
                crowd_id=first.crowd_id,
                n_contributions=first.n_contributions,
                fragments=offset,
                canaries=canaries,
            )
        )
    return batches


# --- 1. order ----------------------------------------------------------------------------


def order_checks(batches: Sequence[ReassembledBatch]) -> list[Finding]:
    """Send order against batch position: Spearman's ρ per batch combined as
    Z = Σ ρ_b √(m_b − 1) / √B (ρ_b √(m_b − 1) ≈ N(0, 1) under a uniform shuffle); the
    positions of each batch's earliest-sent quarter of canaries, uniform over ten position bins
    (χ², 9 df); and how often two fragments of one contribution sit side by side (Poisson with
    mean Σ_c f_c(f_c − 1)/N per batch under a uniform shuffle)."""
    scores: list[float] = []
    early, expected_early, adjacent, mean_adjacent = np.zeros(BINS), np.zeros(BINS), 0, 0.0
    scatter: list[tuple[float, float]] = []
    for batch in batches:
        marks = sorted(batch.canaries, key=lambda pm: (pm[1].seq, pm[1].index))
        m, n = len(marks), batch.fragments
        if m < 3 or n < 2:
            continue
        positions = np.array([position for position, _ in marks], dtype=float)
        rho = float(stats.spearmanr(np.arange(m), positions).statistic)
        scores.append(rho * math.sqrt(m - 1))
        scatter += [(i / (m - 1), p / (n - 1)) for i, p in enumerate(positions)]
        seqs = sorted({marker.seq for _, marker in marks})
        first = set(seqs[: max(1, math.ceil(len(seqs) / 4))])
        bin_of = np.minimum((np.arange(n) * BINS) // n, BINS - 1)
        share = np.bincount(bin_of, minlength=BINS) / n
        chosen = [position for position, marker in marks if marker.seq in first]
        early += np.bincount(bin_of[chosen], minlength=BINS)
        expected_early += len(chosen) * share
        adjacent_b, mean_b = _adjacency(marks, n)
        adjacent, mean_adjacent = adjacent + adjacent_b, mean_adjacent + mean_b
    if not scores:
        return [
            Finding(
                check="order", name="rank_correlation", passed=False, detail="no canary batch found"
            )
        ]
    z = float(sum(scores) / math.sqrt(len(scores)))
    rank = statistical(
        "order", "rank_correlation", z, float(2 * stats.norm.sf(abs(z))),
        f"combined Spearman Z over {len(scores)} batches (send order vs position)",
    )  # fmt: skip
    rank.plot = {"kind": "scatter", "points": scatter[:5000]}
    chi2 = float(((early - expected_early) ** 2 / np.maximum(expected_early, 1e-12)).sum())
    uniform = statistical(
        "order", "early_canaries_uniform", chi2, float(stats.chi2.sf(chi2, BINS - 1)),
        f"χ² of the earliest-sent quarter's positions over {BINS} bins",
    )  # fmt: skip
    uniform.plot = {"kind": "bars", "observed": early.tolist(), "expected": expected_early.tolist()}
    apart = statistical(
        "order", "contributions_split", float(adjacent),
        float(stats.poisson.sf(adjacent - 1, mean_adjacent)),
        f"{adjacent} adjacent fragment pairs of one contribution, {mean_adjacent:.1f} expected",
    )  # fmt: skip
    return [rank, uniform, apart]


def _adjacency(marks: Sequence[tuple[int, Marker]], n: int) -> tuple[int, float]:
    """Side-by-side fragment pairs of one contribution, and their expectation under a shuffle."""
    at = {position: marker.seq for position, marker in marks}
    observed = sum(1 for position, seq in at.items() if at.get(position + 1) == seq)
    sizes: dict[int, int] = defaultdict(int)
    for _, marker in marks:
        sizes[marker.seq] += 1
    return observed, sum(f * (f - 1) for f in sizes.values()) / n


# --- 2. metadata -------------------------------------------------------------------------


def metadata_checks(
    parts: Sequence[Part], signing_key: Ed25519PublicKey, payload_size: int, channel_id: str
) -> list[Finding]:
    """Bodies carry exactly the documented fields in the one serialization both sides sign
    (:meth:`common.wire.Batch.body`), only documented headers, one fragment size per channel
    (the audit channel's :func:`common.envelope.inner_size`), signatures that verify with the
    registered key, and no fragment twice."""
    extra = [p.seq for p in parts if p.data is None or set(p.data) != DOCUMENTED_FIELDS]
    canonical = [p.seq for p in parts if p.batch is None or p.batch.body() != p.body]
    headers = sorted({h for p in parts for h in p.headers} - ALLOWED_HEADERS)
    sizes: dict[str, set[int]] = defaultdict(set)
    seen: set[str] = set()
    repeated = 0
    for part in parts:
        if part.batch is not None:
            for text in part.batch.fragments:
                sizes[part.batch.channel_id].add(len(text))
                repeated += text in seen
                seen.add(text)
    mixed = {c: sorted(s) for c, s in sizes.items() if len(s) > 1}
    audit_size = len(base64.b64encode(bytes(inner_size(payload_size))))
    wrong = sizes.get(channel_id, set()) - {audit_size}
    unsigned = [p.seq for p in parts if not _signed(p, signing_key)]
    verdicts: dict[str, tuple[Sequence[Any], str]] = {
        "documented_fields": (extra, "parts with other than the documented fields"),
        "canonical_body": (canonical, "parts not in the signed serialization"),
        "headers": (headers, "undocumented request headers"),
        "one_fragment_size": ([*mixed.items(), *wrong], "channels with mixed or odd sizes"),
        "signatures": (unsigned, "parts whose signature does not verify"),
        "no_repeated_fragment": ([0] * repeated, "fragments seen twice"),
    }
    return [_count("metadata", name, bad, what) for name, (bad, what) in verdicts.items()]


def _signed(part: Part, key: Ed25519PublicKey) -> bool:
    try:
        signature = base64.b64decode(part.headers.get("esa-signature", ""), validate=True)
    except (binascii.Error, ValueError):
        return False
    return verify(part.body, signature, key)


def _count(check: str, name: str, bad: Sequence[Any], what: str) -> Finding:
    shown = ", ".join(map(str, list(bad)[:5]))
    return Finding(
        check=check,
        name=name,
        passed=not bad,
        statistic=float(len(bad)),
        p_value=None,
        detail=f"{len(bad)} {what}: {shown}",
    )


# --- 4. crowd threshold ------------------------------------------------------------------


def crowd_checks(
    batches: Sequence[ReassembledBatch], policy: ChannelPolicy, small: Sequence[str]
) -> list[Finding]:
    """No batch below ``min_crowd``; the auditor's deliberately small groups never released;
    no batch claims fewer contributions than the canaries found in it."""
    below = [b.batch_id for b in batches if b.n_contributions < policy.min_crowd]
    leaked = [b.batch_id for b in batches if b.crowd_id in small]
    short = [b.batch_id for b in batches if len({m.seq for _, m in b.canaries}) > b.n_contributions]
    return [
        _count("crowd", "min_crowd", below, f"batches below min_crowd={policy.min_crowd}"),
        _count("crowd", "small_groups_withheld", leaked, "small canary groups released"),
        _count("crowd", "counts_cover_canaries", short, "batches counting fewer than found"),
    ]


# --- 5. randomized deletion --------------------------------------------------------------


def kept_law(n: int, policy: ChannelPolicy) -> dict[int | None, float]:
    """ESA-revisited Algorithm 3's law of the released count for a group of ``n``:
    P(kept = k) = F(k + 1 − n + c) − F(k − n + c) for min_crowd ≤ k < n, F the Laplace(2/ε_cr)
    CDF and c = (2/ε_cr)·ln(2/δ_cr); ``None`` is no batch at all (held or aborted)."""
    b = 2.0 / policy.eps_cr
    c = b * math.log(2.0 / policy.delta_cr)

    def cdf(x: float) -> float:
        return 0.5 * math.exp(x / b) if x < 0 else 1.0 - 0.5 * math.exp(-x / b)

    law: dict[int | None, float] = {
        k: cdf(k + 1 - n + c) - cdf(k - n + c) for k in range(policy.min_crowd, n)
    }
    law[None] = max(0.0, 1.0 - sum(law.values()))
    return law


def exact_surprisal_p(
    laws: Sequence[dict[int | None, float]], observed: Sequence[int | None]
) -> tuple[float, float]:
    """S = Σ −ln P(observed outcome) over independent groups and P(S' ≥ S) under the laws,
    exactly up to a {GRID}-nat grid (dynamic programming over the groups)."""
    total, dist = 0.0, np.array([1.0])
    for law, outcome in zip(laws, observed, strict=True):
        probability = law.get(outcome, 0.0)
        total += SURPRISAL_CAP if probability <= 0 else min(SURPRISAL_CAP, -math.log(probability))
        step = np.zeros(int(SURPRISAL_CAP / GRID) + 2)
        for p in law.values():
            if p > 0:
                step[int(min(SURPRISAL_CAP, -math.log(p)) / GRID)] += p
        dist = np.convolve(dist, step)
    start = int(total / GRID)
    return total, float(min(1.0, dist[start:].sum()))


def deletion_checks(
    batches: Sequence[ReassembledBatch],
    sent: Sequence[Sent],
    policy: ChannelPolicy,
    groups: Sequence[str],
) -> list[Finding]:
    """Kept counts against Algorithm 3's exact law (:func:`kept_law`, :func:`exact_surprisal_p`)
    over the canary-only ``groups``; and whether the survivors' send ranks are uniform among
    their group's (Wilcoxon rank sum, combined Z)."""
    by_crowd = {b.crowd_id: b for b in batches}
    laws, outcomes, z_sum, var_sum = [], [], 0.0, 0.0
    hist: dict[str, int] = defaultdict(int)
    for crowd in groups:
        members = sorted(s.seq for s in sent if s.crowd_id == crowd)
        batch = by_crowd.get(crowd)
        laws.append(kept_law(len(members), policy))
        outcomes.append(None if batch is None else batch.n_contributions)
        hist["absent" if batch is None else str(len(members) - batch.n_contributions)] += 1
        if batch is None:
            continue
        found = {m.seq for _, m in batch.canaries}
        k, n = len(found), len(members)
        ranks = [i + 1 for i, seq in enumerate(members) if seq in found]
        z_sum += sum(ranks) - k * (n + 1) / 2
        var_sum += k * (n - k) * (n + 1) / 12
    statistic, p = exact_surprisal_p(laws, outcomes)
    law = statistical(
        "deletion", "kept_count_law", statistic, p,
        f"Σ surprisal of {len(groups)} groups' released counts under Algorithm 3 "
        f"(ε_cr={policy.eps_cr}, δ_cr={policy.delta_cr}); deleted per group: {dict(hist)}",
    )  # fmt: skip
    law.plot = {"kind": "deleted", "histogram": dict(hist)}
    if var_sum == 0:
        survivors = Finding(
            check="deletion", name="survivors_random", passed=True, detail="no group had deletions"
        )
    else:
        z = z_sum / math.sqrt(var_sum)
        survivors = statistical(
            "deletion", "survivors_random", z, float(2 * stats.norm.sf(abs(z))),
            "Wilcoxon rank-sum Z of the survivors' send ranks",
        )  # fmt: skip
    return [law, survivors]


# --- 6. timing ---------------------------------------------------------------------------


def timing_checks(
    parts: Sequence[Part], channel_id: str, closes_at: float, skew: float
) -> list[Finding]:
    """No part of the audited epoch arrives before it closed (its end, or the auditor's close
    request), allowing ``skew`` seconds of clock difference between sink and auditor."""
    early = [
        p.seq
        for p in parts
        if p.batch is not None
        and p.batch.channel_id == channel_id
        and p.received_at < closes_at - skew
    ]
    return [_count("timing", "release_at_close", early, "parts received before the epoch closed")]


def arrival_pattern_check(
    parts: Sequence[Part],
    sent: Sequence[Sent],
    crowds: tuple[str, str],
    round_seconds: float,
) -> Finding:
    """Batch timing independent of the arrival pattern. The auditor sends all canaries of the
    first crowd of ``crowds`` first and all of the second's last, S seconds later; a correct
    shuffler releases both groups in the same batching round after the close, so their first
    parts reach the sink G ≈ 0 s apart (the sink's clock alone; forwarding many batches one
    after another spreads them by a few seconds, which the other groups' release spread
    measures), while one that releases a group when it fills or a fixed time after its first
    arrival shows G ≈ S. Fails when |G| exceeds ``round_seconds`` plus the other groups'
    release spread, or S/2. ``parts`` are the audited channel's parts of the audited epoch."""
    early, late = crowds
    released: dict[str, float] = {}
    for part in parts:
        if part.batch is not None:
            crowd = part.batch.crowd_id
            released[crowd] = min(released.get(crowd, math.inf), part.received_at)
    name = "release_independent_of_arrival"
    if early == late or early not in released or late not in released:
        why = "needs two full groups" if early == late else "a burst group was not released"
        return Finding(check="timing", name=name, passed=True, detail=why)
    others = [t for c, t in released.items() if c not in crowds]
    spread = max(others) - min(others) if len(others) > 1 else 0.0
    first_sent = {c: min(s.sent_at for s in sent if s.crowd_id == c) for c in crowds}
    separation = first_sent[late] - first_sent[early]
    gap = released[late] - released[early]
    allowed = min(round_seconds + spread, separation / 2)
    detail = (
        f"groups whose canaries arrived {separation:.2f} s apart were released {gap:+.2f} s "
        f"apart (allowed ±{allowed:.2f} s: a batching round plus the {spread:.2f} s the other "
        "groups' releases took, at most half the separation)"
    )
    return Finding(
        check="timing",
        name=name,
        passed=abs(gap) <= allowed,
        statistic=gap,
        p_value=None,
        detail=detail,
    )
