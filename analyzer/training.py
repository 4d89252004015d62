"""Training state at the analyzer, for every channel whose mechanism offers the training facet
(:class:`common.mechanisms.base.Training`; LDP-SGD, ESA-revisited Algorithm 5).

For every such channel the analyzer keeps the current round ``t`` and model ``θ_t`` (the
facet's ``θ_0``), publishes both in the channel's ``params`` of the signed collection config
(:func:`published_channels`, the facet's ``model_params``: ``round`` and ``theta`` for LDP-SGD)
and, at :meth:`Trainer.step`, has the facet take one step from the epochs received since the
previous step: for LDP-SGD the reports naming round ``t`` give the noisy gradient of line 5,
the projected step of line 6 gives ``θ_{t+1}``, and reports naming any other round (a device
that trained on a stale or forged model) are refused and counted in the step's record. The
state is a JSON file per channel, replaced atomically, so a restart resumes at the same round.
"""

from __future__ import annotations

import base64
import fcntl
import json
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from analyzer.channels import ChannelRuntime
from analyzer.errors import NothingReceivedError, UnknownChannelError
from analyzer.releases import settled_received
from analyzer.store import AnalyzerStore
from common.mechanisms.base import BoundTraining
from common.wire import MAX_INT, ChannelConfig


@dataclass(frozen=True)
class StepRecord:
    """One step: the round trained, epochs consumed, reports used and refused, ‖g‖, and the
    round's certified central ε at its smallest batch (δ of the channel)."""

    round: int
    epochs: tuple[int, int]
    reports: int
    refused_other_rounds: int
    devices: int
    gradient_norm: float
    eps_central: float


@dataclass
class TrainingState:
    """Round ``t``, ``θ_t``, the first epoch not consumed yet, and the steps taken."""

    round: int
    theta: list[float]
    next_epoch: int = 0
    steps: list[StepRecord] = field(default_factory=list)

    def to_json(self) -> str:
        """The state file's content (θ as base64 float64, exact)."""
        body = asdict(self)
        body["theta"] = base64.b64encode(np.asarray(self.theta, ">f8").tobytes()).decode()
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        """Inverse of :meth:`to_json`."""
        body = json.loads(text)
        theta = np.frombuffer(base64.b64decode(body["theta"]), dtype=">f8").astype(float)
        steps = [StepRecord(**{**s, "epochs": tuple(s["epochs"])}) for s in body["steps"]]
        return cls(int(body["round"]), theta.tolist(), int(body["next_epoch"]), steps)


