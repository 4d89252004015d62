"""The fragment ledger (``esa_analyzer_ledger_fragments{channel, state}``): read from the
database, so it is the same at every analyzer worker and equals the sum of every worker's
``esa_analyzer_fragments_opened_total`` / ``..._invalid_total`` (what ``esa loadtest`` needs to
verify conservation whichever worker answers its scrape).

* In-process, both backends: fragments that do not decrypt (invalid, not opened) and fragments
  that decrypt but do not parse (opened and invalid) are told apart, as the counters do; parts
  waiting to be opened count nowhere; a channel with nothing yet reads 0; the gauge is in the
  Prometheus text.
* Migration 0006: a part opened before it counts ``n_fragments - invalid``; downgrade works.
* Real processes: one analyzer on PostgreSQL, then two sharing the database, each opening its
  own share: both scrapes show the same ledger, the sum of both processes' counters.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import secrets
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest
from alembic import command
from alembic.config import Config
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import text

from analyzer.metrics import EventsCollector
from analyzer.service import MIGRATIONS
from analyzer.store import AnalyzerStore
from common.envelope import (
    FragmentContext,
    load_or_create_x25519,
    seal_fragment,
)
from common.mechanisms import krappor
from common.randomness import SeededSource
from common.wire import Batch, b64
from runtime import db

from ..support import ServiceProcess, analyzer_process, unopened_parts, wait_until
from .helpers import (
    ANALYZER_KEY,
    CHANNEL,
    SHUFFLERS,
    VALUES,
    Signed,
    build,
    post,
    seeded_entry,
    signed,
)

OTHER = CHANNEL.model_copy(update={"id": "settings-page"})
_SAMPLE = re.compile(r"^(esa_analyzer_[a-z_]+)(\{[^}]*\})? (\S+)$", re.MULTILINE)


def _batch(
    values: npt.NDArray[np.int64],
    analyzer: X25519PublicKey,
    undecryptable: int = 0,
    unparsable: int = 0,
    seed: int = 0,
    epoch: int = 7,
) -> tuple[Signed, int]:
    """A signed batch of k-RAPPOR reports of ``values`` for ``epoch``, plus random bytes (do
    not decrypt) and sealed junk (decrypts, does not parse); with its fragments that decrypt."""
    params = krappor.KRapporParams(**CHANNEL.params)
    rng = SeededSource(seed)
    context = FragmentContext(CHANNEL.id, epoch, "")
    sealed = [
        seal_fragment(f, context, 16, analyzer)
        for v in values
        for f in krappor.KRappor().encode_value(params, int(v), rng)
    ]
    sealed += [seal_fragment(b"\xff junk", context, 16, analyzer) for _ in range(unparsable)]
    opened = len(sealed)
    sealed += [secrets.token_bytes(len(sealed[0])) for _ in range(undecryptable)]
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=len(values),
        fragments=[b64(f) for f in sealed],
    )
    return signed(batch), opened


def test_the_ledger_is_what_the_opener_counted(database_url: str) -> None:
    layers = build(database_url, (CHANNEL, OTHER))
    channels = [CHANNEL.id, OTHER.id]
    assert layers.store.fragment_ledger(channels) == {c: (0, 0) for c in channels}
    first, opened = _batch(VALUES[:300], ANALYZER_KEY.public_key(), 7, 5, seed=1)
    layers.deliver(*first)
    second, more = _batch(VALUES[300:], ANALYZER_KEY.public_key(), 3, 0, seed=2, epoch=8)
    layers.deliver(*second)
    waiting, _ = _batch(VALUES[:100], ANALYZER_KEY.public_key(), 2, 2, seed=3, epoch=9)
    layers.intake.accept(*waiting)  # stored, not opened: counts nowhere
    assert layers.store.unopened_parts() == 1
    found = layers.store.fragment_ledger(channels)
    counted = (layers.events.get("fragments_opened"), layers.events.get("fragments_invalid"))
    assert found[CHANNEL.id] == counted == (opened + more, 7 + 5 + 3)
    assert found[OTHER.id] == (0, 0)
    # Only configured channels become labels; an unknown id asked for reads 0.
    assert layers.store.fragment_ledger([OTHER.id]) == {OTHER.id: (0, 0)}
    registry = CollectorRegistry(auto_describe=True)
    ledger = functools.partial(layers.store.fragment_ledger, channels)
    registry.register(EventsCollector(layers.events, layers.store.unopened_parts, ledger))
    samples = _samples(generate_latest(registry).decode())
    assert samples[f'esa_analyzer_ledger_fragments{{channel="{CHANNEL.id}",state="opened"}}'] == (
        opened + more
    )
    assert samples[f'esa_analyzer_ledger_fragments{{channel="{CHANNEL.id}",state="invalid"}}'] == 15
    assert samples[f'esa_analyzer_ledger_fragments{{channel="{OTHER.id}",state="opened"}}'] == 0
    assert samples["esa_analyzer_fragments_opened_total"] == opened + more


def test_migration_0006_counts_parts_opened_before_it(database_url: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    engine = db.make_engine(database_url)
    columns = (
        "batch_id, part, parts, shuffler_id, channel_id, crowd_id, epoch, n_contributions,"
        " n_fragments, body, status, attempts, invalid, received_at"
    )
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "0005")
            for batch_id, status in (("a" * 32, "opened"), ("b" * 32, "stored")):
                conn.execute(
                    text(
                        f"INSERT INTO batch_parts ({columns}) VALUES (:b, 0, 1, 'shuffler-1',"
                        " 'homepage', '', 7, 50, 10, NULL, :status, 0, 3, 1.0)"
                    ),
                    {"b": batch_id, "status": status},
                )
            command.upgrade(config, "head")
        found = AnalyzerStore(engine).fragment_ledger([CHANNEL.id])
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0005")
            left = conn.execute(text("SELECT count(*) FROM batch_parts")).scalar_one()
    finally:
        engine.dispose()
    assert found == {CHANNEL.id: (7, 3)}  # n_fragments - invalid; the stored part not at all
    assert left == 2


def _samples(exposition: str) -> dict[str, float]:
    return {m[1] + (m[2] or ""): float(m[3]) for m in _SAMPLE.finditer(exposition)}


def _scrape(url: str) -> dict[str, float]:
    return _samples(httpx.get(url + "/metrics", timeout=30).raise_for_status().text)


def _ledger(samples: dict[str, float]) -> tuple[float, float]:
    key = 'esa_analyzer_ledger_fragments{{channel="{}",state="{}"}}'
    return samples[key.format(CHANNEL.id, "opened")], samples[key.format(CHANNEL.id, "invalid")]


def _counters(samples: dict[str, float]) -> tuple[float, float]:
    return (
        samples["esa_analyzer_fragments_opened_total"],
        samples["esa_analyzer_fragments_invalid_total"],
    )


def _deliver(url: str, batch: Signed) -> None:
    """POST one part to one worker and wait until it is opened (by that worker: the other
    polls only every 10 minutes)."""
    response = post(url, batch)
    assert response.status_code == 201, response.text
    wait_until(lambda: unopened_parts(url) == 0, timeout=60)


def _worker(tmp: Path, database_url: str, name: str) -> ServiceProcess:
    registry = [seeded_entry("shuffler-1", SHUFFLERS["shuffler-1"])]
    process = analyzer_process(
        tmp,
        [CHANNEL.model_dump()],
        registry,
        database_url,
        opening_processes="1",
        opening_poll_seconds="600",
    )
    return dataclasses.replace(process, log_path=tmp / f"{name}.log")


@pytest.mark.system
def test_two_analyzer_processes_report_one_ledger(postgres_url: str, tmp_path: Path) -> None:
    engine = db.make_engine(postgres_url)
    db.upgrade(engine, MIGRATIONS)  # as esa up does before starting several workers
    engine.dispose()
    key = load_or_create_x25519(tmp_path / "analyzer" / "keys" / "hpke.pem").public_key()
    batches = [_batch(VALUES[i::3], key, i + 1, 2 * i, seed=i, epoch=7 + i) for i in range(3)]
    first = _worker(tmp_path, postgres_url, "w1").start()
    second: ServiceProcess | None = None
    try:
        _deliver(first.url, batches[0][0])
        alone = _scrape(first.url)
        assert _ledger(alone) == _counters(alone) == (batches[0][1], 1)
        second = _worker(tmp_path, postgres_url, "w2").start()
        _deliver(second.url, batches[1][0])
        _deliver(first.url, batches[2][0])
        one, two = _scrape(first.url), _scrape(second.url)
    finally:
        for process in (second, first):
            if process is not None:
                process.stop()
    total = (sum(n for _, n in batches), (1 + 2 + 3) + (0 + 2 + 4))
    shares = [_counters(one), _counters(two)]
    assert all(share[0] > 0 for share in shares)  # each worker opened a share
    assert tuple(map(sum, zip(*shares, strict=True))) == total
    assert _ledger(one) == _ledger(two) == total  # whichever worker a scrape reaches
