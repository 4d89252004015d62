"""Opening stored batch parts in the background, so intake never waits on HPKE.

:class:`PartOpener` opens each part :mod:`analyzer.intake` stored, on a pool of processes
(:class:`FragmentOpener`: HPKE opening is the analyzer's bottleneck), and folds it with
:meth:`AnalyzerStore.fold_part`, which marks it opened in the same transaction: after a crash a
part is opened again from scratch, never counted twice. The pool opens one part ahead while the
part in hand is folded; memory is bounded by two parts plus one accumulator. A part whose
opening fails :data:`OPEN_ATTEMPTS` times is quarantined (never folded in, so its batch stays
incomplete); failures of the database are not the part's fault and count against none.

Paging, retries and quarantine: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from analyzer.channels import ChannelRuntime
from analyzer.errors import StorageConflictError
from analyzer.metrics import AnalyzerEvents
from analyzer.records import Completion, Folded, PartHeader, ReceivedRange
from analyzer.store import AnalyzerStore
from common.envelope import EnvelopeError, FragmentContext, KeyRing, open_fragment, seal_key
from common.wire import Batch
from runtime.failpoints import failpoint

log = logging.getLogger("esa.analyzer")

#: Failed openings after which a stored part is quarantined (a part that cannot be
#: opened is neither retried forever nor allowed to hold up the parts behind it).
OPEN_ATTEMPTS = 5

#: How often a pool worker checks that the analyzer that started it is still there.
PARENT_CHECK_SECONDS = 1.0

#: How long :meth:`FragmentOpener.warm` waits for every worker process to have started.
WARM_TIMEOUT_SECONDS = 60.0
WARM_TASK_SECONDS = 0.05

#: The key ring of a pool worker process and the raw keys it was built from (rebuilt when a
#: task brings other keys: a rotation).
_worker_ring: KeyRing | None = None
_worker_keys: tuple[bytes, ...] = ()


#: An opened fragment: its seal key (:func:`common.envelope.seal_key`, which no two honestly
#: sealed fragments share) and its plaintext.
Opened = tuple[bytes, bytes]


def open_chunk(ring: KeyRing, info: bytes, texts: Sequence[str]) -> list[Opened]:
    """Open base64 sealed fragments bound to ``info`` (their batch's channel, epoch and crowd:
    :meth:`FragmentContext.info`), each with its seal key; the ones that fail are left out
    (chaff, or fragments sealed for another epoch or crowd, counted by the caller as the
    difference)."""
    opened = []
    for text in texts:
        try:
            blob = base64.b64decode(text)
            opened.append((seal_key(blob), open_fragment(blob, info, ring)))
        except (EnvelopeError, binascii.Error, ValueError):
            continue
    return opened


def _start_worker(parent: int) -> None:
    threading.Thread(
        target=_exit_with, args=(parent,), name="esa-parent-watch", daemon=True
    ).start()


def _exit_with(parent: int) -> None:
    """A worker ends when the analyzer that started it (``parent``, passed in rather than read
    here: it may have died while this worker was still starting) is gone. A crash or ``kill
    -9`` runs no shutdown, and the pool's workers would otherwise stay behind, idle, holding
    memory."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(0)


def _worker_pid() -> int:
    """A pool worker's process id, after a short pause so that one worker cannot answer every
    call of :meth:`FragmentOpener.warm` alone."""
    time.sleep(WARM_TASK_SECONDS)
    return os.getpid()


def _open_in_worker(keys: tuple[bytes, ...], info: bytes, texts: Sequence[str]) -> list[Opened]:
    global _worker_ring, _worker_keys
    if _worker_ring is None or keys != _worker_keys:
        ring = KeyRing()
        for key in keys:
            ring.add(X25519PrivateKey.from_private_bytes(key))
        _worker_ring, _worker_keys = ring, keys
    return open_chunk(_worker_ring, info, texts)


class OpeningTask:
    """Fragments being opened: their result is taken once, after which the task holds
    neither the sealed fragments nor the opened ones; :meth:`cancel` drops the chunks no
    worker has started (a pass that failed on the way)."""

    def __init__(self, answer: Callable[[], list[Opened]], futures: list[Future[list[Opened]]]):
        self._answer: Callable[[], list[Opened]] | None = answer
        self._futures = futures

    def result(self) -> list[Opened]:
        """The opened fragments with their seal keys, in order (waits for the pool).

        Raises:
            RuntimeError: the result was taken already.
        """
        answer, self._answer = self._answer, None
        if answer is None:
            raise RuntimeError("an opening's result is taken once")
        try:
            return answer()
        finally:
            self._futures = []

    def cancel(self) -> None:
        """Drop the chunks no worker has started, and the task's hold on every chunk."""
        for future in self._futures:
            future.cancel()
        self._answer, self._futures = None, []


