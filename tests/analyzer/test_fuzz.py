"""Schemathesis against a real analyzer process (issue 12, "The OpenAPI is the truth").

The analyzer is started by the launcher (:func:`tests.support.analyzer_process`) and fuzzed
through its OpenAPI document: every operation, every check schemathesis has (server
errors, status-code, content-type, response-schema and header conformance, positive data
accepted, negative data rejected, missing required headers, unsupported methods, ignored
auth, …), in positive and negative modes, examples and coverage phases included. The run
is deterministic (``derandomize``) and takes ``ESA_FUZZ_EXAMPLES`` examples per operation
(200 in ``make test``; ``make fuzz`` sets more). The document is built in-process from
:func:`analyzer.app.create_app` when the module is collected (schemathesis 4.32's
fixture-loaded schemas do not run under pytest 9) and must equal what the running process
serves at ``/openapi.json``.

Random bytes never carry a valid Ed25519 signature, so on ``POST /v1/batches`` a positive
case is also, at the fuzzer's choice, replaced by a *validly signed* batch part from the
registered shuffler, sent as it (``ESA-Shuffler``; :func:`signed_parts`): sealed fragments of
real reports for the configured channels (bound to the part's channel, epoch and crowd, or at
times replayed from another epoch) mixed with chaff, any part of a batch of one to three parts,
known and new batch ids, declared and undeclared crowds, below and above the minimum crowd,
unknown channels, epochs up to ``MAX_INT``, second batches for a group. Those parts are
stored and opened, so the estimate, ledger, release and dashboard operations fuzzed after
them read real, adversarial data. The admin routes (publishing, training steps, requeueing
quarantined parts) are called with the admin token on every other case (and without it
otherwise), so they are exercised past their 401.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode, HookContext

from analyzer.app import create_app
from analyzer.settings import AnalyzerSettings
from common.envelope import FragmentContext, seal_fragment, sign, write_private_key
from common.mechanisms import get
from common.preauth import preauth_header
from common.randomness import SeededSource
from common.wire import MAX_INT, ChannelConfig, b64
from services.cli.launcher import LOCAL_SETTINGS

from ..support import analyzer_process, wait_until
from .helpers import seeded_entry

#: schemathesis 4.32 gives every operation's test one node id under pytest 9, which pytest-xdist
#: would run once: the module runs in pytest's own process after the parallel run (Makefile).
pytestmark = pytest.mark.serial

#: Examples per operation (``make fuzz`` raises it).
EXAMPLES = int(os.environ.get("ESA_FUZZ_EXAMPLES", "200"))
ADMIN = {"Authorization": "Bearer development"}
SHUFFLER = "shuffler-1"
CHANNELS = (
    ChannelConfig(
        id="homepage",
        mechanism="krappor",
        params={"k": 20, "eps": 4.0},
        min_crowd=5,
        max_fragments=8,
        delta=1e-8,
        payload_size=16,
        crowds=("", "eu"),
    ),
    ChannelConfig(
        id="clicks",
        mechanism="krr",
        params={"k": 8, "eps": 2.0},
        min_crowd=3,
        max_fragments=2,
        delta=1e-8,
        payload_size=16,
    ),
)
#: Batch ids the signed parts reuse, so parts of one batch meet (duplicates, disagreements,
#: batches completed by a later part).
KNOWN_BATCHES = tuple(f"{i:032x}" for i in range(1, 5))
#: Largest body the fuzzed analyzer accepts (small, so the signed parts stay cheap).
MAX_BATCH_BYTES = 1 << 20

#: Status codes answered per operation, across the whole run (reported at the end).
ANSWERS: defaultdict[str, Counter[int]] = defaultdict(Counter)
#: Seconds spent sending and checking, per operation.
SECONDS: defaultdict[str, float] = defaultdict(float)
#: The signatures of the validly signed parts the fuzzer sent.
SIGNED: set[str] = set()


#: The registered shuffler's batch-signing key and the analyzer's HPKE key (written into the
#: analyzer's key folder before it starts, so parts can be sealed and signed at collection).
SIGNER = Ed25519PrivateKey.generate()
ANALYZER_KEY = X25519PrivateKey.generate()


def _document() -> dict[str, Any]:
    """The analyzer's OpenAPI document, from the application itself (no server)."""
    with tempfile.TemporaryDirectory() as folder:
        settings = AnalyzerSettings(
            database_url=f"sqlite:///{folder}/openapi.db",
            key_dir=Path(folder),
            opening_processes=1,
            # as the process runs it (the launcher's local profile): a page origin allowed
            cors_origins=LOCAL_SETTINGS["ESA_ANALYZER_CORS_ORIGINS"],
        )
        document: dict[str, Any] = create_app(settings).openapi()
    return document


