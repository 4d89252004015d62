"""A device never relaxes what it accepted about a channel's privacy: the terms of the first
config naming a channel are pinned in the state file; a later validly signed config relaxing
any of them is refused for that channel (typed error naming field, old and new value) and
nothing is queued under it, across restarts; a stronger one is pinned; the app's caps hold
whatever the config says."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from common.collection import sign_config
from common.terms import ChannelTerms, relaxations
from common.wire import ChannelConfig, CollectionConfig, DeviceBudget, SignedConfig
from encoder_client import (
    BudgetExceededError,
    Client,
    ConfigError,
    InvalidArgumentError,
    PrivacyCapError,
    PrivacyCaps,
    PrivacyRelaxedError,
)

from ..support import OfflineConfig, offline_config

EPOCH = 3600
BUDGET = DeviceBudget(lifetime_eps=100.0)
#: k-RAPPOR at ε = 3: removal ε 3, replacement ε 6 per report.
PAGES = ChannelConfig(
    id="pages",
    mechanism="krappor",
    params={"k": 8, "eps": 3.0},
    epoch_seconds=EPOCH,
    max_fragments=8,
    budget=BUDGET,
)
OTHER = PAGES.model_copy(update={"id": "other"})
#: An ε no float holds (a signed config may carry any JSON integer).
HUGE = 10**400


class Clock:
    """Epoch-aligned time the test moves forward."""

    def __init__(self) -> None:
        self.now = 1_000 * EPOCH + 5.0

    def __call__(self) -> float:
        return self.now


def _resign(found: OfflineConfig, channels: list[ChannelConfig], **update: Any) -> None:
    """Sign ``channels`` (and ``update``) with the analyzer's own key, one second newer: a
    config every signature check accepts."""
    signed = SignedConfig.model_validate_json(found.path.read_text())
    config = CollectionConfig.model_validate(signed.config)
    newer = config.model_copy(
        update={"channels": channels, "issued_at": config.issued_at + 1, **update}
    )
    found.path.write_text(sign_config(newer, found.signer).model_dump_json())


def _client(tmp: Path, found: OfflineConfig, clock: Clock, **kwargs: Any) -> Client:
    return Client(
        config_file=found.path,
        trust_file=found.trust_file,
        state_path=tmp / "state.sqlite",
        background=False,
        clock=clock,
        **kwargs,
    )


WEAKER: list[tuple[dict[str, Any], str, object, object]] = [
    ({"params": {"k": 8, "eps": 12.0}}, "local ε (replacement)", 6.0, 24.0),
    ({"mechanism": "krr", "params": {"k": 8, "eps": 3.0}}, "mechanism", "krappor", "krr"),
    ({"params": {"k": 8, "eps": "x"}}, "params", {"k": 8, "eps": 3.0}, {"k": 8, "eps": "x"}),
    ({"delta": 1e-6}, "delta", 1e-9, 1e-6),
    # an ε no float holds: its privacy cannot be evaluated, so it is not orderable
    ({"params": {"k": 8, "eps": HUGE}}, "params", {"k": 8, "eps": 3.0}, {"k": 8, "eps": HUGE}),
    ({"eps_cr": 1.0}, "eps_cr", 0.5, 1.0),
    ({"delta_cr": 1e-6}, "delta_cr", 1e-9, 1e-6),
    ({"min_crowd": 20}, "min_crowd", 100, 20),
    ({"epoch_seconds": 60}, "epoch_seconds", EPOCH, 60),
    ({"max_fragments": 4}, "max_fragments", 8, 4),
    ({"budget": None}, "budget", BUDGET.model_dump(), None),
    ({"budget": DeviceBudget(lifetime_eps=1000.0)}, "budget.lifetime_eps", 100.0, 1000.0),
]


@pytest.mark.parametrize(("change", "field", "old", "new"), WEAKER, ids=[w[1] for w in WEAKER])
def test_a_config_relaxing_a_channel_is_refused_and_nothing_is_sent_under_it(
    tmp_path: Path, change: dict[str, Any], field: str, old: object, new: object
) -> None:
    found, clock = offline_config(tmp_path, [PAGES, OTHER]), Clock()
    with _client(tmp_path, found, clock) as client:
        client.histogram("pages").report(3)
        reporter = client.histogram("pages")
        _resign(found, [PAGES.model_copy(update=change), OTHER])
        client.refresh_config()  # the config is taken; only the relaxed channel is refused
        clock.now += EPOCH
        queued, spent = client.state.outbox_size(), client.budget_spent()
        with pytest.raises(PrivacyRelaxedError) as refused:
            reporter.report(3)
        assert (refused.value.channel_id, refused.value.field) == ("pages", field)
        assert (refused.value.old, refused.value.new) == (old, new)
        assert "'pages'" in str(refused.value) and field in str(refused.value)
        with pytest.raises(PrivacyRelaxedError):
            client.histogram("pages")
        assert (client.state.outbox_size(), client.budget_spent()) == (queued, spent)
        client.histogram("other").report(1)  # the unchanged channel reports as usual
    # the pin lives in the state file
    with _client(tmp_path, found, clock) as again, pytest.raises(PrivacyRelaxedError):
        again.histogram("pages").report(3)


def test_a_lifted_device_budget_refuses_every_channel(tmp_path: Path) -> None:
    found, clock = offline_config(tmp_path, [PAGES], DeviceBudget(lifetime_eps=50.0)), Clock()
    with _client(tmp_path, found, clock) as client:
        client.histogram("pages").report(3)
    _resign(found, [PAGES], device_budget=None)
    with _client(tmp_path, found, clock) as client, pytest.raises(PrivacyRelaxedError) as refused:
        client.histogram("pages")
    assert refused.value.field == "device_budget"


def test_a_stronger_config_is_pinned_and_the_old_terms_never_return(tmp_path: Path) -> None:
    found, clock = offline_config(tmp_path, [PAGES]), Clock()
    with _client(tmp_path, found, clock) as client:
        client.histogram("pages").report(3)
        stronger = PAGES.model_copy(update={"params": {"k": 8, "eps": 1.0}, "min_crowd": 200})
        _resign(found, [stronger])
        client.refresh_config()
        clock.now += EPOCH
        client.histogram("pages").report(3)
        assert client.budget_spent("pages") == pytest.approx(6.0 + 2.0)  # charged at ε = 1
        _resign(found, [PAGES])  # back to what was accepted first: relaxes the pinned
        client.refresh_config()
        with pytest.raises(PrivacyRelaxedError) as refused:
            client.histogram("pages")
        assert (refused.value.old, refused.value.new) == (2.0, 6.0)  # replacement notion


def test_a_channel_above_the_apps_local_cap_is_refused(tmp_path: Path) -> None:
    found, clock = offline_config(tmp_path, [PAGES, OTHER]), Clock()
    caps = PrivacyCaps(local_eps=4.0, channel_local_eps={"other": 6.0})
    with _client(tmp_path, found, clock, caps=caps) as client:
        with pytest.raises(PrivacyCapError) as refused:
            client.histogram("pages")
        assert (refused.value.channel_id, refused.value.cap, refused.value.value) == (
            "pages",
            4.0,
            6.0,
        )
        client.histogram("other").report(2)  # its own cap admits ε = 6
        assert client.state.pinned_terms().keys() == {"other"}


def test_a_channel_whose_eps_cannot_be_evaluated_is_refused_alone(tmp_path: Path) -> None:
    huge = PAGES.model_copy(update={"id": "huge", "params": {"k": 8, "eps": 10**400}})
    found, clock = offline_config(tmp_path, [huge, OTHER]), Clock()
    with _client(tmp_path, found, clock, caps=PrivacyCaps(local_eps=10.0)) as client:
        with pytest.raises(PrivacyCapError) as refused:
            client.histogram("huge")
        assert refused.value.value == math.inf
        client.histogram("other").report(1)
        client.refresh_config()


class GatedClock(Clock):
    """A clock that holds the thread named ``gated`` once, inside :meth:`Client._accept` after
    it reviewed its config against the pins (the only clock read there), until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self) -> float:
        if threading.current_thread().name == "gated" and not self.entered.is_set():
            self.entered.set()
            self.release.wait(2.0)
        return self.now


