"""The cost of counting each sealed fragment once: the analyzer's record (:mod:`analyzer.seen`).

``.venv/bin/python benchmarks/seen_fragments.py [--keys 8400000] [--postgres URL]``: an
epoch's seal keys (16 random bytes each: what :func:`common.envelope.seal_key` takes from a
fresh HPKE ``enc``) recorded as the analyzer's fold does, one transaction per part of
``PART_FRAGMENTS`` keys (:meth:`analyzer.seen.SeenRecord.check` in the transaction,
:meth:`~analyzer.seen.SeenRecord.commit` after it), into a migrated database (SQLite by
default, WAL, the analyzer's engine). Then a second process's view: the whole epoch reloaded
from its rows and one more part checked (a worker that folded none of it, or a restart).
Printed: wall and CPU seconds in total and per part (first and last tenth), keys/s, the
reload, the database (and WAL) bytes at the end and this process's peak RSS: 10^6 k-RAPPOR
contributions at k = 64, ε = 2 carry ~8.4·10^6 fragments.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Engine

from analyzer.seen import SeenRecord
from analyzer.service import MIGRATIONS
from common.wire import PART_FRAGMENTS
from runtime import db

GROUP = ("homepage", 1)


def _fold(engine: Engine, record: SeenRecord, keys: list[bytes]) -> tuple[float, float]:
    """One part recorded as a fold does; (wall, CPU) seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    with engine.begin() as conn:
        repeated, staged = record.check(conn, GROUP, keys)
    record.commit(staged)
    assert repeated == []
    return time.perf_counter() - wall, time.process_time() - cpu


def run(keys: int, url: str) -> dict[str, object]:
    """Record ``keys`` fresh seal keys part by part; the numbers."""
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    parts = -(-keys // PART_FRAGMENTS)
    record = SeenRecord()
    walls, cpus = [], []
    for i in range(parts):
        batch = [os.urandom(16) for _ in range(min(PART_FRAGMENTS, keys - i * PART_FRAGMENTS))]
        wall, cpu = _fold(engine, record, batch)
        walls.append(wall)
        cpus.append(cpu)
    reload = _fold(engine, SeenRecord(), [os.urandom(16) for _ in range(PART_FRAGMENTS)])
    tenth = max(1, parts // 10)
    found: dict[str, object] = {
        "database": engine.dialect.name,
        "keys": keys,
        "parts": parts,
        "seconds_total_wall": round(sum(walls), 1),
        "seconds_total_cpu": round(sum(cpus), 1),
        "keys_per_second_wall": round(keys / sum(walls)),
        "seconds_per_part_first_tenth": round(sum(walls[:tenth]) / tenth, 3),
        "seconds_per_part_last_tenth": round(sum(walls[-tenth:]) / tenth, 3),
        "reload_and_one_part_seconds_wall": round(reload[0], 2),
        "reload_and_one_part_seconds_cpu": round(reload[1], 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        found["database_bytes"] = sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    engine.dispose()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=8_400_000)
    parser.add_argument("--postgres", help="a fresh PostgreSQL database URL (default: SQLite)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="esa-seen-") as tmp:
        url = args.postgres or f"sqlite:///{tmp}/analyzer.db"
        print(json.dumps(run(args.keys, url), indent=2))


if __name__ == "__main__":
    main()
