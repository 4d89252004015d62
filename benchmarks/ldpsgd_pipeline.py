"""LDP-SGD on the bundled digits through the real pipeline (issue 19, item 3; ESA-revisited
§VI, Algorithms 4–5), beside the aggregate simulator at the same N, ε_ℓe and rounds.

A deployment on loopback started by the launcher (:mod:`services.cli.launcher`, as ``esa up``
and ``tests/e2e/test_ldpsgd.py`` do): the analyzer and three shufflers, SQLite, one ``ldp-sgd``
channel for multinomial logistic regression on scikit-learn's digits (d = 650; data, model and
parameters of ``benchmarks/ldpsgd.py``). N simulated devices, each holding one training image
resampled with a fixed seed (the data, not privacy noise), enrol over HTTP at every shuffler.
Each round (= epoch) t:

1. the driver fetches ``GET /v1/config``, verifies it and every shuffler's descriptor in it
   against the keys pinned in ``var/trust.json`` (as every device's SDK would for the same
   document) and reads ``(t, θ_t)`` from the
   channel's params (:func:`common.mechanisms.ldpsgd.model_from_params`);
2. worker processes, each holding a shard of devices, compute every device's gradient at θ_t,
   encode it with the ``ldp-sgd`` mechanism (Algorithm 4, OS CSPRNG), seal each fragment to the
   analyzer and the contribution to the shuffler it routes to (HPKE; the sealing code of
   :mod:`services.tools.loadgen`), and write ready requests for the round's epoch;
3. the asyncio driver of :mod:`services.tools.loadgen` posts them to the shufflers;
4. an admin closes the epoch at every shuffler (``POST /v1/admin/close``: groups evaluated,
   randomized deletion applied, batches forwarded), the driver waits until the analyzer has
   opened every part, and takes the step (``POST /v1/channels/{id}/training/step``,
   Algorithm 5): the next signed config publishes θ_{t+1}.

Afterwards: test accuracy of the final θ, the aggregate simulator's accuracy at the same N, ε_ℓe
and rounds (``benchmarks/ldpsgd.py``'s per-report ``exact`` mode, several seeds), the certified
training-long central ε of the analyzer's ledger (``GET /v1/channels/{id}/privacy``), the plan's
ε (:meth:`common.mechanisms.ldpsgd.LdpSgd.training_eps`) and the wall time.

Run (heavy: ~2 cores for minutes): ``flock /tmp/esa-bench.lock .venv/bin/python
benchmarks/ldpsgd_pipeline.py --devices 5000 --rounds 10`` (prints markdown).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ldpsgd as simulator
from _report import machine, run_main

from common.collection import TrustAnchors
from common.mechanisms import ldpsgd
from common.wire import ChannelConfig
from services.cli import launcher
from services.tools import loadgen
from services.tools.loadgen import devices

Floats = npt.NDArray[np.float64]
ADMIN = {"Authorization": "Bearer development"}
CHANNEL_ID = "digits"
#: The simulator's parameters (benchmarks/ldpsgd.py, docs/ldp-sgd.md): L, radius, η.
CLIP, RADIUS, RATE = 1.0, 50.0, 2.0
DELTA = simulator.DELTA


def channel(eps: float, tau: int, epoch_seconds: int) -> ChannelConfig:
    """The training channel: the simulator's model and step, the catalogue's deletion."""
    params = {"dim": 650, "eps": eps, "clip": CLIP, "radius": RADIUS, "learning_rate": RATE}
    return ChannelConfig(
        id=CHANNEL_ID,
        title="LDP-SGD: digits, multinomial logistic regression",
        mechanism="ldp-sgd",
        params={**params, "tau": tau},
        epoch_seconds=epoch_seconds,
        min_crowd=50,
        eps_cr=1.0,
        delta_cr=1e-6,
        max_fragments=tau,
        delta=DELTA,
        payload_size=32,
    )


def start(var: Path, config: ChannelConfig) -> list[launcher.Service]:
    """``esa up`` with this channel only: analyzer + 3 shufflers (SQLite) on free ports; the
    shufflers batch and forward fast and take a contribution until the end of the epoch after
    its own (grace = one epoch)."""
    overrides = {
        "ESA_SHUFFLER_BATCH_INTERVAL_SECONDS": "0.2",
        "ESA_SHUFFLER_FORWARD_INTERVAL_SECONDS": "0.2",
        "ESA_SHUFFLER_EPOCH_GRACE_SECONDS": str(config.epoch_seconds),
        "ESA_ANALYZER_TRAINING_DIR": str(var / "analyzer" / "training"),
        **launcher.DEVELOPMENT_TOKENS,
    }
    base = launcher.free_base_port(4)
    specs = launcher.prepare(var, 3, base, channels=[config], overrides=overrides)
    services = [launcher.start(s, var / "logs" / f"{s.name}.log") for s in specs]
    try:
        launcher.wait_ready(services, 120)
        launcher.wait_config(services[0], 120)  # every shuffler's signed descriptor fetched
    except launcher.LaunchError:
        launcher.stop(services)
        raise
    return services


# --- devices: gradients, encoding and sealing in worker processes --------------------------


@dataclass(frozen=True)
class Shard:
    """A worker's devices: client tokens (one per shuffler) and each device's example."""

    tokens: list[tuple[str, ...]]
    x: Floats
    y: npt.NDArray[np.int64]


def _worker_main(connection: Connection, config: dict[str, Any], shard: Shard) -> None:
    """A device worker: per message ``(round, θ bytes, epoch, path)`` every device of the shard
    computes its gradient at θ, encodes it (Algorithm 4, OS CSPRNG), seals it and writes one
    request for ``epoch`` to ``path``; answers ``(requests, wall s, cpu s)``. ``None`` stops."""
    sealer = devices._Sealer(config, CHANNEL_ID, loadgen.ZipfValues(2))
    shufflers = len(sealer.shufflers)
    while (message := connection.recv()) is not None:
        round_, theta_bytes, epoch, path = message
        start, cpu = time.perf_counter(), time.process_time()
        try:
            theta = np.frombuffer(theta_bytes, dtype=np.float64)
            grads = simulator.gradients(theta, shard.x, shard.y)
            written = 0
            with open(path, "wb") as out:
                for tokens, gradient in zip(shard.tokens, grads, strict=True):
                    report = ldpsgd.GradientReport(round_, gradient)
                    encoded = sealer.mechanism.encode(
                        sealer.params, report, None, sealer.rng, shufflers
                    )
                    # Fragments are sealed (to this channel, epoch and crowd) as written.
                    device = devices._Device(tokens, encoded.routes)
                    for slot, fragments in device.routes:
                        sealer._write(out, device, epoch, slot, fragments)
                        written += 1
        except Exception as error:  # reported to the parent, which raises
            connection.send(("error", f"{type(error).__name__}: {error}"))
            continue
        spent = (time.perf_counter() - start, time.process_time() - cpu)
        connection.send(("ok", (written, *spent)))


class Devices:
    """Worker processes that each hold a shard of the population (spawned: no inherited
    state; each draws its randomness from the OS CSPRNG)."""

    def __init__(self, config: dict[str, Any], shards: Sequence[Shard]) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipes: list[Connection] = []
        self._processes = []
        for shard in shards:
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(child, config, shard), daemon=True)
            process.start()
            self._pipes.append(parent)
            self._processes.append(process)

    def seal_round(
        self, round_: int, theta: Floats, epoch: int, directory: Path
    ) -> tuple[list[Path], loadgen.SealTiming]:
        """Every device's request for ``epoch`` (its report of round ``round_`` at θ)."""
        paths = [directory / f"round-{round_}-{i}.bin" for i in range(len(self._pipes))]
        start = time.perf_counter()
        data = np.ascontiguousarray(theta, dtype=np.float64).tobytes()
        for pipe, path in zip(self._pipes, paths, strict=True):
            pipe.send((round_, data, epoch, str(path)))
        results = []
        for pipe in self._pipes:
            status, result = pipe.recv()
            if status != "ok":
                raise loadgen.LoadError(f"device worker failed: {result}")
            results.append(result)
        written, cpu = sum(r[0] for r in results), sum(r[2] for r in results)
        return paths, loadgen.SealTiming(written, time.perf_counter() - start, cpu)

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.send(None)
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()


