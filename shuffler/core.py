"""Shuffler core: plain Python over a SQLAlchemy engine, testable without HTTP.

Intake (PROTOCOL.md): bearer tokens ``client_id.HMAC`` verified without a lookup (plus a
revocation set); contributions opened with the shuffler's HPKE key, checked against the
channel's policy, and committed — one contribution per (client, channel, crowd, epoch), nonces
never reused — before anything is acknowledged.

Batching (ESA-revisited §V, Algorithm 3): per (channel, crowd, epoch) group, when the epoch
closes (or ``max_batch`` contributions wait), draw the noise ONCE:
``n̂ = max(n + Laplace(2/ε_cr) - (2/ε_cr) ln(2/δ_cr), 0)``; if ``n̂ > n`` abort (delete the
group, logged and counted); if ``floor(n̂) < min_crowd`` hold (never released, deleted at
retention expiry); otherwise delete ``n - floor(n̂)`` uniformly chosen WHOLE contributions,
flatten the survivors' fragments, shuffle them with a CSPRNG Fisher–Yates, and store the signed
batch in the same transaction that removes the contributions and records the group as
evaluated (a group is never evaluated twice). Batches carry only counts: no client id, token,
nonce, timestamp or arrival order.

Forwarding: at least once, with exponential backoff and jitter, resumed after restarts; the
analyzer deduplicates by ``batch_id``. Retention: anything undelivered or held past the
retention period is deleted and counted.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from common.envelope import Contribution, EnvelopeError, KeyRing, open_contribution, sign
from common.wire import Batch, ChannelPolicy, b64
from services.runtime.http import RejectedError
from shuffler import storage
from shuffler.settings import ShufflerSettings

log = logging.getLogger("esa.shuffler")


# --- tokens -------------------------------------------------------------------------------


class TokenAuthority:
    """Client tokens ``client_id.mac`` with ``mac = HMAC-SHA256(secret, client_id)``."""

    def __init__(self, secret: bytes, revoked: set[str] | None = None) -> None:
        self._secret = secret
        self.revoked = revoked if revoked is not None else set()

    def _mac(self, client_id: str) -> str:
        # hmac.new, not hmac.digest: the one-shot function releases the GIL even for a few
        # bytes, and on the event loop thread getting it back can wait for other threads.
        digest = hmac.new(self._secret, client_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self) -> str:
        """A new client id (128 random bits) and its token."""
        client_id = secrets.token_hex(16)
        return f"{client_id}.{self._mac(client_id)}"

    def verify(self, token: str) -> str:
        """The client id of a valid, unrevoked token.

        Raises:
            RejectedError: 401 for a malformed, forged or revoked token.
        """
        client_id, _, mac = token.partition(".")
        if not client_id or not mac or not hmac.compare_digest(mac, self._mac(client_id)):
            raise RejectedError(401, "bad_token", "client token is missing, malformed or forged")
        if client_id in self.revoked:
            raise RejectedError(401, "revoked", "client token has been revoked")
        return client_id


# --- randomness ---------------------------------------------------------------------------


def _uniform_open() -> float:
    """Uniform in (0, 1] from the OS CSPRNG (53 bits)."""
    return (secrets.randbits(53) + 1) / float(1 << 53)


def laplace(scale: float) -> float:
    """Laplace(scale) as the difference of two CSPRNG exponentials."""
    return scale * (math.log(_uniform_open()) - math.log(_uniform_open()))


def secure_shuffle(items: list[Any]) -> None:
    """In-place Fisher–Yates with ``secrets.randbelow`` (never numpy's or ``random``'s PRNG)."""
    for i in range(len(items) - 1, 0, -1):
        j = secrets.randbelow(i + 1)
        items[i], items[j] = items[j], items[i]


@dataclass(frozen=True)
class Deletion:
    """Outcome of Algorithm 3 for one group."""

    status: str  # "released", "held" or "aborted"
    n: int
    kept: int

    @property
    def deleted(self) -> int:
        """Contributions removed now: all when aborted, none when held (retention deletes them)."""
        if self.status == "held":
            return 0
        return self.n if self.status == "aborted" else self.n - self.kept


def randomized_deletion(
    n: int, policy: ChannelPolicy, noise: Callable[[float], float] = laplace
) -> Deletion:
    """ESA-revisited Algorithm 3 for one group of n contributions (one noise draw)."""
    scale = 2.0 / policy.eps_cr
    n_hat = max(n + noise(scale) - scale * math.log(2.0 / policy.delta_cr), 0.0)
    if n_hat > n:
        return Deletion("aborted", n, 0)
    kept = math.floor(n_hat)
    if kept < policy.min_crowd:
        return Deletion("held", n, 0)
    return Deletion("released", n, kept)


# --- fragments inside a stored contribution -----------------------------------------------


def pack_fragments(fragments: Sequence[bytes]) -> bytes:
    """``u16 length | bytes`` per fragment."""
    return b"".join(len(f).to_bytes(2, "big") + f for f in fragments)


def unpack_fragments(blob: bytes) -> list[bytes]:
    """Inverse of :func:`pack_fragments`."""
    out, offset = [], 0
    while offset < len(blob):
        length = int.from_bytes(blob[offset : offset + 2], "big")
        out.append(blob[offset + 2 : offset + 2 + length])
        offset += 2 + length
    return out


@dataclass(frozen=True)
class Pending:
    """A validated contribution on its way to the database."""

    client_id: str
    contribution: Contribution
    received_at: float


@dataclass(frozen=True)
class Stored:
    """Result of storing one contribution: a receipt, or the reason it was refused."""

    receipt: str | None
    rejection: RejectedError | None = None


_COLUMNS = (
    "channel_id",
    "crowd_id",
    "epoch",
    "client_id",
    "nonce",
    "fragments",
    "n_fragments",
    "received_at",
    "receipt",
)
_NONCE, _RECEIPT = _COLUMNS.index("nonce"), _COLUMNS.index("receipt")
_PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}
_ROWS_PER_STATEMENT = 100  # 900 parameters: under SQLite's historical limit of 999


def new_receipts(count: int) -> list[str]:
    """``count`` unique, unguessable receipts: 32 hex digits, the time in microseconds (13)
    then 76 random bits (19).

    The time prefix makes a batch's receipts neighbours in the unique index, so a commit
    touches one index page for all of them instead of one random page each (the write-ahead
    log copies every page a commit touches). A receipt only ever goes back to the client
    that sent the contribution, which knows when it did.
    """
    prefix = f"{time.time_ns() // 1000:013x}"
    random = secrets.token_hex(10 * count)  # one system call for the whole batch
    return [prefix + random[20 * i : 20 * i + 19] for i in range(count)]


@functools.lru_cache(maxsize=256)
def _insert_sql(mark: str, rows: int) -> str:
    """``INSERT INTO contributions (...) VALUES (...), ... ON CONFLICT DO NOTHING``."""
    values = "(" + ", ".join([mark] * len(_COLUMNS)) + ")"
    return (
        f"INSERT INTO {storage.contributions.name} ({', '.join(_COLUMNS)}) "
        f"VALUES {', '.join([values] * rows)} ON CONFLICT DO NOTHING"
    )


class ShufflerCore:
    """Everything a shuffler does, over one database."""

    def __init__(
        self,
        settings: ShufflerSettings,
        engine: Engine,
        ring: KeyRing,
        signing_key: Ed25519PrivateKey,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.ring = ring
        self.signing_key = signing_key
        self.clock = clock
        self.closed_upto: dict[str, int] = {}
        self.tokens = TokenAuthority(settings.token_secret.get_secret_value().encode())
        self.events: dict[str, int] = {}
        self._batching = threading.Lock()

    def load_state(self) -> None:
        """Revocations and closed epochs from the database (after a restart)."""
        with self.engine.connect() as conn:
            self.tokens.revoked |= {
                row[0] for row in conn.execute(select(storage.revoked.c.client_id))
            }
            closed = select(
                storage.closed_epochs.c.channel_id, func.max(storage.closed_epochs.c.epoch)
            )
            for channel, epoch in conn.execute(closed.group_by(storage.closed_epochs.c.channel_id)):
                self.closed_upto[channel] = int(epoch)

    def _count(self, event: str, amount: int = 1) -> None:
        self.events[event] = self.events.get(event, 0) + amount

    # --- intake ---------------------------------------------------------------------------

    def validate(self, token: str, blob: bytes, client_id: str | None = None) -> Pending:
        """Authenticate, open and check one contribution (nothing is stored yet).

        ``client_id`` may be passed when the caller has already verified ``token``.

        Raises:
            RejectedError: 401 bad token, 400 malformed / unknown channel / closed epoch,
                413 too many fragments.
        """
        client_id = client_id or self.tokens.verify(token)
        try:
            contribution = open_contribution(blob, self.settings.shuffler_id, self.ring)
        except EnvelopeError as error:
            raise RejectedError(400, "malformed", str(error)) from error
        policy = self.settings.channel(contribution.channel_id)
        if policy is None:
            raise RejectedError(
                400, "unknown_channel", f"channel {contribution.channel_id!r} is not served here"
            )
        if len(contribution.fragments) > policy.max_fragments:
            raise RejectedError(
                413,
                "too_many_fragments",
                f"{len(contribution.fragments)} fragments > max_fragments={policy.max_fragments}",
            )
        now = self.clock()
        current = int(now // policy.epoch_seconds)
        open_epochs = {current}
        if now - current * policy.epoch_seconds < self.settings.epoch_grace_seconds:
            open_epochs.add(current - 1)
        if contribution.epoch not in open_epochs or contribution.epoch <= self.closed_upto.get(
            policy.id, -1
        ):
            raise RejectedError(
                400, "epoch_not_open", f"epoch {contribution.epoch} is not open (current {current})"
            )
        return Pending(client_id, contribution, now)

    def _insert(self, conn: Connection) -> Callable[..., Any]:
        return pg_insert if conn.dialect.name == "postgresql" else sqlite_insert

    def store(self, pending: Sequence[Pending]) -> list[Stored]:
        """Commit contributions in ONE transaction (group commit); receipts only after commit.

        One multi-row ``INSERT ... ON CONFLICT DO NOTHING`` per (up to) 100 rows; each row
        carries a fresh receipt (:func:`new_receipts`). When the database reports that every
        row was inserted (the common case) that is the whole transaction; otherwise the rows
        that landed are exactly the receipts found afterwards, and a row that did not land hit
        the nonce (replay) or the quota constraint.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the database is unavailable (nothing stored).
        """
        receipts = new_receipts(len(pending))
        rows = [
            (
                p.contribution.channel_id,
                p.contribution.crowd_id,
                p.contribution.epoch,
                p.client_id,
                p.contribution.nonce,
                pack_fragments(p.contribution.fragments),
                len(p.contribution.fragments),
                p.received_at,
                receipt,
            )
            for p, receipt in zip(pending, receipts, strict=True)
        ]
        c = storage.contributions.c
        with self.engine.begin() as conn:
            inserted = self._insert_rows(conn, rows)
            if inserted == len(rows):
                landed, taken = set(receipts), set()
            else:
                landed = set(
                    conn.execute(select(c.receipt).where(c.receipt.in_(receipts))).scalars()
                )
                missing = [row[_NONCE] for row in rows if row[_RECEIPT] not in landed]
                taken = set(conn.execute(select(c.nonce).where(c.nonce.in_(missing))).scalars())
        return [self._outcome(row, landed, taken) for row in rows]

    def _insert_rows(self, conn: Connection, rows: list[tuple[Any, ...]]) -> int:
        """Insert, skipping conflicting rows; returns how many rows were inserted, or -1 when
        the driver cannot tell (then the caller looks the receipts up).

        The SQL is written once per (placeholder style, row count) and sent as is: per-row
        SQLAlchemy compilation and type processing cost more than the insert itself, and one
        statement per chunk is one round trip (and one GIL release) instead of one per row.
        """
        mark = _PLACEHOLDERS.get(conn.dialect.paramstyle)
        if mark is None:
            conn.execute(
                self._insert(conn)(storage.contributions).on_conflict_do_nothing(),
                [dict(zip(_COLUMNS, row, strict=True)) for row in rows],
            )
            return -1
        inserted = 0
        for start in range(0, len(rows), _ROWS_PER_STATEMENT):
            chunk = rows[start : start + _ROWS_PER_STATEMENT]
            result = conn.exec_driver_sql(
                _insert_sql(mark, len(chunk)), tuple(value for row in chunk for value in row)
            )
            if result.rowcount is None or result.rowcount < 0:
                return -1
            inserted += result.rowcount
        return inserted

    @staticmethod
    def _outcome(row: tuple[Any, ...], landed: set[str], taken: set[bytes]) -> Stored:
        if row[_RECEIPT] in landed:
            return Stored(row[_RECEIPT])
        if row[_NONCE] in taken:
            return Stored(None, RejectedError(409, "replayed_nonce", "nonce already used"))
        detail = "one contribution per (client, channel, crowd, epoch) already received"
        return Stored(None, RejectedError(409, "quota_exceeded", detail))

    def revoke(self, client_id: str) -> None:
        """Revoke a client id (persisted, effective immediately in this process)."""
        with self.engine.begin() as conn:
            conn.execute(make_revocation(conn, client_id, self.clock()))
        self.tokens.revoked.add(client_id)

    # --- batching -------------------------------------------------------------------------

    def due_groups(self, now: float) -> list[tuple[str, str, int, bool]]:
        """(channel, crowd, epoch, final) groups to evaluate: closed epochs, or full parts."""
        due = []
        c = storage.contributions.c
        query = (
            select(c.channel_id, c.crowd_id, c.epoch, func.count())
            .where(c.held_part.is_(None))
            .group_by(c.channel_id, c.crowd_id, c.epoch)
        )
        with self.engine.connect() as conn:
            for channel_id, crowd_id, epoch, count in conn.execute(query):
                policy = self.settings.channel(channel_id)
                if policy is None:
                    continue
                closes_at = (epoch + 1) * policy.epoch_seconds + self.settings.epoch_grace_seconds
                if now >= closes_at or epoch <= self.closed_upto.get(channel_id, -1):
                    due.append((channel_id, crowd_id, int(epoch), True))
                elif count >= policy.max_batch:
                    due.append((channel_id, crowd_id, int(epoch), False))
        return due

    def evaluate(self, channel_id: str, crowd_id: str, epoch: int, final: bool) -> Deletion | None:
        """Apply Algorithm 3 to one group and store its batch, all in one transaction."""
        policy = self.settings.channel(channel_id)
        if policy is None:
            return None
        now = self.clock()
        c = storage.contributions.c
        with self.engine.begin() as conn:
            part = conn.execute(
                select(func.count())
                .select_from(storage.groups)
                .where(
                    storage.groups.c.channel_id == channel_id,
                    storage.groups.c.crowd_id == crowd_id,
                    storage.groups.c.epoch == epoch,
                )
            ).scalar_one()
            rows = conn.execute(
                select(c.id, c.fragments)
                .where(
                    c.channel_id == channel_id,
                    c.crowd_id == crowd_id,
                    c.epoch == epoch,
                    c.held_part.is_(None),
                )
                .order_by(c.id)
                .limit(policy.max_batch)
            ).all()
            if not rows or (not final and len(rows) < policy.max_batch):
                return None
            outcome = randomized_deletion(len(rows), policy)
            ids = [row[0] for row in rows]
            if outcome.status == "held":
                conn.execute(
                    update(storage.contributions).where(c.id.in_(ids)).values(held_part=part)
                )
            else:
                if outcome.status == "released":
                    order = list(range(len(rows)))
                    secure_shuffle(order)
                    survivors = [rows[i][1] for i in order[: outcome.kept]]
                    self._store_batch(conn, channel_id, crowd_id, epoch, survivors, now)
                _delete_ids(conn, ids)
            conn.execute(
                insert(storage.groups).values(
                    channel_id=channel_id,
                    crowd_id=crowd_id,
                    epoch=epoch,
                    part=part,
                    status=outcome.status,
                    n=outcome.n,
                    kept=outcome.kept,
                    deleted=outcome.deleted,
                    evaluated_at=now,
                )
            )
        self._count(f"group_{outcome.status}")
        self._count(
            "deleted_by_randomized_deletion", outcome.deleted if outcome.status == "released" else 0
        )
        self._count("deleted_by_abort", outcome.deleted if outcome.status == "aborted" else 0)
        log.info(
            "group evaluated",
            extra={
                "channel": channel_id,
                "epoch": epoch,
                "part": part,
                "status": outcome.status,
                "n": outcome.n,
                "kept": outcome.kept,
            },
        )
        return outcome

    def _store_batch(
        self,
        conn: Connection,
        channel_id: str,
        crowd_id: str,
        epoch: int,
        survivors: list[bytes],
        now: float,
    ) -> str:
        fragments = [f for blob in survivors for f in unpack_fragments(blob)]
        secure_shuffle(fragments)
        batch = Batch(
            batch_id=secrets.token_hex(16),
            shuffler_id=self.settings.shuffler_id,
            channel_id=channel_id,
            crowd_id=crowd_id,
            epoch=epoch,
            n_contributions=len(survivors),
            fragments=[b64(f) for f in fragments],
        )
        body = batch.body()
        conn.execute(
            insert(storage.batches).values(
                batch_id=batch.batch_id,
                channel_id=channel_id,
                epoch=epoch,
                n_contributions=len(survivors),
                body=body,
                signature=b64(sign(body, self.signing_key)),
                status="pending",
                created_at=now,
                attempts=0,
                next_attempt_at=now,
            )
        )
        self._count("batches_released")
        return batch.batch_id

    def run_batching(self) -> int:
        """Evaluate every due group; returns how many were evaluated.

        Serialized within the process (the periodic batcher and an admin close may overlap);
        across replicas the groups table's primary key lets exactly one evaluation commit.
        """
        count = 0
        with self._batching:
            for channel_id, crowd_id, epoch, final in self.due_groups(self.clock()):
                while self._evaluate_once(channel_id, crowd_id, epoch, final) is not None:
                    count += 1
                    if final:
                        break
        return count

    def _evaluate_once(
        self, channel_id: str, crowd_id: str, epoch: int, final: bool
    ) -> Deletion | None:
        try:
            return self.evaluate(channel_id, crowd_id, epoch, final)
        except IntegrityError:
            log.info(
                "group already evaluated by another worker",
                extra={"channel": channel_id, "epoch": epoch},
            )
            return None

    def close(self, channel_id: str, epoch: int) -> int:
        """Close every epoch <= ``epoch`` of a channel now (admin, demo); returns groups done."""
        with self.engine.begin() as conn:
            exists = conn.execute(
                select(storage.closed_epochs.c.epoch).where(
                    storage.closed_epochs.c.channel_id == channel_id,
                    storage.closed_epochs.c.epoch == epoch,
                )
            ).first()
            if exists is None:
                conn.execute(
                    insert(storage.closed_epochs).values(
                        channel_id=channel_id, epoch=epoch, closed_at=self.clock()
                    )
                )
        self.closed_upto[channel_id] = max(epoch, self.closed_upto.get(channel_id, -1))
        return self.run_batching()

    # --- forwarding -----------------------------------------------------------------------

    def forward_due(self, client: httpx.Client) -> dict[str, int]:
        """POST every due batch to the analyzer; backoff with jitter on failure."""
        result = {"forwarded": 0, "retried": 0, "failed": 0}
        if not self.settings.analyzer_url:
            return result
        now = self.clock()
        b = storage.batches.c
        with self.engine.connect() as conn:
            due = conn.execute(
                select(b.batch_id, b.body, b.signature, b.attempts)
                .where(b.status == "pending", b.next_attempt_at <= now)
                .order_by(b.created_at)
                .limit(32)
            ).all()
        url = self.settings.analyzer_url.rstrip("/") + "/v1/batches"
        for batch_id, body, signature, attempts in due:
            outcome, error = _post(client, url, body, signature)
            changes: dict[str, Any]
            if outcome == "ok":
                changes = {"status": "forwarded", "forwarded_at": self.clock(), "last_error": None}
            elif outcome == "permanent":
                changes = {"status": "failed", "last_error": error}
                log.error(
                    "batch rejected by analyzer", extra={"batch_id": batch_id, "reason": error}
                )
            else:
                delay = min(
                    self.settings.backoff_cap_seconds,
                    self.settings.backoff_base_seconds * 2**attempts,
                )
                delay *= 0.5 + _uniform_open()
                changes = {
                    "attempts": attempts + 1,
                    "next_attempt_at": self.clock() + delay,
                    "last_error": error,
                }
                log.warning(
                    "forward failed, will retry",
                    extra={"batch_id": batch_id, "attempt": attempts + 1, "reason": error},
                )
            with self.engine.begin() as conn:
                conn.execute(
                    update(storage.batches).where(b.batch_id == batch_id).values(**changes)
                )
            key = {"ok": "forwarded", "permanent": "failed", "retry": "retried"}[outcome]
            result[key] += 1
            self._count(f"batches_{key}")
        return result

    # --- retention ------------------------------------------------------------------------

    def purge(self) -> int:
        """Delete held, pending and undelivered data older than the retention period."""
        cutoff = self.clock() - self.settings.retention_seconds
        c, b = storage.contributions.c, storage.batches.c
        with self.engine.begin() as conn:
            old = conn.execute(select(c.id).where(c.received_at < cutoff)).scalars().all()
            stale = conn.execute(
                select(b.batch_id, b.n_contributions).where(
                    b.status != "forwarded", b.created_at < cutoff
                )
            ).all()
            if old:
                _delete_ids(conn, list(old))
            if stale:
                conn.execute(delete(storage.batches).where(b.batch_id.in_([s[0] for s in stale])))
            total = len(old) + sum(s[1] for s in stale)
            if total:
                conn.execute(
                    insert(storage.purges).values(
                        reason="retention", contributions=total, purged_at=self.clock()
                    )
                )
        if total:
            log.info("retention purge", extra={"contributions": total})
            self._count("deleted_by_retention", total)
        return int(total)

    # --- bookkeeping ----------------------------------------------------------------------

    def ledger(self) -> dict[str, int]:
        """Where every acknowledged contribution went (for audits and tests)."""
        with self.engine.connect() as conn:

            def scalar(query: Any) -> int:
                return int(conn.execute(query).scalar_one() or 0)

            b, g = storage.batches.c, storage.groups.c
            return {
                "pending": scalar(
                    select(func.count())
                    .select_from(storage.contributions)
                    .where(storage.contributions.c.held_part.is_(None))
                ),
                "held": scalar(
                    select(func.count())
                    .select_from(storage.contributions)
                    .where(storage.contributions.c.held_part.is_not(None))
                ),
                "in_batches_forwarded": scalar(
                    select(func.sum(b.n_contributions)).where(b.status == "forwarded")
                ),
                "in_batches_unforwarded": scalar(
                    select(func.sum(b.n_contributions)).where(b.status != "forwarded")
                ),
                "deleted_by_algorithm_3": scalar(select(func.sum(g.deleted))),
                "purged": scalar(select(func.sum(storage.purges.c.contributions))),
            }


def _delete_ids(conn: Connection, ids: list[int]) -> None:
    for start in range(0, len(ids), 10_000):
        conn.execute(
            delete(storage.contributions).where(
                storage.contributions.c.id.in_(ids[start : start + 10_000])
            )
        )


def make_revocation(conn: Connection, client_id: str, now: float) -> Any:
    """Idempotent insert of a revocation."""
    make_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    return (
        make_insert(storage.revoked)
        .values(client_id=client_id, revoked_at=now)
        .on_conflict_do_nothing()
    )


def _post(client: httpx.Client, url: str, body: bytes, signature: str) -> tuple[str, str | None]:
    """("ok" | "retry" | "permanent", error). 4xx other than 408/429 will not heal by retrying."""
    try:
        response = client.post(
            url,
            content=body,
            headers={"ESA-Signature": signature, "Content-Type": "application/json"},
        )
    except httpx.HTTPError as error:
        return "retry", f"{type(error).__name__}: {error}"
    if response.is_success:
        return "ok", None
    reason = f"HTTP {response.status_code}: {response.text[:200]}"
    if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
        return "permanent", reason
    return "retry", reason
