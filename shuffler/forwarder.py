"""Forwarding (PROTOCOL.md, "Delivery guarantees"): POST every due batch to the analyzer, at
least once, with the shared backoff policy (:mod:`common.retry`), resumed after restarts.

A batch leaves the shuffler as the exact bytes it was signed over, with its Ed25519 signature in
``ESA-Signature``; the analyzer counts a ``batch_id`` once, so re-sending after a lost answer is
safe. A permanent refusal (a 4xx that retrying cannot heal) marks the batch failed and is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import httpx
from pydantic import ValidationError

from common.randomness import RandomSource
from common.retry import Backoff, retry_after_seconds, retryable_status
from common.wire import BatchAck
from shuffler.records import DueBatch
from shuffler.store import ContributionStore

log = logging.getLogger("esa.shuffler")
#: Characters of an analyzer's refusal kept as the batch's ``last_error``.
ERROR_EXCERPT = 200


class Outcome(StrEnum):
    """What one attempt to forward a batch came to."""

    FORWARDED = "forwarded"
    RETRIED = "retried"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One POST's outcome; ``wait`` is the analyzer's ``Retry-After`` when it sent one."""

    outcome: Outcome
    error: str | None = None
    wait: float | None = None


def post_batch(client: httpx.Client, url: str, batch: DueBatch) -> Attempt:
    """POST one batch; classify the answer with :func:`common.retry.retryable_status`."""
    headers = {"ESA-Signature": batch.signature, "Content-Type": "application/json"}
    try:
        response = client.post(url, content=batch.body, headers=headers)
    except httpx.HTTPError as error:
        return Attempt(Outcome.RETRIED, f"{type(error).__name__}: {error}")
    if response.is_success:
        _check_ack(response, batch.batch_id)
        return Attempt(Outcome.FORWARDED)
    reason = f"HTTP {response.status_code}: {response.text[:ERROR_EXCERPT]}"
    if retryable_status(response.status_code):
        return Attempt(Outcome.RETRIED, reason, retry_after_seconds(response.headers))
    return Attempt(Outcome.FAILED, reason)


def _check_ack(response: httpx.Response, batch_id: str) -> None:
    """Read the analyzer's :class:`~common.wire.BatchAck`. A 2xx means the part is durably
    stored there whatever its body says, so an unreadable acknowledgement is only logged."""
    try:
        ack = BatchAck.model_validate_json(response.content)
    except ValidationError:
        log.warning("unreadable batch acknowledgement", extra={"batch_id": batch_id})
        return
    if ack.batch_id != batch_id:
        log.warning("acknowledgement names another batch", extra={"batch_id": batch_id})


class Forwarder:
    """Sends due batches from the store to the analyzer and records each outcome."""

    def __init__(
        self,
        store: ContributionStore,
        analyzer_url: str | None,
        backoff: Backoff,
        rng: RandomSource,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.url = analyzer_url.rstrip("/") + "/v1/batches" if analyzer_url else None
        self.backoff = backoff
        self.rng = rng
        self.clock = clock

    def forward_due(self, client: httpx.Client) -> dict[Outcome, int]:
        """One round: POST every due batch; how many were forwarded, retried, failed."""
        tally = dict.fromkeys(Outcome, 0)
        if self.url is None:
            return tally
        for batch in self.store.due_batches(self.clock()):
            attempt = post_batch(client, self.url, batch)
            self._record(batch, attempt)
            tally[attempt.outcome] += 1
        return tally

    def _record(self, batch: DueBatch, attempt: Attempt) -> None:
        error = attempt.error or ""
        if attempt.outcome is Outcome.FORWARDED:
            self.store.record_forwarded(batch.batch_id, self.clock())
        elif attempt.outcome is Outcome.FAILED:
            log.error(
                "batch rejected by analyzer", extra={"batch_id": batch.batch_id, "reason": error}
            )
            self.store.record_failed(batch.batch_id, error)
        else:
            delay = max(self.backoff.delay(batch.attempts, self.rng), attempt.wait or 0.0)
            log.warning(
                "forward failed, will retry",
                extra={"batch_id": batch.batch_id, "attempt": batch.attempts + 1, "reason": error},
            )
            self.store.record_retry(batch.batch_id, batch.attempts + 1, self.clock() + delay, error)
