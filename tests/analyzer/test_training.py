"""LDP-SGD training at the analyzer (ESA-revisited Algorithm 5): real HPKE-sealed reports through
intake, opening and the store, one projected step per round, the model in the signed config."""

from __future__ import annotations

import math
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from analyzer.errors import NothingReceivedError, UnknownChannelError
from analyzer.training import (
    StepBody,
    StepRecord,
    Trainer,
    TrainingState,
    published_channels,
    step_result,
    training_body,
)
from common.collection import sign_config, verify_config
from common.mechanisms import SeededSource, get, ldpsgd, registry
from common.wire import AnalyzerInfo, Batch, ChannelConfig, CollectionConfig, HpkeKey
from tests.analyzer.helpers import CHANNEL, Clock, Layers, build, seal, signed

TRAIN = ChannelConfig(
    id="train",
    mechanism="ldp-sgd",
    params={"dim": 4, "eps": 2.0, "clip": 1.0, "radius": 0.5, "learning_rate": 0.1},
    min_crowd=10,
    max_fragments=1,
    delta=1e-6,
    payload_size=32,
)
PARAMS: ldpsgd.LdpSgdParams = get("ldp-sgd").parse_params(TRAIN.params)


def batch(
    layers: Layers, rounds: list[int], epoch: int, seed: int, shuffler: str = "shuffler-1"
) -> list[bytes]:
    """Deliver one signed batch of LDP-SGD reports naming ``rounds`` from ``shuffler``;
    returns the plaintexts."""
    rng = SeededSource(seed)
    plain = [
        ldpsgd.encode(ldpsgd.GradientReport(r, np.array([0.3, -0.2, 0.1, 0.0])), PARAMS, rng)[0]
        for r in rounds
    ]
    body = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=shuffler,
        channel_id=TRAIN.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=len(rounds),
        fragments=seal(plain, TRAIN, epoch),
    )
    layers.deliver(*signed(body))
    return plain


def expected_theta(theta: np.ndarray, plain: list[bytes], round_: int) -> np.ndarray:
    """Algorithm 5 lines 5–6 recomputed from the plaintext reports of ``round_``."""
    parsed = [ldpsgd.parse_fragment(f) for f in plain]
    mine = [(s, seed) for r, s, seed in parsed if r == round_]
    total = sum(s * ldpsgd.sphere([seed], 4)[0] for s, seed in mine)
    gradient = PARAMS.scale * total / len(mine)
    return ldpsgd.project(theta - 0.1 * gradient, 0.5)


def test_rounds_step_refuse_other_rounds_and_persist(tmp_path: Path) -> None:
    layers = build(f"sqlite:///{tmp_path / 'a.db'}", [CHANNEL, TRAIN])
    trainer = Trainer(layers.store, layers.releases.channels, tmp_path / "training")
    assert trainer.state("train").round == 0
    with pytest.raises(NothingReceivedError, match="round 0"):
        trainer.step("train")
    plain = batch(layers, [0] * 30 + [5] * 4, epoch=3, seed=1)
    record = trainer.step("train")
    assert (record.round, record.reports, record.refused_other_rounds) == (0, 30, 4)
    assert record.devices == 34 and record.epochs == (0, 3) and 0 < record.eps_central < 2
    theta1 = np.asarray(trainer.state("train").theta)
    assert theta1 == pytest.approx(expected_theta(np.zeros(4), plain, 0), abs=1e-12)
    assert np.linalg.norm(theta1) <= 0.5 + 1e-12
    # Round 1: epoch 3 is consumed; a stale report of round 0 in epoch 4 is refused.
    plain = batch(layers, [1] * 20 + [0] * 3, epoch=4, seed=2)
    again = Trainer(layers.store, layers.releases.channels, tmp_path / "training")
    record = again.step("train")
    assert (record.round, record.reports, record.refused_other_rounds) == (1, 20, 3)
    state = again.state("train")
    assert state.round == 2 and state.next_epoch == 5 and len(state.steps) == 2
    assert np.asarray(state.theta) == pytest.approx(expected_theta(theta1, plain, 1), abs=1e-12)
    with pytest.raises(UnknownChannelError, match="homepage"):
        trainer.step(CHANNEL.id)


