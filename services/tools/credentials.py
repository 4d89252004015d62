"""The bearer tokens a tool presents at each service of a deployment it operates (closing
epochs, reading a shuffler's exact counts): each party has its own admin token, and each
shuffler its own metrics token, so a tool acting for several parties holds each one's, by URL.

An ``esa up`` deployment keeps them in ``<var>/keys/<party>/admin-token`` and
``metrics-token``; a compose loadgen gets them as secret files named
``<party>-admin-token`` / ``<party>-metrics-token`` in one folder. A single token given for
every party (``--admin-token``) serves a deployment whose parties share one (development).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: The files a party's tokens are kept in (as ``services.cli.launcher`` writes them).
ADMIN, METRICS = "admin-token", "metrics-token"


@dataclass(frozen=True)
class Credentials:
    """Admin and metrics tokens by service URL, one for every URL not listed, and the folder
    the parties' own tokens are read from once their URLs are known (:meth:`for_parties`)."""

    admin: Mapping[str, str] = field(default_factory=dict, repr=False)
    metrics: Mapping[str, str] = field(default_factory=dict, repr=False)
    default: str | None = field(default=None, repr=False)
    folder: Path | None = None

    @classmethod
    def shared(cls, token: str) -> Credentials:
        """One token at every service."""
        return cls(default=token)

    @classmethod
    def from_keys(
        cls, folder: Path, parties: Mapping[str, str], default: str | None = None
    ) -> Credentials:
        """The tokens of ``parties`` (id → URL) found in ``folder`` (``<id>/admin-token`` or
        ``<id>-admin-token``, likewise ``metrics-token``); ``default`` where none is. A
        shuffler without a metrics token is read with its admin token, as it serves one."""
        admin: dict[str, str] = {}
        metrics: dict[str, str] = {}
        for party, url in parties.items():
            for kind, into in ((ADMIN, admin), (METRICS, metrics)):
                token = _token(folder, party, kind)
                if token is not None:
                    into[url] = token
        return cls(admin, metrics, default, folder)

    def for_parties(self, parties: Mapping[str, str]) -> Credentials:
        """These credentials with the tokens of ``parties`` (id → URL) read from
        :attr:`folder` (unchanged without one).

        Raises:
            ValueError: a shuffler has no admin token in the folder and none is given for all
                (naming the shuffler and the files looked for), found before anything is sent.
        """
        if self.folder is None:
            return self
        found = Credentials.from_keys(self.folder, parties, self.default)
        lacking = [p for p, url in parties.items() if p != "analyzer" and url not in found.admin]
        if lacking and self.default is None:
            raise ValueError(
                f"no admin token for {', '.join(lacking)} in {self.folder} (looked for "
                f"<party>/{ADMIN} and <party>-{ADMIN})"
            )
        return found

    def admin_headers(self, url: str) -> dict[str, str]:
        """The ``Authorization`` header of ``url``'s admin routes (none known: no header)."""
        return _bearer(self.admin.get(url, self.default))

    def metrics_headers(self, url: str) -> dict[str, str]:
        """The ``Authorization`` header of ``url``'s ``/metrics``."""
        return _bearer(self.metrics.get(url) or self.admin.get(url, self.default))


def _token(folder: Path, party: str, kind: str) -> str | None:
    for path in (folder / party / kind, folder / f"{party}-{kind}"):
        if path.is_file():
            return path.read_text().strip()
    return None


def _bearer(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}
