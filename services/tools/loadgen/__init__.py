"""A load generator for a deployment's ingest (``POST /v1/contributions``): real devices in
protocol terms, sealed ahead of time, replayed at a target rate.

Every simulated device is a device as PROTOCOL.md defines one: its own client token, enrolled
over HTTP at each shuffler (``POST /v1/enroll``), its own report encoded with the channel's
mechanism (:mod:`common.mechanisms`) from the OS CSPRNG, then, for every epoch it reports in,
its fragments HPKE-sealed to the analyzer key of the signed collection config (bound to that
channel, epoch and crowd) inside a fresh contribution (its own nonce) sealed to the shuffler it
routes to, with the key that shuffler's own descriptor vouches for. Only public keys are shared.

Sealing is the expensive part in Python (one HPKE seal, ~0.13 ms, per fragment: ~4 ms for a
31-fragment k-RAPPOR report), so it runs in worker processes ahead of the run
(:class:`SealerPool`): each worker keeps its shard of devices and writes one file of ready HTTP
requests per epoch. By default a device encodes its report once and re-sends it (memoized,
as the permanent randomized response of RAPPOR, Erlingsson et al. CCS 2014), sealed anew for
each epoch; ``fresh=True`` re-encodes it for every epoch. One pool serves every channel of the
config (``channel=``), and a device's report can carry a given value (``values=``: the
population's truth, for ``esa loadtest``'s verification). A longitudinal channel's devices
(:meth:`SealerPool.add_series`) run their own tree state (Erlingsson et al. 2019, Algorithm 1)
through every period ahead of time; :class:`SeriesWaves` then sends them in waves, one epoch
each and at most one report per device in it, a report left unsent when its epoch ended going
in a later wave (``esa demo``, ``esa loadtest``): a slow machine takes more epochs, never loses a
period.

:class:`Driver` replays those files (:class:`EpochSource`: only the current epoch's requests,
switching at each boundary) over keep-alive HTTP/1.1 connections with bounded concurrency,
paced to a rate or as fast as the servers answer; it honours ``429`` + ``Retry-After`` and
counts every answer by status. The client is a small asyncio HTTP/1.1 client: on this 2-core
class of machine general-purpose Python clients cost more CPU per request than the shuffler
itself (docs/benchmarks.md, "Shuffler") and would measure themselves.

By job: :mod:`.target` (the verified config and a channel of it), :mod:`.http` (the client),
:mod:`.devices` (enrolment and the sealing pool), :mod:`.waves` (longitudinal waves),
:mod:`.replay` (sources, pacing, statistics, the driver), :mod:`.processes` (``/proc``). This
package re-exports their public names.
"""

from services.tools.loadgen.devices import (
    SealerPool,
    SealTiming,
    ZipfValues,
    domain_of,
    enroll,
)
from services.tools.loadgen.http import HttpConnection, Response
from services.tools.loadgen.processes import Usage, process_tree, process_usage
from services.tools.loadgen.replay import (
    ChannelSource,
    Driver,
    EpochSource,
    Pace,
    Request,
    Source,
    Stats,
    percentile,
    read_requests,
)
from services.tools.loadgen.target import (
    ATTEMPTS,
    ENROLL,
    INGEST,
    RECORD,
    LoadError,
    Target,
    fetch_config,
    fetch_target,
)
from services.tools.loadgen.waves import EMPTY_WAVES, SeriesWaves, Wave

__all__ = [
    "ATTEMPTS",
    "EMPTY_WAVES",
    "ENROLL",
    "INGEST",
    "RECORD",
    "ChannelSource",
    "Driver",
    "EpochSource",
    "HttpConnection",
    "LoadError",
    "Pace",
    "Request",
    "Response",
    "SealTiming",
    "SealerPool",
    "SeriesWaves",
    "Source",
    "Stats",
    "Target",
    "Usage",
    "Wave",
    "ZipfValues",
    "domain_of",
    "enroll",
    "fetch_config",
    "fetch_target",
    "percentile",
    "process_tree",
    "process_usage",
    "read_requests",
]
