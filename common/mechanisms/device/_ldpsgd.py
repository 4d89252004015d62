"""LDP-SGD's vector arithmetic on the device — ESA-revisited Algorithm 4 with the PRG reduction:
the fixed seed-to-sphere sampler (:func:`sphere`, SHAKE-256), gradient clipping, the encoder,
and the model a signed config publishes. Needs numpy, so :mod:`common.mechanisms.device.ldpsgd`
imports it only when an LDP-SGD channel reports.

Sampler and constant: docs/mechanisms.md, "LDP-SGD"; docs/ldp-sgd.md.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.mechanisms._estimates import FloatArray
from common.mechanisms._wire import frame
from common.mechanisms.device import MechanismError
from common.mechanisms.device.ldpsgd import (
    MECHANISM_CODE,
    SEED_BYTES,
    SPHERE_DOMAIN,
    GradientReport,
    LdpSgdParams,
)
from common.randomness import RandomSource, bernoulli, default_source, random_bytes


def sphere(seeds: Sequence[bytes], dim: int) -> FloatArray:
    """The fixed seed-to-sphere sampler: one unit vector per seed (docs/mechanisms.md, LDP-SGD)."""
    pairs = (dim + 1) // 2
    raw = b"".join(hashlib.shake_256(SPHERE_DOMAIN + s).digest(16 * pairs) for s in seeds)
    words = np.frombuffer(raw, dtype="<u8").reshape(len(seeds), pairs, 2)
    u = ((words >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    radius = np.sqrt(-2.0 * np.log(u[:, :, 0]))
    angle = 2.0 * math.pi * u[:, :, 1]
    normals = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=2)
    normals = normals.reshape(len(seeds), 2 * pairs)[:, :dim]
    result: FloatArray = normals / np.linalg.norm(normals, axis=1, keepdims=True)
    return result


def clip_gradient(gradient: FloatArray, clip: float) -> FloatArray:
    """Algorithm 4 line 1: ``x · min(1, L/‖x‖)``."""
    norm = float(np.linalg.norm(gradient))
    result: FloatArray = gradient * min(1.0, clip / norm) if norm > 0 else gradient
    return result


def check_gradient(value: Any, params: LdpSgdParams) -> GradientReport:
    """Validate a device's value (a :class:`GradientReport` of the channel's dimension)."""
    if not isinstance(value, GradientReport):
        raise MechanismError(f"value must be a GradientReport, got value={type(value).__name__}")
    if isinstance(value.round, bool) or not isinstance(value.round, int):
        raise MechanismError(f"round must be an integer, got round={value.round!r}")
    if not 0 <= value.round < 1 << 32:
        raise MechanismError(f"round must be in [0, 2**32), got round={value.round}")
    gradient = np.asarray(value.gradient, dtype=np.float64)
    if gradient.shape != (params.dim,) or not np.all(np.isfinite(gradient)):
        raise MechanismError(
            f"gradient must be {params.dim} finite numbers, got shape {gradient.shape}"
        )
    return GradientReport(value.round, gradient)


def encode(
    value: GradientReport, params: LdpSgdParams, rng: RandomSource | None = None
) -> list[bytes]:
    """Algorithm 4 with the PRG reduction: ``tau`` fragments ``(round, sign, seed)``."""
    report = check_gradient(value, params)
    rng = rng or default_source()
    x = clip_gradient(report.gradient, params.clip)
    norm = float(np.linalg.norm(x))
    fragments = []
    for _ in range(params.tau):
        # z = ±L x/‖x‖ (a uniform direction when x = 0: E[z] = x = 0 either way).
        direction = x / norm if norm > 0 else sphere([random_bytes(rng, SEED_BYTES)], params.dim)[0]
        z_sign = 1.0 if bernoulli(rng, 0.5 + norm / (2.0 * params.clip)) else -1.0
        seed = random_bytes(rng, SEED_BYTES)
        bit = z_sign * float(direction @ sphere([seed], params.dim)[0]) >= 0.0
        if bernoulli(rng, params.flip_prob):
            bit = not bit
        payload = report.round.to_bytes(4, "big") + bytes((int(bit),)) + seed
        fragments.append(frame(MECHANISM_CODE, payload))
    return fragments


def model_params(round_: int, theta: FloatArray) -> dict[str, Any]:
    """The published model as ``params`` keys of the signed channel config: ``round`` and
    ``theta`` (standard base64 of big-endian float64)."""
    data = np.asarray(theta, dtype=">f8").tobytes()
    return {"round": int(round_), "theta": base64.b64encode(data).decode()}


def model_from_params(params: Mapping[str, Any], dim: int) -> tuple[int, FloatArray]:
    """``(round, θ)`` from a signed channel config's ``params`` (what a device trains at).

    Raises:
        MechanismError: the config publishes no model, or one of another dimension.
    """
    round_, text = params.get("round"), params.get("theta")
    if isinstance(round_, bool) or not isinstance(round_, int) or not isinstance(text, str):
        raise MechanismError("channel params publish no model (round and theta)")
    try:
        theta = np.frombuffer(base64.b64decode(text, validate=True), dtype=">f8")
    except ValueError as error:
        raise MechanismError(f"theta is not base64 float64: {error}") from error
    if theta.shape != (dim,):
        raise MechanismError(f"theta must have {dim} values, got {theta.size}")
    return round_, theta.astype(np.float64)
