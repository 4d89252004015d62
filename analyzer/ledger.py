"""The privacy ledger: every release of a channel with cumulative (ε, δ).

Releases of one channel are charged by basic composition (Dwork & Roth, *The Algorithmic
Foundations of Differential Privacy*, Theorem 3.16): ε and δ add up over releases, δ capped
at 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from analyzer.channels import ChannelRuntime
from analyzer.errors import UnknownChannelError
from analyzer.store import AnalyzerStore, StoredRelease
from common.wire import Ledger, LedgerRow

NOTE = "cumulative ε and δ by basic composition over all releases"


def compose(releases: Iterable[StoredRelease]) -> list[LedgerRow]:
    """Ledger rows with running totals by basic composition (Dwork & Roth, Theorem 3.16)."""
    rows, eps_sum, delta_sum = [], 0.0, 0.0
    for release in releases:
        cert = release.certificate
        eps_sum += cert.eps
        delta_sum += cert.delta
        rows.append(
            LedgerRow(
                id=release.id,
                epochs=(release.epoch_from, release.epoch_to),
                n=release.n,
                eps=cert.eps,
                delta=cert.delta,
                method=cert.method,
                neighbouring=cert.neighbouring,
                cumulative_eps=eps_sum,
                cumulative_delta=min(delta_sum, 1.0),
                released_at=release.released_at,
            )
        )
    return rows


class LedgerService:
    """Reads a channel's ledger."""

    def __init__(self, store: AnalyzerStore, channels: Mapping[str, ChannelRuntime]) -> None:
        self.store = store
        self.channels = channels

    def rows(self, channel_id: str) -> list[LedgerRow]:
        """The ledger rows of a configured channel.

        Raises:
            UnknownChannelError: if the channel is not configured.
        """
        if channel_id not in self.channels:
            raise UnknownChannelError(f"channel {channel_id!r} is not configured")
        return compose(self.store.releases(channel_id))

    def ledger(self, channel_id: str) -> Ledger:
        """``GET /v1/channels/{id}/privacy``."""
        return Ledger(channel_id=channel_id, releases=self.rows(channel_id), note=NOTE)
