"""The ledger's lifetime ε from dominating pairs (issue 13): each epoch enters as the
mechanism's pair at its crowd, exactly as ``esa account compose`` builds it; mechanisms without
a pair enter as their certificate; and the device-side budget in use, by the SDK's own rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer.channels import ChannelRuntime
from analyzer.ledger import budget_in_use, compose_items, lifetime
from common.accounting import BinaryRR, compose_epochs, lifetime_for_mechanism
from common.accounting.lifetime import charged_crowds
from common.mechanisms import BatchContext, Received, krappor
from common.wire import Bound, ChannelConfig, DeviceBudget, LedgerRow
from encoder_client import BudgetExceededError
from encoder_client._client import _limits as sdk_limits
from encoder_client._state import Charge, DeviceState
from services.cli.account import account

from .helpers import CHANNEL, VALUES, build, crowd, make_batch

KRAPPOR = ChannelConfig(
    id="pages",
    mechanism="krappor",
    params={"k": 20, "eps": 2.0},
    min_crowd=50,
    max_fragments=20,
    delta=1e-8,
    eps_cr=0.5,
    delta_cr=1e-9,
)
KRR = KRAPPOR.model_copy(
    update={"id": "answers", "mechanism": "krr", "params": {"k": 20, "eps": 1.0}}
)
ZSUM = KRAPPOR.model_copy(
    update={
        "id": "features",
        "mechanism": "zsum",
        "params": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 2000},
        "delta": 1e-6,
    }
)
#: Twelve distinct crowds around 5,000: more than MAX_EXACT_CROWDS, so crowds are snapped.
CROWDS = [4610, 4770, 4850, 4925, 4990, 5040, 5105, 5180, 5260, 5333, 5410, 5480]


def _runtime(config: ChannelConfig) -> ChannelRuntime:
    return ChannelRuntime.build(config, ["shuffler-1"])


def _row(runtime: ChannelRuntime, epoch: int, n: int) -> LedgerRow:
    """The ledger row the analyzer writes for one epoch with one batch of ``n`` (the same
    certificates as :meth:`ChannelRuntime.charge`)."""
    received = Received(
        epoch=epoch,
        shuffler_id="shuffler-1",
        batches=(n,),
        accumulator=runtime.mechanism.new_accumulator(),
        source=BatchContext(0, 1),
    )
    certs = runtime.certify([received])
    return LedgerRow(
        epoch=epoch,
        crowd_id="",
        n=n,
        certificate=Bound.model_validate(certs.certified.as_dict()),
        other_notion=Bound.model_validate(certs.other.as_dict()),
        crowds=certs.crowds,
        batches=1,
        charged_at=0.0,
    )


def _items(
    config: ChannelConfig, crowds: list[int], first: int = 0
) -> list[tuple[ChannelRuntime, LedgerRow]]:
    runtime = _runtime(config)
    rows = {n: _row(runtime, 0, n) for n in set(crowds)}  # certify each crowd once
    return [
        (runtime, rows[n].model_copy(update={"epoch": first + i})) for i, n in enumerate(crowds)
    ]


def test_a_year_of_krappor_at_5000_pairs_are_far_tighter_than_certificates() -> None:
    crowds = [CROWDS[i % len(CROWDS)] for i in range(365)]
    items = _items(KRAPPOR, crowds)
    pairs, used = compose_items(items, 1e-5)
    certificates = lifetime([row.certificate for _, row in items], 1e-5)
    assert pairs is not None and pairs.eps is not None
    assert certificates is not None and certificates.eps is not None
    assert set(used) == {"pair"} and pairs.pair_parts == 365
    assert certificates.pair_parts == 0
    # The issue's example: ≈ 3.6 by pairs; the epochs' certificates compose to ≈ 25.
    assert pairs.eps < certificates.eps / 5.0
    assert pairs.eps <= pairs.eps_basic and pairs.eps < 4.0
    assert "12 distinct crowds charged at" in pairs.note
    # Equal to esa account compose's composition and to compose_epochs of the same pairs.
    direct = lifetime_for_mechanism(BinaryRR(), 2.0, crowds, 1e-5)
    assert pairs.eps == pytest.approx(direct.eps, rel=1e-12, abs=0.0)
    assert pairs.eps_basic == pytest.approx(direct.eps_basic, rel=1e-12)
    params = krappor.KRapporParams(k=20, eps=2.0)
    mechanism = krappor.KRappor()
    epochs = [mechanism.epoch_pair(params, n, 1e-5 / 365) for n in charged_crowds(crowds)]
    assert all(epoch is not None for epoch in epochs)
    composed = compose_epochs([e for e in epochs if e is not None], 1e-5)
    assert pairs.eps == pytest.approx(composed.eps, rel=1e-12)


def _cli(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(account, ["compose", *args, "--json"])
    assert result.exit_code == 0, result.output
    body: dict[str, object] = json.loads(result.output)
    return body


@pytest.mark.parametrize(
    ("config", "cli"),
    [
        (KRAPPOR, ["--mechanism", "krappor", "--eps0", "2"]),
        (KRR, ["--mechanism", "krr", "--eps0", "1", "--k", "20"]),
    ],
)
def test_esa_account_compose_and_the_analyzer_give_the_same_lifetime(
    config: ChannelConfig, cli: list[str]
) -> None:
    crowds = [CROWDS[i % len(CROWDS)] // 10 for i in range(40)]
    items = _items(config, crowds)
    text = ",".join(str(n) for n in crowds)
    plain, used = compose_items(items, 1e-6)
    deleted, _ = compose_items(items, 1e-6, deleted=True)
    assert set(used) == {"pair"} and plain is not None and deleted is not None
    body = _cli(*cli, "--crowds", text, "--delta", "1e-6")
    assert plain.eps == pytest.approx(body["eps"], rel=1e-12)
    assert plain.eps_basic == pytest.approx(body["eps_basic"], rel=1e-12)
    assert plain.neighbouring == body["neighbouring"]
    extra = ["--eps-cr", "0.5", "--delta-cr", "1e-9"]
    body = _cli(*cli, "--crowds", text, "--delta", "1e-6", *extra)
    assert deleted.eps == pytest.approx(body["eps"], rel=1e-12)
    assert deleted.neighbouring == body["neighbouring"] == "add-remove"
    assert deleted.delta_split.certificates == pytest.approx(40 * 1e-9)
    assert deleted.eps > plain.eps


def test_a_mechanism_without_a_pair_enters_as_its_certificate() -> None:
    items = _items(ZSUM, [2000, 2100, 2050])
    result, used = compose_items(items, 1e-4)
    assert used == ["certificate"] * 3
    assert result is not None and result.pair_parts == 0 and result.parts == 3
    same = lifetime([row.certificate for _, row in items], 1e-4)
    assert same is not None and result.eps == same.eps
    # Across channels in different notions every epoch is a replacement statement: k-RAPPOR
    # (removal) as two independent copies of its pair, Balcer–Cheu as its certificate.
    mixed = items + _items(KRAPPOR, [5000, 5200], first=10)
    overview, how = compose_items(mixed, 1e-4, replacement=True)
    assert how == ["certificate"] * 3 + ["pair"] * 2
    assert overview is not None and overview.neighbouring == "replacement"
    assert overview.pair_parts == 4 and overview.parts == 7
    with pytest.raises(ValueError, match="one neighbouring notion"):
        compose_items(mixed, 1e-4)


def test_the_ledger_composes_received_epochs_as_pairs(database_url: str) -> None:
    layers = build(database_url)
    claimed = (1000, 400, 700)
    for epoch, size in enumerate(claimed, start=1):
        layers.deliver(*make_batch(VALUES[:size], epoch=epoch, seed=epoch))
    sizes = [crowd(VALUES[:size], epoch) for epoch, size in enumerate(claimed, start=1)]
    ledger = layers.ledger.ledger(CHANNEL.id)
    assert [row.composed_as for row in ledger.epochs] == ["pair"] * 3
    assert ledger.lifetime is not None and ledger.with_randomized_deletion is not None
    expected = lifetime_for_mechanism(BinaryRR(), 4.0, list(sizes), layers.ledger.delta)
    assert ledger.lifetime.eps == pytest.approx(expected.eps, rel=1e-12)
    deletion = (CHANNEL.eps_cr, CHANNEL.delta_cr)
    with_deletion = lifetime_for_mechanism(
        BinaryRR(), 4.0, list(sizes), layers.ledger.delta, deletion=deletion
    )
    assert ledger.with_randomized_deletion.eps == pytest.approx(with_deletion.eps, rel=1e-12)
    as_certificates = lifetime([row.certificate for row in ledger.epochs], layers.ledger.delta)
    assert as_certificates is not None and as_certificates.eps is not None
    assert ledger.lifetime.eps is not None and ledger.lifetime.eps < as_certificates.eps
    budget = ledger.device_budget
    assert budget is not None and budget.reports == 3 and budget.limits == []
    assert budget.local_eps == 8.0 and budget.spent == pytest.approx(24.0)  # replacement 2ε
    overview = layers.ledger.overview()
    assert overview.lifetime is not None and overview.lifetime.eps == ledger.lifetime.eps
    assert overview.device_budget is not None and overview.device_budget.spent == 24.0


def _sdk_refuses(epochs: list[int], eps: float, budget: DeviceBudget, path: Path) -> bool:
    """Whether the SDK's own state refuses one of a device's reports in ``epochs`` (hourly),
    with the caps the client builds for each report (``encoder_client._client._limits``)."""
    state = DeviceState(path)
    try:
        for epoch in epochs:
            start = float(epoch * 3600)
            charge = Charge(eps, start, tuple(sdk_limits("pages", budget, start)))
            assert state.commit_report("pages", epoch, "krappor", None, [], charge)
    except BudgetExceededError:
        return True
    return False


@pytest.mark.parametrize(
    ("budget", "exhausted"),
    [
        (DeviceBudget(lifetime_eps=16.0), False),
        (DeviceBudget(lifetime_eps=15.9), True),
        (DeviceBudget(window_eps=12.0, window_seconds=3 * 3600), False),
        (DeviceBudget(window_eps=11.9, window_seconds=3 * 3600), True),
        (DeviceBudget(window_eps=8.0, window_seconds=2 * 3600), False),
        (DeviceBudget(window_eps=8.0, window_seconds=2 * 3600 + 1), True),
    ],
)
def test_the_budget_in_use_is_what_the_sdk_would_charge(
    budget: DeviceBudget, exhausted: bool, tmp_path: Path
) -> None:
    epochs = [1, 2, 3, 10]
    channel = KRAPPOR.model_copy(update={"budget": budget})
    items = [
        (runtime, row.model_copy(update={"epoch": e}))
        for (runtime, row), e in zip(_items(channel, [500] * 4), epochs, strict=True)
    ]
    used = budget_in_use(items, channel.budget, DeviceBudget(lifetime_eps=100.0), "so far")
    assert used.local_eps == 4.0 and used.reports == 4 and used.spent == 16.0
    mine, device = used.limits
    assert mine.scope == "channel" and device.scope == "device"
    assert mine.exhausted is exhausted and not device.exhausted and device.left == 84.0
    cap = budget.lifetime_eps if budget.lifetime_eps is not None else budget.window_eps
    assert cap is not None and mine.spent is not None
    assert mine.left == pytest.approx(max(0.0, cap - mine.spent))
    assert _sdk_refuses(epochs, 4.0, budget, tmp_path / "device.db") is exhausted


def test_no_local_privacy_is_an_unbounded_spend() -> None:
    used = budget_in_use(_items(ZSUM, [2000, 2000]), DeviceBudget(lifetime_eps=5.0), None, "")
    assert used.local_eps is None and used.spent is None
    (limit,) = used.limits
    assert limit.exhausted and limit.spent is None and limit.left == 0.0
    assert "no local privacy" in used.note
    assert math.isinf(_runtime(ZSUM).mechanism.local_privacy().replacement)
    empty = budget_in_use([], None, None, "")
    assert empty.reports == 0 and empty.spent == 0.0 and empty.limits == []


def test_snapped_crowds_keep_the_smallest_first() -> None:
    assert charged_crowds([5000] * 3) == (5000,) * 3
    snapped = charged_crowds(CROWDS)
    assert all(s <= n and s >= n * (1 - 2**-7) for s, n in zip(snapped, CROWDS, strict=True))
    with pytest.raises(ValueError, match="crowd"):
        charged_crowds([])
