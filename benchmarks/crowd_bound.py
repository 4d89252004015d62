"""What an honest batch pays for the verified crowd being a lower confidence bound.

The analyzer certifies a batch at the smallest crowd its distinct valid fragments are consistent
with (:meth:`common.mechanisms.FragmentCount.verified_crowd`, α = 10⁻⁹), never at the crowd a
shuffler claims. For honest batches of n real contributions, encoded by each mechanism's own
encoder with a seeded source, this prints the verified crowd and the certified ε at the true n
and at the verified crowd (δ = 10⁻⁸), the median over ``--batches`` batches.

Run: ``.venv/bin/python benchmarks/crowd_bound.py [--batches 11] [--write]`` (``--write``
records the table in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _report import add_write, machine, write_section  # noqa: E402

from common.mechanisms import BatchContext, SeededSource, get  # noqa: E402

#: The adversary suite's channels: k-RAPPOR (a random number of fragments) and k-RR (one).
CHANNELS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("krappor", {"k": 64, "eps": 2.0}),
    ("krr", {"k": 16, "eps": 2.0}),
)
CROWDS = (50, 200, 1_000, 5_000)
DELTA = 1e-8
SECTION = "## Verified crowd: what an honest batch loses to the lower bound"


def row(name: str, raw: dict[str, Any], n: int, batches: int) -> str:
    """One table row: the median verified crowd and ε over ``batches`` seeded batches."""
    mechanism = get(name)
    params = mechanism.parse_params(raw)
    law = mechanism.fragment_count(params, BatchContext(0, 3))
    verified = []
    for seed in range(batches):
        rng = SeededSource(seed)
        valid = sum(
            len(mechanism.encode(params, i % 16, None, rng, 3).routes[0][1]) for i in range(n)
        )
        verified.append(law.verified_crowd(n, valid, 0))
    middle = int(statistics.median(verified))
    at_n = mechanism.certify_crowd(params, n, DELTA).certified.eps
    at_verified = mechanism.certify_crowd(params, middle, DELTA).certified.eps
    return (
        f"| {name} {raw} | {n:,} | {middle:,} ({min(verified):,}–{max(verified):,}) "
        f"| {middle / n:.3f} | {at_n:.3f} | {at_verified:.3f} | {at_verified - at_n:+.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=11, help="seeded batches per cell")
    add_write(parser)
    args = parser.parse_args()
    lines = [
        f"Command: `.venv/bin/python benchmarks/crowd_bound.py --batches {args.batches}`.",
        f"Machine: {machine(pinned=False)}. δ = {DELTA:g}, α = 10⁻⁹; median (range) over "
        f"{args.batches} seeded honest batches.",
        "",
        "| channel | true n | verified crowd | verified / n | ε at n | ε at verified | ε lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, raw in CHANNELS:
        for n in CROWDS:
            lines.append(row(name, raw, n, args.batches))
            print(lines[-1], flush=True)
    write_section(SECTION, "\n".join(lines), args.write)


if __name__ == "__main__":
    main()
