"""LDP-SGD — ESA-revisited §VI, Algorithms 4–5, with the paper's PRG communication reduction.

A device reports ``tau`` signs of its clipped gradient against sphere directions regenerated
from 128-bit seeds (:func:`sphere`, a fixed SHAKE-256 sampler), each flipped with probability
``1/(1 + e^ε)`` (OS CSPRNG). Wire payload (code 6): ``uint32 round | uint8 sign | 16-byte
seed``. The server averages and scales by Algorithm 5 line 5's constant with the factor ``d``
the paper omits (:func:`paper_scale` is the printed one), then projects onto the L2 ball.
Each report is binary RR of its sign given a uniform seed: certified as k-RR at k = 2 (FMT21
Cor. 4.2), ``tau`` reports composed per round.

The device facet (parameters, the encoder) is :mod:`common.mechanisms.device.ldpsgd` and
:mod:`common.mechanisms.device._ldpsgd`.

Sampler, constant and privacy argument: docs/mechanisms.md, "LDP-SGD"; docs/ldp-sgd.md.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.accounting import BoundResult, Epoch, KaryRR
from common.accounting.lifetime import compose_epochs as compose_lifetime
from common.mechanisms._estimates import Estimate, FloatArray
from common.mechanisms._wire import FragmentError, unframe
from common.mechanisms.base import (
    Mechanism,
    NoDataError,
    PrivacyDescription,
    Received,
    ReleaseCertificate,
    TrainingStep,
    compose_epochs,
    epoch_batches,
)
from common.mechanisms.device import BatchContext
from common.mechanisms.device._ldpsgd import (
    check_gradient,
    clip_gradient,
    encode,
    model_from_params,
    model_params,
    sphere,
)
from common.mechanisms.device.ldpsgd import (
    MECHANISM_CODE,
    MODEL_KEYS,
    NAME,
    PAYLOAD_SIZE,
    SEED_BYTES,
    SPHERE_DOMAIN,
    GradientReport,
    LdpSgdDevice,
    LdpSgdParams,
    paper_scale,
)

__all__ = [
    "CHUNK",
    "MAX_ROUNDS",
    "MECHANISM_CODE",
    "MODEL_KEYS",
    "NAME",
    "PAYLOAD_SIZE",
    "SEED_BYTES",
    "SPHERE_DOMAIN",
    "GradientReport",
    "LdpSgd",
    "LdpSgdAccumulator",
    "LdpSgdDevice",
    "LdpSgdParams",
    "check_gradient",
    "clip_gradient",
    "encode",
    "model_from_params",
    "model_params",
    "noisy_gradient",
    "paper_scale",
    "parse_fragment",
    "project",
    "server_step",
    "simulate_reports",
    "sphere",
    "theorem_vi1",
]

#: Distinct rounds one accumulator keeps; fragments naming further rounds are chaff.
MAX_ROUNDS = 64
#: Reports whose sphere vectors are generated and summed at once (bounds memory: chunk × d).
CHUNK = 4096


def parse_fragment(fragment: bytes) -> tuple[int, float, bytes]:
    """``(round, ±1, seed)`` of one fragment.

    Raises:
        FragmentError: naming what is wrong.
    """
    payload = unframe(MECHANISM_CODE, PAYLOAD_SIZE, fragment)
    if payload[4] > 1:
        raise FragmentError(f"sign byte must be 0 or 1, got {payload[4]}")
    return int.from_bytes(payload[:4], "big"), 1.0 if payload[4] else -1.0, payload[5:]


@dataclass
class LdpSgdAccumulator:
    """Per round: the sum of reconstructed reports ``Σ ẑ_i`` and how many; ``n`` contributions
    (devices) of the batches folded in."""

    dim: int
    sums: dict[int, FloatArray] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    n: int = 0

    def add(self, round_: int, vectors: FloatArray) -> None:
        """Add reconstructed reports of one round."""
        current = self.sums.get(round_)
        total = vectors.sum(axis=0)
        self.sums[round_] = total if current is None else current + total
        self.counts[round_] = self.counts.get(round_, 0) + len(vectors)

    def merge(self, other: LdpSgdAccumulator) -> LdpSgdAccumulator:
        """Sum of two accumulators of the same dimension."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge accumulators of dim {self.dim} and {other.dim}")
        merged = LdpSgdAccumulator(self.dim, dict(self.sums), dict(self.counts), self.n + other.n)
        for r, total in other.sums.items():
            merged.sums[r] = merged.sums[r] + total if r in merged.sums else total
            merged.counts[r] = merged.counts.get(r, 0) + other.counts[r]
        return merged

    def to_bytes(self) -> bytes:
        """Compressed, pickle-free serialization."""
        rounds = sorted(self.sums)
        buffer = io.BytesIO()
        np.savez_compressed(
            buffer,
            meta=np.array([self.dim, self.n], dtype=np.int64),
            rounds=np.array(rounds, dtype=np.int64),
            counts=np.array([self.counts[r] for r in rounds], dtype=np.int64),
            sums=np.array([self.sums[r] for r in rounds], dtype=np.float64).reshape(-1, self.dim),
        )
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> LdpSgdAccumulator:
        """Inverse of :meth:`to_bytes`."""
        with np.load(io.BytesIO(data), allow_pickle=False) as a:
            dim, n = (int(v) for v in a["meta"])
            rounds = [int(r) for r in a["rounds"]]
            sums = {r: a["sums"][i].astype(np.float64) for i, r in enumerate(rounds)}
            counts = {r: int(a["counts"][i]) for i, r in enumerate(rounds)}
        return cls(dim, sums, counts, n)


