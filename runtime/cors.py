"""Cross-origin access for the routes a device calls from a web page (the CORS protocol of the
WHATWG Fetch standard), and for nothing else.

A party names the origins its device pages are served from (``cors_origins``, validated by
:func:`parse_cors_origins`; none by default, ``*`` refused). On its device routes
(:class:`DeviceRoute`) a request from one of them is answered with
``Access-Control-Allow-Origin`` (that origin, never ``*``) and ``Retry-After`` exposed, and a
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) with ``204``, the route's
methods and the request headers a device sends. Every other preflight (another origin, method
or header, or any other path) is ``403`` in the one error shape (:mod:`runtime.http`), and
every other route answers without any CORS header, whatever the origin. Why none by default
and no wildcard: docs/operations.md, "Browsers (CORS)".
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator

from runtime.errors import DomainError, Kind
from runtime.http import error_body, status_of

Headers = list[tuple[bytes, bytes]]
#: A raw answer: (status, body, extra response headers).
Answer = tuple[int, bytes, Headers]
#: A route answered outside ASGI (:class:`runtime.server.DirectRoutes`): request headers and
#: ``receive`` to its answer.
Handler = Callable[[Headers, Callable[[], Awaitable[Any]]], Awaitable[Answer]]
#: ``refused(route, code)``: a refused preflight, for the party's refusal counters.
Refused = Callable[[str, str], None]
#: Seconds a browser may cache a granted preflight. A page whose origin an operator removes
#: may still send contributions (never read the answers) for this long, so it is short: a
#: device sends about one contribution per epoch, and a preflight more costs it little.
MAX_AGE = 600
#: Answer headers a device page reads besides the CORS-safelisted ones (``Retry-After`` of a
#: 429 or 503 says when to try again).
EXPOSED = "Retry-After"
#: Schemes a device page is served over.
SCHEMES = {"http": 80, "https": 443}
#: A host as browsers serialize it in ``Origin``: a lower-case ASCII name or IPv4 address, or
#: an IPv6 address in brackets.
HOST = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\]")
_VARY = (b"vary", b"Origin")


def parse_cors_origins(value: object) -> str:
    """``value`` (a comma-separated string, a JSON list in a string, or a list of strings) as
    the allowed origins, normalized as browsers send them (lower case, no default port),
    comma-separated; empty: none.

    Raises:
        ValueError: an entry that is not an origin ``scheme://host[:port]`` (a path, a query,
            credentials, a scheme other than http or https), ``*`` or ``null``.
    """
    entries = value
    if isinstance(value, str):
        text = value.strip()
        try:
            entries = json.loads(text) if text.startswith("[") else text.split(",")
        except ValueError:
            entries = None
    if not isinstance(entries, list | tuple) or not all(isinstance(e, str) for e in entries):
        raise ValueError("cors_origins: give a comma-separated list or a JSON list of origins")
    found = [_origin(entry.strip()) for entry in entries if entry.strip()]
    return ",".join(dict.fromkeys(found))


def _origin(entry: str) -> str:
    """One allowed origin, normalized.

    Raises:
        ValueError: naming the entry and what is wrong with it.
    """
    shown = repr(entry[:80])
    if entry in ("*", "null"):
        raise ValueError(
            f"cors_origins: {shown} is refused: name each origin a device page is served from "
            '(docs/operations.md, "Browsers (CORS)")'
        )
    example = "an origin is scheme://host[:port], e.g. https://app.example.com"
    try:
        parts = urlsplit(entry)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"cors_origins: {shown} is not an origin ({error}); {example}") from None
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    if "[" in parts.netloc:
        host = f"[{host}]"
    problem = _problem(entry, scheme, host, parts.netloc, parts.path)
    if problem is not None:
        raise ValueError(f"cors_origins: {shown} is not an origin: {problem}; {example}")
    shown_port = "" if port in (None, SCHEMES[scheme]) else f":{port}"
    return f"{scheme}://{host}{shown_port}"


def _problem(entry: str, scheme: str, host: str, netloc: str, path: str) -> str | None:
    """What keeps ``entry`` (split into its parts) from being an origin, or None."""
    if scheme not in SCHEMES:
        return "its scheme is not http or https"
    if "@" in netloc:
        return "it has credentials"
    if path:
        return "it has a path (not even / belongs to an origin)"
    if "?" in entry or "#" in entry:
        return "it has a query or fragment"
    if not HOST.fullmatch(host):
        return (
            "its host is not a lower-case ASCII name or an address (write an internationalized "
            "name in its xn-- form)"
        )
    return None


class CorsSettings(BaseModel):
    """The ``cors_origins`` setting of a service (``ESA_<SERVICE>_CORS_ORIGINS``), one
    definition for every service that takes it; documented in docs/operations.md."""

    #: The origins of the web pages whose devices call this party's device routes
    #: (comma-separated, or a JSON list); empty: no browser page may (the default).
    cors_origins: Annotated[str, BeforeValidator(parse_cors_origins)] = ""

    @property
    def allowed_origins(self) -> tuple[str, ...]:
        """The allowed origins, as browsers send them in ``Origin``."""
        return tuple(self.cors_origins.split(",")) if self.cors_origins else ()


@dataclass(frozen=True)
class DeviceRoute:
    """A path a device calls from a page: its methods, and the request headers it sends beyond
    the CORS-safelisted ones (what a preflight may ask for)."""

    methods: tuple[str, ...]
    headers: tuple[str, ...] = ()


class CorsRefusedError(DomainError):
    """A CORS preflight this party does not grant (a browser then sends nothing)."""

    kind = Kind.FORBIDDEN


class CorsRouteRefusedError(CorsRefusedError):
    """A preflight for a path that is not a device route: no page may call it."""

    code = "cors_route_refused"


class CorsOriginRefusedError(CorsRefusedError):
    """A preflight from an origin that is not allowed (or naming none)."""

    code = "cors_origin_refused"


class CorsMethodRefusedError(CorsRefusedError):
    """A preflight asking for a method the device route does not serve."""

    code = "cors_method_refused"


class CorsHeadersRefusedError(CorsRefusedError):
    """A preflight asking for request headers a device does not send."""

    code = "cors_headers_refused"


def _single(headers: Headers, name: bytes) -> bytes | None:
    """The value of header ``name`` when it is sent once; None when absent or repeated."""
    values = [value for key, value in headers if key == name]
    return values[0] if len(values) == 1 else None


def _check_asked(path: str, route: DeviceRoute, headers: Headers) -> None:
    """Check the method and request headers a preflight asks for against ``route``.

    Raises:
        CorsMethodRefusedError: a method the route does not serve (or none asked for).
        CorsHeadersRefusedError: a request header a device does not send there.
    """
    method = (_single(headers, b"access-control-request-method") or b"").decode("latin-1")
    if method not in route.methods:
        served = ", ".join(route.methods)
        raise CorsMethodRefusedError(f"{path} answers {served} only, not {method[:16]!r}")
    asked = (_single(headers, b"access-control-request-headers") or b"").decode("latin-1")
    taken = {name.lower() for name in route.headers}
    extra = sorted({name.strip().lower() for name in asked.split(",")} - taken - {""})
    if extra:
        allowed = ", ".join(route.headers) or "none"
        raise CorsHeadersRefusedError(
            f"{path} takes no request header {extra[0][:32]!r} (allowed: {allowed})"
        )


class Cors:
    """One party's CORS policy: its allowed origins and device routes."""

    def __init__(self, origins: Iterable[str], routes: Mapping[str, DeviceRoute]) -> None:
        self.origins = tuple(origins)
        self.routes = dict(routes)
        self._allowed = frozenset(origin.encode() for origin in self.origins)

    def granted(self, path: str, headers: Headers) -> Headers:
        """The headers to add to an answer on ``path``: none off the device routes or with no
        origin allowed; else ``Vary: Origin``, and the grant for an allowed ``Origin``."""
        if not self._allowed or path not in self.routes:
            return []
        origin = _single(headers, b"origin")
        if origin is None or origin not in self._allowed:
            return [_VARY]
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-expose-headers", EXPOSED.encode()),
            _VARY,
        ]

    def is_preflight(self, method: str, path: str, headers: Headers) -> bool:
        """Whether this party answers the request as a preflight: any ``OPTIONS`` on a device
        route (no route serves it otherwise), and on any other path one that asks
        ``Access-Control-Request-Method`` (a plain ``OPTIONS`` there is the app's 405)."""
        if method != "OPTIONS":
            return False
        return path in self.routes or _single(headers, b"access-control-request-method") is not None

    def preflight(self, path: str, headers: Headers) -> Headers:
        """The headers of a granted preflight (answered ``204``).

        Raises:
            CorsRefusedError: the path is not a device route, or the origin, the requested
                method or a requested header is not allowed there.
        """
        route = self.routes.get(path)
        if route is None:
            routes = ", ".join(self.routes)
            raise CorsRouteRefusedError(f"no page may call this path; a device page calls {routes}")
        origin = _single(headers, b"origin")
        if origin is None or origin not in self._allowed:
            raise CorsOriginRefusedError(
                "the request's Origin is not one this party allows (its cors_origins setting)"
            )
        _check_asked(path, route, headers)
        grant = [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", ", ".join(route.methods).encode()),
            (b"access-control-max-age", str(MAX_AGE).encode()),
            _VARY,
        ]
        if route.headers:
            grant.append((b"access-control-allow-headers", ", ".join(route.headers).encode()))
        return grant

    def direct(self, path: str, handler: Handler) -> Handler:
        """``handler`` (a route answered outside ASGI, on ``path``) with the grant added to its
        answers; ``handler`` itself when no origin is allowed."""
        if not self._allowed:
            return handler

        async def granting(headers: Headers, receive: Callable[[], Awaitable[Any]]) -> Answer:
            status, body, extra = await handler(headers, receive)
            return status, body, [*extra, *self.granted(path, headers)]

        return granting


