"""One audit run (``esa audit run``): canaries through the audited shuffler, the epoch closed,
the sink's records read back, every check run.

The audit channel must carry canaries alone (its groups' sizes are then known exactly), and the
shuffler must forward to an :mod:`audit sink <services.tools.audit.sink>`. Full groups get
``group_size`` canaries and the last crowd ``min_crowd − 1``; the first full group is sent before
every other and the last after (:func:`services.tools.audit.checks.arrival_pattern_check`).
With ``game_trials``, more privacy-game rounds follow, one per epoch
(:mod:`~services.tools.audit.game`, :mod:`~services.tools.audit.mechgame`).

The steps of a run: docs/audit.md, "One run, step by step".
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from common.envelope import load_ed25519_public
from common.randomness import RandomSource, SeededSource, SystemSource
from common.wire import ChannelPolicy, ShufflerConfig, unb64
from services.tools.audit import checks, game, mechgame, probes
from services.tools.audit.canary import MIN_PAYLOAD, CanaryFleet, CanaryKey, Sent
from services.tools.audit.sink import fetch_records

Progress = Callable[[str], None]


class AuditError(RuntimeError):
    """The audit could not run (shuffler or sink unreachable, channel unsuitable)."""


@dataclass
class AuditConfig:
    """What one run needs; ``group_size`` None picks a size Algorithm 3 almost surely
    releases (:func:`default_group_size`); ``payload_size`` is replaced by the audited
    channel's own before anything is sealed."""

    shuffler_url: str
    sink_url: str
    sink_token: str
    channel_id: str
    admin_token: str | None = None
    signing_key: str | None = None
    payload_size: int = 16
    group_size: int | None = None
    fragments: int = 3
    settle_seconds: float = 2.0
    wait_seconds: float = 120.0
    skew_seconds: float = 2.0
    game_eps0: float = 4.0
    game_delta: float = 1e-6
    game_trials: int = 0
    game_channel: str | None = None
    round_seconds: float = 2.0
    seed: int | None = None


@dataclass
class AuditResult:
    """Every finding and what the run did."""

    findings: list[checks.Finding]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.findings)


@dataclass(frozen=True)
class GamePlan:
    """Which privacy game the canaries play: binary RR with ε0 (``mechanism`` None) or a
    default channel's mechanism (:mod:`~services.tools.audit.mechgame`)."""

    eps0: float
    delta: float
    mechanism: mechgame.MechanismGame | None = None
    max_fragments: int = 255

    @classmethod
    def of(cls, config: AuditConfig, policy: ChannelPolicy) -> GamePlan:
        """Raises: AuditError: an unknown or unsupported game channel."""
        if config.game_channel is None:
            return cls(config.game_eps0, config.game_delta)
        try:
            mechanism = mechgame.MechanismGame.named(config.game_channel)
        except mechgame.GameError as error:
            raise AuditError(str(error)) from error
        return cls(config.game_eps0, config.game_delta, mechanism, min(255, policy.max_fragments))

    def payloads(self, value: int, source: RandomSource) -> list[bytes]:
        """The mechanism fragments of one canary's report of ``value`` (A or B by the secret
        for a target, C otherwise).

        Raises:
            AuditError: a report with no fragment or more than the audit channel allows (the
                report cannot be redrawn: that would change the mechanism's law).
        """
        assert self.mechanism is not None
        fragments = self.mechanism.encode(value, source)
        if not 1 <= len(fragments) <= self.max_fragments:
            raise AuditError(
                f"a {self.mechanism.mechanism_name} canary report has {len(fragments)} fragments:"
                f" the audit channel's max_fragments must be >= that (at most 255), for "
                f"{self.mechanism.channel!r} about 8 sd above its mean (services/tools/catalogue)"
            )
        return fragments

    def trials(
        self, batches: Iterable[checks.ReassembledBatch], secrets: dict[str, int], fragments: int
    ) -> list[Any]:
        if self.mechanism is None:
            return game.trials_from(list(batches), secrets, fragments)
        return mechgame.trials_from(batches, secrets, self.mechanism)

    def finding(self, trials: Sequence[Any]) -> checks.Finding:
        if self.mechanism is None:
            return game.privacy_game(trials, self.eps0, self.delta)
        return mechgame.mechanism_game(trials, self.mechanism)

    def outcomes(self, trials: Sequence[Any], run: str) -> dict[str, Any]:
        if self.mechanism is None:
            return game.outcomes(trials, self.eps0, self.delta, run)
        return mechgame.outcomes(trials, self.mechanism, run)


