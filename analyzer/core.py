"""Analyzer core: plain Python over a SQLAlchemy engine, testable without HTTP.

Intake (PROTOCOL.md, ``POST /v1/batches``): the Ed25519 signature over the exact body must
verify against the registered key of the shuffler the body names (401 otherwise); batches
below the channel's minimum crowd, for unknown channels, or with more fragments than their
contributions can carry are inconsistent (422); a known ``batch_id`` is acknowledged again but
counted once. Every fragment is opened with any live analyzer key and parsed by the channel's
mechanism; fragments that fail either are counted as chaff, never fatal. The accumulator update
and the receipt commit in one transaction.

Releases: estimates over a range of epochs with standard errors and 95% intervals, and the
certified central (ε, δ) computed from the crowds actually received:

* histogram mechanisms (krappor, krr, zsum): each batch is shuffled separately, so a user's
  report hides in its own batch — certify at the smallest batch; epochs compose (a user sends
  at most one contribution per epoch), so a range release is certified by basic composition
  of its epochs;
* report fragments: shufflers run randomized deletion independently, so their batches hold
  different users; certified with ``rfrag_across_batches`` over the epoch's batches;
* longitudinal: a report hides among the reports of its level in its period and shuffler
  batch; only one report per user carries data, so a range is certified at the smallest such
  crowd in it (no composition over periods; MECHANISMS.md §3).

Every release is appended to the ledger.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError
from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from analyzer import storage
from analyzer.channels import ChannelRuntime
from analyzer.dashboard import png_gray
from common.accounting import BoundResult
from common.envelope import EnvelopeError, KeyRing, open_fragment, verify
from common.mechanisms import Estimate, LocalPrivacy, NoDataError, Received
from common.wire import Batch
from services.runtime.http import RejectedError

log = logging.getLogger("esa.analyzer")
#: Bins kept in a histogram release's stored summary (the API returns more on request).
SUMMARY_BINS = 50


@dataclass(frozen=True)
class Intake:
    """What happened to one batch."""

    batch_id: str
    duplicate: bool
    opened: int = 0
    invalid: int = 0


@dataclass(frozen=True)
class Release:
    """An estimate over ``[epoch_from, epoch_to]`` with its certificate."""

    channel_id: str
    epoch_from: int
    epoch_to: int
    estimate: Estimate
    certificate: BoundResult
    other_notion: BoundResult | None
    crowds: dict[str, int]
    add_remove: BoundResult | None = None
    lower: BoundResult | None = None
    local: LocalPrivacy | None = None

    def as_dict(self, top: int | None = None) -> dict[str, Any]:
        """JSON-ready release (``top`` limits histogram bins to the largest estimates)."""
        lo, hi = self.estimate.interval()
        index = self.estimate.top(top) if top else np.arange(self.estimate.values.size)
        return {
            "channel_id": self.channel_id,
            "epochs": [self.epoch_from, self.epoch_to],
            "n": self.estimate.n,
            "bins": [int(i) for i in index],
            "values": [float(self.estimate.values[i]) for i in index],
            "std_errors": [float(self.estimate.std_errors[i]) for i in index],
            "ci95": [[float(lo[i]), float(hi[i])] for i in index],
            "note": self.estimate.note,
            "certificate": self.certificate.as_dict(),
            "other_notion": None if self.other_notion is None else self.other_notion.as_dict(),
            "with_randomized_deletion": None
            if self.add_remove is None
            else self.add_remove.as_dict(),
            "lower_bound": None if self.lower is None else self.lower.as_dict(),
            "local": None
            if self.local is None
            else {
                "removal": self.local.removal,
                "replacement": self.local.replacement,
                "eps_l_inf": self.local.eps_l_inf,
                "eps_l1": self.local.eps_l1,
                "note": self.local.note,
            },
            "crowds": self.crowds,
        }


class AnalyzerCore:
    """Everything the analyzer does, over one database."""

    def __init__(
        self,
        engine: Engine,
        ring: KeyRing,
        channels: dict[str, ChannelRuntime],
        shufflers: dict[str, Ed25519PublicKey],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.ring = ring
        self.channels = channels
        self.shufflers = shufflers
        self.clock = clock
        self.events: dict[str, int] = {}
        self._storing = threading.Lock()

    def _count(self, event: str, amount: int = 1) -> None:
        self.events[event] = self.events.get(event, 0) + amount

    # --- intake ---------------------------------------------------------------------------

    def _verified(self, body: bytes, signature: str) -> Batch:
        try:
            batch = Batch.model_validate_json(body)
        except ValidationError as error:
            raise RejectedError(400, "malformed", f"not a batch: {error.errors()[:2]}") from error
        key = self.shufflers.get(batch.shuffler_id)
        if key is None:
            raise RejectedError(
                401, "unknown_shuffler", f"shuffler {batch.shuffler_id!r} is not registered"
            )
        try:
            raw = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError) as error:
            raise RejectedError(401, "bad_signature", "ESA-Signature is not base64") from error
        if not verify(body, raw, key):
            raise RejectedError(401, "bad_signature", "signature does not verify for this shuffler")
        return batch

    def _runtime(self, batch: Batch) -> ChannelRuntime:
        runtime = self.channels.get(batch.channel_id)
        if runtime is None:
            raise RejectedError(
                422, "unknown_channel", f"channel {batch.channel_id!r} is not configured"
            )
        config = runtime.config
        if batch.n_contributions < config.min_crowd:
            raise RejectedError(
                422,
                "below_min_crowd",
                f"batch of {batch.n_contributions} contributions < min_crowd={config.min_crowd}",
            )
        if len(batch.fragments) > batch.n_contributions * config.max_fragments:
            raise RejectedError(
                422,
                "inconsistent_counts",
                f"{len(batch.fragments)} fragments cannot come from {batch.n_contributions} "
                f"contributions of at most {config.max_fragments} fragments",
            )
        return runtime

    def accept(self, body: bytes, signature: str) -> Intake:
        """Verify, open and accumulate one batch (idempotent by ``batch_id``).

        Raises:
            RejectedError: 400 malformed, 401 unknown shuffler or bad signature, 422
                inconsistent batch.
        """
        batch = self._verified(body, signature)
        runtime = self._runtime(batch)
        if self._known(batch.batch_id):
            self._count("batches_duplicate")
            return Intake(batch.batch_id, True)
        opened, undecryptable = [], 0
        for text in batch.fragments:
            try:
                opened.append(open_fragment(base64.b64decode(text), batch.channel_id, self.ring))
            except (EnvelopeError, binascii.Error, ValueError):
                undecryptable += 1
        stored = self._store_once(batch, runtime, opened)
        if stored is None:
            self._count("batches_duplicate")
            return Intake(batch.batch_id, True)
        invalid = undecryptable + stored
        self._count("batches_accepted")
        self._count("fragments_opened", len(opened))
        self._count("fragments_invalid", invalid)
        log.info(
            "batch accepted",
            extra={
                "batch_id": batch.batch_id,
                "channel": batch.channel_id,
                "epoch": batch.epoch,
                "n": batch.n_contributions,
                "invalid": invalid,
            },
        )
        return Intake(batch.batch_id, False, len(opened) - (invalid - undecryptable), invalid)

    def _store_once(self, batch: Batch, runtime: ChannelRuntime, opened: list[bytes]) -> int | None:
        """Store the batch; None if its receipt already exists (a concurrent duplicate).

        An integrity conflict is a duplicate only if the receipt is there; otherwise another
        worker created the same accumulator row first, and the store is retried (its
        transaction rolled back, so nothing was counted twice).
        """
        for _ in range(5):
            try:
                with self._storing:
                    return self._store(batch, runtime, opened)
            except IntegrityError:
                if self._known(batch.batch_id):
                    return None
        raise RejectedError(503, "storage_conflict", "could not store the batch; retry later")

    def _known(self, batch_id: str) -> bool:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(storage.receipts.c.batch_id).where(storage.receipts.c.batch_id == batch_id)
            ).first()
        return row is not None

    def _store(self, batch: Batch, runtime: ChannelRuntime, opened: list[bytes]) -> int:
        a = storage.accumulators.c
        key = (
            a.channel_id == batch.channel_id,
            a.crowd_id == batch.crowd_id,
            a.epoch == batch.epoch,
            a.shuffler_id == batch.shuffler_id,
        )
        with self.engine.begin() as conn:
            conn.execute(
                insert(storage.receipts).values(
                    batch_id=batch.batch_id,
                    shuffler_id=batch.shuffler_id,
                    channel_id=batch.channel_id,
                    crowd_id=batch.crowd_id,
                    epoch=batch.epoch,
                    n_contributions=batch.n_contributions,
                    n_fragments=len(batch.fragments),
                    invalid=0,
                    received_at=self.clock(),
                )
            )
            query = select(a.state, a.batches).where(*key)
            if conn.dialect.name == "postgresql":
                query = query.with_for_update()
            row = conn.execute(query).first()
            accumulator = runtime.new_accumulator() if row is None else runtime.load(row[0])
            invalid = runtime.add(accumulator, opened, batch.n_contributions, batch.shuffler_id)
            if row is None:
                conn.execute(
                    insert(storage.accumulators).values(
                        channel_id=batch.channel_id,
                        crowd_id=batch.crowd_id,
                        epoch=batch.epoch,
                        shuffler_id=batch.shuffler_id,
                        state=accumulator.to_bytes(),
                        batches=1,
                    )
                )
            else:
                conn.execute(
                    update(storage.accumulators)
                    .where(*key)
                    .values(state=accumulator.to_bytes(), batches=row[1] + 1)
                )
            conn.execute(
                update(storage.receipts)
                .where(storage.receipts.c.batch_id == batch.batch_id)
                .values(invalid=invalid)
            )
        return invalid

    # --- releases -------------------------------------------------------------------------

    def release(
        self, channel_id: str, epoch_from: int, epoch_to: int, crowd_id: str = ""
    ) -> Release:
        """Estimate over the epochs with its certificate, appended to the ledger.

        Raises:
            RejectedError: 404 unknown channel, or no batch received in the range.
        """
        runtime = self.channels.get(channel_id)
        if runtime is None:
            raise RejectedError(404, "unknown_channel", f"channel {channel_id!r} is not configured")
        a, r = storage.accumulators.c, storage.receipts.c
        in_range = (
            a.channel_id == channel_id,
            a.crowd_id == crowd_id,
            a.epoch >= epoch_from,
            a.epoch <= epoch_to,
        )
        with self.engine.connect() as conn:
            rows = conn.execute(select(a.epoch, a.shuffler_id, a.state).where(*in_range)).all()
            batches = conn.execute(
                select(r.epoch, r.shuffler_id, r.n_contributions).where(
                    r.channel_id == channel_id,
                    r.crowd_id == crowd_id,
                    r.epoch >= epoch_from,
                    r.epoch <= epoch_to,
                )
            ).all()
        if not rows:
            raise RejectedError(
                404,
                "no_data",
                f"no batch received for {channel_id!r} in epochs [{epoch_from}, {epoch_to}]",
            )
        states = [(int(e), s, runtime.load(state)) for e, s, state in rows]
        merged = states[0][2]
        for _, _, accumulator in states[1:]:
            merged = merged.merge(accumulator)
        estimate = runtime.estimate(merged)
        sizes: dict[tuple[int, str], list[int]] = {}
        for epoch, shuffler_id, n in batches:
            sizes.setdefault((int(epoch), shuffler_id), []).append(int(n))
        received = [
            Received(e, s, tuple(sizes.get((e, s), ())), acc, runtime.source(s))
            for e, s, acc in states
        ]
        try:
            certs = runtime.certify(received)
        except NoDataError as error:
            raise RejectedError(404, "no_data", f"{channel_id!r}: {error}") from error
        config = runtime.config
        release = Release(
            channel_id,
            epoch_from,
            epoch_to,
            estimate,
            certs.certified,
            certs.other,
            certs.crowds,
            certs.with_deletion(config.eps_cr, config.delta_cr),
            certs.lower,
            runtime.local_privacy(),
        )
        certificate, other = certs.certified, certs.other
        image = None
        if config.display == "image" and config.image_shape is not None:
            image = png_gray(estimate.values, config.image_shape)
        record = {
            "certificate": certificate.as_dict(),
            "other_notion": None if other is None else other.as_dict(),
        }
        top = None if config.display == "series" else SUMMARY_BINS
        with self.engine.begin() as conn:
            conn.execute(
                insert(storage.releases).values(
                    channel_id=channel_id,
                    epoch_from=epoch_from,
                    epoch_to=epoch_to,
                    n=estimate.n,
                    certificate=json.dumps(record),
                    summary=json.dumps(release.as_dict(top)),
                    image=image,
                    released_at=self.clock(),
                )
            )
        self._count("releases")
        return release


def ledger_rows(engine: Engine, channel_id: str) -> list[dict[str, Any]]:
    """The privacy ledger of a channel with cumulative (basic composition) ε and δ."""
    r = storage.releases.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(r.id, r.epoch_from, r.epoch_to, r.n, r.certificate, r.released_at)
            .where(r.channel_id == channel_id)
            .order_by(r.id)
        ).all()
    out, eps_sum, delta_sum = [], 0.0, 0.0
    for row in rows:
        cert = json.loads(row.certificate)["certificate"]
        eps_sum += cert["eps"]
        delta_sum += cert["delta"]
        out.append(
            {
                "id": row.id,
                "epochs": [row.epoch_from, row.epoch_to],
                "n": row.n,
                "eps": cert["eps"],
                "delta": cert["delta"],
                "method": cert["method"],
                "neighbouring": cert["neighbouring"],
                "cumulative_eps": eps_sum,
                "cumulative_delta": min(delta_sum, 1.0),
                "released_at": row.released_at,
            }
        )
    return out


def latest_release(engine: Engine, channel_id: str) -> tuple[dict[str, Any], bytes | None] | None:
    """The most recent release's summary and image, if any."""
    r = storage.releases.c
    with engine.connect() as conn:
        row = conn.execute(
            select(r.summary, r.image)
            .where(r.channel_id == channel_id)
            .order_by(r.id.desc())
            .limit(1)
        ).first()
    return None if row is None else (json.loads(row.summary), row.image)
