"""The SDK against real shuffler and analyzer processes."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.envelope import public_bytes
from common.wire import MAX_EPOCH_SECONDS, ChannelConfig
from encoder_client import (
    AlreadyReportedError,
    ChannelError,
    Client,
    ConfigError,
    EsaError,
    TrustedKeyError,
    UnknownCrowdError,
    ValueOutOfDomainError,
)

from ..support import Deployment, close_epoch, start_deployment, wait_until

pytestmark = pytest.mark.system  # starts real processes

# epoch_seconds=MAX_EPOCH_SECONDS (a year) on the channels whose tests span seconds (200
# reports; a shuffler restart): with hour-long epochs a run straddled an epoch boundary
# (contributions refused as epoch_not_open, or split over two epochs) with probability
# ~(test duration)/3600, ~1% in all.
# homepage's eps_cr, delta_cr: Algorithm 3 aborts a group with probability delta_cr / 4, so
# 1e-3 made one of the three shufflers drop its whole crowd in 7.5e-4 of runs; 1e-7 gives
# 7.5e-8, and each shuffler deletes ln(2 / delta_cr) / 2 + Laplace(0.5) ~ 8 contributions.
# min_crowd 10 (a shuffler's floor), not 20: the 200 devices give a shuffler Binomial(200, 1/3)
# ~67, and its kept contributions' fragments (1.16 each) must verify min_crowd at alpha 1e-9
# (28 fragments for 10, 43 for 20). With 20 a shuffler held its batch (no release: the test
# waits for all three) in 4.4e-3 of runs; with 10 in 6.2e-7 (sum over the binomial split, the
# Laplace draw and the exact fragment-count law, aborts included).
CHANNELS = [
    ChannelConfig(
        id="homepage",
        mechanism="krappor",
        params={"k": 10, "eps": 4.0},
        epoch_seconds=MAX_EPOCH_SECONDS,
        min_crowd=10,
        eps_cr=4.0,
        delta_cr=1e-7,
        max_fragments=10,
        payload_size=16,
        delta=1e-8,
    ),
    ChannelConfig(
        id="pages",
        mechanism="rfrag",
        params={"k": 10, "eps_b": 4.0, "eps_f": 2.0, "tau": 3},
        epoch_seconds=MAX_EPOCH_SECONDS,
        min_crowd=20,
        eps_cr=1.0,
        delta_cr=1e-3,
        max_fragments=10,
        payload_size=16,
    ),
    ChannelConfig(
        id="abroad",
        mechanism="longitudinal",
        params={"d": 8, "k": 1, "eps": 2.0},
        min_crowd=20,
        max_fragments=1,
        payload_size=16,
        display="series",
    ),
    ChannelConfig(
        id="regional",
        mechanism="krr",
        params={"k": 4, "eps": 2.0},
        epoch_seconds=MAX_EPOCH_SECONDS,
        min_crowd=20,
        max_fragments=1,
        payload_size=16,
        crowds=("eu", "us"),
    ),
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    running = start_deployment(tmp_path_factory.mktemp("sdk"), CHANNELS)
    yield running
    running.stop()


def _client(deployment: Deployment, state: Path, **kwargs: Any) -> Client:
    return Client(
        deployment.analyzer.url + "/v1/config",
        trust_file=deployment.trust_file,
        state_path=state,
        **kwargs,
    )


def test_reports_reach_the_analyzer_estimates(deployment: Deployment, tmp_path: Path) -> None:
    truth = np.array([60, 45, 30, 25, 20, 10, 5, 3, 1, 1])
    values = np.repeat(np.arange(10), truth)
    for i, value in enumerate(values):
        with _client(deployment, tmp_path / f"device-{i}.db", background=False) as client:
            client.histogram("homepage").report(int(value))
            assert client.flush() == 1
    epoch = int(time.time() // CHANNELS[0].epoch_seconds)
    close_epoch(deployment, "homepage", epoch)
    url = deployment.analyzer.url + f"/v1/channels/homepage/estimate?epoch={epoch}"

    def crowds() -> int:
        response = httpx.get(url)
        return len(response.json()["crowds"]) if response.status_code == 200 else 0

    # Every shuffler got contributions (P(one got none) = 3 (2/3)^200), so wait for its batch.
    wait_until(lambda: crowds() == len(deployment.shufflers))
    release = httpx.get(url).json()
    # honest shufflers: the certificate rests on the crowds their fragments prove (a lower bound
    # a few percent under each claim), the estimate on the claims the fragments allow
    check = release["crowd_check"]
    assert check["batches"] == len(deployment.shufflers)
    assert check["verified"] == sum(release["crowds"].values()) <= release["n"] == check["claimed"]
    assert check["invalid_fragments"] == 0
    kept = release["n"] / values.size
    bins = np.array(release["bins"])
    values_hat = np.array(release["values"])
    expected = truth[bins] * kept
    # The analyzer's standard error covers the randomized response only; randomized
    # deletion adds (about) hypergeometric sampling noise of the kept users per bin.
    deletion_var = truth[bins] * kept * (1 - kept)
    spread = np.sqrt(np.array(release["std_errors"]) ** 2 + deletion_var)
    assert 0.7 < kept < 1.0  # expected ~0.87; 0.7 needs Laplace(0.5) noise summing below -30
    # Thresholds from a 10^7-run Monte Carlo of this setup (multinomial routing, Algorithm 3,
    # hypergeometric deletion, k-RAPPOR). Small bins' counts are Poisson-like (skewed), so the
    # normal tail does not apply: 3.29 per bin ("99.9%") failed a correct pipeline in 1.7% of
    # runs (2.4% with the old deletion settings). P(max |z| > 6.5) = 1.9e-6, above 1e-6;
    # P(max |z| > 7.5) = 5.5e-8 (union over bins of the exact randomized-response tail given
    # the kept crowd, averaged over 1,000 draws of routing and deletion).
    z = (values_hat - expected) / spread
    assert np.all(np.abs(z) <= 7.5), (values_hat, expected, spread)
    # Power: estimates in the wrong bins fail the correlation; estimates off by a factor fail
    # the slope of estimate on truth (sd ~4%; 5 sd was never exceeded in the 10^7 runs).
    assert np.corrcoef(values_hat, expected)[0, 1] > 0.8
    slope = expected @ values_hat / (expected @ expected)
    slope_sd = np.sqrt(np.sum(expected**2 * spread**2)) / (expected @ expected)
    assert abs(slope - 1.0) <= 5.0 * slope_sd, (slope, slope_sd)


def test_outbox_survives_app_restarts_and_delivers_exactly_once(
    deployment: Deployment, tmp_path: Path
) -> None:
    state = tmp_path / "device.db"
    key = str(deployment.trust_file)
    config_url = deployment.analyzer.url + "/v1/config"
    for process in deployment.shufflers:
        process.stop()
    script = (
        "import sys; from encoder_client import Client\n"
        "c = Client(sys.argv[1], trust_file=sys.argv[2], state_path=sys.argv[3],\n"
        "           background=False)\n"
        "c.histogram('pages').report(3)\n"
        "print(c.flush(), c.state.outbox_size()); c.close()\n"
    )
    queued = subprocess.run(
        [sys.executable, "-c", script, config_url, key, str(state)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert queued.stdout.split() == ["0", "3"]  # three rows, one per shuffler, all queued
    for process in deployment.shufflers:
        process.start()
    before = _received(deployment)
    drain = (
        "import sys, time; from encoder_client import Client\n"
        "c = Client(sys.argv[1], trust_file=sys.argv[2], state_path=sys.argv[3],\n"
        "           background=False)\n"
        "sent = 0\n"
        "for _ in range(60):\n"
        "    sent += c.flush()\n"
        "    if c.state.outbox_size() == 0: break\n"
        "    time.sleep(0.25)\n"
        "print(sent, c.state.outbox_size(), c.flush()); c.close()\n"
    )
    drained = subprocess.run(
        [sys.executable, "-c", drain, config_url, key, str(state)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert drained.stdout.split() == ["3", "0", "0"]
    assert _received(deployment) - before == 3


ADMIN = {"Authorization": "Bearer development"}


def _received(deployment: Deployment) -> int:
    total = 0
    for process in deployment.shufflers:
        metrics = httpx.get(process.url + "/metrics", headers=ADMIN).text
        for line in metrics.splitlines():
            if line.startswith("esa_shuffler_contributions_received_total"):
                total += int(float(line.split()[-1]))
    return total


def test_restart_reuses_state_and_a_lost_file_is_a_new_device(
    deployment: Deployment, tmp_path: Path
) -> None:
    state = tmp_path / "device.db"
    with _client(deployment, state, background=False) as client:
        client.histogram("pages").report(4)
        device = client.device_id
        backstops = client.state.channel_state("pages", "rfrag")
        tracker = client.longitudinal("abroad")
        tracker.update(1, False)
        tree = client.state.channel_state("abroad", "longitudinal")
    with _client(deployment, state, background=False) as again:
        assert again.device_id == device
        assert again.state.channel_state("pages", "rfrag") == backstops
        assert again.state.channel_state("abroad", "longitudinal") == tree
        with pytest.raises(AlreadyReportedError):
            again.histogram("pages").report(4)
    state.unlink()
    for suffix in ("-wal", "-shm"):
        Path(str(state) + suffix).unlink(missing_ok=True)
    with _client(deployment, state, background=False) as fresh:
        assert fresh.device_id != device
        assert fresh.state.channel_state("pages", "rfrag") is None


def test_corrupted_state_is_detected_and_reset(deployment: Deployment, tmp_path: Path) -> None:
    state = tmp_path / "device.db"
    state.write_bytes(b"this is not a sqlite database" * 100)
    with _client(deployment, state, background=False) as client:
        assert client.state.was_reset
        assert list(tmp_path.glob("device.db.corrupt-*"))


def test_typed_errors(deployment: Deployment, tmp_path: Path) -> None:
    url = deployment.analyzer.url + "/v1/config"
    pins = deployment.trust().to_json()
    other_key = base64.b64encode(public_bytes(Ed25519PrivateKey.generate().public_key())).decode()
    with pytest.raises(ConfigError, match="does not verify"):
        Client(
            url,
            trusted_key=other_key,
            shuffler_keys=pins["shufflers"],
            state_path=tmp_path / "a.db",
            background=False,
        )
    # the analyzer's key alone no longer makes a device: each shuffler's own key is pinned
    with pytest.raises(TrustedKeyError, match="shuffler_keys"):
        Client(url, trusted_key=pins["analyzer"], state_path=tmp_path / "a.db", background=False)
    wrong = dict(pins["shufflers"], **{"shuffler-2": other_key})
    with pytest.raises(ConfigError, match="'shuffler-2' is not signed by the key pinned for it"):
        Client(
            url,
            trusted_key=deployment.trusted_key(),
            shuffler_keys=wrong,
            state_path=tmp_path / "a.db",
            background=False,
        )
    fewer = {k: v for k, v in pins["shufflers"].items() if k != "shuffler-3"}
    with pytest.raises(ConfigError, match="'shuffler-3', whose key this device does not pin"):
        Client(
            url,
            trusted_key=pins["analyzer"],
            shuffler_keys=fewer,
            state_path=tmp_path / "a.db",
            background=False,
        )
    # the pins in var/trust.json are the deployment's own keys, given either way
    with Client(
        url,
        trusted_key=deployment.trusted_key(),
        shuffler_keys=pins["shufflers"],
        state_path=tmp_path / "a.db",
        background=False,
    ) as client:
        assert [s.id for s in client._shufflers] == ["shuffler-1", "shuffler-2", "shuffler-3"]
    with pytest.raises(ConfigError, match="expired"):
        Client(
            url,
            trust_file=deployment.trust_file,
            state_path=tmp_path / "b.db",
            background=False,
            clock=lambda: time.time() + 30 * 24 * 3600,
        )
    document = httpx.get(url).json()
    document["config"]["channels"][0]["params"]["eps"] = 20.0
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="does not verify"):
        Client(
            config_file=tampered,
            trust_file=deployment.trust_file,
            state_path=tmp_path / "c.db",
            background=False,
        )
    unsigned = tmp_path / "unsigned.json"
    unsigned.write_text(json.dumps({"config": document["config"]}))
    with pytest.raises(ConfigError, match="not signed"):
        Client(
            config_file=unsigned,
            trust_file=deployment.trust_file,
            state_path=tmp_path / "d.db",
            background=False,
        )
    with _client(deployment, tmp_path / "e.db", background=False) as client:
        with pytest.raises(ValueOutOfDomainError, match="value must be an integer in \\[0, 10\\)"):
            client.histogram("homepage").report(10)
        client.histogram("homepage").report(2)
        with pytest.raises(AlreadyReportedError):
            client.histogram("homepage").report(5)
        with pytest.raises(ChannelError):
            client.longitudinal("homepage")
        with pytest.raises(ChannelError):
            client.histogram("nope")
        assert client.state.outbox_size() == 1


def test_a_device_reports_in_one_declared_crowd(deployment: Deployment, tmp_path: Path) -> None:
    """Issue 12: crowds come from the signed config; the first is the default, another declared
    one can be chosen per client or per reporter, an undeclared one is refused by name."""
    with _client(deployment, tmp_path / "a.db", background=False) as client:
        assert client.histogram("regional").crowd == "eu"
        assert client.histogram("homepage").crowd == ""
        assert client.histogram("regional", crowd="us").crowd == "us"
        with pytest.raises(UnknownCrowdError, match="'asia'") as raised:
            client.histogram("regional", crowd="asia")
        assert isinstance(raised.value, EsaError) and isinstance(raised.value, ChannelError)
        with pytest.raises(UnknownCrowdError, match="'eu'"):
            client.histogram("homepage", crowd="eu")  # homepage declares only ""
        client.histogram("regional", crowd="us").report(1)
        assert client.flush() == 1  # the shuffler took it (202): "us" is declared there too
        with pytest.raises(AlreadyReportedError):  # one contribution per channel and epoch
            client.histogram("regional", crowd="eu").report(2)
    with _client(deployment, tmp_path / "b.db", background=False, crowd="us") as client:
        assert client.histogram("regional").crowd == "us"
        with pytest.raises(UnknownCrowdError, match="'us'"):
            client.histogram("homepage")
        assert client.histogram("homepage", crowd="").crowd == ""
    document = httpx.get(deployment.analyzer.url + "/v1/config").json()
    regional = next(c for c in document["config"]["channels"] if c["id"] == "regional")
    assert regional["crowds"] == ["eu", "us"]
    regional["crowds"].append("asia")  # crowds are signed with the rest of the config
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="does not verify"):
        Client(
            config_file=tampered,
            trust_file=deployment.trust_file,
            state_path=tmp_path / "c.db",
            background=False,
        )
