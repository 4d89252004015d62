"""The same shuffler under uvicorn (as shipped) and under granian: CPU per request, in one run.

Run: ``.venv/bin/pip install granian`` (not a dependency of ours), then ``flock
/tmp/esa-bench.lock .venv/bin/python benchmarks/http_server.py [--prefill N] [--requests N]
[--rounds N]``. Asks whether a leaner HTTP server than uvicorn's ASGI cycle would cut the
ingest CPU of a contribution (docs/benchmarks.md, "Ingest CPU per contribution, before and
after"). Both serve this tree's ``shuffler.app:create_asgi`` on SQLite with the same settings,
side by side; granian (HTTP parsing and sockets in Rust, one worker, one runtime thread,
uvloop) runs the app in a child process, so each server's CPU is that of its whole process
tree. Rounds alternate: contributions stored (202), then as many requests with a forged token
(401, the HTTP cycle alone). Prints medians of CPU-µs per request and granian / uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest_cpu import ROOT, _load, _post, esa_serve, prefill, requests, serving

from services.tools import loadgen


def granian(port: int) -> list[str]:
    """granian serving the same application factory that ``esa shuffler serve`` serves."""
    return [
        *(sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--http", "1"),
        *("--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--no-ws"),
        *("--host", "127.0.0.1", "--port", str(port), "shuffler.app:create_asgi"),
    ]


#: The two servers, in the order their rounds alternate.
SERVERS = ("granian", "uvicorn")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it."""
    table = loadgen.process_table()
    return sum(loadgen.cpu_seconds(member) for member in loadgen.process_tree(pid, table))


def cpu_per_request(port: int, pid: int, load: list[bytes], status: int) -> float:
    """Server CPU-µs per request of one round of ``load``; every answer has ``status``."""
    before = tree_cpu_seconds(pid)
    asyncio.run(_load(port, load, (status,)))
    return (tree_cpu_seconds(pid) - before) * 1e6 / len(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=100_000, help="rows stored first")
    parser.add_argument("--requests", type=int, default=10_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    servers = {"granian": granian, "uvicorn": esa_serve}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        running = {
            name: stack.enter_context(
                serving(ROOT, Path(tmp) / name, f"sqlite:///{tmp}/{name}/shuffler.db", command)
            )
            for name, command in servers.items()
        }
        for port, pid in running.values():
            prefill(port, pid, args.prefill)
        cpu: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, (port, pid) in running.items():
                stored = cpu_per_request(port, pid, requests(port, args.requests), 202)
                forged = [_post("forged.token", b"z" * 2600)] * args.requests
                cpu.setdefault(f"{name} stored", []).append(stored)
                cpu.setdefault(f"{name} forged", []).append(cpu_per_request(port, pid, forged, 401))
    report(cpu)


def report(cpu: dict[str, list[float]]) -> None:
    """Medians (and each round) of every kind, then granian / uvicorn for each kind: the ratio
    of the medians and the median of the ratios of rounds run one after the other."""
    for kind, values in cpu.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"{kind}: {statistics.median(values):.0f} CPU-µs per request ({rounds})")
    for kind in ("stored", "forged"):
        granian_cpu, uvicorn_cpu = (statistics.median(cpu[f"{s} {kind}"]) for s in SERVERS)
        paired = statistics.median(
            g / u for g, u in zip(cpu[f"granian {kind}"], cpu[f"uvicorn {kind}"], strict=True)
        )
        print(
            f"granian / uvicorn, {kind}: {granian_cpu / uvicorn_cpu:.2f} "
            f"(median of the rounds' ratios {paired:.2f})"
        )


if __name__ == "__main__":
    main()
