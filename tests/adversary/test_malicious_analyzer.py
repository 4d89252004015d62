"""A malicious analyzer against a real device (the SDK pinned to ``var/trust.json``): it serves
its real config, re-signed with its real config-signing key, after changing what it says about
the shufflers (PROTOCOL.md, "Who vouches for what"). A device must refuse every such config and
send nothing anywhere.

Before devices pinned a key per trust domain, the first attack succeeded: the device enrolled
at the analyzer's "shuffler" and sent it contributions it could open (token, address, timing
and fragments).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import canonical
from common.envelope import load_or_create_ed25519
from common.wire import b64
from encoder_client import Client, ConfigError

from ..support import Deployment, QuietHandler, descriptor, handler_served


@contextmanager
def serving(answer: Callable[[str], dict[str, Any]]) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering every GET and POST with ``answer(path)`` as JSON; yields its
    URL and the paths it was asked for."""
    asked: list[str] = []

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

        def _answer(self) -> None:
            asked.append(self.path)
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            body = json.dumps(answer(self.path)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with handler_served(Handler) as url:
        yield url, asked


class Analyzer:
    """The deployment's analyzer as its operator holds it: the real config and signing key."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.key = load_or_create_ed25519(deployment.var / "keys" / "analyzer" / "signing.pem")

    def config(self) -> dict[str, Any]:
        """The config it really serves (unsigned body)."""
        document = httpx.get(self.deployment.analyzer.url + "/v1/config", timeout=10).json()
        return dict(document["config"])

    def sign(self, config: dict[str, Any]) -> dict[str, Any]:
        """A config signed with the analyzer's real key, as its ``GET /v1/config`` would."""
        return {"config": config, "signature": b64(self.key.sign(canonical(config)))}


@pytest.fixture
def analyzer(deployment: Deployment) -> Analyzer:
    return Analyzer(deployment)


def _device(deployment: Deployment, url: str, state: Path, **kwargs: Any) -> Client:
    return Client(
        url + "/v1/config",
        trust_file=deployment.trust_file,
        state_path=state,
        background=False,
        **kwargs,
    )


def _substituted(config: dict[str, Any], shuffler_url: str) -> dict[str, Any]:
    """Every shuffler replaced by the analyzer's own: its own HPKE key and signing key, the
    analyzer's URL, the shuffler's id."""
    forged = copy.deepcopy(config)
    forged["shufflers"] = [
        descriptor(
            Ed25519PrivateKey.generate(),
            X25519PrivateKey.generate(),
            str(d["descriptor"]["id"]),
            shuffler_url,
        ).model_dump(mode="json")
        for d in config["shufflers"]
    ]
    return forged


def test_a_shuffler_key_the_analyzer_substitutes_is_refused_and_nothing_is_sent(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    with serving(lambda _: {"client_token": "x", "receipt": "x"}) as (fake, asked):
        forged = analyzer.sign(_substituted(analyzer.config(), fake))
        with serving(lambda _: forged) as (evil, _), pytest.raises(ConfigError) as refused:
            _device(deployment, evil, tmp_path / "device.db")
    print("substituted shuffler keys:", refused.value)
    assert "not signed by the key pinned for it" in str(refused.value)
    assert asked == []


def test_a_shuffler_url_the_analyzer_changes_breaks_the_shuffler_signature(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    config = analyzer.config()
    with serving(lambda _: {"client_token": "x"}) as (fake, asked):
        config["shufflers"][0]["descriptor"]["url"] = fake  # the real key, routed to itself
        with serving(lambda _: analyzer.sign(config)) as (evil, _), pytest.raises(ConfigError):
            _device(deployment, evil, tmp_path / "device.db")
    assert asked == []


def test_a_shuffler_the_device_does_not_pin_is_refused(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    config = analyzer.config()
    extra = descriptor(Ed25519PrivateKey.generate(), X25519PrivateKey.generate(), "shuffler-4")
    config["shufflers"].append(extra.model_dump(mode="json"))
    with serving(lambda _: analyzer.sign(config)) as (evil, _), pytest.raises(ConfigError) as why:
        _device(deployment, evil, tmp_path / "device.db")
    assert "does not pin" in str(why.value)


def test_an_older_config_than_one_the_device_accepted_is_refused(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    old = analyzer.sign(analyzer.config())
    state = tmp_path / "device.db"
    time.sleep(1.1)  # the next config is issued a second later
    _device(deployment, deployment.analyzer.url, state).close()
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError) as refused:
        Client(
            config_file=tmp_path / "old.json",
            trust_file=deployment.trust_file,
            state_path=state,
            background=False,
        )
    print("replayed older config:", refused.value)
    assert "older than one this device accepted" in str(refused.value)


def test_an_expired_config_is_refreshed_before_sending_and_a_forged_one_sends_nothing(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    now = [time.time()]
    served = [analyzer.sign(analyzer.config())]
    with (
        serving(lambda _: {"client_token": "x", "receipt": "x"}) as (fake, asked),
        serving(lambda _: served[0]) as (evil, _),
    ):
        device = _device(deployment, evil, tmp_path / "d.db", clock=lambda: now[0])
        try:
            device.histogram("pages").report(3)
            served[0] = analyzer.sign(_substituted(analyzer.config(), fake))
            now[0] += 8 * 24 * 3600  # past the config's and the descriptors' expiry
            assert device.flush() == 0
            assert device.state.outbox_size() == 1  # kept, unsent
            with pytest.raises(ConfigError, match="expired"):
                device.histogram("pages").report(4)
        finally:
            device.close()
    assert asked == []


def test_a_config_that_leaves_out_a_pinned_shuffler_is_refused(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    """Listing one shuffler only would send every device's reports there: a shuffler that
    colludes with the analyzer would then expose all of them, not about one in K."""
    config = analyzer.config()
    config["shufflers"] = config["shufflers"][:1]
    with serving(lambda _: analyzer.sign(config)) as (evil, _), pytest.raises(ConfigError) as why:
        _device(deployment, evil, tmp_path / "device.db")
    print("a config naming shuffler-1 only:", why.value)
    assert "leaves out shuffler-2, shuffler-3" in str(why.value)
