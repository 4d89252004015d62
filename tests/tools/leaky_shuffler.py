"""A deliberately broken shuffler for the audit tests: the real shuffler process (``esa shuffler
serve``) with the faults named in ``ESA_AUDIT_LEAKS`` (comma-separated) switched on. Test-only:
it refuses to start with ``ESA_SHUFFLER_ENVIRONMENT=production``.

* ``noshuffle``: the CSPRNG shuffle is the identity, so a batch keeps the stored (arrival)
  order and Algorithm 3's survivors are the oldest contributions (biased deletion);
* ``oldestfirst``: biased deletion alone: Algorithm 3 keeps its count law (one Laplace draw)
  and the batch is still shuffled, but the ``kept`` survivors are the group's oldest
  contributions (the newest ``n − kept`` are deleted) instead of a uniformly chosen set;
* ``keepall``: no randomized deletion and no threshold: every group is released whole;
* ``belowcrowd``: no threshold alone: Algorithm 3 still draws its noise and deletes, but a
  group it would hold (⌊n̂⌋ < ``min_crowd``) is released anyway, with the contributions it
  has (a held group's ``Deletion.deleted`` is 0), so groups below ``min_crowd`` go out;
* ``openmetrics``: ``/metrics`` (exact counts) answers without a token;
* ``timestamp``: every batch body carries an extra ``released_at`` field (still signed);
* ``token``: every batch body carries an extra ``client_token`` field (a client credential's
  shape, still signed);
* ``early``: a group is evaluated at the first batching round after it appears, before its
  epoch closes (released by arrival, as ``max_batch`` once did).

Run as ``python -m tests.tools.leaky_shuffler``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from typing import Any

import numpy as np


def apply(leaks: set[str]) -> None:
    """Switch the named faults on in this process."""
    import common.randomness
    import common.wire
    import shuffler.app
    import shuffler.batcher
    import shuffler.service

    if "noshuffle" in leaks:
        common.randomness.shuffle = lambda rng, items: None
    if "keepall" in leaks:

        def keep_all(n: int, policy: Any, rng: Any) -> Any:
            return shuffler.batcher.Deletion(shuffler.batcher.GroupStatus.RELEASED, n, n)

        shuffler.batcher.randomized_deletion = keep_all
    if "belowcrowd" in leaks:
        decide = shuffler.batcher.randomized_deletion

        def no_threshold(n: int, policy: Any, rng: Any) -> Any:
            deletion = decide(n, policy, rng)
            if deletion.status is shuffler.batcher.GroupStatus.HELD:
                return shuffler.batcher.Deletion(shuffler.batcher.GroupStatus.RELEASED, n, n)
            return deletion

        shuffler.batcher.randomized_deletion = no_threshold
    if "oldestfirst" in leaks:

        def oldest(self: Any, n: int, kept: int) -> Any:
            if not 0 <= kept <= n:
                raise ValueError(f"need 0 <= kept <= n, got {kept=}, {n=}")
            return np.arange(kept, dtype=np.int64)  # row positions in id (arrival) order

        shuffler.batcher.Batcher.survivors = oldest  # type: ignore[method-assign]
    if "early" in leaks:
        shuffler.service.group_due = lambda *args: True  # type: ignore[attr-defined]
    if "openmetrics" in leaks:
        real = shuffler.app.add_operational_routes  # type: ignore[attr-defined]

        def open_routes(app: Any, engine: Any, registry: Any, token: Any = None) -> None:
            real(app, engine, registry, None)

        shuffler.app.add_operational_routes = open_routes  # type: ignore[attr-defined,assignment]
    if "timestamp" in leaks:
        body = common.wire.Batch.body

        def stamped(self: Any) -> bytes:
            data = json.loads(body(self))
            return json.dumps({**data, "released_at": time.time()}).encode()

        common.wire.Batch.body = stamped  # type: ignore[method-assign]
    if "token" in leaks:
        unstamped = common.wire.Batch.body

        def with_token(self: Any) -> bytes:
            data = json.loads(unstamped(self))
            return json.dumps({**data, "client_token": secrets.token_urlsafe(32)}).encode()

        common.wire.Batch.body = with_token  # type: ignore[method-assign]


def main() -> None:
    if os.environ.get("ESA_SHUFFLER_ENVIRONMENT") == "production":
        sys.exit("the leaky shuffler is a test fixture and never runs in production")
    apply(set(filter(None, os.environ.get("ESA_AUDIT_LEAKS", "").split(","))))
    from services.cli.servers import shuffler_serve

    shuffler_serve.main(args=[], standalone_mode=True)


if __name__ == "__main__":
    main()
