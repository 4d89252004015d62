"""Schemathesis (4.x) against a real shuffler process (issue 12): the ``schemathesis run`` CLI on
the instance's own OpenAPI, every operation, every built-in check (``-c all``: server errors,
status code, content type, headers and response schema conformance, positive acceptance and
negative rejection, unsupported methods, ignored auth, …), all its examples, coverage and fuzzing
phases (the stateful one has no links to follow here), at least ``ESA_FUZZ_EXAMPLES`` generated
cases per operation (200 by default; ``make fuzz`` runs 5,000), in schemathesis' deterministic
mode (derandomized: the same cases every run).

Passing means: no 5xx, no status or content type the document does not list, no body that
misses its schema, no header it promises missing — and the sealed-contribution strategy of
:mod:`tests.shuffler.fuzz_hooks` got past HPKE (202s, and refusals only an opened contribution
can get).

Where the schema cannot say what is acceptable, the positive-data check is told which refusals
are still right: a contribution is opaque sealed bytes (whether they open, name a served channel
and an open epoch is known only after decryption: 400, 409, 413), and an admin close of an
epoch that has not started is 422 (the epoch is a number of the clock, not of the schema).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..support import SMALL_CHANNEL, ServiceProcess, shuffler_process

pytestmark = pytest.mark.system  # starts real processes

#: Generated cases per operation (the fuzzing phase; ``make fuzz`` sets more).
EXAMPLES = int(os.environ.get("ESA_FUZZ_EXAMPLES", "200"))
TOKEN_SECRET = "fuzz-token-secret-0123456789"
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
#: A second channel with two declared crowds and at least one fragment per contribution.
OTHER = {**SMALL_CHANNEL, "id": "closable", "crowds": ["", "beta"], "min_fragments": 1}
CHANNELS = [SMALL_CHANNEL, OTHER]
ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
[generation]
deterministic = true
database = "none"

[[operations]]
include-name = "POST /v1/contributions"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "409", "413", "429"]
checks.negative_data_rejection.expected-statuses = ["400", "401", "409", "413", "429"]

[[operations]]
include-name = "POST /v1/admin/close"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "422", "429"]
"""
#: Every operation of the shuffler's OpenAPI document (all of them are fuzzed).
OPERATIONS = {
    "POST /v1/contributions",
    "POST /v1/enroll",
    "GET /v1/config",
    "GET /v1/descriptor",
    "OPTIONS /v1/contributions",
    "OPTIONS /v1/enroll",
    "OPTIONS /v1/descriptor",
    "POST /v1/admin/close",
    "POST /v1/admin/revoke",
    "POST /v1/admin/requeue",
    "GET /v1/admin/keys",
    "POST /v1/admin/keys/rotate",
    "POST /v1/admin/keys/retire",
    "GET /healthz",
    "GET /readyz",
    "GET /metrics",
}
#: What only a genuinely sealed contribution can get (past HPKE and the body's parse).
AFTER_DECRYPTION = {
    "unsupported_version",
    "too_few_fragments",
    "unknown_channel",
    "unknown_crowd",
    "epoch_not_open",
    "too_many_fragments",
    "replayed_nonce",
    "quota_exceeded",
}


Run = subprocess.CompletedProcess[str]


def _schemathesis(process: ServiceProcess, work: Path) -> tuple[Run, dict[str, Any]]:
    """``schemathesis run`` on the instance with the hooks; (process, its JSON report)."""
    (work / "schemathesis.toml").write_text(CONFIG)
    config = httpx.get(process.url + "/v1/config", timeout=10).json()
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.shuffler.fuzz_hooks",
        "ESA_FUZZ_ADMIN_TOKEN": ADMIN_TOKEN,
        "ESA_FUZZ_TOKEN_SECRET": TOKEN_SECRET,
        "ESA_FUZZ_SHUFFLER_ID": config["id"],
        "ESA_FUZZ_SHUFFLER_KEY": config["public_key"],
        "ESA_FUZZ_CHANNELS": json.dumps(CHANNELS),
        "ESA_FUZZ_TALLY": str(work / "tally.jsonl"),
        "PYTHONPATH": str(ROOT),
    }
    report = work / "report.json"
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "--config-file",
        str(work / "schemathesis.toml"),
        "run",
        process.url + "/openapi.json",
        "--checks=all",
        f"--max-examples={EXAMPLES}",
        "--workers=1",
        "--suppress-health-check=all",
        "--request-timeout=30",
        "--report=json",
        f"--report-json-path={report}",
        "--no-color",
    ]
    limit = max(900, EXAMPLES)  # seconds: a generous bound, not a timing assertion
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    return run, (json.loads(report.read_text()) if report.exists() else {})


def test_schemathesis_finds_nothing_and_reaches_past_decryption(tmp_path: Path) -> None:
    process = shuffler_process(
        tmp_path,
        "shuffler-1",
        CHANNELS,
        token_secret=TOKEN_SECRET,
        admin_token=ADMIN_TOKEN,
        max_body_bytes="8192",
    ).start()
    try:
        run, report = _schemathesis(process, tmp_path)
    finally:
        process.stop()
    output = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0 and report.get("exit_code") == 0, output
    assert report["failures"] == [] and report["errors"] == [], output
    operations = report["operations"]
    assert operations["tested"] == operations["total"] == len(OPERATIONS), operations

    statuses: defaultdict[str, Counter[int]] = defaultdict(Counter)
    generated: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    other_methods: Counter[int] = Counter()
    for line in (tmp_path / "tally.jsonl").read_text().splitlines():
        label, method, phase, status, code, *_ = json.loads(line)
        if method != label.split()[0]:  # the coverage phase's undocumented methods
            other_methods[status] += 1
            continue
        statuses[label][status] += 1
        generated[label] += phase == "fuzzing"
        codes[code] += label == "POST /v1/contributions"
    summary = {label: dict(sorted(counts.items())) for label, counts in sorted(statuses.items())}
    print(
        f"\nschemathesis on the shuffler: statuses {json.dumps(summary)}; fuzzing-phase cases "
        f"{dict(generated)}; undocumented methods {dict(other_methods)}; contribution refusals "
        f"{dict(codes)}"
    )
    assert set(statuses) == OPERATIONS and all(n >= EXAMPLES for n in generated.values()), generated
    assert all(status < 500 for counts in statuses.values() for status in counts), summary
    assert set(other_methods) == {405}, other_methods
    contributions = statuses["POST /v1/contributions"]
    assert contributions[202] > 0, contributions  # genuine contributions were stored
    assert codes["malformed"] > 0 and sum(codes[c] for c in AFTER_DECRYPTION) > 0, codes
    assert statuses["GET /v1/descriptor"][200] > 0 and statuses["POST /v1/admin/requeue"][200] > 0
    # the launcher's local profile allows a page origin: preflights granted and refused
    for path in ("/v1/contributions", "/v1/enroll", "/v1/descriptor"):
        assert {204, 403} <= set(statuses[f"OPTIONS {path}"]), statuses[f"OPTIONS {path}"]
