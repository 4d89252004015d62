"""Server-rendered dashboard: inline SVG charts and PNG images, no scripts, no network.

Per channel: the latest release as a top-k histogram with 95% error bars, an image (2-D
channels), or a running series with its 95% band (longitudinal); the crowd sizes behind the
certificate; and the privacy ledger: each epoch's certificate and whether it entered the
lifetime as the mechanism's dominating pair or as that certificate, the lifetime ε of a device in
every epoch (dp_accounting PLD composition) beside basic composition with the δ split (also as
the add/remove statement with randomized deletion), the device-side local-ε budget in use
(the signed config's caps against what a device that reported in every epoch has spent), and
the channel's health: per epoch, newest first, the batches received, the crowds they claim and
verify, parts quarantined, chaff and releases (all of it about released groups only).
"""

from __future__ import annotations

import base64
import html
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from analyzer.records import EpochHealth
from common.wire import (
    BudgetInUse,
    BudgetLimit,
    ChannelConfig,
    Ledger,
    LedgerRow,
    Lifetime,
    ReleaseBody,
)

WIDTH, HEIGHT, PAD = 640, 220, 36
#: Epochs per channel in the dashboard's health table (more than ``/metrics`` keeps: a page is
#: read by a person, not stored as series).
DASHBOARD_EPOCHS = 24


