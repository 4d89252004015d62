"""``esa audit`` (issue 15): the duration of a full audit of a local shuffler, and the power of
the empirical privacy game (check 8).

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/audit.py [--pooled]``. Prints a
markdown section for docs/benchmarks.md.

1. Full audit: ``esa audit sink`` and ``esa shuffler serve`` as real processes (SQLite, the
   production batching and forwarding intervals), an audit channel declaring ``--crowds``
   crowds (64, the most a channel may declare: 63 full canary groups and the small one), and
   :func:`services.tools.audit.runner.run_audit` with the admin close, timed end to end.
2. Power: :func:`services.tools.audit.game.privacy_game` on simulated trials of the same game
   through a uniform shuffle — binary RR ε0 = 4, crowd 20, δ = 1e-6 — at several trial counts,
   against the exact ε of that pair (FMT21 Appendix F, :func:`common.accounting.lower.lower_2rr`).
3. With ``--pooled``: ``run_audit`` with ``game_trials`` on a channel of short epochs, so the
   game's trials are pooled over several real epochs (one round per epoch).
4. With ``--game-channels``: the privacy game of each default channel's mechanism
   (:mod:`services.tools.audit.mechgame`): ε_lower at 95% beside the channel's certified
   replacement ε, from seeded simulated trials (the real encoders, a uniform shuffle) at a small
   crowd and at one where the certificate shows amplification, and from one real audit run per
   channel (``game_channel``, ``--game-crowds`` declared crowds, one epoch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.accounting.lower import lower_2rr
from services.tools.audit.game import Trial, privacy_game, rr_one_probability
from services.tools.audit.mechgame import MechanismGame, mechanism_game, simulate, statistic_eps
from services.tools.audit.runner import AuditConfig, AuditResult, run_audit
from tests.support import UNFOLLOWED, free_port, shuffler_process, wait_until

TOKEN = "benchmark-sink-token-0123"
PRODUCTION_INTERVALS = {
    "batch_interval_seconds": "1.0",
    "forward_interval_seconds": "0.5",
    "enroll_per_minute": "1000000",
    "rate_per_second": "1000",
    "rate_burst": "1000",
}


def _channel(crowds: int, epoch_seconds: int, max_fragments: int = 4) -> dict[str, object]:
    names = [f"c{i:02d}" for i in range(crowds - 1)] + ["small"]
    return {"id": "audit", "epoch_seconds": epoch_seconds, "min_crowd": 5, "eps_cr": 4.0,
            "delta_cr": 1e-7, "max_fragments": max_fragments, "crowds": names}  # fmt: skip


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def audit_once(
    tmp: Path, crowds: int, epoch_seconds: int, game_trials: int, game_channel: str | None = None
) -> tuple[float, AuditResult]:
    """A sink and a shuffler, one audit run; its wall time and result."""
    port = free_port()
    sink_url = f"http://127.0.0.1:{port}"
    log = (tmp / "sink.log").open("ab")
    sink = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "audit", "sink", "--port", str(port),
         "--token", TOKEN],
        stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    channel = _channel(crowds, epoch_seconds, 255 if game_channel else 4)
    shuffler = shuffler_process(
        tmp, "shuffler-1", [channel], analyzer_url=sink_url, **PRODUCTION_INTERVALS,
        **UNFOLLOWED,  # the sink has no analyzer behind it: no signed config to follow
    )  # fmt: skip
    try:
        wait_until(lambda: _ready(sink_url), timeout=30)
        shuffler.start()
        config = AuditConfig(
            shuffler_url=shuffler.url,
            sink_url=sink_url,
            sink_token=TOKEN,
            channel_id="audit",
            admin_token="development",
            game_trials=game_trials,
            skew_seconds=0.5,
            game_channel=game_channel,
        )
        start = time.perf_counter()
        result = run_audit(config, lambda text: print(f"  {text}", file=sys.stderr))
        return time.perf_counter() - start, result
    finally:
        shuffler.stop()
        sink.terminate()
        sink.wait(10)
        log.close()


def simulated_power(trials: int, seeds: int, n: int = 20, eps0: float = 4.0) -> list[float]:
    """ε_lower at 95% of ``seeds`` independent simulated games of ``trials`` groups each."""
    values = []
    p_one = [rr_one_probability(0, eps0), rr_one_probability(1, eps0)]
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(trials):
            secret = int(rng.integers(2))
            reports = (rng.random(n) < p_one[0]).astype(int)
            reports[0] = int(rng.random() < p_one[secret])
            rng.shuffle(reports)
            out.append(Trial(secret, tuple(int(r) for r in reports), n, 1))
        statistic = privacy_game(out, eps0, 1e-6).statistic
        values.append(float(statistic or 0.0))
    return values


#: Default channels the game covers, with a small crowd and one where the certificate shows
#: amplification (report fragments: none up to 500; zero-sum: ∞ below its declared n = 2000).
GAME_CROWDS = {"homepage": (20, 500), "homepage-fragments": (20, 100), "picture": (20, 500),
               "features": (50, 2000)}  # fmt: skip


def _eps_text(eps: float) -> str:
    return "∞" if eps > 29.9 else f"{eps:.2f}"


def channel_games(trials: int, seeds: int, pooled: int) -> list[str]:
    """Table rows: ε_lower at 95% (median, min–max over seeds) of simulated games of each
    default channel beside its certified replacement ε and the ε of the count statistic."""
    rows = []
    for channel, crowds in GAME_CROWDS.items():
        game = MechanismGame.named(channel)
        for n, count in ((crowds[0], trials), (crowds[0], pooled), (crowds[1], trials)):
            runs = seeds if n * count <= 100_000 and count == trials else 1
            start = time.perf_counter()
            found = [mechanism_game(simulate(game, n, count, seed), game) for seed in range(runs)]
            values = [float(f.statistic or 0.0) for f in found]
            cert = game.certified(n)
            rows.append(
                f"| {channel} ({game.mechanism_name}) | {n} | {count} × {runs} | "
                f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) | "
                f"{_eps_text(statistic_eps(game, n, cert.delta or game.delta))} | "
                f"{cert.eps:.2f} ({cert.method}) | "
                f"{'pass' if all(f.passed for f in found) else 'FAIL'} | "
                f"{time.perf_counter() - start:.0f} s |"
            )  # fmt: skip
            print(rows[-1], file=sys.stderr)
    return rows


def _describe(duration: float, result: AuditResult) -> tuple[str, str]:
    failed = [f"{f.check}.{f.name}" for f in result.findings if not f.passed]
    game = next(f for f in result.findings if f.name == "distinguishing_game")
    timing = next(f for f in result.findings if f.name == "release_independent_of_arrival")
    row = (f"{duration:.1f} s, {result.summary['canaries']} canaries, "
           f"{result.summary['batches']} batches, {len(result.findings)} checks, "
           f"failed: {failed or 'none'}")  # fmt: skip
    return row, f"{game.detail}; timing: {timing.detail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crowds", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--pooled", action="store_true", help="also pool the game over epochs")
    parser.add_argument("--pooled-trials", type=int, default=24)
    parser.add_argument("--pooled-epoch-seconds", type=int, default=20)
    parser.add_argument(
        "--game-channels",
        action="store_true",
        help="the privacy game of each default channel's mechanism",
    )
    parser.add_argument("--game-trials", type=int, default=200)
    parser.add_argument(
        "--game-pooled-trials",
        type=int,
        default=1000,
        help="trials of one more simulated game at each channel's small crowd",
    )
    parser.add_argument(
        "--game-crowds",
        type=int,
        default=16,
        help="declared crowds of the real runs with --game-channels",
    )
    args = parser.parse_args()
    if args.game_channels:
        print("\n".join(_channel_section(args)))
        return
    load = os.getloadavg()[0]
    lines = ["### Audit (issue 15)", "",
             "`flock /tmp/esa-bench.lock .venv/bin/python benchmarks/audit.py"
             f"{' --pooled' if args.pooled else ''}` on 2 shared cores "
             f"(1-minute load average {load:.1f} at the start).", ""]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        duration, result = audit_once(Path(tmp), args.crowds, 86400, 0)
    row, game = _describe(duration, result)
    lines += [f"* Full audit, {args.crowds} declared crowds, one epoch: {row}.", f"  {game}."]
    if args.pooled:
        with tempfile.TemporaryDirectory() as tmp:
            duration, result = audit_once(
                Path(tmp), 7, args.pooled_epoch_seconds, args.pooled_trials
            )
        row, game = _describe(duration, result)
        lines += [f"* `--game-trials {args.pooled_trials}`, 7 crowds, epochs of "
                  f"{args.pooled_epoch_seconds} s: {row}.", f"  {game}."]  # fmt: skip
    exact = lower_2rr(4.0, 20, 1e-6).eps
    lines += ["", f"Power (simulated uniform shuffle, binary RR ε0 = 4, crowd 20, δ = 1e-6; exact "
              f"ε of the pair {exact:.2f}; {args.seeds} seeds each):", "",
              "| trials | ε_lower at 95%: median (min–max) | median / exact |",
              "|---|---|---|"]  # fmt: skip
    for trials in (63, 126, 200, 252, 400):
        values = simulated_power(trials, args.seeds)
        median = statistics.median(values)
        lines.append(f"| {trials} | {median:.2f} ({min(values):.2f}–{max(values):.2f}) | "
                     f"{median / exact:.2f} |")  # fmt: skip
    print("\n".join(lines))


def _channel_section(args: argparse.Namespace) -> list[str]:
    load = os.getloadavg()[0]
    lines = ["`flock /tmp/esa-bench.lock .venv/bin/python benchmarks/audit.py --game-channels` "
             f"(1-minute load average {load:.1f} at the start).", "",
             "Simulated (the channel's real encoder, a seeded uniform shuffle; target value 0 or "
             "1, every other canary 2):", "",
             "| channel | crowd | trials × seeds | ε_lower at 95%: median (min–max) | "
             "ε of S_b−S_a's laws | certified ε (replacement) | verdict | time |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += channel_games(args.game_trials, args.seeds, args.game_pooled_trials)
    lines += ["", f"Through a real shuffler (`esa audit run --game-channel …`, {args.game_crowds} "
              "declared crowds, one epoch, default group size; audit channel min_crowd 5, "
              "ε_cr 4, δ_cr 1e-7, max_fragments 255):", ""]  # fmt: skip
    for channel in GAME_CROWDS:
        with tempfile.TemporaryDirectory() as tmp:
            duration, result = audit_once(Path(tmp), args.game_crowds, 86400, 0, channel)
        row, game = _describe(duration, result)
        lines += [f"* `{channel}`: {row}.", f"  {game.split('; timing:')[0]}."]
        print(lines[-2], lines[-1], file=sys.stderr)
    return lines


if __name__ == "__main__":
    main()
