"""Simulated devices: enrolment at every shuffler, and the worker processes that encode each
device's report with its channel's mechanism and seal its contributions ahead of a run
(:class:`SealerPool`), writing files of ready HTTP requests."""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import json
import math
import multiprocessing
import secrets
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, BinaryIO

from common.envelope import load_x25519_public
from common.mechanisms import StateUpdate, build_device
from common.randomness import SystemSource
from common.retry import retry_after_seconds
from common.wire import ChannelConfig, CollectionConfig, ShufflerInfo
from encoder_client.sealing import seal_report, shuffler_slot
from services.tools.loadgen.http import HttpConnection
from services.tools.loadgen.target import ENROLL, RECORD, LoadError, Target

# --- devices: enrolment and sealing -------------------------------------------------------


async def enroll(urls: Sequence[str], count: int, concurrency: int = 32) -> list[list[str]]:
    """``count`` client tokens at each shuffler (``tokens[shuffler][device]``), enrolled over
    HTTP with ``concurrency`` connections per shuffler, waiting out every 429's Retry-After.

    Raises:
        LoadError: a shuffler refused enrolment for another reason.
    """

    async def one_shuffler(url: str) -> list[str]:
        tokens: list[str] = []

        async def worker() -> None:
            connection = HttpConnection(url)
            while len(tokens) < count:
                slot = len(tokens)
                tokens.append("")  # reserve the slot before awaiting
                tokens[slot] = await _enroll_one(connection)
            connection.close()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens[:count]

    return list(await asyncio.gather(*(one_shuffler(url) for url in urls)))


async def _enroll_one(connection: HttpConnection) -> str:
    for _ in range(100):
        response = await connection.request("POST", ENROLL, {"Accept": "application/json"})
        if response.status == 200:
            return str(json.loads(response.body)["client_token"])
        if response.status != 429:
            raise LoadError(f"enrolment refused: {response.status} {response.body[:200]!r}")
        await asyncio.sleep(retry_after_seconds(response.headers) or 1.0)
    raise LoadError("enrolment still rate-limited after 100 attempts")


@dataclass(frozen=True)
class ZipfValues:
    """True values of a population: Zipf(``s``) over ``0..domain-1`` (a homepage-like heavy
    tail). The values are the data being measured, not privacy noise; drawn from the OS
    CSPRNG anyway."""

    domain: int
    s: float = 1.1

    def cdf(self) -> list[float]:
        """Cumulative probabilities of the domain's values."""
        weights = [1.0 / (rank + 1) ** self.s for rank in range(self.domain)]
        total, running, cdf = sum(weights), 0.0, []
        for weight in weights:
            running += weight / total
            cdf.append(running)
        return cdf


def domain_of(channel: ChannelConfig) -> int:
    """The number of values a histogram channel takes (its ``k``, or ``d``)."""
    for name in ("k", "d"):
        if isinstance(channel.params.get(name), int):
            return int(channel.params[name])
    raise LoadError(f"channel {channel.id!r} names no domain size (params k or d)")


@dataclass
class _Device:
    """One device inside a sealing worker: its tokens and its encoded report's routes."""

    tokens: tuple[str, ...]
    routes: tuple[tuple[int | None, tuple[bytes, ...]], ...]
    value: int | None = None


