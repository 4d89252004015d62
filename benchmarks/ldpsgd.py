"""LDP-SGD at small scale (ESA-revisited §VI–§VII-C, Table XII's mechanism on another dataset).

Multinomial logistic regression (64 pixels + bias, 10 classes: d = 650) on scikit-learn's
bundled handwritten digits (1,797 8×8 images, shipped offline), split 75/25 with a fixed seed.
A population of N devices is built by resampling the training images (each device holds one
example); every round (= epoch) every device sends ``tau`` LDP-SGD reports of its gradient at
θ_t (Algorithm 4), and the server takes the step of Algorithm 5 (:func:`server_step`).

Two aggregate simulators: ``exact`` runs Algorithm 4 per report, vectorized
(:func:`common.mechanisms.ldpsgd.simulate_reports`); ``clt`` draws the round's sum of reports
from its normal approximation: mean ``Σ x_i / scale`` (the estimator is unbiased) and
covariance ``(m/d) I`` (the exact one is ``(m/d) I - Σ μ_i μ_iᵀ``, so this slightly overstates
the noise). The benchmark checks the two against each other at N = 2·10^4 before using ``clt``
for larger populations. The certified training-long central ε is the PLD composition of the
rounds' binary-RR pairs at crowd N (:meth:`LdpSgd.training_eps`), Theorem VI.1's rate (O(·) constant
1) beside it for reference.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/ldpsgd.py`` (prints markdown;
``--plot docs/figures/ldpsgd.png`` draws accuracy against rounds).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine

from common.mechanisms import ldpsgd

Floats = npt.NDArray[np.float64]
CLASSES = 10
DELTA = 1e-6


@dataclass(frozen=True)
class Data:
    """Features with a bias column (scaled to [0, 1]) and labels, train and test."""

    x_train: Floats
    y_train: npt.NDArray[np.int64]
    x_test: Floats
    y_test: npt.NDArray[np.int64]


def load(seed: int = 0) -> Data:
    """The bundled digits, split 75/25."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = np.hstack([digits.data / 16.0, np.ones((len(digits.data), 1))])
    xtr, xte, ytr, yte = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    return Data(xtr, ytr.astype(np.int64), xte, yte.astype(np.int64))


def gradients(theta: Floats, x: Floats, y: npt.NDArray[np.int64]) -> Floats:
    """Per-example gradient of the cross-entropy loss, flattened to d = 10 × 65."""
    w = theta.reshape(CLASSES, x.shape[1])
    logits = x @ w.T
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    result: Floats = (p[:, :, None] * x[:, None, :]).reshape(len(y), -1)
    return result


def accuracy(theta: Floats, data: Data) -> float:
    w = theta.reshape(CLASSES, data.x_test.shape[1])
    return float(np.mean(np.argmax(data.x_test @ w.T, axis=1) == data.y_test))


def baseline(data: Data, rounds: int, rate: float) -> list[float]:
    """Non-private full-batch gradient descent on the same model (unclipped)."""
    theta = np.zeros(CLASSES * data.x_train.shape[1])
    curve = []
    for _ in range(rounds):
        theta = theta - rate * gradients(theta, data.x_train, data.y_train).mean(axis=0)
        curve.append(accuracy(theta, data))
    return curve


def train(
    data: Data,
    params: ldpsgd.LdpSgdParams,
    population: int,
    mode: str,
    rng: np.random.Generator,
) -> list[float]:
    """Accuracy after each round of LDP-SGD with N = ``population`` resampled devices."""
    holders = rng.multinomial(population, np.full(len(data.y_train), 1 / len(data.y_train)))
    theta = np.zeros(params.dim)
    curve = []
    for _ in range(params.rounds):
        grads = gradients(theta, data.x_train, data.y_train)
        clipped = grads * np.minimum(1.0, params.clip / np.linalg.norm(grads, axis=1))[:, None]
        if mode == "exact":
            devices = np.repeat(grads, holders, axis=0)
            total, count = ldpsgd.simulate_reports(params, devices, rng)
        else:
            count = population * params.tau
            mean = params.tau * (holders @ clipped) / params.scale
            total = mean + rng.standard_normal(params.dim) * np.sqrt(count / params.dim)
        theta = ldpsgd.server_step(
            theta=theta, params=params, gradient=ldpsgd.noisy_gradient(params, total, count)
        )
        curve.append(accuracy(theta, data))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    data = load()
    rate, clip, radius = 2.0, 1.0, 50.0
    base = baseline(data, args.rounds, rate)
    started = time.perf_counter()
    print(f"Machine: {machine(pinned=False)}.\n")
    print(
        f"Non-private baseline (full-batch GD, rate {rate}): "
        f"{base[-1]:.3f} after {args.rounds} rounds.\n"
    )

    def params(eps: float, tau: int = 1) -> ldpsgd.LdpSgdParams:
        return ldpsgd.LdpSgdParams(
            dim=650,
            eps=eps,
            clip=clip,
            radius=radius,
            learning_rate=rate,
            tau=tau,
            rounds=args.rounds,
        )

    print("| check | N | ε_ℓe | exact | clt |\n|---|---|---|---|---|")
    for eps in (2.0,):
        p = params(eps)
        exact = train(data, p, 20_000, "exact", np.random.default_rng(1))
        clt = train(data, p, 20_000, "clt", np.random.default_rng(1))
        print(f"| final accuracy | 20000 | {eps} | {exact[-1]:.3f} | {clt[-1]:.3f} |")
    print()
    rows, curves = [], {}
    for population in (10_000, 100_000, 1_000_000):
        for eps in (1.0, 2.0, 4.0):
            p = params(eps)
            curve = train(data, p, population, "clt", np.random.default_rng(7))
            curves[(population, eps)] = curve
            central = ldpsgd.LdpSgd().training_eps(p, population, DELTA)
            reference = ldpsgd.theorem_vi1(p, population, DELTA)
            rows.append((population, eps, curve[-1], base[-1] - curve[-1], central, reference))
    print(
        f"| N | ε_ℓe per round | test accuracy after {args.rounds} rounds | below baseline "
        f"| certified central ε (δ = {DELTA:g}, PLD) | Theorem VI.1 rate (reference) |"
    )
    print("|---|---|---|---|---|---|")
    for population, eps, acc, gap, central, reference in rows:
        print(
            f"| {population} | {eps} | {acc:.3f} | {gap * 100:.1f} points | {central:.3f} "
            f"| {reference:.2f} |"
        )
    print(
        "\nAccuracy against rounds (N = 10^5, ε_ℓe = 2): "
        + ", ".join(f"{a:.2f}" for a in curves[(100_000, 2.0)][:: max(1, args.rounds // 10)])
    )
    print(f"\nTotal {time.perf_counter() - started:.1f} s.")
    if args.plot is not None:
        plot(args.plot, base, curves)


def plot(path: Path, base: list[float], curves: dict[tuple[int, float], list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rounds = np.arange(1, len(base) + 1)
    ax.plot(rounds, base, "k--", label="non-private GD")
    for (population, eps), curve in sorted(curves.items()):
        if eps == 2.0 or population == 100_000:
            ax.plot(rounds, curve, label=f"LDP-SGD N={population:.0e}, ε_ℓe={eps}")
    ax.set_xlabel("round (epoch)")
    ax.set_ylabel("test accuracy")
    ax.set_title("LDP-SGD on the bundled digits (multinomial logistic regression)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
