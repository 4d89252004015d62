"""One load test from start to end: prepare, run with the live view, verify, report; the
histogram channels together, then each longitudinal channel in a phase of its own."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from services.tools import loadgen, stopping
from services.tools.credentials import Credentials
from services.tools.loadtest import live, refusals, report, verify
from services.tools.loadtest.population import Population
from services.tools.loadtest.prepare import LoadPlan, Prepared, prepare, series_waves


@dataclass(frozen=True)
class Options:
    """Everything ``esa loadtest`` was asked to do."""

    plan: LoadPlan
    rate: float | loadgen.Pace | None
    concurrency: int
    #: Each party's admin and metrics tokens (None: the run is not verified).
    tokens: Credentials | None
    out: Path
    drain_timeout: float = 600.0
    live: bool = True
    local: Mapping[str, int] = field(default_factory=dict)
    #: Refusal codes the deployment is expected to answer (``--expect-refusal``): counted by
    #: code, never a verification problem, and no reason to stop (:mod:`.refusals`).
    expected: frozenset[str] = frozenset()


def _row(
    options: Options,
    cid: str,
    target: loadgen.Target,
    population: Population,
    epochs: list[int],
    sent: int,
    received: int | None,
    prepared: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """One channel's release over ``epochs``, its estimates checked and its certified ε;
    ``received`` None: the release's batch crowds (histogram channels). With ``prepared`` (per
    epoch, the contributions prepared for it: a histogram channel) the estimates are checked
    epoch by epoch and combined (:func:`verify.check_epochs`); without, the release over
    ``epochs`` is checked as one (a longitudinal phase: every period is a bin of its own)."""
    url = options.plan.analyzer_url
    found = verify.release(url, cid, epochs, population.k)
    row: dict[str, Any] = {"acknowledged": sent, "n": 0, "received": received or 0}
    row |= {"checked": [], "inside": 0, "central_eps": None, "delta": None, "method": None}
    row |= {"population": population.spec, "epochs": [min(epochs), max(epochs)]}
    if found is None:
        return row
    got = verify.received_contributions(found) if received is None else received
    if prepared is None:
        checked = verify.check_estimates(target, population, found, got / sent if sent else 0.0)
    else:
        checked, per_epoch = verify.check_epochs(url, target, population, prepared)
        row["per_epoch"] = {str(e): v for e, v in per_epoch.items()}
    certificate = found["certificate"]
    eps = certificate["eps"]
    return row | {
        "n": int(found["n"]),
        "received": got,
        "checked": checked,
        "inside": verify.count_inside(checked),
        "central_eps": None if eps is None or not math.isfinite(eps) else float(eps),
        "delta": certificate["delta"],
        "method": certificate["method"],
        "local": found.get("local"),
    }


def verification(
    options: Options,
    prepared: Prepared,
    before: dict[str, dict[str, float]],
    stats: loadgen.Stats,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The histogram channels' phase: close, drain, conservation and estimates (:mod:`.verify`)."""
    assert options.tokens is not None
    urls = prepared.shuffler_urls
    verify.close_epochs(urls, options.tokens, prepared.epochs)
    say("epochs closed; waiting for every batch to reach the analyzer")
    drained = verify.drain(options.plan.analyzer_url, urls, options.tokens, options.drain_timeout)
    verify.close_at_analyzer(options.plan.analyzer_url, options.tokens, prepared.epochs)
    after = verify.shuffler_state(urls, options.tokens)
    owner = list(prepared.targets) + [_channel_of(name) for name in prepared.clocks]
    channels = {
        cid: _row(
            options,
            cid,
            target,
            prepared.populations[cid],
            prepared.epochs[cid],
            sum(stats.accepted_by_tag.get(tag, 0) for tag, c in enumerate(owner) if c == cid),
            None,
            _prepared_counts(prepared, cid),
        )
        for cid, target in prepared.targets.items()
    }
    received = sum(r["received"] for r in channels.values())
    check = verify.conservation(before, after, stats.accepted, received)
    problems = verify.conservation_problems(check)
    return {
        "name": "histograms",
        "drain_seconds": drained,
        "check": check,
        "channels": channels,
        "problems": problems,
    }


def _channel_of(clock_group: str) -> str:
    """The channel of a clock group's name (``pages@+600s``: ``pages``)."""
    return clock_group.rsplit("@", 1)[0]


def _prepared_counts(prepared: Prepared, cid: str) -> dict[int, int]:
    """Per epoch of the run, the contributions of ``cid`` sent in it, the clock groups'
    included: the devices whose clock is off are a random part of the population (the
    estimate's kept share is received / all of them, whichever epoch their clocks named)."""
    counts = {e: verify.requests_in(paths) for e, paths in prepared.files[cid].items()}
    for name, by_epoch in prepared.clocks.items():
        if _channel_of(name) == cid:
            for epoch, paths in by_epoch.items():
                counts[epoch] = counts.get(epoch, 0) + verify.requests_in(paths)
    return counts


