"""``esa loadtest`` against a real local deployment (1 analyzer + 3 shufflers as processes):
a run that verifies (conservation, estimates, certified ε), a run over several short epochs
whose estimates are verified epoch by epoch, a longitudinal channel driven through its periods
(each in its own epoch) and verified, a run that must fail because other devices
contributed to the same epoch while it ran, and runs whose epoch a shuffler had already closed
(a second run in the epoch an earlier run's verification closed; a shuffler that refused every
contribution; an epoch an admin closed at one shuffler while the load ran) that must stop with
a clear error instead of verifying."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import click
import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import TrustAnchors
from common.envelope import public_bytes
from common.wire import MAX_EPOCH_SECONDS, b64
from services.cli import launcher
from services.cli.loadtest import _clock_offsets, loadtest
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS
from services.tools.credentials import Credentials
from services.tools.loadgen import devices
from services.tools.loadtest import refusals, verify
from services.tools.loadtest.population import PopulationError, draw, draw_changes
from services.tools.loadtest.prepare import LoadPlan, clock_groups, clock_name, spec_for
from services.tools.loadtest.refusals import RefusedError, check_answers, unexpected
from services.tools.loadtest.verify import channel_problems
from tests.support import LOADTEST_PAGES as PAGES
from tests.support import LOADTEST_SERIES as ABROAD
from tests.support import TEST_SHUFFLER_SETTINGS

HOMEPAGE = next(c for c in DEFAULT_CHANNELS if c.id == "homepage")
FEATURES = next(c for c in DEFAULT_CHANNELS if c.id == "features")
#: A k-RR channel of 3-second epochs: a 12-second run spans 4-5 of them.
TICKS = PAGES.model_copy(update={"id": "ticks", "epoch_seconds": 3})
#: k-RR channels of the closed-epoch tests, each closing its current epoch: no other test may
#: send to them. Their epochs last 10^8 s, so no test waits for an epoch boundary.
AGAIN = PAGES.model_copy(update={"id": "again", "epoch_seconds": MAX_EPOCH_SECONDS})
SHUT = PAGES.model_copy(update={"id": "shut", "epoch_seconds": MAX_EPOCH_SECONDS})
MIDWAY = PAGES.model_copy(update={"id": "midway", "epoch_seconds": MAX_EPOCH_SECONDS})
KEYED = PAGES.model_copy(update={"id": "keyed", "epoch_seconds": MAX_EPOCH_SECONDS})


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(analyzer URL, trust file: the keys an app pins) of a deployment with the pages, ticks,
    features, abroad, again, shut, midway and keyed channels; every party has its own tokens
    (``var/keys/<party>/``, next to the trust file), as ``esa up`` gives them."""
    var = tmp_path_factory.mktemp("deployment")
    base = launcher.free_base_port(4)
    channels = [PAGES, TICKS, FEATURES, ABROAD, AGAIN, SHUT, MIDWAY, KEYED]
    specs = launcher.prepare(var, 3, base, channels=channels, overrides=TEST_SHUFFLER_SETTINGS)
    services = launcher.start_all(specs, var / "logs")
    try:
        launcher.wait_config(services[0], 60)
        yield services[0].url, var / launcher.TRUST_FILE
    finally:
        launcher.stop(services)


def _command(url: str, trust: Path, out: Path, *args: str, keys: Path | None = None) -> list[str]:
    """``esa loadtest`` presenting each party's own tokens (``--keys``: the deployment's
    key folder next to its trust file, unless ``keys``)."""
    return [
        sys.executable, "-m", "services.cli", "loadtest",
        "--analyzer-url", url, "--trust", str(trust), "--keys", str(keys or trust.parent / "keys"),
        "--out", str(out), "--no-live", "--drain-timeout", "60", *args,
    ]  # fmt: skip


def _tokens(url: str, trust: Path) -> Credentials:
    """Each party's own admin and metrics tokens (the deployment's ``var/keys``), by the URLs
    its config names."""
    shufflers = _target(url, trust, "pages").config.shufflers
    parties = {"analyzer": url, **{s.id: s.url for s in shufflers}}
    return Credentials(folder=trust.parent / "keys").for_parties(parties)


