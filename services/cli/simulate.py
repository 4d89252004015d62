"""``esa simulate``: paper-scale experiments with the vectorized aggregate simulators."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

T = TypeVar("T")


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}") from error
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"expected positive numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise click.BadParameter(f"expected whole numbers, got {text!r}")
    return [int(v) for v in values]


def _bounds(choice: str) -> list[str]:
    return ["paper", "tightest"] if choice == "both" else [choice]


def _with_progress(
    total: int, label: str, work: Callable[[Callable[[], None]], list[T]]
) -> list[T]:
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task(label, total=total)
        return work(lambda: progress.advance(task))


def _summary(rows: Sequence[Any], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("ε_c", "bound", "τ", "ε0", "ε_ℓ∞", "ε_ℓ1", "RMSE", "predicted"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r.eps_c:g}",
            r.bound,
            str(r.tau),
            f"{r.eps0:.3f}",
            f"{r.eps_l_inf:.2f}",
            f"{r.eps_l1:.2f}",
            f"{r.rmse:.2f}",
            f"{r.rmse_predicted:.2f}",
        )
    return table


@click.group()
def simulate() -> None:
    """Simulated populations through the real mechanisms and accounting (ESA-revisited §VII)."""


@simulate.command("histogram")
@click.option(
    "--dataset",
    type=click.Choice(["zipf", "horse", "camera", "hubble", "words"]),
    required=True,
    help="Population: heavy hitters, an image, or English words.",
)
@click.option("--eps-c", "eps_c", required=True, help="Target central ε values, comma-separated.")
@click.option("--delta", type=float, required=True, help="δ of the central guarantee.")
@click.option(
    "--tau",
    default="1",
    show_default=True,
    help="Fragments per report, comma-separated (1 = attribute fragments only).",
)
@click.option(
    "--bound",
    type=click.Choice(["paper", "tightest", "both"]),
    default="both",
    show_default=True,
    help="paper = Lemma II.6 as in the paper's tables.",
)
@click.option("--n", "n", type=int, default=None, help="Rescale the population to n respondents.")
@click.option(
    "--eps-f",
    type=float,
    default=None,
    help="Fragment ε for τ > 1 (default: as much noise as the backstop).",
)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--seed", type=int, default=0, show_default=True)
def histogram_command(
    dataset: str,
    eps_c: str,
    delta: float,
    tau: str,
    bound: str,
    n: int | None,
    eps_f: float | None,
    out: Path,
    seed: int,
) -> None:
    """Plan ε0 per target ε_c, simulate the channel, write results.csv and figures to --out.

    \b
    Example (ESA-revisited Table IV):
      esa simulate histogram --dataset horse --n 1914589 --eps-c 0.05,0.25,0.5,0.75,1 \\
          --delta 5e-8 --tau 1,4,16 --out runs/horse
    """
    from services.tools import simulation, simulation_plots
    from services.tools.populations import histogram

    population = histogram(dataset, n, seed)
    tasks = simulation.histogram_tasks(_floats(eps_c), _bounds(bound), _ints(tau))
    runs = _with_progress(
        len(tasks),
        f"{dataset} (n={population.n:,}, k={population.k:,})",
        lambda done: list(simulation.run_histogram(population, tasks, delta, seed, eps_f, done)),
    )
    out.mkdir(parents=True, exist_ok=True)
    simulation.write_results([r.row for r in runs], out / "results.csv")
    figure = out / (f"{dataset}_reconstructions.png" if population.shape else f"{dataset}_top.png")
    if population.shape:
        simulation_plots.image_grid(population, runs, figure)
    else:
        simulation_plots.top_bars(population, runs, figure)
    Console().print(
        _summary([r.row for r in runs], f"{dataset}: n = {population.n:,}, δ = {delta:g}")
    )
    click.echo(f"wrote {out / 'results.csv'} and {figure}")


@simulate.command("longitudinal")
@click.option("--n", "n", type=int, default=100_000, show_default=True, help="Users.")
@click.option("--d", "d", type=int, default=64, show_default=True, help="Horizon (power of two).")
@click.option("--k", "k", type=int, default=4, show_default=True, help="Max changes per user.")
@click.option(
    "--change-rate",
    type=float,
    default=0.5,
    show_default=True,
    help="Each user changes Bin(k, rate) times.",
)
@click.option("--eps-c", "eps_c", required=True, help="Target central ε values, comma-separated.")
@click.option("--delta", type=float, required=True, help="δ of the central guarantee.")
@click.option(
    "--bound", type=click.Choice(["paper", "tightest", "both"]), default="both", show_default=True
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 1000),
    default=10,
    show_default=True,
    help="Simulations averaged into the RMSE (periods share tree nodes).",
)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--seed", type=int, default=0, show_default=True)
def longitudinal_command(
    n: int,
    d: int,
    k: int,
    change_rate: float,
    eps_c: str,
    delta: float,
    bound: str,
    repeats: int,
    out: Path,
    seed: int,
) -> None:
    """Tree-based longitudinal reports: running counts over d periods, with certified ε."""
    from services.tools import simulation, simulation_plots
    from services.tools.populations import longitudinal

    try:
        population = longitudinal(n, d, k, change_rate, seed)
        targets = _floats(eps_c)
        bounds = _bounds(bound)
        runs = _with_progress(
            len(targets) * len(bounds),
            f"longitudinal (n={n:,}, d={d})",
            lambda done: list(
                simulation.run_longitudinal(population, targets, bounds, delta, seed, done, repeats)
            ),
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    out.mkdir(parents=True, exist_ok=True)
    simulation.write_results([r.row for r in runs], out / "results.csv")
    simulation_plots.running_counts(runs, out / "longitudinal_counts.png")
    Console().print(_summary([r.row for r in runs], f"longitudinal: n = {n:,}, d = {d}, k = {k}"))
    click.echo(f"wrote {out / 'results.csv'} and {out / 'longitudinal_counts.png'}")
