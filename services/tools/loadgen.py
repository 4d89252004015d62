"""A load generator for a deployment's ingest (``POST /v1/contributions``): real devices in
protocol terms, sealed ahead of time, replayed at a target rate.

Every simulated device is a device as PROTOCOL.md defines one: its own client token, enrolled
over HTTP at each shuffler (``POST /v1/enroll``), its own report encoded with the channel's
mechanism (:mod:`common.mechanisms`) from the OS CSPRNG, then, for every epoch it reports in,
its fragments HPKE-sealed to the analyzer key of the signed collection config (bound to that
channel, epoch and crowd) inside a fresh contribution (its own nonce) sealed to the shuffler it
routes to, with the key that shuffler's own descriptor vouches for. Only public keys are shared.

Sealing is the expensive part in Python (one HPKE seal, ~0.13 ms, per fragment: ~4 ms for a
31-fragment k-RAPPOR report), so it runs in worker processes ahead of the run
(:class:`SealerPool`): each worker keeps its shard of devices and writes one file of ready HTTP
requests per epoch. By default a device encodes its report once and re-sends it (memoized,
as the permanent randomized response of RAPPOR, Erlingsson et al. CCS 2014), sealed anew for
each epoch; ``fresh=True`` re-encodes it for every epoch. One pool serves every channel of the
config (``channel=``), and a device's report can carry a given value (``values=``: the
population's truth, for ``esa loadtest``'s verification). A longitudinal channel's devices
(:meth:`SealerPool.add_series`) run their own tree state (Erlingsson et al. 2019, Algorithm 1)
through every period ahead of time; :class:`SeriesWaves` then sends them in waves, one epoch
each and at most one report per device in it, a report left unsent when its epoch ended going
in a later wave (``esa demo``, ``esa loadtest``): a slow machine takes more epochs, never loses a
period.

:class:`Driver` replays those files (:class:`EpochSource`: only the current epoch's requests,
switching at each boundary) over keep-alive HTTP/1.1 connections with bounded concurrency,
paced to a rate or as fast as the servers answer; it honours ``429`` + ``Retry-After`` and
counts every answer by status. The client is a small asyncio HTTP/1.1 client: on this 2-core
class of machine general-purpose Python clients cost more CPU per request than the shuffler
itself (docs/benchmarks.md, "Shuffler") and would measure themselves.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import secrets
import ssl
import struct
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

import httpx

from common.collection import TrustAnchors, VerifiedConfig, verify_collection
from common.envelope import (
    Contribution,
    FragmentContext,
    load_x25519_public,
    new_nonce,
    seal_contribution,
    seal_fragment,
)
from common.mechanisms import StateUpdate, ValueKind
from common.mechanisms import get as get_mechanism
from common.randomness import SystemSource
from common.retry import retry_after_seconds
from common.wire import ChannelConfig, CollectionConfig, ShufflerInfo

INGEST = "/v1/contributions"
ENROLL = "/v1/enroll"
#: One request record in an epoch file: shuffler index, token length, body length.
RECORD = struct.Struct(">BHI")
#: Attempts of one request after a broken connection or a 429 before it counts as given up.
ATTEMPTS = 5


class LoadError(RuntimeError):
    """The load cannot be prepared (config refused, enrolment failed, worker died)."""


# --- the deployment as a device sees it ----------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One channel of a deployment: its verified config and where its shufflers are."""

    config: VerifiedConfig
    channel: ChannelConfig

    @property
    def shuffler_urls(self) -> list[str]:
        """Every shuffler's base URL, in the config's order (a record's shuffler index)."""
        return [s.url for s in self.config.shufflers]

    def epoch(self, now: float) -> int:
        """The channel's epoch at unix time ``now``."""
        return int(now // self.channel.epoch_seconds)


def fetch_config(analyzer_url: str, trust: TrustAnchors) -> VerifiedConfig:
    """Fetch ``/v1/config`` and verify it against the pinned keys, as the SDK does.

    Raises:
        LoadError: unreachable, mis-signed, expired config, or a shuffler not vouched for.
    """
    try:
        document = httpx.get(analyzer_url + "/v1/config", timeout=30).raise_for_status().json()
        return verify_collection(document, trust, time.time())
    except (httpx.HTTPError, ValueError) as error:
        raise LoadError(f"collection config refused: {error}") from error


def fetch_target(analyzer_url: str, trust: TrustAnchors, channel_id: str) -> Target:
    """The verified config (:func:`fetch_config`) and one of its channels.

    Raises:
        LoadError: unreachable, mis-signed or expired config, or no such channel.
    """
    config = fetch_config(analyzer_url, trust)
    channel = next((c for c in config.channels if c.id == channel_id), None)
    if channel is None:
        raise LoadError(f"channel {channel_id!r} is not in the collection config")
    if get_mechanism(channel.mechanism).value_kind is not ValueKind.CATEGORY:
        raise LoadError(f"channel {channel_id!r} does not take category values")
    return Target(config, channel)


# --- a small asyncio HTTP/1.1 client ------------------------------------------------------


@dataclass(frozen=True)
class Response:
    """Status, lower-cased headers and body of one answer."""

    status: int
    headers: dict[str, str]
    body: bytes


class HttpConnection:
    """One keep-alive HTTP/1.1 connection to ``base_url`` (http or https), reopened after a
    failure; requests on it are sequential."""

    def __init__(self, base_url: str, timeout: float = 60.0) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.timeout = timeout
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes = b""
    ) -> Response:
        """Send one request and read its answer.

        Raises:
            OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError: the
                connection broke or the answer is not HTTP/1.1 (the connection is closed).
        """
        try:
            return await asyncio.wait_for(self._exchange(method, path, headers, body), self.timeout)
        except BaseException:
            self.close()
            raise

    async def _exchange(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        if self._streams is None:
            context = ssl.create_default_context() if self.tls else None
            self._streams = await asyncio.open_connection(self.host, self.port, ssl=context)
        reader, writer = self._streams
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
        answer = {name.strip().lower(): value.strip() for name, value in fields.items()}
        if answer.get("transfer-encoding", "").lower() == "chunked":
            data = await _read_chunked(reader)
        else:
            data = await reader.readexactly(int(answer.get("content-length", "0")))
        if answer.get("connection", "").lower() == "close":
            self.close()
        return Response(status, answer, data)

    def close(self) -> None:
        """Drop the connection (the next request opens a new one)."""
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        data += await reader.readexactly(size + 2)
        if size == 0:
            return bytes(data[:-2])
        del data[-2:]


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
        self.mechanism = get_mechanism(self.channel.mechanism)
        self.params = self.mechanism.parse_params(self.channel.params)
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
        state = self.mechanism.new_state(self.params, self.rng)
        encoded = self.mechanism.encode(self.params, value, state, self.rng, len(self.shufflers))
        return encoded.routes

    def add(self, tokens: list[tuple[str, ...]], values: list[int] | None = None) -> None:
        """New devices with these tokens (one per shuffler), each with its sealed report of
        its value in ``values`` (default: drawn from the population)."""
        chosen: list[int | None] = list(values) if values is not None else [None] * len(tokens)
        self.devices += [_Device(t, self.report(v), v) for t, v in zip(tokens, chosen, strict=True)]

    def seal_epoch(self, epoch: int, count: int, path: str, fresh: bool) -> int:
        """Write the requests of ``count`` devices of this shard (a CSPRNG sample) for
        ``epoch`` to ``path``; returns how many requests were written."""
        chosen = secrets.SystemRandom().sample(range(len(self.devices)), count)
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
        d = self.mechanism.domain_size(self.params)
        sealed = 0
        for device_tokens, changed in zip(tokens, changes, strict=True):
            state = self.mechanism.new_state(self.params, self.rng)
            periods = []
            for t in range(1, d + 1):
                update = StateUpdate(t, t in changed)
                encoded = self.mechanism.encode(
                    self.params, update, state, self.rng, len(self.shufflers)
                )
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
        k = len(self.shufflers)
        target = secrets.randbelow(k) if slot is None else slot % k  # the SDK's routing
        shuffler_id, key = self.shufflers[target]
        channel, crowd = self.channel, self.channel.crowds[0]
        context = FragmentContext(channel.id, epoch, crowd)
        sealed = tuple(
            seal_fragment(f, context, channel.payload_size, self.analyzer) for f in fragments
        )
        contribution = Contribution(
            channel_id=channel.id, crowd_id=crowd, epoch=epoch, nonce=new_nonce(), fragments=sealed
        )
        body = seal_contribution(contribution, shuffler_id, key)
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
    one :class:`_Sealer` (devices and keys) per channel of the config."""
    sealers = {channel_id: _Sealer(config, channel_id, values)}
    while (message := connection.recv()) is not None:
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
            connection.send(("error", f"{type(error).__name__}: {error}"))
            continue
        spent = (time.perf_counter() - start, time.process_time() - cpu)
        connection.send(("ok", (result, *spent)))


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
        self._processes = []
        #: One step at a time on the pipes (``esa demo`` seals a longitudinal wave while a
        #: thread seals histogram devices in the same workers).
        self._lock = threading.Lock()
        for _ in range(workers):
            parent, child = context.Pipe()
            process = context.Process(
                target=_sealer_main,
                args=(child, config, target.channel.id, values),
                daemon=True,
            )
            process.start()
            child.close()  # the worker's end: a dead worker then reads as EOF, never a hang
            self._pipes.append(parent)
            self._processes.append(process)

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
    ) -> tuple[list[Path], SealTiming]:
        """Files of requests from ``count`` distinct devices (at most the pool) for ``epoch``,
        one per worker (of ``channel``, default the target's)."""
        channel = channel or self.target.channel.id
        devices = self.shards.get(channel, [0] * len(self._pipes))
        if count > sum(devices):
            raise LoadError(
                f"{count} contributions per epoch need {count} devices; pool has {sum(devices)}"
            )
        shares = _split(count, devices)
        paths = [directory / f"epoch-{epoch}-{i}.bin" for i in range(len(self._pipes))]
        start = time.perf_counter()
        results = self._all(
            [
                ("seal", channel, (epoch, n, str(p), fresh))
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

    def close(self) -> None:
        """Stop the workers (again: nothing)."""
        pipes, self._pipes = self._pipes, []
        for pipe in pipes:
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                pipe.send(None)
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()

    def __enter__(self) -> SealerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Waves in a row that may hand out nothing before a longitudinal phase gives up: each was
#: sealed for an epoch that ended before its sealing did.
EMPTY_WAVES = 3


@dataclass(frozen=True)
class Wave:
    """One epoch of a longitudinal phase: the epoch, the latest period (1-based) its reports
    may be of, its request files (one per worker) and how many requests they hold."""

    epoch: int
    period: int
    files: list[Path]
    requests: int


class SeriesWaves:
    """A longitudinal channel's reports (:meth:`SealerPool.add_series`) sent in waves, one
    epoch each: wave w holds every device's earliest unsent report of a period up to w, at
    most one per device (a shuffler takes one contribution per client, channel and epoch).
    A report left unsent when its epoch ended goes in a later wave, sealed anew for that
    epoch; the analyzer reads each report's period from the report itself (Erlingsson et al.
    2019, Algorithm 2), never from the epoch, so a slow machine takes more epochs and never
    loses a period. With nothing slow, wave t is period t, as devices in the field send it.
    """

    def __init__(
        self, pool: SealerPool, channel: ChannelConfig, directory: Path, seal_rate: float
    ) -> None:
        self.pool, self.channel, self.directory = pool, channel, directory
        #: Outer envelopes sealed per second: a guess until a wave measures it.
        self.seal_rate = seal_rate
        self.waves: list[Wave] = []
        #: Requests sealed that their epoch ended before sending (sent again later).
        self.rolled_over = 0
        self._pending: int | None = None
        self._empty = 0

    @property
    def epochs(self) -> list[int]:
        """The epochs of the waves so far."""
        return [wave.epoch for wave in self.waves]

    def next_wave(self) -> Wave | None:
        """Seal the next wave for the first epoch that starts after the sealing is likely
        done (never the previous wave's); None once every report is sent."""
        if self._pending == 0:
            return None
        seconds = self.channel.epoch_seconds
        devices = sum(self.pool.shards.get(self.channel.id, [0]))
        ahead = 1.0 + devices / max(self.seal_rate, 1.0)
        after = self.waves[-1].epoch + 1 if self.waves else 0
        epoch = max(after, int((time.time() + ahead) // seconds))
        period = len(self.waves) + 1
        files, timing = self.pool.seal_wave(epoch, period - 1, self.directory, self.channel.id)
        if timing.items:
            self.seal_rate = timing.rate
        self.waves.append(Wave(epoch, period, files, timing.items))
        return self.waves[-1]

    def settle(self, handed: set[str]) -> int:
        """The last wave was sent as far as ``handed`` (its requests' tokens) says; returns
        how many periods are complete (every report of them sent).

        Raises:
            LoadError: :data:`EMPTY_WAVES` waves in a row sent nothing.
        """
        wave = self.waves[-1]
        self.rolled_over += wave.requests - len(handed)
        self._pending, earliest = self.pool.settle(self.channel.id, handed)
        self._empty = 0 if handed or not wave.requests else self._empty + 1
        if self._empty >= EMPTY_WAVES:
            raise LoadError(
                f"{self.channel.id}: {EMPTY_WAVES} waves in a row sent nothing: sealing "
                f"{wave.requests:,} reports takes longer than a {self.channel.epoch_seconds}-s "
                "epoch on this machine (fewer devices, or more sealing workers)"
            )
        return self._periods(earliest)

    def _periods(self, earliest: int | None) -> int:
        mechanism = get_mechanism(self.channel.mechanism)
        total = mechanism.domain_size(mechanism.parse_params(self.channel.params))
        return total if earliest is None else earliest


def _split(total: int, capacities: list[int]) -> list[int]:
    """``total`` spread over shards in proportion to their sizes (never above one)."""
    size = sum(capacities)
    shares = [total * c // size for c in capacities]
    for i in range(total - sum(shares)):
        shares[i % len(shares)] += 1
    return [min(s, c) for s, c in zip(shares, capacities, strict=True)]


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


# --- the services' processes --------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Resident memory and open file descriptors of a process and its descendants."""

    rss_bytes: int
    fds: int
    processes: int


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``); empty once it is gone."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        if current in parents:
            tree.append(current)
            frontier += [child for child, parent in parents.items() if parent == current]
    return tree


def process_usage(pid: int) -> Usage:
    """:class:`Usage` of ``pid`` and every process below it (Linux ``/proc``); zeros once it
    is gone."""
    tree = process_tree(pid)
    rss = fds = 0
    for member in tree:
        try:
            status = Path(f"/proc/{member}/status").read_text()
            rss += 1024 * int(status.split("VmRSS:", 1)[1].split()[0])
            fds += len(os.listdir(f"/proc/{member}/fd"))
        except (OSError, IndexError):
            continue
    return Usage(rss, fds, len(tree))
