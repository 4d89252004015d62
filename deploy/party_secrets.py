"""The secrets of docker-compose.yml, one set per party (issue 31): every file the compose file
hands a service as a Docker secret, each a distinct random value, never one shared by two
parties.

    python3 deploy/party_secrets.py            # make what is missing in deploy/secrets/, check all
    python3 deploy/party_secrets.py --check    # create nothing; exit 1 naming what is wrong
    python3 deploy/party_secrets.py --dir DIR  # elsewhere (compose: ESA_SECRETS_DIR=DIR)

Per party (``analyzer``, ``shuffler-1``..``shuffler-3``), ``<party>-<kind>``:

* ``admin-token``, ``metrics-token``: its admin and ``/metrics`` bearer tokens;
* ``token-secret`` (shufflers only): the HMAC key of the client tokens it issues;
* ``db-password``: the password of its own PostgreSQL server's only role (``postgres-<party>``);
* ``database-url``: the URL its service connects with (that role and password).

A new value is 256 bits from the OS CSPRNG (URL-safe base64). An existing file is never
overwritten: it is checked (at least 16 characters, no placeholder, no value that another file
holds, each ``database-url`` naming its own party's server, role and password), and any
problem is reported by file name — never by value — with exit status 1. Nothing secret is
printed. The directory is made 0700: it is what guards the files on this host (they are 0644
inside it, because Docker bind-mounts a secret file with its own mode and each container reads
its files as its own non-root user). Standard library only: run it with any Python 3.9+.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "secrets"
#: The parties of docker-compose.yml.
PARTIES = ("analyzer", "shuffler-1", "shuffler-2", "shuffler-3")
#: What each kind of party holds.
KINDS = {
    "analyzer": ("admin-token", "metrics-token", "db-password", "database-url"),
    "shuffler": ("token-secret", "admin-token", "metrics-token", "db-password", "database-url"),
}
#: Values refused as secrets (as the services refuse them: runtime/secrets.py).
PLACEHOLDERS = frozenset(
    {"", "changeme", "change-me", "secret", "development", "password", "postgres"}
)
MIN_LENGTH = 16
PORT = 5432


def kinds(party: str) -> tuple[str, ...]:
    """The secret files ``party`` holds."""
    return KINDS["analyzer" if party == "analyzer" else "shuffler"]


def files(parties: Sequence[str] = PARTIES) -> Iterator[tuple[str, str]]:
    """Every (party, file name) of the deployment."""
    for party in parties:
        for kind in kinds(party):
            yield party, f"{party}-{kind}"


def database(party: str) -> str:
    """The database and role of ``party`` on its own server: ``esa_analyzer``,
    ``esa_shuffler_1``... (the database names of ``esa up --database-url-template``)."""
    return "esa_" + party.replace("-", "_")


def server(party: str) -> str:
    """The compose service of ``party``'s PostgreSQL."""
    return f"postgres-{party}"


def database_url(party: str, password: str) -> str:
    """The URL ``party``'s service connects with."""
    role = database(party)
    return f"postgresql+psycopg://{role}:{password}@{server(party)}:{PORT}/{role}"


def _refused(value: str) -> bool:
    return value.lower() in PLACEHOLDERS or len(value) < MIN_LENGTH


def _write(path: Path, value: str) -> None:
    """Create ``path`` with ``value`` (never over an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    os.chmod(path, 0o644)  # whatever the umask: each container reads it as its own user


def ensure(directory: Path, parties: Sequence[str] = PARTIES, create: bool = True) -> list[str]:
    """Create the missing files (unless ``create`` is false) and check every one; returns
    the problems found (file names and what is wrong, never a value)."""
    problems: list[str] = []
    if create:
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    elif not directory.is_dir():
        return [f"{directory}: no such directory (run deploy/party_secrets.py)"]
    values: dict[str, str] = {}
    for _, name in files(parties):
        if name.endswith("-database-url"):
            continue  # derived from the password below
        path = directory / name
        if not path.exists() and create:
            value = secrets.token_urlsafe(32)
            while value in values.values():  # never two equal values (2^-256, but never)
                value = secrets.token_urlsafe(32)
            _write(path, value)
            print(f"created {path}")
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        value = path.read_text().strip()
        if _refused(value):
            problems.append(f"{path}: a placeholder or shorter than {MIN_LENGTH} characters")
        values[name] = value
    problems += _shared(values)
    for party in parties:
        problems += _check_url(directory, party, values.get(f"{party}-db-password"), create)
    return problems


def _shared(values: dict[str, str]) -> list[str]:
    """Files holding the same value (two parties, or two roles of one party)."""
    holders: dict[str, list[str]] = {}
    for name, value in values.items():
        holders.setdefault(value, []).append(name)
    return [
        f"{', '.join(names)}: the same value (every secret must be its own)"
        for names in holders.values()
        if len(names) > 1
    ]


def _check_url(directory: Path, party: str, password: str | None, create: bool) -> list[str]:
    path = directory / f"{party}-database-url"
    if password is None:
        return []  # its password is missing: reported already
    if not path.exists() and create:
        _write(path, database_url(party, password))
        print(f"created {path}")
    if not path.is_file():
        return [f"{path}: missing"]
    url = urlsplit(path.read_text().strip())
    role = database(party)
    if (url.hostname, url.port, url.username, url.path) != (server(party), PORT, role, f"/{role}"):
        return [f"{path}: not {role} on {server(party)}:{PORT}/{role}"]
    if url.password != password:
        return [f"{path}: its password is not {party}-db-password's"]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(os.environ.get("ESA_SECRETS_DIR", DEFAULT_DIR))
    where = "where the files are (default: $ESA_SECRETS_DIR or deploy/secrets)"
    parser.add_argument("--dir", type=Path, default=default, help=where)
    parser.add_argument("--check", action="store_true", help="create nothing, only check")
    args = parser.parse_args(argv)
    problems = ensure(args.dir, create=not args.check)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        advice = (
            "no service should start with these: fix or delete a wrong file (a deleted one is "
            "made anew), and run without --check to make the missing ones"
        )
        print(advice, file=sys.stderr)
        return 1
    print(f"{args.dir}: every party's secrets are present and distinct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
