"""Replaying the sealed requests: sources that hand out the current epoch's requests, the
pacing, the per-status statistics and the :class:`Driver` that sends them over keep-alive
connections. A refused request (``429``, ``503``, any answer that can heal by waiting) is sent
again after the server's ``Retry-After`` (else a capped backoff) while its epoch lasts, as a
device's outbox does (docs/loadtest.md, "Refused, then delivered")."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from common.randomness import SystemSource
from common.retry import Backoff, retry_after_seconds, retryable_status
from services.tools.loadgen.http import HttpConnection, Response
from services.tools.loadgen.target import ATTEMPTS, INGEST, RECORD

# --- replay -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One ready ``POST /v1/contributions``: shuffler index, client token, sealed body."""

    shuffler: int
    token: str
    body: bytes
    #: Which stream of requests this one came from (a channel, for per-channel counts).
    tag: int = 0
    #: Unix time its epoch ends: a refused request is sent again until then, never after (a
    #: shuffler refuses a contribution to an ended epoch for good). Infinite: no epoch known.
    until: float = math.inf


def read_requests(path: Path, until: float = math.inf) -> Iterator[Request]:
    """The records of an epoch file, in order (``until``: that epoch's end)."""
    with path.open("rb", buffering=1 << 20) as handle:
        while head := handle.read(RECORD.size):
            shuffler, token_length, body_length = RECORD.unpack(head)
            token = handle.read(token_length).decode()
            body = handle.read(body_length)
            yield Request(shuffler=shuffler, token=token, body=body, until=until)


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
            until = (epoch + 1) * self.epoch_seconds
            self._readers = [read_requests(p, until) for p in self.files.pop(epoch, [])]
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
        return None if found is None else replace(found, tag=tag)

    def next(self, now: float) -> Request | None:
        """The next request of the next channel that has one now."""
        for _ in range(len(self.sources)):
            self._turn = (self._turn + 1) % len(self.sources)
            found = self.sources[self._turn].next(now)
            if found is not None:
                return replace(found, tag=self._turn)
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
    """Everything the driver saw: answers by status (every answer, a refusal that was then
    sent again included), transport errors, latencies, and each request's outcome: delivered
    at once, refused and then delivered, or never delivered."""

    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    #: Requests still refused or unreachable when their retries ran out (their epoch ended,
    #: or :data:`ATTEMPTS` / the driver's patience): part of :attr:`never_delivered`.
    given_up: int = 0
    #: Refusals that were waited out and sent again, by status (part of :attr:`statuses`).
    retried: Counter[int] = field(default_factory=Counter)
    #: Requests acknowledged after one or more refusals were waited out.
    refused_then_delivered: int = 0
    #: Requests that ended unacknowledged: refused for good (400...) or :attr:`given_up`.
    never_delivered: int = 0
    #: 409s saying an earlier attempt stored the contribution (:func:`_stored_before`: after
    #: an attempt whose answer was lost, any but an outdated config's; the SDK reads a 409
    #: the same way), counted as acknowledged.
    recovered: int = 0
    latencies: array[float] = field(default_factory=lambda: array("d"))
    #: Answers by shuffler index, then status.
    by_shuffler: dict[int, Counter[int]] = field(default_factory=dict)
    #: Answers by (shuffler index, :attr:`Request.tag`), then status.
    by_shuffler_tag: dict[tuple[int, int], Counter[int]] = field(default_factory=dict)
    #: Acknowledged (202) requests by :attr:`Request.tag`.
    accepted_by_tag: Counter[int] = field(default_factory=Counter)
    #: Each unacknowledged request's last refusal (4xx/5xx) by its JSON ``error`` code
    #: (``?``: no code); a refusal that was waited out and sent again is not one.
    refusals: Counter[str] = field(default_factory=Counter)
    #: :attr:`refusals` by :attr:`Request.tag` (a clock group's refusals told apart).
    refusals_by_tag: dict[int, Counter[str]] = field(default_factory=dict)
    _window: list[float] = field(default_factory=list)

    @property
    def final(self) -> Counter[int]:
        """Each request's last answer, by status (the refusals sent again left out)."""
        return self.statuses - self.retried

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


#: Waits between attempts without a ``Retry-After``: capped exponential backoff with jitter,
#: as the SDK's outbox (``common.retry.Backoff``), but shorter: a load test's epochs are.
BACKOFF = Backoff(base=0.2, cap=5.0)
_JITTER = SystemSource()


