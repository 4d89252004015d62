"""A load generator for a deployment's ingest (``POST /v1/contributions``): real devices in
protocol terms (docs/protocol.md), sealed ahead of time, replayed at a target rate.

:class:`SealerPool` enrolls, encodes and HPKE-seals in worker processes before the run (sealing
is the expensive part in Python), one file of ready requests per epoch; a device re-sends its
memoized report, as RAPPOR's permanent randomized response (Erlingsson et al. CCS 2014).
Longitudinal devices run their tree state (Erlingsson et al. 2019, Algorithm 1) ahead of time and
:class:`SeriesWaves` sends them one epoch per wave. :class:`Driver` replays the files over
keep-alive HTTP/1.1 at a rate or as fast as answered, waiting a refusal (``429``, ``503``)
out and sending again within its epoch, as a device's outbox does.
Modules: :mod:`.target`, :mod:`.http`, :mod:`.devices`, :mod:`.waves`, :mod:`.replay`,
:mod:`.processes`, their public names re-exported here. Design and costs: docs/loadtest.md,
"The load generator".
"""

from services.tools.loadgen.devices import (
    CLOSE_GRACE_SECONDS,
    SealerPool,
    SealTiming,
    ZipfValues,
    clock_range,
    domain_of,
    enroll,
)
from services.tools.loadgen.http import HttpConnection, Response
from services.tools.loadgen.processes import (
    ProcessTable,
    Usage,
    cpu_seconds,
    process_table,
    process_tree,
    process_usage,
    server_cpu_seconds,
    stat_fields,
    stat_seconds,
    thread_cpu_seconds,
)
from services.tools.loadgen.replay import (
    ChannelSource,
    Driver,
    EpochSource,
    FileSource,
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
    "CLOSE_GRACE_SECONDS",
    "EMPTY_WAVES",
    "ENROLL",
    "INGEST",
    "RECORD",
    "ChannelSource",
    "Driver",
    "EpochSource",
    "FileSource",
    "HttpConnection",
    "LoadError",
    "Pace",
    "ProcessTable",
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
    "clock_range",
    "cpu_seconds",
    "domain_of",
    "enroll",
    "fetch_config",
    "fetch_target",
    "percentile",
    "process_table",
    "process_tree",
    "process_usage",
    "read_requests",
    "server_cpu_seconds",
    "stat_fields",
    "stat_seconds",
    "thread_cpu_seconds",
]
