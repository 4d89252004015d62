"""On SQLite the replay and quota checks are held in memory by the one writing process
(shuffler/uniqueness.py, migration 0007): they must refuse exactly what the unique indexes
refused, across a restart and a migration, and a second writer of the file must be stopped."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import inspect
from sqlalchemy.exc import OperationalError

from common.envelope import new_nonce
from runtime import db
from services.cli import launcher
from shuffler import store_backends
from shuffler.app import create_app
from shuffler.records import Conflict
from shuffler.settings import ShufflerSettings
from shuffler.store_backends import SqliteContributionStore, make_store
from shuffler.uniqueness import HeldKeys, Key, SecondWriterError, lock_path

from ..support import free_port
from .factory import POLICY, fill, make_service, migrations_on, pending


def test_held_keys_refuse_a_replayed_nonce_and_a_second_contribution_in_and_across_batches() -> (
    None
):
    held = HeldKeys()
    n1, n2, n3 = b"1" * 16, b"2" * 16, b"3" * 16
    batch = [Key("c", 7, "a", n1), Key("c", 7, "b", n1), Key("c", 7, "a", n2), Key("c", 8, "a", n2)]
    fresh, replayed = held.sort(batch)
    assert fresh == [0, 3] and replayed == {n1}  # index 2: client a's second in epoch 7
    held.add(batch[i] for i in fresh)
    fresh, replayed = held.sort([Key("d", 7, "z", n2), Key("c", 7, "a", n3), Key("c", 9, "a", n3)])
    assert fresh == [2] and replayed == {n2}
    assert len(held) == 2


def test_the_keys_of_closed_epochs_are_dropped_and_only_theirs() -> None:
    held = HeldKeys()
    held.add(
        [Key("c", 7, "a", b"1" * 16), Key("c", 8, "a", b"2" * 16), Key("d", 7, "a", b"3" * 16)]
    )
    held.forget_closed({"c": 7})
    assert len(held) == 2
    assert held.sort([Key("c", 7, "a", b"1" * 16)]) == ([0], set())  # the closed epoch's keys
    assert held.sort([Key("c", 8, "a", b"4" * 16)]) == ([], set())  # still over quota
    assert held.sort([Key("x", 1, "q", b"3" * 16)]) == ([], {b"3" * 16})  # still a replay


def test_a_restarted_sqlite_shuffler_refuses_what_it_stored_before(tmp_path: Path) -> None:
    """The held keys are read back from the table: a replay of a stored nonce and a second
    contribution of a client are 409s after a restart as before it, and the close forgets
    what only a closed epoch held."""
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    service, clock = make_service(url, tmp_path)
    client, nonce = service.tokens.issue(), new_nonce()
    assert isinstance(
        service.store.insert([pending(service, client, clock.epoch, nonce=nonce)])[0], str
    )
    service.store.close()
    again, clock = make_service(url, tmp_path)
    other = again.tokens.issue()
    landings = again.store.insert(
        [
            pending(again, other, clock.epoch, nonce=nonce),
            pending(again, client, clock.epoch),
            pending(again, other, clock.epoch),
        ]
    )
    assert landings[:2] == [Conflict.REPLAYED_NONCE, Conflict.OVER_QUOTA]
    assert isinstance(landings[2], str)
    again.store.close_epoch(POLICY.id, clock.epoch, clock.now)
    clock.now += POLICY.epoch_seconds
    later = again.store.insert([pending(again, client, clock.epoch, nonce=nonce)])
    assert isinstance(later[0], str)  # the closed epoch's nonce is no longer held
    again.store.close()


def test_a_second_writer_of_one_sqlite_file_is_refused_until_the_first_lets_go(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    first, clock = make_service(url, tmp_path)
    second = make_store(db.make_engine(url))
    first.store.start_writing()
    with pytest.raises(SecondWriterError, match="another shuffler process writes"):
        second.start_writing()
    with pytest.raises(SecondWriterError):
        second.insert([pending(first, first.tokens.issue(), clock.epoch)])
    first.store.close()
    landing = second.insert([pending(first, first.tokens.issue(), clock.epoch)])
    assert isinstance(landing[0], str)
    second.close()


def test_migration_0007_keeps_the_rows_and_drops_only_the_two_random_keyed_indexes(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    service, clock = make_service(url, tmp_path)
    client, nonce = service.tokens.issue(), new_nonce()
    stored = service.store.insert([pending(service, client, clock.epoch, nonce=nonce)])
    service.store.close()
    engine = db.make_engine(url)
    with engine.begin() as conn:
        config = migrations_on(conn)
        command.downgrade(config, "0006")
        conn.exec_driver_sql("UPDATE contributions SET held_part = 3")
        rows = conn.exec_driver_sql("SELECT id, held_part, receipt FROM contributions").all()
        conn.exec_driver_sql("CREATE TABLE contributions_0007 (x)")  # an attempt's leftover
        before = {
            u["name"] or str(u["column_names"])
            for u in inspect(conn).get_unique_constraints("contributions")
        }
        command.upgrade(config, "head")
        after = {
            str(u["column_names"]) for u in inspect(conn).get_unique_constraints("contributions")
        }
        indexes = {i["name"] for i in inspect(conn).get_indexes("contributions")}
        kept = conn.exec_driver_sql("SELECT id, held_part, receipt FROM contributions").all()
        conn.exec_driver_sql("UPDATE contributions SET held_part = NULL")  # pending again
    engine.dispose()
    assert before == {"uq_contribution_quota", "['nonce']", "['receipt']"}
    assert after == {"['receipt']"} and indexes == {"ix_contributions_group"}
    assert kept == rows and len(rows) == 1
    again, _ = make_service(url, tmp_path)
    assert again.ledger()["pending"] == 1
    replay = again.store.insert([pending(again, again.tokens.issue(), clock.epoch, nonce=nonce)])
    assert replay == [Conflict.REPLAYED_NONCE] and isinstance(stored[0], str)
    again.store.close()


@pytest.mark.system
def test_a_second_shuffler_server_on_the_same_sqlite_file_stops_at_its_start(
    tmp_path: Path,
) -> None:
    """A real ``esa shuffler serve`` whose SQLite file another process writes exits before it
    answers anything or migrates the file, saying why (it would otherwise break the replay and
    quota checks)."""
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    holder, _ = make_service(url, tmp_path)
    holder.store.start_writing()
    with holder.store.engine.begin() as conn:
        config = migrations_on(conn)
        command.downgrade(config, "0006")  # as if the holder ran an older release
    port = free_port()
    spec = launcher.shuffler_spec(tmp_path, 1, port, "", url)
    env = {
        **os.environ,
        **spec.env,
        "ESA_SHUFFLER_KEY_DIR": str(tmp_path / "keys2"),
        "ESA_SHUFFLER_CHANNELS": json.dumps([POLICY.model_dump()]),
        "ESA_SHUFFLER_CHANNELS_FILE": "",
    }
    env = {k: v for k, v in env.items() if v != ""}
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "shuffler", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode != 0
    assert "another shuffler process writes contributions to" in run.stderr + run.stdout
    with sqlite3.connect(tmp_path / "shuffler.db") as file:
        assert file.execute("SELECT version_num FROM alembic_version_shuffler").fetchall() == [
            ("0006",)
        ]
    holder.store.close()


@pytest.mark.system
def test_the_writer_lock_is_a_file_of_its_own_and_letting_go_keeps_sqlite_s_locks(
    tmp_path: Path,
) -> None:
    """Closing a descriptor of the database file would drop the POSIX locks SQLite holds on
    it in this process: another process closing its connection would then take itself for
    the last one, checkpoint and delete the write-ahead log, and this process's next commit
    would go to a deleted file. The lock lives beside the database instead."""
    database = tmp_path / "shuffler.db"
    service, clock = make_service(f"sqlite:///{database}", tmp_path)
    service.store.start_writing()
    assert Path(lock_path(str(database))) == database.with_name("shuffler.db-writer")
    fill(service, clock.epoch, 1)
    with service.store.engine.connect() as held:  # a connection of this process stays open
        held.exec_driver_sql("SELECT count(*) FROM contributions").all()
        service.store.close()  # lets go of the writer lock
        subprocess.run([sys.executable, "-c", OPEN_AND_CLOSE, str(database)], check=True)
        held.exec_driver_sql("UPDATE contributions SET n_fragments = 99")
        held.commit()
        read = [sys.executable, "-c", READ_BACK, str(database)]  # while this process is open
        seen = subprocess.run(read, check=True, capture_output=True, text=True).stdout
    service.store.engine.dispose()
    assert seen.strip() == "[(99,)]"


#: Another process reading what this one committed.
READ_BACK = (
    "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
    "print(c.execute('SELECT n_fragments FROM contributions').fetchall()); c.close()"
)
#: Another process opening the database and closing it again (a backup, an audit, sqlite3).
OPEN_AND_CLOSE = (
    "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
    "c.execute('SELECT count(*) FROM contributions').fetchall(); c.close()"
)


def test_closing_an_epoch_drops_its_keys_at_once(tmp_path: Path) -> None:
    """Not only at the next insert of the same channel: a channel that goes quiet after its
    close keeps no keys in memory."""
    service, clock = make_service(f"sqlite:///{tmp_path / 'shuffler.db'}", tmp_path)
    fill(service, clock.epoch, 3)
    store = service.store
    assert isinstance(store, SqliteContributionStore)
    held = store._held  # the store's memory of keys, looked at directly
    assert held is not None and len(held) == 3
    service.store.close_epoch(POLICY.id, clock.epoch, clock.now)
    assert len(held) == 0
    service.store.close()


def test_a_downgrade_below_0007_refuses_while_a_nonce_is_stored_twice(tmp_path: Path) -> None:
    """Since 0007 a client may reuse its nonce in a later epoch; 0006's unique index could
    not hold both rows, so the downgrade stops and keeps them."""
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    service, clock = make_service(url, tmp_path)
    client, nonce = service.tokens.issue(), new_nonce()
    assert isinstance(
        service.store.insert([pending(service, client, clock.epoch, nonce=nonce)])[0], str
    )
    service.store.close_epoch(POLICY.id, clock.epoch, clock.now)
    clock.now += POLICY.epoch_seconds
    assert isinstance(
        service.store.insert([pending(service, client, clock.epoch, nonce=nonce)])[0], str
    )
    service.store.close()
    engine = db.make_engine(url)
    refused = pytest.raises(RuntimeError, match="1 nonces are stored more than once")
    with refused, engine.begin() as conn:
        command.downgrade(migrations_on(conn), "0006")
    with engine.connect() as conn:
        version = conn.exec_driver_sql("SELECT version_num FROM alembic_version_shuffler").all()
        rows = conn.exec_driver_sql("SELECT count(*) FROM contributions").all()
    engine.dispose()
    assert version == [("0007",)] and rows == [(2,)]


def test_a_shuffler_app_that_fails_to_start_lets_go_of_its_file(tmp_path: Path) -> None:
    """A start that fails after the app claimed its file (here: its descriptor cannot be
    published, the directory being a file) leaves no lock behind in a process that goes on."""
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    (tmp_path / "not-a-directory").write_text("")
    keys = tmp_path / "app-keys"
    broken = ShufflerSettings(
        database_url=url, key_dir=keys, channels=[POLICY], publish_dir=tmp_path / "not-a-directory"
    )
    with pytest.raises(OSError), TestClient(create_app(broken)):
        pass
    settings = ShufflerSettings(database_url=url, key_dir=keys, channels=[POLICY])
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200


def test_a_failed_group_commit_stores_nothing_holds_no_key_and_the_next_one_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group commit runs on the writer's own connection: a transaction that fails before
    its write (another process holds the write lock) or after it (the row count comes back
    wrong: the one failure after a write that cannot be caused from outside, hence patched)
    is rolled back and raised as SQLAlchemy's error; its keys are not held, so the same
    contribution lands on the next try, on the same connection."""
    path = tmp_path / "shuffler.db"
    service, clock = make_service(f"sqlite:///{path}", tmp_path)
    service.store.close()  # let go of the file for a store that waits 0.2 s for the lock
    store = make_store(db.make_engine(f"sqlite:///{path}", busy_timeout=0.2))
    batch = [pending(service, service.tokens.issue(), clock.epoch)]
    blocker = sqlite3.connect(path)
    blocker.execute("BEGIN EXCLUSIVE")
    with pytest.raises(OperationalError, match="database is locked"):
        store.insert(batch)
    blocker.rollback()
    blocker.close()
    real = store_backends._insert_rows
    monkeypatch.setattr(store_backends, "_insert_rows", lambda *args: real(*args) - 1)
    with pytest.raises(OperationalError, match="a receipt collided"):
        store.insert(batch)
    monkeypatch.undo()
    assert _stored(path) == 0
    assert isinstance(store.insert(batch)[0], str)  # neither a replay nor over the quota
    assert store.insert(batch) == [Conflict.REPLAYED_NONCE]
    assert _stored(path) == 1
    store.close()


def _stored(path: Path) -> int:
    """Contributions in the file, read by a connection of its own."""
    with contextlib.closing(sqlite3.connect(path)) as reader:
        return int(reader.execute("SELECT count(*) FROM contributions").fetchone()[0])
