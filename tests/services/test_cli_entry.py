"""``esa`` with no arguments, ``esa --version`` and the start-up cost of ``--help``: the first
hour of a new user."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from common.envelope import MAGIC
from common.formats import COLLECTION_CONFIG_VERSION
from common.wire import CollectionConfig
from services.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parents[2]


def test_no_arguments_says_what_to_run_first() -> None:
    result = CliRunner().invoke(cli, [], prog_name="esa")
    assert result.exit_code == 0
    first = result.output.splitlines()[:3]
    assert first[0] == "Start here:"
    assert any(line.strip().startswith("esa demo") for line in first)
    assert any(line.strip().startswith("esa up") for line in first)
    assert "Usage: esa" in result.output


def test_version_names_the_wire_formats() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("esa-pipeline ")
    assert f"contribution envelope {MAGIC.decode()}" in result.output
    assert "collection config v2" in result.output
    assert CollectionConfig.model_fields["version"].default == COLLECTION_CONFIG_VERSION


def test_admin_requeue_is_listed_and_needs_a_url_and_a_token() -> None:
    result = CliRunner().invoke(cli, [], prog_name="esa")
    assert "esa admin requeue" in result.output  # the admin command's line names it
    missing = CliRunner().invoke(cli, ["admin", "requeue", "--admin-token", "t"], env={})
    assert missing.exit_code == 2 and "--url" in missing.output
    no_token = CliRunner().invoke(
        cli, ["admin", "requeue", "--url", "http://127.0.0.1:9"], env={"ESA_ADMIN_TOKEN": ""}
    )
    assert no_token.exit_code == 2 and "--admin-token" in no_token.output
    down = CliRunner().invoke(
        cli, ["admin", "requeue", "--url", "http://127.0.0.1:9", "--admin-token", "t"]
    )
    assert down.exit_code == 1 and "http://127.0.0.1:9: ConnectError" in down.output


def test_a_subcommand_still_runs_without_the_banner() -> None:
    result = CliRunner().invoke(cli, ["account", "--help"])
    assert result.exit_code == 0
    assert "Start here" not in result.output


#: What ``esa --help``, ``esa --version``, plain ``esa`` and a command's own ``--help`` (``esa
#: account --help``) may not load: each command's stack loads only when that command runs (a
#: guard by modules, not seconds; the time and memory are in docs/benchmarks.md, "CLI
#: start-up").
HEAVY = ("numpy", "scipy", "dp_accounting", "pydantic", "cryptography", "httpx", "sqlalchemy")


@pytest.mark.system
@pytest.mark.parametrize(
    "arguments", [["--help"], ["--version"], [], ["account", "--help"]], ids=str
)
def test_help_and_version_load_no_command_stack(arguments: list[str]) -> None:
    probe = (
        "import sys\n"
        "from services.cli import cli\n"
        f"try: cli({arguments!r}, prog_name='esa')\n"
        "except SystemExit: pass\n"
        "print(len(sys.modules), *sorted({m.split('.')[0] for m in sys.modules}), file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    count, *packages = done.stderr.split()
    assert not set(HEAVY) & set(packages), done.stderr
    assert int(count) < 250, done.stderr  # 167 with click alone on Python 3.11


def test_every_listed_command_loads_under_its_name() -> None:
    for name in COMMANDS:
        command = cli.get_command(click.Context(cli), name)
        assert command is not None and command.name == name
        assert command.help, name