def test_two_configs_accepted_at_once_never_leave_a_channel_below_its_pin(
    tmp_path: Path,
) -> None:
    found, clock = offline_config(tmp_path, [PAGES]), GatedClock()
    with _client(tmp_path, found, clock) as client:
        stronger = PAGES.model_copy(update={"params": {"k": 8, "eps": 1.0}})
        _resign(found, [stronger])
        first = client._load_config()
        _resign(found, [PAGES])  # newer, and as accepted first: relaxes the stronger pin
        second = client._load_config()
        gated = threading.Thread(target=client._accept, args=(second,), name="gated")
        gated.start()
        assert clock.entered.wait(10.0)
        with contextlib.suppress(ConfigError):  # serialized: older than the one accepted
            client._accept(first)
        clock.release.set()
        gated.join()
        pinned = client.state.pinned_terms()["pages"]
        served = ChannelTerms.of(client._config.channels[0], client._config.device_budget)
        try:
            client.histogram("pages")
        except PrivacyRelaxedError:
            return
        assert relaxations(pinned, served) == [], (pinned, served)


def test_the_apps_lifetime_cap_holds_whatever_the_config_allows(tmp_path: Path) -> None:
    found, clock = offline_config(tmp_path, [PAGES]), Clock()
    with _client(tmp_path, found, clock, caps=PrivacyCaps(lifetime_eps=12.0)) as client:
        for _ in range(2):
            client.histogram("pages").report(3)
            clock.now += EPOCH
        queued = client.state.outbox_size()
        with pytest.raises(BudgetExceededError, match="the app's lifetime budget ε=12"):
            client.histogram("pages").report(3)
        assert client.state.outbox_size() == queued


@pytest.mark.parametrize(
    "caps",
    [
        {"local_eps": 0},
        {"local_eps": float("nan")},
        {"lifetime_eps": -1.0},
        {"local_eps": True},
        {"channel_local_eps": {"pages": "3"}},
        {"channel_local_eps": [("pages", 3.0)]},
    ],
)
def test_unusable_caps_are_invalid_arguments(caps: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="eps"):
        PrivacyCaps(**caps)


def test_caps_must_be_privacy_caps(tmp_path: Path) -> None:
    found = offline_config(tmp_path, [PAGES])
    with pytest.raises(InvalidArgumentError, match="caps"):
        _client(tmp_path, found, Clock(), caps={"local_eps": 1.0})


def test_pinned_terms_are_stored_as_signed(tmp_path: Path) -> None:
    found, clock = offline_config(tmp_path, [PAGES]), Clock()
    with _client(tmp_path, found, clock) as client:
        pinned = client.state.pinned_terms()["pages"]
    assert json.loads(pinned.model_dump_json())["params"] == {"k": 8, "eps": 3.0}
    assert pinned.budget == BUDGET and pinned.policy() == PAGES.policy()