def clock_summary(prepared: Prepared, stats: loadgen.Stats) -> dict[str, Any]:
    """Per clock group (``--clock-offset``): prepared, answered (every request's last
    answer: a group's refusals are not waited out unless a shuffler says they heal),
    acknowledged, refused by error code, and the answers by status."""
    found = {}
    for tag, name in enumerate(prepared.clocks, start=len(prepared.targets)):
        answers = Counter[int]()
        for (_, t), counted in stats.by_shuffler_tag.items():
            answers += counted if t == tag else Counter()
        refused = stats.refusals_by_tag.get(tag, Counter())
        found[name] = {
            "prepared": sum(verify.requests_in(p) for p in prepared.clocks[name].values()),
            "answered": stats.accepted_by_tag.get(tag, 0) + sum(refused.values()),
            "acknowledged": stats.accepted_by_tag.get(tag, 0),
            "refused": dict(refused.most_common()),
            "statuses": {str(k): v for k, v in sorted(answers.items())},
        }
    return found


def series_phase(
    options: Options, prepared: Prepared, cid: str, console: Console
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A longitudinal channel on its own: its devices' reports sent in waves, one epoch each
    (:class:`loadgen.SeriesWaves`: period t in the t-th, unless an epoch ended before its wave
    was sent, whose rest goes in the next), then with the admin token: close, drain,
    conservation (received = the analyzer's fragments opened meanwhile: one per contribution)
    and every period's estimate against the truth (not if a shuffler refused more than it
    acknowledged: :func:`refusals.check_answers` raises). Returns the phase's run summary and
    its verification."""
    target, token = prepared.series[cid], options.tokens
    urls, analyzer = prepared.shuffler_urls, options.plan.analyzer_url
    waves = series_waves(prepared, cid, options.out)
    before = verify.shuffler_state(urls, token) if token else {}
    opened = verify.analyzer_fragments(analyzer, token, cid) if token else {}
    driver = loadgen.Driver(urls, max(1, options.concurrency // len(urls)))
    monitor = live.Monitor(driver=driver, shuffler_urls=urls, local=options.local)
    rate = options.rate if isinstance(options.rate, int | float) else None
    console.log(f"{cid}: periods in waves of one {target.channel.epoch_seconds}-s epoch")
    spent = stopping.run(live.replay_waves(monitor, waves, rate, console, options.live))
    epochs, periods = waves.epochs, prepared.populations[cid].k
    run = live.summary(monitor, spent) | {"periods": periods, "waves": len(epochs)}
    run |= {"rolled_over": waves.rolled_over, "epochs": [min(epochs), max(epochs)]}
    run |= {"samples": report.public_samples(monitor.samples)}
    console.log(
        f"{cid}: {driver.stats.accepted:,} accepted over {periods} periods in {len(epochs)} "
        f"epochs ({waves.rolled_over:,} reports sent in a later epoch than their period's)"
    )
    if token is None:
        return run, None
    if refusals.EPOCH_NOT_OPEN not in options.expected:  # as the histograms' phase
        refusals.check_answers(driver.stats, urls, [cid], {cid: epochs})
    checked = _series_verification(
        options, prepared, cid, epochs, before, opened, driver.stats.accepted
    )
    checked["problems"] += refusals.unexpected(driver.stats.refusals, options.expected)
    return run, checked


def _series_verification(
    options: Options, prepared: Prepared, cid: str, epochs: list[int],
    before: dict[str, dict[str, float]], opened: dict[str, float], acknowledged: int,
) -> dict[str, Any]:  # fmt: skip
    """A longitudinal phase's verification: close, drain, conservation with received = the
    analyzer's fragments opened since ``opened``, every period's estimate."""
    assert options.tokens is not None
    token, urls, analyzer = options.tokens, prepared.shuffler_urls, options.plan.analyzer_url
    verify.close_epochs(urls, token, {cid: [max(epochs)]})  # closes every epoch up to it
    drained = verify.drain(analyzer, urls, token, options.drain_timeout)
    verify.close_at_analyzer(analyzer, token, {cid: [max(epochs)]})
    after, now = verify.shuffler_state(urls, token), verify.analyzer_fragments(analyzer, token, cid)
    received = int(now["opened"] - opened["opened"])
    population = prepared.populations[cid]
    row = _row(options, cid, prepared.series[cid], population, epochs, acknowledged, received)
    check = verify.conservation(before, after, acknowledged, received)
    problems = verify.conservation_problems(check)
    if now["invalid"] > opened["invalid"]:
        problems.append(
            f"{cid}: {now['invalid'] - opened['invalid']:,.0f} fragments failed to "
            "open or parse at the analyzer"
        )
    return {"name": cid, "drain_seconds": drained, "check": check,
            "channels": {cid: row}, "problems": problems}  # fmt: skip


def _histograms(
    options: Options, prepared: Prepared, console: Console
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """The histogram channels' run: its summary, samples and verification; the first request
    of each channel goes alone before the load, and the run stops unverified if a shuffler
    refused more of a channel than it acknowledged (:mod:`.refusals`: a closed epoch)."""
    plan, urls, say = options.plan, prepared.shuffler_urls, console.log
    before = verify.shuffler_state(urls, options.tokens) if options.tokens else {}
    driver = loadgen.Driver(urls, max(1, options.concurrency // len(urls)))
    monitor = live.Monitor(driver=driver, shuffler_urls=urls, local=options.local)
    epochs = {cid: t.channel.epoch_seconds for cid, t in prepared.targets.items()}
    epochs |= {name: epochs[_channel_of(name)] for name in prepared.clocks}
    source = loadgen.ChannelSource({**prepared.files, **prepared.clocks}, epochs)
    on_time = len(prepared.targets)  # the tags of the devices on true time
    start, first = min((min(e) * epochs[c], (c, min(e))) for c, e in prepared.epochs.items())
    what = f"the run's planned start (epoch {first[1]} of {first[0]})"
    live.wait_until(start, what, console, options.live)
    say(f"run: {prepared.count:,} contributions prepared, {len(prepared.targets)} channels")
    if refusals.EPOCH_NOT_OPEN not in options.expected:  # else a refusal proves no closure
        refusals.preflight(driver, source, on_time)
    after_preflight = _on_time_refusals(driver.stats, on_time)  # at the epoch's start, retried
    seconds = stopping.run(
        live.replay(monitor, source, options.rate, plan.duration, console, options.live)
    )
    run = live.summary(monitor, seconds)
    run["prepared_not_sent"] = prepared.count - driver.sent
    run["clocks"] = clock_summary(prepared, driver.stats)
    refused = _on_time_refusals(driver.stats, on_time) - after_preflight
    # a clock group's refusals: beyond the skew is what they test, anything else is not
    skewed = driver.stats.refusals - _on_time_refusals(driver.stats, on_time)
    run["expected_refusals"] = {c: n for c, n in refused.items() if c in options.expected}
    rate = run["accepted_per_s"]
    say(f"run finished: {run['accepted']:,} accepted in {seconds:.1f} s ({rate:,}/s)")
    checked = None
    if options.tokens:
        if refusals.EPOCH_NOT_OPEN not in options.expected:
            refusals.check_answers(driver.stats, urls, source.channels[:on_time], prepared.epochs)
        checked = verification(options, prepared, before, driver.stats, say)
        checked["problems"] += refusals.unexpected(refused, options.expected)
        checked["problems"] += refusals.unexpected(skewed, options.expected | CLOCK_REFUSALS)
    return run, report.public_samples(monitor.samples), checked


#: What a shuffler answers a device whose clock is off (beyond the skew or the grace).
CLOCK_REFUSALS = frozenset({refusals.EPOCH_NOT_OPEN})


def _on_time_refusals(stats: loadgen.Stats, on_time: int) -> Counter[str]:
    """The refusals of the devices on true time (tags below ``on_time``) by error code: a
    clock group's are expected and reported apart (:func:`clock_summary`)."""
    found = Counter[str]()
    for tag, counted in stats.refusals_by_tag.items():
        found += counted if tag < on_time else Counter()
    return found


def execute(options: Options, console: Console) -> dict[str, Any]:
    """The whole load test; returns the summary (``verification.problems`` empty: passed):
    the histogram channels' run, then each longitudinal channel's phase.

    Raises:
        loadgen.LoadError, PopulationError: nothing could be prepared.
        refusals.RefusedError: the shufflers refused the run's contributions (a closed
            epoch, most likely by an earlier run's verification); nothing was verified.
        verify.VerifyError: verification could not complete.
    """
    plan = options.plan
    prepared = prepare(plan, console.log)
    if options.tokens is not None:
        parties = {"analyzer": plan.analyzer_url, **prepared.parties}
        try:
            options = replace(options, tokens=options.tokens.for_parties(parties))
        except ValueError as error:
            prepared.close()
            raise verify.VerifyError(str(error)) from error
    for skipped in prepared.skipped:
        console.log(f"left out: {skipped}")
    summary: dict[str, Any] = {
        "analyzer_url": plan.analyzer_url,
        "devices": plan.devices,
        "channels": {cid: p.spec for cid, p in prepared.populations.items()},
        "skipped_channels": prepared.skipped,
        "preparation": {k: round(v, 1) for k, v in prepared.timings.items()},
        "series": {},
    }
    phases = []
    try:
        if prepared.targets:
            summary["run"], summary["samples"], checked = _histograms(options, prepared, console)
            phases += [checked] if checked else []
        for cid in prepared.series:
            summary["series"][cid], checked = series_phase(options, prepared, cid, console)
            phases += [checked] if checked else []
    except BaseException:  # a failure or a stop: no step of the workers' to wait for
        prepared.close(0.0)
        raise
    prepared.close()
    if "run" not in summary:  # longitudinal channels only: the first one's run is the run
        first = summary["series"][next(iter(prepared.series))]
        summary["run"], summary["samples"] = first, first["samples"]
    if phases:
        summary["verification"] = verify.combined(phases)
    summary["report"] = str(options.out / "loadtest.html")
    report.write_json(options.out / "loadtest.json", summary)
    report.write_html(options.out / "loadtest.html", summary)
    return summary
