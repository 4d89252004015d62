"""A shuffler adopts channel changes from the analyzer's signed config, checking them: the
signature with the key it pins, no live channel's policy changed, no retirement undone, its own
floor for randomized deletion; a retired channel's contributions get ``409 channel_retired``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from fastapi.testclient import TestClient

from analyzer.app import create_app
from analyzer.catalog import RETIRE_MARGIN_SECONDS
from common.collection import ANALYZER_PARTY, CollectionConfigError, sign_config
from common.envelope import key_id, public_bytes
from common.wire import (
    AnalyzerInfo,
    ChannelConfig,
    ChannelPolicy,
    CollectionConfig,
    HpkeKey,
    b64,
)
from shuffler.errors import ChannelRetiredError, UnknownChannelError
from shuffler.policies import MAX_CONFIG_BYTES, ChannelPolicies, PolicyFloor
from shuffler.service import ShufflerService

from ..analyzer.helpers import CHANNEL, app_settings
from ..support import wait_until
from .factory import EPOCH_SECONDS, POLICY, fill, make_service, pending

FLOOR = PolicyFloor(min_crowd=10, max_eps_cr=2.0, max_delta_cr=1e-5)
ADMIN = {"Authorization": "Bearer development"}
SEARCH = CHANNEL.model_copy(update={"id": "search", "eps_cr": 1.0, "delta_cr": 1e-6})


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """A real analyzer app (SQLite): the party whose signed config the shuffler follows."""
    with TestClient(create_app(app_settings(tmp_path / "analyzer"))) as analyzer:
        yield analyzer


def _policy(**changes: Any) -> ChannelPolicy:
    return ChannelPolicy(id="search", min_crowd=20, eps_cr=1.0, delta_cr=1e-6).model_copy(
        update=changes
    )


def test_new_channels_are_adopted_and_live_ones_never_change() -> None:
    policies = ChannelPolicies([POLICY], FLOOR)
    adoption, persist = policies.adopt([_policy(), POLICY], revision=1)
    assert adoption.added == ["search"] and persist == [_policy()]
    assert policies.get("search") == _policy()
    changed, persist = policies.adopt([_policy(min_crowd=500)], revision=2)
    assert "min_crowd" in changed.refused["search"] and persist == []
    assert policies.get("search") == _policy()  # kept as adopted
    retired, persist = policies.adopt([_policy(retired_from_epoch=9)], revision=3)
    assert retired.retired == ["search"] and persist == [_policy(retired_from_epoch=9)]
    policies.adopt([_policy()], revision=4)  # a retirement is never undone
    assert policies.get("search") == _policy(retired_from_epoch=9)
    policies.adopt([_policy(id="late")], revision=2)  # older than one adopted: nothing
    assert policies.get("late") is None


@pytest.mark.parametrize(
    ("field", "value"), [("min_crowd", 9), ("eps_cr", 2.5), ("delta_cr", 1e-4)]
)
def test_a_new_channel_below_the_shufflers_floor_is_refused(field: str, value: float) -> None:
    policies = ChannelPolicies([], FLOOR)
    adoption, persist = policies.adopt([_policy(**{field: value})], revision=1)
    assert field in adoption.refused["search"] and persist == []
    assert policies.get("search") is None


def test_a_shuffler_follows_the_analyzers_signed_config(
    client: TestClient,
    tmp_path: Path,
) -> None:
    signed = client.get("/v1/config").json()
    pinned = signed["config"]["analyzer"]["signing_key"]
    url = f"sqlite:///{tmp_path / 's.db'}"
    homepage = POLICY.model_copy(update=CHANNEL.policy().model_dump())
    service, clock = make_service(
        url,
        tmp_path,
        policy=homepage,
        analyzer_url="http://testserver",
        analyzer_key=pinned,
    )
    clock.now = time.time()
    follower = service.follower
    assert follower is not None
    added = client.post("/v1/admin/channels", json=SEARCH.model_dump(mode="json"), headers=ADMIN)
    assert added.status_code == 201, added.text
    adoption = follower.fetch(client)
    assert adoption is not None and adoption.added == ["search"] and not adoption.refused
    assert service.policies.get("search") == SEARCH.policy()
    token = service.tokens.issue()
    assert pending(service, token, clock.epoch, channel="search").contribution.channel_id
    before = time.time()  # the analyzer retires by its own clock, read during the call
    assert client.post("/v1/admin/channels/search/retire", headers=ADMIN).status_code == 200
    after = time.time()
    assert follower.fetch(client) is not None
    retired_from = service.policies.get("search").retired_from_epoch  # type: ignore[union-attr]
    assert retired_from in {_first_retired(moment) for moment in (before, after)}
    clock.now = float(retired_from * SEARCH.epoch_seconds)  # the first retired epoch
    with pytest.raises(ChannelRetiredError, match="retired from epoch"):
        pending(service, token, clock.epoch, channel="search")
    # a replica (or a restart) over the same database serves what was adopted
    replica, _ = make_service(
        url, tmp_path, policy=homepage, analyzer_url="http://x", analyzer_key=pinned
    )
    with pytest.raises(UnknownChannelError):
        pending(replica, token, clock.epoch, channel="search")
    replica.load_state()
    assert replica.policies.get("search") == service.policies.get("search")


def _first_retired(now: float) -> int:
    """The first epoch of SEARCH a retirement at ``now`` retires: the next one, or the one
    after when the next starts too soon for shufflers to learn of it (analyzer.catalog)."""
    seconds = SEARCH.epoch_seconds
    first = int(now // seconds) + 1
    return first + 1 if first * seconds - now < min(RETIRE_MARGIN_SECONDS, seconds / 2) else first


def test_a_config_signed_by_another_key_is_not_adopted(
    client: TestClient,
    tmp_path: Path,
) -> None:
    other = b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
    service, _ = make_service(
        f"sqlite:///{tmp_path / 's.db'}",
        tmp_path,
        analyzer_url="http://testserver",
        analyzer_key=other,
    )
    added = client.post("/v1/admin/channels", json=SEARCH.model_dump(mode="json"), headers=ADMIN)
    assert added.status_code == 201, added.text
    assert service.follower is not None
    with pytest.raises(CollectionConfigError, match="does not verify"):
        service.follower.fetch(client)
    assert service.policies.get("search") is None


class ForgedAnalyzer:
    """A real HTTP server answering ``GET /v1/config`` with whatever a test sets: an analyzer
    that signs what it likes with its own key, or answers garbage."""

    def __init__(self) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.body = b"{}"
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                self.wfile.write(owner.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def sign(self, revision: int, issued_at: float, channels: list[ChannelConfig]) -> None:
        """Serve a config it signed."""
        hpke = X25519PrivateKey.generate().public_key()
        config = CollectionConfig(
            revision=revision,
            issued_at=int(issued_at),
            expires_at=int(issued_at) + 10**7,
            analyzer=AnalyzerInfo(
                url=self.url,
                keys=[HpkeKey(key_id=key_id(hpke).hex(), public_key=b64(public_bytes(hpke)))],
                signing_key=b64(public_bytes(self.key.public_key())),
            ),
            shufflers=[],
            channels=channels,
        )
        self.body = sign_config(config, self.key).model_dump_json().encode()


@pytest.fixture
def forged(tmp_path: Path) -> Iterator[tuple[ForgedAnalyzer, ShufflerService]]:
    analyzer = ForgedAnalyzer()
    pinned = b64(public_bytes(analyzer.key.public_key()))
    service, clock = make_service(
        f"sqlite:///{tmp_path / 's.db'}",
        tmp_path,
        analyzer_url=analyzer.url,
        analyzer_key=pinned,
        config_refresh_seconds=0.2,
    )
    clock.now = time.time()
    yield analyzer, service
    analyzer.server.shutdown()


def test_garbage_from_the_analyzer_url_is_refused_and_the_follower_lives_on(
    forged: tuple[ForgedAnalyzer, ShufflerService],
) -> None:
    analyzer, service = forged
    assert service.follower is not None
    with httpx.Client() as http:
        for body, why in (
            (b"[1, 2, 3]", "JSON list"),
            (b"null", "JSON NoneType"),
            (b"{" * 10, "not JSON"),
            (b" " * (MAX_CONFIG_BYTES + 1), "over"),
        ):
            analyzer.body = body
            with pytest.raises(CollectionConfigError, match=why):
                service.follower.fetch(http)
        analyzer.sign(1, time.time(), [SEARCH])
        runner = threading.Thread(target=service.follower.run, args=(http,), daemon=True)
        analyzer.body = b"[1]"
        runner.start()  # the loop survives a refusal and adopts the next honest config
        time.sleep(0.2)
        analyzer.sign(1, time.time(), [SEARCH])
        service.follower.wake()
        wait_until(lambda: service.policies.get("search") is not None, timeout=15)
        service.follower.stop()
        runner.join(10)


def test_a_config_from_the_future_does_not_lock_out_the_honest_ones_after_it(
    forged: tuple[ForgedAnalyzer, ShufflerService],
) -> None:
    analyzer, service = forged
    assert service.follower is not None
    with httpx.Client() as http:
        analyzer.sign(1, time.time() + 10**6, [])  # an analyzer clock stepped ahead
        assert service.follower.fetch(http) is not None
        analyzer.sign(2, time.time(), [SEARCH])
        adoption = service.follower.fetch(http)
        assert adoption is not None and adoption.added == ["search"]
        analyzer.sign(1, time.time() + 1, [SEARCH, SEARCH.model_copy(update={"id": "late"})])
        with pytest.raises(CollectionConfigError, match="revision 1 is older"):
            service.follower.fetch(http)  # its channel log went back: refused, and said so
        assert service.policies.get("late") is None


def test_the_followed_analyzer_key_is_kept_for_restarts_and_replicas(
    forged: tuple[ForgedAnalyzer, ShufflerService], tmp_path: Path
) -> None:
    analyzer, service = forged
    assert service.follower is not None
    with httpx.Client() as http:
        analyzer.sign(1, time.time(), [SEARCH])
        assert service.follower.fetch(http) is not None
    stored = service.store.followed_key(ANALYZER_PARTY)
    assert stored == b64(public_bytes(analyzer.key.public_key()))
    # a replica whose configured key names another signer (a swapped analyzer.pub): the key
    # followed so far wins, and a config that does not descend from it is refused
    thief = ForgedAnalyzer()
    replica, clock = make_service(
        f"sqlite:///{tmp_path / 's.db'}",
        tmp_path,
        analyzer_url=thief.url,
        analyzer_key=b64(public_bytes(thief.key.public_key())),
    )
    clock.now = time.time()
    replica.load_state()
    assert replica.follower is not None
    thief.sign(2, time.time(), [SEARCH.model_copy(update={"id": "stolen"})])
    with httpx.Client() as http, pytest.raises(CollectionConfigError):
        replica.follower.fetch(http)
    assert replica.policies.get("stolen") is None
    thief.server.shutdown()


def test_no_group_is_evaluated_before_the_analyzers_config_places_this_shuffler(
    client: TestClient, tmp_path: Path
) -> None:
    """A following shuffler that has not adopted its analyzer's config (just started, the
    analyzer not up yet) cannot tell the crowd the analyzer will verify: its due groups stay
    pending, none is sent to be withheld as below ``min_crowd``; once the config that lists it
    is adopted, they are evaluated."""
    signed = client.get("/v1/config").json()
    homepage = POLICY.model_copy(update=CHANNEL.policy().model_dump())
    service, clock = make_service(
        f"sqlite:///{tmp_path / 's.db'}",
        tmp_path,
        policy=homepage,
        analyzer_url="http://testserver",
        analyzer_key=signed["config"]["analyzer"]["signing_key"],
    )
    clock.now = time.time()
    assert service.follower is not None and service.follower.position is None
    fill(service, clock.epoch, homepage.min_crowd + 5)
    clock.now += homepage.epoch_seconds + service.settings.epoch_grace_seconds + 1
    assert service.run_batching() == 0
    assert service.ledger()["pending"] == homepage.min_crowd + 5
    assert service.follower.fetch(client) is not None
    assert service.follower.position is not None
    assert service.run_batching() == 1
    assert service.ledger()["pending"] == 0


def test_a_stalling_analyzer_costs_a_batching_round_one_config_fetch(tmp_path: Path) -> None:
    """Three due groups and an analyzer that holds every config fetch past its deadline: the
    round asks it once (not once per group), defers all three, and evaluates none."""
    asked: list[float] = []

    class Stalling(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(time.monotonic())
            time.sleep(2.0)  # past the follower's 1 s deadline
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        service, clock = make_service(
            f"sqlite:///{tmp_path / 's.db'}",
            tmp_path,
            analyzer_url=f"http://127.0.0.1:{server.server_address[1]}",
            analyzer_key=b64(public_bytes(Ed25519PrivateKey.generate().public_key())),
            config_fetch_deadline_seconds=1.0,
        )
        clock.now -= 3 * EPOCH_SECONDS
        for _ in range(3):
            fill(service, clock.epoch, POLICY.min_crowd + 2)
            clock.now += EPOCH_SECONDS
        assert len(service.due_groups(clock.now)) == 3
        assert service.follower is not None
        start, frozen = time.monotonic(), clock.now  # the follower's clock runs as time does
        service.follower.clock = lambda: frozen + time.monotonic() - start
        assert service.run_batching() == 0
        assert len(asked) == 1
        assert service.ledger()["pending"] == 3 * (POLICY.min_crowd + 2)
    finally:
        server.shutdown()
        server.server_close()
