"""``esa account --mechanism`` takes its names from the mechanism registry and certifies, for
one batch of n reports, what the mechanism's own privacy description of a channel certifies
(the description the analyzer's per-batch certificates and the ledger's epochs come from),
in process, through click."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from common.mechanisms import get
from services.cli.account import account

N, DELTA = 20_000, 1e-9

#: (mechanism, flags, a channel's params that the flags describe)
CASES: list[tuple[str, list[str], dict[str, Any]]] = [
    ("krappor", ["--eps0", "3"], {"k": 16, "eps": 3.0}),
    ("krr", ["--eps0", "2", "--k", "5"], {"k": 5, "eps": 2.0}),
    ("rfrag", ["--eps-b", "4", "--eps-f", "2", "--tau", "3"],
     {"k": 8, "eps_b": 4.0, "eps_f": 2.0, "tau": 3}),
    ("longitudinal", ["--eps0", "4"], {"d": 8, "k": 2, "eps": 4.0}),
]  # fmt: skip


def _certify(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(account, ["certify", *args, "--n", str(N), "--delta", str(DELTA)])
    return result.exit_code, result.output


@pytest.mark.parametrize(("name", "flags", "params"), CASES, ids=[c[0] for c in CASES])
def test_the_cli_certifies_what_a_channel_of_the_mechanism_certifies(
    name: str, flags: list[str], params: dict[str, Any]
) -> None:
    code, out = _certify("--mechanism", name, *flags, "--json")
    assert code == 0, out
    printed = json.loads(out)
    mechanism = get(name)
    channel = mechanism.privacy(mechanism.parse_params(params)).certify(N, DELTA).certified
    assert printed["mechanism"] == name
    assert printed["certified"]["eps"] == channel.eps
    assert printed["certified"]["method"] == str(channel.method)


def test_zsum_certifies_at_its_declared_crowd_and_delta() -> None:
    args = ["-m", "zsum", "--eps0", "0.5", "--n-declared", "40000", "--n", "30000", "--json"]
    result = CliRunner().invoke(account, ["certify", *args, "--delta", "1e-6"])
    assert result.exit_code == 0, result.output
    zsum = get("zsum")
    params = zsum.parse_params({"d": 8, "eps": 0.5, "delta": 1e-6, "n": 40_000})
    channel = zsum.certify_crowd(params, 30_000, 1e-6).certified
    printed = json.loads(result.output)["certified"]["eps"]
    assert printed == channel.eps and 1.1 < printed < 1.2  # (2ε', δ), ε' = 0.5 sqrt(4/3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "krappor", "--eps0", "2", "--k", "4"], "--k does not apply to krappor"),
        (["-m", "ldp-sgd", "--eps0", "2"], "ldp-sgd declares no privacy description"),
        (["-m", "rfrag", "--eps-b", "2", "--tau", "3"], "eps_f is required for rfrag"),
        (["-m", "generic", "--eps0", "2", "--tau", "3"], "--tau does not apply to generic"),
        (["-m", "sketch", "--eps0", "2"], "unknown mechanism 'sketch'; known: generic, krappor"),
        (["-m", "krr", "--eps0", "2", "--k", "1"], "k=1"),
    ],
)
def test_flags_that_do_not_fit_the_mechanism_are_refused_by_name(
    args: list[str], message: str
) -> None:
    code, out = _certify(*args)
    assert code == 2 and message in out, out
