"""A private PostgreSQL cluster a fault test can stop and start (fault 1 of issue 49):
Debian's server binaries (``/usr/lib/postgresql/*/bin``), ``initdb`` into a temporary
folder, listening on a free port of 127.0.0.1, trust authentication. The machine's shared
server is never touched. As root, the cluster runs as the ``postgres`` user (PostgreSQL
refuses to run as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg

from services.cli import launcher


def binaries() -> Path | None:
    """The newest installed server's ``bin`` folder, or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return found[-1].parent if found else None


@dataclass
class Cluster:
    """One cluster in :attr:`folder` on :attr:`port` (:meth:`create`, then start/stop)."""

    folder: Path
    port: int
    bin: Path

    @classmethod
    def create(cls, bin: Path) -> Cluster:
        folder = Path(tempfile.mkdtemp(prefix="esa-pg-"))
        cluster = cls(folder, launcher.free_base_port(1), bin)
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
        cluster._run("initdb", "-D", str(folder / "data"), "-U", "postgres", "--auth=trust")
        return cluster

    def _run(self, tool: str, *args: str) -> None:
        as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run(
            [*as_postgres, str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", "-D", str(self.folder / "data"), "-o", options,
            "-l", str(self.folder / "server.log"), "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``: ``fast`` rolls back every open transaction and
        disconnects its clients, as a restart does."""
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", mode, "-w", "stop")

    def database(self, name: str) -> str:
        """Create ``name``; its SQLAlchemy URL."""
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def remove(self) -> None:
        """Stop it (immediately) if it runs, and delete its folder."""
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)
