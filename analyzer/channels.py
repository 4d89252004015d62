"""One adapter per channel: its mechanism's parameters, accumulator, estimate and certificate.

The analyzer treats every mechanism the same way through :class:`ChannelRuntime`; the
mechanism-specific parts stay in ``common.mechanisms`` (MECHANISMS.md: one module owns
everything about its mechanism).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from common.accounting import Certification, rfrag_across_batches
from common.mechanisms import MODULES, PARAMS, CountAccumulator, Estimate, rfrag, zsum
from common.mechanisms.longitudinal import TreeAccumulator
from common.wire import ChannelConfig

Accumulator = CountAccumulator | TreeAccumulator


class ChannelConfigError(ValueError):
    """A channel whose mechanism parameters do not validate."""


@dataclass(frozen=True)
class ChannelRuntime:
    """A configured channel with its validated mechanism parameters."""

    config: ChannelConfig
    params: Any
    shuffler_ids: tuple[str, ...]

    @classmethod
    def build(cls, config: ChannelConfig, shuffler_ids: Sequence[str]) -> ChannelRuntime:
        """Validate the mechanism parameters (with the mechanism's own checks).

        Raises:
            ChannelConfigError: naming the channel and what is wrong.
        """
        try:
            params = PARAMS[config.mechanism](**config.params)
        except (TypeError, ValueError) as error:
            raise ChannelConfigError(f"channel {config.id!r}: {error}") from error
        module = MODULES[config.mechanism]
        if config.payload_size < module.PAYLOAD_SIZE + 4:
            raise ChannelConfigError(
                f"channel {config.id!r}: payload_size={config.payload_size} is smaller than the "
                f"{module.PAYLOAD_SIZE + 4} bytes a {config.mechanism} fragment needs when padded"
            )
        return cls(config, params, tuple(shuffler_ids))

    @property
    def module(self) -> Any:
        """The mechanism module."""
        return MODULES[self.config.mechanism]

    def new_accumulator(self) -> Accumulator:
        """An empty accumulator."""
        accumulator: Accumulator = self.module.new_accumulator(self.params)
        return accumulator

    def load(self, data: bytes) -> Accumulator:
        """Deserialize an accumulator of this channel."""
        if self.config.mechanism == "longitudinal":
            return TreeAccumulator.from_bytes(data)
        return CountAccumulator.from_bytes(data)

    def add(
        self, accumulator: Accumulator, fragments: Iterable[bytes], n: int, shuffler_id: str
    ) -> int:
        """Count one batch's opened fragments; returns the invalid ones (chaff)."""
        if self.config.mechanism == "rfrag":
            rows = self.rows_of(shuffler_id)
            invalid: int = rfrag.add_fragments(accumulator, self.params, fragments, n, rows)  # type: ignore[arg-type]
            return invalid
        invalid = self.module.add_fragments(accumulator, self.params, fragments, n)
        return invalid

    def rows_of(self, shuffler_id: str) -> list[int]:
        """Report-fragment rows routed to a shuffler: r with ``r mod K`` its index."""
        if shuffler_id not in self.shuffler_ids:
            return []
        index, count = self.shuffler_ids.index(shuffler_id), len(self.shuffler_ids)
        return [r for r in range(self.params.tau) if r % count == index]

    def estimate(self, accumulator: Accumulator) -> Estimate:
        """The mechanism's estimate (clipping left to the caller's presentation)."""
        result: Estimate = self.module.estimate(accumulator, self.params)
        return result

    def certify(self, crowds: dict[str, int]) -> Certification:
        """Certification at the smallest crowd in ``crowds`` (batch or level crowds)."""
        smallest = min(crowds.values())
        if self.config.mechanism == "zsum":
            return zsum.central(self.params, smallest)
        return self.module.central(self.params, smallest, self.config.delta)  # type: ignore[no-any-return]

    def rfrag_deletion_bound(self, crowds: dict[str, int]) -> Any:
        """Report fragments: batches from independent shufflers hold different users.

        ``crowds`` maps ``"<shuffler>#<i>"`` to each batch's size; each batch carries the rows
        routed to its shuffler.
        """
        ids = sorted(crowds)
        rows = [max(1, len(self.rows_of(s.split("#")[0]))) for s in ids]
        return rfrag_across_batches(
            self.params.eps_b, self.params.eps_f, [crowds[s] for s in ids], rows, self.config.delta
        )
