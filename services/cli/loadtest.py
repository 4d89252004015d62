"""``esa loadtest``: drive a deployment with a simulated population, then verify and report."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

if TYPE_CHECKING:
    from common.collection import TrustAnchors
    from services.tools.credentials import Credentials
    from services.tools.loadgen import Pace
    from services.tools.loadtest.prepare import LoadPlan


def _populations(values: tuple[str, ...]) -> dict[str, str]:
    """``CHANNEL=SPEC`` pairs (a bare ``SPEC`` is for every channel: key ``*``)."""
    found = {}
    for value in values:
        channel, sep, spec = value.partition("=")
        found[channel if sep else "*"] = spec if sep else channel
    return found


def _pace(rate: float | None, ramp: str | None, as_fast: bool) -> float | Pace | None:
    from services.tools.loadgen import Pace

    given = [x for x in (rate is not None, ramp is not None, as_fast) if x]
    if len(given) > 1:
        raise click.UsageError("give one of --rate, --ramp and --max")
    if rate is not None:
        return rate
    if ramp is not None:
        try:
            start, end = (float(x) for x in ramp.split(":"))
        except ValueError as error:
            raise click.UsageError(f"--ramp {ramp!r}: expected START:END (requests/s)") from error
        if start <= 0 or end <= 0:
            raise click.UsageError(f"--ramp {ramp!r}: rates must be positive")
        return Pace(start, end)
    return None


@click.command("loadtest")
@click.option(
    "--analyzer-url",
    default="http://127.0.0.1:8100",
    show_default=True,
    help="The deployment: its analyzer serves the signed collection config, which "
    "names the shufflers.",
)
@click.option(
    "--trust",
    "trust_file",
    envvar="ESA_TRUST_FILE",
    type=click.Path(path_type=Path),
    default=None,
    help="The keys to pin, one per trust domain: the analyzer's config-signing key and each "
    "shuffler's signing key — a trust file, or a folder of what the parties published "
    "(analyzer.pub, <id>.descriptor.json) (default: <var>/trust.json, written by `esa up`).",
)
@click.option(
    "--var",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var"),
    show_default=True,
    help="Where a running `esa up` keeps trust.json.",
)
@click.option(
    "--admin-token",
    envvar="ESA_SHUFFLER_ADMIN_TOKEN",
    default=None,
    help="One admin token for every shuffler (a deployment whose parties share one): with it "
    "the run is verified (epochs closed, batches awaited, conservation and estimates checked).",
)
@click.option(
    "--keys",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Each party's own admin and metrics tokens: <KEYS>/<party>/admin-token and "
    "metrics-token (`esa up` keeps them in <var>/keys) or <KEYS>/<party>-admin-token; with "
    "them the run is verified. --up uses its own deployment's.",
)
@click.option(
    "--up",
    "start_local",
    is_flag=True,
    help="Start a fresh local deployment (as `esa up`, on free ports) for this run, "
    "verify against it with each of its parties' own tokens, then stop it and remove its "
    "folder (keys, tokens, databases).",
)
@click.option(
    "--channel",
    "channels",
    multiple=True,
    metavar="ID",
    help="Only these channels (repeatable; default: every channel that takes one "
    "category value per report, and every longitudinal channel whose periods fit in 15 "
    "minutes).",
)
@click.option(
    "--population",
    "populations",
    multiple=True,
    metavar="[CHANNEL=]SPEC",
    help="Who holds which value: zipf[:S], uniform, horse, camera, hubble, words or "
    "csv:PATH (one value per line, or value,count); for a longitudinal channel "
    "changes[:RATE] (each device changes state Binomial(k, RATE) times). Without "
    "CHANNEL= for every channel of its kind. Default zipf, and changes:0.5.",
)
@click.option(
    "--devices",
    type=click.IntRange(1, 10_000_000),
    default=2000,
    show_default=True,
    help="Simulated devices; each sends one contribution per channel and epoch.",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Contributions per second offered (default: --max).",
)
@click.option(
    "--ramp",
    metavar="START:END",
    default=None,
    help="Offered rate rising linearly from START to END over --duration.",
)
@click.option(
    "--max", "as_fast", is_flag=True, help="As fast as the shufflers answer (the default)."
)
@click.option(
    "--duration",
    type=click.FloatRange(min=1),
    default=60.0,
    show_default=True,
    help="Most seconds of sending (it ends early once every contribution is sent).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 4096),
    default=96,
    show_default=True,
    help="Keep-alive HTTP connections in all, split over the shufflers.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Processes that encode and seal the population before the run.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the population (who holds which value); the devices' privacy "
    "noise always comes from the OS CSPRNG.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var/loadtest"),
    show_default=True,
    help="Folder for loadtest.json, loadtest.html and the prepared requests.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    help="Most seconds to wait for every batch to reach the analyzer (and for a service "
    "that does not answer meanwhile, e.g. restarting).",
)
@click.option(
    "--clock-offset",
    "clock_offsets",
    multiple=True,
    metavar="SECONDS:SHARE",
    help="A share of the devices whose clocks are off by SECONDS (e.g. 600:0.1, -600:0.1; "
    "repeatable): each seals the epoch its own clock shows, as a device does; what the "
    "shufflers answer them is counted apart (run.clocks), never a verification problem.",
)
@click.option(
    "--expect-refusal",
    "expected",
    multiple=True,
    metavar="CODE",
    help="A refusal the deployment is expected to answer devices on true time (a fault test, "
    "e.g. epoch_not_open from a shuffler whose clock is ahead; repeatable): counted by code, "
    "not a verification problem, and with epoch_not_open the run is not stopped for it.",
)
@click.option("--no-live", is_flag=True, help="No live view (log lines only).")
def loadtest(
    analyzer_url: str,
    trust_file: Path | None,
    var: Path,
    admin_token: str | None,
    keys: Path | None,
    start_local: bool,
    channels: tuple[str, ...],
    populations: tuple[str, ...],
    devices: int,
    rate: float | None,
    ramp: str | None,
    as_fast: bool,
    duration: float,
    concurrency: int,
    workers: int,
    seed: int,
    out: Path,
    drain_timeout: float,
    clock_offsets: tuple[str, ...],
    expected: tuple[str, ...],
    no_live: bool,
) -> None:
    """Load-test a deployment with a simulated population; verify and report.

    \b
    1. prepare: devices enroll at each shuffler, encode and seal one contribution per
       channel and epoch, in worker processes, written to files before the run;
    2. run: replay them at --rate, a --ramp or --max, with a live view; longitudinal
       channels follow in a phase of their own, one epoch per wave;
    3. verify (with --admin-token, --keys or --up): close the run's epochs, wait for every
       batch, check conservation and estimates against the truth, print the certified ε.
    Exit status 1 if anything was lost, counted twice or estimated wrong, or if an earlier
    verified run closed the epoch (wait for the next epoch, or use --up).
    Writes <out>/loadtest.json and <out>/loadtest.html. Details: docs/loadtest.md.
    """
    from services.tools.stopping import stops_cleanly

    with stops_cleanly("esa loadtest"):
        _main(dict(locals()))


def _main(kw: dict[str, Any]) -> None:
    """``esa loadtest`` with its options by name: prepare, run, verify, report, exit status."""
    import httpx

    from services.cli import launcher
    from services.tools import stopping
    from services.tools.credentials import Credentials
    from services.tools.loadgen import LoadError
    from services.tools.loadtest import verify
    from services.tools.loadtest.population import PopulationError
    from services.tools.loadtest.run import Options, execute

    console = Console(stderr=True)
    pace = _pace(kw["rate"], kw["ramp"], kw["as_fast"])
    services: list[launcher.Service] = []
    own: Path | None = None  # the folder of a deployment this run started
    analyzer_url, trust_file = kw["analyzer_url"], kw["trust_file"]
    tokens = _credentials(kw["admin_token"], kw["keys"])
    try:
        if kw["start_local"]:
            with stopping.held():  # a stop arriving meanwhile waits until it is recorded
                own = Path(tempfile.mkdtemp(prefix="esa-loadtest-"))
            services, trust_file = _start_local(console, own)
            tokens = Credentials(folder=own / "keys")
            analyzer_url = services[0].url
        options = Options(
            plan=_plan(kw, analyzer_url, trust_file or kw["var"] / launcher.TRUST_FILE),
            rate=pace,
            concurrency=kw["concurrency"],
            tokens=tokens,
            out=kw["out"],
            drain_timeout=kw["drain_timeout"],
            live=not kw["no_live"],
            local={s.name: s.process.pid for s in services},
            expected=frozenset(kw["expected"]),
        )
        summary = execute(options, console)
    except (LoadError, PopulationError, verify.VerifyError, launcher.LaunchError) as error:
        raise click.ClickException(str(error)) from error
    except httpx.HTTPError as error:  # a service went away where no step said what it was doing
        raise click.ClickException(f"lost the deployment: {error}") from error
    finally:
        launcher.stop_started()  # the deployment of --up, if it started (all of it)
        if own is not None:  # its keys, tokens and databases served this run only
            shutil.rmtree(own, ignore_errors=True)
    _print(summary, console)
    problems = summary.get("verification", {}).get("problems", [])
    if problems:
        raise click.ClickException("verification failed: " + "; ".join(problems))


def _plan(kw: dict[str, Any], analyzer_url: str, trust_file: Path) -> LoadPlan:
    """The load test's plan from its options by name (the deployment's URL and trust file
    resolved by the caller: given, or of the deployment ``--up`` started)."""
    from services.tools.loadtest.prepare import LoadPlan

    return LoadPlan(
        analyzer_url=analyzer_url.rstrip("/"),
        trust=_pinned(trust_file),
        devices=kw["devices"],
        duration=kw["duration"],
        workdir=kw["out"],
        channels=kw["channels"],
        populations=_populations(kw["populations"]),
        workers=kw["workers"],
        seed=kw["seed"],
        clock_offsets=_clock_offsets(kw["clock_offsets"]),
    )


def _clock_offsets(values: tuple[str, ...]) -> tuple[tuple[float, float], ...]:
    """``SECONDS:SHARE`` pairs (``--clock-offset``).

    Raises:
        click.UsageError: not two finite numbers, a share outside (0, 1), an offset of 0 (the
            devices on true time are the rest) or one given twice.
    """
    found: list[tuple[float, float]] = []
    for value in values:
        try:
            offset, share = (float(x) for x in value.split(":"))
        except ValueError as error:
            raise click.UsageError(f"--clock-offset {value!r}: expected SECONDS:SHARE") from error
        if not (math.isfinite(offset) and 0 < share < 1):
            raise click.UsageError(
                f"--clock-offset {value!r}: a finite offset, and a share between 0 and 1"
            )
        if offset == 0 or offset in (o for o, _ in found):
            raise click.UsageError(
                f"--clock-offset {value!r}: an offset of 0 is the devices on true time (the "
                "share left), and each offset is one group"
            )
        found.append((offset, share))
    return tuple(found)


def _start_local(console: Console, where: Path) -> tuple[list[Any], Path]:
    """A fresh ``esa up`` deployment on free ports in ``where``; its services and trust
    file."""
    from services.cli import launcher

    console.log(f"starting a fresh deployment under {where} …")
    services = launcher.up(where, base_port=launcher.free_base_port(4))
    return services, where / launcher.TRUST_FILE


def _credentials(token: str | None, keys: Path | None) -> Credentials | None:
    """The tokens verification uses: ``token`` for every party when given, else each party's
    own from ``keys``; None (no verification) without either."""
    from services.tools.credentials import Credentials

    if token is not None:
        return Credentials.shared(token)
    return None if keys is None else Credentials(folder=keys)


def _pinned(path: Path) -> TrustAnchors:
    """The keys a device pins, from a trust file (``esa up`` writes ``var/trust.json``).

    Raises:
        click.UsageError: no such file, or no usable keys in it.
    """
    from common.collection import TrustAnchors

    if not path.exists():
        raise click.UsageError(
            f"no --trust file and no {path}: pin the analyzer's and every shuffler's key"
        )
    try:
        return TrustAnchors.read(path)
    except ValueError as error:
        raise click.UsageError(str(error)) from error


def _print(summary: dict[str, Any], console: Console) -> None:
    """The run's figures, and the verification per channel."""
    from services.tools.loadtest import report

    runs = [("", summary["run"])] if not summary["series"] else []
    if summary["series"] and summary["run"] is not next(iter(summary["series"].values())):
        runs.append(("", summary["run"]))
    runs += [(f"{cid} ({run['periods']} periods): ", run) for cid, run in summary["series"].items()]
    for what, run in runs:
        errors = ", ".join(f"{k}: {v:,}" for k, v in run["errors"].items()) or "none"
        click.echo(
            f"{what}offered {run['offered']:,} ({run['offered_per_s']:,}/s), accepted "
            f"{run['accepted']:,} ({run['accepted_per_s']:,}/s) in {run['seconds']} s; p50 "
            f"{run['p50_ms']} ms, p95 {run['p95_ms']} ms, p99 {run['p99_ms']} ms; errors: {errors}"
        )
        click.echo(f"{what}delivery: {report.delivery(run)}")
        _print_clocks(run)
    found = summary.get("verification")
    if found is None:
        click.echo("not verified (no --admin-token)")
    else:
        totals = found["conservation"]["totals"]
        deleted = sum(totals["deleted"].values())
        click.echo(
            f"conservation: acknowledged {totals['acknowledged']:,} = received at the analyzer "
            f"{totals['received_at_analyzer']:,} + deleted {deleted:,} + held {totals['held']:,}"
            f" + pending {totals['pending']:,}; lost {totals['lost']:,}"
        )
        for cid, row in found["channels"].items():
            eps = "∞" if row["central_eps"] is None else f"{row['central_eps']:.3g}"
            click.echo(
                f"{cid}: received {row['received']:,} of {row['acknowledged']:,} acknowledged "
                f"contributions (n = {row['n']:,}); certified ε {eps} "
                f"(δ {row['delta']}, {row['method']}); {row['inside']} of "
                f"{len(row['checked'])} estimates inside their 95% interval"
            )
        click.echo("verification: " + ("PASS" if not found["problems"] else "FAIL"))
    click.echo(f"report: {summary['report']}")


def _print_clocks(run: dict[str, Any]) -> None:
    """The refusals expected (``--expect-refusal``) and each clock group's answers."""
    expected = run.get("expected_refusals") or {}
    if expected:
        codes = ", ".join(f"{code} {n:,}" for code, n in expected.items())
        click.echo(f"refused as expected (devices on true time): {codes}")
    for name, group in (run.get("clocks") or {}).items():
        codes = ", ".join(f"{code} {n:,}" for code, n in group["refused"].items()) or "none"
        click.echo(
            f"{name}: {group['answered']:,} answered, {group['acknowledged']:,} acknowledged, "
            f"refused: {codes}"
        )
