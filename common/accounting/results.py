"""Immutable result objects and the method ids (docs/accounting.md, "Method ids").

A bound is a value, not a float: every function in :mod:`common.accounting` returns a
:class:`BoundResult` that carries the ε, the δ it holds for, which theorem produced it, the
neighbouring notion, its inputs, whether the inputs are inside the theorem's stated regime,
and a human-readable note.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

Neighbouring = Literal["removal", "replacement", "add-remove"]
BoundKind = Literal["upper", "lower"]
InputValue = float | int | str


#: What a bound id names: a shuffled upper bound (a certificate may rest on it), a local bound,
#: or a lower bound (shown for honesty, never certified).
MethodKind = Literal["shuffled", "local", "lower"]


class Method(str):
    """The id of an accounting bound, a theorem or a computation (``"fmt21-closed"``), as
    results, the CLI and the analyzer's privacy ledger show it.

    Each id is declared once, by the module that implements its bound (:meth:`declare`), with
    what it cites: the set is open, so a plug-in's own bound declares its own id, and tools list
    the ids declared (:meth:`declared`) instead of keeping a list.
    """

    __slots__ = ()
    _declared: ClassVar[dict[str, tuple[str, MethodKind]]] = {}

    @classmethod
    def declare(cls, value: str, cites: str, kind: MethodKind = "shuffled") -> Method:
        """Declare the bound id ``value`` (what ``cites`` names).

        Raises:
            ValueError: ``value`` is declared already (two bounds cannot share an id).
        """
        if value in cls._declared:
            raise ValueError(f"bound id {value!r} is declared twice")
        cls._declared[value] = (cites, kind)
        return cls(value)

    @classmethod
    def parse(cls, value: str) -> Method:
        """The declared id ``value``.

        Raises:
            ValueError: no bound declares it (naming the known ones).
        """
        if value not in cls._declared:
            raise ValueError(f"unknown method {value!r}; known: {', '.join(cls._declared)}")
        return cls(value)

    @classmethod
    def declared(cls, kind: MethodKind | None = None) -> list[Method]:
        """The ids declared so far (of ``kind``), in declaration order."""
        return [cls(v) for v, (_, k) in cls._declared.items() if kind is None or k == kind]

    @property
    def cites(self) -> str:
        """What the bound's id names (a paper's theorem or equation, or a computation)."""
        return self._declared[self][0]


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
