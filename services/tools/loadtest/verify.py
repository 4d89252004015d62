"""Verification after the run: close, drain, conservation, estimates against the population's
truth, and the certified ε per channel (with each shuffler's admin and metrics tokens).

Conservation (ESA-revisited Algorithm 3 deletes whole contributions before the analyzer sees
them): each contribution the run had acknowledged is received at the analyzer, deleted or still
held, the shuffler side read from each trust domain's ledger gauges (:mod:`runtime.conservation`;
without them :class:`VerifyError`). Estimates: each epoch's release against ``truth × kept``
(:func:`check_epochs`); per bin the epochs combine as Σ residuals over Σ sd (:func:`combine`,
valid however correlated they are, by Minkowski); the run fails if fewer intervals hold than
:data:`COVERAGE` allows with probability :data:`FALSE_ALARM`. Why these gauges and this
combination: docs/loadtest.md, "How verification decides".
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from scipy import stats

from runtime.conservation import (
    ANALYZER_FRAGMENTS,
    DELETION_CAUSES,
    FRAGMENT_STATES,
    LATE,
    LEDGER_CONTRIBUTIONS,
    LEDGER_DELETED,
)
from services.tools import loadgen
from services.tools.credentials import Credentials
from services.tools.loadtest.population import Population

Z95 = 1.959963984540054
#: Bins per channel whose estimate is checked against the truth.
CHECKED_BINS = 10
#: The coverage below which the 95% intervals count as failing (normal approximations are
#: rough for small counts; estimates of the wrong thing land nowhere near).
COVERAGE = 0.85
#: Probability of failing a correct deployment on the estimates.
FALSE_ALARM = 1e-6
_METRIC = re.compile(r"^(esa_[a-z_]+)(\{[^}]*\})? (\S+)$", re.MULTILINE)
#: The queues read from ``esa_shuffler_queue_depth``.
QUEUES = ("pending", "held", "in_batches_unforwarded")


#: How long verification waits for a service that does not answer at all (a refused or
#: broken connection: a crash and restart, docs/reliability.md) before it gives up.
RESTART_PATIENCE_SECONDS = 120.0


class VerifyError(RuntimeError):
    """Verification could not be completed (unreachable service, drain timed out)."""


def _request(
    method: str, url: str, patience: float | None = None, **options: Any
) -> httpx.Response:
    """One HTTP request, sent again while the service does not answer at all (connection
    refused or cut: restarting), for ``patience`` seconds (:data:`RESTART_PATIENCE_SECONDS`
    unless a caller's own deadline is nearer). Every request verification sends may be
    repeated (reads, and closes that are idempotent).

    Raises:
        httpx.HTTPError: still no answer after that, or any other failure.
    """
    wait = RESTART_PATIENCE_SECONDS if patience is None else patience
    deadline = time.monotonic() + wait
    while True:
        try:
            return httpx.request(method, url, **options)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def scrape(url: str, tokens: Credentials | None, patience: float | None = None) -> dict[str, float]:
    """A service's ``/metrics`` as {name{labels}: value} (with its metrics token; a service
    that does not answer is waited for ``patience`` seconds, as :func:`_request`)."""
    headers = {} if tokens is None else tokens.metrics_headers(url)
    try:
        response = _request("GET", url + "/metrics", patience, headers=headers, timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as error:
        raise VerifyError(f"metrics of {url}: {error}") from error
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition's ``esa_*`` samples as {name{labels}: value}."""
    return {m.group(1) + (m.group(2) or ""): float(m.group(3)) for m in _METRIC.finditer(text)}


def shuffler_state(
    urls: Sequence[str], tokens: Credentials, patience: float | None = None
) -> dict[str, dict[str, float]]:
    """Per shuffler (trust domain): acknowledged so far, deletions by cause
    (:func:`domain_state`) and its queues.

    Raises:
        VerifyError: a shuffler unreachable, or without the ledger gauges.
    """
    with ThreadPoolExecutor(len(urls)) as pool:
        scraped = list(pool.map(lambda url: scrape(url, tokens, patience), urls))
    found = {}
    for url, metrics in zip(urls, scraped, strict=True):
        queues = {q: metrics.get(f'esa_shuffler_queue_depth{{state="{q}"}}', 0.0) for q in QUEUES}
        found[url] = domain_state(metrics, url) | queues
    return found


