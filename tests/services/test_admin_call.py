"""The CLI's one admin call (services.cli.admin.call), which ``esa admin``, ``esa channel`` and
``esa keys`` share: the method and the party's own token reach a real HTTP server, and a
refusal is a ClickException naming the party's error code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import click
import pytest
from click.testing import CliRunner

from services.cli.admin import call
from services.cli.keys import keys

from ..support import QuietHandler, handler_served

LISTING = {
    "party": "shuffler/shuffler-1",
    "keys": [
        {
            "kind": "hpke",
            "key_id": "ab" * 8,
            "public_key": "",
            "state": "active",
            "published": True,
            "created_at": 0.0,
            "activates_at": 0.0,
            "retires_at": None,
        }
    ],
    "successions": [],
}


@contextmanager
def party() -> Iterator[tuple[str, list[tuple[str, str, str, bytes]]]]:
    """A server answering the key listing at ``/v1/admin/keys`` and 409 ``rotation_pending``
    elsewhere; every request as (method, path, Authorization, body)."""
    seen: list[tuple[str, str, str, bytes]] = []

    class Handler(QuietHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            seen.append((self.command, self.path, self.headers.get("Authorization", ""), body))
            status, answer = (
                (200, LISTING)
                if self.path == "/v1/admin/keys"
                else (409, {"error": "rotation_pending", "detail": "wait"})
            )
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(answer).encode())

        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

    with handler_served(Handler) as url:
        yield url, seen


def test_the_method_and_token_reach_the_party_and_a_refusal_names_its_code() -> None:
    with party() as (url, seen):
        assert call(url, "/v1/admin/keys", "secret", method="GET") == LISTING
        assert call(url + "/", "/v1/admin/keys", None) == LISTING
        with pytest.raises(click.ClickException, match=r"409.*rotation_pending"):
            call(url, "/v1/admin/keys/rotate", "secret", {"key": "hpke"})
    assert seen == [
        ("GET", "/v1/admin/keys", "Bearer secret", b""),
        ("GET", "/v1/admin/keys", "", b""),
        ("POST", "/v1/admin/keys/rotate", "Bearer secret", b'{"key":"hpke"}'),
    ]


def test_esa_keys_uses_it() -> None:
    with party() as (url, seen):
        listed = CliRunner().invoke(keys, ["list", url, "--admin-token", "secret"])
        refused = CliRunner().invoke(
            keys, ["rotate", url, "--key", "signing", "--admin-token", "secret"]
        )
    assert listed.exit_code == 0, listed.output
    assert "shuffler/shuffler-1" in listed.output and "ab" * 8 in listed.output
    assert refused.exit_code == 1 and "rotation_pending" in refused.output
    assert [(method, path) for method, path, *_ in seen] == [
        ("GET", "/v1/admin/keys"),
        ("POST", "/v1/admin/keys/rotate"),
    ]
