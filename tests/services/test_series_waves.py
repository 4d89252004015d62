"""A longitudinal channel's reports in waves (services/tools/loadgen/waves.py ``SeriesWaves``): a
wave whose epoch ends before all of it is sent costs time, never a report. No servers: the
waves' request files are opened with the offline config's real keys, as a shuffler and the
analyzer would, and what was "sent" is chosen by the test."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from common.collection import TrustAnchors, verify_collection
from common.envelope import FragmentContext, KeyRing, open_contribution, open_fragment
from common.mechanisms import longitudinal
from common.wire import SignedConfig
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS
from tests.support import OfflineConfig, offline_config

pytestmark = pytest.mark.system  # starts real processes

ABROAD = next(c for c in DEFAULT_CHANNELS if c.id == "abroad")
PARAMS = longitudinal.LongitudinalParams(**ABROAD.params)
DEVICES = 60


def _opened(
    offline: OfflineConfig, wave: loadgen.Wave, keep: int | None
) -> tuple[set[str], list[tuple[str, int]]]:
    """The tokens of the first ``keep`` requests of ``wave`` (None: all), "sent", and each
    sent request's (token, period), opened with the shuffler's and the analyzer's keys."""
    shuffler, analyzer = KeyRing.of(offline.shuffler), KeyRing.of(offline.analyzer)
    requests = [r for path in wave.files for r in loadgen.read_requests(path)]
    sent = requests if keep is None else requests[:keep]
    reports = []
    for request in sent:
        contribution = open_contribution(request.body, "shuffler-1", shuffler)
        assert contribution.epoch == wave.epoch  # sealed for its own wave's epoch
        context = FragmentContext(ABROAD.id, wave.epoch, contribution.crowd_id)
        (fragment,) = contribution.fragments
        _, period, _ = longitudinal.parse(open_fragment(fragment, context, analyzer), PARAMS)
        assert period <= wave.period  # never a period ahead of the wave
        reports.append((request.token, period))
    assert len({r.token for r in requests}) == len(requests)  # one request per device
    return {r.token for r in sent}, reports


def test_what_an_epoch_left_unsent_goes_in_a_later_wave(tmp_path: Path) -> None:
    offline = offline_config(tmp_path, [ABROAD])
    signed = SignedConfig.model_validate_json(offline.path.read_text())
    verified = verify_collection(signed, TrustAnchors.load(offline.trust_file), time.time())
    target = loadgen.Target(verified, ABROAD)
    changes = [[1 + device % PARAMS.d] if device % 3 else [] for device in range(DEVICES)]
    tokens = [[f"device-{device}" for device in range(DEVICES)]]
    with loadgen.SealerPool(target, workers=2) as pool:
        encoded = pool.add_series(tokens, changes, ABROAD.id).items
        waves = loadgen.SeriesWaves(pool, ABROAD, tmp_path / "waves", seal_rate=1000.0)
        sent: list[tuple[str, int]] = []
        done: list[int] = []
        while (wave := waves.next_wave()) is not None:
            # the first wave's epoch ends after 10 of its requests; the others go whole
            handed, reports = _opened(offline, wave, 10 if len(waves.waves) == 1 else None)
            sent += reports
            done.append(waves.settle(handed))
    per_device = Counter(token for token, _ in sent)
    assert len(sent) == len(set(sent)) == encoded  # every report sent once, none lost
    assert done[-1] == PARAMS.d and done == sorted(done)
    # wave 1 is period 1: the devices of level 1 (they report every period); 10 went out
    level_one = sum(1 for count in per_device.values() if count == PARAMS.d)
    assert waves.waves[0].requests == level_one and waves.rolled_over == level_one - 10 > 0
    epochs = waves.epochs
    assert epochs == sorted(set(epochs)) and len(epochs) == PARAMS.d + 1  # one epoch more
    assert all(len(set(w.files)) == 2 for w in waves.waves)
