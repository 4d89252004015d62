"""Wire vectors for the TypeScript device SDK, made by the Python one (docs/sdk-js.md).

    .venv/bin/python sdk-js/vectors/make_vectors.py           # writes sdk-js/vectors/wire.json
    .venv/bin/python sdk-js/vectors/make_vectors.py --check   # the file still says what Python does

Every expectation in ``wire.json`` is what the Python code of this repository computes from the
inputs next to it: canonical JSON of signed documents, HPKE ``info`` and key ids, padding and
contribution layouts, blobs Python sealed (for the TypeScript side to open), each mechanism's
local ε, encodings replayed from recorded random draws, which changes relax a channel's terms,
and scenarios run through a real :class:`encoder_client.Client` (signed configs accepted or
refused, keys followed through successions, rollbacks, reports charged or refused). The
TypeScript tests read the same file, and :func:`check` (tests/client/test_sdk_js_vectors.py)
recomputes every expectation, so the file cannot drift from Python.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import random
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import (
    TrustAnchors,
    canonical,
    shuffler_party,
    sign_config,
    sign_descriptor,
    sign_succession,
)
from common.envelope import (
    Contribution,
    FragmentContext,
    KeyRing,
    key_id,
    open_contribution,
    open_fragment,
    outer_info,
    pad,
    public_bytes,
    seal_contribution,
    seal_fragment,
)
from common.mechanisms import SeededSource, StateUpdate, get
from common.mechanisms.rfrag import BackstopState
from common.terms import ChannelTerms, relaxations
from common.wire import (
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    DeviceBudget,
    HpkeKey,
    ShufflerDescriptor,
    Succession,
    b64,
)
from encoder_client import Client, EsaError, PrivacyCaps

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "wire.json"
#: A fixed time far from now: every document's validity is stated against it.
T0 = 1_900_000_000
HOUR = 3600


# --- JSON: what both sides can read ----------------------------------------------------------


def jsonable(value: Any) -> Any:
    """``value`` as JSON both sides read: tuples as lists, non-finite floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


# --- keys -------------------------------------------------------------------------------------


def _seed(label: str) -> bytes:
    return hashlib.sha256(b"esa sdk-js vectors/" + label.encode()).digest()


def signing_key(label: str) -> Ed25519PrivateKey:
    """A fixed Ed25519 key named by ``label`` (so the file is the same each time it is made)."""
    return Ed25519PrivateKey.from_private_bytes(_seed(label))


def hpke_key(label: str) -> X25519PrivateKey:
    """A fixed X25519 key named by ``label``."""
    return X25519PrivateKey.from_private_bytes(_seed(label))


def pub(key: Ed25519PrivateKey | X25519PrivateKey) -> str:
    """The public key, base64."""
    return b64(public_bytes(key.public_key()))


