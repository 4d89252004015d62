"""Ingest CPU per contribution, this tree against an earlier commit, in one run.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/ingest_cpu.py [--before REF]
[--also REF] [--postgres USER@HOST:PORT] [--profile DIR] [--perf DIR]``. The earlier commit's
tree (and each ``--also`` commit's) is exported with ``git archive`` and the shufflers run side
by side as real ``esa shuffler serve`` processes (same interpreter and packages, each importing
its own tree), on SQLite (WAL, synchronous=FULL) or on fresh PostgreSQL databases. Rounds
alternate between them: each round sends the same number of pre-sealed ``homepage``
contributions (8 fragments, the e2e epoch's mean being 8.4) over 64 keep-alive connections, and
the server process's CPU (``/proc/<pid>/stat``, all its threads) is divided by the
contributions it acknowledged. Prints the median CPU-µs per contribution of each and their
ratio, and what this tree's contribution is made of, measured in the same run
(:func:`measured_apart`: requests refused before any work and after opening, HPKE opening and
the SQLite store alone); with ``--profile`` py-spy records this tree's shuffler during one
extra round and the hottest functions are printed; with ``--perf DIR`` perf records one more
round and its CPU is split by what does the work, native code and system calls included
(docs/benchmarks.md, "Ingest CPU per contribution, before and after").
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib.util
import io
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from rich.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _perf import PerfRecord, shares
from _profile import Profile, top_frames
from _store import COMMIT_ROWS, migrated_sqlite
from epoch_e2e import _postgres

from common.envelope import (
    Contribution,
    KeyRing,
    inner_size,
    load_x25519_public,
    new_nonce,
    open_contribution,
    seal_contribution,
)
from services.cli import launcher
from services.tools import loadgen
from shuffler.intake import TokenAuthority
from shuffler.records import Pending
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/shuffler.py's raw HTTP/1.1 load and CPU reader (its name is the package's)
_spec = importlib.util.spec_from_file_location("shuffler_bench", ROOT / "benchmarks/shuffler.py")
assert _spec is not None and _spec.loader is not None
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
_cpu_seconds, _load, _post = _bench._cpu_seconds, _bench._load, _bench._post
#: The code as it was when the 10^6-device epoch issue was filed (before its first commit).
BEFORE = "cc2bbdb"
#: The shuffler's policy of the catalogue's ``homepage`` channel, with a one-day epoch.
SHUFFLER_FIELDS = ("id", "min_crowd", "eps_cr", "delta_cr", "max_fragments", "payload_size")
CHANNEL = {
    **{
        field: value
        for c in json.loads((ROOT / "deploy/channels.json").read_text())
        if c["id"] == "homepage"
        for field, value in c.items()
        if field in SHUFFLER_FIELDS
    },
    "epoch_seconds": 86_400,
}
#: Fragments per contribution (the e2e epoch's mean is 8.4), each sealed to the analyzer.
FRAGMENTS = 8


def export(ref: str, into: Path) -> Path:
    """``ref``'s tree, written under ``into`` by ``git archive``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def esa_serve(port: int) -> list[str]:
    """The shuffler as shipped: ``esa shuffler serve`` (uvicorn; the port from its settings)."""
    return [sys.executable, "-m", "services.cli", "shuffler", "serve"]


