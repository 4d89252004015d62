"""The ESA device SDK: what an app embeds (imports only ``common``).

    client = Client("https://analyzer.example/v1/config", trust_file=TRUST, state_path="esa.db")
    client.histogram("homepage").report(42)
    client.flush()

A channel's signed config declares its crowds (``ChannelConfig.crowds``, ESA-revisited §V's
natural crowds); a device reports in the first one unless it names another, per client
(``Client(..., crowd="eu")``) or per reporter (``client.histogram("homepage", crowd="eu")``).

``TRUST`` pins one key per party (``var/trust.json`` of ``esa up``: the analyzer's
config-signing key and every shuffler's signing key); a shuffler's HPKE key is used only when
that shuffler's own signature vouches for it. Values are encoded with the channel's LDP
mechanism (OS CSPRNG), each fragment sealed for the analyzer and each contribution for one
shuffler, queued in a persistent outbox and delivered in
the background. Catch :class:`EsaError` for every SDK error.
"""

from encoder_client._client import Client, HistogramReporter, LongitudinalReporter
from encoder_client._errors import (
    AlreadyReportedError,
    BudgetExceededError,
    ChannelError,
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
