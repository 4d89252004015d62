"""The analyzer half of issue 11's epoch of 10^6, and the part opening throughput.

``.venv/bin/python benchmarks/epoch_analyzer.py [fragments] [--write]``: single-process HPKE
opening vs the analyzer's process pool (:class:`analyzer.opening.FragmentOpener`), measured in
the same run (target: pool rate >= 0.8 x single-process rate x processes used); ``--write``
records the "Part intake and opening throughput" section of docs/benchmarks.md.

``.venv/bin/python benchmarks/epoch_analyzer.py --epoch --contributions 1000000 [--write]``: one
epoch of N k-RAPPOR homepage-like contributions (k = 256, ε = 2; 31.3 sealed fragments each on
average, the mechanism's mean: ``benchmarks/epoch.py`` stores 30 at the shuffler, but the
analyzer certifies only the crowd a batch's fragments can back) reaches a real analyzer process
(``esa analyzer serve``, launched as ``esa up`` does, SQLite, default settings: a pool of one
opening process per core) the way a shuffler sends it: one batch in signed parts of
``PART_FRAGMENTS`` fragments POSTed one after another over HTTP. Measured: the time until every
part is acknowledged, the time until the batch is fully accumulated (every part opened and
folded in, the receipt written: ``esa_analyzer_batches_accepted_total`` = 1), fragments/s, and
the peak resident set (``VmHWM`` from ``/proc``) of the analyzer process and of each opening
worker. Every fragment is sealed afresh, on one process per core before the clock starts (the
analyzer counts a repeated sealed fragment once: a benchmark that reused sealed fragments would
measure repeats). ``--write``
records the "An epoch of 10^6 at the analyzer" section.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import add_write, machine, quiet_worker, run_main, write_section
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.opening import FragmentOpener, open_chunk
from common.envelope import (
    FragmentContext,
    KeyRing,
    load_or_create_ed25519,
    load_or_create_x25519,
    load_x25519_public,
    seal_fragment,
    sign,
)
from common.mechanisms import krappor
from common.preauth import PREAUTH_HEADER, preauth_header
from common.randomness import SeededSource
from common.wire import PART_FRAGMENTS, Batch, ChannelConfig, b64
from services.cli import launcher
from services.tools import loadgen

SECTION = "## Part intake and opening throughput"
EPOCH_SECTION = "## An epoch of 10^6 at the analyzer"
CHANNEL_ID = "homepage"
#: The default catalogue's homepage channel (k-RAPPOR, k = 256, ε = 2).
HOMEPAGE = ChannelConfig(
    id=CHANNEL_ID,
    mechanism="krappor",
    params={"k": 256, "eps": 2.0},
    min_crowd=50,
    max_fragments=96,
    delta=1e-8,
)
EPOCH = 1
#: What every fragment is sealed to: the batch's channel, epoch and crowd.
CONTEXT = FragmentContext(CHANNEL_ID, EPOCH, "")
#: Fragments per contribution on average, the mechanism's mean: a batch carrying fewer would
#: be certified at the smaller crowd its fragments verify.
FRAGMENTS = krappor.KRapporParams(k=256, eps=2.0).expected_fragments()


def throughput(count: int, write: bool) -> None:
    """Single-process opening vs the pool, printed; with ``write`` also :data:`SECTION`."""
    key = X25519PrivateKey.generate()
    ring = KeyRing.of(key)
    texts = [
        b64(seal_fragment(secrets.token_bytes(8), CONTEXT, 16, key.public_key()))
        for _ in range(count)
    ]
    start = time.perf_counter()
    assert len(open_chunk(ring, CONTEXT.info(), texts)) == count
    single = count / (time.perf_counter() - start)
    processes = os.cpu_count() or 1
    opener = FragmentOpener(ring, processes, 2000)
    try:
        opener.open(CONTEXT, texts[: processes * 2000])  # start the workers before timing
        start = time.perf_counter()
        assert len(opener.open(CONTEXT, texts)) == count
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
    write_section(SECTION, "\n".join(lines), write)
    print("\n".join(lines))


# --- the epoch -----------------------------------------------------------------------------


def _status_kb(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the opening pool's workers, multiprocessing's helpers)."""
    return [member for member in loadgen.process_tree(pid) if member != pid]


