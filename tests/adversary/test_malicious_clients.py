"""Malicious clients against honest shufflers: what a client can send must not get an honest
batch refused, stuck or withheld (docs/protocol.md, "Fixed sizes"; the analyzer's crowd check).

Found by a review of the crowd check: a client's oversized fragments pushed an honest part over
the analyzer's body cap (413, retried until retention), and each garbage fragment cost the
honest batch a whole contribution, so a few clients could get it withheld below min_crowd.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import httpx

from common.collection import verify_collection
from common.envelope import (
    Contribution,
    inner_size,
    load_x25519_public,
    new_nonce,
    seal_contribution,
)
from encoder_client import Client

from ..support import ADMIN_HEADERS, Deployment, unopened_parts, wait_until
from .conftest import CLICKS

#: Honest devices and malicious clients of the crowd test.
HONEST, MALICIOUS = 360, 4  # ~100 a shuffler: its lower bound clears min_crowd (20)


def _garbage(deployment: Deployment, fragments: list[bytes]) -> httpx.Response:
    """One contribution of ``fragments`` from a freshly enrolled client to shuffler-1."""
    document = httpx.get(deployment.analyzer.url + "/v1/config", timeout=10).json()
    config = verify_collection(document, deployment.trust(), time.time())
    shuffler = config.shufflers[0]
    key = load_x25519_public(base64.b64decode(shuffler.public_key))
    token = httpx.post(shuffler.url + "/v1/enroll", timeout=10).json()["client_token"]
    epoch = int(time.time() // CLICKS.epoch_seconds)
    contribution = Contribution(
        channel_id=CLICKS.id,
        crowd_id="",
        epoch=epoch,
        nonce=new_nonce(),
        fragments=tuple(fragments),
    )
    return httpx.post(
        shuffler.url + "/v1/contributions",
        content=seal_contribution(contribution, shuffler.id, key),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"},
        timeout=10,
    )


def test_a_fragment_of_another_size_is_refused(deployment: Deployment) -> None:
    """Oversized fragments (16 × 15,800 bytes fit a 256 KB contribution) would make an honest
    part larger than the largest legal one, which the analyzer refuses unread."""
    refused = _garbage(deployment, [os.urandom(15_800)] * 16)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == "bad_fragment_size"
    right = inner_size(CLICKS.payload_size)
    assert _garbage(deployment, [os.urandom(right + 1)]).json()["error"] == "bad_fragment_size"


def test_garbage_from_a_few_clients_costs_an_honest_batch_one_contribution_each(
    deployment: Deployment, tmp_path: Path
) -> None:
    for device in range(HONEST):
        with Client(
            deployment.analyzer.url + "/v1/config",
            trust_file=deployment.trust_file,
            state_path=tmp_path / f"device-{device}.db",
            background=False,
        ) as client:
            client.histogram(CLICKS.id).report(device % CLICKS.params["k"])
            assert client.flush() == 1
    size = inner_size(CLICKS.payload_size)
    for _ in range(MALICIOUS):  # each sends as many garbage fragments as a contribution may
        accepted = _garbage(deployment, [os.urandom(size)] * CLICKS.max_fragments)
        assert accepted.status_code == 202, accepted.text
    epoch = int(time.time() // CLICKS.epoch_seconds)
    for shuffler in deployment.shufflers:
        closed = httpx.post(
            shuffler.url + "/v1/admin/close",
            json={"channel_id": CLICKS.id, "epoch": epoch},
            headers=ADMIN_HEADERS,
            timeout=60,
        )
        assert closed.status_code == 200, closed.text
    url = f"{deployment.analyzer.url}/v1/channels/{CLICKS.id}/estimate"

    def every_batch_in() -> bool:  # each shuffler forwards after its close, in the background
        found = httpx.get(url, params={"epoch": epoch}, timeout=30)
        return found.status_code == 200 and found.json()["crowd_check"]["batches"] == 3

    wait_until(lambda: unopened_parts(deployment.analyzer.url) == 0 and every_batch_in(), 120)
    release = httpx.get(url, params={"epoch": epoch}, timeout=30).json()
    check = release["crowd_check"]
    print(
        f"{HONEST} honest devices and {MALICIOUS} clients sending 16 garbage fragments each:", check
    )
    assert check["batches"] == 3 and check["withheld_batches"] == 0
    # the crowd rests on what the honest fragments prove (a lower bound, never the claim):
    # garbage never lifts it, and costs at most one contribution per client below the claim
    assert check["verified"] <= check["claimed"]
    assert check["invalid_fragments"] <= MALICIOUS * CLICKS.max_fragments
    assert check["verified"] <= release["n"] <= check["claimed"]  # the estimate: claims held