def png_gray(values: npt.ArrayLike, shape: tuple[int, int]) -> bytes:
    """An 8-bit grayscale PNG of ``values`` (clipped at 0, scaled to the maximum)."""
    image = np.clip(np.asarray(values, dtype=float).reshape(shape), 0, None)
    top = image.max() or 1.0
    pixels = (image / top * 255).astype(np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", shape[1], shape[0], 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def _scale(values: Sequence[float], low: float, high: float, size: float) -> list[float]:
    span = (high - low) or 1.0
    return [size - (v - low) / span * size for v in values]


def bars_svg(labels: Sequence[str], values: Sequence[float], errors: Sequence[float]) -> str:
    """Bars with 95% error bars."""
    if not values:
        return "<p>no data</p>"
    top = max(v + e for v, e in zip(values, errors, strict=True))
    bottom = min(0.0, min(v - e for v, e in zip(values, errors, strict=True)))
    step = (WIDTH - 2 * PAD) / len(values)
    ys = _scale(values, bottom, top, HEIGHT - 2 * PAD)
    zero = _scale([0.0], bottom, top, HEIGHT - 2 * PAD)[0]
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">']
    for i, (label, y, e) in enumerate(zip(labels, ys, errors, strict=True)):
        x = PAD + i * step
        height = abs(zero - y)
        half = e / ((top - bottom) or 1.0) * (HEIGHT - 2 * PAD)
        parts.append(
            f'<rect x="{x + 2:.1f}" y="{PAD + min(y, zero):.1f}" width="{step - 4:.1f}" '
            f'height="{height:.1f}" fill="#8fb3d9"/>'
        )
        parts.append(
            f'<line x1="{x + step / 2:.1f}" x2="{x + step / 2:.1f}" y1="{PAD + y - half:.1f}" '
            f'y2="{PAD + y + half:.1f}" stroke="#b2182b"/>'
        )
        parts.append(
            f'<text x="{x + step / 2:.1f}" y="{HEIGHT - 8}" font-size="9" '
            f'text-anchor="middle">{html.escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def series_svg(values: Sequence[float], errors: Sequence[float]) -> str:
    """A running series with its 95% band."""
    if not values:
        return "<p>no data</p>"
    upper = [v + 1.96 * e for v, e in zip(values, errors, strict=True)]
    lower = [v - 1.96 * e for v, e in zip(values, errors, strict=True)]
    low, high = min(lower), max(upper)
    step = (WIDTH - 2 * PAD) / max(1, len(values) - 1)
    xs = [PAD + i * step for i in range(len(values))]

    def points(series: Sequence[float]) -> str:
        return " ".join(
            f"{x:.1f},{PAD + y:.1f}"
            for x, y in zip(xs, _scale(series, low, high, HEIGHT - 2 * PAD), strict=True)
        )

    band = points(upper) + " " + " ".join(reversed(points(lower).split()))
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">'
        f'<polygon points="{band}" fill="#b2182b" fill-opacity="0.2"/>'
        f'<polyline points="{points(values)}" fill="none" stroke="#b2182b"/></svg>'
    )


@dataclass(frozen=True)
class ChannelView:
    """What the dashboard shows of one channel: its latest release summary, its ledger and its
    health (its newest epochs first, :meth:`analyzer.store.AnalyzerStore.channel_health`)."""

    config: ChannelConfig
    release: ReleaseBody | None
    ledger: Ledger | None
    health: Sequence[EpochHealth] = ()


def page(channels: Sequence[ChannelView]) -> str:
    """The whole dashboard page."""
    sections = "".join(_section(c) for c in channels) or "<p>No channels configured.</p>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ESA analyzer</title>
<link rel="icon" href="data:,">
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; }}
section {{ border-top: 1px solid #ccc; padding: 1rem 0; }}
table {{ border-collapse: collapse; font-size: 0.85rem; }}
td, th {{ border: 1px solid #ddd; padding: 0.2rem 0.5rem; text-align: right; }}
.chart {{ width: 100%; max-width: {WIDTH}px; }} .muted {{ color: #666; }}
img.channel {{ image-rendering: pixelated; width: 100%; max-width: 480px; border: 1px solid #ccc; }}
</style></head><body>
<h1>ESA analyzer</h1>
<p class="muted">Certified central (ε, δ) for every release; estimates with 95% intervals.</p>
{sections}
</body></html>"""


def _section(channel: ChannelView) -> str:
    name = html.escape(channel.config.id)
    head = (
        f'<section id="{name}"><h2>{name} '
        f'<span class="muted">({html.escape(channel.config.mechanism)})</span></h2>'
    )
    release = channel.release
    health = health_table(channel.health)
    if release is None:
        nothing = (
            "Nothing released yet: an epoch appears once every shuffler delivered its batch "
            "or at its close timeout."
            if channel.health
            else "No batch received yet."
        )
        return f"{head}<p>{nothing}</p>{health}</section>"
    cert = release.certificate
    summary = (
        f'<p class="certificate">n = <b class="n">{release.n:,}</b>; certified '
        f'<b>ε = <span class="eps">{cert.eps:.4g}</span></b>, δ = {cert.delta:.3g} '
        f"({html.escape(cert.neighbouring)}, {html.escape(cert.method)}); epochs "
        f"{release.epochs[0]}–{release.epochs[1]}</p>"
    )
    crowds = ", ".join(f"{html.escape(k)}: {v:,}" for k, v in sorted(release.crowds.items())[:12])
    chart = chart_for(channel.config, release)
    crowd_line = f'<p class="muted">crowds: {crowds}</p>'
    ledger = "" if channel.ledger is None else _ledger(channel.ledger)
    return head + summary + chart + crowd_line + ledger + health + "</section>"


def _eps(value: float | None) -> str:
    return "∞" if value is None else f"{value:.4g}"


def lifetime_line(lifetime: Lifetime | None, deleted: bool = False) -> str:
    """The lifetime ε of a device in every epoch (PLD) beside basic composition, δ split
    (``deleted``: the add/remove statement with randomized deletion)."""
    if lifetime is None:
        return '<p class="lifetime muted">No epoch charged yet.</p>' if not deleted else ""
    split = lifetime.delta_split
    kind, label = ("lifetime-deletion", "took part at all") if deleted else ("lifetime", "lifetime")
    return (
        f'<p class="{kind}">{label} over {lifetime.epochs} epochs '
        f"({lifetime.pair_parts} of {lifetime.parts} parts dominating pairs): "
        f'<b>ε = <span class="{kind}-eps">{_eps(lifetime.eps)}</span></b> '
        f"({html.escape(lifetime.method)}; PLD {_eps(lifetime.eps_pld)}, basic composition "
        f'<span class="basic-eps">{_eps(lifetime.eps_basic)}</span>, advanced '
        f"{_eps(lifetime.eps_advanced)}) at δ = {lifetime.delta:.3g} "
        f"(certificates {split.certificates:.3g}, composition {split.pld_pairs:.3g} of which "
        f"truncation ≤ {split.pld_truncation:.2g}, basic {split.basic_per_part:.2g} per part; "
        f"{html.escape(lifetime.neighbouring)})</p>"
    )


def _limit(limit: BudgetLimit) -> str:
    scope = "this channel" if limit.scope == "channel" else "the device (all channels)"
    span = (
        "lifetime"
        if limit.window_seconds is None
        else f"any {limit.window_seconds:,} s window (most in one)"
    )
    state = ' <b class="exhausted">exhausted</b>' if limit.exhausted else ""
    return (
        f'<li class="budget-limit">{scope}, {span}: ε ≤ {limit.eps:.4g}; spent '
        f"{_eps(limit.spent)}, left {limit.left:.4g}{state}</li>"
    )


def budget_block(budget: BudgetInUse | None) -> str:
    """The device-side local-ε budget in use: caps of the signed config, and what a device
    that reported in every epoch so far has spent (epochs × local ε, the SDK's rule)."""
    if budget is None:
        return ""
    limits = "".join(_limit(limit) for limit in budget.limits)
    caps = f"<ul>{limits}</ul>" if limits else " No device budget is set for it."
    return (
        f'<div class="device-budget"><p>device budget: local ε per report '
        f"{_eps(budget.local_eps)}; a device in all {budget.reports} epochs has spent "
        f'<b class="budget-spent">{_eps(budget.spent)}</b>.{caps}</p>'
        f'<p class="muted">{html.escape(budget.note)}</p></div>'
    )


def _ledger(ledger: Ledger) -> str:
    return (
        lifetime_line(ledger.lifetime)
        + lifetime_line(ledger.with_randomized_deletion, deleted=True)
        + budget_block(ledger.device_budget)
        + _epoch_table(ledger.epochs)
    )


def _epoch_table(rows: Sequence[LedgerRow]) -> str:
    cells = "".join(
        f"<tr><td>{row.epoch}</td><td>{row.n:,}</td><td>{_eps(row.certificate.eps)}</td>"
        f"<td>{row.certificate.delta:.3g}</td><td>{html.escape(row.certificate.method)}</td>"
        f'<td class="composed-as">{row.composed_as}</td></tr>'
        for row in rows[-10:]
    )
    return (
        '<table class="epochs"><tr><th>epoch</th><th>n</th><th>ε</th><th>δ</th>'
        f"<th>method</th><th>composed as</th></tr>{cells}</table>"
    )


def health_table(rows: Sequence[EpochHealth]) -> str:
    """The channel's health per epoch, newest first: batches complete, withheld and
    incomplete, the crowd received (claimed) and verified, parts quarantined, invalid
    fragments and releases published over the epoch (nothing when no batch was received)."""
    if not rows:
        return ""
    cells = "".join(
        f'<tr class="health-epoch"><td>{row.epoch}</td><td>{row.batches_complete:,}</td>'
        f"<td>{row.batches_withheld:,}</td><td>{row.batches_incomplete:,}</td>"
        f'<td class="received">{row.received:,}</td><td class="verified">{row.verified:,}</td>'
        f'<td class="quarantined">{row.parts_quarantined:,}</td>'
        f'<td class="invalid">{row.fragments_invalid:,}</td>'
        f'<td class="releases">{row.releases:,}</td></tr>'
        for row in rows
    )
    return (
        '<table class="health"><caption>health per epoch (released groups only)</caption>'
        "<tr><th>epoch</th><th>batches complete</th><th>withheld</th><th>incomplete</th>"
        "<th>contributions received</th><th>verified</th><th>parts quarantined</th>"
        f"<th>invalid fragments</th><th>releases</th></tr>{cells}</table>"
    )


def image_png(config: ChannelConfig, release: ReleaseBody) -> bytes | None:
    """The release as a grayscale PNG, for an image channel (bins not in the summary are 0)."""
    if config.display != "image" or config.image_shape is None:
        return None
    rows, columns = config.image_shape
    values = np.zeros(rows * columns)
    values[np.asarray(release.bins, dtype=np.int64)] = release.values
    return png_gray(values, config.image_shape)


def chart_for(config: ChannelConfig, release: ReleaseBody) -> str:
    """The chart a person wants for this channel's kind."""
    image = image_png(config, release)
    if image is not None:
        data = base64.b64encode(image).decode()
        return f'<img class="channel" alt="reconstruction" src="data:image/png;base64,{data}">'
    if config.display == "series":
        return series_svg(release.values, release.std_errors)
    labels = [str(b) for b in release.bins[:20]]
    errors = [1.96 * e for e in release.std_errors[:20]]
    return bars_svg(labels, release.values[:20], errors)
