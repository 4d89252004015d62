"""Load-test tooling speed (issue 14): generation per core, our asyncio driver against Locust,
and the run phase against three local shufflers.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/loadtest.py`` (``--help``). Prints
the "Load test" section of docs/benchmarks.md as Markdown (append it by hand).

1. Generation: ``esa loadtest``'s prepare phase (services/tools/loadtest/prepare.py) with ONE
   worker process for a k-RAPPOR channel (homepage, ~31 fragments) and a k-RR channel (one
   fragment): reports encoded + sealed per second and contributions (outer envelope) sealed per
   second on one core.
2. Generator ceiling: the same prepared requests (homepage-sized bodies) replayed for
   ``--seconds`` against benchmarks/trivial_app.py (answers 202 without work) by the asyncio
   driver (services/tools/loadgen/) and by a minimal Locust ``FastHttpUser`` (one process
   each, the same number of connections/users): requests/s and client CPU µs per request.
3. Run phase against 1 analyzer + 3 shufflers (``esa up`` settings, SQLite): fresh outer-sealed
   contributions (distinct client tokens issued with each shuffler's secret, a new nonce each),
   as fast as answered, by each generator: offered and accepted per second; and one shuffler
   alone with benchmarks/shuffler.py's body (6 fragments of 72 bytes) for its ingest figure.

``--capacity`` (the issue's targets, in one run against the same 3 local shufflers, homepage-
sized bodies: 31 fragments of 72 bytes, ~2.4 KB): alternating rounds of (a) benchmarks/
shuffler.py's ingest measurement (its raw client: ``CONCURRENCY`` keep-alive connections,
requests back to back, here spread over the 3 shufflers) and (b) ``esa loadtest``'s run phase
(services/tools/loadtest/live.py ``replay``: the Driver with ``--connections``, as fast as
answered, from a prepared epoch file), fresh contributions each round; the ratio (b)/(a) of the
medians. Then (c) the run phase at a fixed rate of ``--over`` × the measured capacity: offered
(scheduled: sent + skipped behind schedule) against accepted per second.

``--soak-minutes M --soak-rate R``: ``esa up`` with the homepage channel at
``--soak-epoch-seconds`` epochs, then ``esa loadtest`` itself at ``--rate R`` for M minutes
with verification (close, drain, conservation, estimates epoch by epoch); prints its summary
(``--out``: where ``esa loadtest`` writes loadtest.json and loadtest.html).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import functools
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trivial_app
from _report import machine, run_main

from common.collection import TrustAnchors
from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS, DELETION
from services.tools.loadtest.prepare import LoadPlan, prepare
from shuffler.intake import TokenAuthority

HERE = Path(__file__).resolve().parent
LOCUSTFILE = """
import os, pickle, itertools
from locust import constant, task
from locust.contrib.fasthttp import FastHttpUser
from locust.exception import StopUser

with open(os.environ["ESA_LOCUST_REQUESTS"], "rb") as handle:
    REQUESTS = pickle.load(handle)
NEXT = itertools.cycle(REQUESTS) if os.environ.get("ESA_LOCUST_CYCLE") else iter(REQUESTS)


class Device(FastHttpUser):
    wait_time = constant(0)
    host = "http://127.0.0.1"

    @task
    def contribute(self):
        try:
            url, token, body = next(NEXT)
        except StopIteration:
            raise StopUser()
        headers = {"Authorization": "Bearer " + token, "Content-Type": "application/octet-stream"}
        self.client.post(url + "/v1/contributions", data=body, headers=headers, name="ingest")
