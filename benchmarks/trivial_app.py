"""A trivial FastAPI app for the shuffler benchmark's baseline (same uvicorn/FastAPI stack).

``POST /v1/contributions`` reads the body and answers 202 without doing anything else, so the
ratio against the real shuffler isolates the shuffler's own work.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()


@app.post("/v1/contributions")
async def accept(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse({"receipt": "0" * 32}, 202)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@contextmanager
def running(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """This app in a process of its own on 127.0.0.1:``port``, once it answers; stopped after."""
    app = subprocess.Popen([sys.executable, __file__, str(port)])
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield app
    finally:
        app.terminate()
        app.wait()


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_config=None, access_log=False)
