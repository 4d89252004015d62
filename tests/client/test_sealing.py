"""The one sealing path of the SDK and the device-playing tools: real HPKE both ways."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.envelope import (
    EnvelopeError,
    FragmentContext,
    KeyRing,
    open_contribution,
    open_fragment,
)
from common.wire import ChannelConfig
from encoder_client.sealing import seal_report, shuffler_slot

CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 8, "eps": 2.0},
    epoch_seconds=60,
    min_crowd=10,
    max_fragments=8,
    payload_size=8,
    crowds=("", "eu"),
)


def test_a_sealed_report_opens_at_its_shuffler_and_its_fragments_at_the_analyzer() -> None:
    analyzer, shuffler = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    fragments = [b"\x01\x05\x00\x00\x00\x03", b"\x01\x05\x00\x00\x00\x07"]
    body = seal_report(
        CHANNEL,
        crowd="eu",
        epoch=42,
        fragments=fragments,
        analyzer_key=analyzer.public_key(),
        shuffler=("shuffler-2", shuffler.public_key()),
    )
    contribution = open_contribution(body, "shuffler-2", KeyRing.of(shuffler))
    assert (contribution.channel_id, contribution.crowd_id, contribution.epoch) == (
        "homepage",
        "eu",
        42,
    )
    context = FragmentContext("homepage", 42, "eu")
    opened = [open_fragment(f, context, KeyRing.of(analyzer)) for f in contribution.fragments]
    assert opened == fragments
    with pytest.raises(EnvelopeError):  # bound to its shuffler: another id does not open it
        open_contribution(body, "shuffler-1", KeyRing.of(shuffler))
    with pytest.raises(EnvelopeError):  # bound to its (channel, epoch, crowd)
        open_fragment(contribution.fragments[0], FragmentContext("homepage", 43, "eu"),
                      KeyRing.of(analyzer))  # fmt: skip
    again = open_contribution(
        seal_report(
            CHANNEL,
            crowd="eu",
            epoch=42,
            fragments=fragments,
            analyzer_key=analyzer.public_key(),
            shuffler=("shuffler-2", shuffler.public_key()),
        ),
        "shuffler-2",
        KeyRing.of(shuffler),
    )
    assert again.nonce != contribution.nonce  # a fresh nonce per contribution


def test_routes_follow_the_slot_or_the_weights() -> None:
    assert [shuffler_slot(s, 3) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert {shuffler_slot(None, 3, [0.0, 2.5, 0.0]) for _ in range(200)} == {1}
    assert {shuffler_slot(None, 3) for _ in range(400)} == {0, 1, 2}  # misses one: 3·(2/3)^400
    assert {shuffler_slot(None, 2, [0.0, 0.0]) for _ in range(400)} == {0, 1}