# --- the servers' side of a round ---------------------------------------------------------


def unopened_parts(analyzer_url: str) -> float:
    """The analyzer's intake backlog (``esa_analyzer_parts_unopened``)."""
    text = httpx.get(analyzer_url + "/metrics", timeout=30).text
    found = re.search(r"^esa_analyzer_parts_unopened (\S+)$", text, re.MULTILINE)
    if found is None:
        raise RuntimeError("the analyzer exports no esa_analyzer_parts_unopened")
    return float(found.group(1))


def close_epoch(target: loadgen.Target, analyzer_url: str, epoch: int) -> Counter[str]:
    """Close ``epoch`` at every shuffler now (groups evaluated, batches forwarded), then wait
    until the analyzer has opened every part; returns the shufflers' close results summed."""
    totals: Counter[str] = Counter()
    for url in target.shuffler_urls:
        answer = httpx.post(
            url + "/v1/admin/close",
            headers=ADMIN,
            json={"channel_id": CHANNEL_ID, "epoch": epoch},
            timeout=120,
        )
        if answer.status_code != 200:
            raise RuntimeError(f"{url} refused the close: {answer.status_code} {answer.text}")
        totals.update({k: int(v) for k, v in answer.json().items()})
    deadline = time.monotonic() + 300
    while unopened_parts(analyzer_url) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the analyzer did not open the parts within 300 s")
        time.sleep(0.2)
    return totals