def domain_state(metrics: Mapping[str, float], url: str) -> dict[str, float]:
    """The trust domain's ledger as read from its database (the ``/metrics`` of ``url``):
    acknowledged = the sum of every ledger state, deletions by cause (``late``: purged after
    reaching an evaluated group).

    Raises:
        VerifyError: no ledger gauge in ``metrics``.
    """
    states = [v for name, v in metrics.items() if name.startswith(LEDGER_CONTRIBUTIONS + "{")]
    if not states:
        raise VerifyError(
            f"{url}/metrics has no ledger gauges ({LEDGER_CONTRIBUTIONS}): shuffler too old "
            "to verify (or its database unreadable at this scrape)"
        )
    return {
        "received": math.fsum(states),
        **{
            f"deleted_{cause}": metrics.get(f'{LEDGER_DELETED}{{cause="{cause}"}}', 0.0)
            for cause in (*DELETION_CAUSES, LATE)
        },
    }


#: How long closing waits for an epoch a shuffler says has not started: the run sealed
#: requests for it but ended (``--duration``) before it began, so it begins within an epoch
#: of the run's end (or a shuffler's clock is that far behind this one).
NOT_STARTED_PATIENCE_SECONDS = 30.0


def close_epochs(
    urls: Sequence[str], tokens: Credentials, epochs: Mapping[str, Sequence[int]]
) -> None:
    """Close every run epoch of every channel at every shuffler (admin close, with each
    shuffler's own admin token).

    Raises:
        VerifyError: a shuffler refused or did not answer.
    """
    for channel_id, numbers in epochs.items():
        for epoch in numbers:
            for url in urls:
                _close(url, tokens, channel_id, epoch)


def _close(url: str, tokens: Credentials, channel_id: str, epoch: int) -> None:
    """One admin close; an epoch not started yet (``epoch_not_started``) is closed once it
    starts, within :data:`NOT_STARTED_PATIENCE_SECONDS`.

    Raises:
        VerifyError: refused otherwise, or not answered.
    """
    deadline = time.monotonic() + NOT_STARTED_PATIENCE_SECONDS
    where = f"closing {channel_id} epoch {epoch} at {url}"
    while True:
        try:
            response = _request(
                "POST",
                url + "/v1/admin/close",
                json={"channel_id": channel_id, "epoch": epoch},
                headers=tokens.admin_headers(url),
                timeout=300,
            )
        except httpx.HTTPError as error:
            raise VerifyError(f"{where}: {error}") from error
        if response.status_code == 200:
            return
        if '"epoch_not_started"' not in response.text or time.monotonic() > deadline:
            raise VerifyError(f"{where}: {response.text}")
        time.sleep(0.5)


def drain(analyzer_url: str, urls: Sequence[str], tokens: Credentials, timeout: float) -> float:
    """Wait until no shuffler has a pending contribution or an unforwarded batch and the
    analyzer has opened every stored part; returns the seconds it took. A service that does
    not answer meanwhile (the analyzer restarting after an outage, its database down) is
    waited for too, within the same ``timeout``: the shufflers hold what it has not taken.

    Raises:
        VerifyError: still not drained after ``timeout`` seconds (why: what was left, or
            the last service that did not answer).
    """
    start = time.monotonic()
    while True:
        try:
            state = shuffler_state(urls, tokens, _left(start, timeout))  # the drain's deadline
            waiting = sum(s["pending"] + s["in_batches_unforwarded"] for s in state.values())
            metrics = scrape(analyzer_url, tokens, _left(start, timeout))
            unopened = metrics.get("esa_analyzer_parts_unopened", math.nan)
            if waiting == 0 and unopened == 0:
                return time.monotonic() - start
            left = (
                f"{waiting:,.0f} contributions pending or in unforwarded batches at the "
                f"shufflers, {unopened} parts unopened at the analyzer"
            )
        except VerifyError as error:
            left = str(error)
        if time.monotonic() - start > timeout:
            raise VerifyError(f"not drained after {timeout:.0f} s: {left}")
        time.sleep(0.3)


def _left(start: float, timeout: float) -> float:
    """Seconds left of a ``timeout`` that began at ``start`` (monotonic), at least 0."""
    return max(0.0, timeout - (time.monotonic() - start))


