"""The wire vectors the TypeScript SDK is tested against (sdk-js/vectors/wire.json) still say
what the Python SDK does: every expectation in the file is recomputed here from its inputs
with this repository's code (canonical JSON, HPKE ``info``, padding and layouts, blobs that
open, local ε, encodings replayed from recorded draws, pinned-terms rules, and scenarios run
through a real :class:`encoder_client.Client`). A change of behaviour here fails this test
until the file is made again (``sdk-js/vectors/make_vectors.py``), which then holds the
TypeScript SDK to it (``npm test`` in sdk-js/)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

VECTORS = Path(__file__).resolve().parents[2] / "sdk-js" / "vectors"


def _make_vectors() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_vectors", module)
    spec.loader.exec_module(module)
    return module


def test_every_vector_is_what_the_python_sdk_computes() -> None:
    vectors = json.loads((VECTORS / "wire.json").read_text())
    assert _make_vectors().check(vectors) == []


def test_the_vectors_cover_every_section_and_outcome() -> None:
    """The file exercises what the TypeScript SDK must get right: each section non-empty,
    and the scenarios reach each refusal a device makes."""
    vectors = json.loads((VECTORS / "wire.json").read_text())
    sections = ("canonical", "info", "padding", "contributions", "sealed", "local_privacy",
                "tapes", "terms", "scenarios")  # fmt: skip
    assert all(vectors[name] for name in sections)
    outcomes = {
        step["expect"].get("error", "ok")
        for scenario in vectors["scenarios"]
        for step in scenario["steps"]
    }
    assert outcomes >= {
        "ok", "ConfigError", "AlreadyReportedError", "ValueOutOfDomainError", "ChannelError",
        "UnknownCrowdError", "BudgetExceededError", "PrivacyRelaxedError", "PrivacyCapError",
        "ChannelRetiredError",
    }  # fmt: skip
    mechanisms = {tape["mechanism"] for tape in vectors["tapes"]}
    assert mechanisms == {"krappor", "krr", "rfrag", "longitudinal", "zsum"}
