"""How the demo reaches a running deployment (services/tools/demo.py ``connect``): it verifies
the collection config as a device does, with the keys of a trust file (``esa up`` writes
``var/trust.json``), one per party; without one it takes the keys the deployment serves (trust
on first use), which are the same keys here. A trust file that pins another key for a shuffler
or the analyzer refuses the config."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import TrustAnchors
from common.envelope import load_or_create_ed25519, public_bytes
from common.wire import b64
from services.tools.credentials import Credentials
from services.tools.demo import (
    _UNFORWARDED,
    DemoError,
    _wait_metric,
    analyzer_alive,
    connect,
    served_keys,
)

from ..support import (
    LONG_EPOCH_CHANNEL,
    SMALL_CHANNEL,
    Deployment,
    analyzer_process,
    own_headers,
    registry_entry,
    shuffler_process,
    start_deployment,
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    running = start_deployment(tmp_path_factory.mktemp("demo"), [LONG_EPOCH_CHANNEL], count=2)
    yield running
    running.stop()


#: start_deployment's one development token at every party (tests/support.TEST_TOKENS).
SHARED = Credentials.shared("development")


def _keys(trust: TrustAnchors) -> object:
    return trust.to_json()


@pytest.mark.system
def test_connect_verifies_the_config_with_the_pinned_keys(deployment: Deployment) -> None:
    target = connect(deployment.analyzer.url, deployment.trust_file, SHARED)
    assert target.shuffler_urls == [s.url for s in deployment.shufflers]
    assert [c.id for c in target.channels] == [LONG_EPOCH_CHANNEL.id]
    assert _keys(target.trust) == _keys(deployment.trust())
    # Without a trust file: the keys the deployment serves, which are the pinned ones here.
    served = connect(deployment.analyzer.url, None, SHARED)
    assert _keys(served.trust) == _keys(served_keys(served.document)) == _keys(deployment.trust())


@pytest.mark.system
def test_connect_takes_each_partys_own_tokens_at_the_url_its_config_names(
    deployment: Deployment,
) -> None:
    """With a key folder (``esa demo --keys``, default <var>/keys), each shuffler's admin and
    metrics tokens are read from its own folder and presented at the URL its descriptor names;
    the analyzer (no metrics token) is read with its admin token."""
    var, analyzer = deployment.var, deployment.analyzer.url
    target = connect(analyzer, deployment.trust_file, Credentials(folder=var / "keys"))
    tokens = target.tokens
    for process in deployment.shufflers:
        name = process.spec.name
        assert tokens.admin_headers(process.url) == own_headers(var, name)
        assert tokens.metrics_headers(process.url) == own_headers(var, name, "metrics-token")
    assert tokens.admin_headers(analyzer) == tokens.metrics_headers(analyzer)
    assert tokens.admin_headers(analyzer) == own_headers(var, "analyzer")
    assert tokens.admin_headers("http://127.0.0.1:9") == {}  # no party there: no token


@pytest.mark.system
def test_connect_refuses_a_config_the_pinned_keys_do_not_vouch_for(
    deployment: Deployment, tmp_path: Path
) -> None:
    pinned = json.loads(deployment.trust_file.read_text())
    other = b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
    for change, reason in (
        ({"shufflers": {**pinned["shufflers"], "shuffler-2": other}}, "'shuffler-2'"),
        ({"shufflers": {"shuffler-1": pinned["shufflers"]["shuffler-1"]}}, "does not pin"),
        ({"analyzer": other}, "refused"),
    ):
        wrong = tmp_path / "trust.json"
        wrong.write_text(json.dumps({**pinned, **change}))
        with pytest.raises(DemoError, match="is refused") as refused:
            connect(deployment.analyzer.url, wrong, SHARED)
        assert reason in str(refused.value)


@pytest.mark.system
def test_the_demo_waits_for_an_analyzer_still_fetching_descriptors(tmp_path: Path) -> None:
    """A live analyzer answers 503 shufflers_unavailable until its shufflers are up: the demo
    takes it for a live analyzer (not a free port) and waits for its config."""
    shuffler = shuffler_process(tmp_path, "shuffler-1", [SMALL_CHANNEL])  # started later
    signer = load_or_create_ed25519(tmp_path / "shuffler-1" / "keys" / "signing.pem")
    channel = LONG_EPOCH_CHANNEL.model_dump(mode="json")
    analyzer = analyzer_process(
        tmp_path, [channel], [registry_entry("shuffler-1", shuffler.url, signer)]
    )
    analyzer.start()
    try:
        assert analyzer_alive(analyzer.url)
        later = threading.Timer(2.0, shuffler.start)
        later.start()
        try:
            target = connect(analyzer.url, None, SHARED)
            assert target.shuffler_urls == [shuffler.url]
        finally:
            later.join()
            shuffler.stop()
    finally:
        analyzer.stop()


@pytest.mark.system
def test_a_refused_metrics_token_is_named_at_once(deployment: Deployment) -> None:
    url = deployment.shufflers[0].url
    wrong = Credentials.shared("not-this-shufflers-metrics-token")
    started = time.monotonic()
    with pytest.raises(DemoError, match=r"401|metrics token"):
        _wait_metric(url, _UNFORWARDED, "unforwarded batches", time.monotonic() + 3, wrong)
    assert time.monotonic() - started < 2