def close_at_analyzer(
    analyzer_url: str, tokens: Credentials, epochs: Mapping[str, Sequence[int]]
) -> None:
    """Close every run epoch of every channel at the analyzer once drained: an epoch a
    shuffler sent nothing for (its group held below ``min_crowd``) is released now rather than
    at the analyzer's close timeout (docs/protocol-notes.md, "Releases wait for every
    shuffler"). Without the analyzer's admin token (401) such an epoch stays out of the
    release until then, and its note says so.

    Raises:
        VerifyError: the analyzer did not answer, or refused the close otherwise.
    """
    for channel_id, numbers in epochs.items():
        url = f"{analyzer_url}/v1/admin/channels/{channel_id}/close"
        try:
            response = _request(
                "POST",
                url,
                json={"epoch": max(numbers)},
                headers=tokens.admin_headers(analyzer_url),
                timeout=60,
            )
        except httpx.HTTPError as error:
            raise VerifyError(f"closing {channel_id} at {analyzer_url}: {error}") from error
        if response.status_code not in (200, 401):
            raise VerifyError(f"closing {channel_id} at {analyzer_url}: {response.text}")


def release(
    analyzer_url: str, channel_id: str, epochs: Sequence[int], k: int
) -> dict[str, Any] | None:
    """The channel's release over the run's epochs (None if the analyzer released nothing).

    Raises:
        VerifyError: the analyzer did not answer.
    """
    try:
        response = _request(
            "GET",
            f"{analyzer_url}/v1/channels/{channel_id}/estimate",
            params={"epoch_from": min(epochs), "epoch_to": max(epochs), "top": k},
            timeout=300,
        )
    except httpx.HTTPError as error:
        raise VerifyError(f"the release of {channel_id} at {analyzer_url}: {error}") from error
    if response.status_code != 200:
        return None
    found: dict[str, Any] = response.json()
    return found


def analyzer_fragments(url: str, tokens: Credentials | None, channel_id: str) -> dict[str, float]:
    """``channel_id``'s fragments in every part the analyzer opened so far, by any of its
    workers (``esa_analyzer_ledger_fragments``, read from its database: the same whichever
    worker answers): opened, and failed to open or parse (``invalid``).

    A longitudinal contribution carries exactly one fragment, so over a phase in which the
    channel alone sends, the change of ``opened`` is its contributions received (its release
    counts only the reports at each level's first node, and its crowds are tree nodes).

    Raises:
        VerifyError: no ledger sample for ``channel_id`` (an analyzer older than the gauge,
            the channel not configured there, or its database unreadable at this scrape).
    """
    metrics = scrape(url, tokens)
    keys = {
        state: f'{ANALYZER_FRAGMENTS}{{channel="{channel_id}",state="{state}"}}'
        for state in FRAGMENT_STATES
    }
    if any(key not in metrics for key in keys.values()):
        raise VerifyError(
            f"{url}/metrics has no {ANALYZER_FRAGMENTS} for channel {channel_id!r}: analyzer "
            "too old to verify, the channel not configured there, or its database unreadable"
        )
    return {state: metrics[key] for state, key in keys.items()}


def received_contributions(found: Mapping[str, Any]) -> int:
    """A histogram channel's contributions received: its release's n, the crowds its estimate
    rests on (the shufflers' claims, held within what their fragments allow; the certificate's
    ``crowds`` are lower confidence bounds, a few percent under an honest batch)."""
    return int(found["n"])


def check_estimates(
    target: loadgen.Target, population: Population, found: Mapping[str, Any], kept: float
) -> list[dict[str, float]]:
    """The largest true bins (every period of a longitudinal channel) of one release: truth,
    ``truth × kept`` (what an unbiased estimate targets), the estimate, the standard deviation
    of estimate − target (``spread``: the release's standard error and the binomial noise of
    what was kept) and the 95% interval."""
    values = dict(zip(found["bins"], found["values"], strict=True))
    errors = dict(zip(found["bins"], found["std_errors"], strict=True))
    kept = min(1.0, max(0.0, kept))
    truth = population.counts
    targets = np.asarray(truth * kept, dtype=np.float64)
    rows = []
    for b in np.argsort(-truth, kind="stable")[:CHECKED_BINS]:
        b = int(b)
        spread = math.sqrt(errors.get(b, 0.0) ** 2 + abs(truth[b]) * kept * (1 - kept))
        estimate = float(values.get(b, 0.0))
        rows.append(
            {
                "bin": b,
                "truth": float(truth[b]),
                "expected": float(targets[b]),
                "estimate": estimate,
                "spread": spread,
                "lo": estimate - Z95 * spread,
                "hi": estimate + Z95 * spread,
            }
        )
    return rows


