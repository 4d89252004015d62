"""The mechanism contract suite (test_contract.py) over the TypeScript SDK's encoders.

A Node script (sdk-js/scripts/sample.mjs) draws thousands of reports per input from each
TypeScript encoder; the same checks the Python encoders pass (tests/mechanisms/test_contract.py,
with a sampler of the TypeScript encoders) are applied to them. With the platform CSPRNG, as a
device draws: the largest likelihood ratio of one report equals the local ε the mechanism
describes (bounded and attained), and the exact bin-count law the shuffler audit uses is the
encoder's, each at 6 standard errors (a correct encoder fails one with probability under
1e-6). With a seeded generator, as the Python suite draws (deterministic: the plug-in
divergences of the pair check are within its slack only for fixed seeds, for the Python
encoders too): each dominating pair holds for the shuffled reports. An encoder given a wrong ε,
or a biased coin, fails them.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from common.mechanisms import StateUpdate

from ..support import SDK_JS, built_sdk_js
from .test_contract import CASES, LAW_VIEWS, Sampler, check_bin_count_law, check_described_pairs

pytestmark = pytest.mark.system

SAMPLE = SDK_JS / "scripts" / "sample.mjs"
#: Mechanisms whose reports name bins (their exact bin-count law is checked).
BIN_LAWS = ("krappor", "krr", "rfrag", "zsum")


@pytest.fixture(scope="module")
def node() -> str:
    """Node, with the SDK installed and built as ``make sdk-js`` leaves it."""
    return built_sdk_js()


def typescript_reports(node: str, mutation: str = "", *, seeded: bool = False) -> Sampler:
    """A sampler drawing from the TypeScript encoder: with the platform CSPRNG, or (``seeded``)
    a generator seeded with the seed the suite gives."""

    def sample(name: str, value: Any, draws: int, seed: int) -> list[list[bytes]]:
        told = (
            {"period": value.period, "changed": value.changed}
            if isinstance(value, StateUpdate)
            else value
        )
        arguments = [name, json.dumps(CASES[name].params), json.dumps(told), str(draws)]
        arguments.append(str(seed) if seeded else "system")
        done = subprocess.run(
            [node, str(SAMPLE), *arguments, *([mutation] if mutation else [])],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        lines = done.stdout.splitlines()
        assert len(lines) == draws
        return [[bytes.fromhex(f) for f in line.split(",") if f] for line in lines]

    return sample


@pytest.mark.parametrize("name", sorted(LAW_VIEWS))
def test_the_typescript_encoders_likelihood_ratio_is_the_described_local_eps(
    node: str, name: str
) -> None:
    check_described_pairs(name, typescript_reports(node), pairs=False)


@pytest.mark.parametrize("name", sorted(LAW_VIEWS))
def test_the_described_pairs_hold_for_the_typescript_encoders(node: str, name: str) -> None:
    check_described_pairs(name, typescript_reports(node, seeded=True))


@pytest.mark.parametrize("name", BIN_LAWS)
def test_the_typescript_encoders_bin_count_law_is_the_exact_one(node: str, name: str) -> None:
    check_bin_count_law(name, typescript_reports(node))


@pytest.mark.parametrize(
    ("name", "mutation"),
    [("krr", "eps=1.3"), ("krappor", "eps=1.3"), ("rfrag", "eps=1.5")],
)
def test_an_encoder_with_a_wrong_eps_fails_the_likelihood_check(
    node: str, name: str, mutation: str
) -> None:
    """Not longitudinal: its view (one period's report) bounds the described ε without
    attaining it (``LawView.tight``), so an encoder within the bound passes by design."""
    with pytest.raises(AssertionError):
        check_described_pairs(name, typescript_reports(node, mutation), pairs=False)


@pytest.mark.parametrize(
    ("name", "mutation"),
    [("krr", "coin=0.9"), ("krappor", "coin=0.9"), ("zsum", "coin=0.95"), ("zsum", "eps=0.8")],
)
def test_an_encoder_with_a_biased_coin_or_wrong_eps_fails_the_law_check(
    node: str, name: str, mutation: str
) -> None:
    with pytest.raises(AssertionError):
        check_bin_count_law(name, typescript_reports(node, mutation))
