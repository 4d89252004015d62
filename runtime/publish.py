"""Public material a party publishes for the others to pin: a shuffler's signed descriptor, the
analyzer's config-signing key. Written whole (a reader never sees half a file), readable by
anyone (0644): it is public by design, and it is all that crosses a trust domain at set-up."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def publish(directory: Path, name: str, text: str) -> Path:
    """Write ``text`` to ``directory/name`` atomically (a temporary file renamed over it)."""
    directory.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, directory / name)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return directory / name
