"""Balcer–Cheu's zero-sum histogram against k-RR at the same certified central (ε, δ).

Run: ``.venv/bin/python benchmarks/zsum_vs_krr.py``. For each crowd n per shuffler and domain
d, the zero-sum channel (ε = 1 per bin, δ = 10⁻⁶, declared n) certifies (2ε', δ) at a received
crowd of n (Theorem 12); k-RR is then run at the largest ε0 that certifies the same central ε
at the same δ and n (``esa account plan``), and both give the standard deviation of one bin's
count, summed over 3 shufflers (an empty bin for k-RR; zero-sum's does not depend on the
count). Also the count below which Figure 1's truncated analyzer reports a bin as 0. Prints
the markdown table of docs/reproduction.md, "Balcer–Cheu against k-RR".
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.accounting import KaryRR
from common.accounting.planner import plan_eps0
from common.mechanisms import zsum

SHUFFLERS = 3
CASES = ((2_000, 8), (5_000, 8), (5_000, 256), (5_000, 1024), (50_000, 1024), (500_000, 1024))


def _krr_sd(eps0: float, k: int, m: int) -> float:
    """Standard deviation of k-RR's debiased count of an empty bin over ``m`` reports."""
    e = math.exp(eps0)
    keep, other = e / (e + k - 1), 1 / (e + k - 1)
    return math.sqrt(m * other * (1 - other)) / (keep - other)


def main() -> None:
    print("| n per shuffler | d | zero-sum p | central (ε, δ) | zero-sum sd | "
          "Figure 1 zeroes counts below | k-RR ε0 | k-RR sd |")  # fmt: skip
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for n, d in CASES:
        params = zsum.ZSumParams(d=d, eps=1.0, delta=1e-6, n=n)
        bound = zsum.ZSum().certify_crowd(params, n, params.delta).certified
        m, p = SHUFFLERS * n, params.noise_prob
        plan = plan_eps0(bound.eps, bound.delta, n, KaryRR(k=d))
        print(
            f"| {n:,} | {d} | {p:.3f} | ({bound.eps:.2f}, {bound.delta:g}) | "
            f"{math.sqrt(zsum.variance(m, params)):.1f} | {m * (1 - p):,.0f} | "
            f"{plan.eps0:.2f} | {_krr_sd(plan.eps0, d, m):.1f} |"
        )


if __name__ == "__main__":
    main()