class CorsMiddleware:
    """ASGI: preflights answered here (:meth:`Cors.preflight`), the grant added to the answers
    of device routes (:meth:`Cors.granted`), everything else passed through untouched."""

    def __init__(self, app: Any, cors: Cors, refused: Refused | None = None) -> None:
        self.app, self.cors, self.refused = app, cors, refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, headers = scope["path"], scope["headers"]
        if self.cors.is_preflight(scope["method"], path, headers):
            await _answer(send, *self._preflight(path, headers))
            return
        grant = self.cors.granted(path, headers)
        if not grant:
            await self.app(scope, receive, send)
            return

        async def granting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *grant]}
            await send(message)

        await self.app(scope, receive, granting)

    def _preflight(self, path: str, headers: Headers) -> Answer:
        try:
            return 204, b"", self.cors.preflight(path, headers)
        except CorsRefusedError as error:
            if self.refused is not None:  # a bounded label: any other path is one "OPTIONS"
                route = f"OPTIONS {path}" if path in self.cors.routes else "OPTIONS"
                self.refused(route, error.code)
            return status_of(error), error_body(error.code, error.detail), []


async def _answer(send: Any, status: int, body: bytes, extra: Headers) -> None:
    headers = list(extra)
    if body:
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_cors(app: FastAPI, cors: Cors, refused: Refused | None = None) -> None:
    """Serve ``app`` behind :class:`CorsMiddleware` as its outermost layer: outside its error
    handling, so a 500 carries the grant too (Starlette puts added middleware inside it)."""
    build = app.build_middleware_stack

    def outermost() -> Any:
        return CorsMiddleware(build(), cors, refused)

    app.build_middleware_stack = outermost  # type: ignore[method-assign]


