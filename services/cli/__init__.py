"""The ``esa`` command line.

Subcommands import their heavy dependencies lazily, so ``esa account`` works on a plain
``pip install esa-pipeline`` without the server extras.
"""

from __future__ import annotations

import click

from services.cli.account import account
from services.cli.demo import demo
from services.cli.servers import analyzer, keys, shuffler, up_command
from services.cli.simulate import simulate


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="esa-pipeline")
def cli() -> None:
    """Encode–Shuffle–Analyze telemetry pipeline with certified central differential privacy.

    \b
    esa account certify   every amplification bound for a mechanism, and the certificate
    esa account plan      the largest local ε0 that certifies a target central ε
    esa simulate          paper-scale experiments (histograms, images, longitudinal)
    esa shuffler serve    run one shuffler instance
    esa analyzer serve    run the analyzer (API and dashboard)
    esa up                the whole deployment as processes on 127.0.0.1
    esa demo              a simulated device population through the whole pipeline
    esa keys generate     create HPKE and signing key files
    """


cli.add_command(account)
cli.add_command(simulate)
cli.add_command(shuffler)
cli.add_command(keys)
cli.add_command(analyzer)
cli.add_command(up_command)
cli.add_command(demo)


def main() -> None:
    """Console-script entry point."""
    cli()
