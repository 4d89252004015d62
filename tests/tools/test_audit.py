"""``esa audit`` against real processes: a real shuffler passes every check, and deliberately
broken shufflers (:mod:`tests.tools.leaky_shuffler`, the real server with faults switched on)
fail exactly the checks that name their leak.

Every statistical check fails at p < 1e-7 (ten of them: a correct shuffler fails with
probability below 1e-6); the broken ones fail the checks that name their faults far below
that.
"""

from __future__ import annotations

import base64
import json
import math
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from common.randomness import SeededSource
from common.wire import Batch, BatchAck, ChannelConfig, ChannelPolicy
from services.cli import launcher
from services.cli.audit import audit
from services.tools.audit.canary import MIN_PAYLOAD
from services.tools.audit.checks import kept_law
from services.tools.audit.game import (
    PoolError,
    Trial,
    clopper_pearson,
    eps_lower,
    outcomes,
    pool,
    privacy_game,
    rr_one_probability,
)
from services.tools.audit.mechgame import (
    MechanismGame,
    MechTrial,
    difference_law,
    mechanism_game,
    simulate,
)
from services.tools.audit.report import write_reports
from services.tools.audit.runner import AuditConfig, run_audit
from services.tools.audit.sink import SinkState, answer_batch, fetch_records, serve
from tests.support import UNFOLLOWED, ServiceProcess, free_port, shuffler_process, wait_until

#: The audit's statistical checks have the power of the groups it sees in its window: beside
#: other workers' load it sees fewer, so the module runs after the parallel run (Makefile).
pytestmark = pytest.mark.serial

TOKEN = "sink-token-for-the-audit-tests"
CHANNEL = {
    "id": "audit",
    "epoch_seconds": 86400,
    "min_crowd": 5,
    "eps_cr": 4.0,
    "delta_cr": 1e-7,
    "max_fragments": 4,
    "crowds": [f"c{i:02d}" for i in range(6)] + ["small"],
}
#: Canaries per group where a test needs every full group released: Algorithm 3 holds a
#: group of 24 (ε_cr 4, δ_cr 1e-7, min_crowd 5) with probability ~3e-10 (the default size, 20,
#: with ~1e-6, too often for a test that asserts every group).
GROUP_SIZE = 24
FAST = {"enroll_per_minute": "1000000", "rate_per_second": "1000", "rate_burst": "1000"}
#: One client for every poll: ``httpx.get`` builds a TLS context per call (~0.25 s of CPU).
HTTP = httpx.Client(timeout=10)


