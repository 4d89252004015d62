"""The installed uvicorn is a tested release and has the private API runtime.server builds on.

runtime.server subclasses uvicorn's httptools protocol, which is not public: these fail with
the supported range and what is missing, so an upgrade shows here before it breaks requests.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from runtime import uvicorn_api

ROOT = Path(__file__).resolve().parents[2]


def pinned() -> Requirement:
    """pyproject.toml's uvicorn requirement (the server extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    server = project["optional-dependencies"]["server"]
    return next(Requirement(line) for line in server if Requirement(line).name == "uvicorn")


def test_pyproject_pins_the_supported_range() -> None:
    assert str(pinned().specifier) == str(Requirement(f"uvicorn{uvicorn_api.SUPPORTED}").specifier)
    low, high = uvicorn_api.SUPPORTED_RANGE
    spec = pinned().specifier
    assert Version(".".join(map(str, low))) in spec
    assert Version(".".join(map(str, high))) not in spec


def test_installed_uvicorn_is_within_the_supported_range() -> None:
    installed = uvicorn_api.installed()
    assert uvicorn_api.supported(installed), (
        f"uvicorn {installed} is installed, but runtime/server.py is tested with uvicorn"
        f"{uvicorn_api.SUPPORTED} only (pyproject.toml): install that, or check the private API "
        f"in runtime/uvicorn_api.py against the new release and widen the range"
    )
    assert Version(installed) in pinned().specifier


def test_installed_uvicorn_has_the_private_api() -> None:
    gaps = uvicorn_api.missing()
    assert not gaps, uvicorn_api.explain(gaps)


def test_the_check_sees_the_attributes_uvicorn_sets() -> None:
    """The attribute check reads uvicorn's source: it must find something to compare with."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert {"parser", "cycle", "transport"} <= uvicorn_api.assigned(HttpToolsProtocol)


def test_a_missing_member_is_named_at_server_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        uvicorn_api,
        "CLASSES",
        (*uvicorn_api.CLASSES, (uvicorn_api.MODULE, "HttpToolsProtocol", ("gone",), ("lost",))),
    )
    from runtime.server import uvicorn_options

    with pytest.raises(RuntimeError) as raised:
        uvicorn_options()
    message = str(raised.value)
    assert "HttpToolsProtocol.gone()" in message and "HttpToolsProtocol.lost" in message
    assert uvicorn_api.SUPPORTED in message


@pytest.mark.parametrize(
    ("text", "inside"),
    [("0.54.0", True), ("0.54.9rc1", True), ("0.53.2", False), ("0.55.0", False), ("1.0", False)],
)
def test_supported(text: str, inside: bool) -> None:
    assert uvicorn_api.supported(text) is inside
