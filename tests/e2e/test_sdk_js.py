"""The TypeScript device SDK (sdk-js/, built to sdk-js/dist) on the real wire, in Node.

What it seals opens with the Python shuffler and analyzer code (real HPKE): every contribution
at its shuffler, every fragment at the analyzer, each parsing as its mechanism's report. Then
TypeScript devices report to a real deployment (an analyzer and three shufflers started like
every e2e test): every contribution is taken (202), every fragment opens and parses at the
analyzer, and the release estimates what the devices reported.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from common.envelope import FragmentContext, KeyRing, inner_size, open_contribution, open_fragment
from common.mechanisms import BatchContext, get
from common.wire import MAX_EPOCH_SECONDS, ChannelConfig

from ..support import (
    LONG_EPOCH_CHANNEL,
    SDK_JS,
    Deployment,
    built_sdk_js,
    close_epoch,
    offline_config,
    start_deployment,
    wait_until,
)

DEVICE = SDK_JS / "scripts" / "device.mjs"


@pytest.fixture(scope="module")
def node() -> str:
    """Node, with the SDK installed and built as ``make sdk-js`` leaves it."""
    return built_sdk_js()


def _device(node: str, request: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    done = subprocess.run(
        [node, str(DEVICE)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


CHANNELS = [
    ChannelConfig(id="clicks", mechanism="krappor", params={"k": 8, "eps": 2.0}, max_fragments=8),
    ChannelConfig(
        id="pages", mechanism="krr", params={"k": 4, "eps": 2.0}, max_fragments=1, crowds=("", "eu")
    ),
    ChannelConfig(
        id="rows",
        mechanism="rfrag",
        params={"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3},
        max_fragments=24,
        payload_size=32,
    ),
    ChannelConfig(
        id="counts",
        mechanism="zsum",
        params={"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000},
        max_fragments=9,
    ),
    ChannelConfig(
        id="abroad", mechanism="longitudinal", params={"d": 1, "k": 1, "eps": 2.0}, max_fragments=1
    ),
]
REPORTS: list[dict[str, Any]] = [
    {"channel": "clicks", "value": 3},
    {"channel": "pages", "value": 2, "crowd": "eu"},
    {"channel": "rows", "value": 7},
    {"channel": "counts", "value": 5},
    {"channel": "abroad", "period": 1, "changed": True},
]


def test_what_the_typescript_sdk_seals_opens_with_the_python_shuffler_and_analyzer(
    tmp_path: Path, node: str
) -> None:
    found = offline_config(tmp_path, CHANNELS)
    now = time.time()
    answer = _device(
        node,
        {
            "mode": "capture",
            "config_text": found.path.read_text(),
            "trust": json.loads(found.trust_file.read_text()),
            "now": now,
            "reports": REPORTS,
        },
    )
    assert answer["outcomes"] == ["ok"] * len(REPORTS)
    shuffler, analyzer = KeyRing.of(found.shuffler), KeyRing.of(found.analyzer)
    channels = {c.id: c for c in CHANNELS}
    seen = []
    for sent in answer["sent"]:
        assert sent["url"] == "http://127.0.0.1:9/v1/contributions"
        contribution = open_contribution(base64.b64decode(sent["body"]), "shuffler-1", shuffler)
        channel = channels[contribution.channel_id]
        assert contribution.epoch == int(now // channel.epoch_seconds)
        expected_crowd = next(r.get("crowd", "") for r in REPORTS if r["channel"] == channel.id)
        assert contribution.crowd_id == expected_crowd
        context = FragmentContext(channel.id, contribution.epoch, contribution.crowd_id)
        assert {len(f) for f in contribution.fragments} <= {inner_size(channel.payload_size)}
        opened = [open_fragment(f, context, analyzer) for f in contribution.fragments]
        mechanism = get(channel.mechanism)
        params = mechanism.parse_params(channel.params)
        accumulator = mechanism.new_accumulator(params)
        invalid = mechanism.accumulate(params, accumulator, opened, 1, BatchContext(0, 1))
        assert invalid == 0, channel.id
        assert len(opened) <= mechanism.fragment_limit(params)
        seen.append(channel.id)
    assert sorted(seen) == sorted(r["channel"] for r in REPORTS)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    running = start_deployment(tmp_path, [LONG_EPOCH_CHANNEL])
    yield running
    running.stop()


#: Values of the TypeScript devices: 135 report 0, 90 report 1, 45 report 2 (~90 a shuffler:
#: each batch's fragments then verify a crowd well above min_crowd, so none is held).
TRUTH = np.array([135, 90, 45] + [0] * 17)


def _estimate(url: str) -> dict[str, Any]:
    response = httpx.get(url + f"/v1/channels/{LONG_EPOCH_CHANNEL.id}/estimate", timeout=30)
    return response.json() if response.status_code == 200 else {}


def test_typescript_devices_report_through_a_real_deployment(
    deployment: Deployment, node: str
) -> None:
    values = np.repeat(np.arange(TRUTH.size), TRUTH)
    np.random.default_rng(1).shuffle(values)
    answer = _device(
        node,
        {
            "mode": "devices",
            "config_url": deployment.analyzer.url + "/v1/config",
            "trust": json.loads(deployment.trust_file.read_text()),
            "devices": [{"channel": LONG_EPOCH_CHANNEL.id, "value": int(v)} for v in values],
        },
    )
    assert answer["outcomes"] == ["ok"] * values.size
    assert (answer["delivered"], answer["left"]) == (values.size, 0)
    close_epoch(deployment, LONG_EPOCH_CHANNEL.id, int(time.time() // MAX_EPOCH_SECONDS))
    url = deployment.analyzer.url
    wait_until(lambda: len(_estimate(url).get("crowds", {})) == len(deployment.shufflers), 90)
    release = _estimate(url)
    check = release["crowd_check"]
    assert check["invalid_fragments"] == 0 and check["withheld_batches"] == 0
    assert check["verified"] <= release["n"] <= check["claimed"] <= values.size
    # Randomized deletion (Algorithm 3) dropped whole contributions uniformly at each shuffler:
    # the estimate targets the reported counts scaled by what was kept; 8 standard errors of
    # randomized response and deletion together (as tests/e2e/test_pipeline.py). The 17 empty
    # bins' counts are Poisson-like (~4.3 false bits each), far from normal in the upper tail:
    # 6 failed a correct run with P = 4.5e-5, 8 with 7.4e-8 (union over bins of the exact
    # randomized-response tail given the kept crowd, averaged over 200 draws of routing and
    # deletion). A group aborted or held adds 7.5e-8 (~90 a shuffler, min_crowd 5).
    kept = release["n"] / values.size
    assert 0.4 < kept <= 1.0
    bins = np.array(release["bins"])
    expected = TRUTH[bins] * kept
    spread = np.sqrt(np.array(release["std_errors"]) ** 2 + TRUTH[bins] * kept * (1 - kept))
    assert np.all(np.abs(np.array(release["values"]) - expected) <= 8.0 * spread), release
