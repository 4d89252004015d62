"""The one registry that maps mechanism names to implementations.

Built-in mechanisms are registered by :mod:`common.mechanisms`; others by calling
:func:`register` in their own module, which is imported by the app that embeds the SDK, or —
in a service process — named in ``ESA_MECHANISM_MODULES`` (comma-separated module paths) or
published under the ``esa.mechanisms`` entry-point group of an installed package. Wire codes
(byte 2 of every inner plaintext) are unique across the registry.
"""

from __future__ import annotations

import importlib
import os
import threading
from importlib.metadata import entry_points
from typing import Any

from common.mechanisms.base import Mechanism

#: Environment variable listing extra modules that register mechanisms when imported.
PLUGIN_ENV = "ESA_MECHANISM_MODULES"
ENTRY_POINT_GROUP = "esa.mechanisms"

_registry: dict[str, Mechanism[Any, Any]] = {}
_lock = threading.Lock()
_plugins_loaded = False


class UnknownMechanismError(ValueError):
    """A mechanism name nobody registered."""


def register(mechanism: Mechanism[Any, Any]) -> Mechanism[Any, Any]:
    """Add ``mechanism`` (idempotent for the same class); returns it.

    Raises:
        ValueError: another mechanism already uses its name or wire code.
    """
    with _lock:
        current = _registry.get(mechanism.name)
        if current is not None:
            if _same(current, mechanism):
                return current
            raise ValueError(f"mechanism name {mechanism.name!r} is already registered")
        clash = next((m for m in _registry.values() if m.code == mechanism.code), None)
        if clash is not None:
            raise ValueError(
                f"wire code {mechanism.code} of {mechanism.name!r} is already used by "
                f"{clash.name!r}"
            )
        _registry[mechanism.name] = mechanism
        return mechanism


def _same(a: Mechanism[Any, Any], b: Mechanism[Any, Any]) -> bool:
    kind_a, kind_b = type(a), type(b)
    return (kind_a.__module__, kind_a.__qualname__) == (kind_b.__module__, kind_b.__qualname__)


def get(name: str) -> Mechanism[Any, Any]:
    """The mechanism registered as ``name`` (plugins are loaded on the first miss).

    Raises:
        UnknownMechanismError: naming the known mechanisms.
    """
    found = _registry.get(name)
    if found is None:
        load_plugins()
        found = _registry.get(name)
    if found is None:
        raise UnknownMechanismError(f"unknown mechanism {name!r}; registered: {', '.join(names())}")
    return found


def names() -> list[str]:
    """Registered mechanism names, sorted."""
    return sorted(_registry)


def load_plugins() -> None:
    """Import the modules named in ``ESA_MECHANISM_MODULES`` and the ``esa.mechanisms``
    entry points (once per process)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(","))):
        importlib.import_module(module)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        entry.load()