def _raw_rate(var: Path, pool: list[str], count: int = 20_000) -> float:
    """Fragments/s this process opens alone with the analyzer's key (the single-core rate the
    pool is compared with, measured in the same run while the analyzer is idle)."""
    ring = KeyRing.of(load_or_create_x25519(var / "keys" / "analyzer" / "hpke.pem"))
    start = time.perf_counter()
    assert len(open_chunk(ring, CONTEXT.info(), pool[:count])) == min(count, len(pool))
    return min(count, len(pool)) / (time.perf_counter() - start)


def _role(pid: int) -> str:
    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return "resource tracker" if "resource_tracker" in command else "opening worker"


@dataclass
class Memory:
    """Peak resident sets (kB) of the analyzer and its descendants, sampled from outside."""

    pid: int
    peaks: dict[int, int] = field(default_factory=dict)
    cpu: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    largest_total: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.sample()

    def sample(self) -> None:
        """Read every process's ``VmHWM`` (its own peak) and the sum of their ``VmRSS``."""
        total = 0
        for pid in [self.pid, *_children(self.pid)]:
            try:
                self.peaks[pid] = max(self.peaks.get(pid, 0), _status_kb(pid, "VmHWM"))
                used = loadgen.cpu_seconds(pid)  # NaN once gone: keep the last reading
                self.cpu[pid] = self.cpu.get(pid, 0.0) if math.isnan(used) else used
                self.roles.setdefault(pid, "analyzer" if pid == self.pid else _role(pid))
                total += _status_kb(pid, "VmRSS")
            except (FileNotFoundError, ProcessLookupError):
                continue
        self.largest_total = max(self.largest_total, total)

    def report(self) -> dict[str, Any]:
        """Peak RSS of the analyzer, of each opening worker, and of all summed (MB)."""
        workers = [kb for p, kb in self.peaks.items() if self.roles[p] == "opening worker"]
        cpu = [s for p, s in self.cpu.items() if self.roles[p] == "opening worker"]
        return {
            "analyzer_cpu_seconds": round(self.cpu[self.pid]),
            "opening_workers_cpu_seconds": ", ".join(str(round(s)) for s in sorted(cpu)),
            "analyzer_peak_rss_mb": round(self.peaks[self.pid] / 1024),
            "opening_workers_peak_rss_mb": ", ".join(
                str(round(kb / 1024)) for kb in sorted(workers)
            ),
            "analyzer_and_workers_max_summed_rss_mb": round(self.largest_total / 1024),
        }


def _sealed(public_raw: bytes, size: int, seed: int) -> list[str]:
    """``size`` sealed fragments, each sealed afresh (the analyzer counts a repeated sealed
    fragment once): k-RAPPOR reports of a Zipf-like page distribution."""
    params, public = krappor.KRapporParams(k=256, eps=2.0), load_x25519_public(public_raw)
    rng, values = SeededSource(seed), np.random.default_rng(seed).zipf(1.3, size) % 256
    sealed: list[str] = []
    for value in values:
        sealed += [
            b64(seal_fragment(f, CONTEXT, HOMEPAGE.payload_size, public))
            for f in krappor.KRappor().encode_value(params, int(value), rng)
        ]
        if len(sealed) >= size:
            break
    return sealed[:size]