def noisy_gradient(params: LdpSgdParams, total: FloatArray, count: int) -> FloatArray:
    """Algorithm 5 line 5: ``scale · (1/m) Σ ẑ_i`` over the ``count`` reports of a round."""
    if count < 1:
        raise NoDataError("no report for this round")
    result: FloatArray = params.scale * total / count
    return result


def project(theta: FloatArray, radius: float) -> FloatArray:
    """L2 projection onto the ball of radius ``radius`` (Algorithm 5 line 6's ``Π_C``)."""
    norm = float(np.linalg.norm(theta))
    result: FloatArray = theta * (radius / norm) if norm > radius else theta
    return result


def server_step(params: LdpSgdParams, theta: FloatArray, gradient: FloatArray) -> FloatArray:
    """Algorithm 5 line 6: ``θ_{t+1} = Π_C(θ_t - η g_t)``."""
    return project(theta - params.learning_rate * gradient, params.radius)


def simulate_reports(
    params: LdpSgdParams, gradients: FloatArray, rng: np.random.Generator
) -> tuple[FloatArray, int]:
    """Vectorized Algorithm 4 for a population (``tau`` reports per row of ``gradients``):
    ``(Σ ẑ_i, count)`` as the server would accumulate them. Numpy's generator, ``v`` drawn
    directly (same distribution as :func:`sphere`): for simulations only, it protects nobody."""
    total = np.zeros(params.dim)
    for start in range(0, len(gradients), CHUNK):
        g = gradients[start : start + CHUNK]
        norms = np.linalg.norm(g, axis=1, keepdims=True)
        x = g * np.minimum(1.0, params.clip / np.maximum(norms, 1e-300))
        xn = np.linalg.norm(x, axis=1, keepdims=True)
        unit = x / np.maximum(xn, 1e-300)
        for _ in range(params.tau):
            z_sign = np.where(rng.random((len(g), 1)) < 0.5 + xn / (2 * params.clip), 1.0, -1.0)
            v = rng.standard_normal((len(g), params.dim))
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            sign = np.where(np.sum(unit * v, axis=1, keepdims=True) * z_sign >= 0, 1.0, -1.0)
            sign *= np.where(rng.random((len(g), 1)) < params.flip_prob, -1.0, 1.0)
            total += (sign * v).sum(axis=0)
    return total, len(gradients) * params.tau


def theorem_vi1(params: LdpSgdParams, n: int, delta: float) -> float:
    """Theorem VI.1's rate with the O(·) constant taken as 1 (for reference, never certified):
    ``(e^ε - 1)/√n · √(T log²(T/δ))``."""
    t = params.rounds
    return math.expm1(params.eps) / math.sqrt(n) * math.sqrt(t * math.log(t / delta) ** 2)


class LdpSgdTraining:
    """Algorithm 5 lines 4–6 at the server, as the analyzer's training facet
    (:class:`common.mechanisms.base.Training`): the reports naming round t give the noisy
    gradient of line 5, the projected step of line 6 gives θ_{t+1}; reports naming any other
    round are left out and counted."""

    def initial_model(self, params: LdpSgdParams) -> FloatArray:
        """θ_0 = 0."""
        return np.zeros(params.dim)

    def step(
        self,
        params: LdpSgdParams,
        theta: FloatArray,
        round_: int,
        accumulators: Sequence[LdpSgdAccumulator],
    ) -> TrainingStep:
        """θ_{t+1} = Π_C(θ_t − η g_t) over the reports of round ``round_``."""
        merged = LdpSgdAccumulator(params.dim)
        for accumulator in accumulators:
            merged = merged.merge(accumulator)
        used = merged.counts.get(round_, 0)
        refused = sum(merged.counts.values()) - used
        if used == 0:
            return TrainingStep(
                theta=theta, used=0, refused=refused, contributions=merged.n, gradient_norm=0.0
            )
        gradient = noisy_gradient(params, merged.sums[round_], used)
        return TrainingStep(
            theta=server_step(params, theta, gradient),
            used=used,
            refused=refused,
            contributions=merged.n,
            gradient_norm=float(np.linalg.norm(gradient)),
        )

    def model_params(self, round_: int, theta: FloatArray) -> dict[str, Any]:
        """``round`` and ``theta`` (:func:`model_params`), which devices train at."""
        return model_params(round_, theta)