#: What schemathesis expects of schema-valid requests by default.
POSITIVE_DEFAULT = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]
#: The one expectation added to schemathesis' defaults: a schema-valid, validly signed part may
#: still be refused as inconsistent with the configuration (422: unknown channel or crowd,
#: below the channel's minimum crowd, more fragments than its contributions can carry, parts
#: that disagree, a second batch for a group) — facts about the channel configuration and
#: what was received before that no JSON schema states.
CONFIG = schemathesis.Config.from_dict(
    {
        "operations": [
            {
                "include-name": "POST /v1/batches",
                "checks": {
                    "positive_data_acceptance": {
                        "expected-statuses": [*POSITIVE_DEFAULT, "422"],
                    }
                },
            }
        ]
    }
)
DOCUMENT = _document()
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


@pytest.fixture(scope="module")
def analyzer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of an analyzer process trusting :data:`SIGNER`, opening with
    :data:`ANALYZER_KEY`, and serving exactly :data:`DOCUMENT`."""
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    keys = tmp / "analyzer" / "keys"
    keys.mkdir(parents=True)
    write_private_key(keys / "hpke.pem", ANALYZER_KEY)
    registry = [seeded_entry(SHUFFLER, SIGNER)]
    process = analyzer_process(
        tmp,
        [c.model_dump(mode="json") for c in CHANNELS],
        registry,
        opening_processes="1",
        opening_poll_seconds="0.1",
        max_batch_bytes=str(MAX_BATCH_BYTES),
    ).start()
    try:
        with httpx.Client(base_url=process.url, timeout=30) as client:
            assert client.get("/openapi.json").json() == DOCUMENT
            _receive_first_epochs(client)
        yield process.url
    finally:
        process.stop()


def _reports(
    channel: ChannelConfig, values: list[int], seed: int, epoch: int, crowd: str
) -> list[str]:
    """The sealed fragments of one report of each value (the device's encoding, seeded), bound
    to ``epoch`` and ``crowd``."""
    mechanism = get(channel.mechanism)
    params = mechanism.parse_params(channel.params)
    rng, sealing = SeededSource(seed), ANALYZER_KEY.public_key()
    context = FragmentContext(channel.id, epoch, crowd)
    return [
        b64(seal_fragment(fragment, context, channel.payload_size, sealing))
        for value in values
        for _, fragments in mechanism.encode(params, value, None, rng, 1).routes
        for fragment in fragments
    ]


def _signature(body: dict[str, Any]) -> str:
    """The registered shuffler's signature of the bytes ``requests`` sends for ``body``."""
    return b64(sign(json.dumps(body, allow_nan=False).encode(), SIGNER))


def _preauth(body: dict[str, Any]) -> str:
    """The registered shuffler's ``ESA-Preauth`` for the bytes ``requests`` sends for
    ``body``, signed now."""
    return preauth_header(SHUFFLER, json.dumps(body, allow_nan=False).encode(), SIGNER, time.time())


def _domain(channel: ChannelConfig) -> int:
    mechanism = get(channel.mechanism)
    return mechanism.domain_size(mechanism.parse_params(channel.params))


def _receive_first_epochs(client: httpx.Client, epochs: int = 3) -> None:
    """Complete batches for every channel in epochs ``0..epochs-1``, opened, before fuzzing
    (so estimates, ledgers and releases have data from the first case on)."""
    for channel, epoch in itertools.product(CHANNELS, range(epochs)):
        values = [v % _domain(channel) for v in range(4 * channel.min_crowd)]
        body = {
            "batch_id": f"{epoch:016x}{CHANNELS.index(channel):016x}",
            "part": 0,
            "parts": 1,
            "shuffler_id": SHUFFLER,
            "channel_id": channel.id,
            "crowd_id": channel.crowds[0],
            "epoch": epoch,
            "n_contributions": len(values),
            "fragments": _reports(channel, values, epoch, epoch, channel.crowds[0]),
        }
        headers = {
            "ESA-Signature": _signature(body),
            "ESA-Shuffler": SHUFFLER,
            "ESA-Preauth": _preauth(body),
            "Content-Type": "application/json",
        }
        content = json.dumps(body, allow_nan=False).encode()
        answer = client.post("/v1/batches", content=content, headers=headers)
        assert answer.status_code == 201, answer.text
    backlog = re.compile(r"^esa_analyzer_parts_unopened (\S+)$", re.MULTILINE)
    wait_until(lambda: backlog.findall(client.get("/metrics").text) == ["0.0"], timeout=60)


@st.composite
def signed_parts(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A batch part signed by the registered shuffler, as JSON and its ``ESA-Signature``."""
    channel = draw(st.sampled_from(CHANNELS))
    values = draw(st.lists(st.integers(0, _domain(channel) - 1), max_size=12))
    crowd_id = draw(st.sampled_from(channel.crowds) | st.just("undeclared"))
    # epochs drawn wide enough that a consistent part rarely meets a group that has a batch
    # already (422 duplicate_group), so some are stored (201) in every run
    epoch = draw(st.integers(0, 400) | st.just(MAX_INT))
    # mostly sealed for this part's group; at times replayed from another epoch (do not open)
    sealed_for = draw(st.just(epoch) | st.integers(0, 12))
    sealed = _reports(channel, values, draw(st.integers(0, 2**32)), sealed_for, crowd_id)
    chaff = draw(st.lists(st.binary(max_size=96).map(b64) | st.text(max_size=8), max_size=4))
    parts = draw(st.just(1) | st.integers(2, 3))
    # Each first alternative is consistent with the configuration (what Hypothesis draws
    # most), each second one is refused (422) for one reason or another.
    crowd = channel.min_crowd + len(values)
    body = {
        "batch_id": draw(st.from_regex(r"\A[0-9a-f]{32}\Z") | st.sampled_from(KNOWN_BATCHES)),
        "part": draw(st.integers(0, parts - 1)),
        "parts": parts,
        "shuffler_id": SHUFFLER,
        "channel_id": draw(st.sampled_from([channel.id, "elsewhere"])),
        "crowd_id": crowd_id,
        "epoch": epoch,
        # Crowds stay small: the lifetime accounting behind GET /v1/privacy is recomputed on
        # every request and takes seconds at n >= 10^5 (test_intake covers the bounds).
        "n_contributions": draw(st.integers(crowd, 2 * crowd) | st.integers(0, crowd)),
        "fragments": draw(st.permutations(sealed + chaff)),
    }
    return body, _signature(body)


def _signed(case: Case[Any], part: tuple[dict[str, Any], str]) -> Case[Any]:
    case.body, signature = part
    case.headers["ESA-Signature"] = signature
    case.headers["ESA-Shuffler"] = SHUFFLER
    case.headers["ESA-Preauth"] = _preauth(case.body)
    SIGNED.add(signature)
    return case


def _aimed(case: Case[Any], channel_id: str, epoch: int | None) -> Case[Any]:
    case.path_parameters = {**(case.path_parameters or {}), "channel_id": channel_id}
    if epoch is not None and case.operation.path.endswith("/estimate"):
        case.query = {**(case.query or {}), "epoch": epoch}
    if epoch is not None and isinstance(case.body, dict):
        case.body = {**case.body, "epoch": epoch}
    return case


def _positive(case: Case[Any]) -> bool:
    return case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE


@schema.hook("flatmap_case")
def aim_at_the_data(context: HookContext, case: Case[Any]) -> st.SearchStrategy[Case[Any]]:
    """Positive cases, or the same aimed past the credentials and at the data: a validly
    signed part in place of two in three batch bodies; a configured channel (and an epoch
    the parts use) in place of half the random channel ids."""
    if not _positive(case):
        return st.just(case)
    if case.operation.label == "POST /v1/batches":
        signed = signed_parts().map(lambda part: _signed(case, part))
        return st.sampled_from([True, True, False]).flatmap(
            lambda sign: signed if sign else st.just(case)
        )
    if "channel_id" in (case.path_parameters or {}):
        epochs = st.none() | st.integers(0, 2) | st.integers(0, 12)
        aims = st.tuples(st.sampled_from([c.id for c in CHANNELS]), epochs)
        return st.just(case) | aims.map(lambda aim: _aimed(case, *aim))
    return st.just(case)


_turn = itertools.count()


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    """One keep-alive connection for every case."""
    with requests.Session() as shared:
        yield shared


@pytest.mark.system
@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented(
    analyzer: str, session: requests.Session, case: Case[Any]
) -> None:
    admin = (
        case.operation.path.endswith(("/releases", "/step", "/requeue")) and next(_turn) % 2 == 0
    )
    started = time.perf_counter()
    response = case.call_and_validate(
        base_url=analyzer, session=session, headers=ADMIN if admin else None, timeout=60
    )
    signed = case.headers.get("ESA-Signature") in SIGNED
    label = case.operation.label + (" (signed)" if signed else "")
    ANSWERS[label][response.status_code] += 1
    SECONDS[label] += time.perf_counter() - started


def test_the_fuzzer_got_past_the_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    """Every operation was fuzzed, and signed parts and the admin token reached the code
    behind the signature and token checks (stored, repeated, refused as inconsistent)."""
    if not ANSWERS:
        pytest.skip("the fuzz test did not run")
    with capsys.disabled():
        for label, statuses in sorted(ANSWERS.items()):
            cases, seconds = sum(statuses.values()), SECONDS[label]
            print(f"\n  {label}: {cases} cases in {seconds:.1f} s, statuses {dict(statuses)}")
    assert {label.split(" (")[0] for label in ANSWERS} == {
        f"{method.upper()} {path}" for path, ops in DOCUMENT["paths"].items() for method in ops
    }
    signed = set(ANSWERS["POST /v1/batches (signed)"])
    # stored (201), or known already (200: a part stored before, by this run's fuzzing), and
    # refused as inconsistent (422)
    assert 422 in signed and signed & {200, 201}, signed
    assert 401 in ANSWERS["POST /v1/batches"]
    assert {201, 401, 404} <= set(ANSWERS["POST /v1/channels/{channel_id}/releases"])
    assert {200, 401} <= set(ANSWERS["POST /v1/admin/requeue"])
    assert 200 in ANSWERS["GET /v1/channels/{channel_id}/estimate"]
    assert 200 in ANSWERS["GET /v1/channels/{channel_id}/privacy"]
