"""The one registry that maps mechanism names to implementations.

Built-in mechanisms are registered by :mod:`common.mechanisms`; others by calling
:func:`register` in their own module, which is imported by the app that embeds the SDK, or —
in a service process — named in ``ESA_MECHANISM_MODULES`` (comma-separated module paths) or
published under the ``esa.mechanisms`` entry-point group of an installed package. Wire codes
(byte 2 of every inner plaintext) are unique across the registry.

A channel's mechanism, its parameters parsed once and bound, is :func:`build_device` on a
device (:class:`common.mechanisms.device.BoundDevice`) and :func:`build` on the analyzer and in
the tools (:class:`common.mechanisms.base.BoundMechanism`); :func:`get_device` and :func:`get`
return the registered mechanism itself (its device facet, or the whole mechanism). A built-in
mechanism is registered by its device facet and a loader: its analyzer and privacy facets, with
numpy and :mod:`common.accounting`, load on the first :func:`get` of it, never on a device.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from common.mechanisms.device import BoundDevice, DeviceMechanism

if TYPE_CHECKING:
    from common.mechanisms.base import Accumulator, BoundMechanism, Mechanism

#: Environment variable listing extra modules that register mechanisms when imported.
PLUGIN_ENV = "ESA_MECHANISM_MODULES"
ENTRY_POINT_GROUP = "esa.mechanisms"

#: Every registered mechanism's device facet (a whole mechanism is one too), by name.
_devices: dict[str, DeviceMechanism[Any]] = {}
#: Whole mechanisms registered or loaded so far, by name.
_mechanisms: dict[str, Mechanism[Any, Any]] = {}
#: What registers the whole mechanism of a device facet registered alone, by name.
_loaders: dict[str, Callable[[], object]] = {}
_lock = threading.Lock()
_plugins_loaded = False


class UnknownMechanismError(ValueError):
    """A mechanism name nobody registered."""


class ChannelSpec(Protocol):
    """What names a channel's mechanism and its parameters (a :class:`common.wire.ChannelConfig`,
    or the terms a config states)."""

    @property
    def mechanism(self) -> str:
        """The registry name."""
        ...

    @property
    def params(self) -> Mapping[str, Any]:
        """The mechanism's parameters, as the config writes them."""
        ...


def build_device(channel: ChannelSpec) -> BoundDevice[object]:
    """The device role of ``channel``'s mechanism with its parameters validated and bound
    (no analyzer or privacy facet loads).

    Raises:
        UnknownMechanismError: the mechanism is not registered.
        ValueError: naming the bad parameter (TypeError: parameters of the wrong types).
    """
    return get_device(channel.mechanism).bind(channel.params)


def build(channel: ChannelSpec) -> BoundMechanism[object, Accumulator]:
    """``channel``'s whole mechanism with its parameters validated and bound: what the analyzer
    and the tools estimate, certify and account with.

    Raises:
        UnknownMechanismError: the mechanism is not registered.
        ValueError: naming the bad parameter (TypeError: parameters of the wrong types).
    """
    return get(channel.mechanism).bind(channel.params)


def register(mechanism: Mechanism[Any, Any]) -> Mechanism[Any, Any]:
    """Add ``mechanism`` (idempotent for the same class; the whole mechanism of a device facet
    registered by :func:`register_device` completes it); returns the registered one.

    Raises:
        ValueError: another mechanism already uses its name or wire code.
    """
    with _lock:
        current = _devices.get(mechanism.name)
        if current is not None:
            whole = _mechanisms.get(mechanism.name)
            if whole is not None and _same(whole, mechanism):
                return whole
            if whole is None and isinstance(mechanism, type(current)):
                _mechanisms[mechanism.name] = mechanism
                return mechanism
            raise ValueError(f"mechanism name {mechanism.name!r} is already registered")
        _add(mechanism)
        _mechanisms[mechanism.name] = mechanism
        return mechanism


def register_device(device: DeviceMechanism[Any], load: Callable[[], object]) -> None:
    """Add a mechanism by its device facet; ``load`` registers its whole mechanism (a subclass
    of the facet's class, by :func:`register`) when :func:`get` first asks for it.

    Raises:
        ValueError: another mechanism already uses its name or wire code.
    """
    with _lock:
        current = _devices.get(device.name)
        if current is not None:
            if _same(current, device) or isinstance(current, type(device)):
                return
            raise ValueError(f"mechanism name {device.name!r} is already registered")
        _add(device)
        _loaders[device.name] = load


def _add(device: DeviceMechanism[Any]) -> None:
    """Record a new name, its wire code unique (the lock held)."""
    clash = next((m for m in _devices.values() if m.code == device.code), None)
    if clash is not None:
        raise ValueError(
            f"wire code {device.code} of {device.name!r} is already used by {clash.name!r}"
        )
    _devices[device.name] = device


def _same(a: DeviceMechanism[Any], b: DeviceMechanism[Any]) -> bool:
    kind_a, kind_b = type(a), type(b)
    return (kind_a.__module__, kind_a.__qualname__) == (kind_b.__module__, kind_b.__qualname__)


def get(name: str) -> Mechanism[Any, Any]:
    """The whole mechanism registered as ``name``, its analyzer and privacy facets loaded on
    first use (plugins are loaded on the first miss).

    Raises:
        UnknownMechanismError: naming the known mechanisms.
    """
    found = _mechanisms.get(name)
    if found is None:
        _load(name)
        found = _mechanisms.get(name)
    if found is None:
        raise UnknownMechanismError(f"unknown mechanism {name!r}; registered: {', '.join(names())}")
    return found


def _load(name: str) -> None:
    """Run what registers ``name``'s whole mechanism: its loader, else the plugins (which may
    register it, or its device facet with a loader). Loading twice registers nothing twice."""
    load = _loaders.get(name)
    if load is None:
        load_plugins()
        load = _loaders.get(name)
    if load is not None:
        load()


def get_device(name: str) -> DeviceMechanism[Any]:
    """The device facet of the mechanism registered as ``name``: what the SDK encodes with and
    what pinned terms are ordered by (plugins are loaded on the first miss).

    Raises:
        UnknownMechanismError: naming the known mechanisms.
    """
    found = _devices.get(name)
    if found is None:
        load_plugins()
        found = _devices.get(name)
    if found is None:
        raise UnknownMechanismError(f"unknown mechanism {name!r}; registered: {', '.join(names())}")
    return found


def names() -> list[str]:
    """Registered mechanism names, sorted."""
    return sorted(_devices)


def load_plugins() -> None:
    """Import the modules named in ``ESA_MECHANISM_MODULES`` and the ``esa.mechanisms``
    entry points (once per process)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points  # a few MB of modules, for this alone

    for module in filter(None, (m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(","))):
        importlib.import_module(module)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        entry.load()