@contextlib.contextmanager
def serving(
    tree: Path, var: Path, database: str, command: Callable[[int], list[str]] = esa_serve
) -> Iterator[tuple[int, int]]:
    """The shuffler of ``tree`` (its own working directory and import path) served by
    ``command(port)``: yields its port and pid, once it answers ``/readyz``."""
    port = free_port()
    spec = launcher.shuffler_spec(var, 1, port, "", database)
    env = {
        **os.environ,
        **spec.env,
        "ESA_SHUFFLER_KEY_DIR": str(var / "keys"),
        "ESA_SHUFFLER_CHANNELS": json.dumps([CHANNEL]),
        "ESA_SHUFFLER_CHANNELS_FILE": "",
        "ESA_SHUFFLER_RATE_PER_SECOND": "1000",
        "ESA_SHUFFLER_RATE_BURST": "1000",
        "PYTHONPATH": str(tree),
    }
    env = {k: v for k, v in env.items() if v != ""}
    var.mkdir(parents=True, exist_ok=True)
    log = (var / "shuffler.log").open("ab")
    process = subprocess.Popen(
        command(port),
        cwd=tree,
        env=env,
        stdout=log,
        stderr=log,
    )
    service = launcher.Service(
        name="shuffler-1", url=spec.url, process=process, log=var / "shuffler.log"
    )
    try:
        launcher.wait_ready([service], 60.0)
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def requests(port: int, count: int, crowd: str = "") -> list[bytes]:
    """``count`` contributions sealed to the shuffler on ``port``, each with its own token
    (``crowd``: the crowd they name)."""
    config = httpx.get(f"http://127.0.0.1:{port}/v1/config").json()
    public = load_x25519_public(base64.b64decode(config["public_key"]))
    tokens = TokenAuthority(b"development")
    return [
        _post(tokens.issue(), seal_contribution(c, "shuffler-1", public))
        for c in contributions(count, crowd)
    ]


def one_round(
    port: int, pid: int, load: list[bytes], statuses: tuple[int, ...] = (202,)
) -> dict[str, float]:
    """One round: server CPU-µs per request (the process, threads that ended included, and
    the event loop's thread apart) and requests/s; every answer has one of ``statuses``."""
    before, main = _cpu_seconds(pid), loadgen.thread_cpu_seconds(pid)[pid]
    seconds, _ = asyncio.run(_load(port, load, statuses))
    per = 1e6 / len(load)
    return {
        "cpu": (_cpu_seconds(pid) - before) * per,
        "main": (loadgen.thread_cpu_seconds(pid)[pid] - main) * per,
        "rate": len(load) / seconds,
    }


