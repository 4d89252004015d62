"""On PostgreSQL the big ``bytea`` reads come in the binary format at both parties: the
shuffler's read of a closing group's fragments and of a part body it forwards, the analyzer's
read of a stored part it opens (:data:`runtime.db.BINARY_RESULTS`); the rows are what was
stored, and the estimate is the truth the test knows."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event
from sqlalchemy.engine import Engine

from common.randomness import SeededSource
from common.wire import BatchAck
from tests.analyzer.helpers import CHANNEL, VALUES, build, make_batch
from tests.shuffler.factory import fill, make_service

#: A statement that reads one of the big columns: a group's fragments, a part's body.
BIG_READ = re.compile(r"^SELECT .*\b(contributions\.fragments|\w+\.body)\b", re.DOTALL)


def _reads(engine: Engine) -> list[tuple[str, int]]:
    """The big column each statement reads from now on, with the result format its cursor
    asks for (psycopg: 0 text, 1 binary) as it runs."""
    found: list[tuple[str, int]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _seen(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        read = BIG_READ.match(statement)
        if read:
            found.append((read.group(1), int(cursor.format)))

    return found


def test_the_shuffler_reads_fragments_and_part_bodies_in_binary(
    postgres_url: str, tmp_path: Path
) -> None:
    service, clock = make_service(
        postgres_url, tmp_path, rng=SeededSource(3), analyzer_url="http://analyzer.test/"
    )
    reads = _reads(service.store.engine)
    fill(service, clock.epoch, 40)
    service.close("homepage", clock.epoch)
    posted: list[dict[str, Any]] = []

    def analyzer(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        ack = BatchAck(batch_id=posted[-1]["batch_id"], part=posted[-1]["part"], duplicate=False)
        return httpx.Response(201, content=ack.model_dump_json())

    with httpx.Client(transport=httpx.MockTransport(analyzer)) as client:
        assert service.forward_due(client)["forwarded"] == 1
    kept = posted[0]["n_contributions"]
    assert sum(len(part["fragments"]) for part in posted) == 2 * kept > 0  # 2 per contribution
    assert {column for column, _ in reads} == {"contributions.fragments", "part_bodies.body"}
    assert {fmt for _, fmt in reads} == {1}


def test_the_analyzer_reads_a_stored_part_in_binary(postgres_url: str) -> None:
    layers = build(postgres_url)
    reads = _reads(layers.store.engine)
    layers.intake.accept(*make_batch(VALUES))
    assert layers.opener.open_pending() == 1
    estimate = layers.releases.release(CHANNEL.id, 7, 7).estimate
    assert estimate.n == len(VALUES)
    assert {column for column, _ in reads} == {"batch_parts.body"}
    assert {fmt for _, fmt in reads} == {1}
