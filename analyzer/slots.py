"""Slots for reading batch parts before their signature is checked, partitioned by sender.

A request takes a slot only once its head is vouched for by the shuffler it names
(``ESA-Preauth``, :mod:`common.preauth`, checked by
:meth:`analyzer.intake.BatchIntake.preauthorize`), so an unauthenticated sender never holds
one. Each registered shuffler id has its own ``intake_slots_per_shuffler`` slots: one
shuffler's parts never wait for another's. The server's body deadline (:mod:`runtime.deadlines`)
bounds how long any read holds a slot; all slots together bound what reads in progress can make
one worker process buffer (slots × registered shufflers × the largest part; times the worker
processes of a replica). Why and what is left: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from analyzer.errors import IntakeBusyError


class IntakeSlots:
    """``per_sender`` concurrent part reads for each sender id (used from one event loop)."""

    def __init__(self, per_sender: int) -> None:
        if per_sender < 1:
            raise ValueError(f"intake slots per sender must be >= 1, got {per_sender}")
        self.per_sender = per_sender
        self._held: dict[str, int] = {}

    def held(self, sender: str) -> int:
        """Slots of ``sender`` held now."""
        return self._held.get(sender, 0)

    @contextmanager
    def slot(self, sender: str) -> Iterator[None]:
        """Hold one slot of ``sender`` while the block runs (only registered ids whose head
        verified reach here, so the table is bounded by the registry).

        Raises:
            IntakeBusyError: every slot of that sender is held (503 ``busy``, Retry-After).
        """
        held = self._held.get(sender, 0)
        if held >= self.per_sender:
            raise IntakeBusyError(
                f"every intake slot of shuffler {sender[:64]!r} ({self.per_sender}) is reading "
                "a part; retry",
                retry_after=1.0,
            )
        self._held[sender] = held + 1
        try:
            yield
        finally:
            left = self._held[sender] - 1
            if left:
                self._held[sender] = left
            else:
                del self._held[sender]