def prefill(port: int, pid: int, count: int, chunk: int = 20_000) -> None:
    """``count`` contributions stored before measuring, so the indexes have the size they
    have mid-way through a 10^6-device epoch at one of three shufflers."""
    for start in track(range(0, count, chunk), description=f"prefill :{port}"):
        one_round(port, pid, requests(port, min(chunk, count - start)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help=f"earlier commit (default {BEFORE})")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="REF",
        help="another commit measured in the same rounds (an experiment's branch, say); "
        "printed with its ratio to before (repeatable)",
    )
    parser.add_argument("--requests", type=int, default=10_000, help="contributions per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per tree")
    parser.add_argument(
        "--prefill", type=int, default=200_000, help="contributions stored before the rounds"
    )
    parser.add_argument("--postgres", help="PostgreSQL server USER@HOST:PORT (else SQLite)")
    parser.add_argument("--profile", type=Path, help="py-spy this tree's shuffler into DIR")
    parser.add_argument(
        "--perf", type=Path, help="perf record this tree's shuffler into DIR (native stacks)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        trees = {"before": export(args.before, tmp / "before-tree")}
        trees |= {ref: export(ref, tmp / f"tree-{i}") for i, ref in enumerate(args.also)}
        print(compare({**trees, "after": ROOT}, tmp, args))


def compare(trees: dict[str, Path], tmp: Path, args: argparse.Namespace) -> str:
    """Alternate rounds between the trees' shufflers, each followed by a round of refused
    requests at this tree's; the medians, their ratio and this tree's parts."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_postgres(args.postgres))
        servers = {}
        for index, (name, tree) in enumerate(trees.items(), start=1):
            var = tmp / f"var-{index}"
            sqlite = f"sqlite:///{var / 'db.sqlite'}"
            database = url.format(service=f"shuffler_{index}") if url else sqlite
            servers[name] = stack.enter_context(serving(tree, var, database))
        for port, pid in servers.values():
            prefill(port, pid, args.prefill)
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        refused: dict[str, list[float]] = {"forged": [], "opened": []}
        for _ in range(args.rounds):
            for name, (port, pid) in servers.items():
                rounds[name].append(one_round(port, pid, requests(port, args.requests)))
            for kind, answers in refused.items():
                answers.append(refused_round(*servers["after"], args.requests, kind))
        parts = measured_apart(refused, args)
        if args.profile:
            profile_round(*servers["after"], args)
        if args.perf:
            perf_round(*servers["after"], args)
    return summary(rounds, parts, args)


#: A crowd the ``homepage`` channel does not declare: refused (400) once opened and parsed.
UNDECLARED_CROWD = "undeclared"


def refused_round(port: int, pid: int, count: int, kind: str) -> float:
    """The server's CPU-µs per request refused: ``count`` contributions as the rounds send
    them, each with a forged token (``forged``: 401 before any work) or naming a crowd the
    channel does not declare (``opened``: 400 after opening, parsing and the policy checks)."""
    if kind == "forged":
        load = [r.replace(b"Bearer ", b"Bearer forged", 1) for r in requests(port, count)]
        return one_round(port, pid, load, (401,))["cpu"]
    return one_round(port, pid, requests(port, count, UNDECLARED_CROWD), (400,))["cpu"]


def measured_apart(refused: dict[str, list[float]], args: argparse.Namespace) -> dict[str, float]:
    """What this tree's contribution is made of (CPU-µs per contribution), measured in the same
    run. At the server (medians of the :func:`refused_round` after each round): ``forged``, a
    request refused before any work (uvicorn's HTTP cycle, the sockets, the refusal), and
    ``opened``, one refused after HPKE opening, parsing and the policy checks; a stored
    contribution's round less ``opened`` is the storing (the commit thread and the hand-offs).
    Alone, in this process on an otherwise idle machine: ``hpke alone``, opening one
    contribution; ``store alone``, one row of ``ContributionStore.insert`` in transactions of
    :data:`COMMIT_ROWS` on a SQLite file that holds ``--prefill`` rows (not with
    ``--postgres``: the database's own CPU would be missing). The two kinds do not add up: at
    the server the load generator shares the machine's two cores, which slows the same work
    (docs/benchmarks.md, "Ingest CPU per contribution, before and after")."""
    parts = {kind: statistics.median(cpu) for kind, cpu in refused.items()}
    parts["hpke alone"] = hpke_cpu(2_000)
    if not args.postgres:
        parts["store alone"] = store_cpu(args.prefill, args.requests)
    return parts


def contributions(count: int, crowd: str = "") -> Iterator[Contribution]:
    """``count`` contributions of the rounds' shape (``homepage``, :data:`FRAGMENTS`) naming
    ``crowd``."""
    epoch = int(time.time() // 86_400)
    size = inner_size(CHANNEL["payload_size"])
    for _ in range(count):
        fragments = tuple(os.urandom(size) for _ in range(FRAGMENTS))
        yield Contribution(
            channel_id="homepage",
            crowd_id=crowd,
            epoch=epoch,
            nonce=new_nonce(),
            fragments=fragments,
        )


def hpke_cpu(count: int) -> float:
    """CPU-µs of opening one contribution sealed as the rounds' are (to a key of this run)."""
    key = X25519PrivateKey.generate()
    ring = KeyRing.of(key)
    blobs = [seal_contribution(c, "shuffler-1", key.public_key()) for c in contributions(count)]
    start = time.process_time()
    for blob in blobs:
        open_contribution(blob, "shuffler-1", ring)
    return (time.process_time() - start) / count * 1e6


def store_cpu(prefill: int, count: int) -> float:
    """CPU-µs of storing one row through ``ContributionStore.insert`` in transactions of
    :data:`COMMIT_ROWS`, once ``prefill`` rows are stored (a fresh SQLite file, WAL, FULL)."""
    with tempfile.TemporaryDirectory() as directory:
        engine, store = migrated_sqlite(Path(directory) / "store.sqlite")

        def batches(rows: int, size: int) -> Iterator[list[Pending]]:
            made = (Pending(secrets.token_hex(16), c, time.time()) for c in contributions(rows))
            while batch := list(itertools.islice(made, size)):
                yield batch

        for batch in track(batches(prefill, 1_000), description="store prefill"):
            store.insert(batch)
        timed, used = 0, 0.0
        for batch in batches(count, COMMIT_ROWS):
            start = time.process_time()
            store.insert(batch)
            used, timed = used + time.process_time() - start, timed + len(batch)
        store.close()  # its writer lock
        engine.dispose()
    return used / timed * 1e6


def recorded_round(port: int, pid: int, load: list[bytes], recorder: Profile | PerfRecord) -> None:
    """One round of ``load`` while ``recorder`` (started a second before) samples the server;
    the recording ends even if the round fails."""
    try:
        time.sleep(1)
        one_round(port, pid, load)
    finally:
        recorder.stop()


def profile_round(port: int, pid: int, args: argparse.Namespace) -> None:
    """py-spy on this tree's shuffler during one more round; the hottest functions."""
    load = requests(port, args.requests)
    args.profile.mkdir(parents=True, exist_ok=True)
    profile = Profile(pid, args.profile / "ingest", rate=200)
    recorded_round(port, pid, load, profile)
    for frame, inside, alone in top_frames(profile.raw, count=25):
        print(f"{inside:6.1%} {alone:6.1%}  {frame}")


def perf_round(port: int, pid: int, args: argparse.Namespace) -> None:
    """perf on this tree's shuffler during one more round, five times as long as the others
    (a few thousand samples at perf's 250 Hz): what its CPU is spent on, native code and
    system calls included (:func:`_perf.shares`)."""
    load = requests(port, 5 * args.requests)
    args.perf.mkdir(parents=True, exist_ok=True)
    record = PerfRecord(pid, args.perf / "ingest")
    recorded_round(port, pid, load, record)
    found = shares(record.data)
    if not found:
        raise RuntimeError(f"perf recorded no samples of the shuffler (pid {pid})")
    print(f"perf: {found[0][2]:,} samples of a round of {len(load):,} stored contributions")
    for name, share, _ in found:
        print(f"{share:6.1%}  {name}")


def summary(
    rounds: dict[str, list[dict[str, float]]], parts: dict[str, float], args: argparse.Namespace
) -> str:
    """The rounds, the medians and this tree's parts (:func:`measured_apart`) as text."""
    lines = [
        f"before = {args.before}, after = this tree; {args.prefill:,} stored first, then "
        f"{args.rounds} rounds of {args.requests:,} each"
    ]
    medians = {}
    for name, measured in rounds.items():
        medians[name] = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
        each = ", ".join(f"{r['cpu']:.0f}" for r in measured)
        m = medians[name]
        lines.append(
            f"{name}: median {m['cpu']:.0f} CPU-µs/contribution ({each}), event loop thread "
            f"{m['main']:.0f}, other threads {m['cpu'] - m['main']:.0f}; "
            f"{m['rate']:,.0f} contributions/s"
        )
    for name in [name for name in medians if name not in ("before", "after")]:
        lines.append(f"{name} / before: {medians[name]['cpu'] / medians['before']['cpu']:.3f}")
    ratio = medians["after"]["cpu"] / medians["before"]["cpu"]
    lines.append(f"after / before: {ratio:.3f} (target <= 0.667)")
    stored, forged, opened = medians["after"]["cpu"], parts["forged"], parts["opened"]
    lines.append(
        f"after, at the server (CPU-µs per request): refused before any work {forged:.0f} "
        f"(the HTTP cycle), refused after opening {opened:.0f} (opening and checks "
        f"{opened - forged:.0f}), stored {stored:.0f} (storing {stored - opened:.0f})"
    )
    alone = ", ".join(f"{name} {value:.0f}" for name, value in parts.items() if "alone" in name)
    lines.append(f"after, alone in this process (CPU-µs per contribution): {alone}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
