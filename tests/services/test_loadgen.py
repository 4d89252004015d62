"""The load generator (services/tools/loadgen/) against a real deployment: devices enrolled
over HTTP (through the shufflers' enrolment limit), sealed in a worker process, replayed; every
contribution acknowledged and counted where it went."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import TrustAnchors, verify_collection
from common.wire import MAX_EPOCH_SECONDS, SignedConfig
from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS
from tests.support import TEST_SHUFFLER_SETTINGS, offline_config, own_headers

DEVICES = 30


def _received(service: launcher.Service, var: Path) -> float:
    """A shuffler's contributions received, read with its own metrics token."""
    headers = own_headers(var, service.name, launcher.METRICS_TOKEN_FILE)
    answer = httpx.get(service.url + "/metrics", headers=headers, timeout=10)
    answer.raise_for_status()
    text = answer.text
    line = next(x for x in text.splitlines() if x.startswith("esa_shuffler_contributions_received"))
    return float(line.split()[-1])


@pytest.mark.system
def test_driver_delivers_every_contribution(tmp_path: Path) -> None:
    homepage = next(c for c in DEFAULT_CHANNELS if c.id == "homepage")
    # 600 enrolments a minute per address: a burst of 100, so the last devices get 429s and
    # must wait out Retry-After.
    overrides = {**TEST_SHUFFLER_SETTINGS, "ESA_SHUFFLER_ENROLL_PER_MINUTE": "600"}
    base = launcher.free_base_port(4)
    specs = launcher.prepare(tmp_path, 3, base, channels=[homepage], overrides=overrides)
    services = launcher.start_all(specs, tmp_path / "logs")
    try:
        launcher.wait_config(services[0], 60)
        trust = TrustAnchors.load(tmp_path / launcher.TRUST_FILE)
        _assert_only_the_pinned_keys_are_taken(services[0].url, trust)
        target = loadgen.fetch_target(services[0].url, trust, "homepage")
        assert [s.url for s in target.config.shufflers] == [s.url for s in services[1:]]
        tokens = asyncio.run(loadgen.enroll(target.shuffler_urls[:1], 110, 8))
        assert len(tokens[0]) == len(set(tokens[0])) == 110
        tokens = asyncio.run(loadgen.enroll(target.shuffler_urls, DEVICES, 8))
        epoch = target.epoch(time.time() + 30)  # this epoch unless it ends within 30 s
        with loadgen.SealerPool(target, workers=1) as pool:
            assert pool.add_devices(tokens).items == DEVICES
            files, timing = pool.seal_epoch(epoch, DEVICES, tmp_path)
        assert timing.items == DEVICES
        while target.epoch(time.time()) < epoch:
            time.sleep(0.5)
        driver = loadgen.Driver(target.shuffler_urls, concurrency=4)
        source = loadgen.EpochSource({epoch: files}, target.channel.epoch_seconds)
        asyncio.run(driver.run(source, rate=None, seconds=60, until_empty=True))
        assert driver.stats.accepted == DEVICES, driver.stats.errors
        assert driver.stats.errors == {}
        assert sum(_received(s, tmp_path) for s in services[1:]) == DEVICES
    finally:
        launcher.stop(services)


def _assert_only_the_pinned_keys_are_taken(url: str, trust: TrustAnchors) -> None:
    """The load generator verifies the config as a device does: another key pinned for a
    shuffler, a shuffler not pinned, or another analyzer key, and nothing is sealed."""
    other = Ed25519PrivateKey.generate().public_key()
    substituted = TrustAnchors(trust.analyzer, {**trust.shufflers, "shuffler-2": other})
    unpinned = TrustAnchors(
        trust.analyzer, {k: v for k, v in trust.shufflers.items() if k != "shuffler-3"}
    )
    for wrong, reason in (
        (substituted, "shuffler 'shuffler-2' is not signed by the key pinned for it"),
        (unpinned, "lists shuffler 'shuffler-3', whose key this device does not pin"),
        (TrustAnchors(other, trust.shufflers), "signature"),
    ):
        with pytest.raises(loadgen.LoadError, match="collection config refused") as refused:
            loadgen.fetch_target(url, wrong, "homepage")
        assert reason in str(refused.value)
    with pytest.raises(loadgen.LoadError, match="'nope' is not in the collection config"):
        loadgen.fetch_target(url, trust, "nope")


