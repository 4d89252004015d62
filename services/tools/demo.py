"""``esa demo``: a population of simulated devices through the real SDK, end to end.

Every device is an :class:`encoder_client.Client` with its own SQLite state file. It verifies
the signed collection config against the pinned analyzer key, encodes with the operating
system's CSPRNG, seals for the analyzer and one shuffler, enrols and POSTs over HTTP, exactly
like an app. The demo then closes the epoch at every shuffler (admin close), waits until every
batch has reached the analyzer, reads each channel's release and compares it with the
population's truth.

Randomized deletion (ESA-revisited, Algorithm 3) removes whole contributions at random before
the analyzer sees them, so the estimate targets ``truth * kept`` where ``kept`` is the share of
contributions that reached it; the interval the demo checks adds that sampling noise
(``truth * kept * (1 - kept)``, the binomial approximation) to the analyzer's standard error.
"""

from __future__ import annotations

import base64
import math
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from common.mechanisms import ValueKind
from common.mechanisms import get as get_mechanism
from common.mechanisms.longitudinal import ChangeLog
from common.wire import ChannelConfig, ChannelList, CollectionConfig, SignedConfig
from services.tools import populations

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: Two-sided 95% normal quantile.
Z95 = 1.959963984540054
#: Devices handled per worker task (one progress-bar step).
CHUNK = 50
#: How many of a channel's largest true bins the demo prints and checks.
SHOWN = 5
#: At most this many devices report on a longitudinal channel: each of its periods is one
#: short epoch, and every report of a period must reach a shuffler before that epoch ends.
LONGITUDINAL_DEVICES = 800
#: Threads per worker process that deliver one longitudinal period's reports.
PERIOD_THREADS = 8


class DemoError(RuntimeError):
    """The demo cannot run or did not complete (message says what and what to do)."""


@dataclass(frozen=True)
class Target:
    """A running deployment as the demo reaches it."""

    analyzer_url: str
    trusted_key: str
    admin_token: str
    document: SignedConfig
    config: CollectionConfig

    @property
    def channels(self) -> list[ChannelConfig]:
        """The signed collection config's channels."""
        return list(self.config.channels)

    @property
    def shuffler_urls(self) -> list[str]:
        """Every shuffler's URL, as devices are told."""
        return [s.url for s in self.config.shufflers]


@dataclass
class Truth:
    """What the simulated devices of one channel hold.

    Attributes:
        config: The channel.
        values: One value per device (histogram channels).
        changes: The change log (longitudinal channels).
        counts: True histogram (or per-period sum of states) over all devices.
    """

    config: ChannelConfig
    counts: IntArray
    values: IntArray | None = None
    changes: ChangeLog | None = None


