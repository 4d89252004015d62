"""The HTML report of ``esa demo``: one self-contained page (inline PNG plots, no scripts)."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.tools.demo_results import Z95, ChannelResult, budget_text, lifetime_text

#: Bins a histogram plot shows (the largest true values).
PLOTTED = 20
#: What the report's "Privacy over time" table shows.
PRIVACY_INTRO = """<p>The analyzer charges each epoch once, at the crowds it received. A device
that reported in every epoch loses the composition of the epochs: composed by privacy-loss
distributions (dp_accounting, pessimistic) of each epoch's dominating pair, or of its (ε, δ)
certificate for mechanisms without one, beside basic composition. The device budget is the
local-ε cap of the signed config that the SDK enforces, against epochs × local ε.</p>"""


def _png(figure: object) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    return base64.b64encode(buffer.getvalue()).decode()


def plot(result: ChannelResult, shape: tuple[int, int] | None = None) -> str:
    """One channel's figure as base64 PNG: estimate with 95% intervals against the truth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    truth = np.array(result.truth, dtype=np.float64) * result.kept
    values = np.zeros(truth.size)
    errors = np.zeros(truth.size)
    index = np.array(result.release["bins"], dtype=np.int64)
    values[index] = result.release["values"]
    errors[index] = result.release["std_errors"]
    if result.display == "image" and shape is not None:
        figure, axes = plt.subplots(1, 2, figsize=(7, 3.4))
        for axis, image, name in zip(
            axes,
            (truth, np.clip(values, 0, None)),
            ("truth × kept", "released estimate"),
            strict=True,
        ):
            axis.imshow(image.reshape(shape), cmap="gray")
            axis.set_title(name)
            axis.axis("off")
    elif result.display == "series":
        figure, axis = plt.subplots(figsize=(7, 3.4))
        periods = np.arange(1, truth.size + 1)
        axis.plot(periods, truth, "k-o", label="truth × kept")
        axis.errorbar(periods, values, yerr=Z95 * errors, fmt="s", capsize=3, label="estimate")
        axis.set_xticks(periods)
        axis.set_xlabel("period")
        axis.set_ylabel("devices in state 1")
        axis.legend()
    else:
        figure, axis = plt.subplots(figsize=(7, 3.4))
        top = np.argsort(-truth, kind="stable")[:PLOTTED]
        x = np.arange(top.size)
        axis.bar(x, truth[top], color="0.8", label="truth × kept")
        axis.errorbar(x, values[top], yerr=Z95 * errors[top], fmt="o", capsize=3, label="estimate")
        axis.set_xticks(x, [str(b) for b in top], rotation=90, fontsize=7)
        axis.set_xlabel("value (largest true counts)")
        axis.set_ylabel("devices")
        axis.legend()
    figure.suptitle(result.title, fontsize=10)
    encoded = _png(figure)
    plt.close(figure)
    return encoded


def _epsilon(value: float | None) -> str:
    return "∞" if value is None else f"{value:.3g}"


def privacy_rows(results: Sequence[ChannelResult]) -> str:
    """One row per channel: the lifetime ε of a device in every epoch (PLD) beside basic
    composition, the δ and its split, the add/remove lifetime and the device budget in use."""
    rows = []
    for r in results:
        life = r.lifetime
        deleted = r.privacy.get("with_randomized_deletion")
        budget = r.privacy.get("device_budget") or {}
        if life is None:
            rows.append(f"<tr><td>{html.escape(r.channel_id)}</td><td colspan=7>—</td></tr>")
            continue
        split = life["delta_split"]
        rows.append(
            f"<tr><td>{html.escape(r.channel_id)}</td><td>{life['epochs']}</td>"
            f'<td class="lifetime-pld">{_epsilon(life["eps_pld"])}</td>'
            f'<td class="lifetime-basic">{_epsilon(life["eps_basic"])}</td>'
            f"<td>{life['delta']:.0e}</td><td>certificates {split['certificates']:.1e}, "
            f"composition {split['pld_pairs']:.1e}</td>"
            f"<td>{_epsilon(None if deleted is None else deleted['eps'])}</td>"
            f"<td>{_epsilon(budget.get('spent'))} ({_caps(budget.get('limits', []))})</td></tr>"
        )
    return (
        "<table><tr><th>channel</th><th>epochs</th><th>lifetime ε (PLD)</th>"
        "<th>basic composition</th><th>δ</th><th>δ split</th><th>took part ε</th>"
        f"<th>device budget spent</th></tr>{''.join(rows)}</table>"
    )


