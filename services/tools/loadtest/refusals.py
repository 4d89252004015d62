"""A run whose epoch the shufflers have closed: stop with a clear error, never verify it.

A shuffler refuses every contribution to a closed epoch (``400 epoch_not_open``), and verifying
such a run would read a release that holds an earlier run's contributions. So the run stops with
:class:`RefusedError`: before the load when a channel's first request is refused
(:func:`preflight`; sent again within :data:`BOUNDARY_SECONDS` of the epoch's start, where the
shuffler's clock may be a little behind), after a phase when a shuffler refused more of a
channel's contributions than it acknowledged (:func:`check_answers`), and in verification on any
refusal but the rate limit's (:func:`unexpected`).

Details: docs/loadtest.md, "Closed epochs: a second run within the same epoch".
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence

from services.tools import loadgen, stopping
from services.tools.loadgen import ChannelSource

#: The shuffler's error code for a contribution to an epoch that is not open (closed by an
#: admin, or past): ``shuffler.errors.EpochNotOpenError.code``.
EPOCH_NOT_OPEN = "epoch_not_open"
#: Seconds after an epoch's start in which ``epoch_not_open`` may be clock skew (the
#: shuffler still in the previous epoch), not a closed epoch.
BOUNDARY_SECONDS = 5.0
#: Refusals that only pace the run (the per-client rate limit): waited out within the epoch,
#: and one still refused at the epoch's end is the deployment limiting the load, not a fault.
RETRIED = frozenset({"rate_limited"})
#: What to do about a closed epoch (the end of every message).
ADVICE = (
    "a closed epoch stays closed until it ends: wait for the next epoch and run again, or "
    "load-test a fresh deployment (esa loadtest --up)"
)


class RefusedError(loadgen.LoadError):
    """The shufflers refused the run's contributions (a closed epoch): not verified."""


class _One:
    """A source of one request."""

    def __init__(self, request: loadgen.Request) -> None:
        self.request: loadgen.Request | None = request

    def next(self, now: float) -> loadgen.Request | None:
        """The request, once."""
        found, self.request = self.request, None
        return found


def preflight(driver: loadgen.Driver, source: ChannelSource, channels: int | None = None) -> None:
    """Send the next request of each channel of ``source`` alone (through ``driver``: it is
    the run's, counted in its stats) before the load; a channel with no request now (its
    first epoch has not started, so it cannot have been closed) is left to the run;
    ``channels``: only the first so many sources (the devices on true time, not the clock
    groups, whose refusals are expected).

    Raises:
        RefusedError: a shuffler refused one as ``epoch_not_open``, naming every such channel.
    """
    closed = []
    for tag, channel in enumerate(source.channels[:channels]):
        now = time.time()
        request = source.next_of(tag, now)
        if request is not None and _refused(driver, request, source.sources[tag].epoch_seconds):
            seconds = source.sources[tag].epoch_seconds
            epoch = int(now // seconds)
            closed.append(
                f"epoch {epoch} of channel '{channel}' is closed "
                f"({driver.urls[request.shuffler]} refused the run's first contribution: "
                f"400 {EPOCH_NOT_OPEN}; the next epoch starts {_when((epoch + 1) * seconds)})"
            )
    if closed:
        raise RefusedError(
            "; ".join(closed) + ". Most likely an earlier run's verification closed it (esa "
            "loadtest --admin-token closes its run's epochs at every shuffler). Stopped before "
            "the load (only the first contribution of each channel was sent), nothing "
            f"verified; {ADVICE}"
        )


def _refused(driver: loadgen.Driver, request: loadgen.Request, seconds: float) -> bool:
    """Whether ``request`` (of a channel with epochs of ``seconds``) is refused
    ``epoch_not_open`` for good: within :data:`BOUNDARY_SECONDS` of its epoch's start (half
    the epoch, for epochs shorter than twice that) a shuffler whose clock is a little behind
    ours still refuses it as a future epoch, so it is sent again each second until then (a
    refused contribution was not stored). Its epoch's end ends the wait: on epochs of 5 s or
    less the boundary was never passed, and the same request was sent again forever."""
    boundary = min(BOUNDARY_SECONDS, seconds / 2)
    while True:
        refused = driver.stats.refusals[EPOCH_NOT_OPEN]
        stopping.run(driver.run(_One(request), None, 60, until_empty=True))
        if driver.stats.refusals[EPOCH_NOT_OPEN] == refused:
            return False
        now = time.time()
        if now % seconds > boundary or now + 1.0 >= request.until:
            return True
        time.sleep(1.0)


def check_answers(
    stats: loadgen.Stats,
    urls: Sequence[str],
    channels: Sequence[str],
    epochs: Mapping[str, Sequence[int]],
) -> None:
    """After a phase: stop if a shuffler refused (400) more of a channel's contributions sent
    to it than it acknowledged (202); ``channels`` by request tag (a tag beyond them, a clock
    group's, whose refusals are expected, is left out), ``epochs``: the phase's, per channel,
    to name them.

    Raises:
        RefusedError: naming every such shuffler and channel.
    """
    refusing = []
    for (index, tag), answers in sorted(stats.by_shuffler_tag.items()):
        if tag >= len(channels):
            continue
        refused, acknowledged = answers[400], answers[202]
        if refused > acknowledged:
            cid = channels[tag]
            refusing.append(
                f"{urls[index]} refused {refused:,} of the {answers.total():,} contributions "
                f"of {cid} ({_epochs(epochs[cid])}) sent to it (400) and acknowledged "
                f"{acknowledged:,}"
            )
    if refusing:
        codes = ", ".join(f"{code} {n:,}" for code, n in stats.refusals.most_common())
        raise RefusedError(
            "; ".join(refusing) + f" (refusals by code: {codes}). With {EPOCH_NOT_OPEN}, those "
            "epochs are closed there, e.g. by an earlier run's verification; not verified (the "
            f"analyzer's release of a closed epoch holds an earlier run's data); {ADVICE}"
        )


def unexpected(refused: Counter[str], expected: frozenset[str] = frozenset()) -> list[str]:
    """A phase's refusals of contributions never delivered (by error code; the refusals
    waited out and then delivered are not among them: ``loadgen.Stats.refusals``) as
    verification problems, but for the rate limit's (:data:`RETRIED`) and the ``expected``
    codes (``esa loadtest --expect-refusal``: a fault test that makes the deployment refuse):
    the run's contributions are well-formed, so any other refusal is the deployment refusing
    part of the run, which a conservation of the acknowledged ones alone would not show."""
    allowed = RETRIED | expected
    found = {code: n for code, n in refused.most_common() if code not in allowed and n > 0}
    if not found:
        return []
    codes = ", ".join(f"{code} {n:,}" for code, n in found.items())
    return [f"{sum(found.values()):,} contributions refused by the deployment ({codes})"]


def _epochs(numbers: Sequence[int]) -> str:
    """``epoch 7`` or ``epochs 7-9``."""
    first, last = min(numbers), max(numbers)
    return f"epoch {first}" if first == last else f"epochs {first}-{last}"


def _when(at: float) -> str:
    """``at 14:00:00 UTC (in 23 min)``."""
    left = max(0.0, at - time.time())
    wait = f"{left:.0f} s" if left < 120 else f"{left / 60:.0f} min"
    return f"at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(at))} (in {wait})"
