"""The example page (docs/examples/web/) in a real browser against a real deployment.

``esa up`` (launcher-started, its own var folder, free ports, its parties' own tokens, CORS
granting the page's origin) and the page served over HTTP on 127.0.0.1 with the bundle
``make sdk-js`` builds and the deployment's trust file; headless Chromium (the system's, driven
by playwright-core from sdk-js/scripts/browser.mjs) loads it in a few tabs, which run 300
devices through the page's own runDevice(), each with its own IndexedDB database. Every device
reports on a k-RAPPOR channel, a report-fragments channel and a longitudinal one; the epochs
close with each party's admin token from the key folder; every acknowledged contribution is
received, deleted or held (conservation) and the releases estimate the population's truth ×
kept within their 95% intervals (the load test's check: services/tools/loadtest/verify.py,
whose count of intervals fails a correct deployment with probability under 1e-6). A config in
which the analyzer substituted a shuffler's key, and the page served from an origin no party
allows, reach nobody: the page shows the SDK's ConfigError and the shufflers take nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.metrics import CHANNEL_CONTRIBUTIONS
from common.collection import TrustAnchors, canonical, verify_collection
from common.envelope import key_id, load_or_create_ed25519, public_bytes
from common.wire import MAX_EPOCH_SECONDS, ChannelConfig, b64
from services.tools.catalogue import DEFAULT_CHANNELS
from services.tools.credentials import Credentials
from services.tools.loadgen.target import Target
from services.tools.loadtest import verify
from services.tools.loadtest.population import Population, draw, draw_changes

from ..support import (
    SDK_JS,
    Deployment,
    built_sdk_js,
    close_epoch,
    example_page,
    free_port,
    start_deployment,
    wait_until,
)

BROWSER = SDK_JS / "scripts" / "browser.mjs"
DEVICES = 300
#: Tabs running devices at once (each tab loads the page once, then runs its devices through
#: the page's runDevice() one after the other: a navigation costs Chromium more than a device).
TABS = 6


def _channel(channel_id: str, **changes: Any) -> ChannelConfig:
    """The default catalogue's channel (what the page reports on under ``esa up``) in epochs of
    10^8 s (no test straddles a boundary), with crowds of 10 and delta_cr 1e-7 (a shuffler's
    floors allow both), so every shuffler releases its batch.

    The test waits for a release from all 9 groups (3 channels x 3 shufflers). A homepage or
    abroad group is Binomial(300, 1/3) ~100 devices, less ln(2/delta_cr) x 2/eps_cr (29 at
    1e-6, 34 at 1e-7) + Laplace(2); a homepage batch must carry the fragments that verify
    min_crowd at alpha 1e-9 (240 for 20, 133 for 10; 8.4 a contribution); an rfrag group
    has all 300. With min_crowd 20 and delta_cr 1e-6 some group was aborted (delta_cr/4 each)
    or held in 6.4e-6 of runs; now in 2.9e-7 (sum over the binomial split, the Laplace draw
    and the exact fragment-count laws)."""
    found = next(c for c in DEFAULT_CHANNELS if c.id == channel_id)
    update = {"epoch_seconds": MAX_EPOCH_SECONDS, "min_crowd": 10, "delta_cr": 1e-7, **changes}
    return ChannelConfig.model_validate(found.model_dump() | update)


#: The page's channels: ``abroad`` over one period (the page reports period 1).
CHANNELS = [
    _channel("homepage"),
    _channel("homepage-fragments"),
    _channel("abroad", params={"d": 1, "k": 1, "eps": 4.0}),
]


@pytest.fixture(scope="module")
def chromium_node() -> str:
    """Node with the SDK built and installed (playwright-core included), and a Chromium
    (browser.mjs looks for the same: ``ESA_CHROMIUM``, else one on PATH); without one the
    tests skip, or fail under CI=true (.ci/run installs Debian's)."""
    node = built_sdk_js()
    names = ("chromium", "chromium-browser", "google-chrome")
    if not os.environ.get("ESA_CHROMIUM") and not any(shutil.which(n) for n in names):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("no chromium on PATH: apt-get install chromium (.ci/run installs it)")
        pytest.skip("no chromium on PATH")
    return node


@pytest.fixture(scope="module")
def page_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, page_port: int) -> Iterator[Deployment]:
    origin = f"http://127.0.0.1:{page_port}"
    cors = {"ESA_ANALYZER_CORS_ORIGINS": origin, "ESA_SHUFFLER_CORS_ORIGINS": origin}
    var = tmp_path_factory.mktemp("var")
    running = start_deployment(var, CHANNELS, env=cors, own_tokens=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def page(
    tmp_path_factory: pytest.TempPathFactory,
    chromium_node: str,
    deployment: Deployment,
    page_port: int,
) -> Iterator[str]:
    """The page's URL: its files, the bundle and the trust file served from one folder, as
    docs/sdk-js.md says to serve them, plus ``forged.json`` (:func:`_forged_config`)."""
    site = tmp_path_factory.mktemp("site")
    (site / "forged.json").write_text(json.dumps(_forged_config(deployment)))
    with example_page(site, deployment.trust_file, page_port) as url:
        yield url


def _forged_config(deployment: Deployment) -> dict[str, Any]:
    """The deployment's config with shuffler-1's HPKE key replaced by one the analyzer holds,
    signed again with the analyzer's own signing key: its signature holds, shuffler-1's does
    not (tests/client/test_trust.py, the same substitution in Python)."""
    url = deployment.analyzer.url + "/v1/config"
    document: dict[str, Any] = httpx.get(url, timeout=10).raise_for_status().json()
    own = X25519PrivateKey.generate().public_key()
    body = document["config"]
    listed = next(s for s in body["shufflers"] if s["descriptor"]["id"] == "shuffler-1")
    listed["descriptor"]["keys"] = [
        {"key_id": key_id(own).hex(), "public_key": b64(public_bytes(own))}
    ]
    signer = load_or_create_ed25519(deployment.var / "keys" / "analyzer" / "signing.pem")
    return {**document, "signature": b64(signer.sign(canonical(body)))}


def _browser(node: str, request: dict[str, Any]) -> dict[str, Any]:
    """sdk-js/scripts/browser.mjs with ``request`` (its modes: the script's header)."""
    done = subprocess.run(
        [node, str(BROWSER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _visit(node: str, page: str, query: str) -> dict[str, Any]:
    """One visit of the page with ``query``: its state, result, error and log as shown."""
    (shown,) = _browser(node, {"mode": "visits", "page": page, "queries": [query]})["visits"]
    assert isinstance(shown, dict)
    return shown


def _credentials(deployment: Deployment) -> Credentials:
    """Each party's own admin and metrics token, from the deployment's key folder."""
    parties = {"analyzer": deployment.analyzer.url}
    parties |= {s.spec.name: s.url for s in deployment.shufflers}
    return Credentials.from_keys(deployment.var / "keys", parties)


def _population() -> tuple[Population, Population]:
    """The devices' pages (Zipf over the homepage channel's k) and whether each one's state
    changed in period 1 (about half did), fixed by their seeds."""
    homepage, abroad = CHANNELS[0], CHANNELS[2]
    pages = draw("zipf", homepage, int(homepage.params["k"]), DEVICES, seed=48)
    changes = draw_changes("changes:0.5", abroad.id, 1, 1, DEVICES, seed=49)
    return pages, changes


def _devices(config_url: str, pages: Population, changes: Population) -> list[dict[str, Any]]:
    """Each device as the page's runDevice() takes it: its own database, its page, whether
    its state changed in period 1."""
    changed = [bool(periods) for periods in changes.change_periods()]
    return [
        {
            "configUrl": config_url,
            "trustUrl": "trust.json",
            "database": f"device-{i}",
            "homepage": int(value),
            "abroad": changed[i],
        }
        for i, value in enumerate(pages.values)
    ]


def _released(deployment: Deployment, credentials: Credentials, epoch: int) -> dict[str, Any]:
    """Close every channel's epoch at every shuffler (each with its own admin token), wait
    until the analyzer opened everything, close at the analyzer (groups held below their crowd
    send nothing) and return each channel's release."""
    for channel in CHANNELS:
        close_epoch(deployment, channel.id, epoch)
    urls = [s.url for s in deployment.shufflers]
    verify.drain(deployment.analyzer.url, urls, credentials, timeout=60)
    verify.close_at_analyzer(
        deployment.analyzer.url, credentials, {c.id: [epoch] for c in CHANNELS}
    )
    found: dict[str, Any] = {}

    def released() -> bool:
        for channel in CHANNELS:
            k = int(channel.params.get("k", channel.params.get("d", 1)))
            found[channel.id] = verify.release(deployment.analyzer.url, channel.id, [epoch], k)
        return all(found.values())

    wait_until(released, timeout=60, interval=0.5)
    return found


def _received(analyzer: str, credentials: Credentials, epoch: int) -> dict[str, int]:
    """Contributions the analyzer received in ``epoch``, by channel: the crowds the shufflers'
    batches claim (``esa_analyzer_channel_contributions``, stage ``received``)."""
    metrics = verify.scrape(analyzer, credentials)
    return {
        c.id: int(
            metrics.get(
                f'{CHANNEL_CONTRIBUTIONS}{{channel="{c.id}",epoch="{epoch}",stage="received"}}', 0
            )
        )
        for c in CHANNELS
    }


def test_300_browser_devices_report_and_the_release_estimates_their_truth(
    deployment: Deployment, page: str, chromium_node: str
) -> None:
    credentials, urls = _credentials(deployment), [s.url for s in deployment.shufflers]
    analyzer = deployment.analyzer.url
    pages, changes = _population()
    before = verify.shuffler_state(urls, credentials)
    opened = verify.analyzer_fragments(analyzer, credentials, "abroad")
    devices = _devices(analyzer + "/v1/config", pages, changes)
    request = {"mode": "devices", "page": page, "devices": devices, "tabs": TABS}
    ran = _browser(chromium_node, request)["devices"]
    failed = [d for d in ran if d["state"] != "done" or d["result"]["outcomes"] != ["ok"] * 3]
    assert not failed, failed[:3]
    assert len({d["result"]["deviceId"] for d in ran}) == DEVICES  # one storage each
    assert sum(d["result"]["left"] for d in ran) == 0
    acknowledged = sum(d["result"]["delivered"] for d in ran)

    epoch = int(time.time() // MAX_EPOCH_SECONDS)
    releases = _released(deployment, credentials, epoch)
    series = verify.analyzer_fragments(analyzer, credentials, "abroad")
    assert series["invalid"] == opened["invalid"]
    received = _received(analyzer, credentials, epoch)
    after = verify.shuffler_state(urls, credentials)
    check = verify.conservation(before, after, acknowledged, sum(received.values()))
    assert verify.conservation_problems(check) == [], check
    assert check["held"] == 0 and check["pending"] == 0, check

    document = httpx.get(analyzer + "/v1/config", timeout=10).json()
    config = verify_collection(document, TrustAnchors.load(deployment.trust_file), time.time())
    rows: dict[str, Any] = {}
    for channel, population in zip(CHANNELS, (pages, pages, changes), strict=True):
        found = releases[channel.id]
        assert found["crowd_check"]["invalid_fragments"] == 0, found["crowd_check"]
        # what the estimate scales with: a histogram's n (devices whose report was kept; an
        # rfrag device's τ rows go to different shufflers), abroad's contributions (one each)
        got = received[channel.id] if channel.id == "abroad" else found["n"]
        target = Target(config=config, channel=channel)
        checked = verify.check_estimates(target, population, found, got / DEVICES)
        rows[channel.id] = {"received": got, "acknowledged": DEVICES}
        rows[channel.id] |= {"checked": checked, "inside": verify.count_inside(checked)}
    assert verify.channel_problems(rows) == [], rows


def test_a_config_with_a_substituted_shuffler_key_reports_nothing_and_the_page_says_why(
    deployment: Deployment, page: str, chromium_node: str
) -> None:
    credentials, urls = _credentials(deployment), [s.url for s in deployment.shufflers]
    before = verify.shuffler_state(urls, credentials)
    base = page.rsplit("/", 1)[0]
    shown = _visit(chromium_node, page, f"config={base}/forged.json&db=forged&homepage=3")
    assert shown["state"] == "failed" and shown["result"] is None, shown
    assert shown["error"].startswith("ConfigError: "), shown
    assert "shuffler-1" in shown["error"] and "pinned" in shown["error"], shown
    after = verify.shuffler_state(urls, credentials)
    assert all(after[u]["received"] == before[u]["received"] for u in urls), (before, after)


def test_a_page_from_an_origin_no_party_allows_gets_no_config_and_says_so(
    deployment: Deployment, chromium_node: str, tmp_path: Path
) -> None:
    """The same page from another port of 127.0.0.1 (another origin, not in any party's
    cors_origins): the browser withholds the analyzer's answer, the page shows a ConfigError
    and no shuffler hears from it (docs/sdk-js.md, "The example page")."""
    credentials, urls = _credentials(deployment), [s.url for s in deployment.shufflers]
    before = verify.shuffler_state(urls, credentials)
    config = deployment.analyzer.url + "/v1/config"
    with example_page(tmp_path / "site", deployment.trust_file) as elsewhere:
        shown = _visit(chromium_node, elsewhere, f"config={config}&db=elsewhere")
    assert shown["state"] == "failed" and shown["error"].startswith("ConfigError: "), shown
    after = verify.shuffler_state(urls, credentials)
    assert all(after[u]["received"] == before[u]["received"] for u in urls), (before, after)
