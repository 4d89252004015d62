"""The deployment as a simulated device sees it: the verified collection config and one
channel of it; the load generator's error."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import httpx

from common.collection import TrustAnchors, VerifiedConfig, verify_collection
from common.mechanisms import ValueKind
from common.mechanisms import get as get_mechanism
from common.wire import ChannelConfig

INGEST = "/v1/contributions"
ENROLL = "/v1/enroll"
#: One request record in an epoch file: shuffler index, token length, body length.
RECORD = struct.Struct(">BHI")
#: Attempts of a request of no known epoch (a broken connection, or a refusal that can heal
#: by waiting) before it counts as given up; one of a known epoch is tried until it ends.
ATTEMPTS = 5


class LoadError(RuntimeError):
    """The load cannot be prepared (config refused, enrolment failed, worker died)."""


# --- the deployment as a device sees it ----------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One channel of a deployment: its verified config and where its shufflers are."""

    config: VerifiedConfig
    channel: ChannelConfig

    @property
    def shuffler_urls(self) -> list[str]:
        """Every shuffler's base URL, in the config's order (a record's shuffler index)."""
        return [s.url for s in self.config.shufflers]

    def epoch(self, now: float) -> int:
        """The channel's epoch at unix time ``now``."""
        return int(now // self.channel.epoch_seconds)


def fetch_config(analyzer_url: str, trust: TrustAnchors) -> VerifiedConfig:
    """Fetch ``/v1/config`` and verify it against the pinned keys, as the SDK does.

    Raises:
        LoadError: unreachable, mis-signed, expired config, or a shuffler not vouched for.
    """
    try:
        document = httpx.get(analyzer_url + "/v1/config", timeout=30).raise_for_status().json()
        return verify_collection(document, trust, time.time())
    except (httpx.HTTPError, ValueError) as error:
        raise LoadError(f"collection config refused: {error}") from error


def fetch_target(analyzer_url: str, trust: TrustAnchors, channel_id: str) -> Target:
    """The verified config (:func:`fetch_config`) and one of its channels.

    Raises:
        LoadError: unreachable, mis-signed or expired config, or no such channel.
    """
    config = fetch_config(analyzer_url, trust)
    channel = next((c for c in config.channels if c.id == channel_id), None)
    if channel is None:
        raise LoadError(f"channel {channel_id!r} is not in the collection config")
    if get_mechanism(channel.mechanism).value_kind is not ValueKind.CATEGORY:
        raise LoadError(f"channel {channel_id!r} does not take category values")
    return Target(config, channel)
