"""A plug-in for ``esa account``'s tests (loaded by ``ESA_MECHANISM_MODULES``): a mechanism whose
privacy description declares a flag of its own, and a bound id of its own, that no list in the
CLI names.

It is k-ary randomized response under another name and wire code, whose description takes the
alphabet size from ``--alphabet`` (not ``--k``) and offers the built-in k-RR bounds plus the
trivial local one under its own id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.accounting import BoundResult, KaryRR
from common.accounting.randomizers import LocalRandomizer, MethodSpec, flag
from common.accounting.results import Method, Neighbouring
from common.mechanisms.krr import KRR
from common.mechanisms.registry import register

PLUGIN_BOUND = Method.declare("plugin-local", "the plug-in's own bound: its local ε")


@dataclass(frozen=True)
class PluginKaryRR(LocalRandomizer):
    """k-RR with the alphabet from ``--alphabet``: the built-in k-RR bounds and its own."""

    kind: ClassVar[str] = "plugin-k-rr"
    natural: ClassVar[Neighbouring] = "replacement"
    alphabet: int = flag("the plug-in's alphabet size")

    def methods(self) -> tuple[MethodSpec, ...]:
        def local(eps0: float, n: int, delta: float) -> BoundResult:
            return BoundResult(eps0, delta, PLUGIN_BOUND, "replacement", (("eps0", eps0),))

        return (*KaryRR(k=self.alphabet).methods(), MethodSpec(PLUGIN_BOUND, local))


class PluginKRR(KRR):
    """k-RR registered under the plug-in's name and code."""

    name = "plugin-krr"
    code = 250
    randomizer_type = PluginKaryRR


register(PluginKRR())