def test_driver_waits_out_retry_after() -> None:
    """A 429 with Retry-After is counted, waited out and the request sent again."""
    answers = [b"429 Too Many Requests\r\nRetry-After: 1", b"202 Accepted"]
    arrivals: list[float] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            arrivals.append(time.monotonic())
            status = answers.pop(0)
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
        writer.close()

    class One:
        def __init__(self) -> None:
            self.left = [loadgen.Request(shuffler=0, token="client.mac", body=b"sealed")]

        def next(self, now: float) -> loadgen.Request | None:
            return self.left.pop() if self.left else None

    async def scenario() -> loadgen.Driver:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        driver = loadgen.Driver([f"http://127.0.0.1:{port}"], concurrency=1)
        await driver.run(One(), rate=None, seconds=30, until_empty=True)
        server.close()
        return driver

    driver = asyncio.run(scenario())
    assert driver.stats.statuses == {429: 1, 202: 1}
    assert driver.stats.errors == {"429": 1}
    assert arrivals[1] - arrivals[0] >= 0.95


def _epoch_file(path: Path, tokens: list[str]) -> Path:
    """An epoch file of one request per token, all to shuffler 0 (the body is the token)."""
    with path.open("wb") as out:
        for token in tokens:
            encoded = token.encode()
            out.write(loadgen.RECORD.pack(0, len(encoded), len(encoded)) + encoded + encoded)
    return path


