"""``esa account compose`` and ``esa account plan --epochs`` (click's CliRunner)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from common.accounting import BinaryRR, lifetime_for_mechanism, plan_eps0
from services.cli.account import account

REFERENCE = ["--mechanism", "krappor", "--eps0", "2", "--n", "5000", "--epochs", "365"]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(account, list(args))
    return result.exit_code, result.output


def test_compose_json_is_the_lifetime_result() -> None:
    code, out = invoke("compose", *REFERENCE, "--delta", "1e-5", "--json")
    assert code == 0, out
    data = json.loads(out)
    expected = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 365, 1e-5).as_dict()
    assert data == json.loads(json.dumps(expected))
    assert data["method"] == "pld" and data["eps"] <= data["eps_basic"] / 10
    assert data["delta_split"]["pld_pairs"] == pytest.approx(1e-5)


def test_compose_table_shows_all_three_and_marks_the_reported_one() -> None:
    code, out = invoke("compose", *REFERENCE, "--delta", "1e-5")
    assert code == 0, out
    assert "PLD" in out and "basic" in out and "advanced" in out
    assert "★" in out and "lifetime ε = 3.6" in out and "via pld" in out


def test_compose_heterogeneous_crowds_and_deletion() -> None:
    code, out = invoke(
        "compose",
        "-m",
        "krappor",
        "--eps0",
        "2",
        "--crowds",
        "5000,4000,3000",
        "--delta",
        "1e-6",
        "--eps-cr",
        "0.1",
        "--delta-cr",
        "1e-9",
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    assert data["epochs"] == 3 and data["neighbouring"] == "add-remove"
    assert data["delta_split"]["certificates"] == pytest.approx(3e-9)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eps0", "2", "--delta", "1e-5"], "--n"),
        (["--eps0", "2", "--n", "0", "--delta", "1e-5"], "crowd=0"),
        (["--eps0", "2", "--n", "10", "--delta", "3"], "delta=3.0"),
        (["--eps0", "2", "--crowds", "10,x", "--delta", "1e-5"], "--crowds"),
        (["--eps0", "2", "--crowds", "10,20", "--epochs", "3", "--delta", "1e-5"], "--epochs"),
        (["--n", "10", "--delta", "1e-5"], "--eps0"),
        (["--eps0", "2", "--n", "10", "--delta", "1e-5", "--eps-cr", "1"], "--delta-cr"),
    ],
)
def test_compose_bad_input_exits_2_naming_the_value(args: list[str], message: str) -> None:
    code, out = invoke("compose", "-m", "krappor", *args)
    assert code == 2 and message in out


def test_plan_with_epochs_plans_for_the_lifetime() -> None:
    args = ["--target-eps", "1", "--delta", "1e-6", "--n", "1000", "-m", "krappor"]
    code, out = invoke("plan", *args, "--epochs", "4", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["epochs"] == 4 and data["lifetime"]["eps"] <= 1.0
    assert data["certified"]["eps"] <= 1.0
    one_epoch = plan_eps0(1.0, 1e-6, 1000, BinaryRR()).eps0
    assert data["eps0"] < one_epoch
    code, table = invoke("plan", *args, "--epochs", "4")
    assert code == 0 and "over 4 epochs" in table and f"ε0 = {data['eps0']:.2f}" in table


def test_plan_without_epochs_is_unchanged() -> None:
    args = ["--target-eps", "1", "--delta", "1e-6", "--n", "1000", "-m", "krappor", "--json"]
    code, out = invoke("plan", *args)
    assert code == 0, out
    assert json.loads(out) == json.loads(
        json.dumps({"mechanism": "krappor", **plan_eps0(1.0, 1e-6, 1000, BinaryRR()).as_dict()})
    )
    code, out = invoke("plan", *args, "--epochs", "3", "--bound", "cheu-lemma-ii6")
    assert code == 2 and "--bound" in out


def test_help_mentions_the_new_commands() -> None:
    code, out = invoke("compose", "--help")
    assert code == 0 and "--crowds" in out and "esa account compose" in out
    code, out = invoke("plan", "--help")
    assert code == 0 and "--epochs" in out and "LIFETIME" in out
