"""Forwarding (docs/protocol.md, "Delivery guarantees"): POST every due batch part to the analyzer,
at least once, by exactly one forwarder at a time, with the shared backoff policy
(:mod:`common.retry`), resumed after restarts.

A part leaves as the exact bytes it was signed over (``ESA-Signature``, made again with the
shuffler's current signing key when it has one: a part staged before a key rotation is sent
signed by the key the analyzer now follows), with an ``ESA-Preauth`` head signed for this send
(:mod:`common.preauth`: the analyzer gives a read slot only to a head the shuffler signed),
and the analyzer counts a (``batch_id``, ``part``)
once, so re-sending is safe. After a refusal of the part's content
(:data:`PERMANENT_REFUSALS`) the part is kept unsent until an admin requeues it; everything else
is retried with backoff (a ``future_epoch`` refusal too: it heals once the analyzer's clock
reaches the epoch). Leases and which refusals are permanent: docs/shuffler.md, "Forwarding".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from common.envelope import sign
from common.preauth import PREAUTH_HEADER, preauth_header
from common.randomness import RandomSource
from common.retry import Backoff, retry_after_seconds
from common.wire import BatchAck, b64
from runtime.failpoints import failpoint
from shuffler.records import DuePart, PartKey
from shuffler.store import ContributionStore

log = logging.getLogger("esa.shuffler")
#: Characters of an analyzer's refusal kept as the part's ``last_error``.
ERROR_EXCERPT = 200
#: Answers that refuse the signed bytes themselves (docs/protocol.md, "Batches and parts": 400
#: malformed, 422 below the minimum crowd or inconsistent counts); re-sending the same bytes
#: cannot heal them.
PERMANENT_REFUSALS = frozenset({400, 422})
#: Error codes of a :data:`PERMANENT_REFUSALS` status that time heals, retried with backoff:
#: ``future_epoch``, the part's epoch starts later than the analyzer's clock plus its skew (this
#: shuffler's clock ahead, or an admin close of the next epoch); it is taken once the
#: analyzer's clock reaches the epoch.
RETRIED_REFUSALS = frozenset({"future_epoch"})
TOO_LARGE = 413


class Outcome(StrEnum):
    """What one attempt to forward a part came to."""

    FORWARDED = "forwarded"
    RETRIED = "retried"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One POST's outcome; ``wait`` is the analyzer's ``Retry-After`` when it sent one."""

    outcome: Outcome
    error: str | None = None
    wait: float | None = None
    status: int | None = None


def post_part(
    client: httpx.Client, url: str, part: DuePart, shuffler_id: str, preauth: str | None = None
) -> Attempt:
    """POST one batch part signed by ``shuffler_id`` (with ``preauth`` as its ``ESA-Preauth``
    head, :mod:`common.preauth`); only :data:`PERMANENT_REFUSALS` fail it (but for
    :data:`RETRIED_REFUSALS`), anything else retries."""
    headers = {
        "ESA-Shuffler": shuffler_id,
        "ESA-Signature": part.signature,
        "Content-Type": "application/json",
    }
    if preauth is not None:
        headers[PREAUTH_HEADER] = preauth
    try:
        response = client.post(url, content=part.body, headers=headers)
    except httpx.HTTPError as error:
        return Attempt(Outcome.RETRIED, f"{type(error).__name__}: {error}")
    if response.is_success:
        _check_ack(response, part)
        return Attempt(Outcome.FORWARDED)
    status = response.status_code
    reason = f"HTTP {status}: {response.text[:ERROR_EXCERPT]}"
    if status in PERMANENT_REFUSALS and _error_code(response) not in RETRIED_REFUSALS:
        return Attempt(Outcome.FAILED, reason, status=status)
    return Attempt(Outcome.RETRIED, reason, retry_after_seconds(response.headers), status)


def _error_code(response: httpx.Response) -> str | None:
    """The ``error`` of the analyzer's JSON error body, None for any other body."""
    try:
        body = response.json()
    except ValueError:
        return None
    return str(body.get("error")) if isinstance(body, dict) else None


def _check_ack(response: httpx.Response, part: DuePart) -> None:
    """Read the analyzer's :class:`~common.wire.BatchAck`. A 2xx means the part is durably
    stored there whatever its body says, so an unreadable acknowledgement is only logged."""
    try:
        ack = BatchAck.model_validate_json(response.content)
    except ValidationError:
        log.warning("unreadable batch acknowledgement", extra={"batch_id": part.batch_id})
        return
    if ack.batch_id != part.batch_id:
        log.warning("acknowledgement names another batch", extra={"batch_id": part.batch_id})


class Forwarder:
    """Claims due parts in the store, sends them to the analyzer and records each outcome."""

    def __init__(
        self,
        shuffler_id: str,
        store: ContributionStore,
        analyzer_url: str | None,
        backoff: Backoff,
        rng: RandomSource,
        clock: Callable[[], float],
        lease_seconds: float,
        signer: Callable[[], Ed25519PrivateKey] | None = None,
    ) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.shuffler_id = shuffler_id
        self.store = store
        self.url = analyzer_url.rstrip("/") + "/v1/batches" if analyzer_url else None
        self.backoff = backoff
        self.rng = rng
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.signer = signer

    def forward_due(self, client: httpx.Client) -> dict[Outcome, int]:
        """One round: claim and POST every due part (one body in memory at a time); how many
        were forwarded, retried, failed. Parts another forwarder holds are skipped."""
        tally = dict.fromkeys(Outcome, 0)
        if self.url is None:
            return tally
        for key in self.store.due_parts(self.clock()):
            part = self.store.claim(key, self.clock(), self.lease_seconds)
            if part is None:
                continue
            failpoint("shuffler.forward.after_lease")
            preauth = None
            if self.signer is not None:
                signing = self.signer()
                part = replace(part, signature=b64(sign(part.body, signing)))
                preauth = preauth_header(self.shuffler_id, part.body, signing, self.clock())
            attempt = post_part(client, self.url, part, self.shuffler_id, preauth)
            if attempt.outcome is Outcome.FORWARDED:
                failpoint("shuffler.forward.after_post")
            self._record(part, attempt)
            tally[attempt.outcome] += 1
        return tally

    def _record(self, part: DuePart, attempt: Attempt) -> None:
        key, error = PartKey(part.batch_id, part.part), attempt.error or ""
        where = {"batch_id": part.batch_id, "part": part.part, "reason": error}
        if attempt.outcome is Outcome.FORWARDED:
            self.store.record_forwarded(key, self.clock())
        elif attempt.outcome is Outcome.FAILED:
            log.error(
                "batch part refused by analyzer: kept until requeued (esa admin requeue) or "
                "purged by retention",
                extra=where,
            )
            self.store.record_failed(key, error)
        else:
            delay = max(self.backoff.delay(part.attempts, self.rng), attempt.wait or 0.0)
            if attempt.status == TOO_LARGE:
                log.error(
                    "analyzer refused a batch part as too large; retrying (lower "
                    "ESA_SHUFFLER_PART_FRAGMENTS or raise the analyzer's limit)",
                    extra=where,
                )
            else:
                log.warning(
                    "forward failed, will retry", extra={**where, "attempt": part.attempts + 1}
                )
            self.store.record_retry(key, part.attempts + 1, self.clock() + delay, error)
