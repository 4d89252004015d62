"""``esa account``: certify central (ε, δ), compose lifetime ε, plan ε0 (docs/accounting.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from common import accounting
from common.accounting.results import BoundResult, Method

if TYPE_CHECKING:
    from common.accounting import Certification, LifetimeResult, LocalRandomizer, Plan


def _shuffled_bounds() -> list[str]:
    """What ``--bound`` selects: every shuffled upper bound declared, a plug-in's too."""
    from common.accounting import randomizers  # noqa: F401 - declares the built-in bounds
    from common.mechanisms import registry

    registry.load_plugins()
    return [str(m) for m in Method.declared("shuffled")]


def _apply(function: Callable[..., Any], options: list[Callable[..., Any]]) -> Callable[..., Any]:
    for option in reversed(options):
        function = option(function)
    return function


class MechanismName(click.ParamType):  # type: ignore[type-arg]
    """``generic`` or a registered mechanism's name (plug-ins included), checked against the
    registry when used."""

    name = "mechanism"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from common.mechanisms import registry

        if value == "generic" or value in registry.names():
            return str(value)
        known = ", ".join(["generic", *registry.names()])
        self.fail(f"unknown mechanism {value!r}; known: {known}", param, ctx)


_MECHANISM_OPTION = click.option(
    "--mechanism",
    "-m",
    type=MechanismName(),
    default="generic",
    show_default=True,
    help="Which LDP mechanism the reports come from: generic (any ε0-DP randomizer) or a "
    "registered mechanism (krappor, krr, rfrag, longitudinal, zsum, plug-ins).",
)
_JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object instead of a table."
)


def _described() -> dict[str, type[LocalRandomizer]]:
    """Every privacy description a flag of ``esa account`` can fill: accounting's generic one
    and each registered mechanism's (``randomizer_type``), by the name ``--mechanism`` takes."""
    from common.mechanisms import registry

    registry.load_plugins()  # a plug-in's description gets its options too
    described: dict[str, type[LocalRandomizer]] = {"generic": accounting.GenericRandomizer}
    for name in registry.names():
        kind = type(registry.get(name)).randomizer_type
        if kind is not None and is_dataclass(kind):  # flags fill a dataclass's fields
            described[name] = kind
    return described


def _param_options() -> list[click.Option]:
    """One option per field the descriptions mark as a flag (:func:`accounting.randomizers.flag`):
    a mechanism's parameters reach the accountant without this command naming them."""
    from common.accounting.randomizers import flagged

    return [
        click.Option(
            ["--" + name.replace("_", "-")], type=value_type, default=None, help="; ".join(helps)
        )
        for name, (value_type, helps) in sorted(flagged(_described()).items())
    ]


def _bound_and_param_options() -> list[click.Option]:
    """``--bound`` (every shuffled bound declared, a plug-in's too) and the parameters'."""
    bound = click.Option(
        ["--bound"],
        type=click.Choice(_shuffled_bounds()),
        default=None,
        help="Use only this method (e.g. cheu-lemma-ii6 reproduces the paper's tables).",
    )
    return [bound, *_param_options()]


