"""The channels a shuffler serves while it runs: those of its own settings, plus those it adopts
from the analyzer's signed collection config (channels added or retired without a restart).

The analyzer's word is checked, not taken: the config must verify with the analyzer key this
shuffler pins and be no older than one adopted; no privacy term of a live channel is relaxed
(its policy, mechanism, parameters, δ, device budgets: :class:`common.terms.ChannelTerms`): a
change that relaxes nothing is pinned, one that relaxes a term (or cannot be ordered, or is over
this shuffler's ceilings) suspends the channel for good, with the pinned terms kept; a
retirement is always taken and never undone; and a new channel
must meet this shuffler's own floor: randomized deletion (ESA-revisited Algorithm 3's
``min_crowd``, ``eps_cr``, ``delta_cr``), so an analyzer cannot switch deletion off, and a
ceiling on its local ε and δ. Runbook: docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from common.fetching import MAX_CONFIG_BYTES, FetchTooLargeError, deadline_client, fetch_within
from common.mechanisms import BatchContext
from common.terms import ChannelTerms, relaxations
from common.wire import (
    ChannelConfig,
    ChannelPolicy,
    CollectionConfig,
    DeviceBudget,
    HpkeKey,
    b64,
)
from shuffler.settings import ShufflerSettings
from shuffler.store import ContributionStore

log = logging.getLogger("esa.shuffler")
#: Least seconds between two fetches woken by contributions for unknown channels.
WAKE_SPACING = 1.0


@dataclass(frozen=True, kw_only=True)
class PolicyFloor:
    """The weakest randomized deletion this shuffler applies to a channel it adopts, and the
    largest local ε (replacement notion) and δ it serves a channel with (a mechanism that
    gives no local privacy by design only when ``without_local_privacy``)."""

    min_crowd: int
    max_eps_cr: float
    max_delta_cr: float
    max_local_eps: float = 12.0
    max_delta: float = 1e-5
    without_local_privacy: bool = True

    def refusal(self, policy: ChannelPolicy) -> str | None:
        """Why ``policy`` is below the floor (None: it is not)."""
        if policy.min_crowd < self.min_crowd:
            return f"min_crowd={policy.min_crowd} < this shuffler's floor {self.min_crowd}"
        if policy.eps_cr > self.max_eps_cr:
            return f"eps_cr={policy.eps_cr} > this shuffler's ceiling {self.max_eps_cr}"
        if policy.delta_cr > self.max_delta_cr:
            return f"delta_cr={policy.delta_cr} > this shuffler's ceiling {self.max_delta_cr}"
        return None

    def terms_refusal(self, terms: ChannelTerms) -> str | None:
        """Why the channel's δ or its mechanism's local ε is above the ceiling (None: not).
        Only a mechanism that declares it gives no local privacy
        (:attr:`common.mechanisms.Mechanism.shuffle_only`) escapes the ε ceiling: parameters
        whose ε overflows to infinity are above it like any other."""
        if terms.delta > self.max_delta:
            return f"delta={terms.delta} > this shuffler's ceiling {self.max_delta}"
        if terms.shuffle_only():
            if self.without_local_privacy:
                return None  # privacy from the shuffle alone, which the operator allows
            return f"local ε=inf ({terms.mechanism} gives no local privacy): not adopted here"
        local = terms.local_privacy()
        if local is None:
            return f"{terms.mechanism} with these params: its local ε cannot be computed here"
        if not local.replacement <= self.max_local_eps:
            return (
                f"local ε={local.replacement:g} ({terms.mechanism}, replacement) > this "
                f"shuffler's ceiling {self.max_local_eps:g}"
            )
        return None


@dataclass(frozen=True)
class Adoption:
    """What one config changed: channels added, retired, whose privacy terms were pinned
    (first seen in a config, or changed in a way that relaxes nothing), suspended (id → why:
    the config relaxes their pinned terms or puts them over this shuffler's ceilings), and
    refused (id → why)."""

    added: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    pinned: list[str] = field(default_factory=list)
    suspended: dict[str, str] = field(default_factory=dict)


def _split(item: ChannelPolicy, device_budget: DeviceBudget | None) -> ChannelTerms | None:
    """The privacy terms an offered channel states (None: a bare policy states none)."""
    if isinstance(item, ChannelTerms):
        return item
    if isinstance(item, ChannelConfig):
        return ChannelTerms.of(item, device_budget)
    return None


def _as_terms(policy: ChannelPolicy, stated: ChannelTerms) -> ChannelTerms:
    """``policy`` with the rest of ``stated``: a channel of this shuffler's settings, whose
    mechanism no config stated before, compared on its policy alone."""
    fields = {k: getattr(policy, k) for k in ChannelPolicy.model_fields}
    rest = stated.model_dump(exclude=set(ChannelPolicy.model_fields))
    return ChannelTerms.model_validate({**rest, **fields})


class ChannelPolicies:
    """The policies intake and batching read, replaced whole on a change (readers never see a
    half-applied one). A suspended channel is kept for batching what it took before, and
    takes nothing more (``409 channel_terms_changed``), for good: a channel whose privacy
    must change gets a new channel id."""

    def __init__(self, configured: Iterable[ChannelPolicy], floor: PolicyFloor) -> None:
        self._items = {policy.id: policy for policy in configured}
        self._terms: dict[str, ChannelTerms] = {}
        self._suspended: dict[str, str] = {}
        self.floor = floor
        self.revision = 0
        self._lock = threading.Lock()

    def get(self, channel_id: str) -> ChannelPolicy | None:
        """The policy of ``channel_id``, if served."""
        return self._items.get(channel_id)

    def all(self) -> list[ChannelPolicy]:
        """Every served channel (retired ones too)."""
        return list(self._items.values())

    def terms(self, channel_id: str) -> ChannelTerms | None:
        """The privacy terms pinned for ``channel_id`` (None: no config stated them yet)."""
        return self._terms.get(channel_id)

    def suspension(self, channel_id: str) -> str | None:
        """Why ``channel_id`` takes no more contributions (None: it is not suspended)."""
        return self._suspended.get(channel_id)

    def suspensions(self) -> dict[str, str]:
        """Every suspended channel, with why."""
        return dict(self._suspended)

    def suspend(self, suspended: Mapping[str, str]) -> None:
        """Suspend these channels again (as persisted before a restart)."""
        with self._lock:
            self._suspended = {**self._suspended, **suspended}

    def adopt(
        self,
        channels: Sequence[ChannelPolicy],
        revision: int,
        device_budget: DeviceBudget | None = None,
    ) -> tuple[Adoption, list[ChannelPolicy]]:
        """Fold in a verified config's channels (:class:`ChannelConfig` with the config's
        ``device_budget``, or stored :class:`ChannelTerms`) at ``revision``: (what changed,
        what to persist). A revision older than the one adopted changes nothing."""
        with self._lock:
            if revision < self.revision:
                return Adoption(), []
            items, terms, adoption = dict(self._items), dict(self._terms), Adoption()
            persist: list[ChannelPolicy] = []
            for offered in channels:
                id_, stated = offered.id, _split(offered, device_budget)
                known = items.get(id_)
                if known is None:
                    value = self._new(offered, stated, adoption)
                else:
                    value = self._live(known, terms.get(id_), offered, stated, adoption)
                if value is None:
                    continue
                items[id_] = value.policy()
                if isinstance(value, ChannelTerms):
                    terms[id_] = value
                persist.append(value)
            self._items, self._terms, self.revision = items, terms, revision
            self._suspended = {**self._suspended, **adoption.suspended}
        return adoption, persist

    def _new(
        self, offered: ChannelPolicy, stated: ChannelTerms | None, adoption: Adoption
    ) -> ChannelPolicy | None:
        """A channel not served yet: adopted when above the floor and under the ceilings."""
        why = self.floor.refusal(offered.policy())
        if why is None and stated is not None:
            why = self.floor.terms_refusal(stated)
        if why is not None:
            adoption.refused[offered.id] = why
            return None
        adoption.added.append(offered.id)
        return stated or offered.policy()

    def _live(
        self,
        known: ChannelPolicy,
        pinned: ChannelTerms | None,
        offered: ChannelPolicy,
        stated: ChannelTerms | None,
        adoption: Adoption,
    ) -> ChannelPolicy | None:
        """A served channel offered again (None: nothing to persist). Its retirement is always
        honoured; terms that relax nothing are pinned; terms that relax the pinned ones, or
        are over this shuffler's ceilings, suspend it with the pinned terms kept."""
        id_, policy = known.id, offered.policy()
        retire = known.retired_from_epoch is None and policy.retired_from_epoch is not None
        epoch = policy.retired_from_epoch if retire else known.retired_from_epoch
        if retire:
            adoption.retired.append(id_)
        kept: ChannelPolicy = pinned or known
        if stated is None:
            changed = known.changed_fields(policy)
            if changed:
                adoption.refused[id_] = f"a live channel's {', '.join(changed)} changed (kept)"
        elif id_ not in self._suspended:
            why = self._relaxed(pinned or _as_terms(known, stated), stated)
            if why is not None:
                adoption.suspended[id_] = why
            elif pinned is None or pinned.changed_terms(stated) or known.changed_fields(policy):
                adoption.pinned.append(id_)
                kept = stated
        if not (retire or id_ in adoption.suspended or id_ in adoption.pinned):
            return None
        return kept.model_copy(update={"retired_from_epoch": epoch})

    def _relaxed(self, old: ChannelTerms, new: ChannelTerms) -> str | None:
        """Why ``new`` cannot be served in place of ``old`` (None: it relaxes nothing and is
        within this shuffler's ceilings)."""
        found = relaxations(old, new)
        if found:
            return f"relaxes {'; '.join(r.describe() for r in found)}"[:500]
        ceiling = self.floor.terms_refusal(new)
        return None if ceiling is None else f"over this shuffler's ceiling: {ceiling}"


