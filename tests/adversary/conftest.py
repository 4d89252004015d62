"""One real deployment (an analyzer and three shufflers, processes on 127.0.0.1) shared by the
adversary tests of a module; each test uses its own channel or epochs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.wire import MAX_EPOCH_SECONDS, ChannelConfig

from ..support import Deployment, start_deployment

#: One report per contribution: the crowd a batch claims is exactly its fragments.
PAGES = ChannelConfig(
    id="pages",
    mechanism="krr",
    params={"k": 16, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=20,
    min_fragments=1,
    max_fragments=1,
    delta=1e-8,
)
#: A random number of fragments per contribution (about 8.4 of 64 bits at ε0 = 2).
HOMEPAGE = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 64, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=20,
    max_fragments=64,
    delta=1e-8,
)


#: What honest devices report while a few malicious clients send garbage: deletion cheap
#: enough (Algorithm 3 removes ~8 contributions a group) that a batch of ~40 is released.
CLICKS = ChannelConfig(
    id="clicks",
    mechanism="krappor",
    params={"k": 16, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=20,
    eps_cr=4.0,
    delta_cr=1e-7,
    max_fragments=16,
    delta=1e-8,
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    found = start_deployment(Path(tmp_path_factory.mktemp("adversary")), [PAGES, HOMEPAGE, CLICKS])
    try:
        yield found
    finally:
        found.stop()
