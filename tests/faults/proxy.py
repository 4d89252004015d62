"""A fault proxy for the link between a shuffler and the analyzer (fault 5 of issue 49):
a small asyncio TCP proxy in its own thread whose mode the test changes while it runs.

* ``pass``: bytes go through as they come;
* ``slow``: every chunk, either way, is delivered ``latency`` seconds after it arrived (a
  long, slow link: order kept, nothing lost);
* ``reset``: every request that starts a POST (a part) is cut: alternately after half of its
  first chunk (the analyzer never sees the whole part) and after the whole request, dropping
  the answer (the analyzer stored the part, the shuffler never hears so and sends it again).
  A cut closes both sockets with a TCP reset (``SO_LINGER`` 0). With ``cut_every`` n, only
  every n-th POST is cut (a lossy link rather than a broken one).

The same proxy stands between the load test's devices and a shuffler (fault 5, the devices'
side): there a POST is a contribution, and a dropped answer is a 202 the device never saw.

A real network fault, not a mock: the shuffler's HTTP client and the analyzer see broken
connections, timeouts and resets on real sockets.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["pass", "slow", "reset"]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset: the peer sees ECONNRESET, as when a middlebox drops a flow."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class FaultProxy:
    """Listens on 127.0.0.1 (:attr:`port`, chosen at :meth:`start`) and forwards to
    ``target_port``; :attr:`mode` may change at any time."""

    target_port: int
    mode: Mode = "pass"
    latency: float = 2.0
    port: int = 0
    #: POSTs cut mid-request, and POSTs whose answer was dropped.
    cut_requests: int = 0
    cut_answers: int = 0
    #: Cut only every n-th POST in ``reset`` mode (1: every one).
    cut_every: int = 1
    #: POSTs seen in ``reset`` mode.
    posts: int = 0
    connections: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", self.port)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _connection(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _reset(client_w)
            return
        self.connections += 1
        cut_answer = asyncio.Event()
        ends = (client_w, server_w)
        up = asyncio.ensure_future(self._pump(client_r, server_w, ends, cut_answer, True))
        down = asyncio.ensure_future(self._pump(server_r, client_w, ends, cut_answer, False))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for writer in ends:
            writer.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ends: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        cut_answer: asyncio.Event,
        upstream: bool,
    ) -> None:
        """Copy ``reader`` to ``writer`` chunk by chunk under the current mode (a delayed
        chunk goes out ``latency`` after it arrived, in order, by :meth:`_deliver`)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        delivery = asyncio.ensure_future(self._deliver(queue, writer))
        try:
            while chunk := await reader.read(65536):
                if self._cut_now(upstream, chunk):
                    if (self.cut_requests + self.cut_answers) % 2 == 0:
                        self.cut_requests += 1
                        writer.write(chunk[: len(chunk) // 2])
                        await writer.drain()
                        return self._cut(ends)
                    self.cut_answers += 1
                    cut_answer.set()
                elif not upstream and cut_answer.is_set():
                    return self._cut(ends)
                delay = self.latency if self.mode == "slow" else 0.0
                queue.put_nowait((time.monotonic() + delay, chunk))
            await queue.join()
        finally:
            delivery.cancel()

    def _cut_now(self, upstream: bool, chunk: bytes) -> bool:
        """Whether this chunk starts a POST to cut (``reset`` mode, every ``cut_every``-th)."""
        if not (upstream and self.mode == "reset" and chunk.startswith(b"POST ")):
            return False
        self.posts += 1
        return self.posts % self.cut_every == 0

    @staticmethod
    async def _deliver(
        queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(chunk)
            await writer.drain()
            queue.task_done()

    @staticmethod
    def _cut(ends: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        for writer in ends:
            _reset(writer)
