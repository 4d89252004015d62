"""A small asyncio HTTP/1.1 client with keep-alive connections: on this 2-core class of
machine general-purpose Python clients cost more CPU per request than the shuffler itself
(docs/benchmarks.md, "Shuffler") and would measure themselves."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

# --- a small asyncio HTTP/1.1 client ------------------------------------------------------


@dataclass(frozen=True)
class Response:
    """Status, lower-cased headers and body of one answer."""

    status: int
    headers: dict[str, str]
    body: bytes


class HttpConnection:
    """One keep-alive HTTP/1.1 connection to ``base_url`` (http or https), reopened after a
    failure; requests on it are sequential."""

    def __init__(self, base_url: str, timeout: float = 60.0) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.timeout = timeout
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes = b""
    ) -> Response:
        """Send one request and read its answer.

        Raises:
            OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError: the
                connection broke or the answer is not HTTP/1.1 (the connection is closed).
        """
        try:
            return await asyncio.wait_for(self._exchange(method, path, headers, body), self.timeout)
        except BaseException:
            self.close()
            raise

    async def _exchange(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        if self._streams is None:
            context = ssl.create_default_context() if self.tls else None
            self._streams = await asyncio.open_connection(self.host, self.port, ssl=context)
        reader, writer = self._streams
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
        answer = {name.strip().lower(): value.strip() for name, value in fields.items()}
        if answer.get("transfer-encoding", "").lower() == "chunked":
            data = await _read_chunked(reader)
        else:
            data = await reader.readexactly(int(answer.get("content-length", "0")))
        if answer.get("connection", "").lower() == "close":
            self.close()
        return Response(status, answer, data)

    def close(self) -> None:
        """Drop the connection (the next request opens a new one)."""
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        data += await reader.readexactly(size + 2)
        if size == 0:
            return bytes(data[:-2])
        del data[-2:]
