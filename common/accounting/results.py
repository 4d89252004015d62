"""Immutable result objects and the method ids (docs/accounting.md, "Method ids").

A bound is a value, not a float: every function in :mod:`common.accounting` returns a
:class:`BoundResult` that carries the ε, the δ it holds for, which theorem produced it, the
neighbouring notion, its inputs, whether the inputs are inside the theorem's stated regime,
and a human-readable note.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal

Neighbouring = Literal["removal", "replacement", "add-remove"]
BoundKind = Literal["upper", "lower"]
InputValue = float | int | str


class Method(StrEnum):
    """Method ids used in results, the CLI and the analyzer's privacy ledger."""

    EFMRTT19_THM7 = "efmrtt19-thm7"
    FMT21_CLOSED = "fmt21-closed"
    FMT21_THM38 = "fmt21-thm38"
    FMT21_CLONES = "fmt21-clones"
    BLANKET_BINARY_RR = "blanket-binary-rr"
    CHEU_LEMMA_II6 = "cheu-lemma-ii6"
    ESA_THM_III1 = "esa-thm-iii1"
    FMT21_KRR_COR42 = "fmt21-krr-cor42"
    BLANKET_KRR = "blanket-krr"
    BALCER_CHEU_THM12 = "balcer-cheu-thm12"
    ESA_THM_IV1 = "esa-thm-iv1"
    ESA_THM_IV2 = "esa-thm-iv2"
    RFRAG_PER_BATCH = "rfrag-per-batch"
    LOWER_2RR = "lower-2rr"
    LOCAL = "local"


@dataclass(frozen=True, slots=True)
class BoundResult:
    """One privacy statement: the output is (``eps``, ``delta``)-DP under ``neighbouring``.

    Attributes:
        eps: The privacy-loss bound; for ``kind == "upper"`` a rigorous upper bound whenever
            ``valid_regime`` (else the trivial local bound, and ``note`` says why).
        method: Which theorem or computation produced it (:class:`Method`).
        neighbouring: ``"removal"``, ``"replacement"`` or ``"add-remove"`` (docs/accounting.md,
            "Neighbouring notions").
        inputs: The inputs as ``(name, value)`` pairs, in call order.
        kind: ``"upper"`` for certificates, ``"lower"`` for lower bounds shown for honesty
            (never certified).
    """

    eps: float
    delta: float
    method: Method
    neighbouring: Neighbouring
    inputs: tuple[tuple[str, InputValue], ...] = field(default=())
    valid_regime: bool = True
    note: str = ""
    kind: BoundKind = "upper"

    @property
    def certifiable(self) -> bool:
        """True if this result may be used as a certificate (a valid upper bound)."""
        return self.kind == "upper" and self.valid_regime

    def with_note(self, note: str) -> BoundResult:
        """Return a copy whose note is ``note`` appended to the current one."""
        joined = f"{self.note}; {note}" if self.note else note
        return replace(self, note=joined)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dictionary (used by ``--json`` and the analyzer's ledger)."""
        return {
            "method": str(self.method),
            "eps": self.eps,
            "delta": self.delta,
            "neighbouring": self.neighbouring,
            "valid_regime": self.valid_regime,
            "kind": self.kind,
            "note": self.note,
            "inputs": dict(self.inputs),
        }
