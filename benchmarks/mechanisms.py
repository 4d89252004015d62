"""Mechanism speed: k-RAPPOR encoding at Table I scale and the Table I-scale simulation.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/mechanisms.py [--write]``). Pinned to one
core. ``--write`` records the "Mechanisms and simulation" section of docs/benchmarks.md.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import command_line, machine, pin_one_core, write_section

from common.mechanisms import krappor, krr, longitudinal, rfrag, zsum
from common.randomness import SystemSource

SECTION = "## Mechanisms and simulation"
TABLE_I = [
    "--dataset",
    "zipf",
    "--eps-c",
    "0.0025,0.01,0.05,0.25,1",
    "--delta",
    "5e-10",
    "--bound",
    "both",
]


def _rate(label: str, encode: object, reports: int) -> tuple[str, float]:
    start = time.perf_counter()
    for _ in range(reports):
        encode()  # type: ignore[operator]
    seconds = time.perf_counter() - start
    return label, reports / seconds


def main() -> None:
    args = command_line(__doc__).parse_args()
    pin_one_core()
    source = SystemSource()
    big = krappor.KRapporParams(k=1_778_120, eps=12.0)
    r_params = rfrag.RFragParams(k=1_778_120, eps_b=12.0, eps_f=10.6, tau=4)
    state = rfrag.new_state(r_params)
    l_params = longitudinal.LongitudinalParams(d=64, k=4, eps=4.0)
    tree = longitudinal.setup(l_params, source)
    z_params = zsum.ZSumParams(d=16, eps=1.0, delta=1e-8, n=10**6)
    rates = [
        _rate(
            "krappor k=1,778,120 ε=12",
            lambda: krappor.KRappor().encode_value(big, 123, source),
            20_000,
        ),
        _rate(
            "rfrag k=1,778,120 ε_b=12 ε_f=10.6 τ=4 (backstop cached)",
            lambda: rfrag.RFrag().encode_rows(r_params, 123, state, source),
            5_000,
        ),
        _rate(
            "longitudinal d=64 (one update)",
            lambda: longitudinal.update(tree, 64, 1, l_params, source),
            20_000,
        ),
        _rate("zsum d=16", lambda: zsum.ZSum().encode_value(z_params, 3, source), 20_000),
        _rate(
            "krr k=1,778,120",
            lambda: krr.KRR().encode_value(krr.KRRParams(1_778_120, 8.0), 123, source),
            20_000,
        ),
    ]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "services.cli", "simulate", "histogram", *TABLE_I, "--out", out],
            check=True,
            capture_output=True,
        )
        table_i = time.perf_counter() - start
    lines = [
        "Command: `make bench WRITE=--write` "
        "(runs `.venv/bin/python benchmarks/mechanisms.py --write`).",
        f"Machine: {machine()}.",
        "",
        "Encoding with the OS CSPRNG (`secrets.SystemRandom`), one core, no sealing:",
        "",
        "| mechanism | reports/s |",
        "|---|---|",
        *[f"| {label} | {rate:,.0f} |" for label, rate in rates],
        "",
        "Table I-scale simulation (`esa simulate histogram --dataset zipf` with n = 203,950,512,",
        "k = 1,778,120, the five ε_c of Table I, both bounds; includes process start, population,",
        f"planning, sampling, CSV and figure): **{table_i:.1f} s**.",
        "",
        f"Targets: Table I-scale run < 60 s (measured {table_i:.1f} s); k-RAPPOR encode >= 20,000",
        f"reports/s at k = 1,778,120, ε = 12 (measured {rates[0][1]:,.0f}).",
    ]
    write_section(SECTION, "\n".join(lines), args.write)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