class DescribedCommand(click.Command):
    """A command whose options the privacy descriptions name (a mechanism's parameters,
    ``--bound``) are built when it is first used (parsed, or its own ``--help``): listing the
    commands (``esa account --help``) loads no mechanism, numpy or scipy."""

    def __init__(self, *args: Any, described: Callable[[], list[click.Option]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._described: Callable[[], list[click.Option]] | None = described

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if self._described is not None:
            self.params.extend(self._described())
            self._described = None
        return super().get_params(ctx)


def _common_options(function: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        _MECHANISM_OPTION,
        click.option(
            "--n",
            "n",
            type=int,
            required=True,
            help="Crowd size: contributions in the smallest batch.",
        ),
        click.option("--delta", type=float, required=True, help="δ of the central guarantee."),
        _JSON_OPTION,
    ]
    return _apply(function, options)


def _randomizer(mechanism: str, **given: float | None) -> LocalRandomizer:
    """The privacy description the accountant certifies, built from the parameter flags.

    ``generic`` is accounting's own description; any other name is looked up in the mechanism
    registry, whose class says which description its reports have (``randomizer_type``); the
    flags fill its fields by name.
    """
    kind = _randomizer_type(mechanism)
    specs = {spec.name: spec for spec in fields(kind)}  # type: ignore[arg-type]
    values = {name: value for name, value in given.items() if value is not None}
    extra = sorted(set(values) - set(specs))
    if extra:
        flags = ", ".join("--" + name.replace("_", "-") for name in extra)
        raise click.UsageError(f"{flags} does not apply to {mechanism}")
    for name, spec in specs.items():
        if name not in values and spec.default is MISSING and spec.default_factory is MISSING:
            flag = "--" + name.replace("_", "-")
            raise click.UsageError(f"{name} is required for {mechanism}: give {flag}")
    built: LocalRandomizer = _run(lambda: kind(**values))
    return built


def _randomizer_type(mechanism: str) -> type[LocalRandomizer]:
    if mechanism == "generic":
        return accounting.GenericRandomizer
    from common.mechanisms import registry

    found = type(registry.get(mechanism))
    if found.randomizer_type is None:
        raise click.UsageError(
            f"{mechanism} declares no privacy description that these flags fill (a device "
            "sends several reports per batch, or the argument needs the channel's parameters)"
        )
    return found.randomizer_type


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


@account.command("certify", cls=DescribedCommand, described=_bound_and_param_options)
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
    **param_values: Any,
) -> None:
    """Print every applicable bound for shuffling n reports and mark the certificate.

    \b
    Example:
      esa account certify --mechanism krappor --eps0 8 --n 1000000 --delta 1e-9
    """
    local = eps0 if eps0 is not None else eps_b
    if local is None:
        raise click.UsageError("give --eps0 (or --eps-b for rfrag)")
    randomizer = _randomizer(mechanism, **param_values)
    methods = None if bound is None else [bound]
    cert = _run(lambda: accounting.certify(randomizer, local, n, delta, methods))
    if as_json:
        click.echo(json.dumps({"mechanism": mechanism, **cert.as_dict()}))
        return
    heading = f"{mechanism}: ε0 = {local:g}, n = {n:,}, δ = {delta:g}"
    _print_certification(Console(), cert, heading)


@account.command("plan", cls=DescribedCommand, described=_bound_and_param_options)
@click.option(
    "--target-eps",
    type=float,
    required=True,
    help="Target central ε (with --epochs: the target LIFETIME ε).",
)
@click.option(
    "--epochs",
    type=int,
    default=None,
    help="Plan for a lifetime target: ε0 whose lifetime ε over this many epochs (crowd --n "
    "each, PLD composition) is at most --target-eps.",
)
@_common_options
def plan_command(
    target_eps: float,
    epochs: int | None,
    mechanism: str,
    n: int,
    delta: float,
    bound: str | None,
    as_json: bool,
    **param_values: Any,
) -> None:
    """Print the largest ε0 whose certified central ε is at most --target-eps.

    For rfrag the planned value is the backstop ε_b (give --eps-f and --tau). With
    --epochs the target is the lifetime ε over that many epochs (see `esa account compose`).

    \b
    Example (ESA-revisited Table I, ε_c = 1):
      esa account plan --target-eps 1 --delta 5e-10 --n 203950512 \\
          --mechanism krappor --bound cheu-lemma-ii6
    Example (lifetime ε <= 2 over a year of daily epochs):
      esa account plan --target-eps 2 --epochs 365 --delta 1e-5 --n 5000 -m krappor
    """
    randomizer = _randomizer(mechanism, **param_values)
    if epochs is not None:
        if bound is not None:
            raise click.UsageError("--bound applies to one epoch; it cannot be used with --epochs")
        _plan_lifetime(target_eps, epochs, mechanism, randomizer, n, delta, as_json)
        return
    plan: Plan = _run(lambda: accounting.plan_eps0(target_eps, delta, n, randomizer, bound))
    if as_json:
        click.echo(json.dumps({"mechanism": mechanism, **plan.as_dict()}))
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


def _lifetime_table(result: LifetimeResult, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("", "composition", "lifetime ε", "how δ is divided"):
        table.add_column(column, overflow="fold")
    split = result.delta_split
    certs = f" + {split.certificates:.3g} certificates" if split.certificates else ""
    rows = [
        (
            "pld",
            "PLD (dp_accounting, pessimistic)",
            result.eps_pld,
            f"{split.pld_pairs:.3g} pairs (≤ {split.pld_truncation:.2g} for cut tails){certs}",
        ),
        (
            "basic",
            "basic",
            result.eps_basic,
            f"{result.pair_parts} × {split.basic_per_part:.3g}{certs}",
        ),
        (
            result.advanced_rule,
            f"advanced ({result.advanced_rule})",
            result.eps_advanced,
            f"δ' {split.advanced_slack:.3g} + {result.parts} × {split.advanced_per_step:.3g}",
        ),
    ]
    marked = False
    for method, label, eps, how in rows:
        mark = "★" if method == result.method and not marked else ""
        marked = marked or bool(mark)
        table.add_row(mark, label, _fmt(eps), how)
    return table


def _print_lifetime(console: Console, result: LifetimeResult, title: str) -> None:
    console.print(_lifetime_table(result, title))
    ratio = (
        f"; {result.eps_basic / result.eps:.1f}x below basic composition"
        if math.isfinite(result.eps) and result.eps > 0
        else ""
    )
    console.print(
        f"[bold]lifetime ε = {_fmt(result.eps)}[/bold] at δ = {result.delta:.3g} "
        f"({result.neighbouring}, {result.epochs} epochs) via {result.method}{ratio}   "
        f"(★ = reported: the smallest of the three)"
    )


def _parse_crowds(crowds: str | None, n: int | None, epochs: int | None) -> list[int]:
    if crowds is None:
        if n is None:
            raise click.UsageError("give --n (with --epochs) or --crowds")
        return [n] * (1 if epochs is None else epochs)
    try:
        values = [int(part) for part in crowds.split(",") if part.strip()]
    except ValueError:
        raise click.UsageError(
            f"--crowds must be integers separated by commas, got {crowds!r}"
        ) from None
    if epochs is not None and epochs != len(values):
        raise click.UsageError(f"--epochs {epochs} does not match the {len(values)} --crowds")
    return values


@account.command("compose", cls=DescribedCommand, described=_param_options)
@click.option("--eps0", type=float, default=None, help="Local ε of each report (as in certify).")
@click.option("--eps-b", type=float, default=None, help="rfrag: backstop ε_b (same as --eps0).")
@_MECHANISM_OPTION
@click.option("--n", "n", type=int, default=None, help="Crowd of every epoch.")
@click.option("--epochs", type=int, default=None, help="Number of epochs (with --n).")
@click.option(
    "--crowds", default=None, help="Crowd of each epoch, comma-separated (instead of --n)."
)
@click.option("--delta", type=float, required=True, help="δ of the lifetime guarantee.")
@click.option("--eps-cr", type=float, default=None, help="Randomized deletion: ε_cr per epoch.")
@click.option("--delta-cr", type=float, default=None, help="Randomized deletion: δ_cr per epoch.")
@_JSON_OPTION
def compose_command(
    eps0: float | None,
    eps_b: float | None,
    mechanism: str,
    n: int | None,
    epochs: int | None,
    crowds: str | None,
    delta: float,
    eps_cr: float | None,
    delta_cr: float | None,
    as_json: bool,
    **param_values: Any,
) -> None:
    """Print one user's lifetime ε over all epochs: PLD beside basic and advanced composition.

    Each epoch is the mechanism's dominating pair at that epoch's crowd (FMT21 clone pair;
    the blanket pair for binary RR), composed with dp_accounting's privacy-loss distributions.

    \b
    Example (one k-RAPPOR channel, a year of daily epochs):
      esa account compose --mechanism krappor --eps0 2 --n 5000 --epochs 365 --delta 1e-5
    """
    local = eps0 if eps0 is not None else eps_b
    if local is None:
        raise click.UsageError("give --eps0 (or --eps-b for rfrag)")
    if (eps_cr is None) != (delta_cr is None):
        raise click.UsageError("give both --eps-cr and --delta-cr, or neither")
    sizes = _parse_crowds(crowds, n, epochs)
    randomizer = _randomizer(mechanism, **param_values)
    deletion = None if eps_cr is None or delta_cr is None else (eps_cr, delta_cr)
    result: LifetimeResult = _run(
        lambda: accounting.lifetime_for_mechanism(
            randomizer, local, sizes, delta, deletion=deletion
        )
    )
    if as_json:
        click.echo(json.dumps(result.as_dict()))
        return
    crowd_text = (
        f"n = {sizes[0]:,}" if len(set(sizes)) == 1 else f"n = {min(sizes):,}…{max(sizes):,}"
    )
    title = f"{mechanism}: ε0 = {local:g}, {crowd_text}, {len(sizes)} epochs, δ = {delta:g}"
    _print_lifetime(Console(), result, title)


def _plan_lifetime(
    target_eps: float,
    epochs: int,
    mechanism: str,
    randomizer: LocalRandomizer,
    n: int,
    delta: float,
    as_json: bool,
) -> None:
    eps0: float = _run(
        lambda: accounting.plan_eps0_lifetime(target_eps, delta, n, epochs, randomizer)
    )
    result = accounting.lifetime_for_mechanism(randomizer, eps0, [n] * epochs, delta)
    if as_json:
        certified = {
            "method": result.method,
            "eps": result.eps,
            "delta": result.delta,
            "neighbouring": result.neighbouring,
        }
        out: dict[str, object] = {"eps0": eps0, "target_eps": target_eps, "epochs": epochs}
        out |= {"n": n, "delta": delta, "mechanism": mechanism}
        out |= {"certified": certified, "lifetime": result.as_dict()}
        click.echo(json.dumps(out))
        return
    console = Console()
    console.print(
        f"[bold]ε0 = {eps0:.2f}[/bold]  ({eps0:.6f}) is the largest local ε whose lifetime ε "
        f"over {epochs} epochs is <= {target_eps:g} at δ = {delta:g}, n = {n:,} ({mechanism})"
    )
    _print_lifetime(console, result, f"lifetime at ε0 = {eps0:.6f}")
