"""The audit's reports: ``audit.json`` (every finding, machine-readable) and ``audit.html``
(a table of verdicts and the plots: send order against batch position, where the earliest
canaries landed, how many contributions each group lost)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from services.tools.audit.checks import Finding
from services.tools.audit.runner import AuditResult


def write_reports(result: AuditResult, out: Path) -> tuple[Path, Path]:
    """Write ``audit.json`` and ``audit.html`` into ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "passed": result.passed,
        "summary": result.summary,
        "findings": [f.as_dict() for f in result.findings],
    }
    json_path, html_path = out / "audit.json", out / "audit.html"
    json_path.write_text(json.dumps(data, indent=2, default=str))
    html_path.write_text(_html(result))
    return json_path, html_path


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _html(result: AuditResult) -> str:
    rows = "".join(
        f"<tr class={'pass' if f.passed else 'fail'}><td>{html.escape(f.check)}</td>"
        f"<td>{html.escape(f.name)}</td><td>{'PASS' if f.passed else 'FAIL'}</td>"
        f"<td>{_number(f.statistic)}</td><td>{_number(f.p_value)}</td>"
        f"<td>{html.escape(f.detail)}</td></tr>"
        for f in result.findings
    )
    plots = "".join(
        f"<figure><img src='data:image/png;base64,{image}'><figcaption>"
        f"{html.escape(f.check)} / {html.escape(f.name)}</figcaption></figure>"
        for f in result.findings
        if f.plot and (image := _plot(f))
    )
    verdict = "PASSED" if result.passed else "FAILED"
    summary = html.escape(json.dumps(result.summary, indent=2, default=str))
    return (
        "<!doctype html><meta charset=utf-8><title>esa audit</title><style>"
        "body{font-family:sans-serif;margin:2em}"
        "td,th{padding:.2em .6em;border-bottom:1px solid #ddd}"
        ".fail{background:#fdd}.pass{background:#efe}figure{display:inline-block}</style>"
        f"<h1>Shuffler audit: {verdict}</h1><pre>{summary}</pre><table><tr><th>check</th>"
        f"<th>name</th><th>verdict</th><th>statistic</th><th>p-value</th><th>detail</th></tr>"
        f"{rows}</table>{plots}"
    )


def _plot(finding: Finding) -> str:
    """One finding's figure as base64 PNG ('' when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    figure, axes = plt.subplots(figsize=(5, 3.5))
    _draw(axes, finding.plot)
    axes.set_title(f"{finding.name} ({'pass' if finding.passed else 'FAIL'})")
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=80)
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _draw(axes: Any, plot: dict[str, Any]) -> None:
    if plot["kind"] == "scatter":
        xs, ys = zip(*plot["points"], strict=True) if plot["points"] else ((), ())
        axes.scatter(xs, ys, s=4)
        axes.set_xlabel("send order (within batch, scaled)")
        axes.set_ylabel("position in batch (scaled)")
    elif plot["kind"] == "bars":
        bins = range(len(plot["observed"]))
        axes.bar(bins, plot["observed"], label="observed")
        axes.plot(bins, plot["expected"], "k_", markersize=20, label="expected (uniform)")
        axes.set_xlabel("position decile of the earliest-sent canaries")
        axes.legend()
    elif plot["kind"] == "game":
        names = list(plot["bounds"])
        axes.bar(names, [plot["bounds"][k] for k in names], label="ε_lower (95%)")
        if plot["certified"] is not None:  # None: certified ε is ∞ (no line to draw)
            axes.axhline(plot["certified"], color="k", linestyle="--", label="certified ε")
        axes.set_ylabel("ε")
        axes.legend()
    else:
        labels = sorted(plot["histogram"], key=lambda k: (k == "absent", k))
        axes.bar(labels, [plot["histogram"][k] for k in labels])
        axes.set_xlabel("contributions deleted per group")
        axes.set_ylabel("groups")
