"""``esa account``: certify central (ε, δ) and plan ε0 (ACCOUNTING.md, CLI section)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from common.accounting import (
    BoundResult,
    Certification,
    Mechanism,
    MechanismParams,
    Method,
    Plan,
    certify,
    plan_eps0,
)

_MECHANISMS = [m.value for m in Mechanism]
_METHODS = [
    m.value for m in Method if m not in (Method.LOCAL, Method.LOWER_2RR, Method.ESA_THM_IV1)
]


def _common_options(function: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--mechanism",
            "-m",
            type=click.Choice(_MECHANISMS),
            default="generic",
            show_default=True,
            help="Which LDP mechanism the reports come from.",
        ),
        click.option(
            "--n",
            "n",
            type=int,
            required=True,
            help="Crowd size: contributions in the smallest batch.",
        ),
        click.option("--delta", type=float, required=True, help="δ of the central guarantee."),
        click.option(
            "--bound",
            type=click.Choice(_METHODS),
            default=None,
            help="Use only this method (e.g. cheu-lemma-ii6 reproduces the paper's tables).",
        ),
        click.option(
            "--json", "as_json", is_flag=True, help="Print one JSON object instead of a table."
        ),
        click.option("--k", type=int, default=None, help="krr: alphabet size."),
        click.option("--tau", type=int, default=None, help="rfrag: fragments per report."),
        click.option("--eps-f", type=float, default=None, help="rfrag: fragment ε_f."),
        click.option(
            "--d",
            "d",
            type=int,
            default=None,
            help="longitudinal: horizon; zsum: domain size (informational).",
        ),
        click.option(
            "--delta0",
            type=float,
            default=0.0,
            show_default=True,
            help="generic: δ0 of an (ε0, δ0)-DP randomizer (FMT21 Theorem 3.8).",
        ),
        click.option(
            "--n-declared",
            type=int,
            default=None,
            help="zsum: the declared crowd size that fixed the noise (default: --n).",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _params(
    k: int | None,
    tau: int | None,
    eps_f: float | None,
    d: int | None,
    delta0: float,
    n_declared: int | None,
) -> MechanismParams:
    return MechanismParams(k=k, eps_f=eps_f, tau=tau, d=d, delta0=delta0, n_declared=n_declared)


def _fmt(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.6g}"


def _bounds_table(cert: Certification, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("", "method", "ε", "δ", "neighbouring", "valid?", "note"):
        table.add_column(column, overflow="fold")
    rows: list[tuple[str, BoundResult]] = [
        ("★" if b is cert.certified else "", b) for b in cert.bounds
    ]
    if cert.lower is not None:
        rows.append(("↓", cert.lower))
    for mark, b in rows:
        valid = "yes" if b.valid_regime else "no"
        table.add_row(
            mark, str(b.method), _fmt(b.eps), f"{b.delta:.3g}", b.neighbouring, valid, b.note
        )
    return table


def _print_certification(console: Console, cert: Certification, heading: str) -> None:
    console.print(_bounds_table(cert, heading))
    c = cert.certified
    console.print(
        f"[bold]certified[/bold] ({c.neighbouring}): ε = {_fmt(c.eps)}, δ = {c.delta:.3g} "
        f"via {c.method}   (★ = smallest valid upper bound; ↓ = lower bound, never certified)"
    )
    o = cert.other_notion
    console.print(f"{o.neighbouring}: ε = {_fmt(o.eps)}, δ = {o.delta:.3g} ({o.note})")
    for local in cert.local:
        console.print(f"local ({local.neighbouring}): ε = {_fmt(local.eps)}  {local.note}")


def _run(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except ValueError as error:
        raise click.UsageError(str(error)) from error


@click.group()
def account() -> None:
    """Privacy accounting: amplification-by-shuffling bounds and the ε0 planner."""


@account.command("certify")
@click.option(
    "--eps0",
    type=float,
    default=None,
    help="Local ε of each report (ε per bit for krappor, sequence ε for longitudinal).",
)
@click.option("--eps-b", type=float, default=None, help="rfrag: backstop ε_b (same as --eps0).")
@_common_options
def certify_command(
    eps0: float | None,
    eps_b: float | None,
    mechanism: str,
    n: int,
    delta: float,
    bound: str | None,
    as_json: bool,
    k: int | None,
    tau: int | None,
    eps_f: float | None,
    d: int | None,
    delta0: float,
    n_declared: int | None,
) -> None:
    """Print every applicable bound for shuffling n reports and mark the certificate.

    \b
    Example:
      esa account certify --mechanism krappor --eps0 8 --n 1000000 --delta 1e-9
    """
    local = eps0 if eps0 is not None else eps_b
    if local is None:
        raise click.UsageError("give --eps0 (or --eps-b for rfrag)")
    params = _params(k, tau, eps_f, d, delta0, n_declared)
    methods = None if bound is None else [bound]
    cert = _run(lambda: certify(mechanism, local, n, delta, params, methods))
    if as_json:
        click.echo(json.dumps(cert.as_dict()))
        return
    heading = f"{mechanism}: ε0 = {local:g}, n = {n:,}, δ = {delta:g}"
    _print_certification(Console(), cert, heading)


@account.command("plan")
@click.option("--target-eps", type=float, required=True, help="Target central ε.")
@_common_options
def plan_command(
    target_eps: float,
    mechanism: str,
    n: int,
    delta: float,
    bound: str | None,
    as_json: bool,
    k: int | None,
    tau: int | None,
    eps_f: float | None,
    d: int | None,
    delta0: float,
    n_declared: int | None,
) -> None:
    """Print the largest ε0 whose certified central ε is at most --target-eps.

    For rfrag the planned value is the backstop ε_b (give --eps-f and --tau).

    \b
    Example (ESA-revisited Table I, ε_c = 1):
      esa account plan --target-eps 1 --delta 5e-10 --n 203950512 \\
          --mechanism krappor --bound cheu-lemma-ii6
    """
    params = _params(k, tau, eps_f, d, delta0, n_declared)
    plan: Plan = _run(lambda: plan_eps0(target_eps, delta, n, mechanism, params, bound))
    if as_json:
        click.echo(json.dumps(plan.as_dict()))
        return
    console = Console()
    console.print(
        f"[bold]ε0 = {plan.eps0:.2f}[/bold]  ({plan.eps0:.6f}) is the largest local ε that "
        f"certifies central ε <= {target_eps:g} at δ = {delta:g}, n = {n:,} ({mechanism}, "
        f"via {plan.method})"
    )
    per = Table(title="largest ε0 per method", title_justify="left")
    per.add_column("method")
    per.add_column("ε0")
    for method, value in plan.per_method:
        per.add_row(str(method), "—" if value is None else f"{value:.4f}")
    console.print(per)
    _print_certification(console, plan.certification, f"certification at ε0 = {plan.eps0:.6f}")