def step(analyzer_url: str, epoch: int) -> dict[str, Any]:
    """``POST /v1/channels/{id}/training/step`` (admin token) up to ``epoch``."""
    answer = httpx.post(
        f"{analyzer_url}/v1/channels/{CHANNEL_ID}/training/step",
        headers=ADMIN,
        params={"epoch_to": epoch},
        timeout=300,
    )
    if answer.status_code != 200:
        raise RuntimeError(f"training step refused: {answer.status_code} {answer.text}")
    result: dict[str, Any] = answer.json()
    return result


def published_model(analyzer_url: str, trust: TrustAnchors) -> tuple[loadgen.Target, int, Floats]:
    """The signed config, verified against the pinned keys, and the ``(t, θ_t)`` it publishes."""
    target = loadgen.fetch_target(analyzer_url, trust, CHANNEL_ID)
    round_, theta = ldpsgd.model_from_params(target.channel.params, 650)
    return target, round_, theta


def next_epoch(after: int, epoch_seconds: int) -> int:
    """The current epoch once it is later than ``after`` (waits for the boundary)."""
    while (epoch := int(time.time() // epoch_seconds)) <= after:
        time.sleep(0.05)
    return epoch


# --- the run --------------------------------------------------------------------------------


@dataclass
class Round:
    """What one round did and took."""

    round: int
    epoch: int
    accepted: int
    refused: dict[str, int]
    seal_seconds: float
    send_seconds: float
    close_seconds: float
    step: dict[str, Any]
    accuracy: float


def one_round(
    devices: Devices,
    analyzer_url: str,
    trust: TrustAnchors,
    after: int,
    epoch_seconds: int,
    work: Path,
) -> Round:
    """Round t: read θ_t from the signed config, seal every device's report for the next
    epoch, send, close, step."""
    target, round_, theta = published_model(analyzer_url, trust)
    epoch = next_epoch(after, epoch_seconds)
    paths, sealing = devices.seal_round(round_, theta, epoch, work)
    driver = loadgen.Driver(target.shuffler_urls, concurrency=8, patience=30.0)
    sent = asyncio.run(driver.run(loadgen.FileSource(paths), None, 3600.0, until_empty=True))
    for path in paths:
        path.unlink()
    late = time.time() - ((epoch + 2) * epoch_seconds)
    if late > 0:
        Console(stderr=True).print(f"[yellow]round {round_}: sending ended {late:.1f} s late")
    started = time.perf_counter()
    close_epoch(target, analyzer_url, epoch)
    result = step(analyzer_url, epoch)
    closing = time.perf_counter() - started
    return Round(
        round=round_,
        epoch=epoch,
        accepted=driver.stats.accepted,
        refused=driver.stats.errors,
        seal_seconds=sealing.seconds,
        send_seconds=sent,
        close_seconds=closing,
        step=result["step"],
        accuracy=0.0,
    )


def enroll(target: loadgen.Target, count: int) -> list[list[str]]:
    """``count`` devices' client tokens at every shuffler (``POST /v1/enroll``)."""
    return asyncio.run(loadgen.enroll(target.shuffler_urls, count, concurrency=16))


def shards(
    tokens: list[list[str]], data: simulator.Data, count: int, workers: int, seed: int
) -> list[Shard]:
    """Device i holds train example ``idx[i]`` (resampled with a fixed seed) and its tokens."""
    idx = np.random.default_rng(seed).integers(0, len(data.y_train), count)
    per_device = list(zip(*tokens, strict=True))
    return [
        Shard(per_device[w::workers], data.x_train[idx[w::workers]], data.y_train[idx[w::workers]])
        for w in range(workers)
    ]


def train_through_pipeline(
    args: argparse.Namespace, var: Path, data: simulator.Data
) -> tuple[list[Round], Floats, dict[str, Any], float]:
    """Start the deployment, enrol, run the rounds; returns them, the final θ, the channel's
    privacy ledger and the seconds the rounds took."""
    config = channel(args.eps, args.tau, args.epoch_seconds)
    services = start(var, config)
    analyzer_url = services[0].url
    trust = TrustAnchors.load(var / launcher.TRUST_FILE)
    devices: Devices | None = None
    try:
        target, _, _ = published_model(analyzer_url, trust)
        began = time.perf_counter()
        tokens = enroll(target, args.devices)
        took = time.perf_counter() - began
        print(f"Enrolled {args.devices} devices at 3 shufflers in {took:.1f} s.")
        config = {  # what loadgen's sealing workers take (loadgen.SealerPool builds the same)
            "config": target.config.config.model_dump(mode="json"),
            "shufflers": [s.model_dump() for s in target.config.shufflers],
        }
        devices = Devices(config, shards(tokens, data, args.devices, args.workers, args.seed))
        rounds, theta, seconds = run_rounds(args, devices, analyzer_url, trust, var, data)
        ledger = httpx.get(f"{analyzer_url}/v1/channels/{CHANNEL_ID}/privacy", timeout=60).json()
        return rounds, theta, ledger, seconds
    finally:
        if devices is not None:
            devices.close()
        launcher.stop(services)


def run_rounds(
    args: argparse.Namespace,
    devices: Devices,
    analyzer_url: str,
    trust: TrustAnchors,
    var: Path,
    data: simulator.Data,
) -> tuple[list[Round], Floats, float]:
    """The rounds, with a progress bar; returns them, θ after the last step, and seconds."""
    rounds: list[Round] = []
    work = var / "requests"
    work.mkdir(exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    began, epoch = time.perf_counter(), -1
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True)) as progress:
        task = progress.add_task("LDP-SGD rounds", total=args.rounds)
        for _ in range(args.rounds):
            record = one_round(devices, analyzer_url, trust, epoch, args.epoch_seconds, work)
            _, _, theta = published_model(analyzer_url, trust)
            record.accuracy = simulator.accuracy(theta, data)
            rounds.append(record)
            epoch = record.epoch
            progress.update(
                task,
                advance=1,
                description=f"LDP-SGD rounds (accuracy {record.accuracy:.3f})",
            )
    return rounds, theta, time.perf_counter() - began


def simulate(
    data: simulator.Data, params: ldpsgd.LdpSgdParams, population: int, runs: int
) -> Floats:
    """Accuracy curves of the aggregate simulator (per-report ``exact``), one row per seed."""
    return np.array(
        [
            simulator.train(data, params, population, "exact", np.random.default_rng(100 + s))
            for s in range(runs)
        ]
    )


def report(
    args: argparse.Namespace,
    rounds: list[Round],
    ledger: dict[str, Any],
    seconds: float,
    data: simulator.Data,
) -> None:
    """Print the run as markdown."""
    params = ldpsgd.LdpSgdParams(
        dim=650, eps=args.eps, clip=CLIP, radius=RADIUS, learning_rate=RATE, tau=args.tau,
        rounds=args.rounds,
    )  # fmt: skip
    curves = simulate(data, params, args.devices, args.sim_runs)
    base = simulator.baseline(data, args.rounds, RATE)
    print(f"\nMachine: {machine(pinned=False)}.\n")
    print("| round | epoch | contributions accepted | reports used | contributions at the "
          "analyzer | seal s | send s | close+step s | round's central ε | pipeline accuracy "
          f"| simulator accuracy (mean ± sd, {args.sim_runs} seeds) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r, mean, sd in zip(rounds, curves.mean(axis=0), curves.std(axis=0), strict=True):
        s = r.step
        eps = "none" if s["eps_central"] is None else f"{s['eps_central']:.3f}"
        print(f"| {r.round} | {r.epoch} | {r.accepted} | {s['reports']} | {s['devices']} | "
              f"{r.seal_seconds:.1f} | {r.send_seconds:.1f} | {r.close_seconds:.1f} | {eps} | "
              f"{r.accuracy:.3f} | {mean:.3f} ± {sd:.3f} |")  # fmt: skip
    refused = Counter[str]()
    for r in rounds:
        refused.update(r.refused)
    lifetime = ledger.get("lifetime") or {}
    crowd = min(int(r.step["devices"]) // 3 for r in rounds)
    print(f"\nN = {args.devices}, ε_ℓe = {args.eps}, τ = {args.tau}, {args.rounds} rounds; "
          f"non-private baseline {base[-1]:.3f}. Refused or failed requests: "
          f"{dict(refused) or 'none'}.")  # fmt: skip
    print(f"Final test accuracy: pipeline {rounds[-1].accuracy:.3f}, simulator "
          f"{curves[:, -1].mean():.3f} ± {curves[:, -1].std():.3f}.")  # fmt: skip
    print(f"Certified training-long central ε (ledger, GET /v1/channels/{CHANNEL_ID}/privacy): "
          f"{lifetime.get('eps')} at δ = {lifetime.get('delta')} ({lifetime.get('method')}, "
          f"{lifetime.get('epochs')} epochs).")  # fmt: skip
    at_n, at_crowd = (ldpsgd.LdpSgd().training_eps(params, n, DELTA) for n in (args.devices, crowd))
    print(f"Plan (LdpSgd.training_eps, δ = {DELTA:g}): {at_n:.3f} at crowd N; {at_crowd:.3f} "
          f"at crowd ≈ N/3 = {crowd} (a shuffler's batch).")  # fmt: skip
    print(f"Wall time of the rounds: {seconds:.1f} s ({seconds / len(rounds):.1f} s per round).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=5000, help="N simulated devices")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (= epochs)")
    parser.add_argument("--eps", type=float, default=2.0, help="ε_ℓe per report")
    parser.add_argument("--tau", type=int, default=1, help="reports per device per round")
    parser.add_argument("--epoch-seconds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2, help="device worker processes")
    parser.add_argument("--sim-runs", type=int, default=5, help="simulator seeds")
    parser.add_argument("--seed", type=int, default=0, help="the population's resampling")
    parser.add_argument("--var", type=Path, default=None, help="deployment folder (kept)")
    args = parser.parse_args()
    if args.rounds < 1 or args.devices < 300 or args.workers < 1:
        parser.error("need --rounds >= 1, --workers >= 1 and --devices >= 300 (each shuffler's "
                     "group must keep min_crowd = 50 after randomized deletion)")  # fmt: skip
    data = simulator.load()
    var = args.var or Path(tempfile.mkdtemp(prefix="esa-ldpsgd-"))
    began = time.perf_counter()
    try:
        rounds, _, ledger, seconds = train_through_pipeline(args, var, data)
    finally:
        if args.var is None:
            shutil.rmtree(var, ignore_errors=True)
    report(args, rounds, ledger, seconds, data)
    total = time.perf_counter() - began
    print(f"Total wall time (deployment start to stop, simulator included): {total:.1f} s.")


if __name__ == "__main__":
    run_main(main)
