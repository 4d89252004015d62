"""Figures for ``esa simulate``: what a person would rather look at than read.

* image datasets: the true image next to its reconstructions, one row per ε_c (ESA-revisited
  Table III style);
* histograms (zipf, words): the top values' true counts as bars with the estimates and 95%
  error bars, one panel per ε_c;
* longitudinal: true vs estimated running counts with a 95% band, one panel per ε_c.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.tools.populations import HistogramPopulation
from services.tools.simulation import HistogramRun, LongitudinalRun

TOP = 20


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(run: HistogramRun) -> str:
    r = run.row
    base = f"{r.bound}, τ={r.tau}" if r.tau > 1 else r.bound
    return f"{base}\nε_ℓ∞={r.eps_l_inf:.2f}  RMSE={r.rmse:.1f}"


def image_grid(population: HistogramPopulation, runs: Sequence[HistogramRun], path: Path) -> None:
    """True image and reconstructions (clipped at 0, same grey scale), a row per ε_c."""
    assert population.shape is not None
    plt = _pyplot()
    eps_cs = sorted({run.row.eps_c for run in runs})
    per_row = max(sum(1 for run in runs if run.row.eps_c == e) for e in eps_cs)
    fig, axes = plt.subplots(
        len(eps_cs), per_row + 1, figsize=(2.6 * (per_row + 1), 2.4 * len(eps_cs)), squeeze=False
    )
    top = float(population.counts.max())
    for i, eps_c in enumerate(eps_cs):
        axes[i][0].imshow(
            population.counts.reshape(population.shape), cmap="gray", vmin=0, vmax=top
        )
        axes[i][0].set_title(f"truth (n={population.n:,})\nε_c = {eps_c:g}", fontsize=8)
        row_runs = [run for run in runs if run.row.eps_c == eps_c]
        for j, run in enumerate(row_runs, start=1):
            image = np.clip(run.estimate, 0, top).reshape(population.shape)
            axes[i][j].imshow(image, cmap="gray", vmin=0, vmax=top)
            axes[i][j].set_title(_label(run), fontsize=7)
        for ax in axes[i]:
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def top_bars(population: HistogramPopulation, runs: Sequence[HistogramRun], path: Path) -> None:
    """Top-20 true counts as bars, estimates with 95% error bars, a panel per (ε_c, bound)."""
    plt = _pyplot()
    order = np.argsort(-population.counts)[:TOP]
    names = [population.labels[i] if population.labels else str(i) for i in order]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), squeeze=False)
    x = np.arange(order.size)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        ax.bar(x, population.counts[order], color="#c9d6e8", label="true count")
        ax.errorbar(
            x,
            run.estimate[order],
            yerr=1.96 * run.std_error[order],
            fmt="o",
            ms=3,
            color="#b2182b",
            capsize=2,
            label="estimate ± 95%",
        )
        ax.set_title(
            f"{population.name}: ε_c = {run.row.eps_c:g}, {_label(run)}".replace("\n", ", "),
            fontsize=9,
        )
        ax.set_xticks(x, names, rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def running_counts(runs: Sequence[LongitudinalRun], path: Path) -> None:
    """True vs estimated Σ_i st_i[t] with a 95% band, a panel per (ε_c, bound)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        t = np.arange(1, run.truth.size + 1)
        ax.plot(t, run.truth, color="black", label="true")
        ax.plot(t, run.estimate, color="#b2182b", label="estimate")
        ax.fill_between(
            t,
            run.estimate - 1.96 * run.std_error,
            run.estimate + 1.96 * run.std_error,
            color="#b2182b",
            alpha=0.2,
            label="95% band",
        )
        r = run.row
        ax.set_title(
            f"ε_c = {r.eps_c:g} ({r.bound}): sequence ε = {r.eps0:.2f}, "
            f"certified {run.certified_eps:.3f}, RMSE {r.rmse:.0f}",
            fontsize=9,
        )
        ax.set_xlabel("period t")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