def raw_private(key: X25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    return raw.hex()


# --- canonical JSON, ids, padding, layouts ----------------------------------------------------

CANONICAL_INPUTS = [
    '{"b": 1, "a": [1, 2.0, -0.0, 1e-9, 1E5, 0.1, 123.456, 1e16, 1e22, 1.5e300]}',
    '{"ints": [0, -0, 123456789012345678901234567890, -9007199254740993, 9007199254740991]}',
    '{"floats": [5e-324, 1.7976931348623157e308, 2.5e-5, 0.0001, 1e-05, 1234567890123456.0]}',
    '{"floats": [12345678901234567.0, 1e400, -1e400, 3.0e0, 100.0, 1e15, 0.30000000000000004]}',
    '{"text": "caf\\u00e9 \\ud83d\\ude00 \\u2028 \\u007f tab\\t nl\\n quote\\" back\\\\ /"}',
    '{"raw": "café 😀 \u2028 \u007f", "ctl": "\\u0001\\u001f\\b\\f\\r"}',
    '{"é": 1, "z": 2, "A": 3, "\\ud83d\\ude00": 4, "\\uffff": 5, "": 6}',
    '{"dup": 1, "dup": 2, "nested": {"y": [true, false, null], "x": {}}}',
    "[]",
    '{"lone": "\\ud800", "esc": "\\u00e9\\u00E9"}',
    ' { "spaces" : [ 1 , 2 ] , "t" : true } ',
    '{"n": NaN, "i": Infinity, "m": -Infinity}',
]


def _random_floats() -> list[str]:
    """Floats of every magnitude, written shortest (as Python does) and with 17 digits (as
    another writer may): both must canonicalize to Python's repr."""
    rng = random.Random(20)
    values = [rng.random() * 10.0 ** rng.randint(-330, 308) for _ in range(400)]
    values += [float(rng.randint(1, 10**18)) for _ in range(50)]
    values += [rng.choice((-1, 1)) * 2.0 ** rng.randint(-1074, 1023) for _ in range(50)]
    shortest = "[" + ",".join(repr(v) for v in values) + "]"
    long = "[" + ",".join(format(v, ".17g") for v in values) + "]"
    return [shortest, long]


def canonical_cases() -> list[dict[str, Any]]:
    return [
        {"text": text, "canonical": canonical(json.loads(text)).decode()}
        for text in [*CANONICAL_INPUTS, *_random_floats()]
    ]


INFO_CASES: list[tuple[str, int, str]] = [
    ("pages", 0, ""),
    ("pages", 527_777, "eu"),
    ("a" * 255, 2**53 - 1, "b" * 255),
    ("a" * 256, 1, ""),
    ("pages", 1, "c" * 256),
    ("pages", -1, ""),
    ("x.y_z-1", 42, "crowd.1"),
    ("é", 7, "ü"),
]


def _info(channel: str, epoch: int, crowd: str) -> dict[str, Any]:
    case: dict[str, Any] = {"channel": channel, "epoch": epoch, "crowd": crowd}
    try:
        case["info"] = FragmentContext(channel, epoch, crowd).info().hex()
    except ValueError:
        case["error"] = True
    return case


def info_cases() -> list[dict[str, Any]]:
    return [_info(*case) for case in INFO_CASES]


def outer_cases() -> list[dict[str, Any]]:
    return [{"shuffler": s, "info": outer_info(s).hex()} for s in ("shuffler-1", "s", "é")]


def key_id_cases() -> list[dict[str, Any]]:
    keys = [pub(hpke_key(f"key-id-{i}")) for i in range(3)]
    return [_key_id(k) for k in keys]


def _key_id(public: str) -> dict[str, Any]:
    from common.envelope import load_x25519_public

    return {"public": public, "key_id": key_id(load_x25519_public(base64.b64decode(public))).hex()}


PAD_CASES: list[tuple[str, int]] = [
    ("", 8),
    ("0105000000", 8),
    ("010500000003", 8),
    ("01050000000300", 8),
    ("0102" + "00" * 4, 16),
    ("ff" * 1022, 1024),
    ("ff" * 1023, 1024),
    ("", 65535),
    ("", 65536),
    ("aa", 1),
]


def _pad(data: str, size: int) -> dict[str, Any]:
    case: dict[str, Any] = {"data": data, "size": size}
    try:
        case["padded"] = pad(bytes.fromhex(data), size).hex()
    except ValueError:
        case["error"] = True
    return case


def pad_cases() -> list[dict[str, Any]]:
    return [_pad(*case) for case in PAD_CASES]


CONTRIBUTION_CASES: list[dict[str, Any]] = [
    {"channel_id": "pages", "crowd_id": "", "epoch": 527_777, "nonce": "00" * 16,
     "fragments": ["aa" * 56, "bb" * 56]},
    {"channel_id": "homepage", "crowd_id": "eu", "epoch": 0, "nonce": "0f" * 16, "fragments": []},
    {"channel_id": "c", "crowd_id": "x", "epoch": 2**53 - 1, "nonce": "ff" * 16,
     "fragments": ["01"]},
    {"channel_id": "pages", "crowd_id": "", "epoch": 1, "nonce": "00" * 15, "fragments": []},
    {"channel_id": "p" * 256, "crowd_id": "", "epoch": 1, "nonce": "00" * 16, "fragments": []},
]  # fmt: skip


def _contribution(case: dict[str, Any]) -> dict[str, Any]:
    out = dict(case)
    try:
        out["encoded"] = (
            Contribution(
                channel_id=case["channel_id"],
                crowd_id=case["crowd_id"],
                epoch=case["epoch"],
                nonce=bytes.fromhex(case["nonce"]),
                fragments=tuple(bytes.fromhex(f) for f in case["fragments"]),
            )
            .encode()
            .hex()
        )
    except ValueError:
        out["error"] = True
    return out


def contribution_cases() -> list[dict[str, Any]]:
    return [_contribution(case) for case in CONTRIBUTION_CASES]


def sealed_cases() -> list[dict[str, Any]]:
    """Blobs Python sealed, with the private keys that open them (each side opens the other's:
    these for TypeScript, the system test for Python)."""
    analyzer, shuffler = hpke_key("sealed-analyzer"), hpke_key("sealed-shuffler")
    context = FragmentContext("pages", 527_777, "eu")
    fragment = bytes.fromhex("0105000000")
    inner = seal_fragment(fragment, context, 16, analyzer.public_key())
    contribution = Contribution("pages", "eu", 527_777, b"\x07" * 16, (inner,))
    outer = seal_contribution(contribution, "shuffler-1", shuffler.public_key())
    return [
        {
            "kind": "fragment",
            "private": raw_private(analyzer),
            "public": pub(analyzer),
            "channel": "pages",
            "epoch": 527_777,
            "crowd": "eu",
            "payload_size": 16,
            "blob": inner.hex(),
            "fragment": fragment.hex(),
        },
        {
            "kind": "contribution",
            "private": raw_private(shuffler),
            "public": pub(shuffler),
            "shuffler": "shuffler-1",
            "blob": outer.hex(),
            "contribution": contribution.encode().hex(),
        },
    ]


def check_sealed(case: dict[str, Any]) -> bool:
    """Whether a sealed blob still opens with Python to what the case says."""
    ring = KeyRing.of(X25519PrivateKey.from_private_bytes(bytes.fromhex(case["private"])))
    blob = bytes.fromhex(case["blob"])
    if case["kind"] == "fragment":
        context = FragmentContext(case["channel"], case["epoch"], case["crowd"])
        return open_fragment(blob, context, ring).hex() == case["fragment"]
    opened = open_contribution(blob, case["shuffler"], ring)
    return opened.encode().hex() == case["contribution"]


# --- mechanisms -------------------------------------------------------------------------------

HUGE = 10**400
LOCAL_CASES: list[tuple[str, dict[str, Any]]] = [
    ("krappor", {"k": 8, "eps": 1.0}),
    ("krappor", {"k": 2, "eps": 3}),
    ("krappor", {"k": 8, "eps": 0.0}),
    ("krappor", {"k": 1, "eps": 1.0}),
    ("krappor", {"k": 8.0, "eps": 1.0}),
    ("krappor", {"k": 8, "eps": HUGE}),
    ("krappor", {"k": 8, "eps": 1.0, "extra": 1}),
    ("krappor", {"k": 8}),
    ("krappor", {"k": True, "eps": 1.0}),
    ("krappor", {"k": 8, "eps": "1.0"}),
    ("krr", {"k": 4, "eps": 2.0}),
    ("krr", {"k": 1000, "eps": 0.5}),
    ("krr", {"k": 4294967295, "eps": 8.0}),
    ("krr", {"k": 4294967296, "eps": 8.0}),
    ("rfrag", {"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3}),
    ("rfrag", {"k": 16, "eps_b": 1.0, "eps_f": 4.0, "tau": 1}),
    ("rfrag", {"k": 16, "eps_b": 1.0, "eps_f": 4.0, "tau": 65535}),
    ("rfrag", {"k": 16, "eps_b": 1.0, "eps_f": 4.0, "tau": 65536}),
    ("rfrag", {"k": 16, "eps_b": 1.0, "eps_f": 4.0, "tau": 3.0}),
    ("longitudinal", {"d": 4, "k": 2, "eps": 4.0}),
    ("longitudinal", {"d": 1, "k": 1, "eps": 1.0}),
    ("longitudinal", {"d": 6, "k": 2, "eps": 4.0}),
    ("longitudinal", {"d": 2**20, "k": 3, "eps": 2.0}),
    ("longitudinal", {"d": 2**21, "k": 3, "eps": 2.0}),
    ("longitudinal", {"d": 4, "k": 0, "eps": 4.0}),
    ("zsum", {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000}),
    ("zsum", {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 100}),
    ("zsum", {"d": 1025, "eps": 1.0, "delta": 1e-6, "n": 3000}),
    ("zsum", {"d": 8, "eps": 1.5, "delta": 1e-6, "n": 3000}),
    ("ldp-sgd", {"dim": 4, "eps": 2.0}),
    ("ldp-sgd", {"dim": 4, "eps": 2.0, "tau": 3, "round": 2, "theta": "AAAA"}),
    ("ldp-sgd", {"dim": 1, "eps": 2.0}),
    ("nosuch", {"k": 4}),
]


def local_privacy(mechanism: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The local ε a device orders parameters by (None: not orderable: unknown mechanism,
    parameters that do not validate or cannot be evaluated), as :class:`ChannelTerms` does."""
    terms = ChannelTerms(id="c", mechanism=mechanism, params=dict(params), delta=1e-9)
    local = terms.local_privacy()
    if local is None:
        return None
    notions = ("removal", "replacement", "eps_l_inf", "eps_l1")
    return {notion: jsonable(float(getattr(local, notion))) for notion in notions}


def local_cases() -> list[dict[str, Any]]:
    return [{"mechanism": m, "params": p, "local": local_privacy(m, p)} for m, p in LOCAL_CASES]


class Tape:
    """A random source that records every draw of a seeded one (``record``) or replays a
    recording, refusing any draw that differs in kind or bound (``replay``)."""

    def __init__(self, draws: list[list[Any]] | None = None, seed: int = 0) -> None:
        self._source = SeededSource(seed) if draws is None else None
        self.draws: list[list[Any]] = [] if draws is None else draws
        self._next = 0

    def _replay(self, kind: str, *bound: int) -> Any:
        if self._next >= len(self.draws):
            raise AssertionError(f"no recorded draw left for {kind}{bound}")
        draw = self.draws[self._next]
        self._next += 1
        if draw[:-1] != [kind, *bound]:
            raise AssertionError(f"draw {self._next - 1} is {draw[:-1]}, not {[kind, *bound]}")
        return draw[-1]

    def random(self) -> float:
        if self._source is None:
            return float(self._replay("random"))
        value = self._source.random()
        self.draws.append(["random", value])
        return value

    def randbelow(self, upper: int) -> int:
        if self._source is None:
            return int(self._replay("randbelow", upper))
        value = self._source.randbelow(upper)
        self.draws.append(["randbelow", upper, value])
        return value

    @property
    def used_up(self) -> bool:
        return self._source is not None or self._next == len(self.draws)


TAPE_CASES: list[dict[str, Any]] = [
    {"mechanism": "krappor", "params": {"k": 8, "eps": 1.0}, "value": 3, "seed": 1},
    {"mechanism": "krappor", "params": {"k": 300, "eps": 0.5}, "value": 299, "seed": 2},
    {"mechanism": "krappor", "params": {"k": 2, "eps": 4.0}, "value": 0, "seed": 3},
    {"mechanism": "krr", "params": {"k": 4, "eps": 2.0}, "value": 1, "seed": 4},
    {"mechanism": "krr", "params": {"k": 1000, "eps": 0.1}, "value": 999, "seed": 5},
    {"mechanism": "zsum", "params": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000},
     "value": 5, "seed": 6},
    {"mechanism": "rfrag", "params": {"k": 8, "eps_b": 1.0, "eps_f": 0.8, "tau": 3},
     "value": 2, "seed": 7, "shufflers": 2},
    {"mechanism": "rfrag", "params": {"k": 64, "eps_b": 0.5, "eps_f": 0.5, "tau": 4},
     "value": 63, "seed": 8, "shufflers": 3,
     "state": {"backstops": {"63": [1, 5, 63], "2": [2]}}},
    {"mechanism": "longitudinal", "params": {"d": 8, "k": 2, "eps": 2.0},
     "value": {"period": 1, "changed": True}, "seed": 9},
    {"mechanism": "longitudinal", "params": {"d": 8, "k": 2, "eps": 2.0},
     "value": {"period": 4, "changed": True}, "seed": 10,
     "state": {"tree": [2, 3, 1, 0], "st": 1, "last": 2}},
    {"mechanism": "longitudinal", "params": {"d": 8, "k": 2, "eps": 2.0},
     "value": {"period": 8, "changed": False}, "seed": 11,
     "state": {"tree": [1, 4, 1, 1], "st": 1, "last": 7}},
    {"mechanism": "longitudinal", "params": {"d": 8, "k": 2, "eps": 2.0},
     "value": {"period": 3, "changed": False}, "seed": 12,
     "state": {"tree": [1, 2, 0, 0], "st": 0, "last": 2}},
]  # fmt: skip


def _python_state(mechanism: str, params: Any, state: dict[str, Any] | None) -> Any:
    """The Python mechanism's state from the neutral form the vectors hold."""
    if state is None:
        return None
    if mechanism == "rfrag":
        backstops = {int(v): list(ones) for v, ones in state["backstops"].items()}
        return {"backstops": BackstopState(params.fingerprint(), backstops).to_json()}
    return dict(state)


def _neutral_state(mechanism: str, state: Any) -> dict[str, Any] | None:
    """The neutral form of a Python mechanism's state (rfrag: the backstops by value)."""
    if state is None:
        return None
    if mechanism == "rfrag":
        found = BackstopState.from_json(state["backstops"])
        return {"backstops": {str(v): ones for v, ones in sorted(found.backstops.items())}}
    return dict(state)


def run_tape(case: Mapping[str, Any], tape: Tape) -> dict[str, Any]:
    """One encoding of ``case`` drawing from ``tape``: routes (slot, fragments hex) and the
    state after; a new state (drawn from the tape too) when the case gives none."""
    mechanism = get(case["mechanism"])
    params = mechanism.parse_params(case["params"])
    state = _python_state(case["mechanism"], params, case.get("state"))
    if state is None:
        state = mechanism.new_state(params, tape)
    value = case["value"]
    if isinstance(value, dict):
        value = StateUpdate(value["period"], value["changed"])
    encoded = mechanism.encode(params, value, state, tape, case.get("shufflers", 1))
    return {
        "routes": [[slot, [f.hex() for f in fragments]] for slot, fragments in encoded.routes],
        "state_after": _neutral_state(case["mechanism"], encoded.state),
    }


def tape_cases() -> list[dict[str, Any]]:
    out = []
    for case in TAPE_CASES:
        tape = Tape(seed=case["seed"])
        result = run_tape(case, tape)
        out.append(
            {**{k: v for k, v in case.items() if k != "seed"}, "draws": tape.draws, **result}
        )
    return out


def check_tape(case: dict[str, Any]) -> bool:
    tape = Tape(draws=[list(d) for d in case["draws"]])
    result = run_tape(case, tape)
    return tape.used_up and result == {k: case[k] for k in ("routes", "state_after")}


# --- pinned terms -----------------------------------------------------------------------------

BASE_CHANNEL: dict[str, Any] = {
    "id": "pages",
    "mechanism": "krappor",
    "params": {"k": 8, "eps": 3.0},
    "epoch_seconds": HOUR,
    "max_fragments": 8,
    "budget": {"lifetime_eps": 100.0},
}
TERMS_CHANGES: list[tuple[dict[str, Any], dict[str, Any] | None]] = [
    ({}, None),
    ({"params": {"k": 8, "eps": 12.0}}, None),
    ({"params": {"k": 8, "eps": 1.0}}, None),
    ({"params": {"k": 8, "eps": 3}}, None),
    ({"params": {"eps": 3.0, "k": 8}}, None),
    ({"params": {"k": 16, "eps": 3.0}}, None),
    ({"mechanism": "krr", "params": {"k": 8, "eps": 3.0}}, None),
    ({"params": {"k": 8, "eps": "x"}}, None),
    ({"params": {"k": 8, "eps": HUGE}}, None),
    ({"delta": 1e-6}, None),
    ({"delta": 1e-12}, None),
    ({"eps_cr": 1.0}, None),
    ({"eps_cr": 0.1}, None),
    ({"delta_cr": 1e-6}, None),
    ({"min_crowd": 20}, None),
    ({"min_crowd": 200}, None),
    ({"epoch_seconds": 60}, None),
    ({"epoch_seconds": 7200}, None),
    ({"max_fragments": 4}, None),
    ({"min_fragments": 1}, None),
    ({"payload_size": 32}, None),
    ({"crowds": ["", "eu"]}, None),
    ({"retired_from_epoch": 5}, None),
    ({"title": "Pages", "display": "series"}, None),
    ({"budget": None}, None),
    ({"budget": {"lifetime_eps": 1000.0}}, None),
    ({"budget": {"lifetime_eps": 50.0}}, None),
    ({"budget": {"window_eps": 10.0, "window_seconds": 86400}}, None),
    ({"budget": {"lifetime_eps": 100.0, "window_eps": 10.0, "window_seconds": 86400}}, None),
    ({}, {"lifetime_eps": 40.0}),
    ({"budget": {"lifetime_eps": 100.0, "window_eps": 10.0, "window_seconds": 86400}},
     {"window_eps": 10.0, "window_seconds": 86400}),
    ({"mechanism": "rfrag", "params": {"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3}}, None),
    ({"mechanism": "zsum", "params": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000}}, None),
    ({"mechanism": "nosuch", "params": {"k": 8, "eps": 3.0}}, None),
]  # fmt: skip
#: Pairs whose old terms are not the base channel (old change, new change).
TERMS_PAIRS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"budget": {"lifetime_eps": 100.0, "window_eps": 10.0, "window_seconds": 86400}},
     {"budget": {"lifetime_eps": 100.0, "window_eps": 10.0, "window_seconds": 3600}}),
    ({"budget": {"lifetime_eps": 100.0, "window_eps": 10.0, "window_seconds": 86400}},
     {"budget": {"lifetime_eps": 100.0, "window_eps": 20.0, "window_seconds": 86400}}),
    ({"budget": {"lifetime_eps": 100.0, "window_eps": 10.0, "window_seconds": 86400}},
     {"budget": {"lifetime_eps": 100.0}}),
    ({"mechanism": "zsum", "params": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000}},
     {"mechanism": "zsum", "params": {"d": 8, "eps": 0.5, "delta": 1e-6, "n": 3000}}),
    ({"mechanism": "zsum", "params": {"d": 8, "eps": 0.5, "delta": 1e-6, "n": 3000}},
     {"mechanism": "zsum", "params": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000}}),
    ({"mechanism": "rfrag", "params": {"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3}},
     {"mechanism": "rfrag", "params": {"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 4}}),
    ({"mechanism": "rfrag", "params": {"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3}},
     {"mechanism": "rfrag", "params": {"k": 8, "eps_b": 3.0, "eps_f": 0.5, "tau": 4}}),
    ({"mechanism": "ldp-sgd", "params": {"dim": 4, "eps": 2.0, "round": 1, "theta": "AA=="}},
     {"mechanism": "ldp-sgd", "params": {"dim": 4, "eps": 2.0, "round": 2, "theta": "AQ=="}}),
    ({"mechanism": "ldp-sgd", "params": {"dim": 4, "eps": 2.0}},
     {"mechanism": "ldp-sgd", "params": {"dim": 4, "eps": 2.0, "tau": 2}}),
    ({"mechanism": "longitudinal", "params": {"d": 4, "k": 2, "eps": 4.0}},
     {"mechanism": "longitudinal", "params": {"d": 4, "k": 3, "eps": 4.0}}),
    ({"mechanism": "nosuch", "params": {"k": 8}},
     {"mechanism": "nosuch", "params": {"k": 8.0}}),
    ({"mechanism": "nosuch", "params": {"k": 8}},
     {"mechanism": "nosuch", "params": {"k": 9}}),
]  # fmt: skip


def _terms(channel: dict[str, Any], device_budget: dict[str, Any] | None) -> ChannelTerms:
    budget = None if device_budget is None else DeviceBudget(**device_budget)
    return ChannelTerms.of(ChannelConfig(**channel), budget)


def terms_expectation(case: Mapping[str, Any]) -> dict[str, Any]:
    """What a device makes of ``new`` once it pinned ``old``: relaxations (field, old, new),
    and whether it pins ``new`` (as strong or stronger, and a term changed)."""
    old = _terms(case["old"], case["old_device_budget"])
    new = _terms(case["new"], case["new_device_budget"])
    found = relaxations(old, new)
    return {
        "relaxations": [jsonable([r.field, r.old, r.new]) for r in found],
        "repin": not found and bool(old.changed_terms(new)),
    }


def terms_cases() -> list[dict[str, Any]]:
    cases = []
    pairs = [({}, change, None, budget) for change, budget in TERMS_CHANGES]
    pairs += [(old, new, None, None) for old, new in TERMS_PAIRS]
    for old_change, new_change, old_budget, new_budget in pairs:
        case = {
            "old": {**BASE_CHANNEL, **old_change},
            "old_device_budget": old_budget,
            "new": {**BASE_CHANNEL, **new_change},
            "new_device_budget": new_budget,
        }
        cases.append({**case, **terms_expectation(case)})
    return cases


# --- signed documents and scenarios -----------------------------------------------------------


@dataclass
class Party:
    """A signer with the keys it rotated through (``keys[0]`` is the one a device pins)."""

    party: str
    keys: list[Ed25519PrivateKey]

    def chain(self, upto: int, start: int = T0) -> list[Succession]:
        """Successions from ``keys[0]`` to ``keys[upto]``, a second apart."""
        return [
            sign_succession(self.party, self.keys[i], self.keys[i + 1].public_key(), start + i)
            for i in range(upto)
        ]


ANALYZER = Party("analyzer", [signing_key(f"analyzer-{i}") for i in range(3)])
SHUFFLERS = {
    sid: Party(shuffler_party(sid), [signing_key(f"{sid}-{i}") for i in range(2)])
    for sid in ("s1", "s2", "s3")
}
ANALYZER_HPKE = hpke_key("analyzer-hpke")
SHUFFLER_HPKE = {sid: hpke_key(f"{sid}-hpke") for sid in SHUFFLERS}
BUDGET = {"lifetime_eps": 40.0}
CHANNELS: list[dict[str, Any]] = [
    {"id": "pages", "mechanism": "krr", "params": {"k": 4, "eps": 2.0}, "epoch_seconds": HOUR,
     "min_crowd": 20, "max_fragments": 1, "crowds": ["", "eu"],
     "budget": {"lifetime_eps": 12.0, "window_eps": 4.0, "window_seconds": 2 * HOUR}},
    {"id": "clicks", "mechanism": "krappor", "params": {"k": 8, "eps": 1.0},
     "epoch_seconds": HOUR, "max_fragments": 8, "delta": 1e-8},
    {"id": "rows", "mechanism": "rfrag", "params": {"k": 8, "eps_b": 3.0, "eps_f": 2.5, "tau": 3},
     "epoch_seconds": HOUR, "max_fragments": 24},
    {"id": "abroad", "mechanism": "longitudinal", "params": {"d": 1, "k": 1, "eps": 2.0},
     "epoch_seconds": HOUR, "max_fragments": 1, "display": "series"},
    {"id": "counts", "mechanism": "zsum", "params": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 3000},
     "epoch_seconds": HOUR, "max_fragments": 9},
    {"id": "sgd", "mechanism": "ldp-sgd", "params": {"dim": 4, "eps": 2.0, "round": 0,
     "theta": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}, "epoch_seconds": HOUR},
]  # fmt: skip


def descriptor(
    sid: str,
    *,
    signer: int = 0,
    issued: int = T0,
    lifetime: int = 30 * 86400,
    url: str | None = None,
    signed_by: Ed25519PrivateKey | None = None,
    names_key: Ed25519PrivateKey | None = None,
    successions: list[Succession] | None = None,
) -> dict[str, Any]:
    """Shuffler ``sid``'s own signed descriptor (as JSON), by its key number ``signer`` with
    the successions that lead there (``signed_by``/``names_key``: a forgery's signer and the
    key it names)."""
    party = SHUFFLERS[sid]
    key = party.keys[signer]
    hpke = SHUFFLER_HPKE[sid]
    body = ShufflerDescriptor(
        id=sid,
        url=url or f"http://127.0.0.1:9/{sid}",
        keys=[HpkeKey(key_id=key_id(hpke.public_key()).hex(), public_key=pub(hpke))],
        signing_key=pub(names_key or signed_by or key),
        issued_at=issued,
        expires_at=issued + lifetime,
    )
    chain = party.chain(signer) if successions is None else successions
    return sign_descriptor(body, signed_by or key, chain).model_dump(mode="json")


def config_document(
    *,
    issued: int = T0,
    lifetime: int = 30 * 86400,
    signer: int = 0,
    successions: list[Succession] | None = None,
    shufflers: list[dict[str, Any]] | None = None,
    channels: list[dict[str, Any]] | None = None,
    device_budget: dict[str, Any] | None = BUDGET,
    signed_by: Ed25519PrivateKey | None = None,
    tamper: Callable[[dict[str, Any]], None] | None = None,
    resign: bool = False,
) -> str:
    """A signed collection config as the analyzer serves it (pydantic's JSON, whose float
    text differs from the canonical form the signature covers); ``tamper`` changes the
    document after signing, and ``resign`` signs what it made (a malformed config the
    analyzer's own key vouches for)."""
    key = ANALYZER.keys[signer]
    config = CollectionConfig(
        revision=1,
        issued_at=issued,
        expires_at=issued + lifetime,
        analyzer=AnalyzerInfo(
            url="http://127.0.0.1:9",
            keys=[HpkeKey(key_id=key_id(ANALYZER_HPKE.public_key()).hex(),
                          public_key=pub(ANALYZER_HPKE))],
            signing_key=pub(key),
        ),
        shufflers=shufflers if shufflers is not None else [descriptor("s1"), descriptor("s2")],
        channels=[ChannelConfig(**c) for c in (CHANNELS if channels is None else channels)],
        device_budget=None if device_budget is None else DeviceBudget(**device_budget),
    )  # fmt: skip
    chain = ANALYZER.chain(signer) if successions is None else successions
    signed = sign_config(config, signed_by or key, chain)
    if tamper is None:
        return signed.model_dump_json()
    document = signed.model_dump(mode="json")
    tamper(document)
    if resign:
        document["signature"] = b64((signed_by or key).sign(canonical(document["config"])))
    return json.dumps(document)


def _channels(**changes: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario channels with some changed by id."""
    return [{**c, **changes.get(c["id"], {})} for c in CHANNELS]


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def tamper(document: dict[str, Any]) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return tamper


def trust(shufflers: tuple[str, ...] = ("s1", "s2")) -> dict[str, Any]:
    return {
        "analyzer": pub(ANALYZER.keys[0]),
        "shufflers": {s: pub(SHUFFLERS[s].keys[0]) for s in shufflers},
    }


def report(channel: str, value: Any, at: int, **extra: Any) -> dict[str, Any]:
    kind = "longitudinal" if isinstance(value, dict) else "histogram"
    return {"do": "report", "kind": kind, "channel": channel, "value": value, "at": at, **extra}


def config_step(document: str, at: int) -> dict[str, Any]:
    return {"do": "config", "document": document, "at": at}


def _honest_steps() -> list[dict[str, Any]]:
    """A device's life under one analyzer: reports charged, refused and retried; stronger
    configs pinned, a relaxing one refused for its channel, replays and forgeries refused."""
    t = T0 + 10
    stronger = _channels(pages={"params": {"k": 4, "eps": 1.5}})
    relaxed = _channels(pages={"params": {"k": 4, "eps": 3.0}})
    return [
        config_step(config_document(issued=T0), t),
        report("pages", 1, t),
        report("pages", 2, t),
        report("pages", 2, t, crowd="eu"),
        report("pages", 4, t + HOUR),
        report("pages", True, t + 2 * HOUR),
        report("pages", 1, t + 3 * HOUR, crowd="us"),
        report("clicks", 9, t),
        report("clicks", 3, t),
        report("clicks", 3.5, t + HOUR),
        report("rows", 5, t),
        report("rows", 6, t + HOUR),
        report("counts", 7, t),
        report("abroad", {"period": 1, "changed": True}, t),
        report("abroad", {"period": 1, "changed": False}, t + HOUR),
        report("abroad", {"period": 2, "changed": False}, t + 2 * HOUR),
        report("abroad", 1, t + 3 * HOUR),
        report("clicks", {"period": 1, "changed": True}, t + 4 * HOUR),
        report("nope", 1, t),
        config_step(config_document(issued=T0 + 100, channels=stronger), t + 100),
        report("pages", 1, t + 4 * HOUR),
        config_step(config_document(issued=T0), t + 200),
        config_step(config_document(issued=T0 + 300, channels=relaxed), t + 300),
        report("pages", 1, t + 5 * HOUR),
        report("clicks", 1, t + 5 * HOUR),
        config_step(config_document(issued=T0 + 400, channels=stronger), t + 400),
        report("pages", 1, t + 6 * HOUR),
        config_step(config_document(issued=T0 + 500, channels=_channels(
            pages={"params": {"k": 4, "eps": 1.5}, "retired_from_epoch": 0})), t + 500),
        report("pages", 1, t + 7 * HOUR),
        config_step(config_document(issued=T0 + 600, lifetime=10), t + 700),
        config_step(config_document(issued=T0 + 800, tamper=_set(
            ["config", "channels", 0, "params", "eps"], 1.0)), t + 800),
        config_step(config_document(issued=T0 + 900, lifetime=-1), t + 900),
    ]  # fmt: skip


def _clock_steps() -> list[dict[str, Any]]:
    """Documents issued in the future are taken, but remembered no later than now + 300 s, so
    an honest document issued after that is not locked out; one issued before is a replay."""
    t = T0 + 10_000
    return [
        config_step(config_document(issued=T0), t),
        config_step(config_document(issued=t + 50_000), t + 10),
        config_step(config_document(issued=t + 200), t + 20),
        config_step(config_document(issued=t + 320), t + 30),
        config_step(config_document(issued=t + 320, shufflers=[
            descriptor("s1", issued=t + 40_000), descriptor("s2")]), t + 40),
        config_step(config_document(issued=t + 330, shufflers=[
            descriptor("s1", issued=t + 100), descriptor("s2")]), t + 50),
        config_step(config_document(issued=t + 340, shufflers=[
            descriptor("s1", issued=t + 400), descriptor("s2")]), t + 60),
    ]  # fmt: skip


def _shuffler_steps() -> list[dict[str, Any]]:
    """What the analyzer cannot do to shufflers: substitute one, alter its descriptor (its
    URL, its key), list an unpinned one or one twice, or leave a pinned one out."""
    t = T0 + 10
    forged = SHUFFLERS["s1"].keys[0]
    s1, s2, s3 = descriptor("s1"), descriptor("s2"), descriptor("s3")

    def listing(*documents: dict[str, Any]) -> dict[str, Any]:
        return config_step(config_document(shufflers=list(documents)), t)

    def tampered(path: list[Any], value: Any) -> dict[str, Any]:
        return config_step(config_document(tamper=_set(["config", "shufflers", *path], value)), t)

    return [
        listing(s1, descriptor("s2", signed_by=forged)),
        listing(s1, descriptor("s2", signed_by=ANALYZER.keys[0])),
        tampered([1, "descriptor", "url"], "http://evil.example"),
        tampered([0, "descriptor", "keys", 0, "public_key"], pub(ANALYZER_HPKE)),
        listing(descriptor("s1", names_key=SHUFFLERS["s2"].keys[0]), s2),
        listing(s1),
        listing(s1, s2, s3),
        config_step(config_document(shufflers=[descriptor("s1"), descriptor("s1")]), t),
        config_step(config_document(shufflers=[]), t),
        config_step(config_document(shufflers=[descriptor("s1"), descriptor("s2", lifetime=5)]), t),
        config_step(config_document(signed_by=SHUFFLERS["s1"].keys[0]), t),
        config_step(config_document(tamper=_set(["signature"], "not base64!")), t),
        config_step(config_document(tamper=lambda d: d.pop("signature")), t),
        config_step(config_document(tamper=_set(["config", "version"], 1)), t),
        config_step(config_document(), t),
        report("rows", 1, t),
    ]  # fmt: skip


def _rotation_steps() -> list[dict[str, Any]]:
    """Signing keys handed over by successions: followed, and the pins moved with them; a
    fork from a key the device moved away from, a forged or broken chain, refused."""
    t = T0 + 10
    a, s1 = ANALYZER, SHUFFLERS["s1"]
    forged = [sign_succession("analyzer", a.keys[1], a.keys[1].public_key(), T0)]
    bad_link = a.chain(1)[0].model_copy(update={"signature": a.chain(1)[0].signature[:-4] + "AAA="})
    other_party = [sign_succession("shuffler/s1", a.keys[0], a.keys[1].public_key(), T0)]
    backwards = [
        sign_succession("analyzer", a.keys[0], a.keys[1].public_key(), T0 + 5),
        sign_succession("analyzer", a.keys[1], a.keys[2].public_key(), T0 + 1),
    ]
    return [
        config_step(config_document(issued=T0), t),
        config_step(config_document(issued=T0 + 1, signer=1, successions=forged), t),
        config_step(config_document(issued=T0 + 1, signer=1, successions=[bad_link]), t),
        config_step(config_document(issued=T0 + 1, signer=1, successions=other_party), t),
        config_step(config_document(issued=T0 + 1, signer=2, successions=backwards), t),
        config_step(config_document(issued=T0 + 1, signer=1, successions=[]), t),
        config_step(config_document(issued=T0 + 2, signer=1, shufflers=[
            descriptor("s1", signer=1, issued=T0 + 2), descriptor("s2")]), t + 10),
        config_step(config_document(issued=T0 + 3, signer=0), t + 20),
        config_step(config_document(issued=T0 + 4, signer=1, shufflers=[
            descriptor("s1", signer=1, issued=T0 + 4), descriptor("s2")]), t + 30),
        config_step(config_document(issued=T0 + 5, signer=1, shufflers=[
            descriptor("s1", issued=T0 + 5), descriptor("s2")]), t + 40),
        config_step(config_document(issued=T0 + 6, signer=2, shufflers=[
            descriptor("s1", signer=1, issued=T0 + 6, successions=s1.chain(1)), descriptor("s2")]),
            t + 50),
        config_step(config_document(issued=T0 + 7, signer=2, successions=a.chain(2)[1:]), t + 60),
        report("clicks", 2, t + 60),
    ]  # fmt: skip


def _budget_steps() -> list[dict[str, Any]]:
    """The channel's lifetime and rolling-window budgets and the config's device budget, by
    basic composition of each report's replacement ε."""
    t = T0 + 10
    lower, higher = {"lifetime_eps": 7.0}, {"lifetime_eps": 12.0}
    return [
        config_step(config_document(issued=T0, device_budget={"lifetime_eps": 9.0}), t),
        *(report("pages", 0, t + i * HOUR) for i in range(4)),
        report("clicks", 0, t + 4 * HOUR),
        report("clicks", 0, t + 5 * HOUR),
        report("clicks", 0, t + 6 * HOUR),
        report("rows", 0, t + 7 * HOUR),
        config_step(config_document(issued=T0 + 1, device_budget=lower), t + 7 * HOUR),
        report("clicks", 0, t + 8 * HOUR),
        config_step(config_document(issued=T0 + 2, device_budget=higher), t + 8 * HOUR),
        report("clicks", 0, t + 9 * HOUR),
        config_step(config_document(issued=T0 + 3, device_budget=None), t + 9 * HOUR),
        report("counts", 0, t + 9 * HOUR),
    ]  # fmt: skip


def scenarios() -> list[dict[str, Any]]:
    """Scenarios: trust, options and the steps a device takes (expectations filled by
    :func:`run_scenario`)."""
    t = T0 + 10
    plain = {"every_shuffler": True, "caps": None, "crowd": None}
    found = [
        {"name": "honest lifecycle", "trust": trust(), "options": plain, "steps": _honest_steps()},
        {"name": "clock skew", "trust": trust(), "options": plain, "steps": _clock_steps()},
        {"name": "shufflers", "trust": trust(), "options": plain, "steps": _shuffler_steps()},
        {"name": "rotation", "trust": trust(), "options": plain, "steps": _rotation_steps()},
        {"name": "budgets", "trust": trust(), "options": plain, "steps": _budget_steps()},
        {
            "name": "some shufflers",
            "trust": trust(("s1", "s2", "s3")),
            "options": {**plain, "every_shuffler": False, "crowd": "eu"},
            "steps": [
                config_step(config_document(shufflers=[descriptor("s2"), descriptor("s3")]), t),
                report("pages", 3, t),
                report("clicks", 3, t),
                report("rows", 3, t),
            ],
        },
        {
            "name": "caps",
            "trust": trust(),
            "options": {
                **plain,
                "caps": {
                    "local_eps": 3.0,
                    "channel_local_eps": {"clicks": 1.5, "rows": 100.0},
                    "lifetime_eps": 13.0,
                },
            },
            "steps": [
                config_step(config_document(), t),
                report("pages", 1, t),
                report("clicks", 1, t),
                report("counts", 1, t),
                *(report("rows", 1, t + i * HOUR) for i in range(3)),
                config_step(
                    config_document(
                        issued=T0 + 1,
                        channels=_channels(
                            pages={"params": {"k": 4, "eps": 1.0}},
                            clicks={"params": {"k": 8, "eps": 0.5}},
                        ),
                    ),
                    t + 3 * HOUR,
                ),
                report("clicks", 1, t + 3 * HOUR),
                report("pages", 1, t + 4 * HOUR),
            ],
        },
        {
            "name": "first contact refused",
            "trust": trust(),
            "options": plain,
            "steps": [
                config_step(config_document(issued=T0, lifetime=5), t),
                config_step(
                    config_document(
                        issued=T0 + 100, tamper=_set(["config", "channels", 1, "params", "k"], 9)
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 100,
                        resign=True,
                        tamper=_set(["config", "channels", 1, "unknown"], 9),
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 100,
                        resign=True,
                        tamper=_set(["config", "analyzer", "keys", 0, "public_key"], "AAAA"),
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 100,
                        resign=True,
                        tamper=_set(["config", "channels", 0, "epoch_seconds"], 0),
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 100,
                        resign=True,
                        tamper=_set(["config", "shufflers", 0, "descriptor", "extra"], 1),
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 100,
                        resign=True,
                        tamper=_set(["config", "issued_at"], "1900000100"),
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 200,
                        resign=True,
                        tamper=_set(["config", "extra"], {"ignored": True}),
                    ),
                    t,
                ),
                config_step(
                    config_document(
                        issued=T0 + 300,
                        resign=True,
                        tamper=_set(["config", "channels", 1, "params", "k"], 1),
                    ),
                    t,
                ),
                report("clicks", 0, t),
                report("pages", 0, t),
                config_step(
                    config_document(
                        issued=T0 + 400,
                        resign=True,
                        tamper=_set(["config", "channels", 0, "epoch_seconds"], 3600.0),
                    ),
                    t,
                ),
                report("pages", 0, t + HOUR),
            ],
        },
    ]
    return found


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


@contextmanager
def _quiet() -> Iterator[None]:
    import logging

    logger = logging.getLogger("esa.client")
    before = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(before)


def _refused(client: Client) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for channel, error in sorted(client._refused.items()):
        entry: dict[str, Any] = {"error": type(error).__name__}
        for name in ("field", "old", "new", "cap", "value"):
            if hasattr(error, name):
                entry[name] = jsonable(getattr(error, name))
        out[channel] = entry
    return out


def _accepted(client: Client, roots: Mapping[str, str]) -> dict[str, Any]:
    pinned = client.state.pinned_terms()
    return {
        "ok": True,
        "refused": _refused(client),
        "seen": dict(sorted(client.state.seen().items())),
        "pins": dict(sorted(client.state.pins(roots).items())),
        "pinned": {c: jsonable(t.model_dump(mode="json")) for c, t in sorted(pinned.items())},
        "shufflers": [s.id for s in client._shufflers],
        "expires_at": client._config.expires_at,
    }


def _caps(options: Mapping[str, Any]) -> PrivacyCaps | None:
    caps = options.get("caps")
    return None if caps is None else PrivacyCaps(**caps)


def _report(client: Client, step: Mapping[str, Any]) -> dict[str, Any]:
    try:
        if step["kind"] == "longitudinal":
            value = step["value"]
            reporter = client.longitudinal(step["channel"], step.get("crowd"))
            reporter.update(value["period"], value["changed"])
        else:
            client.histogram(step["channel"], step.get("crowd")).report(step["value"])
        outcome: dict[str, Any] = {"ok": True}
    except EsaError as error:
        outcome = {"error": type(error).__name__}
    outcome["spent"] = client.budget_spent(step["channel"])
    outcome["spent_all"] = client.budget_spent()
    outcome["outbox"] = client.state.outbox_size()
    return outcome


def run_scenario(scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each step's outcome through a real Python client (a config file re-read at each config
    step, a state file kept across them)."""
    outcomes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder, _quiet():
        tmp = Path(folder)
        (tmp / "trust.json").write_text(json.dumps(scenario["trust"]))
        roots = TrustAnchors.from_json(scenario["trust"]).roots()
        clock, client = Clock(), None
        options = scenario["options"]
        try:
            for step in scenario["steps"]:
                clock.now = float(step["at"])
                if step["do"] == "report":
                    if client is None:
                        raise AssertionError("a report before any config was accepted")
                    outcomes.append(_report(client, step))
                    continue
                (tmp / "config.json").write_text(step["document"])
                try:
                    if client is None:
                        client = Client(
                            config_file=tmp / "config.json",
                            trust_file=tmp / "trust.json",
                            state_path=tmp / "state.sqlite",
                            background=False,
                            clock=clock,
                            every_shuffler=options["every_shuffler"],
                            caps=_caps(options),
                            crowd=options["crowd"],
                        )
                    else:
                        client.refresh_config()
                    outcomes.append(_accepted(client, roots))
                except EsaError as error:
                    outcomes.append({"error": type(error).__name__})
        finally:
            if client is not None:
                client.close()
    return outcomes


def scenario_cases() -> list[dict[str, Any]]:
    out = []
    for scenario in scenarios():
        outcomes = run_scenario(scenario)
        steps = [
            {**step, "expect": outcome}
            for step, outcome in zip(scenario["steps"], outcomes, strict=True)
        ]
        out.append({**scenario, "steps": steps})
    return out


def scenario_keys() -> dict[str, Any]:
    """The scenarios' HPKE keys, private ones too (test keys: tests open what a client sealed)."""
    keys = {"analyzer": ANALYZER_HPKE, **SHUFFLER_HPKE}
    return {name: {"private": raw_private(k), "public": pub(k)} for name, k in keys.items()}


# --- the file ---------------------------------------------------------------------------------


def build() -> dict[str, Any]:
    """Every vector, with what Python makes of it."""
    return {
        "about": "made by sdk-js/vectors/make_vectors.py from the Python SDK; do not edit",
        "t0": T0,
        "canonical": canonical_cases(),
        "info": info_cases(),
        "outer_info": outer_cases(),
        "key_ids": key_id_cases(),
        "padding": pad_cases(),
        "contributions": contribution_cases(),
        "sealed": sealed_cases(),
        "local_privacy": local_cases(),
        "tapes": tape_cases(),
        "terms": terms_cases(),
        "scenarios": scenario_cases(),
        "scenario_keys": scenario_keys(),
    }


def _same(section: str, found: list[Any], expected: list[Any]) -> list[str]:
    if len(found) != len(expected):
        return [f"{section}: {len(found)} cases in the file, Python makes {len(expected)}"]
    return [
        f"{section}[{i}]: the file says {a!r:.300}, Python says {b!r:.300}"
        for i, (a, b) in enumerate(zip(found, expected, strict=True))
        if a != b
    ]


def check(vectors: Mapping[str, Any]) -> list[str]:
    """Every expectation of ``vectors`` that Python no longer computes from its inputs."""
    problems: list[str] = []
    problems += _same(
        "canonical",
        [c["canonical"] for c in vectors["canonical"]],
        [canonical(json.loads(c["text"])).decode() for c in vectors["canonical"]],
    )
    problems += _same(
        "info",
        vectors["info"],
        [_info(c["channel"], c["epoch"], c["crowd"]) for c in vectors["info"]],
    )
    problems += _same(
        "outer_info",
        vectors["outer_info"],
        [
            {"shuffler": c["shuffler"], "info": outer_info(c["shuffler"]).hex()}
            for c in vectors["outer_info"]
        ],
    )
    problems += _same(
        "key_ids", vectors["key_ids"], [_key_id(c["public"]) for c in vectors["key_ids"]]
    )
    problems += _same(
        "padding", vectors["padding"], [_pad(c["data"], c["size"]) for c in vectors["padding"]]
    )
    inputs = [
        {k: v for k, v in c.items() if k not in ("encoded", "error")}
        for c in vectors["contributions"]
    ]
    problems += _same("contributions", vectors["contributions"], [_contribution(c) for c in inputs])
    problems += [
        f"sealed[{i}] does not open" for i, c in enumerate(vectors["sealed"]) if not check_sealed(c)
    ]
    problems += _same(
        "local_privacy",
        [c["local"] for c in vectors["local_privacy"]],
        [local_privacy(c["mechanism"], c["params"]) for c in vectors["local_privacy"]],
    )
    problems += [
        f"tapes[{i}] replays differently"
        for i, c in enumerate(vectors["tapes"])
        if not check_tape(c)
    ]
    problems += _same(
        "terms",
        [{k: c[k] for k in ("relaxations", "repin")} for c in vectors["terms"]],
        [terms_expectation(c) for c in vectors["terms"]],
    )
    if vectors["scenario_keys"] != scenario_keys():
        problems.append("scenario_keys: not the keys the scenarios are signed with")
    for scenario in vectors["scenarios"]:
        outcomes = run_scenario(scenario)
        problems += _same(
            f"scenario {scenario['name']!r}", [s["expect"] for s in scenario["steps"]], outcomes
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check wire.json, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(json.loads(OUTPUT.read_text()))
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    vectors = build()
    text = json.dumps(vectors, indent=1, ensure_ascii=False) + "\n"
    problems = check(json.loads(text))
    if problems:
        print("\n".join(problems))
        return 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