def check_epochs(
    analyzer_url: str,
    target: loadgen.Target,
    population: Population,
    prepared: Mapping[int, int],
) -> tuple[list[dict[str, float]], dict[int, dict[str, Any]]]:
    """A histogram channel's estimates epoch by epoch (see module): each epoch's release
    against the population's truth × that epoch's kept share (received / ``prepared[epoch]``,
    the contributions prepared for it), then :func:`combine`. Returns the combined rows and,
    per epoch released, its received, prepared, kept share and rows (epochs the analyzer
    released nothing for are left out)."""
    per_epoch: dict[int, dict[str, Any]] = {}
    for epoch, count in sorted(prepared.items()):
        found = release(analyzer_url, target.channel.id, [epoch], population.k)
        if found is None or count <= 0:
            continue
        got = received_contributions(found)
        rows = check_estimates(target, population, found, got / count)
        per_epoch[epoch] = {"received": got, "prepared": count, "kept": got / count}
        per_epoch[epoch] |= {"checked": rows, "inside": count_inside(rows)}
    return combine([e["checked"] for e in per_epoch.values()]), per_epoch


def combine(epochs: Sequence[Sequence[Mapping[str, float]]]) -> list[dict[str, float]]:
    """Per bin, the epochs' rows as one: expected and estimate summed, the spread the sum of
    the epochs' spreads (an upper bound on the standard deviation of the summed residual
    whatever the epochs' correlation: the triangle inequality for standard deviations), the
    95% interval on it; ``truth`` stays one device's count and ``epochs`` counts the rows."""
    by_bin: dict[int, list[Mapping[str, float]]] = {}
    for rows in epochs:
        for row in rows:
            by_bin.setdefault(int(row["bin"]), []).append(row)
    combined = []
    for b, rows in by_bin.items():
        estimate = math.fsum(r["estimate"] for r in rows)
        spread = math.fsum(r["spread"] for r in rows)
        combined.append(
            {
                "bin": b,
                "truth": rows[0]["truth"],
                "expected": math.fsum(r["expected"] for r in rows),
                "estimate": estimate,
                "spread": spread,
                "lo": estimate - Z95 * spread,
                "hi": estimate + Z95 * spread,
                "epochs": len(rows),
            }
        )
    return combined


def count_inside(rows: Sequence[Mapping[str, float]]) -> int:
    """How many rows' 95% intervals hold what the estimator targets."""
    return sum(1 for r in rows if r["lo"] <= r["expected"] <= r["hi"])


def requests_in(paths: Sequence[Path]) -> int:
    """The requests in prepared request files (loadgen's records, read header by header)."""
    count = 0
    for path in paths:
        with path.open("rb") as handle:
            while head := handle.read(loadgen.RECORD.size):
                _, token_length, body_length = loadgen.RECORD.unpack(head)
                handle.seek(token_length + body_length, 1)
                count += 1
    return count


def fewest_inside(checked: int) -> int:
    """The fewest of ``checked`` 95% intervals that must hold their target (see module)."""
    return int(stats.binom.ppf(FALSE_ALARM, checked, COVERAGE)) if checked else 0


def conservation(
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    acknowledged: int,
    received: int,
) -> dict[str, Any]:
    """Acknowledged (this run's 202s) against received + deleted + held (shuffler deltas,
    :func:`shuffler_state`); ``purged_late`` is reported, not accounted for."""

    def delta(key: str) -> int:
        return int(sum(after[u][key] - before[u][key] for u in after))

    deleted = {c: delta(f"deleted_{c}") for c in DELETION_CAUSES}
    held, pending = delta("held"), delta("pending")
    accounted = received + sum(deleted.values()) + held + pending
    return {
        "acknowledged": acknowledged,
        "shufflers_acknowledged": delta("received"),
        "received_at_analyzer": received,
        "deleted": deleted,
        "purged_late": delta("deleted_late"),
        "held": held,
        "pending": pending,
        "lost": acknowledged - accounted,
        "per_shuffler": {
            url: {k: int(after[url][k] - before[url][k]) for k in after[url]} for url in after
        },
    }


