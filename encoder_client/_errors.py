"""The SDK's exceptions. Catch :class:`EsaError` to catch them all::

EsaError
├── ConfigError            unsigned, mis-signed, tampered, expired or unreachable config
├── ChannelError           unknown channel, or a reporter of the wrong kind for it
├── ValueOutOfDomainError  a value the channel cannot encode (also a ValueError)
├── AlreadyReportedError   a second report on a channel in the same epoch
├── StateError             the device state cannot be used for this channel
└── BudgetExceededError    the report would spend more local ε than the device budget allows
"""

from __future__ import annotations


class EsaError(Exception):
    """Base of every error the SDK raises."""


class ConfigError(EsaError):
    """The collection config cannot be trusted or fetched."""


class ChannelError(EsaError):
    """Unknown channel, or a reporter of the wrong kind for it."""


class ValueOutOfDomainError(EsaError, ValueError):
    """A value outside the channel's domain."""


class AlreadyReportedError(EsaError):
    """One contribution per channel per epoch: this one was already made."""


class StateError(EsaError):
    """The device state cannot be used for this channel (e.g. drawn for other parameters)."""


class BudgetExceededError(EsaError):
    """The report would take this device past a local-ε budget of the signed config."""