class Driver:
    """Replays requests at a rate over ``concurrency`` keep-alive connections per shuffler."""

    def __init__(self, urls: Sequence[str], concurrency: int = 48, patience: float = 0.0) -> None:
        """A refused request (an answer :func:`common.retry.retryable_status` says heals by
        waiting: 429, 503...) or a broken connection is tried again after ``Retry-After``
        (else :data:`BACKOFF`) until its epoch ends (:attr:`Request.until`); a request of no
        known epoch :data:`ATTEMPTS` times. ``patience`` > 0 also ends every request's retries
        that many seconds after its first attempt (a device's outbox while a shuffler
        restarts)."""
        self.urls = list(urls)
        self.concurrency = concurrency
        self.patience = patience
        self.stats = Stats()
        self.sent = 0
        self.behind = 0
        self._clock: Callable[[], float] = time.time

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
        Requests being retried are waited for (at most until their epoch ends).
        Returns the seconds it ran, from the first request to the last answer."""
        self._clock = clock
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
        """Send ``request`` until it is acknowledged, refused for good, or its retries run
        out (:meth:`_again`), counting its outcome in :attr:`stats`."""
        headers = {
            "Authorization": f"Bearer {request.token}",
            "Content-Type": "application/octet-stream",
        }
        deadline, lost, refused = time.monotonic() + self.patience, False, False
        for attempt in itertools.count():
            start = time.perf_counter()
            try:
                response = await connection.request("POST", INGEST, headers, request.body)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as error:
                self.stats.transport_errors[type(error).__name__] += 1
                lost, wait = True, BACKOFF.delay(attempt, _JITTER)
                if not self._again(request, attempt, deadline, wait):
                    break
                await asyncio.sleep(wait)
                continue
            status = response.status
            if status == 409 and _stored_before(response, lost):
                self.stats.recovered += 1
                status = 202
            self.stats.record(status, time.perf_counter() - start, request.shuffler, request.tag)
            if status == 202:
                self.stats.refused_then_delivered += refused
                return
            if retryable_status(status):
                wait = retry_after_seconds(response.headers) or BACKOFF.delay(attempt, _JITTER)
                if self._again(request, attempt, deadline, wait):
                    self.stats.retried[status] += 1
                    refused = True
                    await asyncio.sleep(wait)
                    continue
                self.stats.given_up += 1
            if status >= 400:
                code = _error_code(response)
                self.stats.refusals[code] += 1
                self.stats.refusals_by_tag.setdefault(request.tag, Counter())[code] += 1
            self.stats.never_delivered += 1
            return
        self.stats.given_up += 1
        self.stats.never_delivered += 1

    def _again(self, request: Request, attempt: int, deadline: float, wait: float) -> bool:
        """Whether a failed attempt is tried again after ``wait`` seconds: only if that is
        still within the request's epoch, and within the driver's patience when it has one;
        :data:`ATTEMPTS` attempts in all for a request of no known epoch and no patience."""
        if self._clock() + wait >= request.until:
            return False
        if self.patience > 0:
            return time.monotonic() + wait < deadline
        return math.isfinite(request.until) or attempt + 1 < ATTEMPTS


#: 409 codes that say the contribution stored nothing because the device's config is behind
#: (the SDK drops such a contribution and refreshes its config: ``encoder_client``'s
#: ``OUTDATED``), so never "an earlier attempt landed", lost answer or not.
OUTDATED = frozenset({"channel_retired", "config_outdated", "channel_terms_changed"})


def _stored_before(response: Response, lost: bool) -> bool:
    """Whether a 409 says an earlier attempt of this request was stored: its own nonce
    (:func:`_replayed`), or after an attempt whose answer was lost any 409 but an
    :data:`OUTDATED` one (its quota, used by that attempt), as the SDK reads it."""
    return _replayed(response) or (lost and _error_code(response) not in OUTDATED)


def _replayed(response: Response) -> bool:
    """A 409 ``replayed_nonce``: this request's own nonce is already stored, so an earlier
    attempt of it was committed, e.g. by a replica that died before answering, and a load
    balancer resent it (every nonce is sent by one logical request only, as a device's
    outbox re-sends only its own queued contribution: docs/protocol.md, "Contributions")."""
    return _error_code(response) == "replayed_nonce"


def _error_code(response: Response) -> str:
    """A refusal's JSON ``error`` code (docs/protocol.md, "Errors"); ``?`` when there is none."""
    try:
        code = json.loads(response.body).get("error")
    except (ValueError, AttributeError):
        return "?"
    return code if isinstance(code, str) else "?"