class _Sealer:
    """A sealing worker's state: the target's keys and its shard of devices."""

    def __init__(self, config: dict[str, Any], channel_id: str, values: ZipfValues) -> None:
        self.config = CollectionConfig.model_validate(config["config"])
        self.channel = next(c for c in self.config.channels if c.id == channel_id)
        self.mechanism = build_device(self.channel)
        self.analyzer = load_x25519_public(
            base64.b64decode(self.config.analyzer.keys[0].public_key)
        )
        self.shufflers = [
            (s.id, load_x25519_public(base64.b64decode(s.public_key)))
            for s in (ShufflerInfo.model_validate(v) for v in config["shufflers"])
        ]
        self.rng = SystemSource()
        self.cdf = values.cdf()
        self.devices: list[_Device] = []
        #: Longitudinal devices: tokens and, per period, the sealed routes of its report.
        self.series: list[tuple[tuple[str, ...], list[tuple[Any, ...]]]] = []
        #: Per longitudinal device, the periods (0-based) whose report is not sent yet.
        self.pending: list[list[int]] = []
        #: The token each device of the last wave used, to that device's index.
        self.waved: dict[str, int] = {}

    def report(self, value: int | None = None) -> tuple[tuple[int | None, tuple[bytes, ...]], ...]:
        """Encode ``value`` (default: one drawn from the population)."""
        if value is None:
            value = bisect.bisect_left(self.cdf, secrets.randbelow(1 << 53) / (1 << 53))
            value = min(value, len(self.cdf) - 1)
        state = self.mechanism.new_state(self.rng)
        encoded = self.mechanism.encode(value, state, self.rng, len(self.shufflers))
        return encoded.routes

    def add(self, tokens: list[tuple[str, ...]], values: list[int] | None = None) -> None:
        """New devices with these tokens (one per shuffler), each with its sealed report of
        its value in ``values`` (default: drawn from the population)."""
        chosen: list[int | None] = list(values) if values is not None else [None] * len(tokens)
        self.devices += [_Device(t, self.report(v), v) for t, v in zip(tokens, chosen, strict=True)]

    def seal_epoch(
        self, epoch: int, count: int, path: str, fresh: bool, among: tuple[float, float] = (0, 1)
    ) -> int:
        """Write the requests of ``count`` devices of this shard (a CSPRNG sample of those in
        the ``among`` fractions of it: a clock group, :func:`clock_range`) for ``epoch`` to
        ``path``; returns how many requests were written."""
        chosen = secrets.SystemRandom().sample(range(*clock_range(len(self.devices), among)), count)
        written = 0
        with open(path, "wb") as out:
            for index in chosen:
                device = self.devices[index]
                routes = self.report(device.value) if fresh else device.routes
                for slot, fragments in routes:
                    self._write(out, device, epoch, slot, fragments)
                    written += 1
        return written

    def add_series(self, tokens: list[tuple[str, ...]], changes: list[list[int]]) -> int:
        """New devices of a longitudinal channel (Erlingsson et al. 2019, Algorithm 1): each
        runs its own tree state (from the OS CSPRNG) through every period, changing state at
        the periods in its entry of ``changes``, and keeps the sealed report of each period
        the tree asks it to report in. Returns how many reports were encoded."""
        d = self.mechanism.domain_size()
        sealed = 0
        for device_tokens, changed in zip(tokens, changes, strict=True):
            state = self.mechanism.new_state(self.rng)
            periods = []
            for t in range(1, d + 1):
                update = StateUpdate(t, t in changed)
                encoded = self.mechanism.encode(update, state, self.rng, len(self.shufflers))
                state = encoded.state
                periods.append(encoded.routes)
                sealed += len(encoded.routes)
            self.series.append((device_tokens, periods))
            self.pending.append([t for t, routes in enumerate(periods) if routes])
        return sealed

    def seal_wave(self, epoch: int, period: int, path: str) -> int:
        """Write, for every longitudinal device with a report not sent yet of a period up to
        ``period`` (0-based), its earliest such report in a new outer envelope for ``epoch``
        to ``path``: at most one request per device, as a shuffler takes one per epoch.
        Returns how many requests were written."""
        self.waved = {}
        with open(path, "wb") as out:
            for index, periods in enumerate(self.pending):
                if not periods or periods[0] > period:
                    continue
                tokens, routes = self.series[index]
                for slot, fragments in routes[periods[0]]:
                    token = self._write(out, _Device(tokens, ()), epoch, slot, fragments)
                    self.waved[token] = index
        return len(self.waved)

    def settle(self, handed: set[str]) -> tuple[int, int | None]:
        """The last wave's requests whose token is in ``handed`` were sent: those reports
        are done, the others stay first in line. Returns the reports still pending and the
        earliest period (0-based) among them (None: none)."""
        for token, index in self.waved.items():
            if token in handed:
                del self.pending[index][0]
        self.waved = {}
        heads = [periods[0] for periods in self.pending if periods]
        return sum(len(periods) for periods in self.pending), min(heads, default=None)

    def _write(
        self,
        out: BinaryIO,
        device: _Device,
        epoch: int,
        slot: int | None,
        fragments: tuple[bytes, ...],
    ) -> str:
        """One contribution of ``device`` for ``epoch``: its fragments sealed to the analyzer
        for this epoch, a new nonce, sealed to its shuffler; returns the token it uses."""
        target = shuffler_slot(slot, len(self.shufflers))
        body = seal_report(
            self.channel,
            crowd=self.channel.crowds[0],
            epoch=epoch,
            fragments=fragments,
            analyzer_key=self.analyzer,
            shuffler=self.shufflers[target],
        )
        token = device.tokens[target]
        encoded = token.encode()
        out.write(RECORD.pack(target, len(encoded), len(body)) + encoded + body)
        return token


