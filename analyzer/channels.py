"""A configured channel: its config and its mechanism with the parameters bound
(:func:`common.mechanisms.registry.build`, once per channel).

The analyzer treats every mechanism the same way through the bound mechanism's methods;
everything mechanism-specific lives in the mechanism's module (:mod:`common.mechanisms.base`).
:class:`ChannelRuntime` adds only what is the channel's: its δ, its ``max_fragments`` and where
each shuffler sits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from analyzer.errors import InvalidChannelError
from analyzer.records import ReceivedRange
from common.mechanisms import (
    Accumulator,
    BatchContext,
    BoundMechanism,
    FragmentCount,
    NoDataError,
    Received,
    ReleaseCertificate,
    build,
)
from common.wire import ChannelConfig

#: How far above a mechanism's mean fragment count a channel's ``max_fragments`` must sit when
#: it is below the mechanism's maximum (the default catalogue keeps 8): shufflers refuse an
#: honest report above it, and the crowd check assumes that never happens.
TRUNCATION_SIGMAS = 8.0


@dataclass(frozen=True, kw_only=True)
class ChannelRuntime:
    """A configured channel: its config, its mechanism with the parameters bound (built once,
    when the channel is; the mechanism's own methods, which take no parameters, are called
    on :attr:`mechanism` directly) and the shufflers its batches come from.

    Attributes:
        config: The channel's config.
        mechanism: Its mechanism with its parameters bound.
        shuffler_ids: The registered shufflers, in the order that gives each its position.
    """

    config: ChannelConfig
    mechanism: BoundMechanism[object, Accumulator]
    shuffler_ids: tuple[str, ...]

    @classmethod
    def build(cls, config: ChannelConfig, shuffler_ids: Sequence[str]) -> ChannelRuntime:
        """Validate the channel with its mechanism's own checks.

        Raises:
            InvalidChannelError: naming the channel and what is wrong.
        """
        try:
            mechanism = build(config)
        except (TypeError, ValueError) as error:
            raise InvalidChannelError(f"channel {config.id!r}: {error}") from error
        _check_fragment_bounds(config, mechanism, len(shuffler_ids))
        if config.payload_size < mechanism.payload_size + 4:
            raise InvalidChannelError(
                f"channel {config.id!r}: payload_size={config.payload_size} is smaller than the "
                f"{mechanism.payload_size + 4} bytes a {config.mechanism} fragment needs padded"
            )
        return cls(config=config, mechanism=mechanism, shuffler_ids=tuple(shuffler_ids))

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
        count = self.mechanism.fragment_count(self.source(shuffler_id))
        return count.accepting(self.config.max_fragments)

    def add(
        self, accumulator: Accumulator, fragments: Sequence[bytes], n: int, shuffler_id: str
    ) -> int:
        """Fold one batch from ``shuffler_id`` in (the mechanism's ``accumulate`` at that
        shuffler's position); returns the invalid fragments (chaff)."""
        return self.mechanism.accumulate(accumulator, fragments, n, self.source(shuffler_id))

    def certify(self, received: Sequence[Received[Accumulator]]) -> ReleaseCertificate:
        """The release certificate over what was received, at the channel's δ.

        Raises:
            NoDataError: nothing in ``received`` a certificate can rest on.
        """
        return self.mechanism.certify(self.config.delta, received)

    def crowds(self, received: ReceivedRange) -> list[Received[Accumulator]]:
        """What the mechanism certifies from: each stored (epoch, shuffler) with its batches."""
        return [
            Received(
                epoch=s.epoch,
                shuffler_id=s.shuffler_id,
                batches=received.batch_sizes.get((s.epoch, s.shuffler_id), ()),
                accumulator=self.mechanism.load_accumulator(s.state),
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
    config: ChannelConfig, mechanism: BoundMechanism[object, Accumulator], shufflers: int
) -> None:
    """The channel's ``[min_fragments, max_fragments]`` must hold every honest contribution
    to every shuffler (up to a tail :data:`TRUNCATION_SIGMAS` standard deviations out), since
    shufflers refuse the rest and the analyzer verifies crowds against the mechanism's law.

    Raises:
        InvalidChannelError: naming the bound and what an honest report can carry.
    """
    for index in range(max(1, shufflers)):
        count = mechanism.fragment_count(BatchContext(index, max(1, shufflers)))
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