class FragmentOpener:
    """Opens fragments in chunks of ``chunk`` on ``processes`` worker processes (in this
    process when ``processes`` is 1), with the keys ``ring`` holds at each call: every task
    carries them, so a rotation (:class:`analyzer.config.AnalyzerKeys` refills the ring)
    reaches the workers without a restart."""

    def __init__(self, ring: KeyRing, processes: int, chunk: int) -> None:
        if processes < 1 or chunk < 1:
            raise ValueError(f"need processes >= 1 and chunk >= 1, got {processes}, {chunk}")
        self.ring = ring
        self.processes = processes
        self.chunk = chunk
        self._pool = self._start() if processes > 1 else None

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.processes,
            mp_context=get_context("spawn"),
            initializer=_start_worker,
            initargs=(os.getpid(),),
        )

    def warm(self, timeout: float = WARM_TIMEOUT_SECONDS) -> int:
        """Start every worker process now and return once each has started (or
        after ``timeout`` seconds, or if a worker died: then :meth:`open` starts the pool
        afresh); how many answered. Without it the pool starts its processes at the first
        part, whose opening then waits for them: ~2–4 s on a loaded 2-core machine, more than
        opening the part (docs/benchmarks.md, "Replicas and analyzer workers")."""
        if self._pool is None:
            return 1
        deadline, answered = time.monotonic() + timeout, set[int]()
        try:
            while len(answered) < self.processes and time.monotonic() < deadline:
                calls = [self._pool.submit(_worker_pid) for _ in range(self.processes)]
                for call in calls:
                    answered.add(call.result(timeout=max(0.0, deadline - time.monotonic())))
        except (TimeoutError, BrokenProcessPool) as error:
            log.warning("opening processes not all started", extra={"error": type(error).__name__})
        return len(answered)

    def open(self, context: FragmentContext, texts: Sequence[str]) -> list[Opened]:
        """The opened fragments, in order (those that do not open for ``context`` left out).

        Raises:
            BrokenProcessPool: if a worker died; the pool is started afresh for the next call.
        """
        return self.submit(context, texts).result()

    def submit(self, context: FragmentContext, texts: Sequence[str]) -> OpeningTask:
        """Start opening ``texts`` on the pool, so the caller can prepare the next part
        meanwhile; the task's :meth:`OpeningTask.result` is :meth:`open`'s answer (in this
        process the opening happens when the result is asked for).

        Raises (from the result):
            BrokenProcessPool: if a worker died; the pool is started afresh for the next call.
        """
        info, pool = context.info(), self._pool
        if pool is None:
            return OpeningTask(lambda: open_chunk(self.ring, info, texts), [])
        keys = tuple(k.private_bytes_raw() for k in self.ring.keys.values())
        try:
            futures = [
                pool.submit(_open_in_worker, keys, info, texts[i : i + self.chunk])
                for i in range(0, len(texts), self.chunk)
            ]
        except BrokenProcessPool:
            self._restart(pool)
            raise

        def answer() -> list[Opened]:
            try:
                return [fragment for future in futures for fragment in future.result()]
            except BrokenProcessPool:
                self._restart(pool)
                raise

        return OpeningTask(answer, futures)

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        """Start the pool afresh, unless an earlier failure of ``broken`` did already."""
        if self._pool is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self._pool = self._start()

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Opening:
    """A part being opened: its header and channel, how many fragments it carries, what
    waits for them opened, and the lock that keeps other analyzer workers off it."""

    header: PartHeader
    runtime: ChannelRuntime
    fragments: int
    task: OpeningTask
    lock: contextlib.ExitStack