class AnalyzerKeyIds:
    """The analyzer's HPKE key ids as the configs this shuffler verified list them: the
    current ones, and every one seen since this process started. A key seen before and no
    longer listed is retired (by its overlap's end or early, by an admin); one never seen may
    be newer than the config adopted, so it is not called retired."""

    def __init__(self) -> None:
        #: (current, seen), replaced whole so a reader never sees one without the other.
        self._ids: tuple[frozenset[bytes], frozenset[bytes]] = (frozenset(), frozenset())
        self.issued_at = -1
        self._lock = threading.Lock()

    @property
    def current(self) -> frozenset[bytes]:
        """The key ids the adopted config lists."""
        return self._ids[0]

    @property
    def seen(self) -> frozenset[bytes]:
        """Every key id listed by a config adopted since this process started."""
        return self._ids[1]

    def adopt(self, keys: Iterable[HpkeKey], issued_at: int) -> None:
        """Follow the keys a verified config issued at ``issued_at`` lists (one issued before
        the config followed, e.g. replayed, changes nothing)."""
        ids = frozenset(bytes.fromhex(key.key_id) for key in keys)
        with self._lock:
            if issued_at < self.issued_at:
                return
            self._ids = (ids, self._ids[1] | ids)
            self.issued_at = issued_at

    def retired(self, key_id: bytes) -> bool:
        """Whether ``key_id`` was one of the analyzer's keys and is no longer."""
        current, seen = self._ids  # one read: both from the same config
        return key_id in seen and key_id not in current


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
        #: The analyzer's HPKE keys the adopted configs list (a contribution whose fragments
        #: are sealed to one retired since gets 409 ``config_outdated``).
        self.analyzer_keys = AnalyzerKeyIds()
        #: The analyzer key this follower moved to along the successions it verified.
        self._pin: Ed25519PublicKey | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._fetching = threading.Lock()
        self._last = 0.0
        #: Where this shuffler sits among the config's K (what the analyzer verifies its
        #: batches' crowds at); None until a config listing it was adopted.
        self.position: BatchContext | None = None

    def load(self) -> None:
        """Adopt what was adopted before a restart (or by another replica)."""
        stored, revision, suspended = self.store.followed()
        self.policies.suspend(suspended)
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
        url = self.settings.analyzer_url.rstrip("/") + "/v1/config"
        document = _read_config(http, url, self.settings.config_fetch_deadline_seconds)
        if document is None:
            return None
        now = self.clock()
        vouched = verify_config_chain(document, key, now)
        config = vouched.value
        # Where the analyzer places this shuffler now, even from a config whose channels are
        # refused below: its crowd checks follow the analyzer as it is.
        self.position = _position(config, self.settings.shuffler_id)
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
        self.analyzer_keys.adopt(config.analyzer.keys, config.issued_at)
        adoption, persist = self.policies.adopt(
            config.channels, config.revision, config.device_budget
        )
        if persist:
            self.store.follow(persist, config.revision, self.policies.suspensions())
        self._report(adoption, config.revision)
        self._refused_config = ""
        return adoption

    def _report(self, adoption: Adoption, revision: int) -> None:
        for name in ("added", "retired", "pinned"):
            for channel in getattr(adoption, name):
                log.info(f"channel {name}", extra={"channel": channel, "revision": revision})
        fresh = {k: v for k, v in adoption.refused.items() if self._refused.get(k) != v}
        for channel, why in fresh.items():
            log.error(
                "channel in the analyzer's config refused",
                extra={"channel": channel, "reason": why, "revision": revision},
            )
        for channel, why in adoption.suspended.items():
            log.error(
                "channel suspended: the analyzer's config changed its privacy terms",
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
            self._attempt(http)
            self._wake.wait(self.settings.config_refresh_seconds)
            self._wake.clear()

    def fetch_now(self) -> bool:
        """One fetch on the caller's thread, for a group that is due while this shuffler
        cannot tell the crowd its analyzer will verify (an admin close just after a start);
        whether a config that lists this shuffler is adopted now (no fetch when one began
        less than :data:`WAKE_SPACING` s ago: an unreachable analyzer costs a batching round
        no more than that)."""
        with self._fetching:  # one fetch at a time; one just ended counts as this one
            if self.clock() - self._last < WAKE_SPACING:
                return self.position is not None
            with deadline_client(self.settings.config_fetch_deadline_seconds) as http:
                self._fetch_logged(http)
        return self.position is not None

    def _attempt(self, http: httpx.Client) -> None:
        """One fetch, serialized with any other; a failure is logged, never raised."""
        with self._fetching:
            self._fetch_logged(http)

    def _fetch_logged(self, http: httpx.Client) -> None:
        """:meth:`fetch`, its failure logged; :attr:`_last` is when it ended (a slow analyzer
        costs one fetch's deadline per :data:`WAKE_SPACING`, not one per caller)."""
        try:
            self.fetch(http)
        except (httpx.HTTPError, ValueError) as error:
            self._refusal(f"{type(error).__name__}: {error}"[:300])
        except Exception:  # the follower must outlive any one answer
            log.exception("analyzer config not adopted; fetched again next time")
        finally:
            self._last = self.clock()

    def stop(self) -> None:
        """End :meth:`run`."""
        self._stop.set()
        self._wake.set()


def _read_config(http: httpx.Client, url: str, seconds: float) -> dict[str, Any] | None:
    """The analyzer's signed config document (None: it answered no 200), read up to
    :data:`MAX_CONFIG_BYTES` (an answer is read before its signature can be checked) within
    ``seconds`` for the whole request.

    Raises:
        CollectionConfigError: larger, or not a JSON object.
        httpx.HTTPError: a network failure, or the deadline passed.
    """
    try:
        fetched = fetch_within(http, url, MAX_CONFIG_BYTES, seconds)
    except FetchTooLargeError as error:
        too_large = f"the config answer is over {MAX_CONFIG_BYTES} bytes"
        raise CollectionConfigError(too_large) from error
    if fetched.status != 200:
        return None
    try:
        document = json.loads(fetched.body)
    except ValueError as error:
        raise CollectionConfigError(f"the config answer is not JSON: {error}") from error
    if not isinstance(document, dict):
        raise CollectionConfigError(f"the config answer is a JSON {type(document).__name__}")
    return document


def _position(config: CollectionConfig, shuffler_id: str) -> BatchContext | None:
    """Where ``shuffler_id`` sits among the config's shufflers, in the analyzer's order."""
    ids = [str(signed.descriptor.get("id")) for signed in config.shufflers]
    return BatchContext(ids.index(shuffler_id), len(ids)) if shuffler_id in ids else None
