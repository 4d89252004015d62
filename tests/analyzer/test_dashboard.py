"""The dashboard: images drawn from stored summaries, and the page in headless Chromium (loads,
no console errors, shows the channels' numbers)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from analyzer.channels import ChannelRuntime
from analyzer.dashboard import ChannelView, image_png, page, png_gray
from analyzer.ledger import LedgerService
from common.envelope import (
    FragmentContext,
    load_or_create_ed25519,
    load_or_create_x25519,
    seal_fragment,
    sign,
)
from common.mechanisms import SeededSource, krappor, longitudinal
from common.preauth import PREAUTH_HEADER, preauth_header
from common.wire import Batch, ChannelConfig, DeviceBudget, b64

from ..support import analyzer_process, wait_until
from .helpers import Signed, build, counter, seal, seeded_entry, signed

CHANNELS = [
    ChannelConfig(
        id="homepage",
        mechanism="krappor",
        params={"k": 12, "eps": 4.0},
        min_crowd=20,
        max_fragments=12,
        payload_size=16,
    ),
    ChannelConfig(
        id="picture",
        mechanism="krappor",
        params={"k": 48, "eps": 6.0},
        min_crowd=20,
        max_fragments=48,
        payload_size=16,
        display="image",
        image_shape=(6, 8),
    ),
    ChannelConfig(
        id="abroad",
        mechanism="longitudinal",
        params={"d": 8, "k": 1, "eps": 4.0},
        min_crowd=20,
        max_fragments=1,
        payload_size=16,
        display="series",
    ),
]


def test_an_image_release_is_drawn_from_its_stored_summary() -> None:
    """Image channels store every bin, so the PNG is the full reconstruction."""
    picture = CHANNELS[1]
    layers = build("sqlite://", [picture])
    params = krappor.KRapporParams(**picture.params)
    rng = SeededSource(4)
    values = np.random.default_rng(5).integers(0, params.k, size=200)
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=picture.id,
        crowd_id="",
        epoch=3,
        n_contributions=values.size,
        fragments=seal(
            [f for v in values for f in krappor.KRappor().encode_value(params, int(v), rng)],
            picture,
            3,
        ),
    )
    layers.deliver(*signed(batch))
    release = layers.releases.publish(picture.id, 3, 3)
    summary = layers.store.latest_summary(picture.id)
    assert summary is not None and summary.bins == list(range(params.k))
    assert image_png(picture, summary) == png_gray(release.estimate.values, (6, 8))
    assert image_png(CHANNELS[0], summary) is None
    view = ChannelView(picture, summary, layers.ledger.ledger(picture.id))
    shown = page([view])
    assert "data:image/png;base64," in shown and 'class="lifetime-eps"' in shown


def test_the_ledger_shows_pairs_lifetimes_and_the_device_budget_in_use() -> None:
    """Per channel: how each epoch entered the lifetime, the lifetime ε (PLD) beside basic
    composition, the add/remove lifetime and the device budget against a device's spend."""
    budget = DeviceBudget(lifetime_eps=20.0, window_eps=10.0, window_seconds=7200)
    homepage = CHANNELS[0].model_copy(update={"budget": budget})
    layers = build("sqlite://", [homepage])
    runtimes = {homepage.id: ChannelRuntime.build(homepage, ["shuffler-1"])}
    ledger = LedgerService(layers.store, runtimes, device_budget=DeviceBudget(lifetime_eps=7.0))
    params = krappor.KRapporParams(**homepage.params)
    values = np.random.default_rng(6).integers(0, params.k, size=120)
    for epoch in (4, 5, 6):
        rng = SeededSource(epoch)
        fragments = seal(
            [f for v in values for f in krappor.KRappor().encode_value(params, int(v), rng)],
            homepage,
            epoch,
        )
        batch = Batch(
            batch_id=secrets.token_hex(16),
            shuffler_id="shuffler-1",
            channel_id=homepage.id,
            crowd_id="",
            epoch=epoch,
            n_contributions=values.size,
            fragments=fragments,
        )
        layers.deliver(*signed(batch))
    summary = layers.releases.release(homepage.id, 6, 6).to_wire(50)
    shown = page([ChannelView(homepage, summary, ledger.ledger(homepage.id))])
    assert shown.count('<td class="composed-as">pair</td>') == 3
    assert 'class="lifetime-eps"' in shown and 'class="lifetime-deletion-eps"' in shown
    assert "3 of 3 parts dominating pairs" in shown and "6 of 9 parts" in shown  # deletion
    # A device in all three epochs: 3 × 8 (replacement ε of k-RAPPOR at ε = 4) = 24.
    assert '<b class="budget-spent">24</b>' in shown
    limits = shown.split('class="device-budget"')[1]
    assert "this channel, lifetime: ε ≤ 20; spent 24, left 0" in limits
    assert "any 7,200 s window (most in one): ε ≤ 10; spent 16, left 0" in limits
    assert "the device (all channels), lifetime: ε ≤ 7; spent 24" in limits
    assert limits.count('class="exhausted"') == 3


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium is required under CI=true (.ci/run installs it)")
        pytest.skip("chromium not installed")
    return path


