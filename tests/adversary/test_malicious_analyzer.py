"""A malicious analyzer against a real device (the SDK pinned to ``var/trust.json``): it serves
its real config, re-signed with its real config-signing key, after changing what it says about
the shufflers (docs/protocol.md, "Who vouches for what"). A device must refuse every such config and
send nothing anywhere.

Before devices pinned a key per trust domain, the first attack succeeded: the device enrolled
at the analyzer's "shuffler" and sent it contributions it could open (token, address, timing
and fragments).
"""

from __future__ import annotations

import base64
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
from common.envelope import (
    Contribution,
    load_or_create_ed25519,
    load_x25519_public,
    new_nonce,
    seal_contribution,
)
from common.wire import b64
from encoder_client import Client, ConfigError, PrivacyCapError, PrivacyCaps, PrivacyRelaxedError

from ..support import (
    Deployment,
    QuietHandler,
    descriptor,
    handler_served,
    shuffler_process,
    wait_until,
)
from .forge import MaliciousShuffler


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


def _relaxed(config: dict[str, Any], eps: float) -> dict[str, Any]:
    """The real config with channel ``pages`` raised to local ``eps`` and every device budget
    dropped, issued a second later: a document every signature check accepts."""
    relaxed = copy.deepcopy(config)
    relaxed["issued_at"] = int(config["issued_at"]) + 1
    relaxed["device_budget"] = None
    for channel in relaxed["channels"]:
        if channel["id"] == "pages":
            channel["params"] = {**channel["params"], "eps": eps}
            channel["budget"] = None
    return relaxed


def _log_line(path: Path, *parts: str) -> str:
    """The first line of a service's log holding every one of ``parts`` ("" if none yet)."""
    text = path.read_text() if path.exists() else ""
    return next((line for line in text.splitlines() if all(p in line for p in parts)), "")


def _contribute_to(deployment: Deployment, url: str, channel_id: str) -> httpx.Response:
    """One report of ``channel_id`` encoded as a device does (fragments sealed to the
    analyzer) from a newly enrolled client, sent to the shuffler at ``url``."""
    target = httpx.get(url + "/v1/config", timeout=10).json()
    key = load_x25519_public(base64.b64decode(target["public_key"]))
    config = MaliciousShuffler(deployment).channel(channel_id)
    epoch = int(time.time() // config.epoch_seconds)
    fragments = MaliciousShuffler(deployment).fragments(channel_id, epoch, [3])
    contribution = Contribution(
        channel_id=channel_id,
        crowd_id="",
        epoch=epoch,
        nonce=new_nonce(),
        fragments=tuple(base64.b64decode(f) for f in fragments),
    )
    with httpx.Client(timeout=10) as http:
        token = http.post(url + "/v1/enroll").json()["client_token"]
        return http.post(
            url + "/v1/contributions",
            content=seal_contribution(contribution, target["id"], key),
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/octet-stream",
            },
        )


