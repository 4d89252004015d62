"""The TypeScript device SDK (sdk-js/) beside the Python one: the browser bundle's size, and
what a report costs in Node against the Python SDK on the same config.

Run: ``.venv/bin/python benchmarks/sdk_js.py [--write]`` (builds sdk-js when its build is
stale; ``--write`` replaces the "TypeScript device SDK" section of docs/benchmarks.md, without
it the numbers are only printed). Both SDKs get the signed config of benchmarks/client.py (three
shufflers; k-RAPPOR at k = 1,778,120, report fragments, k-RR, Balcer–Cheu) and report once per
epoch with nothing delivered, on one core. Per report: check the config, encode (the platform
CSPRNG), pad and HPKE-seal every fragment for the analyzer and the contribution(s) for the
shuffler(s), commit the state and the outbox (Python: SQLite with synchronous=FULL;
TypeScript: memory, or a file written and fsynced whole). And HPKE seals per second of one
padded fragment, alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import add_write, machine, pin_one_core, write_section
from client import CHANNELS, _config
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.envelope import FragmentContext, pad, seal
from encoder_client import Client

SECTION = "## TypeScript device SDK (sdk-js)"
SDK = Path(__file__).resolve().parents[1] / "sdk-js"
BUNDLE = SDK / "dist" / "esa-device-sdk.browser.js"


def _build() -> None:
    """``npm ci`` (when sdk-js has no node_modules) and ``npm run build``."""
    if not (SDK / "node_modules").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=SDK, check=True)
    subprocess.run(["npm", "run", "build"], cwd=SDK, check=True, capture_output=True)


def _python(config: Path, trust: Path, tmp: Path, reports: int, rounds: int) -> dict[str, float]:
    """Python SDK: ms per report on each channel (one epoch per report, as client.py), the
    best of ``rounds`` rounds of ``reports``."""
    found = {}
    start = time.time()
    for channel in CHANNELS:
        tick = [0]
        client = Client(
            config_file=config,
            trust_file=trust,
            state_path=tmp / f"{channel.id}.db",
            background=False,
            clock=lambda tick=tick: start + tick[0],
        )
        reporter = client.histogram(channel.id)
        reporter.report(0)
        best = float("inf")
        for _ in range(rounds):
            began = time.perf_counter()
            for i in range(1, reports + 1):
                tick[0] += 1
                reporter.report(i % 16)
            best = min(best, (time.perf_counter() - began) / reports * 1e3)
        found[channel.id] = best
        client.close()
    return found


def _python_seals(count: int, rounds: int) -> float:
    """HPKE seals per second of one padded 16-byte fragment (common.envelope.seal), the best
    of ``rounds`` rounds."""
    key = X25519PrivateKey.generate().public_key()
    info, plaintext = FragmentContext("krr", 1, "").info(), pad(b"\x01\x05\x00\x00\x00\x07", 16)
    for _ in range(50):
        seal(plaintext, key, info)
    fastest = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(count):
            seal(plaintext, key, info)
        fastest = min(fastest, time.perf_counter() - began)
    return count / fastest


def _node(request: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        ["node", str(SDK / "scripts" / "bench.mjs")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _node_version() -> str:
    return subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()


def measure(reports: int, seals: int, rounds: int) -> list[str]:
    """Every number, as the lines of the docs section."""
    _build()
    load = os.getloadavg()[0]
    raw = BUNDLE.read_bytes()
    zipped = len(gzip.compress(raw, compresslevel=9))
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        config, trust = _config(tmp)
        python = _python(config, trust, tmp, reports, rounds)
        python_seals = _python_seals(seals, rounds)
        base = {
            "config_text": config.read_text(),
            "trust": json.loads(trust.read_text()),
            "channels": [c.id for c in CHANNELS],
            "reports": reports,
            "rounds": rounds,
            "dir": str(tmp),
            "seals": seals,
        }
        runs = {
            ("memory", "webcrypto"): _node({**base, "storage": "memory", "backend": "webcrypto"}),
            ("file", "webcrypto"): _node({**base, "storage": "file", "backend": "webcrypto"}),
            ("memory", "noble"): _node({**base, "storage": "memory", "backend": "noble"}),
        }
    rows = [
        f"| {c.mechanism} | {python[c.id]:.2f} | "
        + " | ".join(f"{run['per_report'][c.id]:.2f}" for run in runs.values())
        + " |"
        for c in CHANNELS
    ]
    return [
        "Command: `.venv/bin/python benchmarks/sdk_js.py --write`.",
        f"Machine: {machine()}, Node {_node_version()}; load average {load:.1f} (a shared",
        "machine: the columns are comparable with each other, not with other sections).",
        "",
        "Browser bundle (`sdk-js/dist/esa-device-sdk.browser.js`: the SDK, hpke-js with both",
        f"X25519 implementations, @noble/ed25519; ESM, minified): {len(raw) / 1024:.1f} KiB,",
        f"**{zipped / 1024:.1f} KiB gzipped** (gzip -9).",
        "",
        f"ms per report, the best of {rounds} rounds' means of {reports:,} reports per channel,",
        "one epoch each, nothing delivered (the config of benchmarks/client.py: three",
        "shufflers):",
        "",
        "| mechanism | Python (SQLite) | TS, memory, WebCrypto | TS, file, WebCrypto | "
        "TS, memory, JS curves |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"HPKE seals per second of one padded 16-byte fragment (best of {rounds} rounds of "
        f"{seals:,}): Python (`cryptography`) "
        f"{python_seals:,.0f}; TypeScript with WebCrypto X25519 "
        f"{runs[('memory', 'webcrypto')]['seals_per_second']:,.0f}; with `@hpke/dhkem-x25519` "
        f"{runs[('memory', 'noble')]['seals_per_second']:,.0f}.",
        "",
        "A TypeScript report's file storage rewrites and fsyncs the whole state (the outbox",
        "included) per report, where SQLite appends rows: the file column grows with the",
        f"outbox ({rounds * reports:,} contributions queued by the last report here); a device",
        "that delivers keeps it short.",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_write(parser)
    parser.add_argument("--reports", type=int, default=100, help="reports per round")
    parser.add_argument("--seals", type=int, default=1000, help="HPKE seals per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the best is kept)")
    args = parser.parse_args(argv)
    pin_one_core()
    lines = measure(args.reports, args.seals, args.rounds)
    print("\n".join(lines))
    write_section(SECTION, "\n".join(lines), args.write)


if __name__ == "__main__":
    main()
