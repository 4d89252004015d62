"""``esa account`` end to end through the real console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest

pytestmark = pytest.mark.system  # starts real processes

ESA = [sys.executable, "-m", "services.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ESA, *args], capture_output=True, text=True, timeout=120, check=False)


def test_plan_table_i_paper_bound_prints_12_99() -> None:
    out = run(
        "account",
        "plan",
        "--target-eps",
        "1",
        "--delta",
        "5e-10",
        "--n",
        "203950512",
        "--mechanism",
        "krappor",
        "--bound",
        "cheu-lemma-ii6",
    )
    assert out.returncode == 0, out.stderr
    assert "ε0 = 12.99" in out.stdout


def test_plan_tightest_is_larger_and_json_is_one_object() -> None:
    out = run(
        "account",
        "plan",
        "--target-eps",
        "1",
        "--delta",
        "5e-10",
        "--n",
        "203950512",
        "--mechanism",
        "krappor",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"certified", "bounds", "eps0"}
    assert data["eps0"] > 13.5
    assert data["certified"]["eps"] <= 1.0
    assert data["certified"]["method"] == "blanket-binary-rr"


def test_certify_marks_the_smallest_valid_bound() -> None:
    out = run(
        "account",
        "certify",
        "--mechanism",
        "krappor",
        "--eps0",
        "8",
        "--n",
        "1000000",
        "--delta",
        "1e-9",
        "--json",
    )
    data = json.loads(out.stdout)
    valid = [b for b in data["bounds"] if b["valid_regime"]]
    assert data["certified"]["eps"] == min(b["eps"] for b in valid)
    assert data["eps0"] == 8.0
    table = run(
        "account",
        "certify",
        "--mechanism",
        "krappor",
        "--eps0",
        "8",
        "--n",
        "1000000",
        "--delta",
        "1e-9",
    )
    assert "★" in table.stdout and "blanket-binary-rr" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eps0", "1", "--n", "0", "--delta", "1e-6"], "n=0"),
        (["--eps0", "1", "--n", "10", "--delta", "2"], "delta=2.0"),
        (["--eps0", "nan", "--n", "10", "--delta", "1e-6"], "eps0=nan"),
        (["--n", "10", "--delta", "1e-6"], "--eps0"),
        (["--eps0", "1", "--n", "10", "--delta", "1e-6", "--mechanism", "krr"], "k is required"),
    ],
)
def test_bad_input_exits_2_with_the_value_named(args: list[str], message: str) -> None:
    out = run("account", "certify", *args)
    assert out.returncode == 2
    assert message in out.stderr


def test_help_explains_commands() -> None:
    out = run("account", "plan", "--help")
    assert out.returncode == 0 and "--target-eps" in out.stdout and "cheu-lemma-ii6" in out.stdout


def test_every_flag_a_privacy_description_declares_is_an_option_of_each_command() -> None:
    """``esa account``'s parameter options come from the descriptions (``flag`` fields of each
    registered mechanism's ``randomizer_type`` and the generic one), not from a list of its own:
    each such field is an option of certify, plan and compose, and fills the description."""
    from dataclasses import fields

    from common.accounting.randomizers import FLAG
    from services.cli import account

    described = account._described()
    assert {"generic", "krr", "rfrag", "zsum"} <= set(described)
    for command in (
        account.certify_command,
        *map(account.account.commands.get, ["plan", "compose"]),
    ):
        assert command is not None
        params = command.get_params(click.Context(command))
        options = {opt for param in params for opt in param.opts}
        for kind in described.values():
            for spec in fields(kind):  # type: ignore[arg-type]
                if FLAG in spec.metadata:
                    assert "--" + spec.name.replace("_", "-") in options, (command.name, spec)
    flags = ("-m", "krr", "--k", "4", "--eps0", "1", "--n", "10000", "--delta", "1e-6", "--json")
    result = run("account", "certify", *flags)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["randomizer_params"] == {"k": 4}


def test_a_plugins_description_brings_its_own_option_and_bound_id() -> None:
    """A plug-in loaded by ESA_MECHANISM_MODULES gets ``--alphabet`` from its description's
    ``flag`` field and ``--bound plugin-local`` from its ``Method.declare``: no list in the CLI
    names either."""
    env = {**os.environ, "ESA_MECHANISM_MODULES": "tests.accounting.flag_plugin"}
    shown = subprocess.run(
        [*ESA, "account", "certify", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert (
        "--alphabet" in shown.stdout and "plugin-krr: the plug-in's alphabet size" in shown.stdout
    )
    flags = ("-m", "plugin-krr", "--alphabet", "4", "--eps0", "1", "--n", "1000", "--delta", "1e-6")
    run = subprocess.run(
        [*ESA, "account", "certify", *flags, "--bound", "plugin-local", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["randomizer_params"] == {"alphabet": 4}
    assert answer["certified"]["method"] == "plugin-local" and answer["certified"]["eps"] == 1.0
