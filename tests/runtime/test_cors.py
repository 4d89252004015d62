"""The CORS policy itself (runtime/cors.py): which origins a party may name, what a preflight
is answered, and that the grant is added outside the app's error handling (a 500 carries it)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from analyzer.settings import AnalyzerSettings
from runtime.cors import (
    MAX_AGE,
    Cors,
    DeviceRoute,
    install_cors,
    parse_cors_origins,
)
from runtime.http import install_error_handlers
from shuffler.settings import ShufflerSettings

PAGE = "https://app.example.com"
ROUTES = {
    "/send": DeviceRoute(("POST",), ("Authorization", "Content-Type")),
    "/read": DeviceRoute(("GET",)),
}


@pytest.mark.parametrize(
    ("given", "allowed"),
    [
        ("", ""),
        (" , ", ""),
        ("https://app.example.com", PAGE),
        ("HTTPS://App.Example.COM:443", PAGE),  # as a browser sends it: lower case, no port
        (
            "http://127.0.0.1:8000, http://localhost:8000",
            "http://127.0.0.1:8000,http://localhost:8000",
        ),
        ('["https://a.example", "http://b.example:80"]', "https://a.example,http://b.example"),
        ("https://[::1]:8443", "https://[::1]:8443"),
        ("https://xn--bcher-kva.example", "https://xn--bcher-kva.example"),
        ("https://a.example,https://a.example:443", "https://a.example"),  # once
    ],
)
def test_origins_are_normalized_as_browsers_send_them(given: str, allowed: str) -> None:
    assert parse_cors_origins(given) == allowed


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("*", "is refused: name each origin"),
        ("null", "is refused: name each origin"),
        ("https://a.example/", "has a path"),
        ("https://a.example/app", "has a path"),
        ("https://a.example?x=1", "query or fragment"),
        ("https://a.example#top", "query or fragment"),
        ("https://user:pw@a.example", "credentials"),
        ("ftp://a.example", "scheme is not http or https"),
        ("a.example", "scheme is not http or https"),
        ("https://a.example:99999", "is not an origin"),
        ("https://a.example:http", "is not an origin"),
        ("https://bücher.example", "xn-- form"),
        ("https://", "host"),
        ("https://a b.example", "host"),
        ('["https://a.example", 7]', "comma-separated list or a JSON list"),
        ('["https://a.example"', "comma-separated list or a JSON list"),
    ],
)
def test_what_is_not_an_origin_is_refused_naming_the_setting(given: str, problem: str) -> None:
    with pytest.raises(ValueError, match="cors_origins") as refused:
        parse_cors_origins(given)
    assert problem in str(refused.value)


def test_both_parties_take_the_setting_from_their_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ShufflerSettings().allowed_origins == AnalyzerSettings().allowed_origins == ()
    monkeypatch.setenv("ESA_SHUFFLER_CORS_ORIGINS", "https://a.example,http://localhost:8000")
    monkeypatch.setenv("ESA_ANALYZER_CORS_ORIGINS", '["https://a.example"]')
    assert ShufflerSettings().allowed_origins == ("https://a.example", "http://localhost:8000")
    assert AnalyzerSettings().allowed_origins == ("https://a.example",)
    monkeypatch.setenv("ESA_SHUFFLER_CORS_ORIGINS", "*")
    with pytest.raises(ValidationError, match=r"cors_origins: '\*' is refused"):
        ShufflerSettings()
    assert ShufflerSettings(cors_origins=[PAGE]).allowed_origins == (PAGE,)


def test_esa_up_refuses_a_bad_origin_before_doing_anything(tmp_path: Path) -> None:
    from services.cli.servers import up_command

    var = tmp_path / "var"
    answer = CliRunner().invoke(up_command, ["--var", str(var), "--cors-origins", "https://a/b"])
    assert answer.exit_code == 2 and "--cors-origins" in answer.output
    assert "has a path" in answer.output and not var.exists()


def _app(origins: tuple[str, ...] = (PAGE,)) -> FastAPI:
    app = FastAPI()

    @app.post("/send")
    async def send() -> dict[str, str]:
        raise RuntimeError("a bug")

    @app.get("/read")
    async def read() -> dict[str, str]:
        return {"read": "yes"}

    @app.get("/other")
    async def other() -> dict[str, str]:
        return {"other": "yes"}

    install_error_handlers(app, logging.getLogger("test"), lambda _: None)
    install_cors(app, Cors(origins, ROUTES))
    return app


def test_a_granted_preflight_names_the_routes_methods_and_headers() -> None:
    client = TestClient(_app())
    asked = {
        "Origin": PAGE,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    answer = client.options("/send", headers=asked)
    assert answer.status_code == 204 and answer.content == b""
    assert answer.headers["access-control-allow-origin"] == PAGE
    assert answer.headers["access-control-allow-methods"] == "POST"
    assert answer.headers["access-control-allow-headers"] == "Authorization, Content-Type"
    assert answer.headers["access-control-max-age"] == str(MAX_AGE)
    assert answer.headers["vary"] == "Origin"
    plain = client.options(
        "/read", headers={"Origin": PAGE, "Access-Control-Request-Method": "GET"}
    )
    assert plain.status_code == 204 and "access-control-allow-headers" not in plain.headers


@pytest.mark.parametrize(
    ("path", "headers", "code"),
    [
        ("/other", {"Origin": PAGE, "Access-Control-Request-Method": "GET"}, "cors_route_refused"),
        ("/nowhere", {"Access-Control-Request-Method": "GET"}, "cors_route_refused"),
        ("/send", {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
         "cors_origin_refused"),
        ("/send", {"Access-Control-Request-Method": "POST"}, "cors_origin_refused"),
        ("/send", {"Origin": PAGE}, "cors_method_refused"),
        ("/send", {"Origin": PAGE, "Access-Control-Request-Method": "PUT"}, "cors_method_refused"),
        ("/read", {"Origin": PAGE, "Access-Control-Request-Method": "GET",
                   "Access-Control-Request-Headers": "authorization"}, "cors_headers_refused"),
        ("/send", {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "content-type,x-extra"},
         "cors_headers_refused"),
    ],
)  # fmt: skip
def test_every_other_preflight_is_a_json_403(path: str, headers: dict[str, str], code: str) -> None:
    answer = TestClient(_app()).options(path, headers=headers)
    assert answer.status_code == 403 and answer.headers["content-type"] == "application/json"
    assert answer.json()["error"] == code and answer.json()["detail"]
    assert not any(name.startswith("access-control-") for name in answer.headers)


def test_only_device_routes_carry_the_grant_even_on_a_500() -> None:
    """The grant is added outside the app's error handling: a page sees the JSON 500 of a
    bug; a route that is not a device's never answers with a CORS header."""
    client = TestClient(_app(), raise_server_exceptions=False)
    failed = client.post("/send", headers={"Origin": PAGE})
    assert failed.status_code == 500 and failed.json()["error"] == "internal"
    assert failed.headers["access-control-allow-origin"] == PAGE
    assert failed.headers["access-control-expose-headers"] == "Retry-After"
    read = client.get("/read", headers={"Origin": PAGE})
    assert read.headers["access-control-allow-origin"] == PAGE and read.json() == {"read": "yes"}
    other = client.get("/other", headers={"Origin": PAGE})
    assert other.status_code == 200 and not any(n.startswith("access-") for n in other.headers)
    assert "vary" not in other.headers
    stranger = client.get("/read", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in stranger.headers
    assert stranger.headers["vary"] == "Origin"  # a cache keeps the two answers apart


def test_with_no_origin_allowed_nothing_is_granted_and_a_plain_options_is_the_apps() -> None:
    client = TestClient(_app(origins=()))
    read = client.get("/read", headers={"Origin": PAGE})
    assert read.status_code == 200 and not any(n.startswith("access-") for n in read.headers)
    assert "vary" not in read.headers
    asked = {"Origin": PAGE, "Access-Control-Request-Method": "GET"}
    assert client.options("/read", headers=asked).json()["error"] == "cors_origin_refused"
    plain = client.options("/other")  # no preflight: the app's own 405
    assert plain.status_code == 405 and plain.json()["error"] == "method_not_allowed"


def test_a_repeated_origin_is_no_origin() -> None:
    client = TestClient(_app())
    answer = client.get("/read", headers=[("Origin", PAGE), ("Origin", PAGE)])
    assert "access-control-allow-origin" not in answer.headers
