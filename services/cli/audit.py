"""``esa audit``: audit a shuffler run by another party (docs/audit.md).

``esa audit sink`` runs where the audited shuffler forwards; ``esa audit run`` sends canaries,
closes the epoch, reads the sink and checks order, metadata, the public surface, the crowd
threshold, randomized deletion, timing and intake, exiting 1 when any check fails;
``esa audit pool`` combines the privacy games of saved runs into one bound.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from services.tools.audit.checks import Finding


@click.group()
def audit() -> None:
    """Audit a shuffler from outside: a sink it forwards to, canaries sent through it, and
    statistical checks of what it released (docs/audit.md)."""


@audit.command("sink")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", type=int, default=8190, show_default=True, help="Port.")
@click.option(
    "--token",
    envvar="ESA_AUDIT_SINK_TOKEN",
    required=True,
    help="Bearer token the auditor reads records with (env ESA_AUDIT_SINK_TOKEN).",
)
@click.option(
    "--record",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also append every record to this JSON-lines file.",
)
@click.option("--relay", default=None, help="Pass other channels' parts on to this analyzer URL.")
@click.option(
    "--keep-channel",
    multiple=True,
    help="Channel answered by the sink itself even with --relay (the audit channel); repeatable.",
)
def sink(
    host: str,
    port: int,
    token: str,
    record: Path | None,
    relay: str | None,
    keep_channel: tuple[str, ...],
) -> None:
    """Record every batch part the audited shuffler forwards, answering as the analyzer does
    (set the shuffler's ESA_SHUFFLER_ANALYZER_URL to this address)."""
    from services.tools.audit.sink import SinkState, serve

    if len(token) < 16:
        raise click.UsageError("--token must be at least 16 characters")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    state = SinkState(
        token=token, record_file=record, relay=relay, keep_channels=frozenset(keep_channel)
    )
    server = serve(state, host, port)
    click.echo(f"audit sink on http://{host}:{port} (relay: {relay or 'none'})", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@audit.command("run")
@click.option("--shuffler", "shuffler_url", required=True, help="The audited shuffler's URL.")
@click.option("--sink", "sink_url", required=True, help="The audit sink's URL.")
@click.option(
    "--sink-token",
    envvar="ESA_AUDIT_SINK_TOKEN",
    required=True,
    help="The sink's bearer token (env ESA_AUDIT_SINK_TOKEN).",
)
@click.option("--channel", required=True, help="The audit channel (used by canaries only).")
@click.option(
    "--admin-token",
    envvar="ESA_AUDIT_ADMIN_TOKEN",
    default=None,
    help="The shuffler's admin token: close the epoch now and probe revocation (else wait "
    "for the epoch to end).",
)
@click.option("--signing-key", default=None, help="The shuffler's registered Ed25519 key (base64).")
@click.option(
    "--group-size", type=int, default=None, help="Canaries per group (default: from the policy)."
)
@click.option("--fragments", type=int, default=3, show_default=True, help="Fragments per canary.")
@click.option("--wait", "wait_seconds", type=float, default=120.0, show_default=True,
              help="Most seconds to wait for batches after the close.")  # fmt: skip
@click.option(
    "--game-eps0",
    type=float,
    default=4.0,
    show_default=True,
    help="Local ε0 of the binary randomized response canaries report in the privacy game.",
)
@click.option(
    "--game-channel",
    default=None,
    help="Play the privacy game with this default channel's mechanism (homepage, "
    "homepage-fragments, picture, features) instead of binary RR: the target canary reports "
    "value 0 or 1, the others 2, and ε_lower is printed beside the channel's certified "
    "replacement ε (the audit channel's max_fragments must fit one report; docs/audit.md).",
)
@click.option(
    "--game-trials",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Pool at least this many privacy-game trials: after the audited epoch, one more "
    "round of full canary groups per following epoch (waits for each epoch to start; use a "
    "short epoch_seconds). About 200 trials give the bound its power (docs/audit.md).",
)
@click.option(
    "--round-seconds",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds of one batching round: the first- and last-arriving groups' releases may "
    "differ by this plus the time the other groups' releases took (at most half the time "
    "between their arrivals).",
)
@click.option(
    "--clock-skew",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds the sink's clock may differ from the auditor's (release-at-close check).",
)
@click.option("--seed", type=int, default=None, help="Seed the game's coins (default: OS CSPRNG).")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("audit-report"),
    show_default=True,
    help="Where audit.json and audit.html go.",
)
def run(
    shuffler_url: str,
    sink_url: str,
    sink_token: str,
    channel: str,
    admin_token: str | None,
    signing_key: str | None,
    group_size: int | None,
    fragments: int,
    wait_seconds: float,
    game_eps0: float,
    game_channel: str | None,
    game_trials: int,
    round_seconds: float,
    clock_skew: float,
    seed: int | None,
    out: Path,
) -> None:
    """Send canaries through the shuffler, close the epoch, read the sink and run every check;
    exit 1 when one fails.

    The shuffler must forward to `esa audit sink`, and the audit channel must be used by
    canaries only, with at least two declared crowds (the last receives min_crowd - 1 canaries
    and must never be released). Prints each check with its statistic and p-value and writes
    audit.json and audit.html into --out. See docs/audit.md for staging.
    """
    from rich.console import Console

    from services.tools.audit.report import write_reports
    from services.tools.audit.runner import AuditConfig, AuditError, run_audit

    console = Console(stderr=True)
    config = AuditConfig(
        shuffler_url=shuffler_url, sink_url=sink_url, sink_token=sink_token, channel_id=channel,
        admin_token=admin_token, signing_key=signing_key, group_size=group_size,
        fragments=fragments, wait_seconds=wait_seconds, game_eps0=game_eps0,
        game_trials=game_trials, game_channel=game_channel, round_seconds=round_seconds,
        skew_seconds=clock_skew, seed=seed,
    )  # fmt: skip
    try:
        with console.status("auditing") as status:
            result = run_audit(config, lambda text: status.update(text))
    except AuditError as error:
        raise click.ClickException(str(error)) from error
    _print_findings(result.findings)
    json_path, html_path = write_reports(result, out)
    click.echo(f"reports: {json_path} {html_path}")
    if not result.passed:
        click.echo("audit FAILED", err=True)
        sys.exit(1)
    click.echo("audit passed")


def _print_findings(findings: list[Finding]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("check", "name", "verdict", "statistic", "p-value", "detail")
    for f in findings:
        verdict = "[green]pass" if f.passed else "[red]FAIL"
        stat = "" if f.statistic is None else f"{f.statistic:.4g}"
        p = "" if f.p_value is None else f"{f.p_value:.3g}"
        table.add_row(f.check, f.name, verdict, stat, p, f.detail[:90])
    Console().print(table)


@audit.command("pool")
@click.argument(
    "reports", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the pooled finding to this JSON file.",
)
def pool(reports: tuple[Path, ...], out: Path | None) -> None:
    """Pool the privacy games of saved runs (their audit.json files) into one Clopper–Pearson
    bound: ε_lower at 95% beside the certified ε at the smallest released crowd of any run;
    exit 1 when ε_lower at confidence 1 - 1e-7 exceeds it.

    The runs must share --game-eps0 (and δ); a run given twice is refused (its trials would
    count twice). Pooling stays valid across runs, epochs and crowd sizes (docs/audit.md).
    """
    from services.tools.audit.game import PoolError
    from services.tools.audit.game import pool as pool_games

    saved = []
    for path in reports:
        try:
            data = json.loads(path.read_text())
            saved.append((str(path), data["summary"]["game"]))
        except (ValueError, KeyError, TypeError) as error:
            raise click.UsageError(f"{path} is not an audit.json with a game outcome") from error
    try:
        finding, runs = pool_games(saved)
    except PoolError as error:
        raise click.UsageError(str(error)) from error
    _print_findings([finding])
    if out is not None:
        out.write_text(json.dumps({"runs": runs, "finding": finding.as_dict()}, indent=2))
    if not finding.passed:
        click.echo("pooled privacy game FAILED", err=True)
        sys.exit(1)
    click.echo(f"pooled {runs} runs: passed")