@pytest.fixture(scope="module")
def sink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``esa audit sink`` as its own process (one for the module: each audit reads only the
    records that arrived after it started)."""
    with audit_sink(tmp_path_factory.mktemp("sink")) as url:
        yield url


@contextmanager
def audit_sink(tmp_path: Path, *options: str) -> Iterator[str]:
    """An ``esa audit sink`` process with ``options`` (e.g. ``--relay URL``), its token
    :data:`TOKEN`, its records and log under ``tmp_path``: its URL while it runs."""
    port = free_port()
    log = (tmp_path / "sink.log").open("ab")
    command = [sys.executable, "-m", "services.cli", "audit", "sink", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--token", TOKEN, "--record", str(tmp_path / "sink.jsonl"), *options],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), timeout=30)
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def _ready(url: str) -> bool:
    try:
        return HTTP.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _shuffler(
    tmp: Path, sink: str, leaks: str = "", channel: dict[str, object] = CHANNEL
) -> ServiceProcess:
    """A shuffler forwarding to the sink; with ``leaks``, the leaky variant's process."""
    # the sink has no analyzer behind it (no --relay): no signed config to follow
    process = shuffler_process(
        tmp, "shuffler-1", [channel], analyzer_url=sink, **FAST, **UNFOLLOWED
    )
    spec = replace(process.spec, env={**process.spec.env, "ESA_AUDIT_LEAKS": leaks})
    process.log_path.parent.mkdir(parents=True, exist_ok=True)
    module = "tests.tools.leaky_shuffler" if leaks else "services.cli"
    popen = subprocess.Popen(
        [sys.executable, "-m", module, *([] if leaks else ["shuffler", "serve"])],
        env={**os.environ, **spec.env},
        stdout=process.log_path.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    process.service = launcher.Service(
        name=spec.name, url=spec.url, process=popen, log=process.log_path, spec=spec
    )
    try:
        wait_until(lambda: popen.poll() is not None or _ready(spec.url), timeout=60)
    except AssertionError:
        process.stop()
        raise
    assert popen.poll() is None, process.service.log_tail()
    return process


def _audit(shuffler: ServiceProcess, sink: str, out: Path) -> tuple[int, dict[str, bool]]:
    """``esa audit run`` against the shuffler: its exit code and each check's verdict."""
    args = ["run", "--shuffler", shuffler.url, "--sink", sink, "--sink-token", TOKEN]
    args += ["--channel", "audit", "--admin-token", "development", "--out", str(out)]
    args += ["--clock-skew", "0.2"]  # sink and auditor share this machine's clock
    result = CliRunner().invoke(audit, args, catch_exceptions=False)
    report = json.loads((out / "audit.json").read_text())
    assert (out / "audit.html").read_text().count("<img") >= 3
    return result.exit_code, {f"{f['check']}.{f['name']}": f["passed"] for f in report["findings"]}


def _config(shuffler: ServiceProcess, sink: str, **settings: Any) -> AuditConfig:
    """An in-process audit of ``shuffler`` (the runner's API, not the command) on the
    ``audit`` channel with small groups."""
    return AuditConfig(
        shuffler_url=shuffler.url,
        sink_url=sink,
        sink_token=TOKEN,
        channel_id="audit",
        admin_token="development",
        skew_seconds=0.2,
        group_size=GROUP_SIZE,
        **settings,
    )


def _failed_with(tmp_path: Path, sink: str, leaks: str) -> set[str]:
    """The checks ``esa audit run`` fails against a shuffler with ``leaks`` switched on (its
    exit code must be 1); the report stays in ``tmp_path / "report"``."""
    shuffler = _shuffler(tmp_path, sink, leaks)
    try:
        code, verdicts = _audit(shuffler, sink, tmp_path / "report")
    finally:
        shuffler.stop()
    assert code == 1
    return {name for name, passed in verdicts.items() if not passed}


@pytest.mark.system
def test_real_shuffler_passes_every_check(tmp_path: Path, sink: str) -> None:
    shuffler = _shuffler(tmp_path, sink)
    try:
        code, verdicts = _audit(shuffler, sink, tmp_path / "report")
    finally:
        shuffler.stop()
    assert [name for name, passed in verdicts.items() if not passed] == []
    assert code == 0
    assert len(verdicts) >= 25
    report = json.loads((tmp_path / "report" / "audit.json").read_text())
    timing = next(f for f in report["findings"] if f["name"] == "release_independent_of_arrival")
    assert timing["statistic"] is not None  # both burst groups released, in one round
    crowds = CHANNEL["crowds"]
    assert isinstance(crowds, list) and len(report["summary"]["game"]["trials"]) == len(crowds) - 1
    # the saved game pools (alone, not twice: the same run's trials are not independent)
    path = str(tmp_path / "report" / "audit.json")
    pooled = CliRunner().invoke(audit, ["pool", path])
    assert pooled.exit_code == 0 and "pooled 1 runs: passed" in pooled.output
    assert CliRunner().invoke(audit, ["pool", path, path]).exit_code == 2
    # the sink answered as the analyzer: every part acknowledged, so none left to retry
    records = fetch_records(sink, TOKEN, client=HTTP)
    assert all(r["path"] == "/v1/batches" for r in records)
    # every part names its sender, as the analyzer requires (it picks the pinned key by it)
    assert all(_header(r, "esa-shuffler") == "shuffler-1" for r in records[-5:]), records[-1]


def _header(record: dict[str, object], name: str) -> str | None:
    """The value of header ``name`` (any case) in a sink record."""
    pairs = record["headers"]
    assert isinstance(pairs, list)
    return next((value for key, value in pairs if key.lower() == name), None)


@pytest.mark.system
def test_arrival_order_and_oldest_first_deletion_fail(tmp_path: Path, sink: str) -> None:
    failed = _failed_with(tmp_path, sink, "noshuffle,openmetrics,timestamp")
    assert {
        "order.rank_correlation",
        "order.early_canaries_uniform",
        "order.contributions_split",
        "deletion.survivors_random",
        "surface.metrics",
        "metadata.documented_fields",
        "metadata.canonical_body",
    } <= failed
    assert not any(name.startswith(("crowd.", "intake.", "timing.")) for name in failed)


@pytest.mark.system
def test_early_release_without_deletion_or_threshold_fails(tmp_path: Path, sink: str) -> None:
    """Groups released as they arrive, whole and tiny: the crowd, deletion and timing checks
    fail (intake may too: this shuffler forgets released contributions, and with them the
    nonces and quotas it should still refuse)."""
    failed = _failed_with(tmp_path, sink, "keepall,early")
    assert {
        "crowd.min_crowd",
        "crowd.small_groups_withheld",
        "deletion.kept_count_law",
        "timing.release_at_close",
        "timing.release_independent_of_arrival",
    } <= failed
    assert not any(name.startswith(("order.", "metadata.", "surface.")) for name in failed)


@pytest.mark.system
def test_biased_deletion_missing_threshold_and_token_fail_alone(tmp_path: Path, sink: str) -> None:
    """Three faults that touch disjoint parts of the shuffler, each failing only the check that
    names it: ``oldestfirst`` (the batch still shuffled, Algorithm 3's count law intact, but the
    oldest contributions survive) fails ``deletion.survivors_random`` while every order check
    passes; ``belowcrowd`` (noise and deletion intact, held groups released anyway) releases
    the ``min_crowd − 1`` group; ``token`` adds a ``client_token`` field to every body.

    Wrong verdicts: the survivors' rank-sum Z is −√(3 Σ k(n − k)/(n + 1)) over the 6 groups
    of n = 20 (k ≈ 11 kept: Z ≈ −9), above −5.33 (p ≥ 1e-7) only if three groups keep ≥ 17 or
    none (< 1e-13); the small group escapes ``belowcrowd`` only by an abort (2.5e-8). A full
    group held by Algorithm 3 (1e-6 each) is released whole by ``belowcrowd``, which
    ``kept_count_law`` rightly rejects: that check is asserted only when no group was."""
    failed = _failed_with(tmp_path, sink, "oldestfirst,belowcrowd,token")
    assert {
        "deletion.survivors_random",
        "crowd.min_crowd",
        "crowd.small_groups_withheld",
        "metadata.documented_fields",
        "metadata.canonical_body",
    } <= failed
    assert not any(name.startswith(("order.", "surface.", "timing.", "intake.")) for name in failed)
    assert not failed & {
        "crowd.counts_cover_canaries",
        "metadata.headers",
        "metadata.one_fragment_size",
        "metadata.signatures",
        "metadata.no_repeated_fragment",
    }
    report = json.loads((tmp_path / "report" / "audit.json").read_text())
    finding = {f"{f['check']}.{f['name']}": f for f in report["findings"]}
    assert finding["deletion.survivors_random"]["statistic"] < -5.33  # the oldest survive
    law = finding["deletion.kept_count_law"]
    assert law["passed"] or "0" in law["plot"]["histogram"]  # "0": a held group released whole


def test_kept_law_is_algorithm_3() -> None:
    policy = ChannelPolicy(id="audit", min_crowd=5, eps_cr=4.0, delta_cr=1e-7)
    law = kept_law(20, policy)
    assert sum(law.values()) == pytest.approx(1.0)
    assert law.get(20, 0.0) == 0.0  # n̂ = n exactly has probability 0: no deletion is a leak
    assert max((k for k in law if k is not None), key=lambda k: law[k]) == 11  # 20 − ⌈c⌉


def _game_trials(shuffled: bool, trials: int, n: int, eps0: float, seed: int) -> list[Trial]:
    """The privacy game's trials as a shuffler would release them: RR reports of n − 1 zeros
    and a target (sent first) reporting RR of a secret bit; shuffled, or in arrival order."""
    rng = np.random.default_rng(seed)
    p_one = [rr_one_probability(0, eps0), rr_one_probability(1, eps0)]
    out = []
    for _ in range(trials):
        secret = int(rng.integers(2))
        reports = (rng.random(n) < p_one[0]).astype(int)
        reports[0] = int(rng.random() < p_one[secret])
        if shuffled:
            rng.shuffle(reports)
        out.append(Trial(secret, tuple(int(r) for r in reports), n, 1))
    return out


def test_privacy_game_catches_arrival_order_and_passes_a_shuffle() -> None:
    leaky = privacy_game(_game_trials(False, 1000, 200, 2.0, seed=1), 2.0, 1e-6)
    shuffled = privacy_game(_game_trials(True, 1000, 200, 2.0, seed=2), 2.0, 1e-6)
    assert not leaky.passed and leaky.statistic is not None and leaky.statistic > 1.2
    assert shuffled.passed and shuffled.statistic is not None and shuffled.statistic < 0.5


def test_pooled_game_reaches_half_the_exact_eps_and_stays_valid() -> None:
    """Issue 15's power target: binary RR ε0 = 4 at crowd 20 (exact ε of the pair 4.0,
    ``common.accounting.lower_2rr``): three saved runs of 80 groups pooled give ε_lower ≥ 2 at
    95%, still below the certified ε; pooled runs of a shuffler keeping arrival order fail at a
    crowd of 200, where the certified ε of ε0 = 2 is far below 2."""
    runs = [
        outcomes(_game_trials(True, 80, 20, 4.0, seed=10 + i), 4.0, 1e-6, f"r{i}") for i in range(3)
    ]
    finding, count = pool((f"run{i}", data) for i, data in enumerate(runs))
    assert count == 3 and finding.passed
    assert finding.statistic is not None and finding.statistic >= 2.0
    leaky = [outcomes(_game_trials(False, 300, 200, 2.0, i), 2.0, 1e-6, f"l{i}") for i in range(3)]
    assert not pool((f"l{i}", d) for i, d in enumerate(leaky))[0].passed
    with pytest.raises(PoolError, match="already pooled"):
        pool([("a", runs[0]), ("b", runs[0])])
    with pytest.raises(PoolError, match="different game settings"):
        pool([("a", runs[0]), ("b", {**runs[1], "eps0": 2.0})])


def test_clopper_pearson_covers() -> None:
    low, high = clopper_pearson(0, 100, 0.95)
    assert low == 0.0 and high == pytest.approx(1 - 0.05 ** (1 / 100))
    assert eps_lower([(1, 1)] * 50 + [(0, 0)] * 50, 0.0, 0.95) == pytest.approx(
        math.log((0.05 ** (1 / 50)) / (1 - 0.05 ** (1 / 50)))
    )


def _part(part: int = 0) -> bytes:
    return Batch(
        batch_id=secrets.token_hex(16),
        part=part,
        parts=part + 1,
        shuffler_id="shuffler-1",
        channel_id="audit",
        crowd_id="c00",
        epoch=1,
        n_contributions=7,
        fragments=[],
    ).body()


@pytest.mark.system
def test_sink_answers_like_the_analyzer(sink: str) -> None:
    body, headers = _part(), {"ESA-Signature": "A" * 86 + "==", "Content-Type": "application/json"}
    first = HTTP.post(sink + "/v1/batches", content=body, headers=headers)
    again = HTTP.post(sink + "/v1/batches", content=body, headers=headers)
    assert (first.status_code, first.json()["duplicate"]) == (201, False)
    assert (again.status_code, again.json()["duplicate"]) == (200, True)
    BatchAck.model_validate_json(first.content)
    unsigned = HTTP.post(sink + "/v1/batches", content=body, headers={"X": "1"})
    text = HTTP.post(
        sink + "/v1/batches", content=body, headers={**headers, "Content-Type": "text/plain"}
    )
    junk = HTTP.post(sink + "/v1/batches", content=b"{}", headers=headers)
    assert [r.status_code for r in (unsigned, text, junk)] == [401, 415, 400]
    assert junk.json()["error"] == "malformed"
    assert HTTP.get(sink + "/v1/audit/records").status_code == 401
    recorded = fetch_records(sink, TOKEN, client=HTTP)[-5:]
    assert [base64.b64decode(r["body"]) for r in recorded[:2]] == [body, body]
    assert ["ESA-Signature", headers["ESA-Signature"]] in recorded[0]["headers"]


@pytest.mark.system
def test_sink_relays_other_channels_byte_for_byte(sink: str) -> None:
    """A second sink (in this process) relays to the sink process, except its kept channel."""
    relaying = SinkState(token="t" * 16, relay=sink, keep_channels=frozenset({"kept"}))
    body = _part()
    signature = {
        "esa-shuffler": "shuffler-1",
        "esa-signature": "B" * 86 + "==",
        "esa-preauth": "1." + "2." + "0" * 64 + "." + "C" * 86 + "==",
        "content-type": "application/json",
    }
    status, answer = answer_batch(relaying, signature, body)
    assert status == 201 and json.loads(answer)["batch_id"] == json.loads(body)["batch_id"]
    relayed = fetch_records(sink, TOKEN, client=HTTP)[-1]
    assert base64.b64decode(relayed["body"]) == body
    assert _header(relayed, "esa-shuffler") == "shuffler-1"  # the sender, relayed with the bytes
    assert _header(relayed, "esa-signature") == signature["esa-signature"]
    assert _header(relayed, "esa-preauth") == signature["esa-preauth"]  # the slot's head too
    relaying.keep_channels = frozenset({"audit"})
    before = len(fetch_records(sink, TOKEN, client=HTTP))
    assert answer_batch(relaying, signature, _part())[0] == 201
    assert len(fetch_records(sink, TOKEN, client=HTTP)) == before


@pytest.mark.parametrize("channel", ["homepage", "homepage-fragments", "picture", "features"])
def test_mechanism_game_law_is_the_encoders(channel: str) -> None:
    """The exact law the count distinguisher's threshold is fitted to (fragments naming b
    minus those naming a, per report of a, b or c) is what the mechanism's encoder draws."""
    game = MechanismGame.named(channel)
    source = SeededSource(7)
    for value in (0, 1, 2):
        views = [game.view(game.encode(value, source)) for _ in range(1000)]
        offset, pmf = _one_report_law(game, value)
        drawn = np.bincount([b - a - offset for a, b, _ in views], minlength=len(pmf))
        assert np.abs(drawn / len(views) - pmf).max() < 0.04, (value, drawn, pmf)


def _one_report_law(game: MechanismGame, value: int) -> tuple[int, np.ndarray]:
    joint = game.law(value)
    rows, cols = joint.shape
    pmf = np.zeros(rows + cols - 1)
    for i in range(rows):
        for j in range(cols):
            pmf[j - i + rows - 1] += joint[i, j]
    return -(rows - 1), pmf


def test_mechanism_game_power_and_a_leak() -> None:
    """Through a (seeded) uniform shuffle of the real encoder's fragments the bound stays below
    the certified ε with some power; in arrival order (the target's fragments first) the
    "first fragment naming a or b" distinguisher sees the leak; and a release that gives the
    target away fails at a crowd where the certificate shows amplification (k-RAPPOR ε = 2,
    k = 3 at crowd 1000: certified 1.02)."""
    homepage = MechanismGame.named("homepage")
    fair = mechanism_game(simulate(homepage, 20, 1000, seed=3), homepage)
    leak = mechanism_game(simulate(homepage, 20, 1000, seed=3, shuffled=False), homepage)
    assert fair.passed and fair.statistic is not None and 0.3 <= fair.statistic < 1.0
    assert "certified ε=4.000" in fair.detail  # replacement: twice the per-bit removal ε
    assert leak.statistic is not None and leak.statistic > 1.5
    _, law_a, law_b = difference_law(homepage, 20)
    assert law_a.sum() == pytest.approx(1.0) and law_b.sum() == pytest.approx(1.0)
    assert (np.arange(len(law_b)) * law_b).sum() - (np.arange(len(law_a)) * law_a).sum() == (
        pytest.approx(2 * (1 - 2 / (1 + math.exp(2.0))))
    )
    small = MechanismGame.of(
        ChannelConfig(id="small", mechanism="krappor", params={"k": 3, "eps": 2.0}, delta=1e-8)
    )
    assert small.certified(1000).eps < 1.1
    given_away = [MechTrial(s, (1 - s, s, s), 1000) for s in (0, 1) * 150]
    assert not mechanism_game(given_away, small).passed
    hidden = [MechTrial(s, (300, 300, -1), 1000) for s in (0, 1) * 150]
    assert mechanism_game(hidden, small).passed
    with pytest.raises(ValueError, match="longitudinal"):
        MechanismGame.named("abroad")


@pytest.mark.system
def test_real_shuffler_mechanism_game(tmp_path: Path, sink: str) -> None:
    """The game of the zero-sum channel through a real shuffler: canaries carry Balcer–Cheu
    fragments, the auditor reads them back from the released batches, every check passes, and
    the saved outcome pools. The audited channel's fragments are as large as the game's
    (shufflers refuse a fragment sealed to another size than its channel's)."""
    payload = MIN_PAYLOAD + MechanismGame.named("features").fragment_size
    crowds = ["c00", "c01", "c02", "small"]
    channel = {**CHANNEL, "max_fragments": 16, "crowds": crowds, "payload_size": payload}
    shuffler = _shuffler(tmp_path, sink, channel=channel)
    try:
        config = _config(shuffler, sink, game_channel="features", seed=1)
        result = run_audit(config)
    finally:
        shuffler.stop()
    assert [f.name for f in result.findings if not f.passed] == []
    finding = next(f for f in result.findings if f.name == "distinguishing_game")
    assert "features: zsum" in finding.detail and "certified ε=inf" in finding.detail
    saved = result.summary["game"]
    assert saved["mechanism"] == "zsum" and len(saved["trials"]) == 3
    for trial in saved["trials"]:
        assert trial["view"] is not None and trial["n_contributions"] >= CHANNEL["min_crowd"]
        # the target's own message names its value: a or b is named at least once
        assert trial["view"][0] + trial["view"][1] >= 1
    pooled, runs = pool([("run", saved)])
    assert runs == 1 and pooled.passed
    json_path, html_path = write_reports(result, tmp_path / "report")  # certified ε is ∞ here
    assert html_path.read_text().count("<img") >= 3
    assert json.loads(json_path.read_text())["summary"]["game"]["channel"] == "features"
    with pytest.raises(PoolError, match="binary RR"):
        pool([("run", saved), ("rr", outcomes(_game_trials(True, 4, 20, 4.0, 0), 4.0, 1e-6, "x"))])


@pytest.mark.system
def test_canaries_take_the_audited_channels_fragment_size(tmp_path: Path, sink: str) -> None:
    shuffler = _shuffler(tmp_path, sink, channel={**CHANNEL, "payload_size": 32})
    try:
        config = _config(shuffler, sink)
        result = run_audit(config)  # payload_size left at its default
    finally:
        shuffler.stop()
    assert [f.name for f in result.findings if not f.passed] == []


@pytest.mark.system
def test_a_relaying_sink_serves_the_analyzers_signed_config_unchanged(sink: str) -> None:
    """A shuffler whose analyzer URL is a relaying sink keeps following its analyzer: the sink
    answers ``GET /v1/config`` with the analyzer's config, byte for byte, 502 ``relay_failed``
    for any other answer, and 503 ``relay_unavailable`` when the analyzer is unreachable; a
    sink without a relay has no config to give (404)."""
    document = b'{"config": {"revision": 7}, "signature": "c2ln"}'
    analyzer = _Serving(document)
    relaying = serve(SinkState(token="t" * 16, relay=analyzer.url), "127.0.0.1", 0)
    threading.Thread(target=relaying.serve_forever, daemon=True).start()
    try:
        through = f"http://127.0.0.1:{relaying.server_address[1]}/v1/config"
        answer = HTTP.get(through)
        assert answer.status_code == 200 and answer.content == document
        alone = HTTP.get(sink + "/v1/config")
        assert alone.status_code == 404 and alone.json()["error"] == "not_found"
        analyzer.status = 503  # not the config: said as the sink's own error, never passed on
        refused = HTTP.get(through)
        assert refused.status_code == 502 and refused.json()["error"] == "relay_failed"
        assert "503" in refused.json()["detail"]
        analyzer.server.shutdown()
        analyzer.server.server_close()
        down = HTTP.get(through)
        assert down.status_code == 503 and down.json()["error"] == "relay_unavailable"
    finally:
        relaying.shutdown()


class _Serving:
    """An HTTP server on loopback answering every GET with ``body`` (at :attr:`status`)."""

    def __init__(self, body: bytes) -> None:
        self.status = 200
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