# --- OpenAPI ----------------------------------------------------------------------------------


def document_preflights(cors: Cors) -> Callable[[dict[str, Any]], None]:
    """What adds each device route's preflight to an OpenAPI document (as its ``options``
    operation: the server's own statuses and the error shape are added after it, by
    :func:`runtime.http.document_errors`)."""

    def add(schema: dict[str, Any]) -> None:
        paths = schema.get("paths", {})
        for path, route in cors.routes.items():
            if path in paths:
                paths[path]["options"] = _preflight_operation(path, route, cors.origins)

    return add


def _preflight_operation(path: str, route: DeviceRoute, origins: tuple[str, ...]) -> dict[str, Any]:
    """The ``options`` operation of one device route (204 only when some origin is allowed)."""
    responses: dict[str, Any] = {}
    if origins:
        responses["204"] = {"description": "Granted", "headers": _granted_headers(route)}
    responses["403"] = {
        "description": "Not granted: cors_origin_refused (an Origin not allowed, or none), "
        "cors_method_refused or cors_headers_refused (a method or request header the route "
        "does not take)"
    }
    methods = " or ".join(route.methods)
    return {
        "tags": ["cors"],
        "summary": "CORS preflight",
        "description": f"What a browser asks before a page's cross-origin {methods} to {path}: "
        "granted to the origins this party allows (none by default) for the request headers a "
        "device sends. A preflight to any other path is 403 cors_route_refused.",
        "operationId": "preflight" + re.sub(r"\W", "_", path),
        "parameters": _preflight_parameters(route, origins),
        "responses": responses,
    }


def _granted_headers(route: DeviceRoute) -> dict[str, Any]:
    """The headers of a granted preflight, as OpenAPI response headers."""
    text = {"type": "string"}
    granted: dict[str, Any] = {
        "Access-Control-Allow-Origin": {"description": "the request's Origin", "schema": text},
        "Access-Control-Allow-Methods": {"description": ", ".join(route.methods), "schema": text},
        "Access-Control-Max-Age": {
            "description": f"seconds a browser may cache the grant ({MAX_AGE})",
            "schema": {"type": "integer", "minimum": 0},
        },
    }
    if route.headers:
        allowed = ", ".join(route.headers)
        granted["Access-Control-Allow-Headers"] = {"description": allowed, "schema": text}
    return {name: {**header, "required": True} for name, header in granted.items()}


def _preflight_parameters(route: DeviceRoute, origins: tuple[str, ...]) -> list[dict[str, Any]]:
    """The request headers of a preflight, as OpenAPI parameters (the allowed origins as the
    enum of ``Origin``, when there are some)."""
    origin: dict[str, Any] = {"type": "string"}
    if origins:
        origin["enum"] = list(origins)
    asked = ", ".join(route.headers) or "none"
    return [
        {"name": "Origin", "in": "header", "required": True, "schema": origin},
        {
            "name": "Access-Control-Request-Method",
            "in": "header",
            "required": True,
            "schema": {"type": "string", "enum": list(route.methods)},
        },
        {
            "name": "Access-Control-Request-Headers",
            "in": "header",
            "required": False,
            "description": f"comma-separated request header names; allowed: {asked}",
            "schema": {"type": "string"},
        },
    ]