@dataclass
class ChannelResult:
    """One channel's outcome: what was sent, what the analyzer released, how it compares."""

    channel_id: str
    title: str
    mechanism: str
    display: str
    devices: int
    delivered: int
    release: dict[str, Any]
    truth: list[int]
    bins: list[int] = field(default_factory=list)
    checked: list[dict[str, float]] = field(default_factory=list)

    @property
    def n(self) -> int:
        """Contributions the release counts."""
        return int(self.release["n"])

    @property
    def kept(self) -> float:
        """Share of devices whose contribution reached the analyzer (randomized deletion)."""
        return min(1.0, self.n / self.devices) if self.devices else 0.0

    @property
    def central_eps(self) -> float:
        """The certified central ε of the release."""
        eps = self.release["certificate"]["eps"]
        return math.inf if eps is None else float(eps)  # JSON carries "no bound" as null

    @property
    def local_eps(self) -> float | None:
        """The local ε of one report in the certificate's notion, if the mechanism has one."""
        local = self.release.get("local") or {}
        notion = "replacement" if self.neighbouring == "replacement" else "removal"
        value = local.get(notion)
        return None if value is None or not math.isfinite(value) else float(value)

    @property
    def neighbouring(self) -> str:
        """The neighbouring notion of the certificate (the local ε is shown in the same one)."""
        return str(self.release["certificate"]["neighbouring"])

    @property
    def add_remove_eps(self) -> float | None:
        """ε for whether a user took part at all (add-remove, with randomized deletion)."""
        other = self.release.get("with_randomized_deletion") or {}
        value = other.get("eps")
        return None if value is None else float(value)

    @property
    def inside(self) -> int:
        """How many checked bins hold their expected value inside the interval."""
        return sum(1 for row in self.checked if row["lo"] <= row["expected"] <= row["hi"])

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``esa demo --json``)."""
        return {
            "channel_id": self.channel_id,
            "mechanism": self.mechanism,
            "devices": self.devices,
            "delivered": self.delivered,
            "n": self.n,
            "kept": self.kept,
            "central_eps": self.central_eps if math.isfinite(self.central_eps) else None,
            "neighbouring": self.release["certificate"]["neighbouring"],
            "central_delta": self.release["certificate"]["delta"],
            "method": self.release["certificate"]["method"],
            "local_eps": self.local_eps,
            "add_remove_eps": self.add_remove_eps,
            "rmse": self.rmse,
            "checked": self.checked,
            "inside": self.inside,
        }

    @property
    def rmse(self) -> float:
        """Root-mean-square error of the estimate against ``truth * kept`` over all bins."""
        values = np.zeros(len(self.truth))
        values[np.array(self.release["bins"], dtype=np.int64)] = self.release["values"]
        return float(np.sqrt(np.mean((values - np.array(self.truth) * self.kept) ** 2)))


# --- reaching a deployment ----------------------------------------------------------------


def analyzer_alive(url: str) -> bool:
    """True if an ESA analyzer answers at ``url``."""
    try:
        response = httpx.get(url + "/v1/config", timeout=2.0)
        return response.status_code == 200 and "config" in response.json()
    except (httpx.HTTPError, ValueError):
        return False


def connect(analyzer_url: str, trusted_key: str | None, admin_token: str) -> Target:
    """Fetch and verify the collection config as a device would.

    Raises:
        DemoError: unreachable analyzer, or a config the pinned key does not verify.
    """
    from common.collection import CollectionConfigError, verify_config
    from common.envelope import load_ed25519_public

    try:
        response = httpx.get(analyzer_url + "/v1/config", timeout=10.0).raise_for_status()
        document = SignedConfig.model_validate_json(response.content)
    except (httpx.HTTPError, ValueError) as error:
        raise DemoError(f"no analyzer at {analyzer_url}: {error}") from error
    try:
        key = trusted_key or str(document.config["analyzer"]["signing_key"])
        config = verify_config(document, load_ed25519_public(base64.b64decode(key)), time.time())
    except (CollectionConfigError, ValueError, KeyError, TypeError) as error:
        raise DemoError(f"the collection config at {analyzer_url} is refused: {error}") from error
    target = Target(analyzer_url, key, admin_token, document, config)
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


def check_fresh_epochs(target: Target, channels: list[ChannelConfig], now: float) -> None:
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
    mechanism = get_mechanism(config.mechanism)
    k = mechanism.domain_size(mechanism.parse_params(config.params))
    if mechanism.value_kind is ValueKind.STATE:
        drawn = populations.longitudinal(devices, k, 1, seed=int(rng.integers(2**31)))
        return Truth(config, drawn.changes.true_counts(), changes=drawn.changes)
    if config.display == "image" and config.image_shape is not None:
        pixels = _ring(config.image_shape).ravel()
        counts = populations.rescale(np.round(1000 * pixels).astype(np.int64), devices)
    elif k > populations.HEAVY_HITTERS:
        counts = populations.heavy_hitters(devices, k, seed=int(rng.integers(2**31))).counts
    else:
        # Balcer–Cheu's analyzer only reports bins holding more than about n·(1 − p) users
        # (MECHANISMS.md §4), a large share at demo scale: one dominant bin shows it at work.
        weights = 0.25 ** np.arange(k)
        counts = rng.multinomial(devices, weights / weights.sum())
    values: IntArray = rng.permutation(np.repeat(np.arange(k), counts)).astype(np.int64)
    return Truth(config, np.asarray(counts, dtype=np.int64), values=values)


# --- devices (run in worker processes) ----------------------------------------------------


@dataclass(frozen=True)
class DeviceJob:
    """Devices ``first..first+len(values)-1``: report each channel's value, then deliver."""

    config_file: str
    trusted_key: str
    state_dir: str
    first: int
    values: dict[str, list[int]]


def _deliver_all(client: Any, deadline: float) -> int:
    delivered = client.flush()
    while client.state.outbox_size() and time.monotonic() < deadline:
        time.sleep(0.2)
        delivered += client.flush()
    return int(delivered)


