"""The private part of uvicorn that :mod:`runtime.server` builds on, and a check that it is there.

:class:`runtime.server.JsonHttpToolsProtocol` subclasses uvicorn's httptools protocol
(``uvicorn.protocols.http.httptools_impl``, not a public API): it overrides and reads the
methods and attributes named below, which any uvicorn release may rename. pyproject.toml pins
uvicorn to :data:`SUPPORTED`, the releases this is tested with; :func:`missing` lists what an
installed uvicorn lacks, so a server refuses to start with that list (:func:`require`) rather
than failing inside a request.

Why: docs/architecture.md, "Runtime: HAProxy and the server".
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import textwrap
from importlib.metadata import PackageNotFoundError, version

#: The uvicorn releases runtime.server is tested with, as pinned in pyproject.toml.
SUPPORTED = ">=0.54,<0.55"
#: The same range as (lowest included, first excluded) release numbers.
SUPPORTED_RANGE = ((0, 54), (0, 55))
#: uvicorn's httptools protocol module.
MODULE = "uvicorn.protocols.http.httptools_impl"
#: Names runtime.server imports from :data:`MODULE`.
NAMES = ("STATUS_LINE", "HttpToolsProtocol", "RequestResponseCycle")
#: (module, class, methods it must have, attributes its methods set on ``self``).
CLASSES = (
    (
        MODULE,
        "HttpToolsProtocol",
        (
            "connection_made",
            "connection_lost",
            "pause_writing",
            "resume_writing",
            "data_received",
            "_unset_keepalive_if_required",
            "_should_upgrade",
            "handle_websocket_upgrade",
            "send_400_response",
            "on_message_begin",
            "on_url",
            "on_header",
            "on_headers_complete",
            "on_body",
            "on_message_complete",
            "_start_asgi_task",
        ),
        ("app", "loop", "logger", "parser", "server_state", "tasks", "transport", "flow", "cycle"),
    ),
    (
        MODULE,
        "RequestResponseCycle",
        ("receive",),
        (
            "scope",
            "transport",
            "message_event",
            "on_response",
            "disconnected",
            "keep_alive",
            "waiting_for_100_continue",
            "response_started",
            "response_complete",
        ),
    ),
    (
        "uvicorn.protocols.http.flow_control",
        "FlowControl",
        ("drain",),
        ("read_paused", "write_paused"),
    ),
    ("uvicorn.server", "ServerState", (), ("tasks", "default_headers")),
)


def release(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string (``"0.54.0rc1"`` -> ``(0, 54, 0)``)."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(number) for number in match.group().split(".")) if match else ()


def supported(text: str) -> bool:
    """Whether uvicorn version ``text`` is within :data:`SUPPORTED`."""
    low, high = SUPPORTED_RANGE
    return low <= release(text) < high


def assigned(cls: type) -> set[str]:
    """The attributes the methods of ``cls`` (not its bases) set on ``self``, read from its
    source (instance attributes are not on the class); empty if the source is not at hand."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "self"
                ):
                    names.add(part.attr)
    return names


def _class_gaps(
    module_name: str, class_name: str, methods: tuple[str, ...], attributes: tuple[str, ...]
) -> list[str]:
    """What one class of uvicorn lacks: the class itself, its methods, or (when its source is
    at hand) the attributes it sets."""
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return [f"{module_name}.{class_name}"]
    gaps = [f"{class_name}.{name}()" for name in methods if not callable(getattr(cls, name, None))]
    have = set().union(*(assigned(base) for base in cls.__mro__ if base is not object))
    if have:
        gaps += [f"{class_name}.{name}" for name in attributes if name not in have]
    return gaps


def missing() -> list[str]:
    """What the installed uvicorn lacks of the private API runtime.server relies on (empty if
    nothing): its httptools protocol module, the names imported from it, and each class's
    methods and attributes in :data:`CLASSES`."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return [MODULE]
    gaps = [f"{MODULE}.{name}" for name in NAMES if not hasattr(module, name)]
    for module_name, class_name, methods, attributes in CLASSES:
        gaps += _class_gaps(module_name, class_name, methods, attributes)
    return gaps


def installed() -> str:
    """The installed uvicorn's version, or ``"none"``."""
    try:
        return version("uvicorn")
    except PackageNotFoundError:
        return "none"


def explain(gaps: list[str]) -> str:
    """The error naming what is missing, the installed uvicorn and the supported range."""
    return (
        f"runtime.server needs uvicorn's private httptools protocol API, tested with uvicorn"
        f"{SUPPORTED} (pinned in pyproject.toml); the installed uvicorn {installed()} lacks: "
        f"{', '.join(gaps)}. Install a tested release: "
        f"pip install 'uvicorn[standard]{SUPPORTED}'"
    )


def require() -> None:
    """Raise RuntimeError (:func:`explain`) if the installed uvicorn lacks any of it; log a
    warning if it has it all but is a release outside :data:`SUPPORTED` (untested)."""
    gaps = missing()
    if gaps:
        raise RuntimeError(explain(gaps))
    if not supported(installed()):
        logging.getLogger(__name__).warning(
            "uvicorn %s is outside the tested range %s (pyproject.toml)", installed(), SUPPORTED
        )
