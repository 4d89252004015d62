"""LDP mechanisms: one module per mechanism behind one interface (docs/mechanisms.md).

Each mechanism has a device facet in :mod:`common.mechanisms.device` (its parameters, frozen
and validated; ``encode``, fixed-size fragments with the documented byte layout, OS CSPRNG by
default; the device state where it has one; ``fragment_count``; ``local_privacy``) and a module
here that completes it for the analyzer and accounting (the accumulator, ``estimate``,
``privacy``, the typed description :mod:`common.accounting` certifies, ``certify``, and
``simulate_aggregate``, vectorized sampling of the accumulator for paper-scale experiments):
one class implementing :class:`common.mechanisms.base.Mechanism`, registered below.

Callers hold a channel's mechanism with its parameters bound, parsed once: :func:`build`
(:class:`BoundMechanism`, for the analyzer and the tools) or :func:`build_device`
(:class:`BoundDevice`, for devices); no method of those takes parameters.

Importing this package loads the device side only: the analyzer's and accounting's names
(:class:`Mechanism`, :class:`Estimate`, the mechanism modules...) load on first use (PEP 562),
so ``import encoder_client`` stays free of numpy, scipy and dp_accounting (docs/sdk.md, "What
importing costs").
"""

import importlib
from typing import TYPE_CHECKING, Any

from common.mechanisms._wire import WIRE_VERSION, FragmentError
from common.mechanisms.device import (
    BatchContext,
    BoundDevice,
    DeviceMechanism,
    Encoded,
    FragmentCount,
    LocalPrivacy,
    MechanismError,
    StaleUpdateError,
    StateConflictError,
    StateUpdate,
    ValueKind,
)
from common.mechanisms.device.krappor import KRapporDevice
from common.mechanisms.device.krr import KRRDevice
from common.mechanisms.device.ldpsgd import LdpSgdDevice
from common.mechanisms.device.longitudinal import LongitudinalDevice
from common.mechanisms.device.rfrag import RFragDevice
from common.mechanisms.device.zsum import ZSumDevice
from common.mechanisms.registry import (
    ChannelSpec,
    UnknownMechanismError,
    build,
    build_device,
    get,
    get_device,
    names,
    register,
    register_device,
)
from common.randomness import RandomSource, SeededSource, SystemSource, default_source

if TYPE_CHECKING:
    from common.mechanisms import krappor, krr, ldpsgd, longitudinal, rfrag, zsum
    from common.mechanisms._estimates import CountAccumulator, Estimate
    from common.mechanisms.base import (
        Accumulator,
        BoundMechanism,
        Mechanism,
        NoDataError,
        PrivacyDescription,
        Received,
        ReleaseCertificate,
    )

    BUILT_IN: tuple[Mechanism[Any, Any], ...]

#: The built-in mechanisms' device facets: a new one is its two modules plus one entry here.
BUILT_IN_DEVICES: tuple[DeviceMechanism[Any], ...] = (
    KRapporDevice(),
    RFragDevice(),
    LongitudinalDevice(),
    ZSumDevice(),
    KRRDevice(),
    LdpSgdDevice(),
)


def _register_built_in() -> None:
    """Register the built-in mechanisms whole: their analyzer and privacy facets, with numpy
    and :mod:`common.accounting` (the first :func:`get` of one runs this)."""
    from common.mechanisms import krappor, krr, ldpsgd, longitudinal, rfrag, zsum

    for mechanism in (
        krappor.KRappor(),
        rfrag.RFrag(),
        longitudinal.Longitudinal(),
        zsum.ZSum(),
        krr.KRR(),
        ldpsgd.LdpSgd(),
    ):
        register(mechanism)


for _device in BUILT_IN_DEVICES:
    register_device(_device, _register_built_in)

#: Where each name loaded on first use is defined.
_WHERE = {
    "CountAccumulator": "common.mechanisms._estimates",
    "Estimate": "common.mechanisms._estimates",
    "Accumulator": "common.mechanisms.base",
    "BoundMechanism": "common.mechanisms.base",
    "Mechanism": "common.mechanisms.base",
    "NoDataError": "common.mechanisms.base",
    "PrivacyDescription": "common.mechanisms.base",
    "Received": "common.mechanisms.base",
    "ReleaseCertificate": "common.mechanisms.base",
}
_MODULES = ("krappor", "krr", "ldpsgd", "longitudinal", "rfrag", "zsum")


def __getattr__(name: str) -> Any:
    """The analyzer's and accounting's names, and the mechanism modules, on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name == "BUILT_IN":
        value = tuple(get(device.name) for device in BUILT_IN_DEVICES)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "BUILT_IN",
    "BUILT_IN_DEVICES",
    "WIRE_VERSION",
    "Accumulator",
    "BatchContext",
    "BoundDevice",
    "BoundMechanism",
    "ChannelSpec",
    "CountAccumulator",
    "DeviceMechanism",
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
    "build",
    "build_device",
    "default_source",
    "get",
    "get_device",
    "krappor",
    "krr",
    "ldpsgd",
    "longitudinal",
    "names",
    "register",
    "register_device",
    "rfrag",
    "zsum",
]
