"""LDP mechanisms: one module per mechanism (MECHANISMS.md).

Each module owns its parameters (frozen, validated), ``encode`` (fixed-size fragments with the
documented byte layout, OS CSPRNG by default), device state where the mechanism has one, the
accumulator, ``estimate``, ``local_privacy``, ``central`` (through :mod:`common.accounting`) and
``simulate_aggregate`` (vectorized sampling of the accumulator for paper-scale experiments).
"""

from common.mechanisms import krappor, krr, longitudinal, rfrag, zsum
from common.mechanisms._base import LocalPrivacy
from common.mechanisms._estimates import CountAccumulator, Estimate
from common.mechanisms._random import RandomSource, SeededSource, SystemSource, default_source
from common.mechanisms._wire import WIRE_VERSION, FragmentError

MODULES = {m.NAME: m for m in (krappor, rfrag, longitudinal, zsum, krr)}
#: Each mechanism's frozen parameter class, by mechanism name.
PARAMS = {
    "krappor": krappor.KRapporParams,
    "rfrag": rfrag.RFragParams,
    "longitudinal": longitudinal.LongitudinalParams,
    "zsum": zsum.ZSumParams,
    "krr": krr.KRRParams,
}

__all__ = [
    "MODULES",
    "PARAMS",
    "WIRE_VERSION",
    "CountAccumulator",
    "Estimate",
    "FragmentError",
    "LocalPrivacy",
    "RandomSource",
    "SeededSource",
    "SystemSource",
    "default_source",
    "krappor",
    "krr",
    "longitudinal",
    "rfrag",
    "zsum",
]
