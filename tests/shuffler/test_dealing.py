"""The streamed shuffle (shuffler.dealing) and the exact bulk draws it rests on
(common.randomness): one uniform permutation of the whole group whatever the hands, parts never
over the cap, every fragment out exactly once, no temporary file left behind.

Statistical tests are seeded (deterministic); each would fail with p ~ 0 for a dealing that
kept the read order, a modulo-biased draw, or cuts that depend on the data.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from common.randomness import (
    SeededSource,
    bounded_integers,
    default_source,
    random_bytes,
    shuffle,
    uniform_integers,
)
from common.wire import b64
from shuffler.dealing import LOAD, Records, deal, hands_for, piece_sizes
from shuffler.records import pack_fragments

from .factory import open_files


def _packed(fragments: list[bytes], per_blob: int = 3) -> list[bytes]:
    return [pack_fragments(fragments[i : i + per_blob]) for i in range(0, len(fragments), per_blob)]


def _chunks(blobs: list[bytes], per_chunk: int) -> list[list[bytes]]:
    return [blobs[i : i + per_chunk] for i in range(0, len(blobs), per_chunk)]


def _dealt(
    fragments: list[bytes], cap: int, seed: int, per_chunk: int = 2, directory: Path | None = None
) -> list[list[bytes]]:
    blobs = _packed(fragments)
    with deal(_chunks(blobs, per_chunk), len(fragments), cap, SeededSource(seed), directory) as d:
        parts = [part.fragments() for part in d]
        assert d.parts == len(parts) and d.fragments == len(fragments)
    return parts


def _open_in(directory: Path) -> list[str]:
    """This process's open files under ``directory`` (an unlinked temporary file included)."""
    return [link for link in open_files() if link.startswith(str(directory))]


def test_hands_and_pieces() -> None:
    assert [hands_for(f, 10) for f in (0, 1, 8, 9, 80, 81)] == [1, 1, 1, 2, 10, 11]
    assert hands_for(30_000_000, 50_000) == math.ceil(30_000_000 / (LOAD * 50_000)) == 750
    assert piece_sizes(0, 5) == [] and piece_sizes(5, 5) == [5]
    assert piece_sizes(6, 5) == [3, 3] and piece_sizes(11, 5) == [4, 4, 3]
    with pytest.raises(ValueError, match="cap=0"):
        hands_for(3, 0)
    with pytest.raises(ValueError, match="size=-1"):
        piece_sizes(-1, 3)


@pytest.mark.parametrize(
    "sizes", [[72] * 5, [9] * 4, [8] * 3, [1, 5, 0, 72], [2, 0, 0], [0, 0], []]
)
def test_records_read_gather_and_encode_the_stored_packing(sizes: list[int]) -> None:
    """Fixed-length fragments take the vectorised path (and one base64 call when the length
    divides by 3), others the step-by-step one ([2, 0, 0] looks fixed-length to a first glance);
    both read, reorder and encode exactly like pack_fragments / b64."""
    fragments = [os.urandom(n) for n in sizes]
    records = Records.parse(pack_fragments(fragments))
    assert len(records) == len(fragments) and records.fragments() == fragments
    assert records.base64() == [b64(f) for f in fragments]
    backwards = records.take(np.arange(len(fragments) - 1, -1, -1, dtype=np.int64))
    assert backwards.data.tobytes() == pack_fragments(fragments[::-1])
    assert backwards.fragments() == fragments[::-1]
    if fragments:
        with pytest.raises(ValueError, match="inside a record"):
            Records.parse(pack_fragments(fragments) + b"\x00")


def test_whole_permutation_is_uniform_whatever_the_cuts() -> None:
    """4 fragments, parts of at most 2 (3 hands, so hands are split, skipped or whole): all 24
    orders of the released sequence equally likely, overall and given each pattern of part
    sizes (the cuts carry nothing about the order)."""
    fragments = [bytes([i]) * 8 for i in range(4)]
    trials = 7_200
    rng = SeededSource(2024)
    orders: Counter[tuple[int, ...]] = Counter()
    by_cuts: dict[tuple[int, ...], Counter[tuple[int, ...]]] = {}
    for _ in range(trials):
        with deal([_packed(fragments, 1)], 4, 2, rng) as dealt:
            parts = [part.fragments() for part in dealt]
        order = tuple(f[0] for part in parts for f in part)
        orders[order] += 1
        by_cuts.setdefault(tuple(len(p) for p in parts), Counter())[order] += 1
    everything = list(itertools.permutations(range(4)))
    assert set(orders) == set(everything)
    assert stats.chisquare([orders[o] for o in everything]).pvalue > 1e-6
    common = sorted(by_cuts.values(), key=lambda c: -sum(c.values()))[:3]
    assert len(by_cuts) > 3  # the cuts really vary
    for given in common:
        assert stats.chisquare([given[o] for o in everything]).pvalue > 1e-6


