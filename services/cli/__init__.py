"""The ``esa`` command line.

Commands load lazily: ``esa --help`` and ``esa --version`` import only click and the version
constants, and each command imports its own stack (the servers, dp_accounting, numpy) when it
runs, so ``esa account`` also works on a plain ``pip install esa-pipeline`` without the server
extras.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

import click

from common.formats import COLLECTION_CONFIG_VERSION, CONTRIBUTION_MAGIC

#: Every command: its name, where it lives (module, attribute) and what ``esa --help`` says.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "account": (
        "services.cli.account",
        "account",
        "amplification bounds and certificates (certify), the largest ε0 for a target (plan)",
    ),
    "simulate": ("services.cli.simulate", "simulate", "paper-scale experiments"),
    "shuffler": ("services.cli.servers", "shuffler", "run one shuffler instance (serve)"),
    "analyzer": ("services.cli.servers", "analyzer", "run the analyzer, API and dashboard (serve)"),
    "up": ("services.cli.servers", "up_command", "the whole deployment as processes on 127.0.0.1"),
    "demo": ("services.cli.demo", "demo", "a simulated device population through the pipeline"),
    "loadtest": ("services.cli.loadtest", "loadtest", "load-test a deployment, then verify it"),
    "keys": (
        "services.cli.keys",
        "keys",
        "key files (generate); rotate a running party's keys without downtime (rotate, list)",
    ),
    "audit": ("services.cli.audit", "audit", "audit a shuffler: canaries, a sink, statistics"),
    "train": ("services.cli.train", "train", "federated LDP-SGD training through the pipeline"),
    "channel": (
        "services.cli.channel",
        "channel",
        "channels of a running analyzer: add, retire, list (no restart)",
    ),
    "admin": (
        "services.cli.admin",
        "admin",
        "operator actions: esa admin requeue takes up parts set aside once fixed",
    ),
}


class LazyGroup(click.Group):
    """A group that imports a command's module only when that command runs (click's
    "Lazily Loading Subcommands" pattern), and lists commands from :data:`COMMANDS`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute, _ = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, line) for name, (_, _, line) in COMMANDS.items()])


#: What ``esa`` with no arguments prints before its help: the two commands to run first.
START_HERE = """\
Start here:
  esa demo     a simulated population through a local deployment, with certified ε (~3 min)
  esa up       run the deployment (1 analyzer, 3 shufflers) on 127.0.0.1 until Ctrl-C
"""


def version_text() -> str:
    """``esa --version``: the package version and the wire formats it speaks (docs/protocol.md)."""
    try:
        installed = package_version("esa-pipeline")
    except PackageNotFoundError:
        installed = "unknown (not installed)"
    return (
        f"esa-pipeline {installed}\n"
        f"wire: contribution envelope {CONTRIBUTION_MAGIC.decode()}, collection config "
        f"v{COLLECTION_CONFIG_VERSION}, "
        "HPKE DHKEM(X25519, HKDF-SHA256)/HKDF-SHA256/AES-128-GCM, Ed25519 signatures"
    )


def _print_version(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(version_text())
        ctx.exit()


@click.group(
    cls=LazyGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and the wire formats it speaks, then exit.",
)
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Encode–Shuffle–Analyze telemetry pipeline with certified central differential privacy.

    Run esa COMMAND --help for what a command does and its options.
    """
    if ctx.invoked_subcommand is None:
        click.echo(START_HERE)
        click.echo(ctx.get_help())


def main() -> None:
    """Console-script entry point."""
    cli()
