"""The streamed shuffle: a released group's fragments as ONE uniformly random permutation, cut
into parts of at most ``cap`` fragments, without ever holding the group in memory.

ESA-revisited (Girgis et al.) §V, Algorithm 3's "flatten the survivors' fragments and shuffle"
step, done in bounded memory by dealing cards into hands: each fragment gets an independent
uniform hand in ``[0, k)``, ``k = max(1, ceil(F / (LOAD · cap)))``; hands are spilled to one
unlinked temporary file, then each is shuffled with Fisher–Yates and released in hand order.
The cuts' law depends on ``F`` alone. The algorithm, the proof that the parts are one uniform
permutation, and the memory bound: docs/shuffler.md, "The streamed shuffle".
"""

from __future__ import annotations

import base64
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from common import randomness
from common.randomness import RandomSource

#: Expected hand size as a fraction of the part cap. A hand is Binomial(F, 1/k) with mean
#: mu <= 0.8·cap, so at the default cap of 50,000 it exceeds the cap with probability below
#: exp(-mu·0.25²/2.25) < 1e-400 (Chernoff) and parts are practically never split; the cut never
#: depends on the data either way.
LOAD = 0.8

Int64s = npt.NDArray[np.int64]
_LENGTH = 2  # bytes of a fragment's length prefix (shuffler.records.pack_fragments)


@dataclass(frozen=True, slots=True)
class Records:
    """Fragments in their stored packing (``u16 length | bytes`` each, as
    :func:`shuffler.records.pack_fragments` writes them), with where each record starts and
    each fragment's length."""

    data: npt.NDArray[np.uint8]
    starts: Int64s
    sizes: Int64s

    @classmethod
    def parse(cls, packed: bytes) -> Records:
        """Index packed fragments; vectorised when every fragment has the same length (one
        channel's sealed fragments all do), else one step per fragment.

        Raises:
            ValueError: if ``packed`` ends inside a record.
        """
        data = np.frombuffer(packed, dtype=np.uint8)
        width = int.from_bytes(packed[:_LENGTH], "big") + _LENGTH if packed else _LENGTH
        if data.size % width == 0:
            rows = data.reshape(-1, width)
            sizes = rows[:, 0].astype(np.int64) * 256 + rows[:, 1]
            if (sizes == width - _LENGTH).all():
                return cls(data, np.arange(rows.shape[0], dtype=np.int64) * width, sizes)
        starts, lengths, offset = [], [], 0
        while offset < len(packed):
            starts.append(offset)
            lengths.append(int.from_bytes(packed[offset : offset + _LENGTH], "big"))
            offset += _LENGTH + lengths[-1]
        if offset != len(packed):
            raise ValueError(f"packed fragments end inside a record ({offset} != {len(packed)})")
        return cls(data, np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.starts.size)

    def take(self, order: Int64s) -> Records:
        """The records at positions ``order``, in that order, packed contiguously (whole rows
        gathered when every fragment has the same length, else byte by byte)."""
        if len(self) and (self.sizes == self.sizes[0]).all():
            width = int(self.sizes[0]) + _LENGTH
            rows = self.data.reshape(len(self), width)[order]
            starts = np.arange(order.size, dtype=np.int64) * width
            return Records(rows.reshape(-1), starts, self.sizes[order])
        widths = self.sizes[order] + _LENGTH
        ends = np.cumsum(widths)
        starts = ends - widths
        shift = np.repeat(self.starts[order] - starts, widths)
        gathered = self.data[shift + np.arange(int(ends[-1]) if ends.size else 0)]
        return Records(gathered, starts, self.sizes[order])

    def fragments(self) -> list[bytes]:
        """The fragments as bytes."""
        raw = self.data.tobytes()
        spans = zip(self.starts.tolist(), self.sizes.tolist(), strict=True)
        return [raw[start + _LENGTH : start + _LENGTH + size] for start, size in spans]

    def base64(self) -> list[str]:
        """Each fragment in standard base64 (:func:`common.wire.b64`): one encoding of all of
        them when they share a length divisible by 3 (base64 of a concatenation of 3-byte
        multiples is the concatenation of their encodings), else one each."""
        size = int(self.sizes[0]) if len(self) else 0
        if size and size % 3 == 0 and (self.sizes == size).all():
            rows = self.data.reshape(len(self), _LENGTH + size)[:, _LENGTH:]
            text = base64.b64encode(rows.tobytes()).decode()
            step = size // 3 * 4
            return [text[i : i + step] for i in range(0, len(text), step)]
        return [base64.b64encode(f).decode() for f in self.fragments()]


