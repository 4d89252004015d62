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

#: How far above a mechanism's mean fragment count a channel's ``max_fragments`` must sit when
#: it is below the mechanism's maximum (the default catalogue keeps 8): shufflers refuse an
#: honest report above it, and the crowd check assumes that never happens.
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
        _check_fragment_bounds(config, mechanism, params, len(shuffler_ids))
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
        """What one contribution to ``shuffler_id`` carries: the mechanism's law, and at most
        the channel's ``max_fragments`` (what shufflers accept from any client, honest or not).
        The untruncated law is kept: where ``max_fragments`` cuts its tail the accepted
        contributions' mean can only be lower, so an error can only cut an honest batch's
        verified crowd, never let a claim through (and :meth:`build` refuses a
        ``max_fragments`` that would cut more than a negligible tail). Bernstein's range term
        stays the law's (:attr:`FragmentCount.honest_maximum`)."""
        count = self.mechanism.fragment_count(self.params, self.source(shuffler_id))
        return count.accepting(self.config.max_fragments)

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
                epoch=s.epoch,
                shuffler_id=s.shuffler_id,
                batches=received.batch_sizes.get((s.epoch, s.shuffler_id), ()),
                accumulator=self.load(s.state),
                source=self.source(s.shuffler_id),
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


def _check_fragment_bounds(
    config: ChannelConfig, mechanism: Mechanism[Any, Any], params: Any, shufflers: int
) -> None:
    """The channel's ``[min_fragments, max_fragments]`` must hold every honest contribution
    to every shuffler (up to a tail :data:`TRUNCATION_SIGMAS` standard deviations out), since
    shufflers refuse the rest and the analyzer verifies crowds against the mechanism's law.

    Raises:
        InvalidChannelError: naming the bound and what an honest report can carry.
    """
    for index in range(max(1, shufflers)):
        count = mechanism.fragment_count(params, BatchContext(index, max(1, shufflers)))
        if config.min_fragments > count.minimum:
            raise InvalidChannelError(
                f"channel {config.id!r}: min_fragments={config.min_fragments}, but a "
                f"{config.mechanism} contribution can carry {count.minimum} (shufflers would "
                "refuse honest reports)"
            )
        if count.mean is None or count.variance is None or config.max_fragments >= count.maximum:
            continue
        tail = count.mean + TRUNCATION_SIGMAS * math.sqrt(count.variance)
        if config.max_fragments < tail:
            raise InvalidChannelError(
                f"channel {config.id!r}: max_fragments={config.max_fragments} would refuse "
                f"honest {config.mechanism} reports (mean {count.mean:.1f}, sd "
                f"{math.sqrt(count.variance):.1f} fragments): set at least {math.ceil(tail)}"
            )
