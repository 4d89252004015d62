"""A malicious shuffler against a real analyzer: it signs with its own real key and lies about
what it sends (docs/protocol.md, "Who vouches for what": the analyzer certifies only the crowd
it can verify). Each test prints the certificate the analyzer gives, beside the one the lie
asked for.

Every attack here was accepted and certified at the claimed crowd before the analyzer verified
crowds: 30 k-RAPPOR fragments claiming 10^6 contributions certified ε ≈ 0.013; 2,000 fragments
that open for nobody certified as a crowd of 2,000; fragments of an earlier epoch opened in a
later one (they were bound to their channel only).
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx
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
    withheld = liar.release("homepage", 1)
    print("inflated n=10^6 over 30 fragments:", withheld.status_code, withheld.text)
    print(f"  (taken at its word: ε={_at_claim('homepage', 1_000_000):.4g})")
    # 30 fragments prove at most 4 contributions: below min_crowd (20), never released
    assert withheld.status_code == 404, withheld.text

    fragments = liar.fragments("homepage", 3, list(range(64)))
    assert liar.post("homepage", 3, 1_000_000, fragments).status_code == 201
    release = liar.release("homepage", 3).json()
    print("inflated n=10^6 over 64 real contributions:", certified(release))
    check = release["crowd_check"]
    assert check == {**check, "claimed": 1_000_000, "short_batches": 1}
    assert 20 <= check["verified"] <= 64, check
    assert check["verified"] <= release["n"] < 2 * 64  # the claim held to what 64 can carry
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
    assert refused.status_code == 401  # its head, signed with shuffler-1's key, is refused
    assert refused.json()["error"] == "bad_preauth"


def _outcome(liar: MaliciousShuffler, channel_id: str, epoch: int) -> tuple[int, float, int]:
    """What the analyzer made of an epoch: the verified crowd and certified ε of its release,
    and the crowd its privacy ledger charged the epoch at."""
    release = liar.release(channel_id, epoch).json()
    ledger = httpx.get(f"{liar.url}/v1/channels/{channel_id}/privacy", timeout=30).json()
    charged = next(row["n"] for row in ledger["epochs"] if row["epoch"] == epoch)
    return release["crowd_check"]["verified"], release["certificate"]["eps"], charged


@pytest.mark.parametrize("channel_id", ["homepage", "pages"])
def test_repeated_fragments_count_once(liar: MaliciousShuffler, channel_id: str) -> None:
    """The same 500 real contributions as both parts of a batch (claimed 1,000), and each of
    their fragments 10 times in one part (claimed 5,000), beside an honest batch of 500 in the
    same run: the repeats are invalid, the crowd and the ledger are the honest 500's."""
    values = [i % 16 for i in range(500)]
    base = 40 if channel_id == "homepage" else 50
    liar.post(channel_id, base, 500, liar.fragments(channel_id, base, values)).raise_for_status()
    hv, he, hn = _outcome(liar, channel_id, base)
    twice, batch = liar.fragments(channel_id, base + 1, values), secrets.token_hex(16)
    for part in (0, 1):
        sent = liar.post(channel_id, base + 1, 1_000, twice, batch_id=batch, part=part, parts=2)
        sent.raise_for_status()
    v2, e2, n2 = _outcome(liar, channel_id, base + 1)
    tenfold = liar.fragments(channel_id, base + 2, values)
    liar.post(channel_id, base + 2, 5_000, tenfold * 10).raise_for_status()
    v10, e10, n10 = _outcome(liar, channel_id, base + 2)
    print(
        f"ATTACK 4a {channel_id} same 500 as both parts (claim 1,000): verified {v2} certified "
        f"eps {e2:.3f} ledger n {n2}; each 10x in one part (claim 5,000): verified {v10} eps "
        f"{e10:.3f} ledger n {n10}; honest control 500: verified {hv} eps {he:.3f} ledger n {hn}"
    )
    for verified, charged, eps in ((v2, n2, e2), (v10, n10, e10)):
        assert verified == charged <= 500 and eps > _at_claim(channel_id, 1_000)
    if channel_id == "pages":  # a fixed count: exact, the honest 500's very certificate
        assert v2 == v10 == hv == 500 and e2 == pytest.approx(he) == e10
    else:  # a lower bound from a random count: within a few percent of the honest one
        assert min(v2, v10) >= 0.85 * hv and max(e2, e10) <= 1.2 * he


def test_a_claim_above_its_fragments_at_a_small_crowd_certifies_only_the_fragments(
    liar: MaliciousShuffler,
) -> None:
    """60 real k-RAPPOR contributions claimed as 118 (near twice: inside the Bernstein slack
    of a largest-crowd check at small n), beside 60 claimed honestly; and 15 real claimed as
    30 to pass ``min_crowd`` (20): withheld, as the 15 are."""
    honest = liar.post("homepage", 43, 60, liar.fragments("homepage", 43, list(range(60))))
    assert honest.status_code == 201, honest.text
    hv, he, hn = _outcome(liar, "homepage", 43)
    liar.post(
        "homepage", 44, 118, liar.fragments("homepage", 44, list(range(60)))
    ).raise_for_status()
    v, e, n = _outcome(liar, "homepage", 44)
    liar.post(
        "homepage", 45, 30, liar.fragments("homepage", 45, list(range(15)))
    ).raise_for_status()
    small = liar.release("homepage", 45)
    print(
        f"ATTACK 4b 60 real claimed 118 (min_crowd 20): verified {v} certified eps {e:.3f} "
        f"ledger n {n} (at its word: eps {_at_claim('homepage', 118):.3f}); 15 real claimed "
        f"30: {small.status_code}; honest control 60 claimed 60: verified {hv} eps {he:.3f} "
        f"ledger n {hn}"
    )
    assert v == n <= 60 and e > _at_claim("homepage", 60)
    assert small.status_code == 404  # withheld below min_crowd: nothing charged or released
