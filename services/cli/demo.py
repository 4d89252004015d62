"""``esa demo``: bring a deployment up (or use a running one), drive a device population
through it, close the epoch, and show what the analyzer released and certified."""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import click
from rich.console import Console

from services.cli import launcher
from services.tools import stopping
from services.tools.credentials import Credentials

if TYPE_CHECKING:
    from common.wire import ChannelConfig
    from services.tools.demo import DemoDeployment, DemoRun
    from services.tools.demo_results import ChannelResult


@click.command("demo")
@click.option(
    "--devices",
    type=click.IntRange(500, 1_000_000),
    default=15_000,
    show_default=True,
    help="Simulated devices; each reports once on every histogram channel and through every "
    "period of a longitudinal one. Fewer than 500 leave batches below the minimum crowd once "
    "randomized deletion has removed its share.",
)
@click.option(
    "--analyzer-url",
    default="http://127.0.0.1:8100",
    show_default=True,
    help="Use the deployment whose analyzer answers here; if none does, start one on this "
    "port (shufflers on the next ports) in a fresh directory and stop it at the end.",
)
@click.option(
    "--trust",
    "trust_file",
    default=None,
    envvar="ESA_TRUST_FILE",
    type=click.Path(path_type=Path),
    help="The keys to pin, one per trust domain: the analyzer's config-signing key and each "
    "shuffler's signing key — a trust file, or a folder of what the parties published "
    "(default: <var>/trust.json, written by `esa up`; else the keys the deployment serves, "
    "with a warning).",
)
@click.option(
    "--admin-token",
    default=None,
    envvar="ESA_SHUFFLER_ADMIN_TOKEN",
    help="One admin token for every shuffler, to close the epoch (a deployment whose parties "
    "share one); without it, each shuffler's own from --keys.",
)
@click.option(
    "--keys",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Each party's own admin and metrics tokens: <KEYS>/<party>/admin-token and "
    "metrics-token, or <KEYS>/<party>-admin-token (default: <var>/keys, where `esa up` keeps "
    "them; a deployment the demo starts uses its own).",
)
@click.option(
    "--var",
    "var",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var"),
    show_default=True,
    help="Where a running `esa up` keeps trust.json.",
)
@click.option(
    "--database-url-template",
    default=None,
    metavar="URL",
    help="When the demo starts its own deployment: one database per service (see `esa up`).",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("var/demo-report.html"),
    show_default=True,
    help="HTML report with plots.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the results as JSON here.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the population (who holds which value). The devices' privacy noise always "
    "comes from the operating system's CSPRNG.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 32),
    default=2,
    show_default=True,
    help="Worker processes that encode and seal the simulated devices' reports.",
)
@click.option(
    "--channel",
    "channels",
    multiple=True,
    metavar="ID",
    help="Only these channels (repeatable; default: every channel of the config).",
)
@click.option(
    "--rate",
    type=click.FloatRange(1.0, None),
    default=None,
    metavar="PER_SECOND",
    help="Send at most this many contributions per second in all (default: as fast as the "
    "shufflers answer), e.g. to spare a shared staging deployment.",
)
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="Also print each checked bin against its truth and each channel's privacy over time "
    "(per-epoch certificates, lifetime ε with its δ split, device budget); the HTML report "
    "always has them.",
)
@click.option(
    "--keep-running/--exit",
    "keep_running",
    default=None,
    help="If the demo started the deployment: keep it and its dashboard up until Ctrl-C, or "
    "stop it when the demo ends. Default: keep it up when stdin and stdout are a terminal, "
    "stop it otherwise (CI, pipes).",
)
def demo(**kw: Any) -> None:
    """Run a simulated device population through the whole pipeline and check the results.

    \b
    Every device is a device in protocol terms (own token at each shuffler, own nonces, CSPRNG
    encoding, HPKE sealing in worker processes, as `esa loadtest`). Afterwards the demo closes
    the epoch at every shuffler, waits for the batches to reach the analyzer, and prints per
    channel: n, the estimates' error against the population's truth and how many fall inside
    their 95% intervals, central and local ε; with --verbose also every checked bin, each
    epoch's certificate, the lifetime ε of a device in every epoch (PLD beside basic
    composition, δ split) and the device budget in use. The HTML report has all of it.

    A deployment the demo started stays up with its dashboard until Ctrl-C in a terminal, and
    stops at the end under CI or a pipe (--keep-running / --exit choose).
    """
    with stopping.stops_cleanly("esa demo"):
        _demo(kw)


