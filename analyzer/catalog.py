"""The analyzer's channels while it runs: those of its settings, plus those added and retired
through the admin API (``esa channel add|retire|list``).

Changes are a log in the analyzer's database (``channel_changes``) whose version is the
collection config's ``revision``, so every replica folds the same log into the same table and
a restart loses nothing. A channel's parameters never change while it runs (a change is a new
channel); retiring one stops it at its next epoch and keeps its releases and ledger.
Runbook: docs/operations.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from analyzer.channels import ChannelRuntime
from analyzer.errors import ChannelChangeRefusedError, InvalidChannelError, UnknownChannelError
from analyzer.records import ChannelLogRow
from analyzer.settings import largest_part_bytes
from analyzer.store import AnalyzerStore
from analyzer.tables import ADD, RETIRE
from common.wire import ChannelConfig

log = logging.getLogger("esa.analyzer")
#: A channel retired less than this (or half an epoch) before its epoch ends is retired from
#: the epoch after the next: shufflers fetch the config every ``config_refresh_seconds``
#: (10 s by default), and all of them should refuse from the same epoch on.
RETIRE_MARGIN_SECONDS = 60.0


class ChannelTable(Mapping[str, ChannelRuntime]):
    """The channels every part of the analyzer reads, with the config revision they are,
    replaced whole on a change (one reference swap), so a reader never sees one half-applied."""

    def __init__(self, runtimes: Mapping[str, ChannelRuntime]) -> None:
        self._state: tuple[int, dict[str, ChannelRuntime]] = (0, dict(runtimes))

    def __getitem__(self, channel_id: str) -> ChannelRuntime:
        return self._state[1][channel_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state[1])

    def __len__(self) -> int:
        return len(self._state[1])

    def replace(self, runtimes: Mapping[str, ChannelRuntime], revision: int) -> None:
        """Publish a new table and the config revision it is."""
        self._state = (revision, dict(runtimes))

    def configs(self) -> list[ChannelConfig]:
        """Every channel's config, in the order they were configured."""
        return self.published()[1]

    def published(self) -> tuple[int, list[ChannelConfig]]:
        """The config revision and its channels, read together."""
        revision, items = self._state
        return revision, [runtime.config for runtime in items.values()]


def _check_configured(configured: ChannelConfig, logged: ChannelConfig) -> None:
    """A channel of the settings must be the channel added at runtime under its id, if any.

    Raises:
        InvalidChannelError: naming the fields that differ.
    """
    changed = logged.changed_fields(configured)
    if changed:
        raise InvalidChannelError(
            f"channel {configured.id!r} in the channel file differs from the channel added "
            f"at runtime under that id ({', '.join(changed)}): a live channel's parameters "
            "never change; give it another id"
        )


