"""The audit sink (``esa audit sink``): where an audited shuffler forwards its batch parts.

Every ``POST /v1/batches`` is recorded exactly as the analyzer would receive it (raw body, every
header, arrival time) and answered as the analyzer answers (docs/protocol.md), so the shuffler
considers a part delivered exactly when it would at the analyzer; nothing is refused for its
content, since such parts are what the audit looks for. With ``relay`` the parts of every
channel but the audit channels go on, byte for byte, to the real analyzer. The auditor reads the
records from ``GET /v1/audit/records?after=<seq>`` (JSON lines, bearer token) or the record file.

The answers and the relay in detail: docs/audit.md, "How it works".
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from pydantic import ValidationError

from common.fetching import MAX_CONFIG_BYTES
from common.wire import Batch, BatchAck

log = logging.getLogger("esa.audit.sink")
#: Largest batch part accepted (the analyzer's default ``max_batch_bytes`` is of this order).
MAX_BODY = 64 * 1024 * 1024
RELAY_TIMEOUT = 30.0


@dataclass
class SinkState:
    """What the sink has recorded: every POST, in arrival order, and the parts seen."""

    token: str
    record_file: Path | None = None
    relay: str | None = None
    keep_channels: frozenset[str] = frozenset()
    records: list[dict[str, Any]] = field(default_factory=list)
    seen: set[tuple[str, int]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=RELAY_TIMEOUT))

    def record(self, path: str, headers: Iterable[tuple[str, str]], body: bytes) -> int:
        """Append one request to the records (and the record file); its sequence number."""
        with self.lock:
            seq = len(self.records) + 1
            entry: dict[str, Any] = {
                "seq": seq,
                "received_at": time.time(),
                "path": path,
                "headers": [[name, value] for name, value in headers],
                "body": base64.b64encode(body).decode(),
            }
            self.records.append(entry)
            if self.record_file is not None:
                with self.record_file.open("a") as handle:
                    handle.write(json.dumps(entry) + "\n")
            return seq

    def first_time(self, batch_id: str, part: int) -> bool:
        """True the first time a (``batch_id``, ``part``) is acknowledged."""
        with self.lock:
            if (batch_id, part) in self.seen:
                return False
            self.seen.add((batch_id, part))
            return True

    def after(self, seq: int) -> list[dict[str, Any]]:
        """Records with a sequence number above ``seq``."""
        with self.lock:
            return [r for r in self.records if r["seq"] > seq]


def _error(status: int, code: str, detail: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": code, "detail": detail}).encode()


def answer_batch(state: SinkState, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """The analyzer's answer to one recorded part (or the relay's, for relayed channels)."""
    media = headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        return _error(415, "unsupported_media_type", f"Content-Type must be JSON, got {media!r}")
    if not headers.get("esa-signature"):
        return _error(401, "bad_signature", "ESA-Signature header required")
    try:
        batch = Batch.model_validate_json(body)
    except ValidationError as error:
        return _error(400, "malformed", f"not a batch: {error.errors()[:1]}")
    if state.relay and batch.channel_id not in state.keep_channels:
        return relay(state.client, state.relay, headers, body)
    fresh = state.first_time(batch.batch_id, batch.part)
    ack = BatchAck(batch_id=batch.batch_id, part=batch.part, duplicate=not fresh)
    return (201 if fresh else 200), ack.model_dump_json(exclude_none=True).encode()


def relay(
    client: httpx.Client, url: str, headers: dict[str, str], body: bytes
) -> tuple[int, bytes]:
    """POST the exact bytes, signature and signed head on to the analyzer at ``url``; its
    answer."""
    sent = {
        "ESA-Shuffler": headers.get("esa-shuffler", ""),
        "ESA-Signature": headers["esa-signature"],
        "Content-Type": "application/json",
    }
    if "esa-preauth" in headers:  # the shuffler's signed head, for the analyzer's intake slots
        sent["ESA-Preauth"] = headers["esa-preauth"]
    try:
        response = client.post(url.rstrip("/") + "/v1/batches", content=body, headers=sent)
    except httpx.HTTPError as error:
        return _error(503, "relay_unavailable", f"analyzer unreachable: {type(error).__name__}")
    return response.status_code, response.content


def relay_config(client: httpx.Client, url: str) -> tuple[int, bytes]:
    """The analyzer's signed config, as it answers it: a shuffler whose analyzer URL is the sink
    keeps following its analyzer (channel changes, where it sits among the shufflers), and
    verifies the document's signature itself, so the sink cannot change it unseen."""
    try:
        response = client.get(url.rstrip("/") + "/v1/config")
    except httpx.HTTPError as error:
        return _error(503, "relay_unavailable", f"analyzer unreachable: {type(error).__name__}")
    if response.status_code != 200:
        return _error(502, "relay_failed", f"the analyzer answered {response.status_code}")
    if len(response.content) > MAX_CONFIG_BYTES:
        too_large = f"the analyzer's config is over {MAX_CONFIG_BYTES} bytes"
        return _error(502, "relay_failed", too_large)
    return 200, response.content


def make_handler(state: SinkState) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to ``state``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, data: bytes, media: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if self.path != "/v1/batches":
                self._send(*_error(404, "not_found", f"no route {self.path[:80]!r}"))
                return
            if length > MAX_BODY:
                self._send(*_error(413, "too_large", f"batch part over {MAX_BODY} bytes"))
                return
            body = self.rfile.read(length)
            state.record(self.path, self.headers.items(), body)
            lower = {name.lower(): value for name, value in self.headers.items()}
            self._send(*answer_batch(state, lower, body))

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path in ("/healthz", "/readyz"):
                self._send(200, b'{"status": "ok"}')
                return
            if url.path == "/v1/config" and state.relay:
                self._send(*relay_config(state.client, state.relay))
                return
            if url.path != "/v1/audit/records":
                self._send(*_error(404, "not_found", f"no route {url.path[:80]!r}"))
                return
            supplied = self.headers.get("authorization", "").removeprefix("Bearer ").encode()
            if not hmac.compare_digest(supplied, state.token.encode()):
                self._send(*_error(401, "bad_token", "Authorization: Bearer <sink token>"))
                return
            after = int(parse_qs(url.query).get("after", ["0"])[0])
            lines = "".join(json.dumps(r) + "\n" for r in state.after(after))
            self._send(200, lines.encode(), "application/x-ndjson")

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format % args)

    return Handler


def serve(state: SinkState, host: str, port: int) -> ThreadingHTTPServer:
    """A started sink server (serve it with ``serve_forever``)."""
    server = ThreadingHTTPServer((host, port), make_handler(state))
    server.daemon_threads = True
    return server


def fetch_records(
    url: str, token: str, after: int = 0, client: httpx.Client | None = None
) -> list[dict[str, Any]]:
    """The records of the sink at ``url`` above sequence ``after`` (through ``client`` when
    given: a new client costs a TLS context, a quarter of a second of CPU).

    Raises:
        httpx.HTTPError: the sink is unreachable or refused (wrong token).
    """
    request = client.get if client is not None else httpx.get
    response = request(
        url.rstrip("/") + "/v1/audit/records",
        params={"after": after},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    response.raise_for_status()
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def read_record_file(path: Path) -> list[dict[str, Any]]:
    """The records a sink wrote to ``path``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
