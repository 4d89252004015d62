"""A configured channel: its mechanism (from the registry) with validated parameters.

The analyzer treats every mechanism the same way through :class:`ChannelRuntime`; everything
mechanism-specific lives in the mechanism's module (:mod:`common.mechanisms.base`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from analyzer.errors import InvalidChannelError
from analyzer.store import ReceivedRange
from common.mechanisms import (
    BatchContext,
    Estimate,
    FragmentCount,
    LocalPrivacy,
    Mechanism,
    NoDataError,
    Received,
    ReleaseCertificate,
    get,
)
from common.mechanisms.base import Accumulator
from common.wire import ChannelConfig

#: How far above a mechanism's mean fragment count a channel's ``max_fragments`` must sit for
#: the count's law to be kept under truncation (the default catalogue keeps 8).
TRUNCATION_SIGMAS = 8.0


@dataclass(frozen=True)
class ChannelRuntime:
    """A configured channel with its mechanism and validated parameters."""

    config: ChannelConfig
    mechanism: Mechanism[Any, Any]
    params: Any
    shuffler_ids: tuple[str, ...]

    @classmethod
    def build(cls, config: ChannelConfig, shuffler_ids: Sequence[str]) -> ChannelRuntime:
        """Validate the channel with its mechanism's own checks.

        Raises:
            InvalidChannelError: naming the channel and what is wrong.
        """
        try:
            mechanism = get(config.mechanism)
            params = mechanism.parse_params(config.params)
        except (TypeError, ValueError) as error:
            raise InvalidChannelError(f"channel {config.id!r}: {error}") from error
        smallest = min(
            mechanism.fragment_count(params, BatchContext(i, len(shuffler_ids))).minimum
            for i in range(max(1, len(shuffler_ids)))
        )
        if config.min_fragments > smallest:
            raise InvalidChannelError(
                f"channel {config.id!r}: min_fragments={config.min_fragments}, but a "
                f"{config.mechanism} contribution can carry {smallest} (shufflers would refuse "
                "honest reports)"
            )
        if config.payload_size < mechanism.payload_size + 4:
            raise InvalidChannelError(
                f"channel {config.id!r}: payload_size={config.payload_size} is smaller than the "
                f"{mechanism.payload_size + 4} bytes a {config.mechanism} fragment needs padded"
            )
        return cls(config, mechanism, params, tuple(shuffler_ids))

    def source(self, shuffler_id: str) -> BatchContext:
        """Where a registered shuffler sits among the K shufflers."""
        return BatchContext(self.shuffler_ids.index(shuffler_id), len(self.shuffler_ids))

    def fragment_count(self, shuffler_id: str) -> FragmentCount:
        """What one contribution to ``shuffler_id`` carries: the mechanism's count, within the
        channel's ``max_fragments`` (shufflers refuse more). Below the mechanism's maximum the
        accepted contributions follow a truncated law: its mean and variance are kept while
        ``max_fragments`` sits at least :data:`TRUNCATION_SIGMAS` standard deviations above
        the mean (the truncated mass is then negligible), else only the bounds are. Either
        way an error can only cut an honest batch's verified crowd, which makes its
        certificate more conservative, never less."""
        count = self.mechanism.fragment_count(self.params, self.source(shuffler_id))
        most = self.config.max_fragments
        if count.maximum <= most:
            return count
        mean, variance = count.mean, count.variance
        if (
            mean is not None
            and variance is not None
            and most >= mean + TRUNCATION_SIGMAS * math.sqrt(variance)
        ):
            return FragmentCount(min(count.minimum, most), most, mean, variance)
        return FragmentCount(min(count.minimum, most), most)

    def new_accumulator(self) -> Accumulator:
        """Empty sufficient statistics."""
        result: Accumulator = self.mechanism.new_accumulator(self.params)
        return result

    def load(self, data: bytes) -> Accumulator:
        """Deserialize an accumulator of this channel."""
        result: Accumulator = self.mechanism.load_accumulator(self.params, data)
        return result

    def add(
        self, accumulator: Accumulator, fragments: Sequence[bytes], n: int, shuffler_id: str
    ) -> int:
        """Fold one batch's opened fragments in; returns the invalid ones (chaff)."""
        invalid: int = self.mechanism.accumulate(
            self.params, accumulator, fragments, n, self.source(shuffler_id)
        )
        return invalid

    def estimate(self, accumulator: Accumulator) -> Estimate:
        """The mechanism's estimate."""
        result: Estimate = self.mechanism.estimate(self.params, accumulator)
        return result

    def local_privacy(self) -> LocalPrivacy:
        """What one report reveals locally."""
        result: LocalPrivacy = self.mechanism.local_privacy(self.params)
        return result

    def certify(self, received: Sequence[Received[Any]]) -> ReleaseCertificate:
        """The release certificate over what was received (NoDataError if nothing usable)."""
        result: ReleaseCertificate = self.mechanism.certify(
            self.params, self.config.delta, received
        )
        return result

    def crowds(self, received: ReceivedRange) -> list[Received[Any]]:
        """What the mechanism certifies from: each stored (epoch, shuffler) with its batches."""
        return [
            Received(
                s.epoch,
                s.shuffler_id,
                received.batch_sizes.get((s.epoch, s.shuffler_id), ()),
                self.load(s.state),
                self.source(s.shuffler_id),
            )
            for s in received.states
        ]

    def charge(self, received: ReceivedRange) -> str | None:
        """The ledger row of one epoch: its certificates at the crowds received, as JSON
        (:class:`common.wire.EpochCharge` without the key); None if nothing is certifiable."""
        try:
            certs = self.certify(self.crowds(received))
        except NoDataError:
            return None
        return json.dumps(
            {
                "certificate": certs.certified.as_dict(),
                "other_notion": certs.other.as_dict(),
                "crowds": certs.crowds,
            }
        )