def verdict(check: Mapping[str, Any], channels: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every reason the run fails (empty: it passes)."""
    return conservation_problems(check) + channel_problems(channels)


def conservation_problems(check: Mapping[str, Any]) -> list[str]:
    """What :func:`conservation` found wrong (empty: nothing lost or counted twice)."""
    problems = []
    if check["lost"] > 0:
        problems.append(f"{check['lost']:,} acknowledged contributions are nowhere (lost)")
    if check.get("purged_late", 0) > 0:
        problems.append(
            f"{check['purged_late']:,} acknowledged contributions were purged as late (they "
            "reached a group after its evaluation)"
        )
    if check["lost"] < 0:
        problems.append(
            f"{-check['lost']:,} more contributions reached the analyzer or the shufflers' "
            "ledgers than this run had acknowledged (counted twice, or other traffic in the "
            "run's epochs)"
        )
    if check["shufflers_acknowledged"] != check["acknowledged"]:
        problems.append(
            f"the shufflers acknowledged {check['shufflers_acknowledged']:,} contributions, "
            f"this run saw {check['acknowledged']:,} acknowledgements"
        )
    return problems


def channel_problems(channels: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Channels that received more than acknowledged, whose estimates could not all be
    checked, and too few estimates inside their intervals over all channels together."""
    problems = []
    for cid, row in channels.items():
        if row["received"] > row["acknowledged"]:
            problems.append(
                f"{cid}: the analyzer received {row['received']:,} contributions, this run had "
                f"{row['acknowledged']:,} acknowledged"
            )
        problems += unchecked(cid, row)
    checked = sum(len(r["checked"]) for r in channels.values())
    inside = sum(r["inside"] for r in channels.values())
    if inside < fewest_inside(checked):
        problems.append(
            f"only {inside} of {checked} estimates inside their 95% interval (at least "
            f"{fewest_inside(checked)} expected)"
        )
    return problems


def unchecked(cid: str, row: Mapping[str, Any]) -> list[str]:
    """A channel whose received contributions were not all under a checked estimate: every
    epoch's release must be readable (the epochs' counts add up to the run's release) and a
    channel that received anything must have checked rows — an analyzer that fails the
    per-epoch query must not make the estimate check pass on nothing."""
    problems = []
    per_epoch = row.get("per_epoch")
    if per_epoch is not None:
        counted = sum(int(epoch["received"]) for epoch in per_epoch.values())
        if counted != row["received"]:
            problems.append(
                f"{cid}: the epochs' releases hold {counted:,} contributions, the run's release "
                f"{row['received']:,}: an epoch's estimates could not be read and checked"
            )
    if row["received"] > 0 and not row["checked"]:
        problems.append(f"{cid}: {row['received']:,} contributions received, no estimate checked")
    return problems


def combined(phases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One verification from the phases' (each with its own conservation check): totals and
    per-shuffler deltas summed, every channel row, every phase's conservation problem and the
    estimates judged over all channels together."""
    checks = [p["check"] for p in phases]
    totals: dict[str, Any] = {}
    for key in checks[0]:
        if key == "per_shuffler":
            continue
        if key == "deleted":
            totals[key] = {c: sum(x[key][c] for x in checks) for c in checks[0][key]}
        else:
            totals[key] = sum(x[key] for x in checks)
    per_shuffler: dict[str, dict[str, int]] = {}
    for check in checks:
        for url, row in check["per_shuffler"].items():
            into = per_shuffler.setdefault(url, {})
            for key, value in row.items():
                into[key] = into.get(key, 0) + value
    channels = {cid: row for p in phases for cid, row in p["channels"].items()}
    problems = [x for p in phases for x in p["problems"]] + channel_problems(channels)
    return {
        "drain_seconds": round(sum(p["drain_seconds"] for p in phases), 1),
        "conservation": {
            "totals": totals,
            "per_shuffler": per_shuffler,
            "phases": {
                p["name"]: {k: v for k, v in p["check"].items() if k != "per_shuffler"}
                for p in phases
            },
        },
        "channels": channels,
        "problems": problems,
    }
