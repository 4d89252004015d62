"""The ESA device SDK: what an app embeds (imports only ``common``).

    client = Client("https://analyzer.example/v1/config", trust_file=TRUST, state_path="esa.db")
    client.histogram("homepage").report(42)
    client.flush()

``TRUST`` pins one key per party (the analyzer's and every shuffler's signing key); a device
reports in its channel's first declared crowd unless it names another. Values are encoded with
the channel's LDP mechanism, sealed, queued in a persistent outbox and delivered in the
background. A channel's privacy terms are pinned at the first config naming it and never
relaxed by a later one; :class:`PrivacyCaps` are the app's own limits. Catch :class:`EsaError`
for every SDK error. Guide: docs/sdk.md.
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
    PrivacyCapError,
    PrivacyRelaxedError,
    StateError,
    StateFileError,
    TrustedKeyError,
    UnknownCrowdError,
    ValueOutOfDomainError,
)
from encoder_client._terms import PrivacyCaps

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
    "PrivacyCapError",
    "PrivacyCaps",
    "PrivacyRelaxedError",
    "StateError",
    "StateFileError",
    "TrustedKeyError",
    "UnknownCrowdError",
    "ValueOutOfDomainError",
]
