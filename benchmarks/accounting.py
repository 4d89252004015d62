"""Accounting speed: time per certified point and per plan (docs/benchmarks.md).

Run: ``make bench`` (or ``.venv/bin/python benchmarks/accounting.py [--write]``; ``--write``
records the "Privacy accounting" section). Pinned to one core; every timing starts from cold
caches (the accounting functions memoise their results).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import command_line, machine, pin_one_core, write_section

from common.accounting import BinaryRR, blanket_binary_rr, certify, hockey_stick, lower, plan_eps0

NS = [10**3, 10**4, 10**5, 10**6, 10**7, 10**9]
EPS0S = [0.5, 1.0, 2.0, 4.0, 8.0, 12.0]
DELTA = 1e-9
REPEATS = 3
PLANS = [(1.0, 5e-10, 203_950_512), (1.0, 1e-9, 10**5), (0.5, 1e-9, 10**7), (1.0, 1e-9, 10**9)]
SECTION = "## Privacy accounting"


def _cold() -> None:
    hockey_stick.eps_for_delta.cache_clear()
    hockey_stick._blocks.cache_clear()
    lower._lower_eps.cache_clear()
    lower._pmfs.cache_clear()


def _time(action: Callable[[], object]) -> float:
    samples = []
    for _ in range(REPEATS):
        _cold()
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _grid(label: str, action: Callable[[float, int], object]) -> tuple[list[str], float, float]:
    lines = [f"| {label} | " + " | ".join(f"ε0={e:g}" for e in EPS0S) + " |"]
    lines.append("|---|" + "---|" * len(EPS0S))
    worst_small = worst_large = 0.0
    for n in NS:
        cells = []
        for eps0 in EPS0S:
            seconds = _time(lambda e=eps0, m=n: action(e, m))
            cells.append(f"{seconds * 1e3:.1f}")
            if n <= 10**7:
                worst_small = max(worst_small, seconds)
            else:
                worst_large = max(worst_large, seconds)
        lines.append(f"| n=10^{round(np.log10(n))} | " + " | ".join(cells) + " |")
    return lines, worst_small, worst_large


def main() -> None:
    args = command_line(__doc__).parse_args()
    pin_one_core()
    cert_lines, cert_small, cert_large = _grid(
        "certificate (ms)", lambda e, n: blanket_binary_rr(e, n, DELTA)
    )
    full_lines, full_small, full_large = _grid(
        "all bounds (ms)", lambda e, n: certify(BinaryRR(), e, n, DELTA)
    )
    plan_lines = ["| target ε | δ | n | planned ε0 | seconds |", "|---|---|---|---|---|"]
    worst_plan = 0.0
    for target, delta, n in PLANS:
        _cold()
        start = time.perf_counter()
        plan = plan_eps0(target, delta, n, BinaryRR())
        seconds = time.perf_counter() - start
        worst_plan = max(worst_plan, seconds)
        plan_lines.append(f"| {target:g} | {delta:g} | {n:,} | {plan.eps0:.4f} | {seconds:.2f} |")
    body = [
        "Command: `make bench WRITE=--write` "
        "(runs `.venv/bin/python benchmarks/accounting.py --write`).",
        f"Machine: {machine()}.",
        f"δ = {DELTA:g}, mechanism krappor; median of {REPEATS} cold-cache runs per cell.",
        "",
        "*Certificate* is the bound the analyzer certifies (`blanket-binary-rr`, exact numerical",
        "hockey-stick with its bracketing search). *All bounds* is `esa account certify`: every",
        "applicable bound, the exact 2RR lower bound and the replacement certificate (at δ/2).",
        "",
        *cert_lines,
        "",
        *full_lines,
        "",
        "Planner (`plan_eps0`, krappor, tightest bound, including re-certification of the answer):",
        "",
        *plan_lines,
        "",
        "Targets (one core): < 100 ms per certified point for n <= 10^7, < 1 s for n <= 10^9, "
        "planner < 2 s.",
        f"Measured worst cases: certificate {cert_small * 1e3:.0f} ms (n <= 10^7), "
        f"{cert_large * 1e3:.0f} ms (n = 10^9); all bounds {full_small * 1e3:.0f} ms (n <= 10^7), "
        f"{full_large * 1e3:.0f} ms (n = 10^9); planner {worst_plan:.2f} s.",
        "",
    ]
    write_section(SECTION, "\n".join(body), args.write)
    print("\n".join(body))


if __name__ == "__main__":
    main()
