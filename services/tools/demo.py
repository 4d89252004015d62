"""The demo's engine: a population of simulated devices through a real deployment, end to end.

Devices run on the load generator's path (:mod:`services.tools.loadgen`: devices in protocol
terms, sealed in worker processes ahead of sending; docs/loadtest.md, "What a simulated device
is"); a longitudinal channel's devices run their tree (Erlingsson et al. 2019, Algorithm 1), one
short epoch per period. The demo then closes the epochs at every shuffler, waits until every
batch has reached the analyzer and compares each channel's release with the population's truth.
Randomized deletion (ESA-revisited Algorithm 3) removes whole contributions at random, so the
estimate targets ``truth * kept``; the interval checked adds that sampling noise
(``truth * kept * (1 - kept)``, the binomial approximation) to the analyzer's standard error.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from common.collection import TrustAnchors, VerifiedConfig
from common.mechanisms import ValueKind, build
from common.mechanisms import get as get_mechanism
from common.retry import retryable_status
from common.wire import ChannelConfig, ChannelList, CollectionConfig, SignedConfig
from services.tools import loadgen, populations, stopping
from services.tools.credentials import Credentials
from services.tools.demo_results import ChannelResult, Truth, check
from services.tools.loadtest import verify

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: Devices sealed per step of the progress bar.
CHUNK = 500
#: Keep-alive connections per shuffler while replaying.
CONNECTIONS = 32


#: Contributions per second a busy machine replays at least (~3,600 on an idle one): how long
#: before its epoch ends the histogram replay does not start (:func:`_replay_guard`).
SLOW_REPLAY_PER_S = 2000.0

#: How long a simulated device keeps retrying a contribution (transport errors, 429, 503), as
#: the SDK's outbox does: long enough for a crashed shuffler to be restarted.
DEVICE_PATIENCE_SECONDS = 120.0


class DemoError(RuntimeError):
    """The demo cannot run or did not complete (message says what and what to do)."""


@dataclass(frozen=True)
class DemoDeployment:
    """A running deployment as the demo reaches it."""

    analyzer_url: str
    trust: TrustAnchors
    tokens: Credentials
    document: SignedConfig
    config: VerifiedConfig

    @property
    def channels(self) -> list[ChannelConfig]:
        """The signed collection config's channels."""
        return list(self.config.channels)

    @property
    def shuffler_urls(self) -> list[str]:
        """Every shuffler's URL, as devices are told."""
        return [s.url for s in self.config.shufflers]


# --- reaching a deployment ----------------------------------------------------------------


#: How long the demo waits for a live analyzer to serve its config (it answers 503
#: ``shufflers_unavailable`` until it has every shuffler's signed descriptor).
CONFIG_WAIT_SECONDS = 120.0


def analyzer_alive(url: str) -> bool:
    """True if an ESA analyzer answers at ``url``: its config, or a 503 saying it is still
    fetching the shufflers' descriptors."""
    try:
        response = httpx.get(url + "/v1/config", timeout=2.0)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return False
    if response.status_code == 503:
        return isinstance(body, dict) and body.get("error") == "shufflers_unavailable"
    return response.status_code == 200 and isinstance(body, dict) and "config" in body