@pytest.mark.system
def test_loadtest_verifies_conservation_and_estimates(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    url, trust = deployment
    done = subprocess.run(
        _command(url, trust, tmp_path, "--channel", "pages", "--devices", "300", "--max"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "loadtest.json").read_text())
    run, check = summary["run"], summary["verification"]
    assert run["accepted"] == run["offered"] == 300 and run["errors"] == {}
    totals = check["conservation"]["totals"]
    assert totals["lost"] == 0 and totals["shufflers_acknowledged"] == 300
    deleted = totals["deleted"]["randomized_deletion"]
    assert totals["received_at_analyzer"] + deleted + totals["held"] == 300
    assert 0 < deleted < 150  # Algorithm 3 removes some, not most
    row = check["channels"]["pages"]
    assert row["central_eps"] is not None and 0 < row["central_eps"] < 2.0  # amplified
    assert row["inside"] >= 6 and check["problems"] == []
    assert "verification: PASS" in done.stdout
    assert "pages: " in done.stdout and "certified ε" in done.stdout
    page = (tmp_path / "loadtest.html").read_text()
    assert page.count("data:image/png;base64,") >= 3  # throughput, latency, errors


@pytest.mark.system
def test_loadtest_verifies_estimates_epoch_by_epoch_over_a_multi_epoch_run(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    # Every epoch holds one contribution of each device (its memoized report again, in a new
    # envelope), cut off where the rate leaves the epoch's end: summed over 4-5 epochs and
    # held against one contribution per device, the estimates were ~4x their target and
    # outside intervals that treated the repeated reports as independent (the issue-14 soak).
    url, trust = deployment
    args = ["--channel", "ticks", "--devices", "1500", "--population", "ticks=uniform"]
    args += ["--rate", "400", "--duration", "12"]
    done = subprocess.run(
        _command(url, trust, tmp_path, *args), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check = json.loads((tmp_path / "loadtest.json").read_text())["verification"]
    assert check["conservation"]["totals"]["lost"] == 0 and check["problems"] == []
    row = check["channels"]["ticks"]
    per_epoch = row["per_epoch"]
    assert len(per_epoch) >= 3, per_epoch.keys()  # several epochs, each checked
    assert sum(e["received"] for e in per_epoch.values()) == row["received"]
    assert all(0 < e["kept"] <= 1 and e["prepared"] == 1500 for e in per_epoch.values())
    kept = sum(e["kept"] for e in per_epoch.values())
    assert len(row["checked"]) == 10
    for combined in row["checked"]:
        assert combined["epochs"] == len(per_epoch) and combined["truth"] > 50
        assert combined["expected"] == pytest.approx(combined["truth"] * kept)
    # Each combined interval covers its target with probability >= 95%, independently per
    # bin: fewer than 4 of 10 inside has probability < 1e-7 (a sum against one device's
    # truth lands ~(E - 1) x 94 away, far outside).
    assert row["inside"] >= 4, row["checked"]
    assert "verification: PASS" in done.stdout


@pytest.mark.system
def test_loadtest_drives_a_longitudinal_channel_through_its_periods(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    url, trust = deployment
    done = subprocess.run(
        _command(url, trust, tmp_path, "--channel", "abroad", "--devices", "300", "--max"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "loadtest.json").read_text())
    run, check = summary["series"]["abroad"], summary["verification"]
    first, last = run["epochs"]
    # one wave per period on a quiet machine; a busy one may take more epochs, never fewer
    assert run["periods"] == 4 and run["waves"] == last - first + 1 >= 4
    assert run["waves"] == 4 or run["rolled_over"] > 0
    # Every device reports in the periods its level asks (d / 2^(h-1) of 4): ~7/3 each.
    assert 300 < run["accepted"] == run["offered"] < 4 * 300 and run["errors"] == {}
    totals = check["conservation"]["totals"]
    assert totals["lost"] == 0 and totals["shufflers_acknowledged"] == run["accepted"]
    deleted = totals["deleted"]["randomized_deletion"]
    assert totals["received_at_analyzer"] + deleted + totals["held"] == run["accepted"]
    row = check["channels"]["abroad"]
    assert row["received"] == totals["received_at_analyzer"] > 0
    assert row["epochs"] == [first, last] and row["method"] is not None
    assert [r["bin"] for r in sorted(row["checked"], key=lambda r: r["bin"])] == [0, 1, 2, 3]
    assert check["problems"] == [] and "verification: PASS" in done.stdout
    assert "abroad (4 periods): offered" in done.stdout


def test_state_populations_and_specs() -> None:
    found = draw_changes("changes:0.5", "abroad", 4, 2, 1000, seed=4)
    moves = found.change_periods()
    assert len(moves) == 1000 and max(len(m) for m in moves) <= 2
    assert all(1 <= t <= 4 for m in moves for t in m)
    states = np.zeros((1000, 4), dtype=np.int64)  # the truth: devices in state 1 per period
    for device, periods in enumerate(moves):
        for t in periods:
            states[device, t - 1 :] ^= 1
    assert list(found.counts) == list(states.sum(axis=0)) and found.k == 4
    with pytest.raises(PopulationError, match="changes:RATE"):
        draw_changes("zipf", "abroad", 4, 2, 10, seed=0)
    with pytest.raises(PopulationError, match=r"\[0, 1\]"):
        draw_changes("changes:2", "abroad", 4, 2, 10, seed=0)
    trust = TrustAnchors(Ed25519PrivateKey.generate().public_key(), {})
    for given, histogram, series in [
        ("words", "words", "changes"),
        ("changes:0.2", "zipf", "changes:0.2"),
    ]:
        plan = LoadPlan(
            analyzer_url="http://x",
            trust=trust,
            devices=10,
            duration=1,
            workdir=Path("."),
            populations={"*": given},
        )
        assert spec_for(plan, "homepage") == histogram and spec_for(plan, "abroad", True) == series


def _target(url: str, trust: Path, channel: str) -> loadgen.Target:
    """``channel`` of the config at ``url``, verified with the keys of ``trust``."""
    return loadgen.fetch_target(url, TrustAnchors.load(trust), channel)


def _foreign_contributions(
    url: str, trust: Path, count: int, out: Path, channel: str = "features"
) -> loadgen.EpochSource:
    """``count`` contributions from other devices to this epoch of ``channel`` (enrolled and
    sealed in this process, as loadgen's sealing workers do)."""
    target = _target(url, trust, channel)
    tokens = asyncio.run(loadgen.enroll(target.shuffler_urls, count, 4))
    epoch = target.epoch(time.time())
    config = {  # what a sealing worker is given: the verified config and shufflers
        "config": target.config.config.model_dump(mode="json"),
        "shufflers": [s.model_dump() for s in target.config.shufflers],
    }
    sealer = devices._Sealer(config, channel, loadgen.ZipfValues(8))
    sealer.add(list(zip(*tokens, strict=True)))
    sealer.seal_epoch(epoch, count, str(out / "foreign.bin"), fresh=False)
    return loadgen.EpochSource({epoch: [out / "foreign.bin"]}, target.channel.epoch_seconds)


def _within_one_epoch(seconds: float) -> None:
    """Sleep into the next hourly epoch unless ``seconds`` are left of the current one."""
    if time.time() % 3600 > 3600 - seconds:
        time.sleep(3600 - time.time() % 3600 + 1)


def _started(
    command: list[str],
) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """``esa loadtest`` in a subprocess, returned once its load starts (its ``run: `` line):
    the process, its stderr lines so far (a thread keeps reading them) and that thread."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "run: " in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(180), "".join(lines)
    return process, lines, reader


def _finished(process: subprocess.Popen[str], reader: threading.Thread) -> str:
    """Wait for a :func:`_started` load test to end; its stdout."""
    assert process.stdout is not None
    stdout = process.stdout.read()
    process.wait(180)
    reader.join(10)
    return stdout


@pytest.mark.system
def test_loadtest_fails_when_other_traffic_lands_in_its_epoch(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    url, trust = deployment
    _within_one_epoch(300)  # the extra traffic must land in the run's (hourly) epoch
    foreign = _foreign_contributions(url, trust, 40, tmp_path)
    args = ["--channel", "features", "--devices", "200", "--rate", "50", "--duration", "30"]
    process, lines, reader = _started(_command(url, trust, tmp_path / "out", *args))
    driver = loadgen.Driver(_target(url, trust, "features").shuffler_urls, 2)
    asyncio.run(driver.run(foreign, None, 30, until_empty=True))
    assert driver.stats.accepted == 40, driver.stats.errors
    stdout = _finished(process, reader)
    assert process.returncode == 1, stdout + "".join(lines)
    text = "".join(lines).replace("\n", " ")
    assert "verification: FAIL" in stdout, stdout + text
    assert "the shufflers acknowledged 240 contributions, this run saw 200" in text, text
    assert "more contributions reached the analyzer" in text, text


def _refused(urls: list[str], tokens: Credentials) -> float:
    """Contributions the shufflers refused ``epoch_not_open`` so far (their processes')."""
    key = 'esa_shuffler_contributions_rejected_total{reason="epoch_not_open"}'
    return sum(verify.scrape(u, tokens).get(key, 0.0) for u in urls)


@pytest.mark.system
def test_a_second_run_in_an_epoch_the_first_closed_stops_before_the_load(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    """The first run's verification closes its epoch at every shuffler; a second run in the
    same epoch is refused ``epoch_not_open``. It used to carry on and verify against
    the analyzer's release of that epoch, which holds the first run's data: a FAIL with bogus
    conservation numbers ("lost -1,083"). It must stop after one refused contribution, before
    the load, and say which epoch is closed and what to do."""
    url, trust = deployment
    args = ("--channel", "again", "--devices", "300", "--max")
    first = subprocess.run(
        _command(url, trust, tmp_path / "first", *args), capture_output=True, text=True, timeout=240
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "verification: PASS" in first.stdout
    urls, tokens = _target(url, trust, "again").shuffler_urls, _tokens(url, trust)
    acknowledged = sum(s["received"] for s in verify.shuffler_state(urls, tokens).values())
    refused = _refused(urls, tokens)
    epoch = int(time.time() // AGAIN.epoch_seconds)
    second = subprocess.run(
        _command(url, trust, tmp_path / "second", *args),
        capture_output=True,
        text=True,
        timeout=240,
    )
    message = " ".join(second.stderr.split())
    assert second.returncode == 1, second.stdout + message
    assert "verification" not in second.stdout and "lost" not in message, second.stdout
    assert f"epoch {epoch} of channel 'again' is closed" in message, message
    assert "earlier run's verification" in message and "wait for the next epoch" in message
    assert not (tmp_path / "second" / "loadtest.json").exists()
    # One contribution sent alone and refused: the load never went out.
    assert _refused(urls, tokens) == refused + 1
    after = verify.shuffler_state(urls, tokens)
    assert sum(s["received"] for s in after.values()) == acknowledged


@pytest.mark.system
def test_a_first_contribution_refused_on_short_epochs_stops_the_run_instead_of_looping(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    """On 3-second epochs the preflight's wait for a shuffler's clock (sent again each second
    while within 5 s of the epoch's start) never ended: ``time % 3`` is never above 5, so a
    first contribution refused ``epoch_not_open`` (here: sealed for an epoch long past, as a
    device whose clock is 5 minutes behind would) was sent again forever. Now the wait ends
    at half the epoch, or with the epoch, and the run stops with RefusedError."""
    url, trust = deployment
    target = _target(url, trust, "ticks")
    tokens = asyncio.run(loadgen.enroll(target.shuffler_urls, 1, 1))
    config = {
        "config": target.config.config.model_dump(mode="json"),
        "shufflers": [s.model_dump() for s in target.config.shufflers],
    }
    sealer = devices._Sealer(config, "ticks", loadgen.ZipfValues(8))
    sealer.add(list(zip(*tokens, strict=True)))
    now = target.epoch(time.time())
    files = {}
    for epoch in range(now, now + 4):  # handed out in whichever epoch the preflight runs
        path = tmp_path / f"past-{epoch}.bin"
        sealer.seal_epoch(now - 100, 1, str(path), fresh=False)
        files[epoch] = [path]
    source = loadgen.ChannelSource({"ticks": files}, {"ticks": TICKS.epoch_seconds})
    driver = loadgen.Driver(target.shuffler_urls, 1)
    raised: list[BaseException] = []

    def preflight() -> None:
        try:
            refusals.preflight(driver, source)
        except RefusedError as error:
            raised.append(error)

    thread = threading.Thread(target=preflight, daemon=True)
    thread.start()
    thread.join(30)  # at most the 3-second epoch it is sent in, plus the answers
    assert not thread.is_alive(), "the preflight kept sending the refused contribution"
    assert raised and "of channel 'ticks' is closed" in str(raised[0]), raised


@pytest.mark.system
def test_a_shuffler_that_refused_every_contribution_stops_the_run(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    """An epoch closed at one shuffler only (an earlier verification that stopped part way):
    after a phase, a shuffler that refused (400) most of what it was sent stops the run before
    its verification, named with the run's epochs."""
    url, trust = deployment
    target = _target(url, trust, "shut")
    epoch, closed = target.epoch(time.time()), target.shuffler_urls[0]
    httpx.post(
        closed + "/v1/admin/close",
        json={"channel_id": "shut", "epoch": epoch},
        headers=_tokens(url, trust).admin_headers(closed),
        timeout=60,
    ).raise_for_status()
    driver = loadgen.Driver(target.shuffler_urls, 2)
    source = _foreign_contributions(url, trust, 60, tmp_path, "shut")
    asyncio.run(driver.run(source, None, 30, until_empty=True))
    answers = driver.stats.by_shuffler
    assert set(answers[0]) == {400} and all(set(answers[i]) == {202} for i in (1, 2)), answers
    with pytest.raises(RefusedError) as caught:
        check_answers(driver.stats, target.shuffler_urls, ["shut"], {"shut": [epoch]})
    message = str(caught.value)
    refused = answers[0][400]

    assert f"{closed} refused {refused} of the {refused} contributions of shut" in message
    assert f"(epoch {epoch}) sent to it" in message and "wait for the next epoch" in message
    assert f"refusals by code: epoch_not_open {answers[0][400]}" in message
    assert target.shuffler_urls[1] not in message


def _acknowledged(urls: list[str], tokens: Credentials) -> float:
    """Contributions the shufflers' ledgers hold so far (every channel's)."""
    return sum(s["received"] for s in verify.shuffler_state(urls, tokens).values())


@pytest.mark.system
def test_an_epoch_closed_at_one_shuffler_while_the_load_runs_stops_the_run(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    """An admin closes the run's epoch at one shuffler once the load is going (after the first
    contribution, sent alone, was acknowledged): that shuffler refuses the rest of its share,
    and ``esa loadtest`` must stop after the load, before its verification, naming the
    shuffler and the channel (without that check it verifies a release missing that share)."""
    url, trust = deployment
    target = _target(url, trust, "midway")
    urls, closed, tokens = target.shuffler_urls, target.shuffler_urls[0], _tokens(url, trust)
    acknowledged, refused = _acknowledged(urls, tokens), _refused([closed], tokens)
    args = ["--channel", "midway", "--devices", "400", "--rate", "50", "--duration", "8"]
    process, lines, reader = _started(_command(url, trust, tmp_path / "out", *args))
    # The preflight sends one contribution alone: a third acknowledged is the load's.
    while _acknowledged(urls, tokens) < acknowledged + 3:
        assert process.poll() is None, "".join(lines)
        time.sleep(0.05)
    epoch, auth = target.epoch(time.time()), tokens.admin_headers(closed)
    body = {"channel_id": "midway", "epoch": epoch}
    httpx.post(closed + "/v1/admin/close", json=body, headers=auth, timeout=60).raise_for_status()
    stdout = _finished(process, reader)
    text = " ".join("".join(lines).split())
    assert process.returncode == 1, stdout + text
    assert "verification:" not in stdout, stdout
    assert not (tmp_path / "out" / "loadtest.json").exists()
    found = re.search(
        rf"Error: {re.escape(closed)} refused ([\d,]+) of the ([\d,]+) contributions of midway "
        rf"\(epoch {epoch}\) sent to it \(400\) and acknowledged ([\d,]+)",
        text,
    )
    assert found is not None, text
    no, total, yes = (int(n.replace(",", "")) for n in found.groups())
    assert no + yes == total and no > yes, text
    # every refusal of its share, as the shuffler saw
    assert no == _refused([closed], tokens) - refused
    assert "refusals by code: epoch_not_open" in text and "wait for the next epoch" in text
    assert all(other not in text for other in urls[1:]), text


def _key_folder(source: Path, into: Path) -> Path:
    """A copy of the parties' admin and metrics tokens of ``source`` (``var/keys``)."""
    for party in source.iterdir():
        for kind in (launcher.ADMIN_TOKEN_FILE, launcher.METRICS_TOKEN_FILE):
            if (party / kind).is_file():
                (into / party.name).mkdir(parents=True, exist_ok=True)
                shutil.copy(party / kind, into / party.name / kind)
    return into


@pytest.mark.system
def test_a_wrong_or_missing_token_of_one_shuffler_stops_the_run_naming_it(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    """``--keys`` with another metrics token for shuffler-2: the run stops before its load (the
    scrape before it is refused 401), naming shuffler-2's URL. Without shuffler-3's admin
    token the run stops before its load too, naming shuffler-3 and the files looked for.
    With another admin token for shuffler-3, the load goes out and verification stops at the
    close, naming shuffler-3's URL and its refusal, instead of verifying (channel ``keyed``:
    its epoch is left closed at shuffler-1 and -2)."""
    url, trust = deployment
    urls = _target(url, trust, "keyed").shuffler_urls
    wrong = _key_folder(trust.parent / "keys", tmp_path / "wrong")
    (wrong / "shuffler-2" / launcher.METRICS_TOKEN_FILE).write_text("another-token-" * 4)
    args = ("--channel", "keyed", "--devices", "60", "--max")
    done = subprocess.run(
        _command(url, trust, tmp_path / "a", *args, keys=wrong),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    message = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stdout + message
    assert f"metrics of {urls[1]}" in message and "401" in message, message
    assert "run: " not in message and not (tmp_path / "a" / "loadtest.json").exists()
    missing = _key_folder(trust.parent / "keys", tmp_path / "missing")
    (missing / "shuffler-3" / launcher.ADMIN_TOKEN_FILE).unlink()
    done = subprocess.run(
        _command(url, trust, tmp_path / "b", *args, keys=missing),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    message = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stdout + message
    assert "no admin token for shuffler-3" in message, message
    assert "run: " not in message and not (tmp_path / "b" / "loadtest.json").exists()
    (missing / "shuffler-3" / launcher.ADMIN_TOKEN_FILE).write_text("another-token-" * 4)
    done = subprocess.run(
        _command(url, trust, tmp_path / "c", *args, keys=missing),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    message = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stdout + message
    assert "run: " in message and "verification: PASS" not in done.stdout
    epoch = int(time.time() // KEYED.epoch_seconds)
    assert f"closing keyed epoch {epoch} at {urls[2]}" in message, message
    assert "bad_admin_token" in message, message
    assert all(f"at {other}" not in message for other in urls[:2]), message


@pytest.mark.system
def test_loadtest_up_verifies_with_its_own_deployments_tokens(tmp_path: Path) -> None:
    """``esa loadtest --up`` starts a deployment of its own (``esa up``: every party its own
    tokens) and verifies the run with that deployment's key folder, with no token given."""
    done = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "loadtest", "--up",
            "--channel", "homepage", "--devices", "300", "--max",
            "--out", str(tmp_path / "out"), "--no-live", "--drain-timeout", "120",
        ],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where --up puts its deployment
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verification: PASS" in done.stdout
    assert "starting a fresh deployment under " in done.stderr
    # its keys, tokens and databases served this run only: nothing of them is left behind
    assert not list(tmp_path.glob("esa-loadtest-*"))


def test_populations_add_up_to_the_devices(tmp_path: Path) -> None:
    values = tmp_path / "values.csv"
    values.write_text("# page,count\n3,30\n5,10\n7\n")
    found = draw(f"csv:{values}", HOMEPAGE, 256, 80, seed=1)
    assert found.counts.sum() == 80 and found.values.size == 80
    assert list(np.flatnonzero(found.counts)) == [3, 5, 7]
    assert list(found.counts[[3, 5, 7]]) == [59, 19, 2]  # 30 : 10 : 1, largest remainder
    zipf = draw("zipf:1.5", HOMEPAGE, 256, 5000, seed=2).counts
    assert zipf[0] > zipf[1] > zipf[10] and zipf.sum() == 5000
    assert draw("uniform", HOMEPAGE, 256, 2560, seed=3).counts.max() < 30
    with pytest.raises(PopulationError, match="csv population"):
        draw(f"csv:{tmp_path / 'missing.csv'}", HOMEPAGE, 256, 10, seed=0)
    values.write_text("300\n")
    with pytest.raises(PopulationError, match=r"outside 0\.\.255"):
        draw(f"csv:{values}", HOMEPAGE, 256, 10, seed=0)
    with pytest.raises(PopulationError, match="use zipf"):
        draw("pareto", HOMEPAGE, 256, 10, seed=0)


def test_clock_groups_are_disjoint_devices_and_leave_some_on_time() -> None:
    """``--clock-offset``: each group is its own slice of every worker's devices (the same in
    every epoch: a device keeps its clock), the devices on true time first; shares that
    leave none on time are refused."""
    groups = clock_groups(((600.0, 0.1), (-600.0, 0.2)))
    assert [offset for offset, _ in groups] == [0.0, 600.0, -600.0]
    ranges = [loadgen.clock_range(150, among) for _, among in groups]
    assert ranges == [(0, 105), (105, 120), (120, 150)]  # disjoint, covering the shard
    with pytest.raises(loadgen.LoadError, match="leave some on time"):
        clock_groups(((600.0, 0.5), (-600.0, 0.5)))
    assert clock_name("ticks", -600) == "ticks@-600s"


def test_a_clock_groups_refusals_do_not_stop_the_run_but_the_devices_on_time_do() -> None:
    """check_answers looks at the channels' own tags only: a clock group (a tag beyond them)
    refused wholesale is expected, the devices on true time refused more than acknowledged
    stop the run."""
    stats = loadgen.Stats()
    for _ in range(5):
        stats.record(202, 0.01, shuffler=0, tag=0)
        stats.record(400, 0.01, shuffler=0, tag=1)  # ticks@+600s: 200 epochs ahead
    check_answers(stats, ["http://s1"], ["ticks"], {"ticks": [7]})  # no RefusedError
    for _ in range(6):
        stats.record(400, 0.01, shuffler=0, tag=0)
    with pytest.raises(RefusedError, match="refused 6 of the 11"):
        check_answers(stats, ["http://s1"], ["ticks"], {"ticks": [7]})


def test_rate_options_are_exclusive() -> None:
    result = CliRunner().invoke(loadtest, ["--rate", "10", "--max", "--trust", "x"])
    assert result.exit_code == 2 and "give one of --rate, --ramp and --max" in result.output
    result = CliRunner().invoke(loadtest, ["--ramp", "10", "--trust", "x"])
    assert result.exit_code == 2 and "expected START:END" in result.output
    result = CliRunner().invoke(loadtest, ["--trusted-key", "x"])  # replaced by --trust FILE
    assert result.exit_code == 2 and "No such option '--trusted-key'" in result.output


@pytest.mark.system
def test_a_run_pins_every_party_and_stops_on_a_config_it_does_not_vouch_for(
    deployment: tuple[str, Path], tmp_path: Path
) -> None:
    """Without --trust, the keys come from <var>/trust.json and there is none here: a usage
    error. A trust file pinning another key for one shuffler (an analyzer substituting that
    shuffler's descriptor looks the same to a device) stops the run before anything is sent,
    naming the shuffler."""
    url, trust = deployment
    base = [sys.executable, "-m", "services.cli", "loadtest", "--analyzer-url", url]
    missing = subprocess.run(
        [*base, "--var", str(tmp_path), "--out", str(tmp_path / "a"), "--max"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2, missing.stderr
    assert f"no --trust file and no {tmp_path / 'trust.json'}" in " ".join(missing.stderr.split())
    pinned = json.loads(trust.read_text())
    pinned["shufflers"]["shuffler-2"] = b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
    wrong = tmp_path / "trust.json"
    wrong.write_text(json.dumps(pinned))
    refused = subprocess.run(
        _command(url, wrong, tmp_path / "b", "--channel", "pages", "--devices", "10", "--max",
                 keys=trust.parent / "keys"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    message = " ".join(refused.stderr.split())
    assert refused.returncode == 1, refused.stdout + message
    assert "collection config refused" in message and "'shuffler-2'" in message, message
    assert "run: " not in message and not (tmp_path / "b" / "loadtest.json").exists()


def test_pace_ramps_linearly() -> None:
    pace = loadgen.Pace(100, 300)
    assert pace.at(5, 10) == 200 and pace.planned(10, 10) == pytest.approx(2000)
    assert pace.planned(12, 10) == pytest.approx(2600)  # the end rate after the ramp


def test_estimates_that_could_not_be_checked_fail_the_run() -> None:
    """An epoch whose release could not be read (the analyzer failed the per-epoch query) or a
    channel with contributions but no checked row is a problem, not a pass on nothing."""
    row = {"acknowledged": 30, "received": 30, "checked": [{"inside": 1.0}], "inside": 1}
    whole = {"1": {"received": 10}, "2": {"received": 20}}
    assert channel_problems({"c": {**row, "per_epoch": whole}}) == []
    short = channel_problems({"c": {**row, "per_epoch": {"1": {"received": 10}}}})
    assert len(short) == 1 and "10 contributions, the run's release 30" in short[0]
    empty = channel_problems({"c": {**row, "checked": [], "inside": 0, "per_epoch": {}}})
    assert any("no estimate checked" in problem for problem in empty)


def test_refusals_other_than_the_rate_limit_fail_the_verification() -> None:
    """A run that conserves what was acknowledged but had part of its contributions refused
    is not a pass: every refusal but the rate limit's (retried) is a problem."""
    assert unexpected(Counter({"rate_limited": 7})) == []
    assert unexpected(Counter()) == []
    found = unexpected(Counter({"epoch_not_open": 132, "rate_limited": 3, "malformed": 1}))
    assert found == [
        "133 contributions refused by the deployment (epoch_not_open 132, malformed 1)"
    ]


def test_a_deployment_gone_before_verification_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shuffler or the analyzer that stopped answering (the deployment went away during the
    run) is a VerifyError naming what verification was doing, never a traceback, once it
    waited for a restart (here 1 s instead of two minutes)."""
    monkeypatch.setattr(verify, "RESTART_PATIENCE_SECONDS", 1.0)
    url = f"http://127.0.0.1:{launcher.free_base_port(1)}"  # nothing listens there
    with pytest.raises(verify.VerifyError, match=f"closing pages epoch 7 at {url}"):
        verify.close_epochs([url], Credentials.shared("development"), {"pages": [7]})
    with pytest.raises(verify.VerifyError, match=f"the release of pages at {url}"):
        verify.release(url, "pages", [7], 16)


#: Two k-RR channels whose epochs never end during a test: each device sends one contribution
#: to each, both through the one shuffler of :func:`test_refusals_are_waited_out_in_their_epoch`.
BUSY = [
    PAGES.model_copy(update={"id": f"busy-{x}", "epoch_seconds": MAX_EPOCH_SECONDS}) for x in "ab"
]


@pytest.mark.system
def test_refusals_are_waited_out_in_their_epoch(tmp_path: Path) -> None:
    """A shuffler that takes one contribution per second from each client (the rate limit,
    429 + Retry-After) and whose database is locked while the run starts (503, nothing
    stored): as a device's outbox does, the run waits each refusal out and sends again within
    the epoch; everything is delivered, verified, and reported as refused then delivered."""
    var, base = tmp_path / "var", launcher.free_base_port(2)
    overrides = {
        **TEST_SHUFFLER_SETTINGS,
        "ESA_SHUFFLER_RATE_PER_SECOND": "1",
        "ESA_SHUFFLER_RATE_BURST": "1",
        "ESA_SHUFFLER_SQLITE_BUSY_TIMEOUT_SECONDS": "0.2",
    }
    specs = launcher.prepare(var, 1, base, channels=BUSY, overrides=overrides)
    services = launcher.start_all(specs, var / "logs")
    try:
        launcher.wait_config(services[0], 60)
        args = ["--devices", "100", "--max", "--channel", "busy-a", "--channel", "busy-b"]
        command = _command(services[0].url, var / launcher.TRUST_FILE, tmp_path / "out", *args)
        run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        locked = threading.Thread(target=_lock_while_the_run_starts, args=(run, var))
        locked.start()
        watchdog = threading.Timer(240, run.kill)  # a hung run fails the test, never the suite
        watchdog.start()
        assert run.stdout is not None
        out = run.stdout.read()  # the thread reads stderr
        run.wait(10)
        watchdog.cancel()
        locked.join(30)
    finally:
        launcher.stop(services)
    err = "".join(_LOG)
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    summary = json.loads((tmp_path / "out" / "loadtest.json").read_text())
    found = summary["run"]
    assert found["offered"] == found["accepted"] == 200 and found["never_delivered"] == 0
    assert found["retried"].get("503", 0) >= 2, (found["retried"], err[-3000:])
    assert found["retried"]["429"] >= 50, found["retried"]
    assert found["refused_then_delivered"] >= 50
    assert summary["verification"]["problems"] == [], summary["verification"]
    later = found["refused_then_delivered"]
    assert f"{200 - later} delivered at once, {later} refused then delivered" in out
    assert "0 never delivered" in out and "verification: PASS" in out


_LOG: list[str] = []


def _lock_while_the_run_starts(run: subprocess.Popen[str], var: Path) -> None:
    """Hold the shuffler's SQLite write lock from the end of sealing until 3 s after the run
    began (its first contribution, sent alone, is answered 503 again and again: nothing can
    be stored), reading the run's log meanwhile (into :data:`_LOG`)."""
    assert run.stderr is not None
    _LOG.clear()
    lock = None
    for line in run.stderr:
        _LOG.append(line)
        if "sealed" in line and "contributions" in line and lock is None:
            lock = sqlite3.connect(var / "shuffler-1" / "shuffler.db", timeout=10)
            lock.execute("BEGIN IMMEDIATE")
        # rich's log shows the time column only when the second changed: "[19:45:12] run: …"
        if re.search(r"(^|\s)run: ", line) and lock is not None:
            time.sleep(3.0)
            lock.rollback()
            lock.close()
            lock = None
    if lock is not None:
        lock.close()


def test_a_wait_says_what_it_waits_for_and_counts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait of the run (its planned start, a wave's epoch) is never silent: one line says
    what for and until when, then the time left every WAIT_LINE_SECONDS without a live view,
    or in the live view's title; a wait under a second goes unannounced."""
    from rich.console import Console

    from services.tools.loadtest import live

    monkeypatch.setattr(live, "WAIT_LINE_SECONDS", 0.4)
    monkeypatch.setattr(live, "QUIET_WAIT_SECONDS", 0.15)
    out = io.StringIO()
    console = Console(file=out, width=200)
    live.wait_until(time.time() + 0.1, "nothing to say", console, live=False)
    assert out.getvalue() == ""
    at = time.time() + 1.0
    live.wait_until(at, "the run's planned start (epoch 7 of pages)", console, live=False)
    assert time.time() >= at
    lines = out.getvalue().splitlines()
    said = [x for x in lines if "waiting for the run's planned start (epoch 7 of pages):" in x]
    assert len(said) >= 2 and all(" s left (until " in x for x in said), lines
    assert time.strftime("%H:%M:%S", time.localtime(at)) in said[0]

    monitor = live.Monitor(driver=loadgen.Driver([]), shuffler_urls=[])
    titles: list[str] = []

    async def watched() -> None:
        waiting = asyncio.create_task(
            live._wait_in_view(time.time() + 0.6, "epoch 9", monitor, console, live=True)
        )
        while not waiting.done():
            titles.append(monitor.waiting)
            await asyncio.sleep(0.1)

    asyncio.run(watched())
    assert any(t.startswith("waiting for epoch 9: 1 s left") for t in titles), titles
    assert monitor.waiting == ""  # the title is plain again once the wait is over


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (("600:0.1", "600:0.2"), "each offset is one group"),
        (("0:0.1",), "an offset of 0 is the devices on true time"),
        (("nan:0.1",), "a finite offset"),
        (("inf:0.1",), "a finite offset"),
        (("600:1.5",), "a share between 0 and 1"),
        (("600",), "expected SECONDS:SHARE"),
    ],
)
def test_clock_offsets_are_refused_unless_each_is_one_finite_group(
    given: tuple[str, ...], said: str
) -> None:
    with pytest.raises(click.UsageError, match=re.escape(said)):
        _clock_offsets(given)
    assert _clock_offsets(("600:0.1", "-600:0.1")) == ((600.0, 0.1), (-600.0, 0.1))