def _sealer_main(
    connection: Connection,
    config: dict[str, Any],
    channel_id: str,
    values: ZipfValues,
) -> None:
    """A sealing worker: answers (command, channel, args) messages until ``None``; it keeps
    one :class:`_Sealer` (devices and keys) per channel of the config. It leaves quietly when
    its parent is gone (end of file): the parent stops it, a Ctrl-C at the terminal is not
    its to act on (:meth:`SealerPool._start`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # its parent's close() sends it
    sealers = {channel_id: _Sealer(config, channel_id, values)}
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if message is None:
            return
        answer = _answer(sealers, config, values, message)
        try:
            connection.send(answer)
        except OSError:  # the parent is gone
            return


def _answer(
    sealers: dict[str, _Sealer],
    config: dict[str, Any],
    values: ZipfValues,
    message: tuple[str, str, Any],
) -> tuple[str, Any]:
    """A sealing worker's answer to one (command, channel, args) message: ("ok", (result,
    wall seconds, CPU seconds)), or ("error", what failed) for the parent to raise."""
    command, channel, args = message
    start, cpu = time.perf_counter(), time.process_time()
    try:
        if channel not in sealers:
            sealers[channel] = _Sealer(config, channel, values)
        sealer = sealers[channel]
        if command == "ping":
            result: Any = 0
        elif command == "add":
            sealer.add(*args)
            result = len(args[0])
        elif command == "add_series":
            result = sealer.add_series(*args)
        elif command == "seal_wave":
            result = sealer.seal_wave(*args)
        elif command == "settle":
            result = sealer.settle(*args)
        else:
            result = sealer.seal_epoch(*args)
    except Exception as error:  # reported to the parent, which raises LoadError
        return ("error", f"{type(error).__name__}: {error}")
    return ("ok", (result, time.perf_counter() - start, time.process_time() - cpu))


@dataclass(frozen=True)
class SealTiming:
    """What one parallel sealing step did: items, wall seconds and the workers' CPU seconds."""

    items: int
    seconds: float
    cpu_seconds: float = math.nan

    @property
    def per_core(self) -> float:
        """Items per CPU second of the workers (what one core seals on a quiet machine)."""
        return self.items / self.cpu_seconds if self.cpu_seconds > 0 else math.nan

    @property
    def rate(self) -> float:
        """Items per wall second."""
        return self.items / self.seconds if self.seconds > 0 else math.inf


#: Seconds workers have to leave once told to, before they are terminated: an idle worker
#: leaves at once, one left mid-step by a failure or Ctrl-C need not be waited for.
CLOSE_GRACE_SECONDS = 3.0


