"""Replaying the sealed requests: sources that hand out the current epoch's requests, the
pacing, the per-status statistics and the :class:`Driver` that sends them over keep-alive
connections, honouring ``429`` + ``Retry-After``."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from common.retry import retry_after_seconds
from services.tools.loadgen.http import HttpConnection, Response
from services.tools.loadgen.target import ATTEMPTS, INGEST, RECORD

# --- replay -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One ready ``POST /v1/contributions``: shuffler index, client token, sealed body."""

    shuffler: int
    token: str
    body: bytes
    #: Which stream of requests this one came from (a channel, for per-channel counts).
    tag: int = 0


def read_requests(path: Path) -> Iterator[Request]:
    """The records of an epoch file, in order."""
    with path.open("rb", buffering=1 << 20) as handle:
        while head := handle.read(RECORD.size):
            shuffler, token_length, body_length = RECORD.unpack(head)
            token = handle.read(token_length).decode()
            yield Request(shuffler, token, handle.read(body_length))


class Source(Protocol):
    """Where the driver takes its requests from."""

    def next(self, now: float) -> Request | None:
        """The next request to send at unix time ``now``, or None if there is none now."""
        ...


def _finished(source: Source, now: float) -> bool:
    """Whether ``source`` has nothing left at all: a source with a ``finished(now)`` method
    (requests for later epochs still to come) says so itself; any other is finished as soon as
    it has nothing now."""
    finished: Callable[[float], bool] | None = getattr(source, "finished", None)
    return True if finished is None else finished(now)