def _demo(kw: dict[str, Any]) -> None:
    """``esa demo`` with its options by name: deployment, run, report; whatever happens, the
    processes it started are stopped and its folder removed."""
    import httpx

    from encoder_client import EsaError
    from services.tools.demo import DemoError

    options, var = _options(kw), kw["var"]
    with stopping.held():  # a stop arriving meanwhile waits until the folder is recorded
        workdir = Path(tempfile.mkdtemp(prefix="esa-demo-"))
    try:
        template = kw["database_url_template"]
        services, options.trust = _deployment(options, var, workdir, template)
        _run(options, workdir)
        keep = keep_up(bool(services), kw["keep_running"], interactive())
        finish(services, f"{options.analyzer_url}/", keep)
    except (DemoError, launcher.LaunchError) as error:
        raise click.ClickException(str(error)) from error
    except httpx.HTTPError as error:  # a service went away mid-run
        raise click.ClickException(f"lost contact with the deployment: {error}") from error
    except EsaError as error:  # a device's SDK refused (config, state)
        raise click.ClickException(f"a simulated device failed: {error}") from error
    finally:
        launcher.stop_started()  # the deployment it started, if it did (all of it)
        shutil.rmtree(workdir, ignore_errors=True)


def _options(kw: dict[str, Any]) -> _Options:
    """What the command line asked for; each party's own tokens from ``--keys`` (default
    ``<var>/keys``) unless one ``--admin-token`` serves every shuffler."""
    token, folder = kw["admin_token"], kw["keys"] or kw["var"] / "keys"
    return _Options(
        analyzer_url=kw["analyzer_url"].rstrip("/"),
        trust=kw["trust_file"],
        tokens=Credentials.shared(token) if token else Credentials(folder=folder),
        devices=kw["devices"],
        seed=kw["seed"],
        workers=kw["workers"],
        report=kw["report"],
        json_path=kw["json_path"],
        only=kw["channels"],
        rate=kw["rate"],
        verbose=kw["verbose"],
    )


