"""LDP mechanisms: one module per mechanism behind one interface (MECHANISMS.md).

Each module owns its parameters (frozen, validated), ``encode`` (fixed-size fragments with the
documented byte layout, OS CSPRNG by default), device state where the mechanism has one, the
accumulator, ``estimate``, ``local_privacy``, ``privacy`` (the typed description
:mod:`common.accounting` certifies) and
``simulate_aggregate`` (vectorized sampling of the accumulator for paper-scale experiments),
and one class implementing :class:`common.mechanisms.base.Mechanism`, registered below.
"""

from typing import Any

from common.mechanisms import krappor, krr, ldpsgd, longitudinal, rfrag, zsum
from common.mechanisms._estimates import CountAccumulator, Estimate
from common.mechanisms._wire import WIRE_VERSION, FragmentError
from common.mechanisms.base import (
    BatchContext,
    Encoded,
    FragmentCount,
    LocalPrivacy,
    Mechanism,
    MechanismError,
    NoDataError,
    PrivacyDescription,
    Received,
    ReleaseCertificate,
    StaleUpdateError,
    StateConflictError,
    StateUpdate,
    ValueKind,
)
from common.mechanisms.registry import UnknownMechanismError, get, names, register
from common.randomness import RandomSource, SeededSource, SystemSource, default_source

#: The built-in mechanisms: a new one is its module plus one entry here.
BUILT_IN: tuple[Mechanism[Any, Any], ...] = (
    krappor.KRappor(),
    rfrag.RFrag(),
    longitudinal.Longitudinal(),
    zsum.ZSum(),
    krr.KRR(),
    ldpsgd.LdpSgd(),
)
for _builtin in BUILT_IN:
    register(_builtin)

__all__ = [
    "WIRE_VERSION",
    "BatchContext",
    "CountAccumulator",
    "Encoded",
    "Estimate",
    "FragmentCount",
    "FragmentError",
    "LocalPrivacy",
    "Mechanism",
    "MechanismError",
    "NoDataError",
    "PrivacyDescription",
    "RandomSource",
    "Received",
    "ReleaseCertificate",
    "SeededSource",
    "StaleUpdateError",
    "StateConflictError",
    "StateUpdate",
    "SystemSource",
    "UnknownMechanismError",
    "ValueKind",
    "default_source",
    "get",
    "krappor",
    "krr",
    "longitudinal",
    "names",
    "register",
    "rfrag",
    "zsum",
]
