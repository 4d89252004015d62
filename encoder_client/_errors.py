"""The SDK's exceptions; catch :class:`EsaError` to catch them all. Each names the bad value::

EsaError
├── ConfigError            unsigned, mis-signed, tampered, expired or unreachable config
│   └── TrustedKeyError    the pinned key is not base64 of 32 bytes (also a ValueError)
├── ChannelError           unknown channel, or a reporter of the wrong kind for it
│   ├── UnknownCrowdError  a crowd the channel's signed config does not declare
│   ├── PrivacyRelaxedError  a config relaxes privacy terms this device accepted for the channel
│   └── PrivacyCapError    a channel's local ε above the app's cap
├── ValueOutOfDomainError  a value the channel cannot encode (also a ValueError)
├── AlreadyReportedError   a second report on a channel in the same epoch
├── StateError             the device state cannot be used for this channel
│   └── StateFileError     the state file cannot be opened, created or written
├── BudgetExceededError    the report would spend more local ε than the device budget allows
└── InvalidArgumentError   an argument the SDK cannot use (also a ValueError)
"""

from __future__ import annotations


class EsaError(Exception):
    """Base of every error the SDK raises."""


class ConfigError(EsaError):
    """The collection config cannot be trusted or fetched."""


class TrustedKeyError(ConfigError, ValueError):
    """The pinned analyzer key is not an Ed25519 public key (32 raw bytes or their base64)."""


class ChannelError(EsaError):
    """Unknown channel, or a reporter of the wrong kind for it."""


class ChannelRetiredError(ChannelError):
    """The channel was retired at the analyzer: it takes no report for this epoch or later
    (``ChannelConfig.retired_from_epoch``); its past releases stay."""


class UnknownCrowdError(ChannelError):
    """A crowd that the channel's signed config does not declare (``ChannelConfig.crowds``);
    shufflers would refuse the contribution (``400 unknown_crowd``)."""


class PrivacyRelaxedError(ChannelError):
    """A signed config relaxes what this device accepted about a channel's privacy (a larger
    local ε or δ, less randomized deletion, a lower ``min_crowd``, a lifted or raised budget,
    another mechanism, or a change that cannot be ordered): the channel takes no report while
    that config is in force; a channel whose privacy must change needs a new id (docs/sdk.md,
    "Pinned privacy terms").

    Attributes:
        channel_id: The channel.
        field: The first relaxed field (the message names every one).
        old: Its value as accepted.
        new: Its value in the refused config.
    """

    def __init__(
        self, message: str, *, channel_id: str, field: str, old: object, new: object
    ) -> None:
        super().__init__(message)
        self.channel_id, self.field, self.old, self.new = channel_id, field, old, new


class PrivacyCapError(ChannelError):
    """A channel's local ε (replacement notion) is above the cap the app set
    (:class:`encoder_client.PrivacyCaps`): no config can take the device past it.

    Attributes:
        channel_id: The channel.
        cap: The app's cap.
        value: The channel's local ε.
    """

    def __init__(self, message: str, *, channel_id: str, cap: float, value: float) -> None:
        super().__init__(message)
        self.channel_id, self.cap, self.value = channel_id, cap, value


class ValueOutOfDomainError(EsaError, ValueError):
    """A value outside the channel's domain."""


class AlreadyReportedError(EsaError):
    """One contribution per channel per epoch: this one was already made."""


class StateError(EsaError):
    """The device state cannot be used for this channel (e.g. drawn for other parameters)."""


class StateFileError(StateError):
    """The device state file cannot be opened, created or written (a directory, a read-only
    file or folder, a missing drive, a lock held too long); the message names the path."""


class BudgetExceededError(EsaError):
    """The report would take this device past a local-ε budget of the signed config (or the
    app's own lifetime cap, :class:`encoder_client.PrivacyCaps`)."""


class InvalidArgumentError(EsaError, ValueError):
    """An argument the SDK cannot use (a non-positive timeout, negative routing weights...)."""
