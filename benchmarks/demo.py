"""`esa demo` at its default size, timed end to end (issue: default finishes < 3 min on 2 cores).

Runs the command as a user would (it starts its own deployment: analyzer + 3 shufflers on
SQLite), three times, and prints the wall time of each run and the per-channel results of the
median run (``--write`` records them in docs/benchmarks.md). ``--hogs N`` runs N busy loops
(``sh -c 'while :; do :; done'``) beside every run, as a busy machine: the demo must then be
slower, never wrong (section "Demo beside CPU hogs").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import add_write, machine, write_section

from services.cli.launcher import port_free
from tests.support import free_port

ROUNDS = 3
HEADER = (
    "| channel | mechanism | devices | n released | neighbours | central ε | local ε (same "
    "notion) | took part ε (add-remove) | RMSE | checked inside 95% |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def one_run(out: Path) -> tuple[float, float, dict[str, Any]]:
    """One `esa demo`: (wall seconds, CPU seconds of it and every process it started, JSON)."""
    port = free_port()
    while not all(port_free(port + i) for i in range(4)):
        port = free_port()
    started, before = time.monotonic(), _children_cpu()
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "--analyzer-url",
         f"http://127.0.0.1:{port}", "--report", str(out / "r.html"),
         "--json", str(out / "r.json")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    elapsed, cpu = time.monotonic() - started, _children_cpu() - before
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    return elapsed, cpu, json.loads((out / "r.json").read_text())


def _children_cpu() -> float:
    """User + system CPU seconds of the child processes waited for (the demo's own children
    are in it once the demo has waited for them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _eps(value: object) -> str:
    return "∞ (no bound)" if value is None else f"{value:.3f}"


def _row(c: dict[str, Any]) -> str:
    local = "—" if c["local_eps"] is None else f"{c['local_eps']:.2f}"
    took_part = "—" if c["add_remove_eps"] is None else f"{c['add_remove_eps']:.2f}"
    return (
        f"| {c['channel_id']} | {c['mechanism']} | {c['devices']:,} | {c['n']:,} | "
        f"{c['neighbouring']} | {_eps(c['central_eps'])} | {local} | {took_part} | "
        f"{c['rmse']:.1f} | {c['inside']}/{len(c['checked'])} |"
    )


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """``count`` shell busy loops for the duration of the block."""
    loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_write(parser)
    parser.add_argument("--hogs", type=int, default=0, help="busy loops beside each run")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="runs of esa demo")
    args = parser.parse_args()
    runs = []
    for i in range(args.rounds):
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp, hogs(args.hogs):
            elapsed, cpu, result = one_run(Path(tmp))
        runs.append((elapsed, cpu, load, os.getloadavg()[0], result))
        print(f"run {i + 1}: {elapsed:.1f} s, {cpu:.0f} CPU-s", flush=True)
    runs.sort(key=lambda r: r[0])
    median_time, _, _, _, median = runs[len(runs) // 2]
    rows = "\n".join(_row(c) for c in median["channels"])
    each = "; ".join(f"{t:.0f} s ({c:.0f} CPU-s, load {a:.1f} → {b:.1f})" for t, c, a, b, _ in runs)
    inside = sum(c["inside"] for c in median["channels"])
    checked = sum(len(c["checked"]) for c in median["channels"])
    beside = f" --hogs {args.hogs}" if args.hogs else ""
    where = f"beside {args.hogs} busy loops" if args.hogs else "on a quiet machine"
    target = "slower, never wrong" if args.hogs else "target ≤ 180 s"
    body = f"""
Command: `flock /tmp/esa-bench.lock .venv/bin/python benchmarks/demo.py{beside} --rounds
{args.rounds}` (runs `esa demo` at its default size, 15,000 devices, {args.rounds} times
{where};
each run starts its own analyzer + 3 shufflers on SQLite, enrolls every device at every
shuffler, sends the longitudinal channel's reports in waves of one ten-second epoch while 2
worker processes encode and seal the histogram devices, replays the histogram
requests inside one epoch, closes each channel once sent, reads every release and writes the
HTML report). Machine: {machine(pinned=False)} (services, devices and the demo share the 2
cores). CPU: every process of the run, user + system.

Wall time per run (sorted): {each}. Median **{median_time:.0f} s** ({target}).

Median run, per channel ({inside} of {checked} checked estimates inside their 95% intervals):

{HEADER}
{rows}
"""
    print(body)
    write_section("## Demo beside CPU hogs" if args.hogs else "## Demo", body, args.write)
    print(f"median {median_time:.1f} s, mean {statistics.mean(r[0] for r in runs):.1f} s")


if __name__ == "__main__":
    main()
