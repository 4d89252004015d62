"""Opening stored batch parts in the background (issue 11, "Intake that cannot time out").

``POST /v1/batches`` only stores a verified part (:mod:`analyzer.intake`); :class:`PartOpener`
then opens each stored part, chunk by chunk, on a pool of processes (:class:`FragmentOpener`:
HPKE opening is the analyzer's bottleneck, so it uses the cores), and folds it with
:meth:`AnalyzerStore.fold_part`, which marks the part opened in the same transaction that
updates the batch's statistics: a crash before that commit leaves the part stored and
unopened, and the next start opens it again from scratch, so nothing is opened or counted
twice. Memory is bounded by one part (its body, its opened fragments) plus one accumulator.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.channels import ChannelRuntime
from analyzer.metrics import Events
from analyzer.store import AnalyzerStore, Fold, Merge, PartHeader
from common.envelope import EnvelopeError, KeyRing, open_fragment
from common.wire import Batch

log = logging.getLogger("esa.analyzer")

#: The key ring of a pool worker process (set once by :func:`_start_worker`).
_worker_ring: KeyRing | None = None


def open_chunk(ring: KeyRing, channel_id: str, texts: Sequence[str]) -> list[bytes]:
    """Open base64 sealed fragments of ``channel_id``; the ones that fail are left out (chaff,
    counted by the caller as the difference)."""
    opened = []
    for text in texts:
        try:
            opened.append(open_fragment(base64.b64decode(text), channel_id, ring))
        except (EnvelopeError, binascii.Error, ValueError):
            continue
    return opened


def _start_worker(keys: Sequence[bytes]) -> None:
    global _worker_ring
    _worker_ring = KeyRing.of(*(X25519PrivateKey.from_private_bytes(k) for k in keys))


def _open_in_worker(channel_id: str, texts: Sequence[str]) -> list[bytes]:
    if _worker_ring is None:
        raise RuntimeError("pool worker started without its key ring")
    return open_chunk(_worker_ring, channel_id, texts)


class FragmentOpener:
    """Opens fragments in chunks of ``chunk`` on ``processes`` worker processes (in this
    process when ``processes`` is 1)."""

    def __init__(self, ring: KeyRing, processes: int, chunk: int) -> None:
        if processes < 1 or chunk < 1:
            raise ValueError(f"need processes >= 1 and chunk >= 1, got {processes}, {chunk}")
        self.ring = ring
        self.processes = processes
        self.chunk = chunk
        self._pool: ProcessPoolExecutor | None = None
        if processes > 1:
            keys = [k.private_bytes_raw() for k in ring.keys.values()]
            self._pool = ProcessPoolExecutor(
                processes,
                mp_context=get_context("spawn"),
                initializer=_start_worker,
                initargs=(keys,),
            )

    def open(self, channel_id: str, texts: Sequence[str]) -> list[bytes]:
        """The opened fragments, in order (undecryptable ones left out)."""
        if self._pool is None:
            return open_chunk(self.ring, channel_id, texts)
        futures = [
            self._pool.submit(_open_in_worker, channel_id, texts[i : i + self.chunk])
            for i in range(0, len(texts), self.chunk)
        ]
        return [fragment for future in futures for fragment in future.result()]

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class PartOpener:
    """Opens stored parts and folds them in, from a background thread (:meth:`start`) or
    synchronously (:meth:`open_pending`)."""

    def __init__(
        self,
        store: AnalyzerStore,
        channels: Mapping[str, ChannelRuntime],
        opener: FragmentOpener,
        events: Events,
        fault_while_opening: str | None = None,
    ) -> None:
        self.store = store
        self.channels = channels
        self.opener = opener
        self.events = events
        self.fault_while_opening = fault_while_opening
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open_pending(self) -> int:
        """Open every stored, unopened part (oldest first); returns how many were folded in."""
        folded = 0
        while pending := self.store.pending_parts():
            progress = [self.open_part(header) for header in pending]
            folded += sum(progress)
            if not any(progress):
                break
        return folded

    def open_part(self, header: PartHeader) -> bool:
        """Open one stored part and fold it in; False if it was already opened or its channel
        is no longer configured (it stays stored)."""
        runtime = self.channels.get(header.channel_id)
        body = self.store.part_body(header)
        if runtime is None or body is None:
            return False
        fragments = Batch.model_validate_json(body).fragments
        del body
        opened = self.opener.open(header.channel_id, fragments)
        undecryptable = len(fragments) - len(opened)
        del fragments
        if self.fault_while_opening == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        invalid: list[int] = []
        fold = _folder(runtime, header, opened, undecryptable, invalid)
        folded = self.store.fold_part(header, fold, _merger(runtime), runtime.charge)
        if folded:
            self.events.count("parts_opened")
            self.events.count("fragments_opened", len(opened))
            self.events.count("fragments_invalid", invalid[-1])
        return folded

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
        """Stop the thread (after the part in hand) and the worker processes."""
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


def _folder(
    runtime: ChannelRuntime,
    header: PartHeader,
    opened: Sequence[bytes],
    undecryptable: int,
    invalid: list[int],
) -> Fold:
    # The group's n enters with part 0 only, so a complete batch carries it exactly once;
    # ``invalid`` receives the chaff count of the fold that commits (the last one).
    n = header.n_contributions if header.part == 0 else 0

    def fold(state: bytes | None) -> tuple[bytes, int]:
        accumulator = runtime.new_accumulator() if state is None else runtime.load(state)
        unparsed = runtime.add(accumulator, opened, n, header.shuffler_id)
        invalid.append(unparsed + undecryptable)
        return accumulator.to_bytes(), unparsed + undecryptable

    return fold


def _merger(runtime: ChannelRuntime) -> Merge:
    def merge(state: bytes | None, batch: bytes) -> bytes:
        if state is None:
            return batch
        merged = runtime.load(state).merge(runtime.load(batch))
        return bytes(merged.to_bytes())

    return merge