class LdpSgd(LdpSgdDevice, Mechanism[LdpSgdParams, LdpSgdAccumulator]):
    """LDP-SGD through the mechanism interface (the estimate is the noisy gradient of the round
    with the most reports); it offers the training facet (:class:`LdpSgdTraining`)."""

    def training(self) -> LdpSgdTraining:
        return LdpSgdTraining()

    def new_accumulator(self, params: LdpSgdParams) -> LdpSgdAccumulator:
        return LdpSgdAccumulator(params.dim)

    def load_accumulator(self, params: LdpSgdParams, data: bytes) -> LdpSgdAccumulator:
        return LdpSgdAccumulator.from_bytes(data)

    def accumulate(
        self,
        params: LdpSgdParams,
        accumulator: LdpSgdAccumulator,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        """Regenerate each report's ``v`` from its seed and add ``sign · v`` to its round's sum;
        returns the invalid fragments (unparsable, or naming a round past :data:`MAX_ROUNDS`)."""
        by_round: dict[int, tuple[list[float], list[bytes]]] = {}
        invalid = 0
        for fragment in fragments:
            try:
                round_, sign, seed = parse_fragment(fragment)
            except FragmentError:
                invalid += 1
                continue
            known = round_ in accumulator.sums or round_ in by_round
            if not known and len(accumulator.sums) + len(by_round) >= MAX_ROUNDS:
                invalid += 1
                continue
            signs, seeds = by_round.setdefault(round_, ([], []))
            signs.append(sign)
            seeds.append(seed)
        for round_, (signs, seeds) in by_round.items():
            for start in range(0, len(seeds), CHUNK):
                vectors = sphere(seeds[start : start + CHUNK], accumulator.dim)
                accumulator.add(round_, vectors * np.asarray(signs[start : start + CHUNK])[:, None])
        accumulator.n += n_contributions
        return invalid

    def estimate(self, params: LdpSgdParams, accumulator: LdpSgdAccumulator) -> Estimate:
        if not accumulator.counts:
            return Estimate(
                values=np.zeros(params.dim),
                std_errors=np.zeros(params.dim),
                n=accumulator.n,
                clipped=False,
                note="LDP-SGD: no report",
            )
        round_ = max(accumulator.counts, key=lambda r: (accumulator.counts[r], r))
        count = accumulator.counts[round_]
        values = noisy_gradient(params, accumulator.sums[round_], count)
        std = np.full(params.dim, params.scale / math.sqrt(params.dim * count))
        note = f"LDP-SGD noisy gradient of round {round_} ({count} reports), Algorithm 5 line 5"
        return Estimate(values=values, std_errors=std, n=accumulator.n, clipped=False, note=note)

    def privacy(self, params: LdpSgdParams) -> PrivacyDescription:
        """One report: binary RR of a sign at ε, i.e. k-RR at k = 2 (replacement)."""
        return PrivacyDescription(KaryRR(k=2), params.eps)

    def certify(
        self, params: LdpSgdParams, delta: float, received: Sequence[Received[LdpSgdAccumulator]]
    ) -> ReleaseCertificate:
        per_epoch = epoch_batches(received)
        if not per_epoch:
            raise NoDataError("no batch received")
        certs = [
            self._round_certificate(params, min(c.values()), delta) for c in per_epoch.values()
        ]
        crowds = {f"{e}/{k}": v for e, c in per_epoch.items() for k, v in c.items()}
        return ReleaseCertificate(
            certified=compose_epochs([c[0] for c in certs]),
            other=compose_epochs([c[1] for c in certs]),
            lower=None,
            crowds=crowds,
            epochs=len(per_epoch),
        )

    def epoch_pair(
        self,
        params: LdpSgdParams,
        n: int,
        delta: float,
        *,
        deletion: tuple[float, float] | None = None,
        replacement: bool = False,
    ) -> Epoch | None:
        """A round at crowd n: the binary-RR pair (k-RR at k = 2), once per report of a device."""
        one = self.privacy(params).epoch(n, delta, deletion=deletion, replacement=replacement)
        if one is None or params.tau == 1:
            return one
        return Epoch(one.pairs * params.tau, one.certificates * params.tau, one.neighbouring)

    def _round_certificate(
        self, params: LdpSgdParams, n: int, delta: float
    ) -> tuple[BoundResult, BoundResult]:
        """A round at crowd n: ``tau`` reports per device, each at δ/τ, by basic composition
        (replacement, the natural notion; the other notion beside it); the lifetime ledger
        composes the pairs instead."""
        cert = self.privacy(params).certify(n, delta / params.tau)
        if params.tau == 1:
            return cert.certified, cert.other_notion
        return (
            compose_epochs([cert.certified] * params.tau),
            compose_epochs([cert.other_notion] * params.tau),
        )

    def training_eps(self, params: LdpSgdParams, n: int, delta: float) -> float:
        """Training-long central ε of ``rounds`` rounds at crowd n (PLD composition of the pairs,
        :func:`common.accounting.lifetime.compose_epochs`)."""
        epoch = self.epoch_pair(params, n, delta / params.rounds)
        if epoch is None:
            raise ValueError("no dominating pair for this channel")
        result = compose_lifetime([epoch] * params.rounds, delta)
        if result.eps is None:
            raise ValueError(f"nothing certified at n={n}, delta={delta}")
        return float(result.eps)