def _channel_payload_size(config: AuditConfig, policy: ChannelPolicy) -> AuditConfig:
    """The config with the audit channel's own payload size (shufflers refuse a fragment of
    any other sealed size), which must fit a marker and the game's mechanism fragment.

    Raises:
        AuditError: the channel's payload size is too small, or the game channel is unknown.
    """
    needed = MIN_PAYLOAD
    if config.game_channel is not None:
        try:
            needed += mechgame.MechanismGame.named(config.game_channel).fragment_size
        except mechgame.GameError as error:
            raise AuditError(str(error)) from error
    if policy.payload_size < needed:
        raise AuditError(
            f"the audit channel {policy.id!r} has payload_size={policy.payload_size}: declare "
            f"at least {needed} to carry a canary's marker"
            + (f" and a {config.game_channel} fragment" if config.game_channel else "")
        )
    return replace(config, payload_size=policy.payload_size)


def default_group_size(policy: ChannelPolicy) -> int:
    """Contributions per canary group: min_crowd + c + 1 + 10·b (b = 2/ε_cr, c = b·ln(2/δ_cr)),
    so a group is held with probability below e^−10/2 (Algorithm 3's threshold)."""
    b = 2.0 / policy.eps_cr
    return math.ceil(policy.min_crowd + b * math.log(2.0 / policy.delta_cr) + 1 + 10 * b)


def run_audit(config: AuditConfig, progress: Progress = lambda _: None) -> AuditResult:
    """Run the whole audit once.

    Raises:
        AuditError: the shuffler or sink cannot be used for an audit.
    """
    with httpx.Client(timeout=30) as client:
        shuffler = _shuffler_config(client, config.shuffler_url)
        policy = next((c for c in shuffler.channels if c.id == config.channel_id), None)
        if policy is None:
            raise AuditError(f"channel {config.channel_id!r} is not served by {shuffler.id}")
        config = _channel_payload_size(config, policy)
        key, plan_game = CanaryKey.fresh(), GamePlan.of(config, policy)
        fleet = CanaryFleet(client, config.shuffler_url, shuffler, key)
        plan = _plan(config, policy)
        epoch = _epoch_with_room(policy, sum(n for _, n in plan))
        before = len(_records(client, config, 0))
        secrets = _secrets(config, plan)
        sent, shots = _send(fleet, config, plan, epoch, secrets, plan_game, progress)
        progress("probing intake refusals")
        revoke = _revoker(client, config) if config.admin_token else None
        intake = probes.intake_checks(fleet, policy.id, config.payload_size, sent[0], revoke)
        closes_at = _close(client, config, policy, epoch, progress)
        records = _collect(client, config, before, progress)
        extra = _game_rounds(
            fleet, config, policy, plan, epoch, (len(secrets), plan_game), progress
        )
    signing = load_ed25519_public(unb64(config.signing_key or shuffler.signing_key))
    parts = checks.parse_parts(records, key)
    ours = [p for p in parts if p.batch is None or p.batch.shuffler_id == shuffler.id]
    audited = [p for p in ours if p.batch is not None and p.batch.epoch == epoch]
    batches = checks.assemble(audited, policy.id)
    mine = [p for p in audited if p.batch and p.batch.channel_id == policy.id]
    full, small = [c for c, n in plan if n == plan[0][1]], [c for c, n in plan if n != plan[0][1]]
    trials = plan_game.trials(batches, secrets, config.fragments) + extra
    findings = [
        *checks.order_checks(batches),
        *checks.metadata_checks(ours, signing, config.payload_size, policy.id),
        *probes.surface_check(shots),
        *checks.crowd_checks(batches, policy, small),
        *checks.deletion_checks(batches, sent, policy, full),
        *checks.timing_checks(audited, policy.id, closes_at, config.skew_seconds),
        checks.arrival_pattern_check(mine, sent, (full[0], full[-1]), config.round_seconds),
        *intake,
        plan_game.finding(trials),
    ]
    summary = {
        "shuffler": shuffler.id,
        "channel": policy.model_dump(),
        "epoch": epoch,
        "canaries": len(sent),
        "groups": dict(plan),
        "parts_recorded": len(records),
        "batches": len(batches),
        "signing_key": config.signing_key or shuffler.signing_key,
        "signing_key_source": "pinned" if config.signing_key else "shuffler /v1/config",
        "alpha": checks.ALPHA,
        "game": plan_game.outcomes(trials, key.run.hex()),
    }
    return AuditResult(findings, summary)


