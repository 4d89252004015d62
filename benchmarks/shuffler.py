"""Shuffler speed: ingest throughput/latency vs a trivial endpoint, and building a 1M batch.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/shuffler.py [--write]``). The shuffler
runs as a real uvicorn process on SQLite (WAL, synchronous=FULL); 64 concurrent HTTP/1.1
clients from this process post pre-sealed contributions. In the same run the same clients hit
the same server's trivial ``GET /healthz``. ``--write`` records the "Shuffler" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trivial_app
from _report import add_write, machine, write_section

from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from services.tools import loadgen
from shuffler.intake import TokenAuthority
from shuffler.records import GroupKey, pack_fragments
from tests.support import free_port, shuffler_process

SECTION = "## Shuffler"
CONCURRENCY = 64
REQUESTS = 12_000
CHANNEL = {
    "id": "bench",
    "epoch_seconds": 3600,
    "min_crowd": 10,
    "eps_cr": 1.0,
    "delta_cr": 1e-6,
    "max_fragments": 16,
}


async def _connection(
    host: str,
    port: int,
    requests: list[bytes],
    latencies: list[float],
    statuses: tuple[int, ...] = (200, 202),
) -> None:
    """One keep-alive HTTP/1.1 connection sending its requests back to back; an answer whose
    status is not among ``statuses`` stops the run.

    A raw asyncio client: general-purpose Python HTTP clients top out near the server's rate
    on this 2-core machine and would measure themselves instead of the server.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for request in requests:
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            if status not in statuses:
                raise RuntimeError(f"unexpected status {status}: {head!r}")
            latencies.append(time.perf_counter() - start)
    finally:
        writer.close()


async def _load(
    port: int, requests: list[bytes], statuses: tuple[int, ...] = (200, 202)
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    shares = [requests[i::CONCURRENCY] for i in range(CONCURRENCY)]
    start = time.perf_counter()
    connections = (_connection("127.0.0.1", port, share, latencies, statuses) for share in shares)
    await asyncio.gather(*connections)
    return time.perf_counter() - start, latencies


def _post(token: str, blob: bytes) -> bytes:
    head = (
        f"POST /v1/contributions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(blob)}\r\n\r\n"
    )
    return head.encode() + blob


TRIVIAL = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


ROUNDS = 3


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default; Linux /proc for others)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    return loadgen.cpu_seconds(pid)


