"""End to end with real processes: 3 shufflers and an analyzer on 127.0.0.1, talking HTTP.

A population is encoded with the real mechanisms, each fragment sealed for the analyzer and each
contribution for one shuffler, posted, batched with randomized deletion, forwarded, analyzed.
Checks: estimates agree with the truth within their standard errors (randomized response plus
randomized deletion), the certified ε equals
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
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import verify_collection
from common.envelope import (
    Contribution,
    FragmentContext,
    load_x25519_public,
    new_nonce,
    seal_contribution,
    seal_fragment,
)
from common.mechanisms import BatchContext, krappor
from common.randomness import SeededSource, default_source
from common.wire import MAX_EPOCH_SECONDS, Batch, ChannelConfig

from ..support import Deployment, start_deployment, wait_until
from .forge import analyzer_key, fragments, krappor_reports, post_part

K, EPS, DELTA = 20, 4.0, 1e-8
# epoch_seconds: the reporting loop takes up to ~90 s on a slow runner and uses one epoch; with
# hour-long epochs it straddled a boundary (contributions refused as epoch_not_open) in ~2% of
# runs. With 10^8 s epochs the chance is < 1e-6 per run.
# eps_cr, delta_cr: Algorithm 3 aborts a shuffler's group (deletes it all) with probability
# delta_cr / 4; 1e-3 made that 7.5e-4 per run (3 shufflers); 1e-7 makes it 7.5e-8. Each shuffler
# still deletes ln(2 / delta_cr) + Laplace(1) ~ 17 contributions, about 7% of the crowd.
CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": K, "eps": EPS},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=50,
    eps_cr=2.0,
    delta_cr=1e-7,
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
    # As a device: the analyzer's config and every shuffler's descriptor, each verified with
    # the key pinned for its party (var/trust.json).
    config = verify_collection(document, deployment.trust(), time.time())
    analyzer_key = load_x25519_public(base64.b64decode(config.analyzer.keys[0].public_key))
    shufflers = config.shufflers
    params = krappor.KRapporParams(k=K, eps=EPS)
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    context = FragmentContext(CHANNEL.id, epoch, "")
    accepted = 0
    tokens: dict[str, list[str]] = {s.id: [] for s in shufflers}
    for value in values:
        target = shufflers[secrets.randbelow(len(shufflers))]
        fragments = tuple(
            seal_fragment(f, context, CHANNEL.payload_size, analyzer_key)
            for f in krappor.KRappor().encode_value(params, int(value), default_source())
        )
        contribution = Contribution(
            channel_id=CHANNEL.id, crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=fragments
        )
        token = httpx.post(target.url + "/v1/enroll", timeout=30).json()["client_token"]
        tokens[target.id].append(token)
        blob = seal_contribution(
            contribution, target.id, load_x25519_public(base64.b64decode(target.public_key))
        )
        response = httpx.post(
            target.url + "/v1/contributions",
            content=blob,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/octet-stream",
            },
            timeout=30,  # not httpx's 5 s: a slow runner's fsync must not fail the test
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


def _proved(n: int, epoch: int) -> int:
    """The crowd the analyzer verifies for :func:`_crafted_batch`'s ``n`` seeded reports."""
    params = krappor.KRapporParams(k=K, eps=EPS)
    rng = SeededSource(epoch)
    valid = sum(len(krappor.KRappor().encode_value(params, int(v), rng)) for v in np.arange(n) % K)
    law = krappor.KRappor().fragment_count(params, BatchContext(0, 3))
    return law.verified_crowd(n, valid, 0)


