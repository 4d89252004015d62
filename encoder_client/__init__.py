"""The ESA device SDK: what an app embeds (imports only ``common``).

    client = Client("https://analyzer.example/v1/config", trust_file=TRUST, state_path="esa.db")
    client.histogram("homepage").report(42)
    client.flush()

``TRUST`` pins one key per party (the analyzer's and every shuffler's signing key); a device
reports in its channel's first declared crowd unless it names another. Values are encoded with
the channel's LDP mechanism, sealed, queued in a persistent outbox and delivered in the
background. Catch :class:`EsaError` for every SDK error. Guide: docs/sdk.md.
"""

from encoder_client._client import Client, HistogramReporter, LongitudinalReporter
from encoder_client._errors import (
    AlreadyReportedError,
    BudgetExceededError,
    ChannelError,
    ChannelRetiredError,
    ConfigError,
    EsaError,
    InvalidArgumentError,
    StateError,
    StateFileError,
    TrustedKeyError,
    UnknownCrowdError,
    ValueOutOfDomainError,
)

__all__ = [
    "AlreadyReportedError",
    "BudgetExceededError",
    "ChannelError",
    "ChannelRetiredError",
    "Client",
    "ConfigError",
    "EsaError",
    "HistogramReporter",
    "InvalidArgumentError",
    "LongitudinalReporter",
    "StateError",
    "StateFileError",
    "TrustedKeyError",
    "UnknownCrowdError",
    "ValueOutOfDomainError",
]