def _ingest(tmp: Path) -> dict[str, Any]:
    """Alternate rounds of ingest, trivial POST and GET /healthz; report medians."""

    service = shuffler_process(
        tmp,
        "shuffler-1",
        [CHANNEL],
        rate_per_second="1000",
        rate_burst="1000",
        commit_batch="64",
        batch_interval_seconds="1.0",
        forward_interval_seconds="1.0",
    ).start()
    trivial_port = free_port()
    with trivial_app.running(trivial_port) as trivial:
        rates: dict[str, list[float]] = {"ingest": [], "post": [], "healthz": []}
        cpu: dict[str, list[float]] = {
            "ingest": [],
            "post": [],
            "client_ingest": [],
            "client_post": [],
        }
        latencies: dict[str, list[float]] = {"ingest": [], "post": [], "healthz": []}
        try:
            config = httpx.get(service.url + "/v1/config").json()
            public = load_x25519_public(base64.b64decode(config["public_key"]))
            tokens = TokenAuthority(b"development")
            epoch = int(time.time() // 3600)
            fragment = bytes(72)
            rounds = [
                [
                    _post(
                        tokens.issue(),
                        seal_contribution(
                            Contribution(
                                channel_id="bench",
                                crowd_id="",
                                epoch=epoch,
                                nonce=new_nonce(),
                                fragments=(fragment,) * 6,
                            ),
                            "shuffler-1",
                            public,
                        ),
                    )
                    for _ in range(REQUESTS)
                ]
                for _ in range(ROUNDS)
            ]
            asyncio.run(_load(service.spec.port, [TRIVIAL] * 2_000))
            asyncio.run(_load(trivial_port, rounds[0][:2_000]))
            for requests in rounds:
                for name, port, pid, load in (
                    ("post", trivial_port, trivial.pid, requests),
                    ("ingest", service.spec.port, service.service.process.pid, requests),  # type: ignore[union-attr]
                    ("healthz", service.spec.port, None, [TRIVIAL] * REQUESTS),
                ):
                    server, client = _cpu_seconds(pid) if pid else 0.0, _cpu_seconds()
                    seconds, lat = asyncio.run(_load(port, load))
                    rates[name].append(REQUESTS / seconds)
                    latencies[name].extend(lat)
                    if pid:
                        cpu[name].append((_cpu_seconds(pid) - server) / REQUESTS * 1e6)
                        cpu[f"client_{name}"].append((_cpu_seconds() - client) / REQUESTS * 1e6)
        finally:
            service.stop()
    quantiles = {k: statistics.quantiles(v, n=100) for k, v in latencies.items()}
    return {
        "ingest_rate": statistics.median(rates["ingest"]),
        "post_rate": statistics.median(rates["post"]),
        "trivial_rate": statistics.median(rates["healthz"]),
        "p50_ms": quantiles["ingest"][49] * 1e3,
        "p99_ms": quantiles["ingest"][98] * 1e3,
        "post_p50_ms": quantiles["post"][49] * 1e3,
        "trivial_p50_ms": quantiles["healthz"][49] * 1e3,
        "ratios": [i / p for i, p in zip(rates["ingest"], rates["post"], strict=True)],
        "ingest_cpu_us": statistics.median(cpu["ingest"]),
        "post_cpu_us": statistics.median(cpu["post"]),
        "client_ingest_cpu_us": statistics.median(cpu["client_ingest"]),
        "client_post_cpu_us": statistics.median(cpu["client_post"]),
    }


def _big_batch(tmp: Path) -> tuple[float, int]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from sqlalchemy import insert

    from common.envelope import KeyRing
    from common.wire import ChannelPolicy
    from runtime import db
    from shuffler import tables
    from shuffler.app import MIGRATIONS
    from shuffler.service import ShufflerService
    from shuffler.settings import ShufflerSettings
    from shuffler.store_backends import make_store

    url = f"sqlite:///{tmp / 'big.db'}"
    policy = ChannelPolicy(**CHANNEL)
    settings = ShufflerSettings(database_url=url, key_dir=tmp / "keys", channels=[policy])
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    service = ShufflerService(
        settings,
        make_store(engine),
        KeyRing.of(X25519PrivateKey.generate()),
        Ed25519PrivateKey.generate(),
        clock=lambda: 0.0,
    )
    contributions, per = 100_000, 10
    rows = [
        {
            "channel_id": "bench",
            "crowd_id": "",
            "epoch": 0,
            "client_id": secrets.token_hex(16),
            "nonce": os.urandom(16),
            "fragments": pack_fragments([os.urandom(72)] * per),
            "n_fragments": per,
            "received_at": 0.0,
            "receipt": secrets.token_hex(16),
        }
        for _ in range(contributions)
    ]
    with engine.begin() as conn:
        conn.execute(insert(tables.contributions), rows)
    start = time.perf_counter()
    outcome = service.evaluate(GroupKey("bench", "", 0))
    seconds = time.perf_counter() - start
    assert outcome is not None and outcome.status == "released"
    return seconds, outcome.kept * per


def main() -> None:
    global REQUESTS, ROUNDS
    load_before = os.getloadavg()[0]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="ingest rounds only: skip the 1M-fragment batch (writes nothing, even with --write)",
    )
    add_write(parser)
    args = parser.parse_args()
    REQUESTS, ROUNDS = args.requests, args.rounds
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        ingest = _ingest(tmp)
        if args.quick:
            ratios = ", ".join(f"{r:.2f}" for r in ingest.pop("ratios"))
            print({k: round(v, 1) for k, v in ingest.items()}, "ratios:", ratios, load_before)
            return
        big_seconds, big_fragments = _big_batch(tmp)
    ratio = statistics.median(ingest["ratios"])
    ratio_get = ingest["ingest_rate"] / ingest["trivial_rate"]
    verdict = "met" if ratio >= 0.5 else "**not met**"
    row = "| {} | {:,.0f} | {:.1f} | {} |"
    lines = [
        "Command: `make bench WRITE=--write` "
        "(runs `.venv/bin/python benchmarks/shuffler.py --write`).",
        f"Machine: {machine(pinned=False)} (server and load generator share the 2 cores).",
        "",
        f"{ROUNDS} alternating rounds of {REQUESTS:,} requests each (medians below) over "
        f"{CONCURRENCY} concurrent HTTP/1.1 keep-alive connections",
        "(loopback) to one `esa shuffler serve` process (uvicorn with uvloop/httptools, SQLite WAL",
        "with synchronous=FULL, group commit). Each contribution is HPKE-sealed with 6 fragments;",
        "the shuffler verifies the token, opens the envelope, checks quota and nonce, and commits",
        "before answering 202. The load generator is a raw asyncio HTTP/1.1 client.",
        "",
        "| endpoint | requests/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
        row.format(
            "POST /v1/contributions",
            ingest["ingest_rate"],
            ingest["p50_ms"],
            f"{ingest['p99_ms']:.1f}",
        ),
        row.format(
            "trivial FastAPI POST, same bodies, same stack",
            ingest["post_rate"],
            ingest["post_p50_ms"],
            "—",
        ),
        row.format(
            "GET /healthz on the shuffler", ingest["trivial_rate"], ingest["trivial_p50_ms"], "—"
        ),
        "",
        f"Ingest: **{ingest['ingest_rate']:,.0f}/s** (target >= 1,500/s). Ratio ingest / trivial",
        f"POST: **{ratio:.2f}**; ingest / GET /healthz: {ratio_get:.2f}",
        f"(target >= 0.5: {verdict}; per-round ratios "
        f"{', '.join(f'{r:.2f}' for r in ingest['ratios'])}).",
        "",
        "CPU per request (medians): shuffler "
        f"{ingest['ingest_cpu_us']:.0f} µs (event loop and commit thread), trivial app "
        f"{ingest['post_cpu_us']:.0f} µs; load generator {ingest['client_ingest_cpu_us']:.0f} µs",
        f"while driving ingest, {ingest['client_post_cpu_us']:.0f} µs while driving the trivial "
        "app, i.e. "
        f"{ingest['client_post_cpu_us'] * ingest['post_rate'] / 1e6:.2f} of a core at the trivial "
        "rate: the generator is not the limit on either side. 1-minute",
        f"load average before the run: {load_before:.1f} (other work shares this machine, so",
        "absolute rates move from run to run; the ratio is taken per alternating round).",
        "",
        "Where the shuffler's time goes (py-spy, samples holding the GIL): about a third is",
        "opening the HPKE envelope (`Suite.decrypt`, ~55 µs: two X25519 scalar multiplications,",
        "since the library re-derives the recipient's public key on every call, plus HKDF and",
        "AES-GCM; it holds the GIL), a quarter is uvicorn's own request/response work that any",
        "endpoint pays, the rest token check, parsing and the hand-off to the commit thread.",
        "Ingest bypasses FastAPI's per-request machinery (same responses, same checks); one",
        "dedicated thread commits whatever is queued as one multi-row INSERT per transaction",
        "and answers the whole batch with one callback; receipts start with the time so a",
        "batch's receipts share index pages; SQLite checkpoints its WAL every 10,000 pages.",
        "",
        f"Building one batch of {big_fragments:,} fragments (100,000 contributions × 10",
        "fragments: Algorithm 3, CSPRNG shuffle, JSON body, Ed25519 signature, stored in the",
        f"transaction that deletes the contributions): **{big_seconds:.1f} s** (target < 10 s).",
    ]
    write_section(SECTION, "\n".join(lines), args.write)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
