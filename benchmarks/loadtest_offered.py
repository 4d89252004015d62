"""Issue 14's target "the run phase offers ≥ 1.2× what three local shufflers accept, so the
deployment is the bottleneck", measured fairly on a 2-core machine by CPU pinning.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/loadtest_offered.py`` (``--help``).
Prints the measurement as JSON and a Markdown table (docs/benchmarks.md, "Load test", by hand).

The deployment (``esa up`` settings: 1 analyzer + 3 shufflers, SQLite, homepage channel, as
benchmarks/loadtest.py ``--capacity`` starts it) runs pinned to core 0 — every thread of every
process of it — and this process, which runs ``esa loadtest``'s run phase (benchmarks/
loadtest.py ``run_phase``: services/tools/loadtest/live.py ``replay`` driving services/tools/
loadgen's ``Driver`` over a prepared epoch file), is pinned to core 1. Homepage-sized fresh
contributions (31 fragments of 72 bytes, ~2.4 KB; distinct client tokens, new nonces).

1. Capacity A: the run phase as fast as answered (``--rounds`` times ``--contributions``);
   A = the highest accepted/s of the rounds (the pace below errs high).
2. Overload: the run phase paced open-loop at ``--over`` × A for ``--seconds``. The Driver's
   feeder puts each due request on its shuffler's queue (``2 × connections-per-shuffler``
   deep); when the deployment is behind, the queues are full, ``put`` waits, the feeder falls
   behind the schedule, and whatever is more than one second behind is skipped and counted in
   ``Driver.behind`` (never sent). So the schedule (``rate × seconds`` requests) splits into
   *sent* (``Driver.sent``: handed to a connection's queue, every one answered before the run
   returns), *skipped* (``Driver.behind``) and an *end lag* (at most one second's worth still
   due when the window closed, neither sent nor counted by the Driver). Offered = the
   schedule; the target is offered / accepted (202) ≥ 1.2 with the deployment's core busy
   (~100%) and the driver's core not.
3. Control: the same Driver, same process on core 1, as fast as answered against benchmarks/
   trivial_app.py (answers 202, keeps nothing) pinned to core 0: the driver's own ceiling and
   its CPU per request, to show it is not what limits in 2.

Per-second samples (a thread here) of /proc/stat for each core (busy = user + nice + system +
irq + softirq + steal; iowait separately), of the deployment's processes' CPU (utime + stime of
every process in each service's tree), of this process's CPU, and of the time its main thread
(the asyncio driver) was runnable but waiting for its core (/proc schedstat run delay: near 0
means other load on core 1 did not hold it back); reported as the mean over the run's interior
seconds (first and last sample dropped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trivial_app
from _report import machine, run_main
from loadtest import Cycle, bodies, driver_run, run_phase

from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS

DEPLOYMENT_CORE, DRIVER_CORE = 0, 1
PID = os.getpid()


# --- pinning and CPU accounting (Linux /proc) ---------------------------------------------


tree = loadgen.process_tree


def pin(pids: Iterable[int], core: int) -> int:
    """Pin every thread of ``pids`` to ``core`` (affinity is per thread on Linux); returns how
    many threads were pinned."""
    pinned = 0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(task), {core})
                pinned += 1
            except (ProcessLookupError, PermissionError):
                continue
    return pinned


def process_cpu(pids: Iterable[int]) -> float:
    """CPU seconds (utime + stime) used so far by ``pids`` (every thread)."""
    used = (loadgen.cpu_seconds(pid) for pid in pids)
    return sum(seconds for seconds in used if not math.isnan(seconds))  # NaN: it is gone


def core_ticks() -> dict[int, tuple[int, int, int]]:
    """Per core since boot: (busy, iowait, all) ticks of /proc/stat."""
    found = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, values[:8])
            busy = user + nice + system + irq + softirq + steal
            found[int(name[3:])] = (busy, iowait, busy + idle + iowait)
    return found


class Meter:
    """Samples, every ``interval`` seconds in a thread, both cores' busy and iowait shares, the
    CPU of each named process group (as a share of one core) and of this process."""

    def __init__(self, groups: dict[str, list[int]], interval: float = 1.0) -> None:
        self.groups = groups
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _read(self) -> tuple[float, dict[int, tuple[int, int, int]], dict[str, float]]:
        cpu = {name: process_cpu(pids) for name, pids in self.groups.items()}
        times = os.times()
        cpu["driver"] = times.user + times.system
        # The driver's (main) thread: nanoseconds runnable but waiting for its core.
        cpu["driver_wait"] = (
            int(Path(f"/proc/{PID}/task/{PID}/schedstat").read_text().split()[1]) / 1e9
        )
        return time.monotonic(), core_ticks(), cpu

    def _loop(self) -> None:
        last = self._read()
        while not self._stop.wait(self.interval):
            now = self._read()
            span = now[0] - last[0]
            sample = {"t": round(span, 3)}
            for core, (busy, iowait, total) in now[1].items():
                before = last[1][core]
                share = 100 / max(1, total - before[2])
                sample[f"core{core}_busy"] = (busy - before[0]) * share
                sample[f"core{core}_iowait"] = (iowait - before[1]) * share
            for name, seconds in now[2].items():
                sample[f"{name}_cpu"] = 100 * (seconds - last[2][name]) / span
            self.samples.append(sample)
            last = now

    def __enter__(self) -> Meter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        """Mean of each measure (%) over the interior samples (first and last dropped)."""
        inner = self.samples[1:-1] or self.samples
        keys = [k for k in (inner[0] if inner else {}) if k != "t"]
        return {k: round(sum(s[k] for s in inner) / len(inner), 1) for k in keys}


# --- the deployment and the three measurements --------------------------------------------


@contextmanager
def pinned_deployment(var: Path) -> Iterator[list[launcher.Service]]:
    """``esa up`` (homepage channel) with every thread of every service on DEPLOYMENT_CORE
    (started from there, so their children inherit it, then pinned again thread by thread),
    and this process's threads on DRIVER_CORE."""
    os.sched_setaffinity(0, {DEPLOYMENT_CORE})
    services = launcher.up(
        var, base_port=launcher.free_base_port(4), channels=[DEFAULT_CHANNELS[0]]
    )
    try:
        for service in services:
            pin(tree(service.process.pid), DEPLOYMENT_CORE)
        pin([os.getpid()], DRIVER_CORE)
        yield services
    finally:
        launcher.stop(services)
        pin([os.getpid()], DRIVER_CORE)


