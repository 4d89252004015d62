"""A shuffler compares every privacy term of a live channel it follows (mechanism, parameters,
δ, device budgets, deletion, crowd and fragments) and refuses a change; its floor caps the
local ε and δ of a channel it adopts; the terms it pinned survive a restart."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from common.mechanisms.ldpsgd import model_params
from common.terms import ChannelTerms, relaxations
from common.wire import ChannelConfig, DeviceBudget, b64
from shuffler.errors import ChannelTermsChangedError, UnknownChannelError
from shuffler.policies import Adoption, ChannelPolicies, PolicyFloor
from shuffler.service import ShufflerService

from ..analyzer.helpers import CHANNEL
from .factory import POLICY, make_service, pending
from .test_followed_channels import ForgedAnalyzer

FLOOR = PolicyFloor(min_crowd=10, max_eps_cr=2.0, max_delta_cr=1e-5)
#: k-RAPPOR at ε = 4: local ε 8 in the replacement notion, under the default ceiling 12.
SEARCH = CHANNEL.model_copy(update={"id": "search", "eps_cr": 1.0, "delta_cr": 1e-6})
BUDGET = DeviceBudget(lifetime_eps=40.0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"params": {"k": 20, "eps": 12.0}}, "local ε (replacement)"),
        ({"mechanism": "krr"}, "mechanism"),
        ({"delta": 1e-6}, "delta"),
        ({"eps_cr": 1.5}, "eps_cr"),
        ({"min_fragments": 2}, "min_fragments"),
        ({"params": {"k": 20, "eps": 10**400}}, "params"),  # cannot be evaluated
        ({"params": {"k": 20, "eps": 1e308}}, "local ε (replacement)"),  # overflows to inf
    ],
)
def test_a_live_channel_whose_terms_are_relaxed_is_suspended(
    change: dict[str, Any], field: str
) -> None:
    policies = ChannelPolicies([], FLOOR)
    adoption, persist = policies.adopt([SEARCH], revision=1)
    assert adoption.added == ["search"] and persist == [ChannelTerms.of(SEARCH, None)]
    changed, persist = policies.adopt([SEARCH.model_copy(update=change)], revision=2)
    assert field in changed.suspended["search"] and persist == [ChannelTerms.of(SEARCH, None)]
    assert policies.suspension("search") == changed.suspended["search"]
    assert policies.terms("search") == ChannelTerms.of(SEARCH, None)  # kept as adopted
    assert policies.get("search") == SEARCH.policy()
    again, _ = policies.adopt([SEARCH], revision=3)  # for good, even if the config goes back
    assert again == Adoption() and policies.suspension("search") is not None


@pytest.mark.parametrize(
    "change",
    [{"params": {"k": 20, "eps": 1.0}}, {"budget": BUDGET}, {"eps_cr": 0.5}, {"delta": 1e-12}],
)
def test_a_stronger_change_is_pinned_and_a_later_retirement_honoured(
    change: dict[str, Any],
) -> None:
    policies = ChannelPolicies([], FLOOR)
    policies.adopt([SEARCH], revision=1)
    stronger = SEARCH.model_copy(update=change)
    adoption, persist = policies.adopt([stronger], revision=2)
    assert adoption.pinned == ["search"] and persist == [ChannelTerms.of(stronger, None)]
    assert policies.terms("search") == ChannelTerms.of(stronger, None)
    assert policies.suspension("search") is None
    retired = stronger.model_copy(update={"retired_from_epoch": 7})
    adoption, _ = policies.adopt([retired], revision=3)
    assert adoption.retired == ["search"] and policies.get("search").retired_from_epoch == 7  # type: ignore[union-attr]


def test_a_suspended_channel_is_still_retired() -> None:
    policies = ChannelPolicies([], FLOOR)
    policies.adopt([SEARCH], revision=1)
    raised = SEARCH.model_copy(update={"params": {"k": 20, "eps": 12.0}})
    policies.adopt([raised], revision=2)
    retired = raised.model_copy(update={"retired_from_epoch": 9})
    adoption, persist = policies.adopt([retired], revision=3)
    assert adoption.retired == ["search"] and policies.suspension("search") is not None
    assert persist == [ChannelTerms.of(SEARCH, None).model_copy(update={"retired_from_epoch": 9})]


def test_a_device_budget_added_is_pinned_and_lifted_suspends() -> None:
    policies = ChannelPolicies([], FLOOR)
    policies.adopt([SEARCH], revision=1)
    added, _ = policies.adopt([SEARCH], revision=2, device_budget=BUDGET)
    assert added.pinned == ["search"]
    lifted, _ = policies.adopt([SEARCH], revision=3, device_budget=None)
    assert "device_budget" in lifted.suspended["search"]


def test_a_configured_channels_terms_are_pinned_at_first_sight() -> None:
    homepage = CHANNEL.model_copy(update=POLICY.model_dump())
    policies = ChannelPolicies([POLICY], FLOOR)
    adoption, persist = policies.adopt([homepage], revision=1)
    assert adoption.pinned == ["homepage"] and persist == [ChannelTerms.of(homepage, None)]
    raised = homepage.model_copy(update={"params": {"k": 20, "eps": 12.0}})
    suspended, _ = policies.adopt([raised], revision=2)
    assert "local ε" in suspended.suspended["homepage"]


def test_a_configured_channel_first_stated_over_the_ceiling_is_suspended() -> None:
    loose = CHANNEL.model_copy(update={**POLICY.model_dump(), "delta": 0.4})
    policies = ChannelPolicies([POLICY], FLOOR)
    adoption, _ = policies.adopt([loose], revision=1)
    assert "delta=0.4 > this shuffler's ceiling" in adoption.suspended["homepage"]


def test_a_huge_integer_refuses_only_its_own_channel() -> None:
    huge = SEARCH.model_copy(update={"id": "huge", "params": {"k": 20, "eps": 10**400}})
    adoption, _ = ChannelPolicies([], FLOOR).adopt([huge, SEARCH], revision=1)
    assert adoption.added == ["search"] and "cannot be computed" in adoption.refused["huge"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"delta": 0.4}, "delta=0.4 > this shuffler's ceiling 1e-05"),
        ({"params": {"k": 20, "eps": 15.0}}, "local ε=30 (krappor, replacement) > this"),
        ({"mechanism": "krr", "params": {"k": 20, "eps": 30.0}}, "local ε=30 (krr"),
        ({"mechanism": "nosuch"}, "nosuch with these params: its local ε cannot be computed"),
        ({"params": {"k": 20, "eps": 1e308}}, "local ε=inf (krappor, replacement) > this"),
    ],
)
def test_a_new_channel_above_the_local_eps_or_delta_ceiling_is_refused(
    change: dict[str, Any], reason: str
) -> None:
    policies = ChannelPolicies([], FLOOR)
    adoption, persist = policies.adopt([SEARCH.model_copy(update=change)], revision=1)
    assert reason in adoption.refused["search"] and persist == []
    assert policies.get("search") is None


def test_no_local_privacy_at_all_is_adopted_only_where_the_operator_allows_it() -> None:
    params = {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 4000}
    zsum = ChannelConfig(id="features", mechanism="zsum", params=params, delta=1e-6)
    assert ChannelPolicies([], FLOOR).adopt([zsum], revision=1)[0].added == ["features"]
    strict = PolicyFloor(
        min_crowd=10, max_eps_cr=2.0, max_delta_cr=1e-5, without_local_privacy=False
    )
    refused = ChannelPolicies([], strict).adopt([zsum], revision=1)[0].refused
    assert "local ε=inf" in refused["features"]


@pytest.fixture
def forged(tmp_path: Path) -> Iterator[tuple[ForgedAnalyzer, ShufflerService]]:
    analyzer = ForgedAnalyzer()
    service, clock = make_service(
        f"sqlite:///{tmp_path / 's.db'}",
        tmp_path,
        analyzer_url=analyzer.url,
        analyzer_key=b64(analyzer.key.public_key().public_bytes_raw()),
    )
    clock.now = time.time()
    yield analyzer, service
    analyzer.server.shutdown()


def test_a_followed_channel_raised_over_http_is_suspended_logged_and_kept_after_a_restart(
    forged: tuple[ForgedAnalyzer, ShufflerService],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    analyzer, service = forged
    assert service.follower is not None
    raised = SEARCH.model_copy(update={"params": {"k": 20, "eps": 12.0}})
    loose = SEARCH.model_copy(update={"id": "loose", "delta": 0.4})
    token = service.tokens.issue()
    epoch = int(time.time()) // SEARCH.epoch_seconds
    with httpx.Client() as http:
        analyzer.sign(1, time.time(), [SEARCH])
        assert service.follower.fetch(http).added == ["search"]  # type: ignore[union-attr]
        before = pending(service, token, epoch, channel="search")  # taken before the change
        analyzer.sign(2, time.time(), [raised, loose])
        with caplog.at_level(logging.ERROR, logger="esa.shuffler"):
            adoption = service.follower.fetch(http)
    assert adoption is not None and set(adoption.refused) == {"loose"}
    assert set(adoption.suspended) == {"search"}
    logged = {r.channel: r.reason for r in caplog.records if hasattr(r, "reason")}  # type: ignore[attr-defined]
    assert "local ε (replacement)" in logged["search"] and "delta=0.4" in logged["loose"]
    assert before.contribution.channel_id == "search"
    with pytest.raises(ChannelTermsChangedError):  # 409 channel_terms_changed: suspended
        pending(service, service.tokens.issue(), epoch, channel="search")
    with pytest.raises(UnknownChannelError):  # 400 unknown_channel: never served
        pending(service, token, epoch, channel="loose")
    replica, clock = make_service(
        f"sqlite:///{tmp_path / 's.db'}",
        tmp_path,
        analyzer_url=analyzer.url,
        analyzer_key=b64(analyzer.key.public_key().public_bytes_raw()),
    )
    clock.now = time.time()
    replica.load_state()  # a restart: the pinned terms and the suspension come back
    assert replica.policies.terms("search") == ChannelTerms.of(SEARCH, None)
    assert replica.policies.suspension("search") == adoption.suspended["search"]
    with pytest.raises(ChannelTermsChangedError):  # before any fetch
        pending(replica, replica.tokens.issue(), epoch, channel="search")


def test_a_new_model_round_of_ldp_sgd_is_not_a_privacy_change() -> None:
    """LDP-SGD publishes its current model in ``params`` every round: not a parameter (the
    mechanism's own parse drops it), so neither a shuffler nor a device refuses it; its ε is."""
    base = {"dim": 4, "eps": 1.0}
    rounds = [
        ChannelConfig(
            id="train",
            mechanism="ldp-sgd",
            params={**base, **model_params(r, np.full(4, float(r)))},
            min_fragments=1,
            max_fragments=1,
        )
        for r in (0, 1)
    ]
    policies = ChannelPolicies([], FLOOR)
    assert policies.adopt(rounds[:1], revision=1)[0].added == ["train"]
    assert policies.adopt(rounds[1:], revision=2)[0] == Adoption()
    old, new = (ChannelTerms.of(r, None) for r in rounds)
    assert relaxations(old, new) == [] and old.changed_terms(new) == []
    raised = rounds[1].model_copy(update={"params": {**rounds[1].params, "eps": 2.0}})
    assert "local ε" in policies.adopt([raised], revision=3)[0].suspended["train"]
    relaxed = relaxations(old, ChannelTerms.of(raised, None))
    assert relaxed[0].field == "local ε (replacement)"