def _post(
    url: str,
    key: Ed25519PrivateKey,
    channel: ChannelConfig,
    epoch: int,
    fragments: list[bytes],
    n: int,
) -> None:
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=channel.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=n,
        fragments=[b64(f) for f in fragments],
    )
    body = batch.body()
    part = Signed(body, b64(sign(body, key)), "shuffler-1")
    headers = {**part.headers, PREAUTH_HEADER: preauth_header("shuffler-1", body, key, time.time())}
    response = httpx.post(url + "/v1/batches", content=body, headers=headers, timeout=30)
    assert response.status_code == 201, response.text


def _send(url: str, signer: Ed25519PrivateKey, analyzer: X25519PublicKey) -> None:
    """Two k-RAPPOR channels at epoch 3 and a longitudinal channel over epochs 1–8."""
    rng = SeededSource(1)
    for channel in CHANNELS[:2]:
        params = krappor.KRapporParams(**channel.params)
        values = np.random.default_rng(2).integers(0, params.k, size=300)
        context = FragmentContext(channel.id, 3, "")
        frags = [
            seal_fragment(f, context, 16, analyzer)
            for v in values
            for f in krappor.KRappor().encode_value(params, int(v), rng)
        ]
        _post(url, signer, channel, 3, frags, values.size)
    l_params = longitudinal.LongitudinalParams(**CHANNELS[2].params)
    states = [longitudinal.setup(l_params, rng) for _ in range(400)]
    for t in range(1, 9):
        reports = []
        context = FragmentContext("abroad", t, "")
        for i, state in enumerate(states):
            states[i], report = longitudinal.update(
                state, t, 1 if (t == 3 and i % 2) else 0, l_params, rng
            )
            if report is not None:
                reports.append(seal_fragment(report, context, 16, analyzer))
        # a contribution is one report: only the devices whose level reports in period t
        assert len(reports) >= CHANNELS[2].min_crowd
        _post(url, signer, CHANNELS[2], t, reports, len(reports))


def _publish(url: str) -> dict[str, Any]:
    """Publish one release per channel (admin token of a development analyzer)."""
    releases = {}
    for name, query in (
        ("homepage", {"epoch": 3}),
        ("picture", {"epoch": 3}),
        ("abroad", {"epoch_from": 1, "epoch_to": 8}),
    ):
        response = httpx.post(
            f"{url}/v1/channels/{name}/releases",
            json=query,
            headers={"Authorization": "Bearer development"},
        )
        assert response.status_code == 201, response.text
        releases[name] = response.json()
    return releases


@pytest.mark.system
def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    browser = _chromium()
    keys = tmp_path / "shuffler-1"
    signer = load_or_create_ed25519(keys / "signing.pem")
    registry = [seeded_entry("shuffler-1", signer)]
    analyzer_keys = tmp_path / "analyzer" / "keys"
    analyzer_key = load_or_create_x25519(analyzer_keys / "hpke.pem")
    service = analyzer_process(tmp_path, [c.model_dump() for c in CHANNELS], registry).start()
    try:
        _send(service.url, signer, analyzer_key.public_key())
        wait_until(lambda: counter(service.url, "parts_opened") == 10, timeout=60)
        releases = _publish(service.url)
        profile = tmp_path / "chromium-profile"
        screenshot = tmp_path / "dashboard.png"
        flags = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
        ]
        dom = subprocess.run(
            [*flags, "--dump-dom", service.url + "/"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        subprocess.run(
            [*flags, f"--screenshot={screenshot}", "--window-size=1200,2400", service.url + "/"],
            capture_output=True,
            timeout=120,
            check=True,
        )
    finally:
        service.stop()
    shown = dom.stdout
    for name, release in releases.items():
        assert f'id="{name}"' in shown
        assert f"{release['certificate']['eps']:.4g}" in shown
        assert f"{release['n']:,}" in shown
    assert "data:image/png;base64," in shown and "<polyline" in shown and "<rect" in shown
    assert shown.count('class="lifetime-eps"') == len(releases)
    console_errors = [
        line
        for line in dom.stderr.splitlines()
        if "CONSOLE" in line and ("error" in line.lower() or "uncaught" in line.lower())
    ]
    assert console_errors == []
    assert screenshot.stat().st_size > 10_000
