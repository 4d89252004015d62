"""What ``import encoder_client`` costs a device app: wall time, peak memory, modules loaded.

Each command runs ``--runs`` times (default 9) as a fresh interpreter from the repository root
(``python -c "import encoder_client"``, what an app's first line pays); the table gives the
median wall time and the median peak RSS of the child (``wait4``'s ``ru_maxrss``), and one
more run of each counts ``sys.modules`` and names the heavy packages it loaded. ``python -c
pass`` is the interpreter alone; ``from encoder_client import Client`` is what an app writes;
the last row is a device's whole first use: a ``Client`` from a locally signed config (a k-RR
and a report-fragments channel, no servers) and one k-RR report encoded, sealed and queued.

Run: ``.venv/bin/python benchmarks/sdk_import.py [--runs 9] [--write]`` (``--write`` records
the "SDK import" section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import ROOT, add_write, machine, write_section

from common.wire import ChannelConfig
from tests.support import offline_config

SECTION = "## SDK import"
COMMANDS = ("pass", "import encoder_client", "from encoder_client import Client")
#: A device's first use (``{folder}``: the signed config and the pins; a new state file per run).
FIRST_USE = (
    "import os; from encoder_client import Client; "
    "c = Client(config_file='{folder}/config.json', trust_file='{folder}/trust.json', "
    "state_path=f'{folder}/state-{{os.getpid()}}.db', background=False); "
    "c.histogram('krr').report(3); c.close()"
)
CHANNELS = (
    ChannelConfig(id="krr", mechanism="krr", params={"k": 16, "eps": 2.0}),
    ChannelConfig(
        id="rfrag", mechanism="rfrag", params={"k": 16, "eps_b": 4.0, "eps_f": 2.0, "tau": 3}
    ),
)
#: Packages a device has no use for at import (the accounting stack, the servers' stack,
#: numpy and the HTTP client, which load on first use).
HEAVY = (
    "scipy",
    "dp_accounting",
    "common.accounting",
    "numpy",
    "httpx",
    "fastapi",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "httptools",
)
PROBE = (
    "import sys\n{code}\nprint(len(sys.modules), *sorted(m for m in {heavy!r} if m in sys.modules))"
)


#: Starts the measured interpreters from a bare one: a child's peak RSS counts the memory of the
#: process it was spawned from (Linux keeps the larger high-water mark across ``exec``), so
#: spawning them from this script, which has loaded numpy and scipy, would inflate every row.
#: A first, unmeasured run writes the bytecode of the modules the command loads, as an
#: installed package has it (without it every run would compile our modules from source).
RUNNER = """
import os, sys, time
code, runs = sys.argv[1], int(sys.argv[2])
for run in range(runs + 1):
    started = time.perf_counter()
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ)
    _, status, usage = os.wait4(pid, 0)
    wall, cpu = time.perf_counter() - started, usage.ru_utime + usage.ru_stime
    if run:
        print(wall, cpu, usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""
#: The children's environment: bytecode written (the warm-up run needs it).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _runs(code: str, runs: int) -> list[tuple[float, float, float]]:
    """Wall and CPU seconds and peak RSS (MiB) of ``runs`` fresh ``python -c code``."""
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, code, str(runs)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    samples = []
    for line in out:
        wall, cpu, rss, status = line.split()
        if int(status) != 0:
            raise SystemExit(f"python -c {code!r} failed")
        samples.append((float(wall), float(cpu), int(rss) / 1024))
    return samples


def _modules(code: str) -> tuple[int, str]:
    """Modules loaded by ``code`` in a fresh interpreter, and the heavy ones among them."""
    probe = PROBE.format(code=code, heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=ENV, capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0]), ", ".join(out[1:]) or "none"


def measure(code: str, runs: int, label: str = "") -> str:
    """One table row: median wall and CPU time, median peak RSS, modules, heavy packages."""
    samples = _runs(code, runs)
    wall, cpu, rss = (statistics.median(sample[i] for sample in samples) for i in range(3))
    count, heavy = _modules(code)
    shown = label or f'`python -c "{code}"`'
    return f"| {shown} | {wall:.3f} | {cpu:.3f} | {rss:.1f} | {count:,} | {heavy} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per command")
    add_write(parser)
    args = parser.parse_args()
    rows = []
    for code in COMMANDS:
        rows.append(measure(code, args.runs))
        print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as folder:
        offline_config(Path(folder), list(CHANNELS))
        code = FIRST_USE.format(folder=folder)
        rows.append(measure(code, args.runs, "first use: `Client(config_file=…)`, one k-RR report"))
        print(rows[-1], flush=True)
    body = "\n".join(
        [
            f"Command: `.venv/bin/python benchmarks/sdk_import.py --runs {args.runs}` (median of "
            f"{args.runs} fresh processes each, from the repository root).",
            f"Machine: {machine(pinned=False)}.",
            "",
            "Target: `import encoder_client` under 0.3 s wall and 40 MiB, loading the device role "
            'only (docs/sdk.md, "What importing costs"); tests/client/test_import_cost.py '
            "guards which modules it loads. CPU is the child's user + system time: on a machine "
            "other jobs share, wall time exceeds it by the time the child waited for a core. "
            "Bytecode is compiled (an unmeasured first run writes it).",
            "",
            "| command | wall (s) | CPU (s) | peak RSS (MiB) | modules | heavy packages loaded |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
            *rows,
        ]
    )
    write_section(SECTION, body, args.write)


if __name__ == "__main__":
    main()
