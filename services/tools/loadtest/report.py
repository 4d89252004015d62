"""The load test's JSON and HTML reports: throughput, latency percentiles and errors over time,
RSS per local service, conservation and each channel's estimates and certified ε."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any


def public_samples(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples without the monitor's private fields."""
    return [{k: v for k, v in s.items() if not k.startswith("_")} for s in samples]


def delivery(run: dict[str, Any]) -> str:
    """How a run's requests ended: acknowledged at once, refused and then delivered (the
    refusals waited out, by status), never delivered (refused for good, or still refused when
    their epoch ended)."""
    later = run.get("refused_then_delivered", 0)
    retried = ", ".join(f"{k}: {v:,}" for k, v in run.get("retried", {}).items()) or "none"
    return (
        f"{run['accepted'] - later:,} delivered at once, {later:,} refused then delivered "
        f"(refusals waited out: {retried}), {run.get('never_delivered', 0):,} never delivered"
    )


def write_json(path: Path, summary: dict[str, Any]) -> None:
    """The whole summary (samples included) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return base64.b64encode(buffer.getvalue()).decode()


def plots(samples: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each plot over the run's samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not samples:
        return []
    t = [s["t"] for s in samples]
    out = []
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot(t, [s["offered_per_s"] for s in samples], label="offered/s")
    ax.plot(t, [s["accepted_per_s"] for s in samples], label="accepted (202)/s")
    ax.set_xlabel("seconds")
    ax.legend()
    out.append(("Throughput", _png(fig)))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3))
    for q in ("p50_ms", "p95_ms", "p99_ms"):
        ax.plot(t, [math.nan if s[q] is None else s[q] for s in samples], label=q)
    ax.set_ylabel("ms")
    ax.set_xlabel("seconds")
    ax.legend()
    out.append(("Latency percentiles (answers in each second)", _png(fig)))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3))
    kinds = sorted({k for s in samples for k in s["errors"]})
    for kind in kinds:
        ax.plot(t, [s["errors"].get(kind, 0) for s in samples], label=kind)
    ax.set_ylabel("errors so far")
    ax.set_xlabel("seconds")
    if kinds:
        ax.legend()
    out.append(("Errors by status (cumulative)", _png(fig)))
    plt.close(fig)
    if samples[0]["rss_mb"]:
        fig, ax = plt.subplots(figsize=(8, 3))
        for name in samples[0]["rss_mb"]:
            ax.plot(t, [s["rss_mb"].get(name, math.nan) for s in samples], label=name)
        ax.set_ylabel("RSS MiB (with children)")
        ax.set_xlabel("seconds")
        ax.legend()
        out.append(("Memory per local service", _png(fig)))
        plt.close(fig)
    return out


def write_html(path: Path, summary: dict[str, Any]) -> None:
    """A self-contained HTML page: the summary tables and the plots."""
    run = summary["run"]
    rows = [
        ("offered / accepted", f"{run['offered']:,} / {run['accepted']:,} in {run['seconds']} s"),
        ("rate offered / accepted", f"{run['offered_per_s']:,}/s / {run['accepted_per_s']:,}/s"),
        ("latency p50 / p95 / p99", f"{run['p50_ms']} / {run['p95_ms']} / {run['p99_ms']} ms"),
        ("errors", json.dumps(run["errors"]) or "none"),
        ("delivery", delivery(run)),
        ("preparation", json.dumps(summary["preparation"])),
    ]
    verification = summary.get("verification")
    if verification:
        rows.append(
            (
                "verdict",
                "PASS"
                if not verification["problems"]
                else "FAIL: " + "; ".join(verification["problems"]),
            )
        )
        rows.append(("conservation", json.dumps(verification["conservation"]["totals"])))
        for cid, channel in verification["channels"].items():
            eps = channel["central_eps"]
            rows.append(
                (
                    cid,
                    f"n {channel['n']:,} of {channel['acknowledged']:,} sent; certified ε "
                    f"{'∞' if eps is None else f'{eps:.3g}'} (δ {channel['delta']}); "
                    f"{channel['inside']} of {len(channel['checked'])} estimates inside",
                )
            )
    table = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    figures = "".join(
        f'<h2>{html.escape(title)}</h2><img src="data:image/png;base64,{data}">'
        for title, data in plots(summary["samples"])
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>esa loadtest</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}th{text-align:left;"
        "padding-right:1em;vertical-align:top}</style>"
        f"<h1>esa loadtest: {html.escape(summary['analyzer_url'])}</h1>"
        f"<table>{table}</table>{figures}"
    )
