"""The tokens a tool presents at each party of a deployment (services/tools/credentials.py):
each party's own admin and metrics tokens by the URL it is reached at, read from either key
folder layout (``esa up``'s ``<party>/admin-token``, a compose loadgen's
``<party>-admin-token``), or one token for every party (``--admin-token``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import launcher
from services.tools.credentials import ADMIN, METRICS, Credentials

ANALYZER, FIRST, SECOND = "http://analyzer:8000", "http://s1:8001", "http://s2:8002"
PARTIES = {"analyzer": ANALYZER, "shuffler-1": FIRST, "shuffler-2": SECOND}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_files_are_the_ones_esa_up_writes() -> None:
    assert (ADMIN, METRICS) == (launcher.ADMIN_TOKEN_FILE, launcher.METRICS_TOKEN_FILE)


def test_each_party_gets_its_own_tokens_from_esa_ups_folders(tmp_path: Path) -> None:
    _write(tmp_path / "analyzer" / ADMIN, "analyzer-admin\n")  # the analyzer has no metrics
    for party in ("shuffler-1", "shuffler-2"):
        _write(tmp_path / party / ADMIN, f"{party}-admin\n")
        _write(tmp_path / party / METRICS, f"  {party}-metrics  \n")
    _write(tmp_path / "shuffler-1" / launcher.TOKEN_SECRET_FILE, "never-presented")
    tokens = Credentials.from_keys(tmp_path, PARTIES)
    assert tokens.admin_headers(FIRST) == _bearer("shuffler-1-admin")
    assert tokens.admin_headers(SECOND) == _bearer("shuffler-2-admin")
    assert tokens.metrics_headers(FIRST) == _bearer("shuffler-1-metrics")  # stripped
    assert tokens.metrics_headers(SECOND) == _bearer("shuffler-2-metrics")
    assert tokens.admin_headers(ANALYZER) == _bearer("analyzer-admin")
    # No metrics token of its own: the analyzer's /metrics is read with its admin token.
    assert tokens.metrics_headers(ANALYZER) == _bearer("analyzer-admin")
    # A URL that is no party's: no token at all (never another party's).
    assert tokens.admin_headers("http://elsewhere") == tokens.metrics_headers("http://x") == {}
    assert "never-presented" not in repr(tokens)


def test_a_compose_secrets_folder_of_flat_files_reads_alike(tmp_path: Path) -> None:
    _write(tmp_path / "analyzer-admin-token", "a\n")
    _write(tmp_path / "shuffler-1-admin-token", "s1\n")
    _write(tmp_path / "shuffler-1-metrics-token", "s1m\n")
    _write(tmp_path / "shuffler-2-admin-token", "s2\n")  # no metrics token: its admin one
    tokens = Credentials.from_keys(tmp_path, PARTIES)
    assert tokens.admin == {ANALYZER: "a", FIRST: "s1", SECOND: "s2"}
    assert tokens.metrics == {FIRST: "s1m"}
    assert tokens.metrics_headers(FIRST) == _bearer("s1m")
    assert tokens.metrics_headers(SECOND) == _bearer("s2")
    # Both layouts at once: the party's own folder first.
    _write(tmp_path / "shuffler-2" / ADMIN, "s2-folder\n")
    assert Credentials.from_keys(tmp_path, PARTIES).admin[SECOND] == "s2-folder"


def test_one_token_serves_every_party_and_fills_in_where_a_party_has_none(
    tmp_path: Path,
) -> None:
    shared = Credentials.shared("development")
    for url in (ANALYZER, FIRST, "http://anything"):
        assert shared.admin_headers(url) == shared.metrics_headers(url) == _bearer("development")
    assert shared.for_parties(PARTIES) is shared  # no folder: nothing to read
    _write(tmp_path / "shuffler-1" / ADMIN, "own\n")
    mixed = Credentials.from_keys(tmp_path, PARTIES, default="fallback")
    assert mixed.admin_headers(FIRST) == mixed.metrics_headers(FIRST) == _bearer("own")
    assert mixed.admin_headers(SECOND) == mixed.metrics_headers(SECOND) == _bearer("fallback")
    # A folder that holds nothing (or does not exist): no token, not an error.
    assert Credentials.from_keys(tmp_path / "missing", PARTIES).admin_headers(FIRST) == {}


def test_a_folder_is_read_once_the_parties_urls_are_known(tmp_path: Path) -> None:
    """``esa demo --keys`` / ``esa loadtest --keys`` know the folder before the config names
    the shufflers' URLs: :meth:`for_parties` reads it then, and keeps the folder."""
    _write(tmp_path / "shuffler-2" / ADMIN, "s2\n")
    _write(tmp_path / "shuffler-2" / METRICS, "s2m\n")
    pending = Credentials(folder=tmp_path)
    assert pending.admin_headers(SECOND) == {}  # nothing read yet
    # shuffler-1 has no admin token there: named before anything is sent to anyone.
    with pytest.raises(ValueError, match=r"no admin token for shuffler-1 in .*admin-token"):
        pending.for_parties(PARTIES)
    assert pending.for_parties({"shuffler-2": SECOND}).admin_headers(SECOND) == _bearer("s2")
    # A token given for all fills in for it (the analyzer needs none to be read).
    tokens = Credentials(folder=tmp_path, default="all").for_parties(PARTIES)
    assert tokens.admin_headers(FIRST) == _bearer("all")
    _write(tmp_path / "shuffler-1" / ADMIN, "s1\n")
    tokens = pending.for_parties(PARTIES)
    assert tokens.folder == tmp_path and tokens.default is None
    assert tokens.admin_headers(SECOND) == _bearer("s2")
    assert tokens.metrics_headers(SECOND) == _bearer("s2m")
    assert tokens.admin_headers(FIRST) == _bearer("s1")
    assert tokens.admin_headers(ANALYZER) == {}
    # A replica's own URL is no party's: the tokens follow the URLs they are given for.
    moved = tokens.for_parties({"shuffler-2": "http://replica:9"})
    assert moved.admin_headers("http://replica:9") == _bearer("s2")
    assert moved.admin_headers(SECOND) == {}
