"""A malicious shuffler against a real analyzer: it signs with its own real key and lies about
what it sends (PROTOCOL.md, "Who vouches for what": the analyzer certifies only the crowd it can
verify). Each test prints the certificate the analyzer gives, beside the one the lie asked for.

Every attack here was accepted and certified at the claimed crowd before the analyzer verified
crowds: 30 k-RAPPOR fragments claiming 10^6 contributions certified ε ≈ 0.013; 2,000 fragments
that open for nobody certified as a crowd of 2,000; fragments of an earlier epoch opened in a
later one (they were bound to their channel only).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.mechanisms import get

from ..support import Deployment
from .conftest import HOMEPAGE, PAGES
from .forge import MaliciousShuffler, certified


@pytest.fixture(scope="module")
def liar(deployment: Deployment) -> MaliciousShuffler:
    return MaliciousShuffler(deployment)


def _at_claim(channel_id: str, n: int) -> float:
    """The ε the analyzer would certify if it took a crowd of ``n`` at its word."""
    config = {c.id: c for c in (PAGES, HOMEPAGE)}[channel_id]
    mechanism: Any = get(config.mechanism)
    params = mechanism.parse_params(config.params)
    return float(mechanism.certify_crowd(params, n, config.delta).certified.eps)


def test_an_inflated_crowd_is_certified_at_the_crowd_its_fragments_back(
    liar: MaliciousShuffler,
) -> None:
    fragments = liar.fragments("homepage", 1, [3, 3, 5, 9])[:30]
    assert liar.post("homepage", 1, 1_000_000, fragments).status_code == 201
    release = liar.release("homepage", 1).json()
    print("inflated n=10^6 over 30 fragments:", certified(release))
    print(f"  (taken at its word: ε={_at_claim('homepage', 1_000_000):.4g})")
    check = release["crowd_check"]
    assert check == {**check, "claimed": 1_000_000, "short_batches": 1}
    assert 1 <= check["verified"] <= 40, check
    assert release["n"] == check["verified"]
    assert release["certificate"]["eps"] > 20 * _at_claim("homepage", 1_000_000)
    assert "verify" in release["note"]


def test_a_fixed_count_channel_refuses_a_crowd_its_fragments_do_not_match(
    liar: MaliciousShuffler,
) -> None:
    fragments = liar.fragments("pages", 1, [1, 2, 3])
    refused = liar.post("pages", 1, 2**31 - 1, fragments)
    print("k-RR, n=2^31-1 over 3 fragments:", refused.status_code, refused.text)
    assert refused.status_code == 422
    assert refused.json()["error"] == "inconsistent_counts"
    assert liar.release("pages", 1).status_code == 404  # nothing of it was stored


def test_chaff_does_not_count_as_a_crowd(liar: MaliciousShuffler) -> None:
    assert liar.post("homepage", 2, 2_000, liar.chaff("homepage", 2_000)).status_code == 201
    nothing = liar.release("homepage", 2)
    print("2,000 undecryptable fragments claiming n=2,000:", nothing.status_code, nothing.text)
    assert nothing.status_code == 404
    assert "can be released" in nothing.json()["detail"], nothing.text

    honest = liar.fragments("pages", 2, list(range(16)) * 60)[:960]
    padded = honest + liar.chaff("pages", 1_040)
    assert liar.post("pages", 2, 2_000, padded).status_code == 201
    release = liar.release("pages", 2).json()
    print("k-RR, 960 real + 1,040 chaff claiming n=2,000:", certified(release))
    assert release["crowd_check"]["verified"] == 960
    assert release["crowd_check"]["invalid_fragments"] == 1_040
    assert release["certificate"]["eps"] == pytest.approx(_at_claim("pages", 960))
    assert release["certificate"]["eps"] > _at_claim("pages", 2_000)


def test_fragments_replayed_from_an_earlier_epoch_do_not_open(liar: MaliciousShuffler) -> None:
    earlier = liar.fragments("pages", 10, [i % 16 for i in range(500)])
    assert liar.post("pages", 10, 500, earlier).status_code == 201
    first = liar.release("pages", 10).json()
    print("epoch 10, 500 honest contributions:", certified(first))
    assert first["crowd_check"]["verified"] == 500

    fresh = liar.fragments("pages", 11, [i % 16 for i in range(500)])
    assert liar.post("pages", 11, 1_000, earlier + fresh).status_code == 201
    second = liar.release("pages", 11).json()
    print("epoch 11, 500 fresh + epoch 10's 500 replayed:", certified(second))
    assert second["crowd_check"]["verified"] == 500
    assert second["crowd_check"]["invalid_fragments"] == 500


def test_parts_of_two_batches_do_not_make_one(liar: MaliciousShuffler) -> None:
    ours = liar.fragments("pages", 20, [i % 16 for i in range(250)])
    theirs = liar.fragments("pages", 21, [i % 16 for i in range(250)])
    batch = "ab" * 16
    assert liar.post("pages", 20, 500, ours, batch_id=batch, part=0, parts=2).status_code == 201
    disagrees = liar.post("pages", 20, 500, theirs, batch_id=batch, part=1, parts=3)
    assert disagrees.status_code == 422, disagrees.text
    assert disagrees.json()["error"] == "inconsistent_counts"
    assert liar.post("pages", 20, 500, theirs, batch_id=batch, part=1, parts=2).status_code == 201
    release = liar.release("pages", 20).json()
    print("epoch 20, a part of epoch 21's batch mixed in:", certified(release))
    assert release["crowd_check"]["verified"] == 250

    second = liar.post("pages", 20, 250, liar.fragments("pages", 20, [1] * 250))
    print("a second batch for the same group:", second.status_code, second.text)
    assert second.status_code == 422
    assert second.json()["error"] == "duplicate_group"


def test_a_shuffler_cannot_sign_for_another(liar: MaliciousShuffler) -> None:
    impostor = MaliciousShuffler(liar.deployment, "shuffler-1")
    impostor.shuffler_id = "shuffler-2"  # names shuffler-2, signs with shuffler-1's key
    refused = impostor.post("pages", 30, 20, impostor.fragments("pages", 30, [0] * 20))
    assert refused.status_code == 401
    assert refused.json()["error"] == "bad_signature"