def _caps(limits: list[dict[str, object]]) -> str:
    if not limits:
        return "no cap set"
    over = sum(1 for limit in limits if limit["exhausted"])
    return f"{len(limits)} cap(s), {over} exhausted"


def _epochs(result: ChannelResult) -> str:
    """The channel's per-epoch certificates (last 10) and its lifetime and budget lines."""
    cells = "".join(
        f"<tr><td>{row['epoch']}</td><td>{row['n']:,}</td><td>{_epsilon(row['eps'])}</td>"
        f"<td>{row['delta']:.0e}</td><td>{html.escape(str(row['method']))}</td>"
        f"<td>{html.escape(str(row['composed_as']))}</td></tr>"
        for row in result.epochs[-10:]
    )
    return (
        f'<p class="lifetime">{html.escape(lifetime_text(result.lifetime))}</p>'
        f'<p class="budget">{html.escape(budget_text(result.privacy.get("device_budget")))}</p>'
        "<table><tr><th>epoch</th><th>n</th><th>ε</th><th>δ</th><th>method</th>"
        f"<th>composed as</th></tr>{cells}</table>"
    )


def _release_rows(results: Sequence[ChannelResult]) -> list[str]:
    """One table row per channel: n, central and local ε, took-part ε, error, coverage."""
    rows = []
    for r in results:
        local = "—" if r.local_eps is None else f"{r.local_eps:.2f}"
        central = f"{r.central_eps:.3f}" if math.isfinite(r.central_eps) else "∞ (no bound)"
        took_part = "—" if r.add_remove_eps is None else f"{r.add_remove_eps:.2f}"
        rows.append(
            f"<tr><td>{html.escape(r.channel_id)}</td><td>{r.mechanism}</td>"
            f"<td>{r.devices:,}</td><td>{r.n:,}</td><td>{central}</td>"
            f"<td>{r.release['certificate']['delta']:.0e}</td><td>{local}</td>"
            f"<td>{took_part}</td><td>{r.rmse:.1f}</td><td>{r.inside}/{len(r.checked)}</td></tr>"
        )
    return rows


def write(
    path: Path,
    results: Sequence[ChannelResult],
    shapes: dict[str, tuple[int, int]],
    dashboard: str | None,
    header: str,
) -> Path:
    """Write the report and return its path."""
    rows = _release_rows(results)
    sections = []
    for r in results:
        method = html.escape(str(r.release["certificate"]["method"]))
        sections.append(
            f"<h2>{html.escape(r.title)}</h2>"
            f"<p>Certified central ε = {r.central_eps:.3f} (δ = "  # prints "inf" for no bound
            f"{r.release['certificate']['delta']:.0e}, {method}, "
            f"{html.escape(str(r.release['certificate']['neighbouring']))} neighbours) over "
            f"{r.n:,} contributions.</p>"
            f'<img alt="{html.escape(r.channel_id)}" '
            f'src="data:image/png;base64,{plot(r, shapes.get(r.channel_id))}">' + _epochs(r)
        )
    link = (
        f'<p>Live dashboard: <a href="{html.escape(dashboard)}">{html.escape(dashboard)}</a></p>'
        if dashboard
        else ""
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ESA demo report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}}
</style></head><body>
<h1>ESA demo report</h1><p>{html.escape(header)}</p>{link}
<p>Estimates are compared with <em>truth × kept</em>: randomized deletion (ESA-revisited,
Algorithm 3) removes whole contributions before the analyzer sees them. Intervals are 95%,
widened by that deletion's sampling noise. Central and local ε are in the certificate's
neighbouring notion (removal: one user's report replaced by the reference input); "took part
ε" covers whether a user contributed at all (add-remove, with randomized deletion). The
longitudinal comparison uses one kept share for all periods, although deletion removes a
larger share of the smaller period batches: read it as approximate.</p>
<table><tr><th>channel</th><th>mechanism</th><th>devices</th><th>n released</th>
<th>central ε</th><th>δ</th><th>local ε</th><th>took part ε</th><th>RMSE</th>
<th>checked inside</th></tr>
{"".join(rows)}</table>
<h2>Privacy over time</h2>
{PRIVACY_INTRO}
{privacy_rows(results)}
{"".join(sections)}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
