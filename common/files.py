"""Files that several processes may create at once and read at once (an analyzer's workers
starting together, `esa up` and a service both creating a party's secret): a file appears
whole or not at all, is never overwritten, and the first writer wins."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def create_once(path: Path, data: bytes, mode: int = 0o600) -> bool:
    """Publish ``data`` at ``path`` unless a file is there; returns whether this call wrote it.

    The bytes go to a private temporary file in the same folder first, which is then hard-linked
    to ``path`` (the link fails if ``path`` exists, so nothing is overwritten): a concurrent
    reader sees no file or the whole file, never a partial one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