class ChannelCatalog:
    """Folds the settings' channels and the channel log into a :class:`ChannelTable`."""

    def __init__(
        self,
        configured: Sequence[ChannelConfig],
        shuffler_ids: Sequence[str],
        store: AnalyzerStore,
        clock: Callable[[], float],
        part_cap: int,
        check: Callable[[list[ChannelConfig]], None] = lambda channels: None,
    ) -> None:
        self.configured = list(configured)
        self.part_cap = part_cap
        #: Refuses a channel list the rest of the analyzer cannot serve (its keys' rotation
        #: windows must cover the longest epoch).
        self.check = check
        self.shuffler_ids = tuple(shuffler_ids)
        self.store = store
        self.clock = clock
        self.table = ChannelTable(
            {c.id: ChannelRuntime.build(c, self.shuffler_ids) for c in self.configured}
        )
        self.revision = 0
        self._seen = (0, 0)
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Fold the log again if another replica (or a restart) changed it; the revision.

        Raises:
            InvalidChannelError: a channel of the settings names a channel added at runtime
                with other parameters (its parameters would change under its releases).
        """
        if self.store.channel_revision() == self._seen:
            return self.revision
        with self._lock:
            changes = self.store.channel_changes()
            folded = self._fold(changes)
            self.revision = changes[-1].version if changes else 0
            self.table.replace(folded, self.revision)
            self._seen = (self.revision, len(changes))
        return self.revision

    def _fold(self, changes: Sequence[ChannelLogRow]) -> dict[str, ChannelRuntime]:
        configs = {c.id: c for c in self.configured}
        added: set[str] = set()
        for change in changes:
            known = configs.get(change.channel_id)
            if change.action == ADD and change.config is not None:
                if change.channel_id in added:
                    continue  # the first add of an id wins (two replicas added it at once)
                logged = ChannelConfig.model_validate_json(change.config)
                if known is not None:
                    _check_configured(known, logged)
                else:
                    configs[change.channel_id] = logged
                added.add(change.channel_id)
            elif change.action == RETIRE and known is not None and known.retired_from_epoch is None:
                update = {"retired_from_epoch": change.retired_from_epoch}
                configs[change.channel_id] = known.model_copy(update=update)
        runtimes = dict(self.table)
        for channel_id, config in configs.items():
            if channel_id not in runtimes or runtimes[channel_id].config != config:
                runtimes[channel_id] = ChannelRuntime.build(config, self.shuffler_ids)
        return runtimes

    def add(self, config: ChannelConfig) -> tuple[ChannelConfig, bool]:
        """Add a channel; (the channel as published, whether anything changed). The same
        channel added again changes nothing.

        Raises:
            InvalidChannelError: its mechanism refuses its parameters (or it is retired already).
            ChannelChangeRefusedError: the id names a channel with other parameters.
            KeyTimingError: the keys' rotation windows would not cover its epochs.
        """
        self.refresh()
        known = self.table.get(config.id)
        if known is not None:
            self._check_same(known.config, config)
            if known.config.retired_from_epoch is not None:
                raise ChannelChangeRefusedError(
                    f"channel {config.id!r} was retired from epoch "
                    f"{known.config.retired_from_epoch} on; a retired id is not taken again: "
                    "add the channel under a new id"
                )
            return known.config, False
        if config.retired_from_epoch is not None:
            raise InvalidChannelError(f"channel {config.id!r}: a new channel cannot be retired")
        if ChannelRuntime.build(config, self.shuffler_ids).mechanism.training is not None:
            raise InvalidChannelError(
                f"channel {config.id!r}: {config.mechanism} channels train state kept from the "
                "start; configure them in the analyzer's channel file"
            )
        if largest_part_bytes([config]) > max(self.part_cap, largest_part_bytes(self.configured)):
            raise InvalidChannelError(
                f"channel {config.id!r}: payload_size={config.payload_size} makes parts larger "
                f"than this analyzer reads ({self.part_cap} bytes, max_batch_bytes); restart "
                "the analyzer with a larger max_batch_bytes first"
            )
        self.check([*self.table.configs(), config])
        self.store.record_channel_change(config.id, ADD, config.model_dump_json(), None)
        self.refresh()
        self._check_same(self.table[config.id].config, config)  # another replica's add first
        log.info("channel added", extra={"channel": config.id, "revision": self.revision})
        return self.table[config.id].config, True

    @staticmethod
    def _check_same(known: ChannelConfig, config: ChannelConfig) -> None:
        changed = known.changed_fields(config)
        if changed:
            raise ChannelChangeRefusedError(
                f"channel {config.id!r} exists with other {', '.join(changed)}: a live "
                "channel's parameters never change; add a channel with a new id instead"
            )

    def retire(self, channel_id: str) -> tuple[ChannelConfig, bool]:
        """Retire a channel from its next epoch on; (the channel, whether anything changed).

        Raises:
            UnknownChannelError: no such channel.
        """
        self.refresh()
        known = self.table.get(channel_id)
        if known is None:
            raise UnknownChannelError(f"no channel {channel_id[:64]!r}")
        if known.config.retired_from_epoch is not None:
            return known.config, False
        now, seconds = self.clock(), known.config.epoch_seconds
        first = int(now // seconds) + 1
        if first * seconds - now < min(RETIRE_MARGIN_SECONDS, seconds / 2):  # too late to learn
            first += 1
        self.store.record_channel_change(channel_id, RETIRE, None, first)
        self.refresh()
        log.info(
            "channel retired",
            extra={"channel": channel_id, "from_epoch": first, "revision": self.revision},
        )
        return self.table[channel_id].config, True