async def _scripted(
    answers: dict[str, list[bytes]], source: loadgen.Source, clock: Any = time.time
) -> loadgen.Driver:
    """A real HTTP/1.1 server on 127.0.0.1 answering each client token's requests with its
    list of status lines in turn (the last one for ever), driven by a :class:`Driver`; a line
    ``status#code`` answers that JSON error code, ``RESET`` drops the answer (the request was
    read whole, the connection is reset: a 202 the client never saw)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.split(b"\r\n")[1:]
                fields = dict(line.split(b": ", 1) for line in lines if b": " in line)
                await reader.readexactly(int(fields[b"Content-Length"]))
                token = fields[b"Authorization"].split()[1].decode()
                line = answers[token].pop(0) if len(answers[token]) > 1 else answers[token][0]
                if line == b"RESET":
                    writer.transport.abort()
                    return
                line, _, code = line.partition(b"#")
                body = b"{}" if line.startswith(b"202") else b'{"error": "%s"}' % (code or line[:3])
                head = b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n" % (line, len(body))
                writer.write(head + body)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    driver = loadgen.Driver([f"http://127.0.0.1:{port}"], concurrency=len(answers))
    try:
        await driver.run(source, rate=None, seconds=30, until_empty=True, clock=clock)
    finally:
        server.close()
    return driver


def test_refused_contributions_are_sent_again_within_their_epoch(tmp_path: Path) -> None:
    """As a device's outbox: a 503 and a 429 (with Retry-After) are waited out and sent
    again in their epoch; the run counts them refused, then delivered, apart from the one
    delivered at once."""
    answers = {
        "unavailable": [b"503 Service Unavailable\r\nRetry-After: 1", b"202 Accepted"],
        "limited": [b"429 Too Many Requests\r\nRetry-After: 1", b"202 Accepted"],
        "at-once": [b"202 Accepted"],
    }
    epoch = int(time.time() // MAX_EPOCH_SECONDS)
    source = loadgen.EpochSource(
        {epoch: [_epoch_file(tmp_path / "e.bin", list(answers))]}, MAX_EPOCH_SECONDS
    )
    start = time.monotonic()
    stats = asyncio.run(_scripted(answers, source)).stats
    assert 0.9 < time.monotonic() - start < 5  # one Retry-After, waited in parallel
    assert stats.accepted == 3 and stats.refused_then_delivered == 2
    assert stats.never_delivered == stats.given_up == 0 and not stats.refusals
    assert stats.retried == {503: 1, 429: 1} and stats.final == {202: 3}
    assert stats.errors == {"429": 1, "503": 1}  # every answer, as the live view shows it


def test_a_contribution_still_refused_when_its_epoch_ends_is_never_delivered(
    tmp_path: Path,
) -> None:
    """Retries end with the epoch (a shuffler refuses a contribution to an ended epoch for
    good): a request still answered 503 then is given up and never delivered; a 400 is not
    retried at all."""
    answers = {
        "down": [b"503 Service Unavailable\r\nRetry-After: 1"],
        "bad": [b"400 Bad Request"],
    }
    seconds = 60
    shift = (int(time.time() // seconds) + 1) * seconds - 1.5 - time.time()
    clock = lambda: time.time() + shift  # noqa: E731 - the epoch now ends in 1.5 s
    epoch = int(clock() // seconds)
    files = {epoch: [_epoch_file(tmp_path / "e.bin", list(answers))]}
    start = time.monotonic()
    stats = asyncio.run(_scripted(answers, loadgen.EpochSource(files, seconds), clock)).stats
    assert time.monotonic() - start < 1.5  # the second wait would end past the epoch
    assert stats.statuses == {503: 2, 400: 1} and stats.retried == {503: 1}
    assert stats.accepted == stats.refused_then_delivered == 0
    assert stats.never_delivered == 2 and stats.given_up == 1
    assert stats.refusals == {"503": 1, "400": 1}


def test_a_replayed_nonce_means_an_earlier_attempt_landed() -> None:
    """Behind a load balancer that resends a request whose replica died after committing it,
    the driver sees 409 ``replayed_nonce`` without a transport error of its own: that
    contribution was acknowledged once, not refused. Any other 409 (quota) stays a refusal."""
    from services.tools.loadgen import Response
    from services.tools.loadgen.replay import _replayed

    def answer(body: bytes) -> Response:
        return Response(409, {}, body)

    assert _replayed(answer(b'{"error": "replayed_nonce", "detail": "nonce already used"}'))
    assert not _replayed(answer(b'{"error": "quota_exceeded", "detail": "one per epoch"}'))
    assert not _replayed(answer(b"<html>conflict</html>"))
    assert not _replayed(answer(b"[1, 2]"))


def test_a_409_after_a_lost_answer_is_acknowledged_only_if_it_says_already_stored(
    tmp_path: Path,
) -> None:
    """A request whose answer was lost is sent again: a 409 ``replayed_nonce`` or
    ``quota_exceeded`` then says the lost attempt stored it (acknowledged, ``recovered``),
    as the SDK reads it; a 409 saying the device's config is outdated (``config_outdated``,
    ``channel_retired``, ``channel_terms_changed``) stored nothing and is a refusal: counted
    as acknowledged, verification would report a loss that never happened."""
    answers = {
        "replayed": [b"RESET", b"409 Conflict#replayed_nonce"],
        "quota": [b"RESET", b"409 Conflict#quota_exceeded"],
        "outdated": [b"RESET", b"409 Conflict#config_outdated"],
        "retired": [b"RESET", b"409 Conflict#channel_retired"],
    }
    epoch = int(time.time() // MAX_EPOCH_SECONDS)
    source = loadgen.EpochSource(
        {epoch: [_epoch_file(tmp_path / "e.bin", list(answers))]}, MAX_EPOCH_SECONDS
    )
    stats = asyncio.run(_scripted(answers, source)).stats
    assert stats.recovered == 2 and stats.accepted == 2, stats
    assert stats.never_delivered == 2 and stats.statuses[409] == 2, stats
    assert stats.refusals == {"config_outdated": 1, "channel_retired": 1}, stats


@pytest.mark.system
def test_a_sealing_worker_that_dies_fails_the_pool_instead_of_hanging(tmp_path: Path) -> None:
    """A worker killed while it seals (out of memory, a crash) closes its pipe: the step
    raises LoadError instead of waiting forever for its answer (the parent keeps no copy of
    the worker's end of the pipe)."""
    homepage = next(c for c in DEFAULT_CHANNELS if c.id == "homepage")
    offline = offline_config(tmp_path, [homepage])
    signed = SignedConfig.model_validate_json(offline.path.read_text())
    verified = verify_collection(signed, TrustAnchors.load(offline.trust_file), time.time())
    target = loadgen.Target(verified, homepage)
    failures: list[BaseException] = []

    epoch = target.epoch(time.time())

    def seal_many(pool: loadgen.SealerPool) -> None:
        try:  # a few seconds of sealing per worker (a report is sealed for each epoch)
            pool.seal_epoch(epoch, 4_000, tmp_path)
        except BaseException as error:
            failures.append(error)

    with loadgen.SealerPool(target, workers=2) as pool:
        pool.ready()
        assert pool.add_devices([["token"] * 4_000]).items == 4_000  # encoded, not sealed
        sealing = threading.Thread(target=seal_many, args=(pool,), daemon=True)
        sealing.start()
        time.sleep(1.0)  # both workers are busy sealing
        victim = pool._processes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        sealing.join(60)
        assert not sealing.is_alive(), "the pool still waits for the dead worker"
    assert len(failures) == 1 and isinstance(failures[0], loadgen.LoadError), failures
    assert "sealing worker died" in str(failures[0])


#: A root that waits for a child burning CPU under its own name, then starts ``sleep`` and
#: says so: its reaped child's CPU is in its ``cutime``.
_ROOT = """
import subprocess, sys, time
burn = "import time\\nwhile time.process_time() < 0.6: pass"
subprocess.run([sys.argv[1], "-c", burn], check=True)
subprocess.Popen(["sleep", "30"])
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.system
def test_process_table_gives_every_tree_and_a_servers_reaped_cpu(tmp_path: Path) -> None:
    """One table gives this process's tree (a root under a name of its own, its ``sleep``) and
    the root's (not this process); the root's name counts, beyond its own ticks, the 0.6 CPU-s
    of a child it reaped (at least 0.5 after the kernel's rounding of each tick count)."""
    name = "esa-test-root"
    interpreter = tmp_path / name
    interpreter.symlink_to(Path(sys.executable).resolve())  # comm is the executable's name
    with subprocess.Popen(
        [str(interpreter), "-c", _ROOT, str(interpreter)], stdout=subprocess.PIPE, text=True
    ) as root:
        try:
            assert root.stdout is not None and root.stdout.readline().strip() == "ready"
            table = loadgen.process_table()
            below = loadgen.process_tree(root.pid, table)
            assert below[0] == root.pid and root.pid in loadgen.process_tree(os.getpid(), table)
            assert [table[m][0] for m in below[1:]] == ["sleep"]
            assert os.getpid() not in below
            own = loadgen.stat_seconds(table[root.pid][1])
            assert loadgen.server_cpu_seconds(name, table) - own >= 0.5  # the reaped child's
        finally:
            for member in reversed(loadgen.process_tree(root.pid)):
                os.kill(member, signal.SIGKILL)


def test_process_table_reads_a_name_that_is_not_utf8() -> None:
    """A command name the kernel cut inside a character (not UTF-8) is read with a replacement
    character, and the rest of the table is still there."""
    comm = Path("/proc/self/comm")
    before = comm.read_bytes().rstrip(b"\n")
    comm.write_bytes(b"esa-\xc3")  # the first byte of a two-byte character, cut
    try:
        table = loadgen.process_table()
        assert table[os.getpid()][0] == "esa-\ufffd"
        assert loadgen.process_tree(os.getpid(), table)[0] == os.getpid()
    finally:
        comm.write_bytes(before)