"""


class Cycle:
    """A source that replays the same requests forever (for a server that keeps nothing)."""

    def __init__(self, requests: list[loadgen.Request]) -> None:
        self._it: Iterator[loadgen.Request] = iter(())
        self.requests = requests

    def next(self, now: float) -> loadgen.Request | None:
        for request in self._it:
            return request
        self._it = iter(self.requests)
        return next(self._it)


class Once:
    """A source that sends each request once."""

    def __init__(self, requests: list[loadgen.Request]) -> None:
        self._it = iter(requests)

    def next(self, now: float) -> loadgen.Request | None:
        return next(self._it, None)


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def generation(var: Path, url: str, trust: TrustAnchors, devices: int) -> dict[str, Any]:
    """Prepare phase with one worker: reports and contributions sealed per second."""
    found = {}
    for channel in ("homepage", "pages"):
        plan = LoadPlan(
            analyzer_url=url,
            trust=trust,
            devices=devices,
            duration=10,
            workdir=var / f"gen-{channel}",
            channels=(channel,),
            workers=1,
        )
        prepared = prepare(plan)
        prepared.close()
        found[channel] = {k: round(v) for k, v in prepared.timings.items()}
    return found


def bodies(
    var: Path, urls: list[str], count: int, fragments: int, size: int
) -> list[loadgen.Request]:
    """``count`` fresh contributions for the homepage channel's current epoch, spread over the
    shufflers: distinct client tokens (issued with each shuffler's own secret), new nonces,
    ``fragments`` inner fragments of ``size`` bytes (the shuffler never opens them)."""
    import httpx

    keys, authorities = [], []
    for i, url in enumerate(urls):
        answer = httpx.get(url + "/v1/config", timeout=30).json()
        keys.append((answer["id"], load_x25519_public(base64.b64decode(answer["public_key"]))))
        secret = (var / "keys" / f"shuffler-{i + 1}" / launcher.TOKEN_SECRET_FILE).read_text()
        authorities.append(TokenAuthority(secret.strip().encode()))
    epoch = int(time.time() // 3600)
    out = []
    for n in range(count):
        index = n % len(urls)
        sid, public = keys[index]
        inner = tuple(os.urandom(size) for _ in range(fragments))
        body = seal_contribution(
            Contribution(
                channel_id="homepage", crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=inner
            ),
            sid,
            public,
        )
        out.append(loadgen.Request(shuffler=index, token=authorities[index].issue(), body=body))
    return out


def driver_run(
    urls: list[str], source: loadgen.Source, seconds: float, connections: int
) -> dict[str, Any]:
    """Our asyncio driver as fast as answered: rate, accepted, CPU µs per request."""
    driver = loadgen.Driver(urls, max(1, connections // len(urls)))
    cpu = _cpu()
    spent = asyncio.run(driver.run(source, None, seconds, until_empty=True))
    used = _cpu() - cpu
    return {
        "offered_per_s": round(driver.sent / spent),
        "accepted_per_s": round(driver.stats.accepted / spent),
        "accepted": driver.stats.accepted,
        "errors": driver.stats.errors,
        "client_cpu_us": round(used / max(1, driver.sent) * 1e6),
    }


def locust_run(
    tmp: Path,
    urls: list[str],
    requests: list[loadgen.Request],
    seconds: float,
    users: int,
    cycle: bool,
) -> dict[str, Any]:
    """A minimal Locust FastHttpUser replaying the same requests (one process, headless)."""
    data = tmp / "locust-requests.pkl"
    data.write_bytes(pickle.dumps([(urls[r.shuffler], r.token, r.body) for r in requests]))
    locustfile = tmp / "locustfile.py"
    locustfile.write_text(LOCUSTFILE)
    env = {**os.environ, "ESA_LOCUST_REQUESTS": str(data), "ESA_LOCUST_CYCLE": "1" if cycle else ""}
    start_children = os.times().children_user + os.times().children_system
    subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(locustfile),
            "--headless",
            "-u",
            str(users),
            "-r",
            str(users),
            "--run-time",
            f"{int(seconds)}s",
            "--csv",
            str(tmp / "locust"),
            "--only-summary",
            "--loglevel",
            "ERROR",
            "--stop-timeout",
            "5",
        ],
        env=env,
        check=False,
        capture_output=True,
        timeout=seconds + 120,
    )
    used = os.times().children_user + os.times().children_system - start_children
    with (tmp / "locust_stats.csv").open() as handle:
        row = next(r for r in csv.DictReader(handle) if r["Name"] == "Aggregated")
    count, failures = int(row["Request Count"]), int(row["Failure Count"])
    rate = float(row["Requests/s"])
    return {
        "offered_per_s": round(rate),
        "accepted_per_s": round(rate * (count - failures) / max(1, count)),
        "accepted": count - failures,
        "failures": failures,
        "client_cpu_us": round(used / max(1, count) * 1e6),
    }


def ceiling(
    tmp: Path, requests: list[loadgen.Request], seconds: float, connections: int
) -> dict[str, Any]:
    """Both generators against the trivial app (it keeps nothing: the same bodies again)."""
    port = launcher.free_base_port(1)
    url = f"http://127.0.0.1:{port}"
    with trivial_app.running(port):
        same = [loadgen.Request(shuffler=0, token=r.token, body=r.body) for r in requests]
        ours = driver_run([url], Cycle(same), seconds, connections)
        theirs = locust_run(tmp, [url], same, seconds, connections, cycle=True)
    return {"driver": ours, "locust": theirs}


def _shuffler_bench() -> Any:
    """benchmarks/shuffler.py as a module (its name clashes with the ``shuffler`` package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_shuffler", HERE / "shuffler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def raw_ingest(urls: list[str], requests: list[loadgen.Request]) -> float:
    """benchmarks/shuffler.py's ingest measurement spread over the shufflers: its client's
    CONCURRENCY connections (round robin over the shufflers), requests back to back."""
    bench = _shuffler_bench()
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    per = [[bench._post(r.token, r.body) for r in requests if r.shuffler == i]
           for i in range(len(urls))]  # fmt: skip
    connections = [[c for c in range(bench.CONCURRENCY) if c % len(ports) == i]
                   for i in range(len(ports))]  # fmt: skip

    async def run() -> float:
        latencies: list[float] = []
        jobs = [
            bench._connection("127.0.0.1", ports[i], per[i][j :: len(mine)], latencies)
            for i, mine in enumerate(connections)
            for j in range(len(mine))
        ]
        start = time.perf_counter()
        await asyncio.gather(*jobs)
        return len(latencies) / (time.perf_counter() - start)

    return asyncio.run(run())


def run_phase(
    tmp: Path, urls: list[str], requests: list[loadgen.Request], rate: float | None,
    seconds: float, connections: int,
) -> dict[str, Any]:  # fmt: skip
    """``esa loadtest``'s run phase (live.replay, no live view) over a prepared epoch file."""
    from rich.console import Console

    from services.tools.loadtest import live

    path = tmp / f"epoch-{time.monotonic_ns()}.bin"
    with path.open("wb") as out:
        for r in requests:
            token = r.token.encode()
            out.write(loadgen.RECORD.pack(r.shuffler, len(token), len(r.body)) + token + r.body)
    epoch = int(time.time() // 3600)
    driver = loadgen.Driver(urls, max(1, connections // len(urls)))
    monitor = live.Monitor(driver=driver, shuffler_urls=urls)
    source = loadgen.EpochSource({epoch: [path]}, 3600)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    spent = asyncio.run(live.replay(monitor, source, rate, seconds, quiet, live=False))
    path.unlink()
    run = live.summary(monitor, spent)
    scheduled = driver.sent + driver.behind
    return run | {"scheduled_per_s": round(scheduled / spent, 1), "behind": driver.behind}


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """The issue's two run-phase targets against the same 3 shufflers in one run."""
    import statistics

    results: dict[str, Any] = {"machine": machine(pinned=False), "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        var = tmp / "var"
        services = launcher.up(var, base_port=launcher.free_base_port(4),
                               channels=[DEFAULT_CHANNELS[0]])  # fmt: skip
        try:
            urls = [s.url for s in services[1:]]
            fresh = functools.partial(bodies, var, urls, fragments=31, size=72)
            results["body_bytes"] = len(fresh(1)[0].body)
            raw, ours = [], []
            for _ in range(args.rounds):
                raw.append(raw_ingest(urls, fresh(args.contributions)))
                found = run_phase(tmp, urls, fresh(args.contributions), None, 600, args.connections)
                ours.append(found["accepted_per_s"])
                print({"shuffler.py": round(raw[-1]), "esa loadtest": found}, flush=True)
            results["shuffler_py_per_s"], results["loadtest_per_s"] = raw, ours
            cap = statistics.median(ours)
            results["ratio"] = cap / statistics.median(raw)
            rate = args.over * cap
            count = int(rate * args.seconds * 1.1)
            results["over"] = run_phase(tmp, urls, fresh(count), rate, args.seconds,
                                        args.connections)  # fmt: skip
            results["over"]["rate"] = round(rate)
        finally:
            launcher.stop(services)
    results["load_after"] = os.getloadavg()[0]
    return results


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """``esa loadtest`` itself for ``--soak-minutes`` at ``--soak-rate`` against ``esa up``."""
    import json

    channel = DEFAULT_CHANNELS[0].model_copy(update={"epoch_seconds": args.soak_epoch_seconds})
    results: dict[str, Any] = {"machine": machine(pinned=False), "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as directory:
        var = Path(directory) / "var"
        services = launcher.up(var, base_port=launcher.free_base_port(4), channels=[channel])
        try:
            devices = int(args.soak_rate * args.soak_epoch_seconds)
            command = [
                sys.executable, "-m", "services.cli", "loadtest",
                "--analyzer-url", services[0].url, "--var", str(var),
                "--keys", str(var / "keys"), "--channel", "homepage",
                "--devices", str(devices), "--rate", str(args.soak_rate),
                "--duration", str(60 * args.soak_minutes), "--workers", "2",
                "--drain-timeout", "3600", "--no-live", "--out", str(args.out),
            ]  # fmt: skip
            print(" ".join(command), flush=True)
            started = time.time()
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            results["wall_seconds"] = round(time.time() - started)
            results["exit"] = done.returncode
            results["stdout"] = done.stdout
            print(done.stdout, done.stderr[-4000:], flush=True)
            summary = json.loads((args.out / "loadtest.json").read_text())
            loads = [s.get("load_1min") for s in summary.get("samples", [])]
            results["load_during"] = [min(loads), max(loads)] if loads else None
            results["run"] = {k: v for k, v in summary["run"].items() if k != "per_shuffler"}
            results["verification"] = summary.get("verification", {}).get("conservation")
            results["estimates"] = {
                cid: {k: row.get(k) for k in ("inside", "n", "central_eps", "delta", "method")}
                | {"checked": len(row["checked"]), "epochs": len(row.get("per_epoch", {}))}
                for cid, row in summary.get("verification", {}).get("channels", {}).items()
            }
            results["problems"] = summary.get("verification", {}).get("problems")
        finally:
            launcher.stop(services)
    results["load_after"] = os.getloadavg()[0]
    return results


def main() -> None:
    import importlib.util

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15, help="length of each timed run")
    parser.add_argument("--connections", type=int, default=96, help="connections / Locust users")
    parser.add_argument("--contributions", type=int, default=20_000, help="fresh bodies per run")
    parser.add_argument("--devices", type=int, default=400, help="devices of the generation step")
    parser.add_argument("--capacity", action="store_true", help="only the run-phase targets")
    parser.add_argument("--rounds", type=int, default=3, help="alternating --capacity rounds")
    parser.add_argument("--over", type=float, default=1.5, help="--capacity: rate / capacity")
    parser.add_argument("--soak-minutes", type=float, default=0, help="esa loadtest soak")
    parser.add_argument("--soak-rate", type=float, default=800, help="soak: contributions/s")
    parser.add_argument("--soak-epoch-seconds", type=int, default=30, help="soak: epoch length")
    parser.add_argument("--out", type=Path, default=Path("/tmp/esa-loadtest-soak"))
    args = parser.parse_args()
    if args.capacity or args.soak_minutes:
        print(capacity(args) if args.capacity else soak(args), flush=True)
        return
    if importlib.util.find_spec("locust") is None:
        raise SystemExit("the comparison needs Locust: .venv/bin/pip install 'locust>=2.20'")
    load = os.getloadavg()[0]
    pages = DEFAULT_CHANNELS[0].model_copy(
        update={
            "id": "pages",
            "mechanism": "krr",
            "params": {"k": 16, "eps": 2.0},
            "max_fragments": 4,
            "min_crowd": 20,
            **DELETION,
        }
    )
    results: dict[str, Any] = {"machine": machine(pinned=False), "load_before": load}
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        var = tmp / "var"
        specs = launcher.prepare(
            var, 3, launcher.free_base_port(4), channels=[DEFAULT_CHANNELS[0], pages]
        )
        services = launcher.start_all(specs, var / "logs")
        try:
            launcher.wait_config(services[0], 60)  # every shuffler's signed descriptor fetched
            url, trust = services[0].url, TrustAnchors.load(var / launcher.TRUST_FILE)
            urls = [s.url for s in services[1:]]
            results["generation"] = generation(var, url, trust, args.devices)
            print(results["generation"], flush=True)
            homepage_body = bodies(var, urls, 200, 31, 72)
            results["body_bytes"] = len(homepage_body[0].body)
            results["ceiling"] = ceiling(tmp, homepage_body, args.seconds, args.connections)
            print(results["ceiling"], flush=True)
            fresh = bodies(var, urls, args.contributions, 31, 72)
            results["deployment_driver"] = driver_run(
                urls, Once(fresh), args.seconds * 4, args.connections
            )
            print(results["deployment_driver"], flush=True)
            fresh = bodies(var, urls, args.contributions, 31, 72)
            results["deployment_locust"] = locust_run(
                tmp, urls, fresh, args.seconds * 4, args.connections, cycle=False
            )
            print(results["deployment_locust"], flush=True)
        finally:
            launcher.stop(services)
    results["load_after"] = os.getloadavg()[0]
    print(results)


if __name__ == "__main__":
    run_main(main)
