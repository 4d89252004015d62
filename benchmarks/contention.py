"""Does this machine charge more CPU per unit of Python work when more processes share its
cores? (docs/benchmarks.md, "Replicas and analyzer workers": 3 vs 6 shuffler processes.)

Each of P processes runs units of ~0.3 ms of dict/str/hash work, each followed by a 0.1 ms
sleep (a wake-up per unit, like a loaded event loop); the same total work for every P. Prints
the CPU per unit, from the children's rusage. Run:
``.venv/bin/python benchmarks/contention.py 3 6 3 6``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import time
from multiprocessing import Process

UNITS = 12_000
WORK_PER_UNIT = 60
SLEEP_SECONDS = 0.0001


def unit(i: int) -> int:
    text = json.dumps({"a": i, "b": str(i) * 8, "c": [i, i + 1, i + 2]})
    hashlib.sha256(text.encode()).hexdigest()
    return int(json.loads(text)["a"])


def worker(units: int) -> None:
    for i in range(units):
        for _ in range(WORK_PER_UNIT):
            unit(i)
        time.sleep(SLEEP_SECONDS)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(processes: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) for UNITS units over ``processes`` processes."""
    before, start = children_cpu(), time.perf_counter()
    workers = [Process(target=worker, args=(UNITS // processes,)) for _ in range(processes)]
    for p in workers:
        p.start()
    for p in workers:
        p.join()
    return time.perf_counter() - start, children_cpu() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("processes", type=int, nargs="+", help="process counts to run, in order")
    for processes in parser.parse_args().processes:
        wall, cpu = run(processes)
        per_unit = cpu / UNITS * 1e6
        print(f"P={processes}: wall {wall:.2f} s, CPU {cpu:.2f} s, per unit {per_unit:.1f} us")


if __name__ == "__main__":
    main()
