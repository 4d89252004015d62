"""A mechanism defined in this file alone runs through the whole pipeline and the accountant.

This is the proof that adding a mechanism is one module plus one registry call: the toy
(binary randomized response on one bit) is registered here with its own privacy description
(a :class:`LocalRandomizer` subclass no other file knows), the analyzer process loads this
module through ``ESA_MECHANISM_MODULES``, and a device population goes SDK encode -> shuffler ->
analyzer accumulate -> estimate -> certificate; certification, planning and lifetime
composition take the toy's description as they take the built-in ones.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest

from common.accounting import (
    LocalRandomizer,
    MethodSpec,
    blanket_binary_rr,
    compose_epochs,
    lifetime_for_mechanism,
    plan_eps0,
)
from common.accounting import shuffle_bounds as sb
from common.accounting.hockey_stick import ClonePair
from common.accounting.results import Neighbouring
from common.mechanisms import (
    BatchContext,
    Encoded,
    Estimate,
    FragmentCount,
    LocalPrivacy,
    Mechanism,
    MechanismError,
    PrivacyDescription,
    Received,
    ReleaseCertificate,
    register,
)
from common.mechanisms._wire import FragmentError, frame, unframe
from common.mechanisms.base import certify_smallest_batch
from common.mechanisms.registry import get
from common.randomness import RandomSource, bernoulli
from common.wire import MAX_EPOCH_SECONDS

TOY_CODE = 200


@dataclass(frozen=True)
class ToyRandomizer(LocalRandomizer):
    """One bit's binary randomized response at ε0, replacement: the privacy-blanket bound and
    its pair (Balle et al. 2019) are the only methods it claims."""

    kind: ClassVar[str] = "toy-binary-rr"
    natural: ClassVar[Neighbouring] = "replacement"

    def methods(self) -> tuple[MethodSpec, ...]:
        def pair(eps0: float, n: int) -> ClonePair:
            return ClonePair(n - 1, 2.0 / (math.exp(eps0) + 1.0), eps0)

        return (
            MethodSpec(
                sb.BLANKET_BINARY_RR,
                lambda e, n, d: blanket_binary_rr(e, n, d, "replacement"),
                pair,
            ),
        )


@dataclass(frozen=True, slots=True)
class ToyParams:
    """``eps``: removal ε of the bit's randomized response."""

    eps: float

    @property
    def flip(self) -> float:
        return 1.0 / (1.0 + math.exp(self.eps))


@dataclass
class ToyAccumulator:
    """Ones reported and contributions seen."""

    ones: int = 0
    n: int = 0

    def merge(self, other: ToyAccumulator) -> ToyAccumulator:
        return ToyAccumulator(self.ones + other.ones, self.n + other.n)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, np.array([self.ones, self.n], dtype=np.int64), allow_pickle=False)
        return buffer.getvalue()