def test_every_fragment_position_is_uniform() -> None:
    """12 fragments read in order, parts of at most 4: each fragment's final position is
    uniform over the 12 (seeded chi-square, 11 degrees of freedom, one per fragment)."""
    fragments = [bytes([i]) * 16 for i in range(12)]
    trials = 2_400
    positions = np.zeros((12, 12))
    for seed in range(trials):
        released = [f[0] for part in _dealt(fragments, 4, seed) for f in part]
        positions[released, np.arange(12)] += 1
    for fragment in range(12):
        assert stats.chisquare(positions[fragment]).pvalue > 1e-6, fragment


@pytest.mark.parametrize("cap", [1, 2, 3, 7, 64])
def test_parts_within_cap_and_every_fragment_out_once(cap: int) -> None:
    """Conservation: the multiset out is the multiset in (duplicates included); no part over
    the cap, none empty, numbered as announced; chunks of any size."""
    for seed in range(60):
        count = (seed * 7) % 90 + 1
        fragments = [bytes([i % 5]) * (1 + i % 3) for i in range(count)]  # repeats on purpose
        parts = _dealt(fragments, cap, seed, per_chunk=1 + seed % 4)
        assert all(0 < len(p) <= cap for p in parts)
        assert Counter(f for p in parts for f in p) == Counter(fragments)


def test_a_group_without_fragments_is_one_empty_part() -> None:
    assert _dealt([], 5, 0) == [[]]
    with deal([], 0, 5, SeededSource(0)) as dealt:
        assert dealt.parts == 1 and [part.fragments() for part in dealt] == [[]]
        with pytest.raises(RuntimeError, match="once"):
            list(dealt)


def test_the_temporary_file_is_gone_after_success_and_after_an_error(tmp_path: Path) -> None:
    fragments = [os.urandom(20) for _ in range(50)]
    blobs = _packed(fragments)
    with deal(_chunks(blobs, 4), 50, 7, default_source(), tmp_path) as dealt:
        assert _open_in(tmp_path)  # the spill lives in the directory while dealing
        assert sum(len(p) for p in dealt) == 50
    assert _open_in(tmp_path) == [] and list(tmp_path.iterdir()) == []

    spill = deal(_chunks(blobs, 4), 50, 7, default_source(), tmp_path)
    with pytest.raises(ZeroDivisionError), spill as dealt:
        next(iter(dealt))
        raise ZeroDivisionError  # e.g. the database failed while storing a part
    assert _open_in(tmp_path) == [] and list(tmp_path.iterdir()) == []

    def failing() -> Iterator[list[bytes]]:
        yield blobs[:3]
        raise OSError("the database went away while reading")

    with (
        pytest.raises(OSError, match="went away"),
        deal(failing(), 50, 7, default_source(), tmp_path),
    ):
        pass
    assert _open_in(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_bounded_integers_have_no_modulo_bias() -> None:
    """Bound 3·2^62: plain ``r mod b`` of a 64-bit word lands below 2^62 half the time; the
    exact draw a third of the time."""
    draws = bounded_integers(SeededSource(1), np.full(60_000, 3 << 62, dtype=np.uint64))
    below = int((draws < (1 << 62)).sum())
    assert abs(below / 60_000 - 1 / 3) < 5 * math.sqrt(2 / 9 / 60_000)
    assert int(draws.max()) < 3 << 62
    assert bounded_integers(SeededSource(1), np.ones(5, dtype=np.uint64)).tolist() == [0] * 5
    with pytest.raises(ValueError, match="bounds must be >= 1"):
        bounded_integers(SeededSource(1), np.zeros(2, dtype=np.uint64))


def test_uniform_integers_and_shuffle_are_uniform() -> None:
    """Seeded chi-square: 7 equally likely values; all 120 orders of a Fisher–Yates shuffle of
    5 items."""
    values = uniform_integers(SeededSource(3), 7, 70_000)
    assert stats.chisquare(np.bincount(values, minlength=7)).pvalue > 1e-6
    rng = SeededSource(4)
    orders: Counter[tuple[int, ...]] = Counter()
    for _ in range(24_000):
        items = list(range(5))
        shuffle(rng, items)
        orders[tuple(items)] += 1
    assert len(orders) == 120 and stats.chisquare(list(orders.values())).pvalue > 1e-6
    with pytest.raises(ValueError, match="upper=0"):
        uniform_integers(SeededSource(3), 0, 4)


def test_random_bytes_from_a_source_without_randbytes() -> None:
    """Any :class:`RandomSource` works: without ``randbytes`` the bytes come from one
    ``randbelow`` over ``256**n``."""

    class Minimal:
        def __init__(self) -> None:
            self.inner = SeededSource(9)

        def random(self) -> float:
            return self.inner.random()

        def randbelow(self, upper: int) -> int:
            return self.inner.randbelow(upper)

    data = random_bytes(Minimal(), 4_000)
    assert len(data) == 4_000 and len(set(data)) > 200
    assert len(random_bytes(default_source(), 16)) == 16