def hands_for(fragments: int, cap: int) -> int:
    """How many hands ``fragments`` are dealt into: ``max(1, ceil(F / (LOAD · cap)))``.

    Raises:
        ValueError: if ``fragments`` < 0 or ``cap`` < 1.
    """
    if fragments < 0 or cap < 1:
        raise ValueError(f"need fragments >= 0 and cap >= 1, got {fragments=}, {cap=}")
    return max(1, math.ceil(fragments / (LOAD * cap)))


def piece_sizes(size: int, cap: int) -> list[int]:
    """A hand of ``size`` fragments cut into ``ceil(size / cap)`` near-equal pieces (none when
    empty).

    Raises:
        ValueError: if ``size`` < 0 or ``cap`` < 1.
    """
    if size < 0 or cap < 1:
        raise ValueError(f"need size >= 0 and cap >= 1, got {size=}, {cap=}")
    pieces = math.ceil(size / cap)
    return [size // pieces + (i < size % pieces) for i in range(pieces)]


class Spill:
    """The dealt fragments on disk: one file, each chunk written grouped by hand, and per chunk
    the ``k + 1`` byte offsets where its hands start (and the last ends)."""

    def __init__(self, file: BinaryIO, hands: int) -> None:
        self.file = file
        self.hands = hands
        self.sizes: Int64s = np.zeros(hands, dtype=np.int64)
        self._starts: list[Int64s] = []
        self._end = 0

    @property
    def fragments(self) -> int:
        """Fragments spilled so far."""
        return int(self.sizes.sum())

    def add(self, records: Records, hands: Int64s) -> None:
        """Append one chunk: record ``i`` goes to hand ``hands[i]``."""
        if len(records) != hands.size:
            raise ValueError(f"{len(records)} fragments but {hands.size} hands drawn")
        grouped = records.take(np.argsort(hands, kind="stable"))
        counts = np.bincount(hands, minlength=self.hands)
        bounds = np.concatenate((grouped.starts, [grouped.data.size]))
        self._starts.append(self._end + bounds[np.concatenate(([0], np.cumsum(counts)))])
        self.file.write(grouped.data.tobytes())
        self._end += int(grouped.data.size)
        self.sizes += counts

    def hand(self, index: int) -> Records:
        """Every fragment dealt to hand ``index``, in the order written."""
        self.file.flush()
        descriptor = self.file.fileno()
        pieces = [
            os.pread(descriptor, int(s[index + 1] - s[index]), int(s[index]))
            for s in self._starts
            if s[index + 1] > s[index]
        ]
        return Records.parse(b"".join(pieces))


class Deal:
    """The parts of one dealt group, in release order: each hand shuffled then cut."""

    def __init__(self, spill: Spill, cap: int, rng: RandomSource) -> None:
        self._spill = spill
        self._rng = rng
        self._pieces = [piece_sizes(int(s), cap) for s in spill.sizes]
        self._dealt = False

    @property
    def fragments(self) -> int:
        """Fragments in all parts together."""
        return self._spill.fragments

    @property
    def parts(self) -> int:
        """How many parts :meth:`__iter__` yields (at least one)."""
        return max(1, sum(len(p) for p in self._pieces))

    def __iter__(self) -> Iterator[Records]:
        """The parts, once: hand by hand, each shuffled (Fisher–Yates) and cut."""
        if self._dealt:
            raise RuntimeError("a deal is released once")
        self._dealt = True
        if self.fragments == 0:
            yield Records.parse(b"")
            return
        for index, pieces in enumerate(self._pieces):
            if not pieces:
                continue
            order = list(range(sum(pieces)))
            randomness.shuffle(self._rng, order)
            hand = self._spill.hand(index)
            start = 0
            for size in pieces:
                yield hand.take(np.array(order[start : start + size], dtype=np.int64))
                start += size


@contextmanager
def deal(
    chunks: Iterable[Sequence[bytes]],
    fragments: int,
    cap: int,
    rng: RandomSource,
    directory: Path | None = None,
) -> Iterator[Deal]:
    """Deal ``chunks`` into hands on a temporary file, gone when the ``with`` block ends.

    Args:
        chunks: The survivors' packed fragments (:func:`shuffler.records.pack_fragments`), a
            bounded number of contributions at a time, in any order.
        fragments: Their fragment count ``F`` as stored (chooses the number of hands).
        cap: Most fragments per part.
        rng: Source of every draw (the OS CSPRNG unless a test seeds one).
        directory: Where the temporary file goes (None: the system's temporary directory).

    Raises:
        ValueError: if ``fragments`` < 0 or ``cap`` < 1.
    """
    hands = hands_for(fragments, cap)
    with tempfile.TemporaryFile(dir=directory, prefix="esa-deal-") as file:
        spill = Spill(file, hands)
        for chunk in chunks:
            records = Records.parse(b"".join(chunk))
            spill.add(records, randomness.uniform_integers(rng, hands, len(records)))
        yield Deal(spill, cap, rng)
