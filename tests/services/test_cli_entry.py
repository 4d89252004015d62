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
    assert "collection config v2" in result.output


def test_admin_requeue_is_listed_and_needs_a_url_and_a_token() -> None:
    result = CliRunner().invoke(cli, [], prog_name="esa")
    assert "esa admin requeue" in result.output
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