class SealerPool:
    """Worker processes that each hold a shard of devices and seal their requests."""

    def __init__(
        self,
        target: Target,
        workers: int = 2,
        values: ZipfValues | None = None,
    ):
        context = multiprocessing.get_context("spawn")
        values = values or ZipfValues(domain_of(target.channel))
        config = {
            "config": target.config.config.model_dump(mode="json"),
            "shufflers": [s.model_dump() for s in target.config.shufflers],
        }
        self.target = target
        #: Devices per channel, per worker.
        self.shards: dict[str, list[int]] = {target.channel.id: [0] * workers}
        self._pipes: list[Connection] = []
        self._processes: list[BaseProcess] = []
        #: One step at a time on the pipes (``esa demo`` seals a longitudinal wave while a
        #: thread seals histogram devices in the same workers).
        self._lock = threading.Lock()
        try:
            for _ in range(workers):
                parent, child = context.Pipe()
                process = context.Process(
                    target=_sealer_main,
                    args=(child, config, target.channel.id, values),
                    daemon=True,
                )
                self._pipes.append(parent)
                self._processes.append(process)
                self._start(process)
                child.close()  # the worker's end: a dead worker then reads as EOF, never a hang
        except BaseException:  # Ctrl-C or SIGTERM while starting: leave no worker behind
            self.close(0.0)
            raise

    @staticmethod
    def _start(process: BaseProcess) -> None:
        """Start a worker with SIGINT and SIGTERM blocked. SIGINT: a mask the worker inherits
        through spawn's exec (a Ctrl-C at the terminal reaches the whole foreground process
        group, and a worker that took it would die with a traceback in the middle of its start;
        its parent stops it, :meth:`close`). SIGTERM: the parent's handler would raise in the
        middle of writing the worker's start data, which the worker would then read short and
        die printing ``EOFError`` (the worker unblocks SIGTERM first thing). Either signal
        meanwhile reaches the parent once it is unblocked. The resource tracker that a spawn
        start needs is started first: starting it unblocks SIGINT on its way out."""
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    @property
    def devices(self) -> list[int]:
        """Devices of the target's channel per worker."""
        return self.shards[self.target.channel.id]

    @property
    def size(self) -> int:
        """Devices in the pool (the target's channel)."""
        return sum(self.devices)

    def ready(self) -> float:
        """Wait until every worker has started; returns the seconds waited."""
        start = time.perf_counter()
        self._all([("ping", self.target.channel.id, ())] * len(self._pipes))
        return time.perf_counter() - start

    def _all(self, messages: list[tuple[str, str, Any]]) -> list[Any]:
        """Each worker's answer to its message.

        Raises:
            LoadError: a worker failed, or died (its pipe closed).
        """
        results = []
        try:
            with self._lock:
                for pipe, message in zip(self._pipes, messages, strict=True):
                    pipe.send(message)
                answers = [pipe.recv() for pipe in self._pipes]
        except (EOFError, OSError) as error:
            raise LoadError(f"a sealing worker died ({type(error).__name__})") from error
        for status, result in answers:
            if status != "ok":
                raise LoadError(f"sealing worker failed: {result}")
            results.append(result)
        return results

    def add_devices(
        self,
        tokens: list[list[str]],
        values: Sequence[int] | None = None,
        channel: str | None = None,
    ) -> SealTiming:
        """Add one device per column of ``tokens`` (``tokens[shuffler][device]``), each
        encoding and sealing its report in a worker: of its entry in ``values`` if given
        (the population's truth), else of a value drawn from the pool's Zipf population.
        ``channel``: another channel of the target's config (default: the target's)."""
        channel = channel or self.target.channel.id
        per_device = list(zip(*tokens, strict=True))
        workers = len(self._pipes)
        shards = [per_device[i::workers] for i in range(workers)]
        chosen = None if values is None else [int(v) for v in values]
        if chosen is not None and len(chosen) != len(per_device):
            raise LoadError(f"{len(chosen)} values for {len(per_device)} devices")
        parts = [None if chosen is None else chosen[i::workers] for i in range(workers)]
        start = time.perf_counter()
        results = self._all([("add", channel, (s, p)) for s, p in zip(shards, parts, strict=True)])
        counts = self.shards.setdefault(channel, [0] * workers)
        for i, (added, _, _) in enumerate(results):
            counts[i] += added
        cpu = sum(r[2] for r in results)
        return SealTiming(len(per_device), time.perf_counter() - start, cpu)

    def seal_epoch(
        self,
        epoch: int,
        count: int,
        directory: Path,
        fresh: bool = False,
        channel: str | None = None,
        among: tuple[float, float] = (0, 1),
        stem: str = "epoch",
    ) -> tuple[list[Path], SealTiming]:
        """Files of requests from ``count`` distinct devices (at most the pool, or the
        ``among`` fractions of each shard: a clock group) for ``epoch``, one per worker (of
        ``channel``, default the target's), named ``<stem>-<epoch>-<worker>.bin``."""
        channel = channel or self.target.channel.id
        shards = self.shards.get(channel, [0] * len(self._pipes))
        devices = [hi - lo for lo, hi in (clock_range(n, among) for n in shards)]
        if count > sum(devices):
            raise LoadError(
                f"{count} contributions per epoch need {count} devices; pool has {sum(devices)}"
            )
        shares = _split(count, devices)
        paths = [directory / f"{stem}-{epoch}-{i}.bin" for i in range(len(self._pipes))]
        start = time.perf_counter()
        results = self._all(
            [
                ("seal", channel, (epoch, n, str(p), fresh, among))
                for n, p in zip(shares, paths, strict=True)
            ]
        )
        written = sum(r[0] for r in results)
        cpu = sum(r[2] for r in results)
        return paths, SealTiming(written, time.perf_counter() - start, cpu)

    def add_series(
        self, tokens: list[list[str]], changes: Sequence[Sequence[int]], channel: str
    ) -> SealTiming:
        """Add one longitudinal device of ``channel`` per column of ``tokens``, changing state
        at the periods of its entry in ``changes``; every period's report is encoded and
        sealed to the analyzer in a worker (the outer envelopes: :meth:`seal_series`)."""
        per_device = list(zip(*tokens, strict=True))
        if len(changes) != len(per_device):
            raise LoadError(f"{len(changes)} change lists for {len(per_device)} devices")
        workers = len(self._pipes)
        moves = [[int(p) for p in c] for c in changes]
        start = time.perf_counter()
        results = self._all(
            [("add_series", channel, (per_device[i::workers], moves[i::workers]))
             for i in range(workers)]
        )  # fmt: skip
        counts = self.shards.setdefault(channel, [0] * workers)
        for i in range(workers):
            counts[i] += len(per_device[i::workers])
        return SealTiming(sum(r[0] for r in results), time.perf_counter() - start,
                          sum(r[2] for r in results))  # fmt: skip

    def seal_wave(
        self, epoch: int, period: int, directory: Path, channel: str
    ) -> tuple[list[Path], SealTiming]:
        """Files (one per worker) of a wave of ``channel``'s longitudinal reports for
        ``epoch``: each device's earliest unsent report of a period up to ``period``
        (0-based), in a new outer envelope (:meth:`_Sealer.seal_wave`)."""
        directory.mkdir(parents=True, exist_ok=True)
        paths = [directory / f"epoch-{epoch}-{i}.bin" for i in range(len(self._pipes))]
        start = time.perf_counter()
        results = self._all(
            [("seal_wave", channel, (epoch, period, str(p))) for p in paths]
        )  # fmt: skip
        written = sum(r[0] for r in results)
        cpu = sum(r[2] for r in results)
        return paths, SealTiming(written, time.perf_counter() - start, cpu)

    def settle(self, channel: str, handed: set[str]) -> tuple[int, int | None]:
        """Tell every worker which requests of the last wave were sent (their tokens);
        returns the reports still pending and the earliest period among them."""
        results = self._all([("settle", channel, (handed,))] * len(self._pipes))
        heads = [r[0][1] for r in results if r[0][1] is not None]
        return sum(r[0][0] for r in results), min(heads, default=None)

    def close(self, grace: float = CLOSE_GRACE_SECONDS) -> None:
        """Stop the workers (again: nothing): each is told to leave, and one still busy after
        ``grace`` seconds (the pool was left mid-step: a failure, Ctrl-C) gets SIGTERM, then
        SIGKILL; none outlives the pool."""
        pipes, self._pipes = self._pipes, []
        for pipe in pipes:
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                pipe.send(None)
            pipe.close()
        started = [p for p in self._processes if p.pid is not None]
        deadline = time.monotonic() + grace
        for process in started:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in started:
            if process.is_alive():
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> SealerPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(CLOSE_GRACE_SECONDS if kind is None else 0.0)  # no step to finish then


def clock_range(devices: int, among: tuple[float, float]) -> tuple[int, int]:
    """The indices ``[lo, hi)`` of a shard of ``devices`` in the fractions ``among`` of it:
    the devices of one clock group (``esa loadtest --clock-offset``), the same in every epoch,
    so a device keeps its clock for the whole run."""
    return round(among[0] * devices), round(among[1] * devices)


def _split(total: int, capacities: list[int]) -> list[int]:
    """``total`` spread over shards in proportion to their sizes (never above one)."""
    size = sum(capacities)
    shares = [total * c // size for c in capacities]
    for i in range(total - sum(shares)):
        shares[i % len(shares)] += 1
    return [min(s, c) for s, c in zip(shares, capacities, strict=True)]