class Trainer:
    """The training state of every training channel (its mechanism offers the facet), kept in
    ``state_dir``."""

    def __init__(
        self, store: AnalyzerStore, channels: Mapping[str, ChannelRuntime], state_dir: Path
    ) -> None:
        self.store = store
        self.channels = {k: v for k, v in channels.items() if v.mechanism.training is not None}
        self.state_dir = state_dir
        self._lock = threading.Lock()

    def _runtime(self, channel_id: str) -> ChannelRuntime:
        runtime = self.channels.get(channel_id)
        if runtime is None:
            raise UnknownChannelError(f"channel {channel_id!r} is not a training channel")
        return runtime

    def _path(self, channel_id: str) -> Path:
        return self.state_dir / f"{channel_id}.json"

    def state(self, channel_id: str) -> TrainingState:
        """The channel's state (round 0, θ_0 = 0 before the first step)."""
        runtime = self._runtime(channel_id)
        path = self._path(channel_id)
        if path.exists():
            return TrainingState.from_json(path.read_text())
        return TrainingState(0, _training(runtime).initial_model().tolist())

    def models(self) -> dict[str, tuple[TrainingState, BoundTraining[Any, Any]]]:
        """Every training channel's state and facet (what :func:`published_channels` takes)."""
        return {c: (self.state(c), _training(r)) for c, r in self.channels.items()}

    def _save(self, channel_id: str, state: TrainingState) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._path(channel_id).with_suffix(".tmp")
        tmp.write_text(state.to_json())
        os.replace(tmp, self._path(channel_id))

    def step(self, channel_id: str, epoch_to: int | None = None) -> StepRecord:
        """Algorithm 5 lines 4–6 over the epochs ``[next_epoch, epoch_to]`` (default: the last
        received): θ_{t+1} from the reports of round t; the others refused and counted.

        Raises:
            UnknownChannelError: not a training channel.
            NothingReceivedError: no report of round t in those epochs (nothing changes).
        """
        self._runtime(channel_id)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Two concurrent steps must not both train round t: a thread lock inside this process
        # and an exclusive lock on a file beside the state for analyzer workers sharing it.
        with self._lock, open(self._path(channel_id).with_suffix(".lock"), "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            return self._step(channel_id, epoch_to)

    def _step(self, channel_id: str, epoch_to: int | None) -> StepRecord:
        runtime = self._runtime(channel_id)
        training = _training(runtime)
        state = self.state(channel_id)
        # Never past the last epoch received, nor past an epoch still waiting for a shuffler's
        # batch (docs/protocol-notes.md, "Releases wait for every shuffler": θ is public): a
        # later epoch's reports would be skipped forever.
        last = self.store.epoch_spans().get(channel_id, (0, -1))[1]
        if epoch_to is not None:
            last = min(last, epoch_to)
        span = (state.next_epoch, min(last, MAX_INT))
        settled, _ = settled_received(self.store, runtime, "", *span)
        last = min([span[1], *(e - 1 for e in settled.waiting)])
        _, received = settled_received(self.store, runtime, "", state.next_epoch, last)
        crowds = runtime.crowds(received)
        accumulators = [item.accumulator for item in crowds]
        step = training.step(np.asarray(state.theta), state.round, accumulators)
        if step.used == 0:
            raise NothingReceivedError(
                f"{channel_id!r}: no report of round {state.round} in the settled epochs "
                f"[{state.next_epoch}, {last}]"
                + (
                    f" (epochs waiting for shufflers: {sorted(settled.waiting)})"
                    if settled.waiting
                    else ""
                )
            )
        record = StepRecord(
            round=state.round,
            epochs=(state.next_epoch, last),
            reports=step.used,
            refused_other_rounds=step.refused,
            devices=step.contributions,
            gradient_norm=step.gradient_norm,
            eps_central=runtime.certify(crowds).certified.eps,
        )
        theta = step.theta
        steps = [*state.steps, record]
        self._save(channel_id, TrainingState(state.round + 1, theta.tolist(), last + 1, steps))
        return record


def _training(runtime: ChannelRuntime) -> BoundTraining[Any, Any]:
    """The channel's training facet, its parameters bound.

    Raises:
        UnknownChannelError: its mechanism offers none.
    """
    training = runtime.mechanism.training
    if training is None:
        raise UnknownChannelError(f"channel {runtime.config.id!r} is not a training channel")
    return training


def published_channels(
    channels: Sequence[ChannelConfig],
    models: Mapping[str, tuple[TrainingState, BoundTraining[Any, Any]]],
) -> list[ChannelConfig]:
    """The channels as the signed config publishes them: each training channel's ``params``
    carry its facet's ``model_params`` for its current round and θ."""
    result = []
    for config in channels:
        found = models.get(config.id)
        if found is None:
            result.append(config)
            continue
        state, training = found
        model = training.model_params(state.round, np.asarray(state.theta))
        result.append(config.model_copy(update={"params": {**config.params, **model}}))
    return result


class StepBody(BaseModel):
    """One step as the API answers it (:class:`StepRecord`; ``eps_central`` null when nothing
    is certified, ε = ∞)."""

    round: int = Field(description="the round trained (reports naming it were used)")
    epoch_from: int = Field(description="first epoch consumed")
    epoch_to: int = Field(description="last epoch consumed")
    reports: int = Field(description="reports of the round used in the gradient (m)")
    refused_other_rounds: int = Field(description="reports naming another round: refused")
    devices: int = Field(description="contributions in the batches consumed")
    gradient_norm: float = Field(description="L2 norm of the noisy gradient g_t")
    eps_central: float | None = Field(
        description="the round's certified central ε at its smallest batch (null: none)"
    )

    @classmethod
    def of(cls, record: StepRecord) -> StepBody:
        """The wire form of ``record``."""
        eps = record.eps_central if math.isfinite(record.eps_central) else None
        return cls(
            round=record.round,
            epoch_from=record.epochs[0],
            epoch_to=record.epochs[1],
            reports=record.reports,
            refused_other_rounds=record.refused_other_rounds,
            devices=record.devices,
            gradient_norm=record.gradient_norm,
            eps_central=eps,
        )


class StepResult(BaseModel):
    """``POST /v1/channels/{id}/training/step``: the new round now published, a summary of
    θ_{t+1} and the step taken."""

    channel_id: str
    round: int = Field(description="the new round t+1 the signed config now publishes")
    theta_norm: float = Field(description="L2 norm of the new model θ_{t+1}")
    theta_dim: int = Field(description="model dimension d")
    step: StepBody


class TrainingBody(BaseModel):
    """``GET /v1/channels/{id}/training``: the current round, θ_t and every step taken."""

    channel_id: str
    round: int = Field(description="the current round t (devices train at θ_t)")
    theta: list[float] = Field(description="the current model θ_t")
    theta_norm: float
    next_epoch: int = Field(description="first epoch the next step consumes")
    history: list[StepBody]


def step_result(trainer: Trainer, channel_id: str, epoch_to: int | None = None) -> StepResult:
    """Take one step (:meth:`Trainer.step`) and answer it on the wire."""
    record = trainer.step(channel_id, epoch_to)
    state = trainer.state(channel_id)
    return StepResult(
        channel_id=channel_id,
        round=state.round,
        theta_norm=float(np.linalg.norm(state.theta)),
        theta_dim=len(state.theta),
        step=StepBody.of(record),
    )


def training_body(trainer: Trainer, channel_id: str) -> TrainingBody:
    """The channel's training state on the wire.

    Raises:
        UnknownChannelError: not a training channel.
    """
    state = trainer.state(channel_id)
    return TrainingBody(
        channel_id=channel_id,
        round=state.round,
        theta=state.theta,
        theta_norm=float(np.linalg.norm(state.theta)),
        next_epoch=state.next_epoch,
        history=[StepBody.of(s) for s in state.steps],
    )
