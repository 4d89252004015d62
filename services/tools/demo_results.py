"""The demo's outcome per channel: what the simulated devices held, what the analyzer
released, and how the two compare.

Randomized deletion (ESA-revisited Algorithm 3) removes whole contributions at random, so an
unbiased estimate targets ``truth * kept``; the interval :func:`check` uses adds that sampling
noise (``truth * kept * (1 - kept)``, the binomial approximation) to the analyzer's standard
error, at 95% (:data:`Z95`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from common.mechanisms.longitudinal import ChangeLog
from common.wire import ChannelConfig

IntArray = npt.NDArray[np.int64]

#: Two-sided 95% normal quantile.
Z95 = 1.959963984540054
#: How many of a channel's largest true bins the demo prints and checks.
SHOWN = 5


@dataclass
class Truth:
    """What the simulated devices of one channel hold.

    Attributes:
        config: The channel.
        values: One value per device (histogram channels).
        changes: The change log (longitudinal channels).
        counts: True histogram (or per-period sum of states) over all devices.
    """

    config: ChannelConfig
    counts: IntArray
    values: IntArray | None = None
    changes: ChangeLog | None = None


@dataclass
class ChannelResult:
    """One channel's outcome: what was sent, what the analyzer released, how it compares."""

    channel_id: str
    title: str
    mechanism: str
    display: str
    devices: int
    delivered: int
    release: dict[str, Any]
    truth: list[int]
    bins: list[int] = field(default_factory=list)
    checked: list[dict[str, float]] = field(default_factory=list)
    #: The channel's privacy ledger (``GET /v1/channels/{id}/privacy``): per-epoch
    #: certificates, the lifetime ε of a device in every epoch, the device budget in use.
    privacy: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Contributions the release counts."""
        return int(self.release["n"])

    @property
    def kept(self) -> float:
        """Share of devices whose contribution reached the analyzer (randomized deletion)."""
        return min(1.0, self.n / self.devices) if self.devices else 0.0

    @property
    def central_eps(self) -> float:
        """The certified central ε of the release."""
        eps = self.release["certificate"]["eps"]
        return math.inf if eps is None else float(eps)  # JSON carries "no bound" as null

    @property
    def local_eps(self) -> float | None:
        """The local ε of one report in the certificate's notion, if the mechanism has one."""
        local = self.release.get("local") or {}
        notion = "replacement" if self.neighbouring == "replacement" else "removal"
        value = local.get(notion)
        return None if value is None or not math.isfinite(value) else float(value)

    @property
    def neighbouring(self) -> str:
        """The neighbouring notion of the certificate (the local ε is shown in the same one)."""
        return str(self.release["certificate"]["neighbouring"])

    @property
    def add_remove_eps(self) -> float | None:
        """ε for whether a user took part at all (add-remove, with randomized deletion)."""
        other = self.release.get("with_randomized_deletion") or {}
        value = other.get("eps")
        return None if value is None else float(value)

    @property
    def lifetime(self) -> dict[str, Any] | None:
        """The lifetime (ε, δ) of a device in every epoch so far (PLD beside basic)."""
        found: dict[str, Any] | None = self.privacy.get("lifetime")
        return found

    @property
    def epochs(self) -> list[dict[str, Any]]:
        """Each charged epoch: n, its certificate and whether it entered as a pair."""
        return [
            {
                "epoch": row["epoch"],
                "n": row["n"],
                "eps": row["certificate"]["eps"],
                "delta": row["certificate"]["delta"],
                "method": row["certificate"]["method"],
                "composed_as": row.get("composed_as", "certificate"),
            }
            for row in self.privacy.get("epochs", [])
        ]

    @property
    def inside(self) -> int:
        """How many checked bins hold their expected value inside the interval."""
        return sum(1 for row in self.checked if row["lo"] <= row["expected"] <= row["hi"])

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``esa demo --json``)."""
        return {
            "channel_id": self.channel_id,
            "mechanism": self.mechanism,
            "devices": self.devices,
            "delivered": self.delivered,
            "n": self.n,
            "kept": self.kept,
            "central_eps": self.central_eps if math.isfinite(self.central_eps) else None,
            "neighbouring": self.release["certificate"]["neighbouring"],
            "central_delta": self.release["certificate"]["delta"],
            "method": self.release["certificate"]["method"],
            "local_eps": self.local_eps,
            "add_remove_eps": self.add_remove_eps,
            "rmse": self.rmse,
            "checked": self.checked,
            "inside": self.inside,
            "epochs": self.epochs,
            "lifetime": self.lifetime,
            "lifetime_with_deletion": self.privacy.get("with_randomized_deletion"),
            "device_budget": self.privacy.get("device_budget"),
        }

    @property
    def rmse(self) -> float:
        """Root-mean-square error of the estimate against ``truth * kept`` over all bins."""
        values = np.zeros(len(self.truth))
        values[np.array(self.release["bins"], dtype=np.int64)] = self.release["values"]
        return float(np.sqrt(np.mean((values - np.array(self.truth) * self.kept) ** 2)))


def _eps(value: float | None, digits: int = 3) -> str:
    return "∞" if value is None else f"{value:.{digits}g}"


def lifetime_text(lifetime: dict[str, Any] | None) -> str:
    """One line: the lifetime ε by PLD composition beside basic (and advanced) composition,
    at the total δ, with how δ is split."""
    if lifetime is None:
        return "no epoch charged yet"
    if lifetime["eps"] is None:
        return (
            f"lifetime ε (PLD) = ∞ over {lifetime['epochs']} epochs beside basic composition ∞: "
            "an epoch certifies no finite ε (e.g. Balcer–Cheu below its declared crowd)"
        )
    split = lifetime["delta_split"]
    return (
        f"lifetime ε (PLD) = {_eps(lifetime['eps_pld'])} over {lifetime['epochs']} epochs "
        f"({lifetime['pair_parts']} of {lifetime['parts']} parts dominating pairs) beside basic "
        f"composition {_eps(lifetime['eps_basic'])} (advanced {_eps(lifetime['eps_advanced'])}; "
        f"certified {_eps(lifetime['eps'])} by {lifetime['method']}) at δ = "
        f"{lifetime['delta']:.2g}, {lifetime['neighbouring']}; δ split: certificates "
        f"{split['certificates']:.2g}, composition {split['pld_pairs']:.2g} (truncation ≤ "
        f"{split['pld_truncation']:.1g}), basic {split['basic_per_part']:.2g} per part"
    )


def budget_text(budget: dict[str, Any] | None) -> str:
    """One line: the device-side local-ε budget in use (the signed config's caps) and what a
    device that reported in every epoch so far has spent (epochs × local ε)."""
    if budget is None:
        return "device budget: not reported by this analyzer"
    caps = []
    for limit in budget["limits"]:
        span = "lifetime" if limit["window_seconds"] is None else f"{limit['window_seconds']} s"
        over = " EXHAUSTED" if limit["exhausted"] else ""
        caps.append(
            f"{limit['scope']} {span} ε ≤ {limit['eps']:g} (spent {_eps(limit['spent'])}, "
            f"left {limit['left']:.3g}){over}"
        )
    return (
        f"device budget: local ε per report {_eps(budget['local_eps'])}; a device in all "
        f"{budget['reports']} epochs spent {_eps(budget['spent'])}; "
        + ("caps: " + "; ".join(caps) if caps else "no cap set in the signed config")
    )


def check(result: ChannelResult, truth: Truth) -> None:
    """Compare the largest true bins (every period for a series) with the release."""
    release = result.release
    values = dict(zip(release["bins"], release["values"], strict=True))
    errors = dict(zip(release["bins"], release["std_errors"], strict=True))
    if result.display == "series":
        shown = list(range(truth.counts.size))
    else:
        shown = [int(b) for b in np.argsort(-truth.counts, kind="stable")[:SHOWN]]
    kept = result.kept
    result.bins = shown
    targets = np.asarray(truth.counts * kept, dtype=np.float64)
    for b in shown:
        expected = float(targets[b])
        spread = math.sqrt(errors[b] ** 2 + abs(truth.counts[b]) * kept * (1 - kept))
        result.checked.append(
            {
                "bin": b,
                "truth": float(truth.counts[b]),
                "expected": expected,
                "estimate": float(values[b]),
                "lo": float(values[b]) - Z95 * spread,
                "hi": float(values[b]) + Z95 * spread,
            }
        )
