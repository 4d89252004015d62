"""Probes of the shuffler's surface: what anyone without credentials can read (check 3), and
how intake refuses what it must (check 7).

Public surface: every unauthenticated probe is answered at several fill levels of an open
group (before the canaries, half way, all sent). Random values (tokens, receipts, ids) are
masked and the ``Date`` header dropped; any other difference between the answers means
something public moves with a group's size, its deletions or its arrivals. A 429 of the
enrolment probe (the per-address enrolment limit, which the canaries' own enrolments drain at a
production limit) answers the prober's request rate, not the group: that probe waits out its
``Retry-After`` and asks again, as the canaries do, up to :data:`RATE_LIMIT_RETRIES` times.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from common.envelope import Contribution, new_nonce, outer_info, seal
from services.tools.audit.canary import CONTRIBUTION_TYPE, CanaryFleet, Sent, retry_after
from services.tools.audit.checks import Finding

#: Long runs of hex or base64 characters with a digit among them: random tokens, receipts,
#: ids (a metric or route name has no digit).
RANDOM = re.compile(r"[A-Za-z0-9_\-+/=.]{20,}")
VOLATILE_HEADERS = frozenset({"date"})
#: Times the enrolment probe answered 429 is asked again after its ``Retry-After``.
RATE_LIMIT_RETRIES = 20
ENROLL_PROBE = "enroll"


@dataclass(frozen=True, slots=True)
class Probe:
    """One unauthenticated request."""

    name: str
    method: str
    path: str
    body: bytes = b""
    content_type: str | None = None


PROBES = (
    Probe(name="healthz", method="GET", path="/healthz"),
    Probe(name="readyz", method="GET", path="/readyz"),
    Probe(name="metrics", method="GET", path="/metrics"),
    Probe(name="config", method="GET", path="/v1/config"),
    Probe(name="openapi", method="GET", path="/openapi.json"),
    Probe(name="docs", method="GET", path="/docs"),
    Probe(name="unknown_path", method="GET", path="/v1/groups"),
    Probe(
        name="contribution_no_token",
        method="POST",
        path="/v1/contributions",
        body=b"x",
        content_type=CONTRIBUTION_TYPE,
    ),
    Probe(
        name="close_no_token",
        method="POST",
        path="/v1/admin/close",
        body=b"{}",
        content_type="application/json",
    ),
    Probe(name="enroll", method="POST", path="/v1/enroll"),
)


def _mask(text: str) -> str:
    return RANDOM.sub(lambda m: "<random>" if any(c.isdigit() for c in m[0]) else m[0], text)


def snapshot(client: httpx.Client, url: str) -> dict[str, str]:
    """Every probe's answer, normalized (status, headers, body with random values masked)."""
    answers = {}
    for probe in PROBES:
        try:
            response = _ask(client, url, probe)
        except httpx.HTTPError as error:
            answers[probe.name] = f"transport error {type(error).__name__}"
            continue
        kept = sorted(
            f"{k}: {_mask(v)}"
            for k, v in response.headers.items()
            if k.lower() not in VOLATILE_HEADERS and k.lower() != "content-length"
        )
        body = _mask(response.text)
        answers[probe.name] = f"{response.status_code}\n" + "\n".join(kept) + "\n\n" + body
    return answers


def _ask(client: httpx.Client, url: str, probe: Probe) -> httpx.Response:
    """``probe``'s answer; for the enrolment probe alone (the one route with a documented
    per-address limit) after waiting out up to :data:`RATE_LIMIT_RETRIES` 429s. Any other
    probe's 429 is kept: an audited shuffler that rate-limits ``/metrics`` only at some fill
    levels would otherwise hide that its answers move with the group."""
    headers = {"Content-Type": probe.content_type} if probe.content_type else {}
    target = url.rstrip("/") + probe.path
    response = client.request(probe.method, target, content=probe.body, headers=headers)
    for _ in range(RATE_LIMIT_RETRIES if probe.name == ENROLL_PROBE else 0):
        if response.status_code != 429:
            break
        time.sleep(retry_after(response))
        response = client.request(probe.method, target, content=probe.body, headers=headers)
    return response


