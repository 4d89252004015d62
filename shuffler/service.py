"""The shuffler as one facade (ESA, Bittau et al.; ESA-revisited §V): what the HTTP app calls.

Composes the layers — :mod:`~shuffler.intake` (tokens, rate limits, validation),
:mod:`~shuffler.store` (every transaction), :mod:`~shuffler.batcher` (Algorithm 3 and the
shuffle, pure), :mod:`~shuffler.forwarder` and :mod:`~shuffler.retention` — and counts what
happens (:mod:`~shuffler.metrics`). It raises :class:`~shuffler.errors.ShufflerError` only and
knows nothing of HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.exc import IntegrityError

from common import randomness
from common.collection import DESCRIPTOR_SUFFIX, shuffler_party, sign_descriptor
from common.envelope import KeyRing, key_id, public_bytes, public_identity
from common.mechanisms import BatchContext
from common.randomness import RandomSource
from common.retry import Backoff
from common.wire import (
    HpkeKey,
    ShufflerConfig,
    ShufflerDescriptor,
    SignedDescriptor,
    Succession,
    b64,
)
from runtime import db
from runtime.failpoints import failpoint
from runtime.keys import KeyDirectory, LiveKeys, PartyKeys
from runtime.publish import publish
from shuffler.batcher import Batcher, Deletion, GroupStatus, closes_at, group_due
from shuffler.closing import CrowdCheck, close_group
from shuffler.errors import (
    FutureEpochError,
    KeyNotLoadedError,
    ShufflerError,
    UnknownChannelError,
)
from shuffler.forwarder import Forwarder
from shuffler.intake import Intake, IntakeHooks, TokenAuthority, refusal
from shuffler.metrics import ShufflerEvents
from shuffler.policies import ChannelPolicies, ConfigFollower, PolicyFloor
from shuffler.records import Conflict, GroupKey, Pending
from shuffler.retention import Retention
from shuffler.settings import ShufflerSettings
from shuffler.store import ContributionStore
from shuffler.store_backends import make_store

log = logging.getLogger("esa.shuffler")
#: Most HPKE keys a descriptor lists (:class:`common.wire.ShufflerDescriptor`).
MAX_DESCRIPTOR_KEYS = 8


@dataclass(frozen=True, slots=True)
class Stored:
    """Result of storing one contribution: a receipt, or the refusal the client gets."""

    receipt: str | None
    refusal: ShufflerError | None = None


class ShufflerService:
    """Everything a shuffler does, over one contribution store."""

    def __init__(
        self,
        settings: ShufflerSettings,
        store: ContributionStore,
        ring: KeyRing,
        signing_key: Ed25519PrivateKey,
        clock: Callable[[], float] = time.time,
        rng: RandomSource | None = None,
        keys: LiveKeys | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.ring = ring
        self._signing_key = signing_key
        self.clock = clock
        self.rng = rng or randomness.default_source()
        self.events = ShufflerEvents()
        floor = PolicyFloor(
            min_crowd=settings.adopt_min_crowd,
            max_eps_cr=settings.adopt_max_eps_cr,
            max_delta_cr=settings.adopt_max_delta_cr,
            max_local_eps=settings.adopt_max_local_eps,
            max_delta=settings.adopt_max_delta,
            without_local_privacy=settings.adopt_without_local_privacy,
        )
        self.policies = ChannelPolicies(settings.channels, floor)
        self.follower = (
            ConfigFollower(settings, self.policies, store, clock)
            if settings.follows_analyzer
            else None
        )
        self.intake = Intake(settings, ring, clock, self.policies, self._intake_hooks(keys))
        self._deferring = False
        self.batcher = Batcher(
            settings.shuffler_id, lambda: self.signing_key, self.rng, settings.part_fragments
        )
        backoff = Backoff(settings.backoff_base_seconds, settings.backoff_cap_seconds)
        self.forwarder = Forwarder(
            settings.shuffler_id,
            store,
            settings.analyzer_url,
            backoff,
            self.rng,
            clock,
            settings.forward_lease_seconds,
            lambda: self.signing_key,
        )
        self.retention = Retention(store, settings.retention_seconds, clock)
        #: The key directory's keys as this replica uses them (:func:`build_service`).
        self.keys = keys
        if keys is not None:
            keys.listeners.append(self.keys_changed)
        self._batching = threading.Lock()
        #: Evaluations so far, and how many there were when a sweep last found nothing dead
        #: (None: look once, for what a previous run left): a sweep scans only after one.
        self._evaluations = 0
        self._swept_at: int | None = None

    def _intake_hooks(self, keys: LiveKeys | None) -> IntakeHooks:
        """What the intake asks of the config follower and the live keys (those it has)."""
        follower = self.follower
        return IntakeHooks(
            on_unknown_channel=follower.wake if follower else lambda: None,
            analyzer_key_retired=follower.analyzer_keys.retired if follower else lambda _: False,
            keys_stale=keys.stale if keys else lambda: False,
            on_unknown_key=keys.catch_up if keys else None,
        )

    @property
    def signing_key(self) -> Ed25519PrivateKey:
        """The key that signs now: with live keys, the newest active one at this instant (so
        every replica switches at its activation, reloaded since or not)."""
        return self._signing_key if self.keys is None else self.keys.current.signer

    @property
    def tokens(self) -> TokenAuthority:
        """The client token authority (issue, verify, revoked)."""
        return self.intake.tokens

    def load_state(self) -> None:
        """Revocations and closed epochs from the database: at start (after a restart) and
        every batching round, so an admin close or a revocation made at one replica of this
        trust domain reaches the others within ``batch_interval_seconds``."""
        self.intake.tokens.revoked |= self.store.revoked()
        if self.keys is not None:
            self.keys.refresh()
        if self.follower is not None:
            self.follower.load()
        for channel_id, epoch in self.store.closed_epochs().items():
            self.intake.close(channel_id, epoch)

    # --- intake ---------------------------------------------------------------------------

    def admit(self, token: str) -> str:
        """The client id behind a bearer token, once its contribution rate allows one more
        (the first step of ``POST /v1/contributions``, before its body is read).

        Raises:
            BadTokenError: a token that does not verify, or a revoked one.
            ClientRateLimitedError: the client sends faster than ``rate_per_second``.
        """
        client_id = self.intake.tokens.verify(token)
        self.intake.contributions.check(client_id, time.monotonic(), "slow down")
        return client_id

    def validate(self, client_id: str, blob: bytes, *, catch_up: bool = True) -> Pending:
        """Open and check one contribution of a client :meth:`admit` let in (its id, not its
        token); nothing is stored yet. A blob sealed to a key this process has not loaded makes
        it read the key files again (:meth:`catch_up`, blocking; with ``catch_up=False`` it
        raises instead, for a caller that must not block and calls :meth:`catch_up` itself).

        Raises:
            ShufflerError: malformed, unknown channel, too many fragments, epoch not open, a key
                not loaded (after reading the keys again).
            KeyNotLoadedError: with ``catch_up=False``, a key not loaded yet.
        """
        try:
            return self.intake.validate(client_id, blob)
        except KeyNotLoadedError:
            if not catch_up:
                raise
            return self.catch_up(client_id, blob)

    def catch_up(self, client_id: str, blob: bytes) -> Pending:
        """:meth:`validate` for a blob sealed to a key not loaded yet: read the key files again
        (blocking: off the event loop), then open it.

        Raises:
            ShufflerError: as :meth:`validate`; a key still not loaded after reading them.
        """
        return self.intake.catch_up(client_id, blob)

    def commit(self, pending: Sequence[Pending]) -> list[Stored]:
        """Commit contributions in one transaction; a receipt only for rows that landed.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the database is unavailable (nothing stored).
        """
        return [
            Stored(None, refusal(landing)) if isinstance(landing, Conflict) else Stored(landing)
            for landing in self.store.insert(pending)
        ]

    def enroll(self, address: str) -> str:
        """A new client token, rate-limited per network address.

        Raises:
            ClientRateLimitedError: too many enrolments from ``address``.
        """
        self.intake.enrolments.check(address, time.monotonic(), "too many enrolments")
        return self.intake.tokens.issue()

    def revoke(self, client_id: str) -> None:
        """Revoke a client id (persisted, effective immediately in this process)."""
        self.store.revoke(client_id, self.clock())
        self.intake.tokens.revoked.add(client_id)

    def config(self) -> ShufflerConfig:
        """``GET /v1/config``: the shuffler's public identity and channel policies."""
        published = self.keys.current.published_hpke() if self.keys is not None else ()
        hpke = published[0].public_key() if published else self.ring.public()
        signing = self.signing_key.public_key()
        identity = public_identity(hpke, signing)
        return ShufflerConfig(
            id=self.settings.shuffler_id, channels=self.policies.all(), **identity
        )

    def descriptor(self) -> SignedDescriptor:
        """``GET /v1/descriptor``: this shuffler's URL and active HPKE keys (the one devices
        seal to first), signed with its current key — with the successions that lead to it
        from its first — and valid for ``descriptor_ttl_seconds`` from now: what a device
        accepts a key of this shuffler from (never from the analyzer's word)."""
        now = int(self.clock())
        signer, successions = self.signing_key, tuple[Succession, ...]()
        if self.keys is not None:
            keys = self.keys.current  # one snapshot: signer, chain and keys agree
            published, signer, successions = keys.published_hpke(), keys.signer, keys.successions
        else:
            current = self.ring.keys[self.ring.current]
            published = (current, *(k for i, k in self.ring.keys.items() if i != self.ring.current))
        descriptor = ShufflerDescriptor(
            id=self.settings.shuffler_id,
            url=self.settings.url,
            keys=[
                HpkeKey(
                    key_id=key_id(k.public_key()).hex(),
                    public_key=b64(public_bytes(k.public_key())),
                )
                for k in published[:MAX_DESCRIPTOR_KEYS]
            ],
            signing_key=b64(public_bytes(signer.public_key())),
            issued_at=now,
            expires_at=now + self.settings.descriptor_ttl_seconds,
        )
        return sign_descriptor(descriptor, signer, successions)

    def keys_changed(self, keys: PartyKeys) -> None:
        """A key became active or retired (:class:`runtime.keys.LiveKeys`): publish the
        descriptor again (what signs is read at each use: :attr:`signing_key`)."""
        self.publish()

    def publish(self) -> Path | None:
        """Write this shuffler's signed descriptor to ``publish_dir`` (public material for the
        analyzer's registry and for app builders); its path, None when not configured."""
        directory = self.settings.publish_dir
        if directory is None:
            return None
        name = f"{self.settings.shuffler_id}{DESCRIPTOR_SUFFIX}"
        return publish(directory, name, self.descriptor().model_dump_json(indent=2) + "\n")

    # --- batching (ESA-revisited Algorithm 3) ---------------------------------------------

    def due_groups(self, now: float) -> list[GroupKey]:
        """Groups whose epoch closed: each is evaluated whole, never split by arrival."""
        found = []
        for key in self.store.open_groups():
            policy = self.policies.get(key.channel_id)
            if policy is None:
                continue
            closed = self.intake.closed_upto.get(key.channel_id, -1)
            if group_due(policy, key.epoch, now, self.settings.epoch_grace_seconds, closed):
                found.append(key)
        return found

    def evaluate(self, key: GroupKey) -> Deletion | None:
        """Apply Algorithm 3 to one whole group and store its batch, as signed parts of at most
        ``part_fragments`` fragments, in one transaction (streamed: :mod:`shuffler.dealing`).

        Raises:
            sqlalchemy.exc.IntegrityError: another worker evaluated this group first.
        """
        policy = self.policies.get(key.channel_id)
        if policy is None:
            return None
        # Persist the close first, also for an epoch that ended by the clock: no replica
        # acknowledges a contribution for it from then on, and on PostgreSQL the inserts already
        # running end before the group is read (else one validated just before the end could
        # land after the evaluation: acknowledged, then purged as late).
        now, grace = self.clock(), self.settings.epoch_grace_seconds
        closed = self.intake.closed_upto.get(key.channel_id, -1)
        if now >= closes_at(policy, key.epoch, grace) or key.epoch <= closed:
            self.store.close_epoch(key.channel_id, key.epoch, now)
            failpoint("shuffler.close.after_epoch_closed")
        placed, position = self._placement()
        if not placed:
            return None
        crowd = self._crowd(key, position)
        outcome = close_group(self.store, key, self.batcher, policy, now, crowd)
        if outcome is None:
            return None
        self._evaluations += 1
        self._count_evaluation(key, outcome.deletion, released=outcome.batch is not None)
        return outcome.deletion

    def _placement(self) -> tuple[bool, BatchContext | None]:
        """Whether this shuffler may evaluate a group now, and where the analyzer's config
        places it (read once, so a group's crowd check and the decision agree).

        A shuffler that follows an analyzer whose config it has not adopted (just started, the
        analyzer unreachable) cannot tell the crowd the analyzer will verify, so it evaluates no
        group until it can (a batch sent meanwhile could be withheld as below ``min_crowd``: its
        contributions lost instead of held). The group stays pending, unless one fetch made now
        places this shuffler. One with no analyzer to follow checks no crowd.
        """
        if self.follower is None:
            return True, None
        position = self.follower.position
        if position is None and self.follower.fetch_now():
            position = self.follower.position
        if (position is None) != self._deferring:
            self._deferring = position is None
            if self._deferring:
                log.warning("groups wait until the analyzer's config lists this shuffler")
            else:
                log.info("groups evaluated again: the analyzer's config lists this shuffler")
        return position is not None, position

    def _crowd(self, key: GroupKey, position: BatchContext | None) -> CrowdCheck | None:
        """The crowd the analyzer will verify for a batch of the group at ``position`` (None:
        no check: no analyzer followed, or a bare policy without the mechanism)."""
        terms = self.policies.terms(key.channel_id)
        if terms is None or position is None:
            return None

        def verified(kept: int, fragments: int) -> int:
            crowd = terms.verified_crowd(kept, fragments, position)
            return kept if crowd is None else crowd

        return verified

    def _count_evaluation(self, key: GroupKey, deletion: Deletion, released: bool) -> None:
        self.events.count(f"group_{deletion.status}")
        self.events.count("batches_released", int(released))
        by_abort = deletion.status is GroupStatus.ABORTED
        self.events.count(
            "deleted_by_abort" if by_abort else "deleted_by_randomized_deletion", deletion.deleted
        )
        # A group's size and its deletions are secret until released (randomized deletion's
        # ε_cr): only a released batch's n_contributions, which the batch itself publishes.
        summary: dict[str, object] = {"status": str(deletion.status)}
        if released:
            summary["n_contributions"] = deletion.kept
        log.info(
            "group evaluated", extra={"channel": key.channel_id, "epoch": key.epoch, **summary}
        )

    def run_batching(self) -> int:
        """Evaluate every due group once; returns how many were evaluated.

        Serialized within the process (the periodic batcher and an admin close may overlap);
        across replicas the groups table's primary key lets exactly one evaluation commit, and
        on PostgreSQL a per-group advisory lock keeps a second replica from dealing it in vain.
        Closed epochs and revocations are read from the store first (other replicas' closes).
        """
        with self._batching:
            self.load_state()
            due_now = self.due_groups(self.clock())
            return sum(self._evaluate_once(key) is not None for key in due_now)

    def _evaluate_once(self, key: GroupKey) -> Deletion | None:
        try:
            return self.evaluate(key)
        except IntegrityError:
            log.info("group already evaluated by another worker", extra={"channel": key.channel_id})
            return None
        except Exception:  # one failing group must not stop the groups behind it
            self.events.count("group_evaluation_failed")
            log.exception(
                "evaluating a group failed; retried next round",
                extra={"channel": key.channel_id, "epoch": key.epoch},
            )
            return None

    def close(self, channel_id: str, epoch: int) -> int:
        """Close every epoch <= ``epoch`` of a channel now (admin, demo); returns groups done.

        Raises:
            UnknownChannelError: the channel is not configured here.
            FutureEpochError: ``epoch`` has not started yet.
        """
        policy = self.policies.get(channel_id)
        if policy is None:
            raise UnknownChannelError(f"channel {channel_id[:64]!r} is not configured here")
        current = int(self.clock() // policy.epoch_seconds)
        if epoch > current:
            raise FutureEpochError(
                f"epoch {epoch} of {channel_id!r} has not started (the current one is {current})"
            )
        self.store.close_epoch(channel_id, epoch, self.clock())
        self.intake.close(channel_id, epoch)
        return self.run_batching()

    # --- forwarding, retention, accounting ------------------------------------------------

    def forward_due(self, client: httpx.Client) -> dict[str, int]:
        """POST every due batch part to the analyzer: how many forwarded, retried, failed."""
        tally = self.forwarder.forward_due(client)
        for outcome, amount in tally.items():
            self.events.count(f"batches_{outcome}", amount)
        return {str(outcome): amount for outcome, amount in tally.items()}

    def purge(self) -> int:
        """Delete what outlived the retention period; returns contributions deleted."""
        removed = self.retention.purge()
        for reason, n in removed.items():
            self.events.count(f"deleted_by_{reason}", n)
        return sum(removed.values())

    def sweep(self) -> int:
        """Delete some dead contributions of evaluated groups (:meth:`ContributionStore.sweep`),
        after each batching round, scanning only once a group was evaluated since the last
        sweep that found none; returns how many (never logged or published)."""
        seen = self._evaluations
        if self._swept_at == seen:
            return 0
        swept = self.store.sweep()
        if swept == 0:
            self._swept_at = seen
        return swept

    def requeue(self, batch_id: str | None = None) -> int:
        """Send the parts the analyzer refused again (admin, after fixing the cause)."""
        return self.store.requeue_refused(self.clock(), batch_id)

    def ledger(self) -> dict[str, int]:
        """Where every acknowledged contribution went."""
        return self.store.ledger()


def build_service(settings: ShufflerSettings) -> ShufflerService:
    """A service over the configured database, with the keys in ``settings.key_dir`` (created
    on first start), read again as they rotate (:class:`runtime.keys.LiveKeys`, every
    ``key_reload_seconds`` from the batching round).

    Raises:
        ValueError: the key directory is unusable (naming the file).
    """
    engine = db.make_engine(settings.database_url, settings.sqlite_busy_timeout_seconds)
    directory = KeyDirectory(settings.key_dir, shuffler_party(settings.shuffler_id))
    keys = LiveKeys(
        directory,
        lambda: settings.key_timing(service.policies.all()),
        reload_seconds=settings.key_reload_seconds,
    )
    service = ShufflerService(
        settings, make_store(engine), keys.ring, keys.current.signer, keys=keys
    )
    return service
