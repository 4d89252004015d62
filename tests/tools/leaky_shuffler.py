"""A deliberately broken shuffler for the audit tests: the real shuffler process (``esa shuffler
serve``) with the faults named in ``ESA_AUDIT_LEAKS`` (comma-separated) switched on. Test-only:
it refuses to start with ``ESA_SHUFFLER_ENVIRONMENT=production``.

* ``noshuffle``: the CSPRNG shuffle is the identity, so a batch keeps the stored (arrival)
  order and Algorithm 3's survivors are the oldest contributions (biased deletion);
* ``keepall``: no randomized deletion and no threshold: every group is released whole;
* ``openmetrics``: ``/metrics`` (exact counts) answers without a token;
* ``timestamp``: every batch body carries an extra ``released_at`` field (still signed);
* ``early``: a group is evaluated at the first batching round after it appears, before its
  epoch closes (released by arrival, as ``max_batch`` once did).

Run as ``python -m tests.tools.leaky_shuffler``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def apply(leaks: set[str]) -> None:
    """Switch the named faults on in this process."""
    import common.randomness
    import common.wire
    import shuffler.app
    import shuffler.batcher
    import shuffler.service

    if "noshuffle" in leaks:
        common.randomness.shuffle = lambda rng, items: None  # type: ignore[assignment]
    if "keepall" in leaks:

        def keep_all(n: int, policy: Any, rng: Any) -> Any:
            return shuffler.batcher.Deletion(shuffler.batcher.GroupStatus.RELEASED, n, n)

        shuffler.batcher.randomized_deletion = keep_all
    if "early" in leaks:
        shuffler.service.due = lambda *args: True
    if "openmetrics" in leaks:
        real = shuffler.app.add_operational_routes

        def open_routes(app: Any, engine: Any, registry: Any, token: Any = None) -> None:
            real(app, engine, registry, None)

        shuffler.app.add_operational_routes = open_routes  # type: ignore[assignment]
    if "timestamp" in leaks:
        body = common.wire.Batch.body

        def stamped(self: Any) -> bytes:
            data = json.loads(body(self))
            return json.dumps({**data, "released_at": time.time()}).encode()

        common.wire.Batch.body = stamped  # type: ignore[method-assign]


def main() -> None:
    if os.environ.get("ESA_SHUFFLER_ENVIRONMENT") == "production":
        sys.exit("the leaky shuffler is a test fixture and never runs in production")
    apply(set(filter(None, os.environ.get("ESA_AUDIT_LEAKS", "").split(","))))
    from services.cli.servers import shuffler_serve

    shuffler_serve.main(args=[], standalone_mode=True)


if __name__ == "__main__":
    main()