def _more_files() -> None:
    """Raise this process's open-file limit to the hard limit: every open Client holds its
    SQLite files and keep-alive sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_devices(job: DeviceJob) -> dict[str, int]:
    """Each device reports once on every histogram channel; returns contributions delivered
    per channel (and ``"_left"``: still in outboxes after retrying for a minute)."""
    from encoder_client import Client

    delivered = {c: 0 for c in job.values}
    left = dropped = 0
    count = len(next(iter(job.values.values()))) if job.values else 0
    for offset in range(count):
        path = Path(job.state_dir) / f"device-{job.first + offset}.db"
        with Client(
            config_file=job.config_file,
            trusted_key=job.trusted_key,
            state_path=path,
            background=False,
        ) as client:
            for channel_id, values in job.values.items():
                client.histogram(channel_id).report(int(values[offset]))
                delivered[channel_id] += 1
            queued = client.state.outbox_size()
            acknowledged = _deliver_all(client, time.monotonic() + 60)
            left += client.state.outbox_size()
            dropped += queued - acknowledged - client.state.outbox_size()
    return {**delivered, "_left": left, "_dropped": dropped}


@dataclass(frozen=True)
class LongitudinalJob:
    """Devices of one longitudinal channel, driven period by period on the channel's epochs."""

    config_file: str
    trusted_key: str
    state_dir: str
    channel_id: str
    epoch_seconds: int
    first_epoch: int
    devices: list[int]
    changes: dict[int, list[int]]  # device -> periods at which its state changes
    d: int


def run_longitudinal(job: LongitudinalJob) -> dict[str, int]:
    """Period t runs in epoch ``first_epoch + t - 1``: every device tells the SDK whether its
    state changed and delivers the report the tree asks for (Erlingsson et al. 2019, Alg. 1).
    The devices' clients stay open across periods, as in an app that keeps running."""
    from contextlib import ExitStack

    from encoder_client import Client

    _more_files()
    sent = late = queued = 0
    with ExitStack() as stack:
        clients = {
            device: stack.enter_context(
                Client(
                    config_file=job.config_file,
                    trusted_key=job.trusted_key,
                    state_path=Path(job.state_dir) / f"device-{device}.db",
                    background=False,
                )
            )
            for device in job.devices
        }
        for t in range(1, job.d + 1):
            start = (job.first_epoch + t - 1) * job.epoch_seconds
            time.sleep(max(0.0, start + 0.05 - time.time()))
            deadline = time.monotonic() + job.epoch_seconds

            def period(
                item: tuple[int, Any], t: int = t, start: float = start, until: float = deadline
            ) -> tuple[int, int]:
                device, client = item
                if time.time() >= start + job.epoch_seconds - 0.3:
                    raise DemoError(
                        f"period {t} of {job.channel_id!r} overran its {job.epoch_seconds}-second "
                        "epoch: this machine is too busy (stop other work, or try --channel to "
                        "leave the longitudinal channel out)"
                    )
                before = client.state.outbox_size()
                client.longitudinal(job.channel_id).update(t, t in job.changes.get(device, ()))
                if client.state.outbox_size() > before:
                    return 1, _deliver_all(client, until)
                return 0, 0

            # Devices are independent; threads overlap their HTTP round trips.
            with ThreadPoolExecutor(PERIOD_THREADS) as threads:
                for reported, acknowledged in threads.map(period, clients.items()):
                    queued += reported
                    sent += acknowledged
        late = sum(client.state.outbox_size() for client in clients.values())
    return {job.channel_id: sent, "_left": late, "_dropped": queued - sent - late}


# --- the run ------------------------------------------------------------------------------


@dataclass
class DemoRun:
    """Inputs of one demo run."""

    target: Target
    devices: int
    workdir: Path
    seed: int = 0
    workers: int = 2
    only: tuple[str, ...] = ()
    progress: Callable[[str, int], None] = lambda _, __: None
    truths: dict[str, Truth] = field(default_factory=dict)


def _kind(config: ChannelConfig) -> ValueKind:
    return get_mechanism(config.mechanism).value_kind


def periods(config: ChannelConfig) -> int | None:
    """How many periods a state channel runs through (None for value channels)."""
    mechanism = get_mechanism(config.mechanism)
    if mechanism.value_kind is not ValueKind.STATE:
        return None
    return mechanism.domain_size(mechanism.parse_params(config.params))


