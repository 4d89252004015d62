"""The channels a shuffler serves while it runs: those of its own settings, plus those it adopts
from the analyzer's signed collection config (channels added or retired without a restart).

The analyzer's word is checked, not taken: the config must verify with the analyzer key this
shuffler pins and be no older than one adopted; a live channel's policy never changes (a
changed one is refused and the old one kept); a retirement is never undone; and a new channel
must meet this shuffler's own floor for randomized deletion (ESA-revisited Algorithm 3's
``min_crowd``, ``eps_cr``, ``delta_cr``), so an analyzer cannot switch deletion off. Runbook:
docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from common.collection import (
    ANALYZER_PARTY,
    CollectionConfigError,
    parse_key,
    verify_config_chain,
)
from common.envelope import public_bytes
from common.wire import ChannelPolicy, b64
from runtime.http import read_capped
from shuffler.settings import ShufflerSettings
from shuffler.store import ContributionStore

log = logging.getLogger("esa.shuffler")
#: Least seconds between two fetches woken by contributions for unknown channels.
WAKE_SPACING = 1.0
#: Largest config answer read (a config lists the shufflers' descriptors and the channels:
#: kilobytes; read before its signature can be checked).
MAX_CONFIG_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class PolicyFloor:
    """The weakest randomized deletion this shuffler applies to a channel it adopts."""

    min_crowd: int
    max_eps_cr: float
    max_delta_cr: float

    def refusal(self, policy: ChannelPolicy) -> str | None:
        """Why ``policy`` is below the floor (None: it is not)."""
        if policy.min_crowd < self.min_crowd:
            return f"min_crowd={policy.min_crowd} < this shuffler's floor {self.min_crowd}"
        if policy.eps_cr > self.max_eps_cr:
            return f"eps_cr={policy.eps_cr} > this shuffler's ceiling {self.max_eps_cr}"
        if policy.delta_cr > self.max_delta_cr:
            return f"delta_cr={policy.delta_cr} > this shuffler's ceiling {self.max_delta_cr}"
        return None


@dataclass(frozen=True)
class Adoption:
    """What one config changed: channels added, retired, and refused (id → why)."""

    added: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


class ChannelPolicies:
    """The policies intake and batching read, replaced whole on a change (readers never see a
    half-applied one)."""

    def __init__(self, configured: Iterable[ChannelPolicy], floor: PolicyFloor) -> None:
        self._items = {policy.id: policy for policy in configured}
        self.floor = floor
        self.revision = 0
        self._lock = threading.Lock()

    def get(self, channel_id: str) -> ChannelPolicy | None:
        """The policy of ``channel_id``, if served."""
        return self._items.get(channel_id)

    def all(self) -> list[ChannelPolicy]:
        """Every served channel (retired ones too)."""
        return list(self._items.values())

    def adopt(
        self, channels: Sequence[ChannelPolicy], revision: int
    ) -> tuple[Adoption, list[ChannelPolicy]]:
        """Fold in a verified config's channels at ``revision``: (what changed, the policies
        to persist). A revision older than the one adopted changes nothing."""
        with self._lock:
            if revision < self.revision:
                return Adoption(), []
            items, adoption, persist = dict(self._items), Adoption(), []
            for policy in channels:
                outcome = self._fold(items.get(policy.id), policy)
                if outcome is None:
                    continue
                kind, value = outcome
                if isinstance(value, str):
                    adoption.refused[policy.id] = value
                    continue
                items[policy.id] = value
                persist.append(value)
                (adoption.added if kind == "added" else adoption.retired).append(policy.id)
            self._items, self.revision = items, revision
        return adoption, persist

    def _fold(
        self, known: ChannelPolicy | None, offered: ChannelPolicy
    ) -> tuple[str, ChannelPolicy | str] | None:
        if known is None:  # retired already: still served for the epochs before
            why = self.floor.refusal(offered)
            return ("refused", why) if why else ("added", offered)
        changed = known.changed_fields(offered)
        if changed:
            return "refused", f"a live channel's {', '.join(changed)} changed (kept as it was)"
        if known.retired_from_epoch is None and offered.retired_from_epoch is not None:
            return "retired", known.model_copy(
                update={"retired_from_epoch": offered.retired_from_epoch}
            )
        return None


class ConfigFollower:
    """Fetches the analyzer's signed config and adopts its channel changes: every
    ``config_refresh_seconds``, and at once (at most every :data:`WAKE_SPACING` s) when a
    contribution names a channel not served yet."""

    def __init__(
        self,
        settings: ShufflerSettings,
        policies: ChannelPolicies,
        store: ContributionStore,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.policies = policies
        self.store = store
        self.clock = clock
        self._refused: dict[str, str] = {}
        self._refused_config = ""
        #: The analyzer key this follower moved to along the successions it verified.
        self._pin: Ed25519PublicKey | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last = 0.0

    def load(self) -> None:
        """Adopt what was adopted before a restart (or by another replica)."""
        stored, revision = self.store.followed()
        self.policies.adopt(stored, revision)
        pinned = self.store.followed_key(ANALYZER_PARTY)
        if pinned is not None:
            self._pin = parse_key(pinned, "followed analyzer")

    def analyzer_key(self) -> Ed25519PublicKey | None:
        """The pinned config-signing key (None: its published file is not there yet)."""
        path = self.settings.analyzer_key_file
        if path is not None and not path.exists():
            return None
        text = path.read_text() if path is not None else self.settings.analyzer_key
        return parse_key(text, "analyzer config-signing")

    def fetch(self, http: httpx.Client) -> Adoption | None:
        """One fetch: verify, adopt, persist; None when nothing could be read or verified.

        Raises:
            CollectionConfigError: the config is not a signed JSON object of at most
                :data:`MAX_CONFIG_BYTES`, does not verify, expired, or is at an older revision
                than one adopted (revisions replace issue times here: a replayed config of the
                same revision carries the same channels, and a config issued in the future
                cannot lock the follower out of the ones after it).
        """
        key = self._pin or self.analyzer_key()
        if key is None or self.settings.analyzer_url is None:
            return None
        document = _read_config(http, self.settings.analyzer_url.rstrip("/") + "/v1/config")
        if document is None:
            return None
        now = self.clock()
        vouched = verify_config_chain(document, key, now)
        config = vouched.value
        if config.revision < self.policies.revision:
            raise CollectionConfigError(
                f"collection config at revision {config.revision} is older than the revision "
                f"adopted ({self.policies.revision}): the analyzer's channel log went back "
                "(a restored or replaced database?)"
            )
        signer = vouched.lineage[-1]
        if self._pin is None or public_bytes(signer) != public_bytes(self._pin):
            self.store.follow_key(ANALYZER_PARTY, b64(public_bytes(signer)))
            self._pin = signer  # a fork made later from an older key is refused
        offered = [channel.policy() for channel in config.channels]
        adoption, persist = self.policies.adopt(offered, config.revision)
        if persist:
            self.store.follow(persist, config.revision)
        self._report(adoption, config.revision)
        self._refused_config = ""
        return adoption

    def _report(self, adoption: Adoption, revision: int) -> None:
        for name in ("added", "retired"):
            for channel in getattr(adoption, name):
                log.info(f"channel {name}", extra={"channel": channel, "revision": revision})
        fresh = {k: v for k, v in adoption.refused.items() if self._refused.get(k) != v}
        for channel, why in fresh.items():
            log.error(
                "channel in the analyzer's config refused",
                extra={"channel": channel, "reason": why, "revision": revision},
            )
        self._refused = dict(adoption.refused)

    def _refusal(self, why: str) -> None:
        """Log why a config was not adopted, once until the reason changes."""
        if why != self._refused_config:
            log.warning("analyzer config not adopted", extra={"error": why})
            self._refused_config = why

    def wake(self) -> None:
        """Fetch soon: a contribution named a channel not served (yet)."""
        if self.clock() - self._last >= WAKE_SPACING:
            self._wake.set()

    def run(self, http: httpx.Client) -> None:
        """Fetch until :meth:`stop` (a failed fetch is logged and tried again next time)."""
        while not self._stop.is_set():
            self._last = self.clock()
            try:
                self.fetch(http)
            except (httpx.HTTPError, ValueError) as error:
                self._refusal(f"{type(error).__name__}: {error}"[:300])
            except Exception:  # the follower must outlive any one answer
                log.exception("analyzer config not adopted; fetched again next time")
            self._wake.wait(self.settings.config_refresh_seconds)
            self._wake.clear()

    def stop(self) -> None:
        """End :meth:`run`."""
        self._stop.set()
        self._wake.set()


def _read_config(http: httpx.Client, url: str) -> dict[str, Any] | None:
    """The analyzer's signed config document (None: it answered no 200), read up to
    :data:`MAX_CONFIG_BYTES` (an answer is read before its signature can be checked).

    Raises:
        CollectionConfigError: larger, or not a JSON object.
    """
    with http.stream("GET", url) as response:
        if response.status_code != 200:
            return None
        body = read_capped(response, MAX_CONFIG_BYTES)
    if body is None:
        raise CollectionConfigError(f"the config answer is over {MAX_CONFIG_BYTES} bytes")
    try:
        document = json.loads(body)
    except ValueError as error:
        raise CollectionConfigError(f"the config answer is not JSON: {error}") from error
    if not isinstance(document, dict):
        raise CollectionConfigError(f"the config answer is a JSON {type(document).__name__}")
    return document