def surface_check(snapshots: list[tuple[int, dict[str, str]]]) -> list[Finding]:
    """Fail for each probe whose normalized answer differs between fill levels (the counts
    of canaries sent at each snapshot are in the detail)."""
    findings = []
    for probe in PROBES:
        answers = [(sent, shot[probe.name]) for sent, shot in snapshots]
        moved = len({answer for _, answer in answers}) > 1
        detail = (
            f"answer changes with the number of pending contributions ({[s for s, _ in answers]}): "
            f"{_difference(answers[0][1], answers[-1][1])}"
            if moved
            else f"same answer at {[s for s, _ in answers]} pending contributions"
        )
        findings.append(
            Finding(
                check="surface",
                name=probe.name,
                passed=not moved,
                statistic=float(moved),
                p_value=None,
                detail=detail,
            )
        )
    return findings


def _difference(first: str, last: str) -> str:
    a, b = first.splitlines(), last.splitlines()
    changed = [f"{x!r} -> {y!r}" for x, y in zip(a, b, strict=False) if x != y]
    return "; ".join(changed[:3])[:400]


def intake_checks(
    fleet: CanaryFleet,
    channel_id: str,
    payload_size: int,
    original: Sent,
    revoke: Callable[[str], None] | None,
) -> list[Finding]:
    """Replayed ciphertext (409), second contribution in an epoch (409), forged token (401),
    revoked token (401, needs the admin token), ciphertext sealed for another shuffler (400),
    undeclared crowd (400): each must be refused with the documented status and code."""
    fresh = fleet.enroll()
    checks: list[tuple[str, int, str, Callable[[], httpx.Response]]] = [
        ("replayed_ciphertext", 409, "replayed_nonce", lambda: fleet.post(original.blob, fresh)),
        ("second_in_epoch", 409, "quota_exceeded", lambda: fleet.post(
            fleet.seal(channel_id, payload_size, original.crowd_id, original.epoch, []),
            original.token)),
        ("forged_token", 401, "bad_token", lambda: fleet.post(
            original.blob, original.token.split(".")[0] + ".AAAA")),
        ("other_shuffler", 400, "malformed", lambda: fleet.post(
            _for_other_shuffler(fleet, channel_id, original), fleet.enroll())),
        ("undeclared_crowd", 400, "unknown_crowd", lambda: fleet.post(
            fleet.seal(channel_id, payload_size, "not-a-declared-crowd", original.epoch, []),
            fleet.enroll())),
    ]  # fmt: skip
    if revoke is not None:
        revoked = fleet.enroll()
        revoke(revoked.split(".")[0])
        empty = fleet.seal(channel_id, payload_size, original.crowd_id, original.epoch, [])
        checks.append(("revoked_token", 401, "revoked", lambda: fleet.post(empty, revoked)))
    findings = []
    for name, status, code, request in checks:
        response = request()
        got = _code(response)
        passed = response.status_code == status and got == code
        detail = f"expected {status} {code}, got {response.status_code} {got}"
        findings.append(
            Finding(
                check="intake",
                name=name,
                passed=passed,
                statistic=float(response.status_code),
                p_value=None,
                detail=detail,
            )
        )
    return findings


def _for_other_shuffler(fleet: CanaryFleet, channel_id: str, original: Sent) -> bytes:
    """A contribution sealed with this shuffler's key but bound to another shuffler's id."""
    contribution = Contribution(
        channel_id=channel_id,
        crowd_id=original.crowd_id,
        epoch=original.epoch,
        nonce=new_nonce(),
        fragments=(),
    )
    return seal(contribution.encode(), fleet.shuffler_key, outer_info(fleet.config.id + "-other"))


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", ""))
    except ValueError:
        return ""