def interactive() -> bool:
    """True when a person is at a terminal: stdin and stdout are both a TTY."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def keep_up(own: bool, keep_running: bool | None, is_interactive: bool) -> bool:
    """Whether the demo keeps the deployment it started (``own``) up after its report:
    ``--keep-running``/``--exit`` when given, else only for a person at a terminal (whose
    first click is the dashboard link). A deployment it found running is never its to stop."""
    if not own:
        return False
    return is_interactive if keep_running is None else keep_running


def finish(services: list[launcher.Service], dashboard: str, keep: bool) -> None:
    """Print the dashboard line; with ``keep``, serve until Ctrl-C or SIGTERM, which stop
    every service the demo started (:func:`launcher.serve_forever`) and end the demo as
    :func:`stopping.stops_cleanly` says.

    Raises:
        launcher.LaunchError: a service died while being kept up.
        stopping.Stopped: Ctrl-C or SIGTERM, once every service is stopped.
    """
    _stdout().print(dashboard_line(dashboard, bool(services), keep), soft_wrap=True)
    if keep:
        launcher.serve_forever(services)


def dashboard_line(url: str, own: bool, keep: bool) -> str:
    """The last line of the demo: the dashboard and what happens to the deployment now."""
    if not own:
        return f"dashboard: {url}"
    if keep:
        return f"dashboard: {url} — press Ctrl-C to stop the deployment"
    return f"dashboard: {url}  (this demo's deployment stops now; --keep-running keeps it)"


@dataclass
class _Options:
    """What one demo run was asked for."""

    analyzer_url: str
    trust: Path | None
    tokens: Credentials
    devices: int
    seed: int
    workers: int
    report: Path
    json_path: Path | None
    only: tuple[str, ...]
    rate: float | None = None
    verbose: bool = False


def _console() -> Console:
    return Console(stderr=True)


def _stdout() -> Console:
    """Results on stdout; no squeezed tables in logs and CI."""
    return Console(width=None if sys.stdout.isatty() else 132)


def _deployment(
    options: _Options, var: Path, workdir: Path, database_template: str | None
) -> tuple[list[launcher.Service], Path | None]:
    """The running deployment at the analyzer URL, or a fresh one started on loopback.

    Returns the services this demo started (empty when it found one running) and the trust
    file to pin (None: the keys the deployment serves).
    """
    from services.tools.demo import DemoError, analyzer_alive

    url, console = options.analyzer_url, _console()
    if analyzer_alive(url):
        console.print(f"using the deployment at {url}")
        found = var / launcher.TRUST_FILE
        if options.trust is None and found.exists():
            return [], found
        if options.trust is None:
            console.print(
                f"[yellow]warning:[/] no --trust file and no {found}: pinning the keys the "
                "deployment serves (an app pins them at build time)"
            )
        return [], options.trust
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost") or parsed.port is None:
        raise DemoError(f"no analyzer answers at {url}")
    console.print(f"starting a fresh deployment under {workdir / 'deployment'} …")
    services = launcher.up(
        workdir / "deployment", base_port=parsed.port, database_template=database_template
    )
    options.tokens = Credentials(folder=workdir / "deployment" / "keys")
    return services, workdir / "deployment" / launcher.TRUST_FILE


def _run(options: _Options, workdir: Path) -> None:
    """Simulate, print what the analyzer released, write the report (and JSON)."""
    from services.tools import demo_report
    from services.tools.demo import DemoError, check_fresh_epochs, connect, results, selected

    target = connect(options.analyzer_url, options.trust, options.tokens)
    channels = selected(target, options.only)
    check_fresh_epochs(target, channels, time.time())
    run, sent = _simulate(options, target, channels, workdir)
    found = results(run, sent)
    out = _stdout()
    _print_summary(out, found)
    if options.verbose:
        _print_checks(out, found)
        _print_privacy(out, found)
    inside, checked = _print_verdicts(out, found)
    dashboard = f"{options.analyzer_url}/"
    shapes = {c.id: c.image_shape for c in target.channels if c.image_shape is not None}
    header = (
        f"{options.devices:,} simulated devices through {len(target.shuffler_urls)} shufflers; "
        f"analyzer {options.analyzer_url}"
    )
    path = demo_report.write(options.report, found, shapes, dashboard, header)
    out.print(f"report:    {path.resolve()}")
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        body = {"devices": options.devices, "channels": [r.as_dict() for r in found]}
        options.json_path.write_text(json.dumps(body, indent=2))
    # 95% intervals miss about 1 in 20; fewer than half inside means something is broken.
    if inside < checked / 2:
        raise DemoError(f"only {inside} of {checked} estimates inside their intervals")


def _simulate(
    options: _Options, target: DemoDeployment, channels: list[ChannelConfig], workdir: Path
) -> tuple[DemoRun, dict[str, tuple[int, int, int, int]]]:
    """Every device reports with a progress bar per population; epochs are closed after."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from services.tools.demo import DemoRun, periods, simulate

    started = time.monotonic()
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    console = _console()
    with Progress(*columns, console=console) as progress:
        tasks = {"devices": progress.add_task("devices reporting", total=options.devices)}
        for config in channels:
            count = periods(config)
            if count is not None:
                tasks[config.id] = progress.add_task(f"{config.id}: periods", total=count)
        run = DemoRun(
            target=target,
            devices=options.devices,
            workdir=workdir,
            seed=options.seed,
            workers=options.workers,
            only=options.only,
            rate=options.rate,
            progress=lambda name, done: progress.advance(tasks[name], done),
            say=progress.console.print,
        )
        sent = simulate(run)
    elapsed = time.monotonic() - started
    console.print(f"every contribution acknowledged; epochs closed ({elapsed:.0f} s)")
    return run, sent


