"""Part opening throughput (issue 11, "Opening throughput"): single-process HPKE opening vs the
analyzer's process pool (:class:`analyzer.opening.FragmentOpener`), measured in the same run.

Run: ``.venv/bin/python benchmarks/epoch_analyzer.py [fragments]``. Writes the "Part intake and
opening throughput" section of docs/benchmarks.md. Target: pool rate >= 0.8 x single-process
rate x processes used.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import machine, write_section
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.opening import FragmentOpener, open_chunk
from common.envelope import KeyRing, seal_fragment
from common.wire import b64

SECTION = "## Part intake and opening throughput"
CHANNEL = "homepage"


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 40_000
    key = X25519PrivateKey.generate()
    ring = KeyRing.of(key)
    texts = [
        b64(seal_fragment(secrets.token_bytes(8), CHANNEL, 16, key.public_key()))
        for _ in range(count)
    ]
    start = time.perf_counter()
    assert len(open_chunk(ring, CHANNEL, texts)) == count
    single = count / (time.perf_counter() - start)
    processes = os.cpu_count() or 1
    opener = FragmentOpener(ring, processes, 2000)
    try:
        opener.open(CHANNEL, texts[: processes * 2000])  # start the workers before timing
        start = time.perf_counter()
        assert len(opener.open(CHANNEL, texts)) == count
        pooled = count / (time.perf_counter() - start)
    finally:
        opener.close()
    ratio = pooled / (single * processes)
    lines = [
        f"Command: `.venv/bin/python benchmarks/epoch_analyzer.py {count}`.",
        f"Machine: {machine(pinned=False)}.",
        "",
        f"{count:,} sealed fragments (base64, as stored in a part), opened with the analyzer key.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| single process (`open_chunk`) | {single:,.0f} fragments/s |",
        f"| pool of {processes} processes (`FragmentOpener`, chunks of 2,000) "
        f"| {pooled:,.0f} fragments/s |",
        f"| pool / (single x {processes}) | **{ratio:.2f}** (target >= 0.8) |",
    ]
    write_section(SECTION, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
