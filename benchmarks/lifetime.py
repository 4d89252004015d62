"""Lifetime accounting (issue 13 targets), for docs/benchmarks.md.

* The issue's example — k-RAPPOR/binary RR at ε0 = 2, n = 5,000 per epoch, 365 epochs,
  δ = 1e-5 — by :func:`common.accounting.lifetime_for_mechanism` (PLD, basic, advanced) and by
  an independent direct ``dp_accounting`` composition of the blanket pair
  (``tests/accounting/direct_pld.py``). Targets: PLD ≤ basic / 10, within 10% of direct.
* Time to compose 365 epochs at n = 10^6 (one core, cold caches). Target: < 5 s.

Run: ``.venv/bin/python benchmarks/lifetime.py [--write]`` (``--write`` records the section).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _report import command_line, machine, pin_one_core, write_section  # noqa: E402

from common.accounting import BinaryRR, lifetime_for_mechanism  # noqa: E402
from tests.accounting.direct_pld import direct_blanket_lifetime  # noqa: E402

EXAMPLE = {"eps0": 2.0, "n": 5_000, "epochs": 365, "delta": 1e-5}
LARGE = {"eps0": 2.0, "n": 10**6, "epochs": 365, "delta": 1e-5}
SECTION = "## Lifetime accounting"


def main() -> None:
    args = command_line(__doc__).parse_args()
    pin_one_core()
    e = EXAMPLE
    result = lifetime_for_mechanism(BinaryRR(), e["eps0"], [e["n"]] * e["epochs"], e["delta"])
    direct = direct_blanket_lifetime(e["n"], e["eps0"], e["epochs"], e["delta"])
    started = time.perf_counter()
    large = lifetime_for_mechanism(BinaryRR(), LARGE["eps0"], [LARGE["n"]] * 365, LARGE["delta"])
    seconds = time.perf_counter() - started
    ratio, off = result.eps_basic / result.eps_pld, result.eps_pld / direct - 1
    rows = [
        (
            "ε0 = 2, n = 5,000, 365 epochs, δ = 1e-5: PLD (dp_accounting, pessimistic)",
            f"{result.eps_pld:.4f}",
            "",
        ),
        (
            "same, basic composition",
            f"{result.eps_basic:.2f}",
            f"PLD ≤ basic / 10: {ratio >= 10} ({ratio:.1f}× below)",
        ),
        ("same, advanced composition", f"{result.eps_advanced:.2f}", ""),
        (
            "same, direct dp_accounting composition of the blanket pair (independent code)",
            f"{direct:.4f}",
            f"PLD within 10%: {abs(off) <= 0.1} ({100 * off:+.1f}%)",
        ),
        (
            "365 epochs at n = 10^6 composed (one core, cold)",
            f"{seconds:.2f} s (ε = {large.eps:.4f})",
            f"< 5 s: {seconds < 5}",
        ),
    ]
    table = "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    body = (
        f"Command: `.venv/bin/python benchmarks/lifetime.py` ({machine()}).\n\n"
        f"| what | value | target |\n|---|---|---|\n{table}\n"
    )
    write_section(SECTION, body, args.write)
    print(body)


if __name__ == "__main__":
    main()