def _print_summary(out: Console, found: list[ChannelResult]) -> None:
    """One row per channel: n, the estimates against the truth, certified central ε with its
    δ, local ε and the took-part ε."""
    from rich.table import Table

    summary = Table(title="What the analyzer released")
    headers = ("channel", "mechanism", "n", "RMSE", "inside 95%", "central ε (δ)", "local ε")
    for name in (*headers, "took part ε (δ)"):
        summary.add_column(name, justify="right")
    for r in found:
        took_part = r.release.get("with_randomized_deletion") or {}
        summary.add_row(
            r.channel_id,
            r.mechanism,
            f"{r.n:,}",
            f"{r.rmse:.1f}",
            f"{r.inside}/{len(r.checked)}",
            _eps_delta(r.central_eps, r.release["certificate"]["delta"]),
            "—" if r.local_eps is None else f"{r.local_eps:.2f}",
            _eps_delta(took_part.get("eps"), took_part.get("delta")),
        )
    out.print(summary)
    out.print(
        "central and local ε: one user's report replaced (removal notion); took part ε: whether "
        "a user contributed at all (add-remove, randomized deletion); RMSE and intervals "
        "against the population's truth × the share deletion kept.",
        soft_wrap=True,
    )


def _eps_delta(eps: float | None, delta: float | None) -> str:
    if eps is None or delta is None:
        return "—"
    return f"{eps:.3f} ({delta:.0e})" if math.isfinite(eps) else "∞ (see below)"


def _print_verdicts(out: Console, found: list[ChannelResult]) -> tuple[int, int]:
    """One line per verdict; returns (estimates inside their interval, checked)."""
    for r in found:
        if not math.isfinite(r.central_eps):
            out.print(
                f"[yellow]{r.channel_id}:[/] no central bound holds for this crowd: "
                f"{r.release['certificate']['note']}",
                soft_wrap=True,
            )
    checked = sum(len(r.checked) for r in found)
    inside = sum(r.inside for r in found)
    out.print(
        f"{inside} of {checked} checked estimates inside their 95% intervals (expected = truth × "
        "the share kept by randomized deletion)"
    )
    return inside, checked


def _print_privacy(out: Console, found: list[ChannelResult]) -> None:
    """Per channel: each epoch's certificate (and whether it entered the lifetime as the
    mechanism's dominating pair), the lifetime ε by PLD beside basic composition with the δ
    split, the same with randomized deletion, and the device budget in use."""
    from rich.table import Table

    from services.tools.demo_results import budget_text, lifetime_text

    for r in found:
        table = Table(title=f"{r.channel_id}: privacy over time (per-epoch certificates)")
        for name in ("epoch", "n", "ε", "δ", "method", "composed as"):
            table.add_column(name, justify="right")
        for row in r.epochs[-10:]:
            eps = "∞" if row["eps"] is None else f"{row['eps']:.3f}"
            table.add_row(
                str(row["epoch"]),
                f"{row['n']:,}",
                eps,
                f"{row['delta']:.0e}",
                str(row["method"]),
                str(row["composed_as"]),
            )
        out.print(table)
        out.print(f"{r.channel_id}: {lifetime_text(r.lifetime)}", soft_wrap=True)
        took_part = lifetime_text(r.privacy.get("with_randomized_deletion"))
        out.print(f"{r.channel_id}: took part at all (with deletion): {took_part}", soft_wrap=True)
        out.print(f"{r.channel_id}: {budget_text(r.privacy.get('device_budget'))}", soft_wrap=True)


def _print_checks(out: Console, found: list[ChannelResult]) -> None:
    """Truth against estimate per checked bin (``--verbose``)."""
    from rich.table import Table

    for r in found:
        what = "every period" if r.display == "series" else "largest true values"
        table = Table(title=f"{r.channel_id}: {what}")
        for name in ("bin", "truth", "expected", "estimate", "95% interval", "inside"):
            table.add_column(name, justify="right")
        for row in r.checked:
            hit = row["lo"] <= row["expected"] <= row["hi"]
            table.add_row(
                str(int(row["bin"]) + (1 if r.display == "series" else 0)),
                f"{row['truth']:.0f}",
                f"{row['expected']:.1f}",
                f"{row['estimate']:.1f}",
                f"[{row['lo']:.1f}, {row['hi']:.1f}]",
                "yes" if hit else "[red]no[/]",
            )
        out.print(table)