def groups(services: list[launcher.Service]) -> dict[str, list[int]]:
    """The deployment's process trees: the three shufflers together, and the analyzer."""
    shufflers = [pid for s in services[1:] for pid in tree(s.process.pid)]
    return {"shufflers": shufflers, "analyzer": tree(services[0].process.pid)}


def metered_run(
    tmp: Path, urls: list[str], requests: list[loadgen.Request], rate: float | None,
    seconds: float, connections: int, watched: dict[str, list[int]],
) -> dict[str, Any]:  # fmt: skip
    """benchmarks/loadtest.py ``run_phase`` (``esa loadtest``'s run phase) under a Meter."""
    with Meter(watched) as meter:
        found = run_phase(tmp, urls, requests, rate, seconds, connections)
    return {**found, "cpu": meter.summary(), "per_s": meter.samples}


def overload(
    tmp: Path, var: Path, urls: list[str], rate: float, args: argparse.Namespace,
    watched: dict[str, list[int]],
) -> dict[str, Any]:  # fmt: skip
    """The run phase paced at ``rate`` for ``args.seconds``: offered (the schedule: sent +
    skipped behind schedule + end lag) against accepted."""
    count = math.ceil(rate * args.seconds) + 200  # the source must not run dry
    requests = bodies(var, urls, count, 31, 72)
    found = metered_run(tmp, urls, requests, rate, args.seconds, args.connections, watched)
    scheduled = round(rate * args.seconds)
    sent, skipped, accepted = found["offered"], found["behind"], found["accepted"]
    found |= {
        "counted_over_accepted": round((sent + skipped) / max(1, accepted), 3),
        "rate": round(rate),
        "scheduled": scheduled,
        "sent": sent,
        "skipped_behind": skipped,
        "end_lag": max(0, scheduled - sent - skipped),
        "offered_per_s": round(scheduled / args.seconds),
        "offered_over_accepted": round(scheduled / max(1, accepted), 3),
    }
    return found