def _seal_part(job: tuple[Path, bytes, bytes, str, int, int, int]) -> int:
    """Write part ``i`` of the epoch's batch (its body, then its signature) to ``path``."""
    path, public_raw, signer_raw, batch_id, i, parts, contributions = job
    total = round(contributions * FRAGMENTS)
    size = min(PART_FRAGMENTS, total - i * PART_FRAGMENTS)
    body = Batch(
        batch_id=batch_id,
        part=i,
        parts=parts,
        shuffler_id="shuffler-1",
        channel_id=CHANNEL_ID,
        crowd_id="",
        epoch=EPOCH,
        n_contributions=contributions,
        fragments=_sealed(public_raw, size, seed=1000 + i),
    ).body()
    signature = b64(sign(body, Ed25519PrivateKey.from_private_bytes(signer_raw)))
    path.write_bytes(signature.encode() + b"\n" + body)
    return size


def _seal_parts(
    tmp: Path, public: Any, signer: Ed25519PrivateKey, contributions: int
) -> list[Path]:
    """The epoch's one batch as signed part files, every fragment sealed afresh, on one
    process per core before the clock starts (sealing is not what is measured)."""
    parts = -(-round(contributions * FRAGMENTS) // PART_FRAGMENTS)
    batch_id, paths = secrets.token_hex(16), [tmp / f"part-{i}.bin" for i in range(parts)]
    keys = (public.public_bytes_raw(), signer.private_bytes_raw())
    jobs = [(paths[i], *keys, batch_id, i, parts, contributions) for i in range(parts)]
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1, quiet_worker) as pool:
        pool.map(_seal_part, jobs)
    return paths


