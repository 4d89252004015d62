"""An epoch of N contributions at one shuffler (issue 11, shuffler half): time to evaluate
(ESA-revisited Algorithm 3), shuffle once and store the signed parts, and the shuffler's peak RSS.

Run: ``.venv/bin/python benchmarks/epoch.py --contributions 1000000`` (prints JSON; add
``--write`` to record the "Epoch of 10^6 contributions (shuffler)" section of docs/benchmarks.md).
Contributions are k-RAPPOR homepage-like (30 sealed fragments of 72 bytes each) and are inserted
through the store's tables directly, not over HTTP; the group is then closed as an admin close
would (``ShufflerService.close``) on SQLite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import machine, write_section
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from sqlalchemy import func, insert, select

from common.envelope import KeyRing
from common.wire import PART_FRAGMENTS, ChannelPolicy
from services.runtime import db
from shuffler import storage
from shuffler.app import MIGRATIONS
from shuffler.records import pack_fragments
from shuffler.service import ShufflerService
from shuffler.settings import ShufflerSettings
from shuffler.store import make_store

#: k-RAPPOR homepage-like: ~30 fragments per contribution, each a sealed 16-byte payload.
FRAGMENTS, FRAGMENT_BYTES = 30, 72
#: Rows per insert transaction while building the epoch (bounds the benchmark's own memory).
INSERT_CHUNK = 20_000
POLICY = ChannelPolicy(id="homepage", min_crowd=100, eps_cr=0.5, delta_cr=1e-9, max_batch=10**9)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _service(tmp: Path, part_fragments: int) -> ShufflerService:
    url = f"sqlite:///{tmp / 'epoch.db'}"
    settings = ShufflerSettings(
        database_url=url, key_dir=tmp / "keys", channels=[POLICY], part_fragments=part_fragments
    )
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    keys = KeyRing.of(X25519PrivateKey.generate())
    return ShufflerService(settings, make_store(engine), keys, Ed25519PrivateKey.generate())


def _fill(service: ShufflerService, contributions: int, epoch: int) -> None:
    for start in range(0, contributions, INSERT_CHUNK):
        rows = [
            {
                "channel_id": POLICY.id,
                "crowd_id": "",
                "epoch": epoch,
                "client_id": secrets.token_hex(16),
                "nonce": os.urandom(16),
                "fragments": pack_fragments([os.urandom(FRAGMENT_BYTES) for _ in range(FRAGMENTS)]),
                "n_fragments": FRAGMENTS,
                "received_at": time.time(),
                "receipt": secrets.token_hex(16),
            }
            for _ in range(min(INSERT_CHUNK, contributions - start))
        ]
        with service.store.engine.begin() as conn:
            conn.execute(insert(storage.contributions), rows)


def run(contributions: int, part_fragments: int) -> dict[str, Any]:
    """Build, close and measure one epoch; returns the numbers."""
    with tempfile.TemporaryDirectory() as directory:
        service = _service(Path(directory), part_fragments)
        epoch = int(time.time() // POLICY.epoch_seconds)
        start = time.perf_counter()
        _fill(service, contributions, epoch)
        fill_seconds, rss_before = time.perf_counter() - start, _peak_rss_mb()
        start = time.perf_counter()
        groups = service.close(POLICY.id, epoch)
        close_seconds = time.perf_counter() - start
        b, p = storage.batches.c, storage.batch_parts.c
        with service.store.engine.connect() as conn:
            kept = conn.execute(select(func.coalesce(func.sum(b.n_contributions), 0))).scalar_one()
            parts = conn.execute(select(func.count()).select_from(storage.batch_parts)).scalar_one()
            largest = conn.execute(select(func.max(func.length(p.body)))).scalar_one()
        service.store.engine.dispose()
    fragments = int(kept) * FRAGMENTS
    return {
        "contributions": contributions,
        "groups_evaluated": groups,
        "kept": int(kept),
        "fragments": fragments,
        "parts": int(parts),
        "part_fragments": part_fragments,
        "largest_part_bytes": int(largest or 0),
        "fill_seconds": round(fill_seconds, 1),
        "evaluate_shuffle_store_seconds": round(close_seconds, 1),
        "fragments_per_second": round(fragments / close_seconds),
        "peak_rss_mb_after_fill": round(rss_before),
        "peak_rss_mb": round(_peak_rss_mb()),
    }


def _section(result: dict[str, Any], command: str) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in result.items())
    return (
        f"Command: `{command}` ({machine(pinned=False)}).\n\n| measure | value |\n|---|---|\n"
        f"{rows}\n\n`evaluate_shuffle_store_seconds` is the admin close: Algorithm 3's draw, the "
        "whole-group shuffle and signing/storing every part in one transaction. "
        "`peak_rss_mb` is the process's peak (ru_maxrss) over the whole run.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contributions", type=int, default=1_000_000)
    parser.add_argument("--part-fragments", type=int, default=PART_FRAGMENTS)
    parser.add_argument("--write", action="store_true", help="record it in docs/benchmarks.md")
    args = parser.parse_args()
    result = run(args.contributions, args.part_fragments)
    print(json.dumps(result, indent=2))
    if args.write:
        command = "python benchmarks/epoch.py " + " ".join(sys.argv[1:])
        write_section("## Epoch of 10^6 contributions (shuffler)", _section(result, command))


if __name__ == "__main__":
    main()
