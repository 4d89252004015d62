"""Attacks 7 and 8 against a real deployment: a registered shuffler's batch for an epoch far in
the future (refused by the analyzer: 422 ``future_epoch``), and a device sealing to an analyzer
key retired early (refused by the shuffler: 409 ``config_outdated``, so the device refreshes
its config and its next report lands). docs/operations.md, "Clock skew" and "Key rotation"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from encoder_client import Client
from services.cli import launcher

from ..support import Deployment, key_deployment, wait_until
from .conftest import HOMEPAGE, PAGES
from .forge import MaliciousShuffler, certified

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """``esa up`` with two shufflers following the analyzer's config every half second."""
    with key_deployment(tmp_path_factory.mktemp("clocks"), [PAGES, HOMEPAGE]) as running:
        yield running


@pytest.fixture(scope="module")
def liar(deployment: Deployment) -> MaliciousShuffler:
    return MaliciousShuffler(deployment)


def test_a_batch_for_an_epoch_far_ahead_is_refused(liar: MaliciousShuffler) -> None:
    current = int(time.time() // PAGES.epoch_seconds)
    ahead = current + 10**6 * 3600 // PAGES.epoch_seconds + 1  # 10^6 hours ahead
    values = [i % 16 for i in range(500)]
    refused = liar.post("pages", ahead, 500, liar.fragments("pages", ahead, values))
    honest = liar.post("pages", 30, 500, liar.fragments("pages", 30, values))
    control = liar.release("pages", 30).json()
    stored = liar.release("pages", ahead)
    print(
        f"ATTACK 7 batch for epoch {ahead} (10^6 h ahead): HTTP {refused.status_code} "
        f"{refused.json().get('error')}, its release HTTP {stored.status_code}; honest control "
        f"epoch 30: HTTP {honest.status_code}, {certified(control)}"
    )
    assert (refused.status_code, refused.json()["error"]) == (422, "future_epoch")
    assert stored.status_code == 404  # nothing of it was stored
    assert honest.status_code == 201
    assert control["crowd_check"]["verified"] == 500


def _admin(deployment: Deployment, path: str, body: dict[str, str] | None = None) -> httpx.Response:
    """The analyzer's key admin route, with its own admin token."""
    token = (deployment.var / "keys" / "analyzer" / launcher.ADMIN_TOKEN_FILE).read_text()
    headers = {"Authorization": f"Bearer {token.strip()}"}
    url = deployment.analyzer.url + "/v1/admin/keys" + path
    if body is None:
        return httpx.get(url, headers=headers, timeout=30)
    return httpx.post(url, json=body, headers=headers, timeout=30)


def _published_hpke(deployment: Deployment) -> str:
    keys = _admin(deployment, "").json()["keys"]
    return next(str(k["key_id"]) for k in keys if k["kind"] == "hpke" and k["published"])


def _listed(deployment: Deployment) -> list[str]:
    """The analyzer HPKE key ids its config lists now."""
    config = httpx.get(deployment.analyzer.url + "/v1/config", timeout=30).json()["config"]
    return [key["key_id"] for key in config["analyzer"]["keys"]]


def test_a_report_sealed_to_a_retired_analyzer_key_is_refused_and_the_next_lands(
    deployment: Deployment, tmp_path: Path
) -> None:
    def device(name: str) -> Client:
        return Client(
            deployment.analyzer.url + "/v1/config",
            trust_file=deployment.trust_file,
            state_path=tmp_path / f"{name}.db",
            background=False,
            weights={"shuffler-1": 1.0},
        )

    stale = device("stale")  # its config lists the analyzer key about to retire
    old = _published_hpke(deployment)
    assert _admin(deployment, "/rotate", {"key": "hpke"}).status_code == 200
    wait_until(lambda: _published_hpke(deployment) != old, 30)
    retired = _admin(deployment, "/retire", {"key": "hpke", "key_id": old})
    assert retired.status_code == 200, retired.text
    wait_until(lambda: old not in _listed(deployment), 30)
    time.sleep(3.0)  # the shufflers follow the config every 0.5 s

    stale.histogram(PAGES.id).report(3)
    attacked = stale.flush()
    outdated = stale.state.outbox_size() == 0 and stale._stale
    stale.histogram(HOMEPAGE.id).report(5)  # fetches the config first, seals to the new key
    recovered = stale.flush()
    control = device("control")
    control.histogram(PAGES.id).report(3)
    honest = control.flush()
    new = stale._config.analyzer.keys[0].key_id
    print(
        f"ATTACK 8 report sealed to analyzer key {old} retired early: delivered {attacked} "
        f"(409 config_outdated: {outdated}), the same device's next report delivered "
        f"{recovered} (sealed to {new}); honest control (config fetched after) delivered {honest}"
    )
    stale.close()
    control.close()
    assert (attacked, outdated) == (0, True)
    assert recovered == 1 and new != old
    assert honest == 1
