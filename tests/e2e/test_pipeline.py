"""End to end with real processes: 3 shufflers and an analyzer on 127.0.0.1, talking HTTP.

A population is encoded with the real mechanisms, each fragment sealed for the analyzer and each
contribution for one shuffler, posted, batched with randomized deletion, forwarded, analyzed.
Checks: estimates sit inside their 95% intervals at the expected rate, the certified ε equals
what ``esa account certify`` prints for the crowd received, batches are verified and counted
once, chaff is counted, a restart keeps everything, and the dashboard shows the numbers.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import verify_config
from common.envelope import (
    Contribution,
    load_ed25519_public,
    load_x25519_public,
    new_nonce,
    seal_contribution,
    seal_fragment,
    sign,
)
from common.mechanisms import krappor
from common.wire import Batch, ChannelConfig, b64

from ..support import Deployment, start_deployment, wait_until

K, EPS, DELTA = 20, 4.0, 1e-8
CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": K, "eps": EPS},
    epoch_seconds=3600,
    min_crowd=50,
    eps_cr=1.0,
    delta_cr=1e-3,
    max_fragments=K,
    delta=DELTA,
    payload_size=16,
)
ADMIN = {"Authorization": "Bearer development"}
TRUTH = np.array([140, 110, 90, 70, 60, 50, 40, 30, 20, 20, 15, 10, 10, 8, 6, 5, 4, 3, 2, 1])


@pytest.fixture(params=["sqlite", "postgresql"])
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    analyzer_db = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    running = start_deployment(tmp_path, [CHANNEL], analyzer_db)
    yield running
    running.stop()


def _report(deployment: Deployment, values: np.ndarray) -> int:
    document = httpx.get(deployment.analyzer.url + "/v1/config").json()
    pinned = load_ed25519_public(base64.b64decode(document["config"]["analyzer"]["signing_key"]))
    config = verify_config(document, pinned, time.time())
    analyzer_key = load_x25519_public(base64.b64decode(config["analyzer"]["keys"][0]["public_key"]))
    shufflers = config["shufflers"]
    params = krappor.KRapporParams(k=K, eps=EPS)
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    accepted = 0
    tokens = {s["id"]: [] for s in shufflers}
    for value in values:
        target = shufflers[secrets.randbelow(len(shufflers))]
        fragments = tuple(
            seal_fragment(f, CHANNEL.id, CHANNEL.payload_size, analyzer_key)
            for f in krappor.encode(int(value), params)
        )
        contribution = Contribution(CHANNEL.id, "", epoch, new_nonce(), fragments)
        token = httpx.post(target["url"] + "/v1/enroll").json()["client_token"]
        tokens[target["id"]].append(token)
        blob = seal_contribution(
            contribution, target["id"], load_x25519_public(base64.b64decode(target["public_key"]))
        )
        response = httpx.post(
            target["url"] + "/v1/contributions",
            content=blob,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/octet-stream",
            },
        )
        accepted += response.status_code == 202
    for process in deployment.shufflers:
        close = httpx.post(
            process.url + "/v1/admin/close",
            headers=ADMIN,
            timeout=60,
            json={"channel_id": CHANNEL.id, "epoch": epoch},
        )
        assert close.status_code == 200, close.text
    return accepted


def _crafted_batch(
    deployment: Deployment,
    n: int,
    fragments: list[str],
    shuffler: str = "shuffler-1",
    key: Ed25519PrivateKey | None = None,
) -> httpx.Response:
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=shuffler,
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=1,
        n_contributions=n,
        fragments=fragments,
    )
    body = batch.body()
    signature = b64(sign(body, key or deployment.signing_keys[shuffler]))
    return httpx.post(
        deployment.analyzer.url + "/v1/batches",
        content=body,
        headers={"ESA-Signature": signature, "Content-Type": "application/json"},
    )


def test_pipeline_end_to_end(deployment: Deployment) -> None:
    values = np.repeat(np.arange(K), TRUTH)
    np.random.default_rng(0).shuffle(values)
    assert _report(deployment, values) == values.size
    url = deployment.analyzer.url
    wait_until(
        lambda: (httpx.get(url + "/v1/channels").json()["channels"][0]["epochs"]) is not None
    )
    time.sleep(1.0)
    release = httpx.get(url + f"/v1/channels/{CHANNEL.id}/estimate").json()
    lo, hi = np.array(release["ci95"]).T
    # Algorithm 3 deleted whole contributions uniformly at each shuffler: the released crowd
    # holds each value in proportion, so the estimate targets the reported counts scaled by it.
    kept = release["n"] / values.size
    assert 0.85 < kept < 1.0
    truth = TRUTH[np.array(release["bins"])] * kept
    assert np.mean((lo <= truth) & (truth <= hi)) >= 0.8, (release["values"], truth)
    smallest = min(release["crowds"].values())
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "account",
            "certify",
            "--mechanism",
            "krappor",
            "--eps0",
            str(EPS),
            "--n",
            str(smallest),
            "--delta",
            str(DELTA),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert release["certificate"]["eps"] == pytest.approx(
        json.loads(cli.stdout)["certified"]["eps"]
    )

    # A duplicated batch counts once; forged and unknown signers get 401; small batches 422.
    sealed = [b64(bytes(72))] * 60
    first = _crafted_batch(deployment, 60, sealed)
    assert first.status_code == 201 and first.json()["invalid"] == 60  # undecryptable chaff
    repeat = httpx.post(
        url + "/v1/batches",
        content=first.request.content,
        headers={"ESA-Signature": first.request.headers["ESA-Signature"]},
    )
    assert repeat.status_code == 200 and repeat.json()["duplicate"] is True
    batch_n = httpx.get(url + f"/v1/channels/{CHANNEL.id}/estimate?epoch=1").json()["n"]
    forged = _crafted_batch(deployment, 60, sealed, key=Ed25519PrivateKey.generate())
    assert forged.status_code == 401 and forged.json()["error"] == "bad_signature"
    unknown = _crafted_batch(
        deployment, 60, sealed, shuffler="shuffler-9", key=deployment.signing_keys["shuffler-1"]
    )
    assert unknown.status_code == 401 and unknown.json()["error"] == "unknown_shuffler"
    small = _crafted_batch(deployment, 10, sealed[:10])
    assert small.status_code == 422 and small.json()["error"] == "below_min_crowd"
    assert batch_n == 60

    # Restart keeps accumulators and the ledger; the dashboard shows the channel's numbers.
    ledger = httpx.get(url + f"/v1/channels/{CHANNEL.id}/privacy").json()["releases"]
    deployment.analyzer.kill()
    deployment.analyzer.start()
    again = httpx.get(
        url + f"/v1/channels/{CHANNEL.id}/estimate?epoch={release['epochs'][0]}"
    ).json()
    assert again["values"] == release["values"]
    assert (
        len(httpx.get(url + f"/v1/channels/{CHANNEL.id}/privacy").json()["releases"])
        == len(ledger) + 1
    )
    page = httpx.get(url + "/").text
    assert CHANNEL.id in page and f"{again['certificate']['eps']:.4g}" in page
    metrics = httpx.get(url + "/metrics").text
    assert (
        "esa_analyzer_batches_accepted_total" in metrics
        and "esa_analyzer_fragments_invalid_total" in metrics
    )