class PartOpener:
    """Opens stored parts and folds them in, from a background thread (:meth:`start`) or
    synchronously (:meth:`open_pending`)."""

    def __init__(
        self,
        store: AnalyzerStore,
        channels: Mapping[str, ChannelRuntime],
        opener: FragmentOpener,
        events: AnalyzerEvents,
        attempts: int = OPEN_ATTEMPTS,
    ) -> None:
        self.store = store
        self.channels = channels
        self.opener = opener
        self.events = events
        self.attempts = attempts
        events.gauge("parts_quarantined", store.quarantined_parts)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open_pending(self) -> int:
        """One pass over every part waiting to be opened, oldest first, a page at a time;
        returns how many were folded in. A part that fails is counted against it and left for
        the next pass (quarantined at :attr:`attempts` failures).

        The pool opens one part ahead: the next part is read, parsed and handed to the pool
        before the one in hand is folded, so the workers do not wait while this process reads
        and folds (an epoch benchmark measured the serial steps at ~12% of its time).

        Raises:
            sqlalchemy.exc.SQLAlchemyError, StorageConflictError: the database failed (no
                part is blamed; the pass starts over later).
        """
        folded, after = 0, None
        ahead: _Opening | None = None
        previous: _Opening | None = None
        try:
            while not self._stop.is_set() and (page := self.store.pending_parts(after=after)):
                for header in page:
                    if self._stop.is_set():  # stopping: the rest waits, stored, for next start
                        break
                    previous, ahead = ahead, self._begin(header)
                    if previous is not None:
                        folded += self._finish(previous)
                        previous = None  # folded: its fragments are no longer held
                after = page[-1]
            if ahead is not None:
                previous, ahead = ahead, None
                folded += self._finish(previous)
        finally:
            if ahead is not None:  # a failure on the way: this part is opened again later
                ahead.task.cancel()
                ahead.lock.close()
        return folded

    def _begin(self, header: PartHeader) -> _Opening | None:
        """Take the part (another analyzer worker opening it right now keeps it: it folds
        it, or its lock dies with it and a later pass takes the part over), read and parse
        it and start opening it; None if it is not this worker's, no longer waiting, or
        failed (counted against it)."""
        lock = contextlib.ExitStack()
        if not lock.enter_context(self.store.opening(header)):
            lock.close()
            return None
        try:
            started = self._start(header, lock)
        except Exception as error:
            with lock:  # the failure is recorded while the part is still this worker's
                self._charge(header, error)
                return None
        if started is None:
            lock.close()
        return started

    def _finish(self, opening: _Opening) -> int:
        """Wait for a started part's fragments and fold them in (1), or count its failure (0);
        its lock is released either way."""
        with opening.lock:
            try:
                return int(self._fold(opening))
            except Exception as error:
                self._charge(opening.header, error)
                return 0

    def _charge(self, header: PartHeader, error: Exception) -> None:
        """Count a failure against its part, unless it is the database's or the pool's
        (:func:`_transient`: raised again, no part blamed)."""
        if _transient(error):
            raise error
        self._failed(header, error)

    def _failed(self, header: PartHeader, error: Exception) -> None:
        where = {"batch_id": header.batch_id, "part": header.part, "channel": header.channel_id}
        log.warning("opening a stored part failed", exc_info=error, extra=where)
        self.events.count("part_open_failures")
        if self.store.record_failure(header, f"{type(error).__name__}: {error}", self.attempts):
            log.error(
                "batch part quarantined: its batch stays incomplete until an operator acts",
                extra={**where, "attempts": self.attempts, "error": str(error)},
            )

    def open_part(self, header: PartHeader) -> bool:
        """Open one stored part and fold it in; False if it is no longer waiting (opened, or
        quarantined) or its channel is no longer configured (it stays stored)."""
        with contextlib.ExitStack() as lock:
            opening = self._start(header, lock)
            return opening is not None and self._fold(opening)

    def _start(self, header: PartHeader, lock: contextlib.ExitStack) -> _Opening | None:
        """Read and parse a stored part and hand its fragments to the pool; None if it is no
        longer waiting or its channel is no longer configured (it stays stored)."""
        runtime = self.channels.get(header.channel_id)
        body = self.store.part_body(header)
        if runtime is None or body is None:
            return None
        fragments = Batch.model_validate_json(body).fragments
        context = FragmentContext(header.channel_id, header.epoch, header.crowd_id)
        task = self.opener.submit(context, fragments)
        return _Opening(
            header=header, runtime=runtime, fragments=len(fragments), task=task, lock=lock
        )

    def _fold(self, opening: _Opening) -> bool:
        """Fold a started part's opened fragments in; False if it was no longer waiting."""
        header, runtime = opening.header, opening.runtime
        opened = opening.task.result()
        undecryptable = opening.fragments - len(opened)
        failpoint("analyzer.fold.after_opening")
        folding = PartFold(runtime, header, [f for _, f in opened], undecryptable)
        keys = [key for key, _ in opened]
        folded = self.store.fold_part(header, folding, n_opened=len(opened), seal_keys=keys)
        if folded is None:
            return False
        self.events.count("parts_opened")
        self.events.count("fragments_opened", len(opened))
        self.events.count("fragments_invalid", folding.invalid)
        self.events.count("fragments_repeated", folding.repeated)
        if folded is Folded.BATCH:
            self.events.count("batches_accepted")
            self._check_crowd(header, folding.verified)
        return True

    def _check_crowd(self, header: PartHeader, verified: int) -> None:
        """Count and log a batch whose fragments verify fewer contributions than its shuffler
        claimed (a release certifies only the verified crowd). On a channel with a random
        fragment count every batch does, by a few percent (the verified crowd is a lower
        bound): a warning only when it is withheld."""
        short = header.n_contributions - verified
        if short <= 0:
            return
        withheld = verified < self.channels[header.channel_id].config.min_crowd
        self.events.count("batches_short_crowd")
        self.events.count("batches_withheld", int(withheld))
        self.events.count("crowd_shortfall", short)
        log.log(
            logging.WARNING if withheld else logging.INFO,
            "batch crowd not verified by its fragments: "
            + ("withheld (below min_crowd)" if withheld else "certified at the verified crowd"),
            extra={
                "batch_id": header.batch_id,
                "shuffler": header.shuffler_id,
                "channel": header.channel_id,
                "epoch": header.epoch,
                "claimed": header.n_contributions,
                "verified": verified,
            },
        )

    def wake(self) -> None:
        """A part was stored: open it soon."""
        self._wake.set()

    def start(self, poll_seconds: float) -> None:
        """Open parts in a background thread: stored ones first (resuming after a crash), then
        whenever :meth:`wake` is called or every ``poll_seconds``."""
        self._thread = threading.Thread(
            target=self._run, args=(poll_seconds,), name="esa-part-opener", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (after the part in hand and the one started ahead of it, both
        folded) and the worker processes."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.opener.close()

    def _run(self, poll_seconds: float) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.open_pending()
            except Exception:
                log.exception("opening stored parts failed; retrying")
            self._wake.wait(poll_seconds)


def _transient(error: Exception) -> bool:
    """A failure of the database, of concurrent writers or of the opening pool itself (a
    worker killed, memory exhausted: the pool restarts), not of the part being opened."""
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(
        error,
        OperationalError
        | InterfaceError
        | PoolTimeoutError
        | StorageConflictError
        | BrokenProcessPool
        | MemoryError,
    )


class PartFold:
    """One opened part's steps in its fold's transaction
    (:class:`analyzer.records.PartFolding`), over its channel's bound mechanism.

    Parts add fragments only: the crowd enters once, verified, when the batch completes
    (:meth:`complete`); a crowd below ``min_crowd`` is withheld, as a shuffler holds a group
    below it ("never released"). Fragments seen before in the epoch are left out and count as
    invalid. ``invalid``, ``repeated`` and ``verified`` are what the last run of each step
    computed: after the commit, those of the transaction that committed.
    """

    def __init__(
        self,
        runtime: ChannelRuntime,
        header: PartHeader,
        opened: Sequence[bytes],
        undecryptable: int,
    ) -> None:
        self.runtime, self.header = runtime, header
        self.opened, self.undecryptable = opened, undecryptable
        self.invalid = self.repeated = self.verified = 0

    def fold(self, state: bytes | None, repeated: Collection[int]) -> tuple[bytes, int]:
        """The part's first-seen fragments added to its batch's statistics."""
        mechanism = self.runtime.mechanism
        accumulator = (
            mechanism.new_accumulator() if state is None else mechanism.load_accumulator(state)
        )
        skip = set(repeated)
        first = [f for i, f in enumerate(self.opened) if i not in skip] if skip else self.opened
        unparsed = self.runtime.add(accumulator, first, 0, self.header.shuffler_id)
        self.invalid, self.repeated = unparsed + self.undecryptable + len(skip), len(skip)
        return accumulator.to_bytes(), self.invalid

    def complete(self, state: bytes, valid: int, invalid: int) -> Completion:
        """The batch's verified crowd (and its estimated crowd in the statistics)."""
        runtime, header = self.runtime, self.header
        count = runtime.fragment_count(header.shuffler_id)
        self.verified = count.verified_crowd(header.n_contributions, valid, invalid)
        accumulator = runtime.mechanism.load_accumulator(state)
        estimated = count.estimated_crowd(header.n_contributions, valid, invalid)
        runtime.add(accumulator, (), estimated, header.shuffler_id)
        released = self.verified >= runtime.config.min_crowd
        return Completion(accumulator.to_bytes(), self.verified, released)

    def merge(self, state: bytes | None, batch: bytes) -> bytes:
        """The batch's statistics merged into its accumulator."""
        if state is None:
            return batch
        load = self.runtime.mechanism.load_accumulator
        return bytes(load(state).merge(load(batch)).to_bytes())

    def charge(self, received: ReceivedRange) -> str | None:
        """The epoch's charge, by the channel's certificate (:meth:`ChannelRuntime.charge`)."""
        return self.runtime.charge(received)