class ToyBit(Mechanism[ToyParams, ToyAccumulator]):
    """Binary randomized response of one bit, one fragment per report."""

    name = "toy-bit"
    code = TOY_CODE
    payload_size = 1

    def parse_params(self, raw: Mapping[str, Any]) -> ToyParams:
        eps = raw.get("eps")
        if not isinstance(eps, int | float) or not 0 < eps < 20:
            raise ValueError(f"eps must be in (0, 20), got eps={eps!r}")
        return ToyParams(float(eps))

    def domain_size(self, params: ToyParams) -> int:
        return 2

    def fragment_count(self, params: ToyParams, batch: BatchContext) -> FragmentCount:
        return FragmentCount.exactly(1)  # one bit, one fragment: the analyzer checks crowds

    def encode(
        self, params: ToyParams, value: Any, state: Any, rng: RandomSource, shufflers: int
    ) -> Encoded:
        if value not in (0, 1):
            raise MechanismError(f"value must be 0 or 1, got value={value!r}")
        bit = value ^ int(bernoulli(rng, params.flip))
        return Encoded(((None, (frame(TOY_CODE, bytes([bit])),)),))

    def new_accumulator(self, params: ToyParams) -> ToyAccumulator:
        return ToyAccumulator()

    def load_accumulator(self, params: ToyParams, data: bytes) -> ToyAccumulator:
        ones, n = np.load(io.BytesIO(data), allow_pickle=False)
        return ToyAccumulator(int(ones), int(n))

    def accumulate(
        self,
        params: ToyParams,
        accumulator: ToyAccumulator,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        invalid = 0
        for fragment in fragments:
            try:
                bit = unframe(TOY_CODE, 1, fragment)[0]
            except FragmentError:
                invalid += 1
                continue
            if bit > 1:
                invalid += 1
            accumulator.ones += bit == 1
        accumulator.n += n_contributions
        return invalid

    def estimate(self, params: ToyParams, accumulator: ToyAccumulator) -> Estimate:
        p, n = params.flip, accumulator.n
        ones = (accumulator.ones - n * p) / (1 - 2 * p)
        std = math.sqrt(n * p * (1 - p)) / (1 - 2 * p)
        return Estimate(
            values=np.array([n - ones, ones]),
            std_errors=np.array([std, std]),
            n=n,
            clipped=False,
            note="toy",
        )

    def local_privacy(self, params: ToyParams) -> LocalPrivacy:
        return LocalPrivacy(
            removal=params.eps,
            replacement=2 * params.eps,
            eps_l_inf=params.eps,
            eps_l1=params.eps,
            note="toy bit",
        )

    def privacy(self, params: ToyParams) -> PrivacyDescription:
        return PrivacyDescription(ToyRandomizer(), params.eps)

    def certify(
        self, params: ToyParams, delta: float, received: Sequence[Received[ToyAccumulator]]
    ) -> ReleaseCertificate:
        description = self.privacy(params)
        return certify_smallest_batch(received, lambda n: description.certify(n, delta))


register(ToyBit())


def test_toy_mechanism_is_registered_and_encodes_locally() -> None:
    from common.mechanisms import SeededSource, get

    toy = get("toy-bit")
    params = toy.parse_params({"eps": 1.0})
    encoded = toy.encode(params, 1, None, SeededSource(0), 3)
    assert len(encoded.routes) == 1 and len(encoded.routes[0][1][0]) == 3
    with pytest.raises(MechanismError):
        toy.encode(params, 2, None, SeededSource(0), 3)


def test_toy_description_certifies_plans_and_composes_like_a_built_in() -> None:
    toy = get("toy-bit")
    params = toy.parse_params({"eps": 2.0})
    cert = toy.privacy(params).certify(5000, 1e-8)
    truth = blanket_binary_rr(2.0, 5000, 1e-8, "replacement")
    assert cert.certified.method == sb.BLANKET_BINARY_RR
    assert cert.certified.eps == truth.eps and cert.certified.neighbouring == "replacement"
    assert cert.as_dict()["randomizer"] == "toy-binary-rr"
    plan = plan_eps0(cert.certified.eps, 1e-8, 5000, ToyRandomizer())
    assert plan.eps0 == pytest.approx(2.0, abs=1e-4)
    crowds = [5000, 4000, 6000]
    epochs = [toy.epoch_pair(params, n, 1e-6 / 3) for n in crowds]
    assert all(epoch is not None for epoch in epochs)
    by_ledger = compose_epochs([e for e in epochs if e is not None], 1e-6)
    direct = lifetime_for_mechanism(ToyRandomizer(), 2.0, crowds, 1e-6)
    assert by_ledger.eps == direct.eps and direct.neighbouring == "replacement"
    assert direct.eps <= direct.eps_basic


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from common.wire import ChannelConfig

    from ..support import start_deployment

    monkeypatch.setenv("ESA_MECHANISM_MODULES", __name__)
    channel = ChannelConfig(
        id="toy",
        mechanism="toy-bit",
        params={"eps": 2.0},
        epoch_seconds=MAX_EPOCH_SECONDS,
        min_crowd=20,
        eps_cr=4.0,
        delta_cr=1e-7,
        max_fragments=1,
        payload_size=8,
        delta=1e-8,
    )
    running = start_deployment(tmp_path, [channel], count=2)
    yield running
    running.stop()


@pytest.mark.system
def test_toy_mechanism_runs_through_the_whole_pipeline(deployment: Any, tmp_path: Path) -> None:
    from encoder_client import Client

    from ..support import close_epoch

    truth = np.array([0] * 120 + [1] * 180)
    for i, value in enumerate(truth):
        with Client(
            deployment.analyzer.url + "/v1/config",
            trust_file=deployment.trust_file,
            state_path=tmp_path / f"device-{i}.db",
            background=False,
        ) as client:
            client.histogram("toy").report(int(value))
            assert client.flush() == 1
    epoch = int(time.time() // MAX_EPOCH_SECONDS)
    close_epoch(deployment, "toy", epoch)
    release = httpx.get(deployment.analyzer.url + "/v1/channels/toy/estimate", timeout=30).json()
    kept = release["n"] / len(truth)
    assert 0.8 < kept <= 1.0
    ones = release["values"][release["bins"].index(1)]
    std = release["std_errors"][release["bins"].index(1)]
    spread = math.sqrt(std**2 + 180 * kept * (1 - kept))
    assert abs(ones - 180 * kept) < 5.5 * spread  # false failure < 1e-7
    certificate = release["certificate"]
    assert certificate["method"] == "blanket-binary-rr" and 0 < certificate["eps"] < 2.0
    # one fragment per contribution, all opened: every crowd claimed is verified
    check = release["crowd_check"]
    assert check["claimed"] == check["verified"] == release["n"]
    assert check["invalid_fragments"] == check["short_batches"] == 0
