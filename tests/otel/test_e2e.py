"""End to end: the example shop (docs/examples/otel_app), instrumented only through the
OpenTelemetry API, runs as 24 devices against a real deployment (``esa up`` for tests: the
analyzer and a shuffler as processes on 127.0.0.1); the released estimate of the route channel
matches what the apps' own metrics recorded."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.wire import MAX_EPOCH_SECONDS, ChannelConfig

from ..support import Deployment, close_epoch, start_deployment, wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "otel_app"
sys.path.insert(0, str(EXAMPLE))
import shop_traffic  # noqa: E402  # the example app's own traffic driver

pytestmark = pytest.mark.system  # starts real processes

# The example mapping's channel ids (esa up's catalogue) with parameters that make the check
# sharp for 24 devices: k-RR at ε = 10 (a report differs from the truth with probability
# 7/(e^10 + 7) < 3.2e-4), one shuffler, and randomized deletion that removes few (ε_cr = 20:
# 0.1·ln(2/δ_cr) ≈ 1.7 contributions plus Laplace(0.1); more than 6 has probability < 1e-17;
# the group is aborted with probability δ_cr/4 = 2.5e-8).
CHANNELS = [
    ChannelConfig(
        id=channel,
        mechanism="krr",
        params={"k": 8, "eps": 10.0},
        epoch_seconds=MAX_EPOCH_SECONDS,
        min_crowd=5,
        eps_cr=20.0,
        delta_cr=1e-7,
        max_fragments=1,
        delta=1e-8,
    )
    for channel in ("homepage", "features")
]
#: Each device's favourite route (route i of the mapping's vocabulary is bin i).
FAVOURITES = ["/items/{item_id}"] * 13 + ["/"] * 7 + ["/search"] * 3 + ["/cart"]


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    running = start_deployment(tmp_path / "var", CHANNELS, count=1)
    yield running
    running.stop()


def _release(url: str, channel: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/channels/{channel}/estimate", timeout=30)
    return response.json() if response.status_code == 200 else {}


def test_the_shop_route_histogram_reaches_the_estimate(
    deployment: Deployment, tmp_path: Path
) -> None:
    url = deployment.analyzer.url
    epoch = int(time.time() // CHANNELS[0].epoch_seconds)
    devices = shop_traffic.run(
        url + "/v1/config", deployment.trust_file, tmp_path / "devices", FAVOURITES, seed=1
    )
    assert all(d.delivered for d in devices)
    # What the apps recorded (their own OpenTelemetry metrics) is the truth the estimate targets.
    truth = Counter(d.most_used for d in devices)
    assert truth == Counter(FAVOURITES)
    for channel in ("homepage", "features"):
        close_epoch(deployment, channel, epoch)
    wait_until(lambda: _release(url, "homepage").get("n", 0) > 0, timeout=30)
    release = _release(url, "homepage")
    deleted = len(devices) - release["n"]
    assert 0 <= deleted <= 6
    vocabulary = shop_traffic.ROUTES
    estimate = dict(zip(release["bins"], release["values"], strict=True))
    for index, route in enumerate(vocabulary):
        # The kept crowd holds between truth - deleted and truth of each route; k-RR moves
        # more than 2 of the 24 reports with probability < 1e-7 (each by at most 1 count).
        assert truth[route] - deleted - 2.5 <= estimate[index] <= truth[route] + 2.5, (
            route,
            estimate,
        )
    assert max(estimate, key=lambda b: estimate[b]) == vocabulary.index("/items/{item_id}")
    # ... and it is what the dashboard shows: the channel's n and its bar chart.
    page = httpx.get(url + "/", timeout=30).text
    section = page[page.index('<section id="homepage">') :]
    section = section[: section.index("</section>")]
    assert f'<b class="n">{release["n"]:,}</b>' in section and "<svg" in section, section[:400]
    wait_until(lambda: _release(url, "features").get("n", 0) > 0, timeout=30)
    assert len(devices) - _release(url, "features")["n"] <= 6