def _crafted_batch(
    deployment: Deployment,
    n: int,
    epoch: int = 1,
    shuffler: str = "shuffler-1",
    key: Ed25519PrivateKey | None = None,
) -> httpx.Response:
    """A batch of ``n`` honest k-RAPPOR contributions for ``epoch``, as ``shuffler`` sends it
    (signed with ``key``, by default its own)."""
    reports = krappor_reports(
        np.arange(n) % K,
        krappor.KRapporParams(k=K, eps=EPS),
        FragmentContext(CHANNEL.id, epoch, ""),
        CHANNEL.payload_size,
        analyzer_key(deployment.analyzer.url),
        SeededSource(epoch),
    )
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=shuffler,
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=n,
        fragments=fragments(reports),
    )
    signer = key or deployment.signing_keys.get(shuffler) or deployment.signing_keys["shuffler-1"]
    return post_part(deployment.analyzer.url, batch.body(), signer, shuffler)


def _estimate(url: str) -> dict[str, Any]:
    response = httpx.get(url + f"/v1/channels/{CHANNEL.id}/estimate")
    return response.json() if response.status_code == 200 else {}


def test_pipeline_end_to_end(deployment: Deployment) -> None:
    values = np.repeat(np.arange(K), TRUTH)
    np.random.default_rng(0).shuffle(values)
    assert _report(deployment, values) == values.size
    url = deployment.analyzer.url
    # Generous deadlines: delivery and background opening under a loaded 2-core machine.
    wait_until(
        lambda: (httpx.get(url + "/v1/channels").json()["channels"][0]["epochs"]) is not None,
        timeout=90.0,
    )
    # Wait for every shuffler's batch (one crowd each), not for a fixed time.
    wait_until(
        lambda: len(_estimate(url).get("crowds", {})) == len(deployment.shufflers), timeout=90.0
    )
    release = _estimate(url)
    # Every shuffler's crowd verified by its fragments: the release rests on the crowd they
    # prove (a lower bound, a few percent under each claim), never on the claims.
    check = release["crowd_check"]
    assert check["batches"] == len(deployment.shufflers) and check["withheld_batches"] == 0
    assert check["verified"] <= release["n"] <= check["claimed"]  # the estimate: claims held
    assert check["invalid_fragments"] == 0
    # Algorithm 3 deleted whole contributions uniformly at each shuffler: the released crowd
    # holds each value in proportion, so the estimate targets the reported counts scaled by it.
    kept = release["n"] / values.size
    assert 0.6 < kept < 1.0  # ~0.93 kept by deletion x ~0.85 proved at ~215 a shuffler
    bins = np.array(release["bins"])
    estimate = np.array(release["values"])
    expected = TRUTH[bins] * kept
    # ci95 covers randomized response only; deletion adds (about hypergeometric) sampling noise
    # of the kept users, as large as the RR noise for the biggest bins. Testing "80% of the 95%
    # intervals cover" failed a correct pipeline in ~1% of runs. Instead, per bin and against the
    # combined spread, with thresholds set by a 10^7-run Monte Carlo of this very setup
    # (multinomial routing, Algorithm 3, hypergeometric deletion, k-RAPPOR):
    spread = np.sqrt(np.array(release["std_errors"]) ** 2 + TRUTH[bins] * kept * (1 - kept))
    z = (estimate - expected) / spread
    # counts are Poisson-like (skewed), so not the normal tail: P(max |z| > 6) = 3.1e-6, above
    # 1e-6; P(max |z| > 7) = 6.5e-8 (union over bins of the exact randomized-response tail
    # given the kept crowd, averaged over 300 draws of routing and deletion). A group aborted
    # or held (no release) adds 7.5e-8: each shuffler keeps ~215, min_crowd 50 needs 100
    # fragments at alpha 1e-9.
    assert np.all(np.abs(z) <= 7.0), (estimate, expected, spread)
    # The per-bin check is loose; the power is here. Slope of estimate on truth, weighted by the
    # truth (sd ~2%): a correct pipeline exceeds 5 sd with probability < 1e-7 (none in the 10^7
    # runs), while estimates scaled by 0.85 fail it with probability > 0.999 and estimates moved
    # one bin over (slope ~0.8) always do.
    slope = expected @ estimate / (expected @ expected)
    slope_sd = np.sqrt(np.sum(expected**2 * spread**2)) / (expected @ expected)
    assert abs(slope - 1.0) <= 5.0 * slope_sd, (slope, slope_sd)
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

    # A duplicated batch counts once, a second batch for its group is refused; forged and
    # unknown signers get 401; small batches 422.
    first = _crafted_batch(deployment, 120)
    assert first.status_code == 201 and first.json()["duplicate"] is False  # stored, opened later
    sent = {k: first.request.headers[k] for k in ("ESA-Signature", "ESA-Shuffler", "ESA-Preauth")}
    repeat = httpx.post(url + "/v1/batches", content=first.request.content, headers=sent)
    assert repeat.status_code == 200 and repeat.json()["duplicate"] is True
    estimate = url + f"/v1/channels/{CHANNEL.id}/estimate?epoch=1"
    wait_until(lambda: httpx.get(estimate).status_code == 200, timeout=60)
    crafted = httpx.get(estimate).json()
    batch_n = crafted["n"]
    second = _crafted_batch(deployment, 120)  # another batch id, same shuffler, epoch and crowd
    assert second.status_code == 422 and second.json()["error"] == "duplicate_group"
    forged = _crafted_batch(deployment, 60, epoch=2, key=Ed25519PrivateKey.generate())
    assert forged.status_code == 401 and forged.json()["error"] == "bad_preauth"  # its head
    unknown = _crafted_batch(
        deployment, 60, epoch=2, shuffler="shuffler-9", key=deployment.signing_keys["shuffler-1"]
    )
    assert unknown.status_code == 401 and unknown.json()["error"] == "unknown_shuffler"
    small = _crafted_batch(deployment, 10, epoch=2)
    assert small.status_code == 422 and small.json()["error"] == "below_min_crowd"
    # Every fragment opened: the certificate rests on the crowd the fragments prove (the same
    # seeded reports give it here), below the claim and above min_crowd; the estimate on the
    # claim, which the fragments allow.
    proved = _proved(120, epoch=1)
    assert batch_n == 120 and CHANNEL.min_crowd <= proved < 120
    assert crafted["crowd_check"] == {
        "batches": 1,
        "claimed": 120,
        "verified": proved,
        "invalid_fragments": 0,
        "short_batches": 1,
        "withheld_batches": 0,
    }
    assert httpx.get(estimate).json()["n"] == 120  # the refused batches added nothing

    # Restart keeps accumulators and the ledger; estimates are reads (the ledger charges each
    # epoch once); a published release is recorded; the dashboard shows the channel's numbers.
    ledger = httpx.get(url + f"/v1/channels/{CHANNEL.id}/privacy").json()
    assert ledger["releases"] == [] and ledger["lifetime"]["eps"] > 0
    deployment.analyzer.kill()
    deployment.analyzer.start()
    again = httpx.get(
        url + f"/v1/channels/{CHANNEL.id}/estimate?epoch={release['epochs'][0]}"
    ).json()
    assert again["values"] == release["values"]
    assert httpx.get(url + f"/v1/channels/{CHANNEL.id}/privacy").json() == ledger
    published = httpx.post(
        url + f"/v1/channels/{CHANNEL.id}/releases",
        json={"epoch": release["epochs"][0]},
        headers={"Authorization": "Bearer development"},
    )
    assert published.status_code == 201 and published.json()["values"] == release["values"]
    recorded = httpx.get(url + f"/v1/channels/{CHANNEL.id}/privacy").json()["releases"]
    assert [r["epochs"] for r in recorded] == [published.json()["epochs"]]
    page = httpx.get(url + "/").text
    assert CHANNEL.id in page and f"{again['certificate']['eps']:.4g}" in page
    metrics = httpx.get(url + "/metrics").text
    assert (
        "esa_analyzer_batches_accepted_total" in metrics
        and "esa_analyzer_fragments_invalid_total" in metrics
    )
