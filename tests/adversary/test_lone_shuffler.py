"""A lone lying shuffler against a real deployment (an analyzer and three shufflers, processes on
127.0.0.1, real devices through the SDK): it keeps one target's contribution, drops everyone
else's from its own batch, pads it with fragments it sealed itself (the analyzer's HPKE key is
public) and reads the public estimate before and after its batch.

Before releases waited for every shuffler, the estimate of the epoch right after its batch was
its batch alone: subtracting its own fragments gave the target's k-RAPPOR report bit for bit,
while a central ε was certified at the padded crowd of 2,000. Now the epoch's estimate appears
only once shuffler-2 and shuffler-3 delivered theirs too (docs/protocol-notes.md, "Releases wait
for every shuffler"), so the target's report is read mixed with the honest crowds of the epoch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from common.envelope import FragmentContext, seal_fragment
from common.mechanisms import BatchContext, get
from common.wire import MAX_EPOCH_SECONDS, ChannelConfig, b64
from encoder_client import Client

from ..support import ADMIN_HEADERS, Deployment, start_deployment, unopened_parts, wait_until
from .forge import MaliciousShuffler

#: k-RAPPOR over 64 values (about 8.4 of 64 bits set per report at ε = 2); deletion cheap
#: enough (Algorithm 3 removes ~8 contributions a group) that the honest groups are released.
#: min_crowd 10 (a shuffler's floor), not 20: an honest shuffler gets Binomial(180, 1/3) ~60
#: devices and must keep >= min_crowd after deletion, whose fragments verify >= min_crowd at
#: alpha 1e-9 (133 fragments for 10, 240 for 20). With 20 one of the two honest groups was held
#: (no release: the test waits for all three batches) in 4.4e-4 of runs, with 10 in 5.8e-8 (sum
#: over the binomial split, the Laplace draw and the exact fragment-count law, aborts included).
TARGETED = ChannelConfig(
    id="targeted",
    mechanism="krappor",
    params={"k": 64, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=10,
    eps_cr=4.0,
    delta_cr=1e-7,
    max_fragments=64,
    delta=1e-8,
)
#: Honest devices (each routed to one of the three shufflers by the SDK).
DEVICES = 180
#: The lying shuffler's batch: the target's contribution and PADDING of its own.
PADDING = 1_999


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    found = start_deployment(Path(tmp_path_factory.mktemp("lone")), [TARGETED])
    try:
        yield found
    finally:
        found.stop()


def _report(liar: MaliciousShuffler, value: int) -> list[bytes]:
    """One k-RAPPOR report of ``value`` as a device encodes it (plaintext fragments)."""
    mechanism: Any = get(TARGETED.mechanism)
    params = mechanism.parse_params(TARGETED.params)
    encoded = mechanism.encode(params, value, None, liar.rng, 3)
    return [f for _, fragments in encoded.routes for f in fragments]


def _bits(fragments: list[bytes]) -> npt.NDArray[np.int64]:
    """The bit counts ``fragments`` add to a k-RAPPOR accumulator (the analyzer's own fold)."""
    mechanism: Any = get(TARGETED.mechanism)
    params = mechanism.parse_params(TARGETED.params)
    accumulator = mechanism.new_accumulator(params)
    mechanism.accumulate(params, accumulator, fragments, 1, BatchContext(0, 3))
    return np.asarray(accumulator.counts, dtype=np.int64)


def _raw_counts(release: dict[str, Any]) -> npt.NDArray[np.int64]:
    """The bit counts behind a public k-RAPPOR estimate (the debiasing inverted)."""
    e, n = np.exp(TARGETED.params["eps"]), release["n"]
    values = np.zeros(TARGETED.params["k"])
    values[release["bins"]] = release["values"]
    return np.rint((values * (e - 1.0) + n) / (e + 1.0)).astype(np.int64)


def _guess(residual: npt.NDArray[np.int64], ones: int) -> npt.NDArray[np.int64]:
    """The attacker's reading of one report from what is left after its own padding: the
    ``ones`` bits with the largest residual counts."""
    guess = np.zeros(residual.size, dtype=np.int64)
    guess[np.argsort(-residual, kind="stable")[:ones]] = 1
    return guess


def _estimate(url: str, epoch: int) -> httpx.Response:
    wait_until(lambda: unopened_parts(url) == 0, timeout=60)
    return httpx.get(
        f"{url}/v1/channels/{TARGETED.id}/estimate", params={"epoch": epoch}, timeout=30
    )


def _close(deployment: Deployment, index: int, epoch: int) -> None:
    closed = httpx.post(
        deployment.shufflers[index].url + "/v1/admin/close",
        json={"channel_id": TARGETED.id, "epoch": epoch},
        headers=ADMIN_HEADERS,
        timeout=60,
    )
    assert closed.status_code == 200, closed.text


def _waiting(url: str, epoch: int, delivered: int) -> bool:
    found = _estimate(url, epoch)
    return found.status_code == 404 and f"epoch {epoch}: {delivered})" in found.json()["detail"]


def test_a_lone_shuffler_reads_its_target_only_mixed_with_the_other_crowds(
    deployment: Deployment, tmp_path: Path
) -> None:
    url = deployment.analyzer.url
    epoch = int(time.time() // TARGETED.epoch_seconds)
    rng = np.random.default_rng(11)
    for device in range(DEVICES):
        with Client(
            url + "/v1/config",
            trust_file=deployment.trust_file,
            state_path=tmp_path / f"device-{device}.db",
            background=False,
        ) as client:
            client.histogram(TARGETED.id).report(int(rng.integers(64)))
            assert client.flush() == 1
    liar = MaliciousShuffler(deployment, "shuffler-1")  # never closes its own real group
    target, decoy = _report(liar, 17), _report(liar, 17)
    padding = [f for v in rng.integers(64, size=PADDING) for f in _report(liar, int(v))]
    context = FragmentContext(TARGETED.id, epoch, "")
    sealed = [
        b64(seal_fragment(f, context, TARGETED.payload_size, liar.analyzer_key))
        for f in target + padding
    ]
    assert liar.post(TARGETED.id, epoch, 1 + PADDING, sealed).status_code == 201
    after_batch = _estimate(url, epoch)
    assert after_batch.status_code == 404, after_batch.text  # its batch alone: nothing shown
    assert after_batch.json()["error"] == "epoch_open"
    wait_until(lambda: _waiting(url, epoch, 1), timeout=30)
    _close(deployment, 1, epoch)
    wait_until(lambda: _waiting(url, epoch, 2), timeout=60)  # two of three: still nothing
    _close(deployment, 2, epoch)
    wait_until(lambda: _estimate(url, epoch).status_code == 200, timeout=60)
    release = _estimate(url, epoch).json()
    check = release["crowd_check"]
    assert check["batches"] == 3 and len(release["crowds"]) == 3, release["crowds"]
    honest = release["n"] - (1 + PADDING)
    assert honest >= 2 * TARGETED.min_crowd  # both honest groups are in the epoch

    residual = _raw_counts(release) - _bits(padding)
    truth, control = _bits(target), _bits(decoy)
    guess = _guess(residual, int(truth.sum()))
    recovered = int((guess == truth).sum())
    by_chance = int((guess == control).sum())
    alone = int((_guess(truth, int(truth.sum())) == truth).sum())  # its batch read alone
    print(
        f"ATTACK lone shuffler (keep 1, drop the rest, pad {PADDING:,}): estimate after its "
        f"batch {after_batch.status_code} {after_batch.json()['error']}, after 2 of 3 batches "
        f"404 epoch_open; released with {honest} honest contributions of shuffler-2/3: target "
        f"bits recovered {recovered}/64 (its batch alone: {alone}/64), same reading of a decoy "
        f"report never sent {by_chance}/64; certified eps {release['certificate']['eps']:.3f}, "
        f"local eps {release['local']['removal']:.1f} per bit (the floor)"
    )
    assert alone == 64  # what the attack read before: every bit
    assert recovered < 64, (recovered, residual.tolist(), truth.tolist())