def _shuffler_config(client: httpx.Client, url: str) -> ShufflerConfig:
    try:
        response = client.get(url.rstrip("/") + "/v1/config")
        response.raise_for_status()
    except httpx.HTTPError as error:
        raise AuditError(f"cannot read {url}/v1/config: {error}") from error
    return ShufflerConfig.model_validate_json(response.content)


def _plan(config: AuditConfig, policy: ChannelPolicy) -> list[tuple[str, int]]:
    """(crowd, canaries) for every declared crowd: the last is the small group."""
    if config.fragments > policy.max_fragments or config.fragments < 1:
        raise AuditError(f"fragments must be in 1..{policy.max_fragments}")
    if len(policy.crowds) < 2:
        raise AuditError("the audit channel needs at least two declared crowds")
    size = config.group_size or default_group_size(policy)
    plan = [(crowd, size) for crowd in policy.crowds[:-1]]
    if policy.min_crowd > 1:
        plan.append((policy.crowds[-1], policy.min_crowd - 1))
    return plan


def _epoch_with_room(policy: ChannelPolicy, contributions: int, after: int = -1) -> int:
    """The current epoch (later than ``after``), after waiting for the next one when this one
    ends before the canaries could all be sent (about 20 ms each, plus margin)."""
    needed = 10.0 + 0.05 * contributions
    if needed > policy.epoch_seconds:
        raise AuditError(f"epochs of {policy.epoch_seconds} s are too short for the canaries")
    now = time.time()
    epoch = int(now // policy.epoch_seconds)
    if epoch <= after:
        time.sleep((after + 1) * policy.epoch_seconds - now + 0.5)
        now, epoch = time.time(), after + 1
    remaining = (epoch + 1) * policy.epoch_seconds - now
    if remaining < needed:
        time.sleep(remaining + 0.5)
        epoch += 1
    return epoch


def _game_rounds(
    fleet: CanaryFleet,
    config: AuditConfig,
    policy: ChannelPolicy,
    plan: list[tuple[str, int]],
    epoch: int,
    played: tuple[int, GamePlan],
    progress: Progress,
) -> list[Any]:
    """More privacy-game trials, one round per following epoch (full groups only, each with
    fresh secrets), until ``config.game_trials`` are pooled with the ``have`` already run."""
    full = [(crowd, n) for crowd, n in plan if n == plan[0][1]]
    have, plan_game = played
    trials: list[Any] = []
    seq = sum(n for _, n in plan)
    while have + len(trials) < config.game_trials:
        epoch = _epoch_with_room(policy, sum(n for _, n in full), after=epoch)
        progress(f"privacy game: {have + len(trials)}/{config.game_trials} trials, epoch {epoch}")
        before = len(_records(fleet.client, config, 0))
        secrets = _secrets(config, full, salt=epoch)
        sent, _ = _send(fleet, config, full, epoch, secrets, plan_game, progress, first_seq=seq)
        seq += len(sent)
        _close(fleet.client, config, policy, epoch, progress)
        parts = checks.parse_parts(_collect(fleet.client, config, before, progress), fleet.key)
        mine = [p for p in parts if p.batch is not None and p.batch.epoch == epoch]
        batches = checks.assemble(
            [p for p in mine if p.batch and p.batch.shuffler_id == fleet.config.id], policy.id
        )
        trials += plan_game.trials(batches, secrets, config.fragments)
    return trials


def _secrets(config: AuditConfig, plan: list[tuple[str, int]], salt: int = 0) -> dict[str, int]:
    """The privacy game's secret bit of each full group (:mod:`~services.tools.audit.game`),
    from the OS CSPRNG unless a seed is given."""
    seeded = config.seed is not None
    coins = random.Random(f"{config.seed}/{salt}") if seeded else random.SystemRandom()
    return {crowd: coins.randrange(2) for crowd, n in plan if n == plan[0][1]}


def _send(
    fleet: CanaryFleet,
    config: AuditConfig,
    plan: list[tuple[str, int]],
    epoch: int,
    secrets: dict[str, int],
    plan_game: GamePlan,
    progress: Progress,
    first_seq: int = 0,
) -> tuple[list[Sent], list[tuple[int, dict[str, str]]]]:
    """Send the canaries (:func:`_order`; each group's first-sent canary is the privacy game's
    target, reporting RR of its secret; the others RR of 0 — or, in a mechanism's game, the
    mechanism's report of value a or b, and of c), snapshotting the public surface at 0, half
    and all of them."""
    seeded = config.seed is not None
    coins = random.Random(f"{config.seed}/{first_seq}") if seeded else random.SystemRandom()
    source = SeededSource(1_000_003 * (config.seed or 0) + first_seq) if seeded else SystemSource()
    started: set[int] = set()
    order = _order(plan)
    bursts = sum(1 for _, n in plan if n == plan[0][1]) > 1
    pause_at = plan[0][1] if bursts else -1
    shots = [(0, probes.snapshot(fleet.client, fleet.url))]
    sent: list[Sent] = []
    for seq, crowd in enumerate(order, start=first_seq):
        if seq - first_seq == pause_at:
            time.sleep(config.round_seconds)  # the first burst apart from all the rest
        if seq - first_seq == len(order) // 2:
            shots.append((seq, probes.snapshot(fleet.client, fleet.url)))
        target = crowd[0] not in started and crowd[1] in secrets
        value = secrets[crowd[1]] if target else 0
        started.add(crowd[0])
        report = int(coins.random() < game.rr_one_probability(value, config.game_eps0))
        payloads = None
        if plan_game.mechanism is not None:
            payloads = plan_game.payloads(value if target else mechgame.C, source)
        sent.append(
            fleet.send(
                seq,
                config.channel_id,
                config.payload_size,
                crowd,
                epoch,
                config.fragments,
                report,
                payloads,
            )
        )
        if seq % 50 == 49:
            progress(f"sent {seq + 1 - first_seq}/{len(order)} canaries")
    shots.append((len(order), probes.snapshot(fleet.client, fleet.url)))
    return sent, shots


def _order(plan: list[tuple[str, int]]) -> list[tuple[int, str]]:
    """(group index, crowd) of each canary in send order: the first full group's all at once,
    then (after a pause of ``round_seconds`` in :func:`_send`) the others round-robin, then
    the last full group's all at once (with one full group, round-robin only)."""
    full = [i for i, (_, n) in enumerate(plan) if n == plan[0][1]]
    first, last = (full[0], full[-1]) if len(full) > 1 else (-1, -1)
    rest = [(i, crowd, n) for i, (crowd, n) in enumerate(plan) if i not in (first, last)]
    middle = [(i, c) for round_ in range(max(n for _, n in plan)) for i, c, n in rest if round_ < n]
    burst = [[(i, plan[i][0])] * plan[i][1] if i >= 0 else [] for i in (first, last)]
    return burst[0] + middle + burst[1]


def _revoker(client: httpx.Client, config: AuditConfig) -> Callable[[str], None]:
    def revoke(client_id: str) -> None:
        response = client.post(
            config.shuffler_url.rstrip("/") + "/v1/admin/revoke",
            json={"client_id": client_id},
            headers={"Authorization": f"Bearer {config.admin_token}"},
        )
        response.raise_for_status()

    return revoke


def _close(
    client: httpx.Client, config: AuditConfig, policy: ChannelPolicy, epoch: int, progress: Progress
) -> float:
    """Close the epoch now (admin token) or wait for its natural end; when it closed."""
    if config.admin_token:
        closes_at = time.time()
        progress(f"closing epoch {epoch} of {policy.id}")
        response = client.post(
            config.shuffler_url.rstrip("/") + "/v1/admin/close",
            json={"channel_id": policy.id, "epoch": epoch},
            headers={"Authorization": f"Bearer {config.admin_token}"},
            timeout=120,
        )
        if response.status_code != 200:
            raise AuditError(f"admin close refused: {response.status_code} {response.text[:200]}")
        return closes_at
    closes_at = float((epoch + 1) * policy.epoch_seconds)
    progress(f"waiting {closes_at - time.time():.0f} s for epoch {epoch} to end")
    time.sleep(max(0.0, closes_at - time.time()))
    return closes_at


def _records(client: httpx.Client, config: AuditConfig, after: int) -> list[dict[str, Any]]:
    try:
        return fetch_records(config.sink_url, config.sink_token, after, client)
    except httpx.HTTPError as error:
        raise AuditError(f"cannot read the sink at {config.sink_url}: {error}") from error


def _collect(
    client: httpx.Client, config: AuditConfig, before: int, progress: Progress
) -> list[dict[str, Any]]:
    """The sink's new records once no part has arrived for ``settle_seconds`` (or after
    ``wait_seconds``)."""
    deadline, last, stable_since = time.monotonic() + config.wait_seconds, -1, time.monotonic()
    progress("waiting for the batches at the sink")
    while True:
        records = _records(client, config, before)
        if len(records) != last:
            last, stable_since = len(records), time.monotonic()
        if time.monotonic() - stable_since >= config.settle_seconds and records:
            return records
        if time.monotonic() > deadline:
            return records
        time.sleep(0.2)
