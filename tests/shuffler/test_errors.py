"""Every shuffler refusal keeps the code and the status clients got before domain errors."""

from __future__ import annotations

import pytest

from runtime.errors import DomainError
from runtime.http import status_of
from shuffler import errors

EXPECTED = {
    errors.BadTokenError: ("bad_token", 401),
    errors.RevokedTokenError: ("revoked", 401),
    errors.AdminTokenError: ("bad_admin_token", 401),
    errors.MalformedContributionError: ("malformed", 400),
    errors.UnsupportedVersionError: ("unsupported_version", 400),
    errors.BadContentTypeError: ("bad_content_type", 400),
    errors.UnknownChannelError: ("unknown_channel", 400),
    errors.ChannelRetiredError: ("channel_retired", 409),
    errors.ConfigOutdatedError: ("config_outdated", 409),
    errors.ChannelTermsChangedError: ("channel_terms_changed", 409),
    errors.UnknownCrowdError: ("unknown_crowd", 400),
    errors.EpochNotOpenError: ("epoch_not_open", 400),
    errors.FutureEpochError: ("epoch_not_started", 422),
    errors.ReplayedNonceError: ("replayed_nonce", 409),
    errors.QuotaExceededError: ("quota_exceeded", 409),
    errors.BodyTooLargeError: ("too_large", 413),
    errors.TooManyFragmentsError: ("too_many_fragments", 413),
    errors.TooFewFragmentsError: ("too_few_fragments", 400),
    errors.FragmentSizeError: ("bad_fragment_size", 400),
    errors.ClientRateLimitedError: ("rate_limited", 429),
    errors.KeyNotLoadedError: ("key_not_loaded", 503),
    errors.ShufflerStorageError: ("storage_unavailable", 503),
}


@pytest.mark.parametrize("error", list(EXPECTED))
def test_code_and_status(error: type[errors.ShufflerError]) -> None:
    instance = error("a sentence")
    assert isinstance(instance, errors.ShufflerError) and isinstance(instance, DomainError)
    assert (instance.code, status_of(instance)) == EXPECTED[error]
    assert instance.detail == "a sentence"


def test_every_shuffler_error_is_listed() -> None:
    defined = {
        value
        for value in vars(errors).values()
        if isinstance(value, type)
        and issubclass(value, errors.ShufflerError)
        and value is not errors.ShufflerError
    }
    assert defined == set(EXPECTED)
    assert len({code for code, _ in EXPECTED.values()}) == len(EXPECTED)  # one code per meaning