def control(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The Driver as fast as answered against the trivial app on DEPLOYMENT_CORE."""
    port = launcher.free_base_port(1)
    os.sched_setaffinity(0, {DEPLOYMENT_CORE})
    with trivial_app.running(port) as app:
        pin([os.getpid()], DRIVER_CORE)
        pin(tree(app.pid), DEPLOYMENT_CORE)
        url = f"http://127.0.0.1:{port}"
        fake = [
            loadgen.Request(shuffler=0, token="x" * 43, body=os.urandom(2390)) for _ in range(200)
        ]
        with Meter({"trivial_app": tree(app.pid)}) as meter:
            found = driver_run([url], Cycle(fake), args.seconds, args.connections)
    return {**found, "cpu": meter.summary()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Capacity rounds, the paced overload run, then the control."""
    results: dict[str, Any] = {"machine": machine(pinned=False), "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as directory:
        tmp, var = Path(directory), Path(directory) / "var"
        with pinned_deployment(var) as services:
            urls, watched = [s.url for s in services[1:]], groups(services)
            rounds = []
            for _ in range(args.rounds):
                requests = bodies(var, urls, args.contributions, 31, 72)
                rounds.append(metered_run(tmp, urls, requests, None, 600, args.connections,
                                          watched))  # fmt: skip
                print(json.dumps(_brief(rounds[-1])), flush=True)
            results["capacity"] = rounds
            results["A"] = max(r["accepted_per_s"] for r in rounds)
            results["overload"] = overload(tmp, var, urls, args.over * results["A"], args,
                                           watched)  # fmt: skip
            print(json.dumps(_brief(results["overload"])), flush=True)
        results["control"] = control(tmp, args)
        print(json.dumps(results["control"]), flush=True)
    results["load_after"] = os.getloadavg()
    return results


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in ("per_s", "per_shuffler")}


def table(results: dict[str, Any]) -> str:
    """The Markdown rows of the three measurements."""
    head = ("| run | offered/s | accepted/s | offered/accepted | shufflers' CPU (core 0) "
            "| core 0 busy | driver CPU (core 1) | driver waiting for core 1 | core 1 busy "
            "| p50 / p99 ms |")  # fmt: skip
    rows = [head, "|" + "---|" * 10]

    def row(name: str, run: dict[str, Any], offered: float, ratio: str, server: str) -> None:
        cpu = run["cpu"]
        latency = f"{run.get('p50_ms', '–')} / {run.get('p99_ms', '–')}"
        rows.append(
            f"| {name} | {offered:,.0f} | {run['accepted_per_s']:,.0f} | {ratio} "
            f"| {cpu.get(server + '_cpu', 0):.0f}% | {cpu['core0_busy']:.0f}% "
            f"| {cpu['driver_cpu']:.0f}% | {cpu['driver_wait_cpu']:.0f}% "
            f"| {cpu['core1_busy']:.0f}% | {latency} |"
        )

    for i, run in enumerate(results["capacity"], 1):
        row(f"(1) capacity, round {i}", run, run["offered_per_s"], "1.00", "shufflers")
    over = results["overload"]
    row(f"(2) paced at {over['rate']:,}/s", over, over["offered_per_s"],
        f"**{over['counted_over_accepted']:.2f}** ({over['offered_over_accepted']:.2f})",
        "shufflers")  # fmt: skip
    ctl = results["control"]
    row("(3) control: trivial app", ctl, ctl["offered_per_s"], "1.00", "trivial_app")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="capacity rounds")
    parser.add_argument("--contributions", type=int, default=15_000, help="per capacity round")
    parser.add_argument("--over", type=float, default=1.5, help="paced rate / capacity A")
    parser.add_argument("--seconds", type=float, default=20, help="paced run and control")
    parser.add_argument("--connections", type=int, default=96, help="Driver connections")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores to pin the deployment and the driver apart")
    results = measure(args)
    print(json.dumps({k: v for k, v in results.items()}, default=str))
    print(table(results))


if __name__ == "__main__":
    run_main(main)
