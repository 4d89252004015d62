"""``esa`` with no arguments and ``esa --version`` (issue 20: the first hour of a new user)."""

from __future__ import annotations

from click.testing import CliRunner

from common.envelope import MAGIC
from services.cli import cli


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
    assert "collection config v1" in result.output


def test_a_subcommand_still_runs_without_the_banner() -> None:
    result = CliRunner().invoke(cli, ["account", "--help"])
    assert result.exit_code == 0
    assert "Start here" not in result.output