def test_a_step_waits_for_every_shuffler_of_its_epochs(tmp_path: Path) -> None:
    """θ is public: a round trained on one shuffler's batch would publish it alone. Epoch 7's
    reports wait until all three shufflers delivered (epoch 6, settled, steps meanwhile)."""
    clock = Clock(7 * 3600 + 10)
    layers = build(f"sqlite:///{tmp_path / 'a.db'}", [CHANNEL, TRAIN], clock, 3600)
    trainer = Trainer(layers.store, layers.releases.channels, tmp_path / "training")
    for shuffler in ("shuffler-1", "shuffler-2", "shuffler-3"):
        batch(layers, [0] * 20, epoch=6, seed=len(shuffler), shuffler=shuffler)
    batch(layers, [1] * 20, epoch=7, seed=7)
    first = trainer.step("train")
    assert (first.round, first.reports, first.epochs) == (0, 60, (0, 6))
    with pytest.raises(NothingReceivedError, match=r"waiting for shufflers: \[7\]"):
        trainer.step("train")
    batch(layers, [1] * 20, epoch=7, seed=8, shuffler="shuffler-2")
    batch(layers, [1] * 20, epoch=7, seed=9, shuffler="shuffler-3")
    second = trainer.step("train")
    assert (second.round, second.reports, second.epochs) == (1, 60, (7, 7))


def test_signed_config_publishes_the_model() -> None:
    state = TrainingState(7, [0.25, -0.5, 0.0, 1.0])
    training = registry.build(TRAIN).training
    assert training is not None  # ldp-sgd offers the training facet; a histogram does not
    assert registry.build(CHANNEL).training is None
    channels = published_channels([CHANNEL, TRAIN], {"train": (state, training)})
    assert channels[0] == CHANNEL
    key = Ed25519PrivateKey.generate()
    config = CollectionConfig(
        issued_at=0,
        expires_at=10,
        analyzer=AnalyzerInfo(
            url="http://a",
            keys=[HpkeKey(key_id="00" * 8, public_key="AA==")],
            signing_key="AA==",
        ),
        shufflers=[],
        channels=channels,
    )
    fetched = verify_config(sign_config(config, key), key.public_key(), now=5)
    published = fetched.channel("train")
    assert published is not None
    round_, theta = ldpsgd.model_from_params(published.params, 4)
    assert round_ == 7 and theta.tolist() == state.theta
    # The analyzer and the SDK still parse the published params as the channel's parameters.
    assert get("ldp-sgd").parse_params(published.params) == PARAMS


def test_the_api_answers_steps_and_state_and_concurrent_steps_train_once(tmp_path: Path) -> None:
    """What ``POST .../training/step`` and ``GET .../training`` answer; two steps at once take
    round 0 once (the second finds no report of round 1)."""
    layers = build(f"sqlite:///{tmp_path / 'a.db'}", [CHANNEL, TRAIN])
    trainer = Trainer(layers.store, layers.releases.channels, tmp_path / "training")
    batch(layers, [0] * 25 + [9] * 2, epoch=0, seed=3)
    with ThreadPoolExecutor(2) as pool:
        tries = [pool.submit(step_result, trainer, "train") for _ in range(2)]
        outcomes = [t.exception() or t.result() for t in tries]
    (result,) = [o for o in outcomes if not isinstance(o, BaseException)]
    (error,) = [o for o in outcomes if isinstance(o, BaseException)]
    assert isinstance(error, NothingReceivedError) and "round 1" in str(error)
    assert (result.round, result.theta_dim, result.step.round) == (1, 4, 0)
    assert (result.step.reports, result.step.refused_other_rounds, result.step.devices) == (
        25,
        2,
        27,
    )
    body = training_body(trainer, "train")
    assert body.round == 1 and body.history == [result.step] and body.next_epoch == 1
    assert body.theta_norm == pytest.approx(result.theta_norm) and len(body.theta) == 4
    with pytest.raises(UnknownChannelError):
        training_body(trainer, CHANNEL.id)
    uncertified = StepRecord(
        round=0,
        epochs=(0, 0),
        reports=5,
        refused_other_rounds=0,
        devices=5,
        gradient_norm=1.0,
        eps_central=math.inf,
    )
    assert StepBody.of(uncertified).eps_central is None
    assert "Infinity" not in StepBody.of(uncertified).model_dump_json()
