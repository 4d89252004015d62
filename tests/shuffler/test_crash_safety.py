"""SIGKILL a real shuffler process at the two dangerous moments; nothing acknowledged is lost.

Every contribution that got a 202 must end up in exactly one forwarded batch or in the deletion
count of Algorithm 3 (or a retention purge, which these runs never reach).
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import create_engine, func, select

from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution, verify
from shuffler import tables

from ..support import (
    SMALL_CHANNEL,
    UNFOLLOWED,
    ServiceProcess,
    free_port,
    receiver,
    shuffler_process,
    wait_until,
)

pytestmark = pytest.mark.system  # starts real processes

# ε_cr = 4, δ_cr = 1e-7 (Algorithm 3): a group of 40 aborts with probability δ_cr / 4 = 2.5e-8
# and is held below min_crowd = 5 with probability ~1e-12, so a batch always comes out of
# these runs although the real process draws from the CSPRNG (SMALL_CHANNEL's settings).
CHANNEL = SMALL_CHANNEL
ADMIN = {"Authorization": "Bearer development"}


def _send(service: ServiceProcess, count: int) -> int:
    config = httpx.get(service.url + "/v1/config").json()
    public = load_x25519_public(base64.b64decode(config["public_key"]))
    epoch = int(time.time() // 3600)
    acknowledged = 0
    for _ in range(count):
        token = httpx.post(service.url + "/v1/enroll").json()["client_token"]
        blob = seal_contribution(
            Contribution(
                channel_id="homepage",
                crowd_id="",
                epoch=epoch,
                nonce=new_nonce(),
                fragments=(bytes(72),) * 2,
            ),
            "shuffler-1",
            public,
        )
        response = httpx.post(
            service.url + "/v1/contributions",
            content=blob,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/octet-stream",
            },
        )
        acknowledged += response.status_code == 202
    return acknowledged


def _deleted(db_path: Path) -> int:
    engine = create_engine(f"sqlite:///{db_path}")
    with engine.connect() as conn:
        return int(
            conn.execute(select(func.coalesce(func.sum(tables.groups.c.deleted), 0))).scalar_one()
        )


def _statuses(db_path: Path) -> list[str]:
    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(tables.batches.c.status)).scalars())
    finally:
        engine.dispose()


def _signing_key(service: ServiceProcess) -> Ed25519PublicKey:
    raw = base64.b64decode(httpx.get(service.url + "/v1/config").json()["signing_key"])
    return Ed25519PublicKey.from_public_bytes(raw)


def test_kill_after_acknowledging_before_batching(tmp_path: Path) -> None:
    with (
        receiver() as analyzer,
        shuffler_process(
            tmp_path, "shuffler-1", [CHANNEL], analyzer_url=analyzer.url, **UNFOLLOWED
        ).start() as service,
    ):
        acknowledged = _send(service, 60)
        assert acknowledged == 60
        service.kill()
        service.start()
        epoch = int(time.time() // 3600)
        close = httpx.post(
            service.url + "/v1/admin/close",
            json={"channel_id": "homepage", "epoch": epoch},
            headers=ADMIN,
            timeout=30,
        )
        assert close.status_code == 200
        wait_until(lambda: len(analyzer.bodies) >= 1)
        key = _signing_key(service)
        service.stop()
    batches = {json.loads(body)["batch_id"]: json.loads(body) for body, _ in analyzer.bodies}
    for body, signature in analyzer.bodies:
        assert verify(body, base64.b64decode(signature), key)
    forwarded = sum(b["n_contributions"] for b in batches.values())
    assert forwarded + _deleted(tmp_path / "shuffler-1" / "db.sqlite") == acknowledged


def test_kill_after_batch_creation_before_forwarding(tmp_path: Path) -> None:
    port = free_port()  # nobody listens yet: the analyzer is down
    with shuffler_process(
        tmp_path, "shuffler-1", [CHANNEL], analyzer_url=f"http://127.0.0.1:{port}", **UNFOLLOWED
    ).start() as service:
        _kill_before_forwarding(tmp_path, service, port)


def _kill_before_forwarding(tmp_path: Path, service: ServiceProcess, port: int) -> None:
    acknowledged = _send(service, 40)
    epoch = int(time.time() // 3600)
    close = httpx.post(
        service.url + "/v1/admin/close",
        json={"channel_id": "homepage", "epoch": epoch},
        headers=ADMIN,
        timeout=30,
    )
    assert close.json()["forwarded"] == 0
    service.kill()
    with receiver(port) as analyzer:
        analyzer.status = 503  # the analyzer comes back unhealthy first: the shuffler retries
        service.start()
        wait_until(lambda: len(analyzer.bodies) >= 2)
        analyzer.status = 201
        wait_until(lambda: len(analyzer.bodies) >= 3)
        # Done when the shuffler recorded the acknowledgement, not after a fixed time.
        wait_until(lambda: _statuses(tmp_path / "shuffler-1" / "db.sqlite") == ["forwarded"])
        service.stop()
    ids = [json.loads(body)["batch_id"] for body, _ in analyzer.bodies]
    assert len(set(ids)) == 1  # one batch, re-sent with the same id until acknowledged
    accepted = json.loads(analyzer.bodies[-1][0])
    assert (
        accepted["n_contributions"] + _deleted(tmp_path / "shuffler-1" / "db.sqlite")
        == acknowledged
    )