def selected(target: Target, only: tuple[str, ...]) -> list[ChannelConfig]:
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


def _close(target: Target, channel_id: str, epoch: int) -> None:
    for url in target.shuffler_urls:
        response = httpx.post(
            url + "/v1/admin/close",
            json={"channel_id": channel_id, "epoch": epoch},
            headers={"Authorization": f"Bearer {target.admin_token}"},
            timeout=120.0,
        )
        if response.status_code != 200:
            raise DemoError(f"closing {channel_id} epoch {epoch} at {url}: {response.text}")


_UNFORWARDED = re.compile(r'esa_shuffler_queue_depth\{state="in_batches_unforwarded"\} (\S+)')


_UNOPENED = re.compile(r"^esa_analyzer_parts_unopened (\S+)$", re.MULTILINE)


def _wait_metric(
    url: str, pattern: re.Pattern[str], what: str, deadline: float, token: str | None = None
) -> None:
    """Poll ``url``'s ``/metrics`` (as ``token`` when given) until ``pattern``'s value is 0."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    while True:
        found = pattern.search(httpx.get(url + "/metrics", headers=headers, timeout=10.0).text)
        if found is not None and float(found.group(1)) == 0:
            return
        if time.monotonic() > deadline:
            raise DemoError(f"{url} still holds {what}")
        time.sleep(0.2)


def _wait_forwarded(target: Target, timeout: float = 300.0) -> None:
    """Until every shuffler has forwarded its batches and the analyzer has opened them all."""
    deadline = time.monotonic() + timeout
    for url in target.shuffler_urls:
        _wait_metric(url, _UNFORWARDED, "unforwarded batches", deadline, target.admin_token)
    _wait_metric(target.analyzer_url, _UNOPENED, "unopened batch parts", deadline)


def simulate(run: DemoRun) -> dict[str, tuple[int, int, int, int]]:
    """Drive every device; returns per channel (devices, delivered, first epoch, last epoch).

    ``run.progress`` is told ``("devices", k)`` as histogram devices finish and
    ``(channel_id, 1)`` as each longitudinal period ends.
    """
    target, rng = run.target, np.random.default_rng(run.seed)
    config_file = run.workdir / "config.json"
    config_file.write_text(target.document.model_dump_json())
    state_dir = run.workdir / "devices"
    state_dir.mkdir(parents=True, exist_ok=True)
    channels = selected(target, run.only)
    stateful = {c.id for c in channels if _kind(c) is ValueKind.STATE}
    sizes = {
        c.id: min(run.devices, LONGITUDINAL_DEVICES) if c.id in stateful else run.devices
        for c in channels
    }
    run.truths = {c.id: population(c, sizes[c.id], rng) for c in channels}
    histograms = {c.id: c for c in channels if c.id not in stateful}
    series = [c for c in channels if c.id in stateful]
    totals: dict[str, int] = dict.fromkeys(run.truths, 0)
    epochs: dict[str, tuple[int, int]] = {}
    started = time.time()
    left_h, dropped_h = _run_histograms(run, list(histograms), config_file, state_dir, totals)
    finished = time.time()
    for cid, config in histograms.items():
        epochs[cid] = (
            int(started // config.epoch_seconds),
            int(finished // config.epoch_seconds),
        )
    try:
        left, dropped = _run_series(run, series, sizes, config_file, state_dir, epochs, totals)
    finally:
        # Close what this run used even when it failed, so a later run never merges with it.
        for cid, (_, last) in epochs.items():
            _close(target, cid, last)
        _wait_forwarded(target)
    dropped, left = dropped + dropped_h, left + left_h
    if dropped:
        raise DemoError(
            f"the shufflers refused {dropped} contributions for good (late "
            "for their epoch, or 400/413: see the shufflers' logs and "
            "esa_shuffler_contributions_rejected_total)"
        )
    if left:
        raise DemoError(f"{left} contributions could not be delivered (see the shufflers' logs)")
    return {cid: (sizes[cid], totals[cid], *epochs[cid]) for cid in run.truths}


def _run_histograms(
    run: DemoRun, channel_ids: list[str], config_file: Path, state_dir: Path, totals: dict[str, int]
) -> tuple[int, int]:
    """Phase 1: the histogram channels, as fast as the machine allows, in worker processes.

    Adds what each channel delivered to ``totals``; returns (left undelivered, refused).
    """
    left = dropped = 0
    with ProcessPoolExecutor(run.workers) as pool:
        futures = {}
        for chunk in _chunks(run.devices, CHUNK):
            values = {
                cid: [int(v) for v in run.truths[cid].values[chunk]]  # type: ignore[index]
                for cid in channel_ids
            }
            job = DeviceJob(
                str(config_file), run.target.trusted_key, str(state_dir), chunk.start, values
            )
            futures[pool.submit(run_devices, job)] = len(chunk)
        for future in as_completed(futures):
            result = future.result()
            left += result.pop("_left")
            dropped += result.pop("_dropped")
            for cid, sent in result.items():
                totals[cid] += sent
            run.progress("devices", futures[future])
    return left, dropped


def _run_series(
    run: DemoRun,
    series: list[ChannelConfig],
    sizes: dict[str, int],
    config_file: Path,
    state_dir: Path,
    epochs: dict[str, tuple[int, int]],
    totals: dict[str, int],
) -> tuple[int, int]:
    """Phase 2 of :func:`simulate`; returns (left in outboxes, refused for good)."""
    target = run.target
    left = dropped = 0
    # Phase 2: longitudinal channels, one period per (short) epoch. They run on a quiet machine:
    # every report of a period has to reach a shuffler before its epoch ends.
    for config in series:
        truth = run.truths[config.id]
        assert truth.changes is not None
        d = periods(config) or 1
        changes: dict[int, list[int]] = {}
        for user, period in zip(truth.changes.user, truth.changes.period, strict=True):
            changes.setdefault(int(user), []).append(int(period))
        # Start at an epoch boundary far enough away for every worker to open its clients.
        lead = 2.0 + 0.03 * sizes[config.id] / run.workers
        first = int((time.time() + lead) // config.epoch_seconds) + 1
        epochs[config.id] = (first, first + d - 1)
        parts = np.array_split(np.arange(sizes[config.id]), run.workers)
        with ProcessPoolExecutor(run.workers) as pool:
            futures = [
                pool.submit(
                    run_longitudinal,
                    LongitudinalJob(
                        str(config_file),
                        target.trusted_key,
                        str(state_dir / config.id),
                        config.id,
                        config.epoch_seconds,
                        first,
                        [int(i) for i in part],
                        {int(i): changes.get(int(i), []) for i in part},
                        d,
                    ),
                )
                for part in parts
            ]
            for t in range(1, d + 1):
                end = (first + t) * config.epoch_seconds
                while time.time() < end and not all(f.done() for f in futures):
                    time.sleep(0.1)
                run.progress(config.id, 1)
            for future in futures:
                result = future.result()
                left += result.pop("_left")
                dropped += result.pop("_dropped")
                for cid, sent in result.items():
                    totals[cid] += sent
    return left, dropped


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
            config.id,
            config.title or config.id,
            config.mechanism,
            config.display,
            devices,
            delivered,
            release,
            [int(c) for c in truth.counts],
        )
        _check(result, truth)
        out.append(result)
    return out


def _check(result: ChannelResult, truth: Truth) -> None:
    """Compare the largest true bins (every period for a series) with the release."""
    release = result.release
    values = dict(zip(release["bins"], release["values"], strict=True))
    errors = dict(zip(release["bins"], release["std_errors"], strict=True))
    if result.display == "series":
        shown = list(range(truth.counts.size))
    else:
        shown = [int(b) for b in np.argsort(-truth.counts, kind="stable")[:SHOWN]]
    kept = result.kept
    result.bins = shown
    mechanism = get_mechanism(truth.config.mechanism)
    params = mechanism.parse_params(truth.config.params)
    targets = mechanism.expected_estimate(
        params, np.asarray(truth.counts * kept, dtype=np.float64), result.n
    )
    for b in shown:
        expected = float(targets[b])
        spread = math.sqrt(errors[b] ** 2 + abs(truth.counts[b]) * kept * (1 - kept))
        result.checked.append(
            {
                "bin": b,
                "truth": float(truth.counts[b]),
                "expected": expected,
                "estimate": float(values[b]),
                "lo": float(values[b]) - Z95 * spread,
                "hi": float(values[b]) + Z95 * spread,
            }
        )
