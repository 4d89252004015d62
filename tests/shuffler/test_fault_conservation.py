"""Fault test of issue 11 with real processes, SQLite and PostgreSQL: SIGKILL a shuffler while
contributions stream in, restart it, close the epoch, and account for every 202.

Conservation (docs/protocol.md, "Delivery guarantees"): acknowledged = in batches received by the
analyzer (all parts in, each contribution counted once across parts) + removed by randomized
deletion (the ``groups.deleted`` counter) + held; nothing lost, nothing counted twice.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from runtime import db
from shuffler import tables

from ..support import (
    SMALL_CHANNEL,
    UNFOLLOWED,
    ServiceProcess,
    receiver,
    shuffler_process,
    wait_until,
)

pytestmark = pytest.mark.system  # starts real processes

ADMIN = {"Authorization": "Bearer development"}
FRAGMENTS = 2
#: Small parts, so every batch is delivered in several (ESA_SHUFFLER_PART_FRAGMENTS).
PART_FRAGMENTS = 9


def _send_until(service: ServiceProcess, stop: threading.Event, counts: list[int]) -> None:
    """Contributions from fresh clients until ``stop`` or the process dies; ``counts[0]`` is
    how many got a 202, ``counts[1]`` how many got no answer (committed or not: unknown)."""
    config = httpx.get(service.url + "/v1/config").json()
    public = load_x25519_public(base64.b64decode(config["public_key"]))
    epoch = int(time.time() // 3600)
    with httpx.Client(base_url=service.url, timeout=5) as client:
        while not stop.is_set():
            try:
                token = client.post("/v1/enroll").json()["client_token"]
                blob = seal_contribution(
                    Contribution(
                        channel_id="homepage",
                        crowd_id="",
                        epoch=epoch,
                        nonce=new_nonce(),
                        fragments=(bytes(72),) * FRAGMENTS,
                    ),
                    "shuffler-1",
                    public,
                )
                answer = client.post(
                    "/v1/contributions",
                    content=blob,
                    headers={
                        "Authorization": f"Bearer {token}",
                        "Content-Type": "application/octet-stream",
                    },
                )
            except httpx.HTTPError:
                counts[1] += 1  # killed with a request in flight: it may have been committed
                return
            counts[0] += answer.status_code == 202


def _ingest(service: ServiceProcess, seconds: float, kill: bool) -> tuple[int, int]:
    stop, counts = threading.Event(), [0, 0]
    sender = threading.Thread(target=_send_until, args=(service, stop, counts))
    sender.start()
    time.sleep(seconds)
    if kill:
        service.kill()
    stop.set()
    sender.join()
    return counts[0], counts[1]


def _shuffler_counts(database_url: str) -> tuple[int, int, int]:
    """(deleted by Algorithm 3, held, undelivered parts) from the shuffler's database."""
    engine = db.make_engine(database_url)
    g, c, p = tables.groups.c, tables.contributions.c, tables.batch_parts.c
    try:
        with engine.connect() as conn:
            deleted = conn.execute(select(func.coalesce(func.sum(g.deleted), 0))).scalar_one()
            held = conn.execute(select(func.count()).where(c.held_part.is_not(None))).scalar_one()
            waiting = conn.execute(select(func.count()).where(p.status != "forwarded")).scalar_one()
    finally:
        engine.dispose()
    return int(deleted), int(held), int(waiting)


def _received(bodies: list[tuple[bytes, str]]) -> int:
    """Contributions in complete received batches; each (batch, part) counted once."""
    parts: dict[str, dict[int, dict[str, object]]] = defaultdict(dict)
    for body, _ in bodies:
        batch = json.loads(body)
        parts[batch["batch_id"]][batch["part"]] = batch
    total = 0
    for batch in parts.values():
        first = next(iter(batch.values()))
        assert set(batch) == set(range(int(first["parts"])))  # type: ignore[call-overload]
        fragments = sum(len(p["fragments"]) for p in batch.values())  # type: ignore[arg-type]
        assert fragments == FRAGMENTS * int(first["n_contributions"])  # type: ignore[call-overload]
        total += int(first["n_contributions"])  # type: ignore[call-overload]
    return total


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_kill_during_ingest_then_restart_conserves_every_contribution(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    database_url = (
        request.getfixturevalue("postgres_url")
        if backend == "postgresql"
        else f"sqlite:///{tmp_path / 'shuffler-1' / 'db.sqlite'}"
    )
    with receiver() as analyzer:
        service = shuffler_process(
            tmp_path,
            "shuffler-1",
            [SMALL_CHANNEL],
            database_url,
            analyzer_url=analyzer.url,
            **UNFOLLOWED,
            enroll_per_minute="600000",
            part_fragments=str(PART_FRAGMENTS),
        ).start()
        acknowledged, unanswered = _ingest(service, 2.0, kill=True)
        service.start()
        acknowledged += _ingest(service, 1.0, kill=False)[0]
        epoch = int(time.time() // 3600)
        close = httpx.post(
            service.url + "/v1/admin/close",
            json={"channel_id": "homepage", "epoch": epoch},
            headers=ADMIN,
            timeout=30,
        )
        assert close.status_code == 200, close.text
        wait_until(lambda: _shuffler_counts(database_url)[2] == 0)
        service.stop()
    deleted, held, _ = _shuffler_counts(database_url)
    # 0 lost (>=) and 0 counted twice (each part once, fragments = 2 x n per batch); only the
    # request cut off by the kill may or may not have landed.
    accounted = _received(analyzer.bodies) + deleted + held
    assert acknowledged > 0 and acknowledged <= accounted <= acknowledged + unanswered