def _parts(paths: list[Path], signer: Ed25519PrivateKey) -> Any:
    """The part bodies, signatures and ``ESA-Preauth`` heads, read one at a time (a shuffler
    keeps one body in memory while it sends it)."""
    for path in paths:
        signature, _, body = path.read_bytes().partition(b"\n")
        yield body, signature.decode(), preauth_header("shuffler-1", body, signer, time.time())


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(rf"^esa_analyzer_{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _deliver(url: str, parts: Any) -> tuple[int, int]:
    """POST every part until acknowledged, one after another (a shuffler's forwarder); the
    number of parts and the largest body."""
    count, largest = 0, 0
    with httpx.Client(timeout=600) as client:
        for body, signature, preauth in parts:
            headers = {
                PREAUTH_HEADER: preauth,
                "ESA-Signature": signature,
                "ESA-Shuffler": "shuffler-1",
                "Content-Type": "application/json",
            }
            while True:
                answer = client.post(url + "/v1/batches", content=body, headers=headers)
                if answer.status_code in (200, 201):
                    break
                print(f"part {count}: {answer.status_code} {answer.text[:200]}, again")
                time.sleep(1)
            count, largest = count + 1, max(largest, len(body))
    return count, largest


def _start_analyzer(var: Path) -> tuple[launcher.Service, Ed25519PrivateKey, Any]:
    """The analyzer alone (this process plays its shuffler), its shuffler's signing key and
    the analyzer's HPKE key, read from its key file: with no shuffler serving its descriptor
    the analyzer serves no config, and batches need only the registered signing key."""
    specs = launcher.prepare(var, 1, launcher.free_base_port(2), channels=[HOMEPAGE])
    service = launcher.start(specs[0], var / "analyzer.log")
    launcher.wait_ready([service], 120)
    signer = load_or_create_ed25519(var / "keys" / "shuffler-1" / "signing.pem")
    public = load_or_create_x25519(var / "keys" / "analyzer" / "hpke.pem").public_key()
    return service, signer, public


def epoch(contributions: int) -> dict[str, Any]:
    """Deliver and accumulate one epoch at a real analyzer; the numbers."""
    with tempfile.TemporaryDirectory(prefix="esa-epoch-analyzer-") as tmp:
        var = Path(tmp)
        service, signer, public = _start_analyzer(var)
        memory = Memory(pid=service.process.pid)
        try:
            start = time.perf_counter()
            paths = _seal_parts(var, public, signer, contributions)
            sealing = time.perf_counter() - start
            raw = _raw_rate(var, _sealed(public.public_bytes_raw(), 20_000, seed=1))
            threading.Thread(target=memory.run, daemon=True).start()
            start = time.perf_counter()
            parts, largest = _deliver(service.url, _parts(paths, signer))
            acknowledged = time.perf_counter() - start
            while _metric(service.url, "batches_accepted_total") < 1:
                time.sleep(0.5)
            accumulated = time.perf_counter() - start
            memory.sample()
            opened = _metric(service.url, "fragments_opened_total")
            repeated = _metric(service.url, "fragments_repeated_total")
            estimate = httpx.get(
                f"{service.url}/v1/channels/{CHANNEL_ID}/estimate?epoch={EPOCH}", timeout=60
            ).json()
            database = sum(f.stat().st_size for f in (var / "analyzer").glob("analyzer.db*"))
        finally:
            memory.done.set()
            launcher.stop([service])
    fragments = round(contributions * FRAGMENTS)
    return {
        "contributions": contributions,
        "fragments": fragments,
        "fragments_opened": int(opened),
        "parts": parts,
        "largest_part_bytes": largest,
        "fragments_repeated": int(repeated),
        "sealing_seconds (not counted)": round(sealing, 1),
        "all_parts_acknowledged_seconds": round(acknowledged, 1),
        "fully_accumulated_seconds": round(accumulated, 1),
        "fragments_per_second": round(fragments / accumulated),
        "raw_single_process_open_rate": round(raw),
        "rate / (raw x cores)": round(fragments / accumulated / (raw * (os.cpu_count() or 1)), 2),
        "estimate_n": estimate.get("n"),
        "estimate_complete": "incomplete" not in str(estimate.get("note")),
        "database_bytes_at_end": database,
        **memory.report(),
    }


def _epoch_section(result: dict[str, Any], command: str) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in result.items())
    verdict = "met" if result["analyzer_peak_rss_mb"] < 1024 else "**not met**"
    return (
        f"Command: `{command}`.\nMachine: {machine(pinned=False)}.\n\n"
        f"| measure | value |\n|---|---|\n{rows}\n\n"
        "One batch of the epoch's fragments in signed parts of `PART_FRAGMENTS` = "
        f"{PART_FRAGMENTS:,} POSTed one after another over HTTP to `esa analyzer serve` "
        "(SQLite, default settings: a pool of one opening process per core, chunks of 2,000). "
        "Times run from the first POST; `fully_accumulated_seconds` ends when the batch's last "
        "part is opened and folded in and its receipt written. Every fragment is sealed "
        "afresh before the clock starts (the analyzer counts a repeated sealed fragment once, "
        "recording each one's seal key in the fold's transaction). Peak RSS is each "
        "process's `VmHWM` read from "
        "`/proc`; `analyzer_and_workers_max_summed_rss_mb` the largest sum of their `VmRSS` "
        "sampled every 0.5 s; CPU seconds are `utime + stime` from `/proc/<pid>/stat`. "
        "`raw_single_process_open_rate` is the benchmark process opening 20,000 of the same "
        "fragments alone, just before the delivery, in the same run (this virtual machine's "
        "speed varies by 2x from hour to hour). "
        f"Target (issue 11): analyzer RSS < 1 GB: {verdict}.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fragments", nargs="?", type=int, default=40_000)
    parser.add_argument("--epoch", action="store_true", help="the epoch benchmark")
    parser.add_argument("--contributions", type=int, default=1_000_000)
    add_write(parser)
    args = parser.parse_args()
    if not args.epoch:
        throughput(args.fragments, args.write)
        return
    result = epoch(args.contributions)
    print(json.dumps(result, indent=2))
    command = (
        "flock /tmp/esa-bench.lock .venv/bin/python benchmarks/epoch_analyzer.py --epoch "
        f"--contributions {args.contributions} --write"
    )
    write_section(EPOCH_SECTION, _epoch_section(result, command), args.write)


if __name__ == "__main__":
    run_main(main)
