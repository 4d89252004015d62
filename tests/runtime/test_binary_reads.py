"""On PostgreSQL the big ``bytea`` reads come in the binary format at both parties: the
shuffler's read of a closing group's fragments and of a part body it forwards, the analyzer's
read of a stored part it opens (:data:`runtime.db.BINARY_RESULTS`). What was read is what was
stored: the forwarded fragments are exactly the contributions' (two known fragments each),
and every fragment of the stored part opens."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event
from sqlalchemy.engine import Engine

from common.randomness import SeededSource
from common.wire import Batch, BatchAck, b64
from tests.analyzer.helpers import CHANNEL, VALUES, build, estimated, make_batch
from tests.shuffler.factory import fill, make_service

#: What a SELECT returns (its column list, up to ``FROM``), and a big column in it: a group's
#: fragments, a part's body (a filter on one, ``body IS NULL``, is not a read of it).
SELECTED = re.compile(r"^SELECT (.*?)\s*\nFROM ", re.DOTALL)
BIG_COLUMN = re.compile(r"\b(contributions\.fragments|\w+\.body)\b")


def _reads(engine: Engine) -> list[tuple[str, int]]:
    """The big column each statement reads from now on, with the result format its cursor
    asks for (psycopg: 0 text, 1 binary) as it runs."""
    found: list[tuple[str, int]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _seen(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        selected = SELECTED.match(statement)
        read = BIG_COLUMN.search(selected.group(1)) if selected else None
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
    forwarded = Counter(f for part in posted for f in part["fragments"])
    assert forwarded == {b64(bytes([0]) * 72): kept, b64(bytes([1]) * 72): kept} and kept > 0
    assert {column for column, _ in reads} == {"contributions.fragments", "part_bodies.body"}
    assert {fmt for _, fmt in reads} == {1}


def test_the_analyzer_reads_a_stored_part_in_binary(postgres_url: str) -> None:
    layers = build(postgres_url)
    reads = _reads(layers.store.engine)
    signed = make_batch(VALUES)
    layers.intake.accept(*signed)
    assert layers.opener.open_pending() == 1
    sent = len(Batch.model_validate_json(signed.body).fragments)
    assert layers.events.get("fragments_opened") == sent  # every one read back opens
    assert layers.events.get("fragments_invalid") == 0
    layers.closer.close_due()  # epoch 7 is long over: it closes with the one batch
    assert layers.releases.release(CHANNEL.id, 7, 7).estimate.n == estimated(VALUES)
    assert {column for column, _ in reads} == {"batch_parts.body"}
    assert {fmt for _, fmt in reads} == {1}