@pytest.mark.system
def test_a_validly_signed_config_relaxing_a_channel_is_refused_by_device_and_shuffler(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    """Attack 2: the analyzer re-signs its config with ``pages`` at local ε 12 instead of 2 and
    no device budget (one k-RR report then all but names the value). A device that accepted
    ``pages`` refuses it and queues nothing; an app cap refuses it on a device that never saw
    the channel; a shuffler following the analyzer suspends the channel and logs why, so the
    report of a fresh device (no pins, no caps: it takes the relaxed config) is not stored."""
    honest_config = analyzer.config()
    served = [analyzer.sign(honest_config)]
    with serving(lambda _: served[0]) as (evil, _):
        follower = shuffler_process(
            tmp_path,
            "shuffler-7",
            [],
            analyzer_url=evil,
            analyzer_key=deployment.trusted_key(),
            analyzer_key_file="",  # the key above, not the launcher's file
        ).start()
        try:
            control = _device(deployment, evil, tmp_path / "control.db")
            victim = _device(deployment, evil, tmp_path / "victim.db")  # pins pages at ε 2
            wait_until(lambda: _log_line(follower.log_path, "channel added", "pages"))
            control.histogram("pages").report(3)  # honest control: reports as usual
            honest_sent = control.flush()
            honest_stored = _contribute_to(deployment, follower.url, "pages").status_code
            served[0] = analyzer.sign(_relaxed(honest_config, 12.0))
            victim.refresh_config()
            with pytest.raises(PrivacyRelaxedError) as refused:
                victim.histogram("pages").report(3)
            attacked_sent = victim.flush() + victim.state.outbox_size()
            capped = _device(deployment, evil, tmp_path / "fresh.db", caps=PrivacyCaps(local_eps=8))
            with pytest.raises(PrivacyCapError) as over_cap:
                capped.histogram("pages")
            fresh = _device(deployment, evil, tmp_path / "new.db")  # takes the relaxed terms
            fresh.histogram("pages")
            for device in (control, victim, capped, fresh):
                device.close()
            wait_until(lambda: _log_line(follower.log_path, "suspended", "pages", "local"))
            suspension = _log_line(follower.log_path, "suspended", "pages", "local")
            after = _contribute_to(deployment, follower.url, "pages")
        finally:
            follower.stop()
    error = refused.value
    print(
        f"ATTACK 2 relaxed config (pages local ε {error.old:g}->{error.new:g}, budget dropped): "
        f"device refused field {error.field!r}, contributions sent {attacked_sent}; fresh "
        f"device with cap 8 refused local ε {over_cap.value.value:g}; shuffler suspended: "
        f"{bool(suspension)}, a fresh device's report after the change answered "
        f"{after.status_code} {after.json().get('error')}; honest control sent {honest_sent}, "
        f"stored at the follower before the change {honest_stored}"
    )
    assert (error.channel_id, error.field) == ("pages", "local ε (replacement)")
    assert (error.old, error.new) == (2.0, 12.0)
    assert attacked_sent == 0 and honest_sent == 1 and over_cap.value.value == 12.0
    assert honest_stored == 202 and after.status_code == 409, after.text
    assert after.json()["error"] == "channel_terms_changed"


@pytest.mark.system
def test_a_fresh_device_reporting_after_a_relaxation_stores_nothing(
    deployment: Deployment, analyzer: Analyzer, tmp_path: Path
) -> None:
    """Attack 2b: the relaxed config of attack 2 reaches a device that never saw ``pages`` (a
    new install: no pins, no caps), whose only shuffler follows the analyzer. The shuffler
    suspended ``pages``: the device's report gets ``409 channel_terms_changed`` and is dropped,
    never counted as delivered; a device reporting before the change is stored."""
    served: list[dict[str, Any]] = [analyzer.sign(analyzer.config())]
    with serving(lambda _: served[0]) as (evil, _):
        follower = shuffler_process(
            tmp_path,
            "shuffler-7",
            [],
            analyzer_url=evil,
            analyzer_key=deployment.trusted_key(),
            analyzer_key_file="",
        ).start()
        try:
            own = httpx.get(follower.url + "/v1/descriptor", timeout=10).json()
            signing_key = httpx.get(follower.url + "/v1/config", timeout=10).json()["signing_key"]
            honest_config = {**analyzer.config(), "shufflers": [own]}
            served[0] = analyzer.sign(honest_config)
            pinned = {"shuffler-7": signing_key}

            def device(name: str) -> Client:
                return Client(
                    evil + "/v1/config",
                    trusted_key=deployment.trusted_key(),
                    shuffler_keys=pinned,
                    state_path=tmp_path / name,
                    background=False,
                )

            wait_until(lambda: _log_line(follower.log_path, "channel added", "pages"))
            control = device("control.db")
            control.histogram("pages").report(3)
            honest_sent = control.flush()
            served[0] = analyzer.sign(_relaxed(honest_config, 12.0))
            wait_until(lambda: _log_line(follower.log_path, "suspended", "pages"))
            fresh = device("fresh.db")  # takes the relaxed terms: nothing pinned to compare
            fresh.histogram("pages").report(3)
            attacked_sent = fresh.flush()
            left = fresh.state.outbox_size()
            for client in (control, fresh):
                client.close()
        finally:
            follower.stop()
    print(
        f"ATTACK 2b fresh device after the relaxation (pages local ε 2->12): delivered "
        f"{attacked_sent}, left in its outbox {left}; honest control before it delivered "
        f"{honest_sent}"
    )
    assert honest_sent == 1 and attacked_sent == 0 and left == 0