class EpochSource:
    """The current epoch's requests, its files interleaved; at an epoch boundary what is left
    of the past epoch is skipped (a contribution for a closed epoch would only be refused)."""

    def __init__(self, files: Mapping[int, Sequence[Path]], epoch_seconds: int) -> None:
        self.files = dict(files)
        self.epoch_seconds = epoch_seconds
        self.skipped = 0
        #: The tokens of the requests handed out (a longitudinal wave's settlement).
        self.handed: set[str] = set()
        self._epoch: int | None = None
        self._readers: list[Iterator[Request]] = []
        self._turn = 0

    def finished(self, now: float) -> bool:
        """Nothing left to send: no reader open and no file for the epoch of ``now`` or later."""
        epoch = int(now // self.epoch_seconds)
        return not self._readers and all(e < epoch for e in self.files)

    def next(self, now: float) -> Request | None:
        """The next request for the epoch of unix time ``now``, or None if there is none."""
        epoch = int(now // self.epoch_seconds)
        if epoch != self._epoch:
            self.skipped += sum(1 for reader in self._readers for _ in reader)
            self._epoch = epoch
            self._readers = [read_requests(p) for p in self.files.pop(epoch, [])]
        while self._readers:
            self._turn = (self._turn + 1) % len(self._readers)
            found = next(self._readers[self._turn], None)
            if found is not None:
                self.handed.add(found.token)
                return found
            del self._readers[self._turn]
        return None


class FileSource:
    """The requests of some files, interleaved, each sent once (for runs not paced by epoch)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._readers: list[Iterator[Request]] = [read_requests(p) for p in paths]
        self._turn = 0

    def next(self, now: float) -> Request | None:
        """The next request of the next file that has one (None: all are done)."""
        while self._readers:
            self._turn = (self._turn + 1) % len(self._readers)
            found = next(self._readers[self._turn], None)
            if found is not None:
                return found
            del self._readers[self._turn]
        return None


class ChannelSource:
    """Every channel's :class:`EpochSource` in turn (one contribution from each)."""

    def __init__(
        self, files: Mapping[str, Mapping[int, Sequence[Path]]], epochs: Mapping[str, int]
    ):
        self.sources = [EpochSource(f, epochs[cid]) for cid, f in files.items()]
        #: The channels in :attr:`sources`' order (a request's tag is its channel's index).
        self.channels = list(files)
        self._turn = 0

    def next_of(self, tag: int, now: float) -> Request | None:
        """The next request of the channel of index ``tag`` alone (None if it has none now)."""
        found = self.sources[tag].next(now)
        if found is None:
            return None
        return Request(found.shuffler, found.token, found.body, tag)

    def next(self, now: float) -> Request | None:
        """The next request of the next channel that has one now."""
        for _ in range(len(self.sources)):
            self._turn = (self._turn + 1) % len(self.sources)
            found = self.sources[self._turn].next(now)
            if found is not None:
                return Request(found.shuffler, found.token, found.body, self._turn)
        return None

    def finished(self, now: float) -> bool:
        """No channel has a request left for the epoch of ``now`` or a later one."""
        return all(s.finished(now) for s in self.sources)

    @property
    def skipped(self) -> int:
        """Requests left unsent because their epoch ended."""
        return sum(s.skipped for s in self.sources)

    @property
    def handed(self) -> set[str]:
        """The tokens of every request handed out to be sent."""
        return set().union(*(s.handed for s in self.sources))


@dataclass
class Stats:
    """Everything the driver saw: answers by status, transport errors, latencies."""

    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    given_up: int = 0
    #: Answers retried in patient mode (503 while a shuffler restarts), by status.
    retried: Counter[int] = field(default_factory=Counter)
    #: 409s after an attempt whose answer was lost: that attempt stored the contribution
    #: (the SDK reads a 409 the same way), counted as acknowledged.
    recovered: int = 0
    latencies: array[float] = field(default_factory=lambda: array("d"))
    #: Answers by shuffler index, then status.
    by_shuffler: dict[int, Counter[int]] = field(default_factory=dict)
    #: Answers by (shuffler index, :attr:`Request.tag`), then status.
    by_shuffler_tag: dict[tuple[int, int], Counter[int]] = field(default_factory=dict)
    #: Acknowledged (202) requests by :attr:`Request.tag`.
    accepted_by_tag: Counter[int] = field(default_factory=Counter)
    #: Refusals (4xx/5xx answers recorded) by their JSON ``error`` code (``?``: no code).
    refusals: Counter[str] = field(default_factory=Counter)
    _window: list[float] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        """Contributions acknowledged (202)."""
        return self.statuses[202]

    @property
    def errors(self) -> dict[str, int]:
        """Every non-202 answer by status, and every transport error by kind."""
        found = {str(code): n for code, n in sorted(self.statuses.items()) if code != 202}
        return {**found, **dict(self.transport_errors)}

    def record(self, status: int, seconds: float, shuffler: int = 0, tag: int = 0) -> None:
        """One answer (from the shuffler of index ``shuffler``, to a request tagged ``tag``)."""
        self.statuses[status] += 1
        if status == 202:
            self.accepted_by_tag[tag] += 1
        self.by_shuffler.setdefault(shuffler, Counter())[status] += 1
        self.by_shuffler_tag.setdefault((shuffler, tag), Counter())[status] += 1
        self.latencies.append(seconds)
        self._window.append(seconds)

    def take_window(self) -> list[float]:
        """Latencies since the last call."""
        window, self._window = self._window, []
        return window


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Pace:
    """A linear ramp from ``start`` to ``end`` requests/s over the run (equal: a fixed rate)."""

    start: float
    end: float

    def at(self, elapsed: float, seconds: float) -> float:
        """The rate ``elapsed`` seconds into a run of ``seconds``."""
        share = min(1.0, elapsed / seconds) if seconds > 0 else 1.0
        return self.start + (self.end - self.start) * share

    def planned(self, elapsed: float, seconds: float) -> float:
        """Requests due after ``elapsed`` seconds (the integral of :meth:`at`)."""
        t = min(elapsed, seconds)
        slope = (self.end - self.start) / seconds if seconds > 0 else 0.0
        return self.start * t + slope * t * t / 2 + self.end * max(0.0, elapsed - seconds)


class Driver:
    """Replays requests at a rate over ``concurrency`` keep-alive connections per shuffler."""

    def __init__(self, urls: Sequence[str], concurrency: int = 48, patience: float = 0.0) -> None:
        """``patience`` > 0: a request keeps retrying transport errors, 429 and 503 with
        backoff for that many seconds, as a device's outbox does while a shuffler restarts
        (0: a few attempts, for measuring)."""
        self.urls = list(urls)
        self.concurrency = concurrency
        self.patience = patience
        self.stats = Stats()
        self.sent = 0
        self.behind = 0

    async def run(
        self,
        source: Source,
        rate: float | Pace | None,
        seconds: float,
        until_empty: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> float:
        """Send for ``seconds`` at ``rate`` requests/s (a :class:`Pace` for a ramp; None: as
        fast as the servers answer);
        with ``until_empty``, stop early once the source has nothing left (a source with a
        ``finished(now)`` method, as :class:`EpochSource`, waits for its later epochs).
        Returns the seconds it ran, from the first request to the last answer."""
        queues: list[asyncio.Queue[Request | None]] = [
            asyncio.Queue(maxsize=2 * self.concurrency) for _ in self.urls
        ]
        workers = [
            asyncio.create_task(self._worker(url, queue))
            for url, queue in zip(self.urls, queues, strict=True)
            for _ in range(self.concurrency)
        ]
        start = time.monotonic()
        try:
            await self._feed(source, queues, rate, seconds, until_empty, clock)
        finally:
            for queue in queues:
                for _ in range(self.concurrency):
                    await queue.put(None)
            await asyncio.gather(*workers)
        return time.monotonic() - start

    async def _feed(
        self,
        source: Source,
        queues: list[asyncio.Queue[Request | None]],
        rate: float | Pace | None,
        seconds: float,
        until_empty: bool,
        clock: Callable[[], float],
    ) -> None:
        pace = Pace(rate, rate) if isinstance(rate, int | float) else rate
        start, planned = time.monotonic(), 0
        while (elapsed := time.monotonic() - start) < seconds:
            due = 256 if pace is None else int(pace.planned(elapsed, seconds)) - planned
            now_rate = 0 if pace is None else max(1, int(pace.at(elapsed, seconds)))
            if pace is not None and due > now_rate:  # over a second behind: skip, not burst
                self.behind += due - now_rate
                planned += due - now_rate
                due = now_rate
            for _ in range(min(due, 256)):
                request = source.next(clock())
                if request is None:
                    if until_empty and _finished(source, clock()):
                        return
                    await asyncio.sleep(0.05)
                    break
                await queues[request.shuffler].put(request)
                planned += 1
                self.sent += 1
            await asyncio.sleep(0 if pace is None else 0.002)

    async def _worker(self, url: str, queue: asyncio.Queue[Request | None]) -> None:
        connection = HttpConnection(url)
        while (request := await queue.get()) is not None:
            await self._send(connection, request)
        connection.close()

    async def _send(self, connection: HttpConnection, request: Request) -> None:
        headers = {
            "Authorization": f"Bearer {request.token}",
            "Content-Type": "application/octet-stream",
        }
        deadline, lost = time.monotonic() + self.patience, False
        for attempt in itertools.count():
            start = time.perf_counter()
            try:
                response = await connection.request("POST", INGEST, headers, request.body)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as error:
                self.stats.transport_errors[type(error).__name__] += 1
                lost = True
                if not self._again(attempt, deadline):
                    break
                await asyncio.sleep(self._backoff(attempt))
                continue
            status = response.status
            if status == 409 and (lost or _replayed(response)):
                self.stats.recovered += 1
                status = 202
            if status == 503 and self.patience > 0 and self._again(attempt, deadline):
                self.stats.retried[503] += 1
                await asyncio.sleep(retry_after_seconds(response.headers) or self._backoff(attempt))
                continue
            self.stats.record(status, time.perf_counter() - start, request.shuffler, request.tag)
            if status >= 400:
                self.stats.refusals[_error_code(response)] += 1
            if status != 429:
                return
            if not self._again(attempt, deadline):
                break
            await asyncio.sleep(retry_after_seconds(response.headers) or 1.0)
        self.stats.given_up += 1

    def _again(self, attempt: int, deadline: float) -> bool:
        """Whether a failed attempt is tried again."""
        if self.patience > 0:
            return time.monotonic() < deadline
        return attempt + 1 < ATTEMPTS

    def _backoff(self, attempt: int) -> float:
        return 0.1 if self.patience <= 0 else min(0.2 * 2**attempt, 3.0)


def _replayed(response: Response) -> bool:
    """A 409 ``replayed_nonce``: this request's own nonce is already stored, so an earlier
    attempt of it was committed, e.g. by a replica that died before answering, and a load
    balancer resent it (every nonce is sent by one logical request only, as a device's
    outbox re-sends only its own queued contribution: PROTOCOL.md)."""
    return _error_code(response) == "replayed_nonce"


def _error_code(response: Response) -> str:
    """A refusal's JSON ``error`` code (PROTOCOL.md's error body); ``?`` when there is none."""
    try:
        code = json.loads(response.body).get("error")
    except (ValueError, AttributeError):
        return "?"
    return code if isinstance(code, str) else "?"