def served_config(url: str, wait: float = CONFIG_WAIT_SECONDS) -> SignedConfig:
    """The analyzer's signed config, waiting up to ``wait`` seconds while it answers 503
    ``shufflers_unavailable``.

    Raises:
        DemoError: unreachable, another answer, or still no config after ``wait`` seconds.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            response = httpx.get(url + "/v1/config", timeout=10.0)
            if response.status_code != 503 or time.monotonic() > deadline:
                return SignedConfig.model_validate_json(response.raise_for_status().content)
        except (httpx.HTTPError, ValueError) as error:
            raise DemoError(f"no analyzer config at {url}: {error}") from error
        time.sleep(0.5)


def connect(analyzer_url: str, trust_file: Path | None, tokens: Credentials) -> DemoDeployment:
    """Fetch and verify the collection config as a device would, with the keys of
    ``trust_file`` (a trust file or a folder of published keys; None: the keys the deployment
    serves itself, trusted on first use), and ``tokens`` for its parties' admin routes.

    Raises:
        DemoError: unreachable analyzer, or a config the pinned keys do not verify.
    """
    from common.collection import CollectionConfigError, verify_collection

    document = served_config(analyzer_url)
    try:
        trust = served_keys(document) if trust_file is None else TrustAnchors.read(trust_file)
        config = verify_collection(document, trust, time.time())
    except (CollectionConfigError, ValueError, KeyError, TypeError) as error:
        raise DemoError(f"the collection config at {analyzer_url} is refused: {error}") from error
    parties = {"analyzer": analyzer_url, **{s.id: s.url for s in config.shufflers}}
    try:
        tokens = tokens.for_parties(parties)
    except ValueError as error:
        raise DemoError(f"{error}: pass --keys or --admin-token") from error
    target = DemoDeployment(
        analyzer_url=analyzer_url, trust=trust, tokens=tokens, document=document, config=config
    )
    for url in target.shuffler_urls:
        try:
            httpx.get(url + "/readyz", timeout=5.0).raise_for_status()
        except httpx.HTTPError as error:
            raise DemoError(
                f"shuffler {url} (from the collection config) is not reachable from here: "
                f"{error}. Devices could not deliver to it; run the demo where the config's "
                "shuffler URLs resolve (for compose: the loadgen service)."
            ) from error
    return target


def served_keys(document: SignedConfig) -> TrustAnchors:
    """The keys a deployment serves for itself: the analyzer's config-signing key and each
    descriptor's signing key (trust on first use, for a demo against a running deployment
    whose trust file is not at hand; an app pins them at build time instead)."""
    config = CollectionConfig.model_validate(document.config)
    shufflers = {
        str(d.descriptor["id"]): str(d.descriptor["signing_key"]) for d in config.shufflers
    }
    return TrustAnchors.from_json({"analyzer": config.analyzer.signing_key, "shufflers": shufflers})


def check_fresh_epochs(target: DemoDeployment, channels: list[ChannelConfig], now: float) -> None:
    """Refuse to run into an epoch an earlier run already closed and released.

    Raises:
        DemoError: naming the channel and when its next epoch starts.
    """
    response = httpx.get(target.analyzer_url + "/v1/channels", timeout=10.0)
    spans = {c.id: c.epochs for c in ChannelList.model_validate_json(response.content).channels}
    for config in channels:
        current = int(now // config.epoch_seconds)
        span = spans.get(config.id)
        if span is not None and span[1] >= current and config.epoch_seconds > 60:
            wait = (current + 1) * config.epoch_seconds - now
            raise DemoError(
                f"channel {config.id!r}: epoch {current} was already closed and released by an "
                f"earlier run, and a closed epoch takes no more contributions. Its next epoch "
                f"starts in {wait / 60:.0f} min; or stop the running deployment and run "
                "`esa demo` alone (it starts a fresh one, on SQLite or on fresh databases)."
            )


# --- the population -----------------------------------------------------------------------


def _ring(shape: tuple[int, int]) -> FloatArray:
    """A bright ring on a dark field: at demo scale (a few thousand devices) k-RAPPOR's noise
    hides a photograph, but a shape with mass on ~60 pixels shows clearly."""
    rows, cols = np.indices(shape, dtype=np.float64)
    centre = (np.array(shape, dtype=np.float64) - 1) / 2
    radius = np.hypot(rows - centre[0], cols - centre[1])
    ring: FloatArray = np.exp(-(((radius - 0.3 * min(shape)) / 0.6) ** 2))
    return ring


def population(config: ChannelConfig, devices: int, rng: np.random.Generator) -> Truth:
    """A population that suits the channel: heavy hitters, an image, counts or state changes.

    A state channel's users change state at most once over its periods, which every
    longitudinal mechanism accepts (k >= 1 changes).
    """
    mechanism = build(config)
    k = mechanism.domain_size()
    if mechanism.value_kind is ValueKind.STATE:
        drawn = populations.longitudinal(devices, k, 1, seed=int(rng.integers(2**31)))
        return Truth(config, drawn.changes.true_counts(), changes=drawn.changes)
    if config.display == "image" and config.image_shape is not None:
        pixels = _ring(config.image_shape).ravel()
        counts = populations.rescale(np.round(1000 * pixels).astype(np.int64), devices)
    elif k > populations.HEAVY_HITTERS:
        counts = populations.heavy_hitters(devices, k, seed=int(rng.integers(2**31))).counts
    else:  # a small domain: Zipf's law over its k values, a few heavy hitters and a tail
        weights = 1.0 / np.arange(1, k + 1)
        counts = rng.multinomial(devices, weights / weights.sum())
    values: IntArray = rng.permutation(np.repeat(np.arange(k), counts)).astype(np.int64)
    return Truth(config, np.asarray(counts, dtype=np.int64), values=values)


# --- devices: the load generator's fast path ------------------------------------------------


@dataclass
class _Delivery:
    """What the replay of one phase saw: acknowledged per channel, refused, never sent."""

    accepted: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    unsent: int = 0

    def merge(self, other: _Delivery) -> None:
        """Add what another phase saw."""
        for cid, count in other.accepted.items():
            self.accepted[cid] = self.accepted.get(cid, 0) + count
        for status, count in other.refused.items():
            self.refused[status] = self.refused.get(status, 0) + count
        self.unsent += other.unsent

    def add(self, channels: list[str], driver: loadgen.Driver, skipped: int) -> None:
        """Count one replay of ``channels`` (request tag i is ``channels[i]``)."""
        for i, cid in enumerate(channels):
            self.accepted[cid] = self.accepted.get(cid, 0) + driver.stats.accepted_by_tag[i]
        for status, count in driver.stats.final.items():
            if status != 202 and not retryable_status(status):  # given_up counts those
                key = str(status)
                self.refused[key] = self.refused.get(key, 0) + count
        self.unsent += driver.stats.given_up + skipped

    def check(self) -> None:
        """Raises DemoError if any contribution was refused or never sent."""
        if self.refused:
            raise DemoError(
                f"the shufflers refused contributions (by status: {self.refused}; late for "
                "their epoch, or 400/413: see the shufflers' logs and "
                "esa_shuffler_contributions_rejected_total)"
            )
        if self.unsent:
            raise DemoError(
                f"{self.unsent} contributions could not be delivered (the epoch ended, or "
                "the shufflers kept answering 429 or broke connections: see their logs)"
            )


def _replay(
    urls: list[str],
    files: dict[str, dict[int, list[Path]]],
    epochs: dict[str, int],
    rate: float | None = None,
) -> tuple[loadgen.Driver, loadgen.ChannelSource]:
    """Send every request of the current epoch(s) at ``rate`` per second in all (None: as fast
    as the shufflers answer); returns the driver (its stats) and the source (what it handed
    out, and how many requests it skipped because their epoch ended)."""
    source = loadgen.ChannelSource(files, epochs)
    driver = loadgen.Driver(urls, concurrency=CONNECTIONS, patience=DEVICE_PATIENCE_SECONDS)
    stopping.run(driver.run(source, rate, 3600.0, until_empty=True))
    return driver, source


def _pieces(columns: list[list[str]], size: int) -> Iterator[tuple[range, list[list[str]]]]:
    """Devices in pieces of ``size``: their range and their tokens at each shuffler."""
    for part in _chunks(len(columns[0]), size):
        yield part, [tokens[part.start : part.stop] for tokens in columns]


def _seal_histograms(
    run: DemoRun,
    pool: loadgen.SealerPool,
    tokens: list[list[str]],
    channels: list[str],
    stop: threading.Event | None = None,
) -> dict[str, dict[int, list[Path]]]:
    """Every histogram device encodes its value (CSPRNG) and seals its report in a worker,
    piece by piece (the progress bar), then one contribution per device and channel is
    sealed for the channel's current epoch. Returns the request files per channel; gives up
    (DemoError) between pieces once ``stop`` is set."""
    for part, columns in _pieces(tokens, CHUNK):
        if stop is not None and stop.is_set():
            raise DemoError("sealing stopped: the run failed")
        for cid in channels:
            values = run.truths[cid].values
            assert values is not None
            pool.add_devices(columns, values[part.start : part.stop].tolist(), cid)
        run.progress("devices", len(part))
    return _seal_current(run, pool, channels)


def _seal_current(
    run: DemoRun, pool: loadgen.SealerPool, channels: list[str]
) -> dict[str, dict[int, list[Path]]]:
    """One contribution per histogram device and channel, in outer envelopes for the
    channel's current epoch (the devices' sealed reports are kept)."""
    files: dict[str, dict[int, list[Path]]] = {}
    for cid in channels:
        epoch = int(time.time() // run.config(cid).epoch_seconds)
        where = run.workdir / "requests" / cid
        where.mkdir(parents=True, exist_ok=True)
        paths, timing = pool.seal_epoch(epoch, run.devices, where, channel=cid)
        files[cid] = {epoch: paths}
        run.requests[cid] = timing.items
    return files


def _current(run: DemoRun, files: dict[str, dict[int, list[Path]]]) -> bool:
    """Whether every channel's requests are for the epoch that is open now."""
    now = time.time()
    return all(int(now // run.config(cid).epoch_seconds) in f for cid, f in files.items())


def _in_time(
    run: DemoRun, pool: loadgen.SealerPool, files: dict[str, dict[int, list[Path]]]
) -> dict[str, dict[int, list[Path]]]:
    """The histogram requests, sealed for epochs that stay open while they are replayed: when
    a channel's epoch ends within :func:`_replay_guard` seconds the demo waits for the next
    one (a request left over at the boundary would be refused as late), and requests sealed
    for an epoch that has ended are sealed again (then checked again: sealing takes time).

    Raises:
        DemoError: a channel's epoch is shorter than its replay may take.
    """
    channels = list(files)
    guard = _replay_guard(run, channels)
    seconds = [run.config(c).epoch_seconds for c in channels]
    if min(seconds) <= guard:
        raise DemoError(
            f"the histogram channels' epochs ({min(seconds)} s) are shorter than sending "
            f"{sum(run.requests.values()):,} requests may take ({guard:.0f} s): use fewer "
            "--devices, or --channel to leave the channel with the short epoch out"
        )
    for _ in range(3):
        wait = seconds_to_wait(time.time(), seconds, guard)
        if wait > 0:
            run.say(f"waiting {wait:.0f} s for the next epoch: the replay must not cross one")
            time.sleep(wait)
        if _current(run, files) and seconds_to_wait(time.time(), seconds, guard) == 0:
            return files
        files = _seal_current(run, pool, channels)
    raise DemoError("could not seal the histogram requests inside one epoch (machine too busy)")


def seconds_to_wait(now: float, epoch_seconds: list[int], guard: float) -> float:
    """How long to wait at unix time ``now`` so that ``guard`` seconds fit before the end of
    the current epoch of every length in ``epoch_seconds``: 0 when they fit now, else until
    just after the first of them ends."""
    ends = min((int(now // s) + 1) * s for s in epoch_seconds)
    return 0.0 if ends - now >= guard else ends - now + 0.1


def _replay_guard(run: DemoRun, channels: list[str]) -> float:
    """Seconds the histogram replay may take on a busy machine: the sealed requests at
    :data:`SLOW_REPLAY_PER_S`, and a few seconds to start."""
    requests = sum(run.requests.get(c, run.devices) for c in channels)
    return 3.0 + requests / SLOW_REPLAY_PER_S


#: Outer envelopes a worker pool seals per second, a guess until the first wave measures it.
SERIES_SEAL_RATE = 1500.0


def _add_series(
    run: DemoRun, pool: loadgen.SealerPool, tokens: list[list[str]], configs: list[ChannelConfig]
) -> list[loadgen.SeriesWaves]:
    """Every longitudinal device runs its tree through each channel's periods (Erlingsson
    et al. 2019, Algorithm 1), encoded and sealed to the analyzer ahead of time; the outer
    envelopes are sealed wave by wave (:class:`loadgen.SeriesWaves`)."""
    found = []
    for config in configs:
        truth = run.truths[config.id]
        assert truth.changes is not None
        changes: list[list[int]] = [[] for _ in range(run.devices)]
        for user, period in zip(truth.changes.user, truth.changes.period, strict=True):
            changes[int(user)].append(int(period))
        pool.add_series(tokens, changes, config.id)
        where = run.workdir / "requests" / config.id
        found.append(loadgen.SeriesWaves(pool, config, where, SERIES_SEAL_RATE))
    return found


def _send_series(run: DemoRun, waves: loadgen.SeriesWaves, seen: _Seen) -> _Delivery:
    """A longitudinal channel's waves, each sent during its own epoch; what an epoch's end
    left unsent goes in a later wave. ``seen`` holds the epochs used (what to close if the
    run fails)."""
    config, delivery, done = waves.channel, _Delivery(), 0
    while (wave := waves.next_wave()) is not None:
        time.sleep(max(0.0, wave.epoch * config.epoch_seconds + 0.05 - time.time()))
        seen.epochs[config.id] = (waves.epochs[0], wave.epoch)
        files = {config.id: {wave.epoch: wave.files}}
        driver, source = _replay(run.target.shuffler_urls, files,
                                 {config.id: config.epoch_seconds}, run.rate)  # fmt: skip
        delivery.add([config.id], driver, 0)
        periods = waves.settle(source.handed)
        run.progress(config.id, periods - done)
        done = periods
    if waves.rolled_over:
        run.say(
            f"{config.id}: {waves.rolled_over:,} reports sent in a later epoch than their "
            f"period's ({len(waves.waves)} epochs for {done} periods: a busy machine)"
        )
    return delivery


# --- the run ------------------------------------------------------------------------------


@dataclass
class DemoRun:
    """Inputs of one demo run."""

    target: DemoDeployment
    devices: int
    workdir: Path
    seed: int = 0
    workers: int = 2
    only: tuple[str, ...] = ()
    rate: float | None = None
    progress: Callable[[str, int], None] = lambda _, __: None
    #: Where a line for the person watching goes (the CLI prints it above the progress bars).
    say: Callable[[str], None] = lambda _: None
    truths: dict[str, Truth] = field(default_factory=dict)
    #: Requests sealed per histogram channel (its devices' routes), once sealed.
    requests: dict[str, int] = field(default_factory=dict)

    def config(self, channel_id: str) -> ChannelConfig:
        """The channel of the collection config named ``channel_id``."""
        return next(c for c in self.target.channels if c.id == channel_id)


def _kind(config: ChannelConfig) -> ValueKind:
    return get_mechanism(config.mechanism).value_kind


def periods(config: ChannelConfig) -> int | None:
    """How many periods a state channel runs through (None for value channels)."""
    mechanism = get_mechanism(config.mechanism)
    if mechanism.value_kind is not ValueKind.STATE:
        return None
    return build(config).domain_size()


def selected(target: DemoDeployment, only: tuple[str, ...]) -> list[ChannelConfig]:
    """The channels to drive: all of the config's, or those named in ``only``.

    Raises:
        DemoError: a named channel is not in the collection config.
    """
    known = {c.id: c for c in target.channels}
    unknown = [c for c in only if c not in known]
    if unknown:
        raise DemoError(
            f"unknown channel(s) {', '.join(unknown)}; the config has {', '.join(known)}"
        )
    return [c for c in target.channels if not only or c.id in only]


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _patiently(send: Callable[[], httpx.Response], what: str) -> httpx.Response:
    """``send()``, tried again after a transport error or a 503 for up to
    :data:`DEVICE_PATIENCE_SECONDS`, with backoff: a shuffler being restarted (in compose its
    name does not even resolve for a while).

    Raises:
        DemoError: still failing at the deadline.
    """
    deadline, delay = time.monotonic() + DEVICE_PATIENCE_SECONDS, 0.2
    while True:
        try:
            response = send()
            if response.status_code != 503:
                return response
            failure = f"HTTP 503: {response.text[:200]}"
        except httpx.TransportError as error:
            failure = f"{type(error).__name__}: {error}"
        if time.monotonic() > deadline:
            raise DemoError(f"{what}: {failure}")
        time.sleep(delay)
        delay = min(2 * delay, 3.0)


def _close(target: DemoDeployment, channel_id: str, epoch: int) -> None:
    for url in target.shuffler_urls:
        send = functools.partial(
            httpx.post,
            url + "/v1/admin/close",
            json={"channel_id": channel_id, "epoch": epoch},
            headers=target.tokens.admin_headers(url),
            timeout=120.0,
        )
        response = _patiently(send, f"closing {channel_id} epoch {epoch} at {url}")
        if response.status_code != 200:
            raise DemoError(f"closing {channel_id} epoch {epoch} at {url}: {response.text}")


_UNFORWARDED = re.compile(r'esa_shuffler_queue_depth\{state="in_batches_unforwarded"\} (\S+)')


_UNOPENED = re.compile(r"^esa_analyzer_parts_unopened (\S+)$", re.MULTILINE)


def _wait_metric(
    url: str, pattern: re.Pattern[str], what: str, deadline: float, tokens: Credentials
) -> None:
    """Poll ``url``'s ``/metrics`` (with its metrics token) until ``pattern``'s value is 0."""
    headers = tokens.metrics_headers(url)
    # One client for every poll: a new one per request builds a TLS context (~20 ms of CPU).
    with httpx.Client(timeout=10.0) as client:
        send = functools.partial(client.get, url + "/metrics", headers=headers)
        while True:
            response = _patiently(send, f"{url}/metrics")
            if response.status_code != 200:
                raise DemoError(
                    f"{url}/metrics answered HTTP {response.status_code}: "
                    f"{response.text[:200]} (its metrics token: --keys <dir>/<party>/"
                    "metrics-token, or --admin-token)"
                )
            found = pattern.search(response.text)
            if found is not None and float(found.group(1)) == 0:
                return
            if time.monotonic() > deadline:
                raise DemoError(f"{url} still holds {what}")
            time.sleep(0.2)


def _wait_forwarded(target: DemoDeployment, timeout: float = 600.0) -> None:
    """Until every shuffler has forwarded its batches and the analyzer has opened them all."""
    deadline = time.monotonic() + timeout
    for url in target.shuffler_urls:
        _wait_metric(url, _UNFORWARDED, "unforwarded batches", deadline, target.tokens)
    _wait_metric(target.analyzer_url, _UNOPENED, "unopened batch parts", deadline, target.tokens)


def simulate(run: DemoRun) -> dict[str, tuple[int, int, int, int]]:
    """Drive every device; returns per channel (devices, delivered, first epoch, last epoch).

    The load generator's fast path (:mod:`services.tools.loadgen`): each device enrolls at
    every shuffler over HTTP (its own tokens), encodes its value with the OS CSPRNG and
    seals it in a worker process; the requests are replayed over keep-alive connections.
    ``run.progress`` is told ``("devices", k)`` as devices have sealed their reports and
    ``(channel_id, 1)`` as each longitudinal period ends; the phases overlap as
    :func:`_drive` says.

    Raises:
        DemoError: enrolment or sealing failed, or contributions were refused or not sent.
    """
    target, rng = run.target, np.random.default_rng(run.seed)
    channels = selected(target, run.only)
    run.truths = {c.id: population(c, run.devices, rng) for c in channels}
    seen = _Seen()
    first = loadgen.Target(target.config, channels[0])
    try:
        with loadgen.SealerPool(first, run.workers, loadgen.ZipfValues(2)) as pool:
            tokens = stopping.run(loadgen.enroll(target.shuffler_urls, run.devices))
            pool.ready()
            try:
                _drive(run, pool, tokens, channels, seen)
            except KeyboardInterrupt:  # stopped: its epochs end on time, as every epoch does
                raise
            except BaseException:
                _close_all(run.target, seen, failing=True)
                raise
            _close_all(run.target, seen, failing=False)
    except loadgen.LoadError as error:
        raise DemoError(f"the simulated devices could not report: {error}") from error
    seen.delivery.check()
    accepted = seen.delivery.accepted
    return {cid: (run.devices, accepted.get(cid, 0), *seen.epochs[cid]) for cid in run.truths}


def _close_all(target: DemoDeployment, seen: _Seen, failing: bool) -> None:
    """Close every epoch the run used that is not closed yet, even when it failed (so that
    a later run never merges with it), then wait until the analyzer has opened everything.
    While an error is on its way (``failing``), a failure here is not raised in its place."""
    try:
        for cid, (_, last) in seen.epochs.items():
            if cid not in seen.closed:
                _close(target, cid, last)
        _wait_forwarded(target)
        closing = {cid: [last] for cid, (_, last) in seen.epochs.items()}
        try:
            verify.close_at_analyzer(target.analyzer_url, target.tokens, closing)
        except verify.VerifyError as error:
            raise DemoError(str(error)) from error
    except (DemoError, httpx.HTTPError):
        if not failing:
            raise


@dataclass
class _Seen:
    """What a run delivered, the (first, last) epoch of each channel, what it closed."""

    delivery: _Delivery = field(default_factory=_Delivery)
    epochs: dict[str, tuple[int, int]] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)

    def close(self, target: DemoDeployment, channel_id: str) -> None:
        """Close the channel's last epoch at every shuffler: the analyzer opens its
        batches while the run goes on."""
        _close(target, channel_id, self.epochs[channel_id][1])
        self.closed.add(channel_id)


def _send_all(run: DemoRun, series: list[loadgen.SeriesWaves], seen: _Seen) -> None:
    """Every longitudinal channel's periods, one channel after the other, each closed once
    its last report is sent."""
    for waves in series:
        seen.delivery.merge(_send_series(run, waves, seen))
        seen.close(run.target, waves.channel.id)


def _drive(
    run: DemoRun,
    pool: loadgen.SealerPool,
    tokens: list[list[str]],
    channels: list[ChannelConfig],
    seen: _Seen,
) -> None:
    """Longitudinal channels are sealed first; while their periods are sent (at most one
    request per device in each 10-second epoch, far below what the shufflers accept), the
    histogram devices encode and seal in the pool's workers (a report a wave could not send
    in its epoch goes in the next wave); then the histogram requests are
    replayed inside one epoch (:func:`_in_time`). Each channel is closed once it is sent."""
    histograms = [c.id for c in channels if _kind(c) is not ValueKind.STATE]
    series = _add_series(run, pool, tokens, [c for c in channels if _kind(c) is ValueKind.STATE])
    if not histograms:
        _send_all(run, series, seen)
        return
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="esa-demo-sealing") as background:
        sealing = background.submit(_seal_histograms, run, pool, tokens, histograms, stop)
        try:
            _send_all(run, series, seen)
        except BaseException:
            stop.set()  # the sealing gives up at its next piece
            raise
        files = sealing.result()
    files = _in_time(run, pool, files)
    seconds = {cid: run.config(cid).epoch_seconds for cid in histograms}
    driver, source = _replay(run.target.shuffler_urls, files, seconds, run.rate)
    seen.delivery.add(histograms, driver, source.skipped)
    seen.epochs |= {cid: (min(f), max(f)) for cid, f in files.items()}
    for cid in histograms:
        seen.close(run.target, cid)


def results(run: DemoRun, sent: dict[str, tuple[int, int, int, int]]) -> list[ChannelResult]:
    """Each channel's release from the analyzer, compared with the truth."""
    out = []
    for config in selected(run.target, run.only):
        devices, delivered, first, last = sent[config.id]
        truth = run.truths[config.id]
        k = truth.counts.size
        response = httpx.get(
            f"{run.target.analyzer_url}/v1/channels/{config.id}/estimate",
            params={"epoch_from": first, "epoch_to": last, "top": k},
            timeout=60.0,
        )
        if response.status_code != 200:
            raise DemoError(
                f"the analyzer released nothing for {config.id!r} in epochs {first}..{last}: "
                f"{response.text} (with too few devices every batch stays below the channel's "
                "minimum crowd after randomized deletion: try more --devices)"
            )
        release = response.json()
        if release["n"] > devices:
            raise DemoError(
                f"{config.id!r}: the release counts {release['n']} contributions but this "
                f"run sent {devices}: other clients reported in the same epoch, so it cannot be "
                "compared with this run's truth (run the demo on its own deployment)"
            )
        result = ChannelResult(
            channel_id=config.id,
            title=config.title or config.id,
            mechanism=config.mechanism,
            display=config.display,
            devices=devices,
            delivered=delivered,
            release=release,
            truth=[int(c) for c in truth.counts],
        )
        check(result, truth)
        result.privacy = privacy(run.target, config.id)
        out.append(result)
    return out


def privacy(target: DemoDeployment, channel_id: str) -> dict[str, Any]:
    """The channel's privacy ledger: each epoch's certificate, the lifetime ε of a device in
    every epoch so far (dp_accounting PLD beside basic composition, δ split) and the device
    budget in use.

    Raises:
        DemoError: the analyzer does not answer it.
    """
    response = httpx.get(f"{target.analyzer_url}/v1/channels/{channel_id}/privacy", timeout=120.0)
    if response.status_code != 200:
        raise DemoError(f"the analyzer's privacy ledger of {channel_id!r}: {response.text}")
    body: dict[str, Any] = response.json()
    return body
