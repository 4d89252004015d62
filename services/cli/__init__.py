"""The ``esa`` command line.

Subcommands import their heavy dependencies lazily, so ``esa account`` works on a plain
``pip install esa-pipeline`` without the server extras.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

import click

from services.cli.account import account
from services.cli.admin import admin
from services.cli.audit import audit
from services.cli.demo import demo
from services.cli.loadtest import loadtest
from services.cli.servers import analyzer, keys, shuffler, up_command
from services.cli.simulate import simulate
from services.cli.train import train

#: What ``esa`` with no arguments prints before its help: the two commands to run first.
START_HERE = """\
Start here:
  esa demo     a simulated population through a local deployment, with certified ε (~3 min)
  esa up       run the deployment (1 analyzer, 3 shufflers) on 127.0.0.1 until Ctrl-C
"""


def version_text() -> str:
    """``esa --version``: the package version and the wire formats it speaks (PROTOCOL.md)."""
    try:
        installed = package_version("esa-pipeline")
    except PackageNotFoundError:
        installed = "unknown (not installed)"
    from common.envelope import MAGIC
    from common.wire import CollectionConfig

    config_version = CollectionConfig.model_fields["version"].default
    return (
        f"esa-pipeline {installed}\n"
        f"wire: contribution envelope {MAGIC.decode()}, collection config v{config_version}, "
        "HPKE DHKEM(X25519, HKDF-SHA256)/HKDF-SHA256/AES-128-GCM, Ed25519 signatures"
    )


def _print_version(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(version_text())
        ctx.exit()


@click.group(
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

    \b
    esa account certify   every amplification bound for a mechanism, and the certificate
    esa account plan      the largest local ε0 that certifies a target central ε
    esa simulate          paper-scale experiments (histograms, images, longitudinal)
    esa shuffler serve    run one shuffler instance
    esa analyzer serve    run the analyzer (API and dashboard)
    esa up                the whole deployment as processes on 127.0.0.1
    esa demo              a simulated device population through the whole pipeline
    esa loadtest          load-test a deployment with a simulated population, then verify
    esa keys generate     create HPKE and signing key files
    esa audit run         audit a shuffler: canaries, a sink, statistical checks
    esa admin requeue     take up batch parts a service set aside, once their cause is fixed
    """
    if ctx.invoked_subcommand is None:
        click.echo(START_HERE)
        click.echo(ctx.get_help())


cli.add_command(account)
cli.add_command(simulate)
cli.add_command(shuffler)
cli.add_command(keys)
cli.add_command(analyzer)
cli.add_command(up_command)
cli.add_command(demo)
cli.add_command(loadtest)
cli.add_command(audit)
cli.add_command(train)


def main() -> None:
    """Console-script entry point."""
    cli()


cli.add_command(admin)
