"""The analyzer's refusals: stable codes, and the statuses clients have always seen."""

from __future__ import annotations

import pytest

from analyzer import errors
from runtime.errors import DomainError, TooLargeError
from runtime.http import status_of

#: Every refusal a client can see: (code, status), as docs/architecture.md, "Errors", lists them.
EXPECTED = {
    errors.MalformedBatchError: ("malformed", 400),
    errors.IncompleteBodyError: ("incomplete_body", 400),
    errors.UnsupportedMediaTypeError: ("unsupported_media_type", 415),
    errors.BatchTooLargeError: ("too_large", 413),
    errors.UnknownShufflerError: ("unknown_shuffler", 401),
    errors.BadSignatureError: ("bad_signature", 401),
    errors.BadPreauthError: ("bad_preauth", 401),
    errors.AdminTokenError: ("bad_admin_token", 401),
    errors.BatchForUnknownChannelError: ("unknown_channel", 422),
    errors.BelowMinCrowdError: ("below_min_crowd", 422),
    errors.UnknownCrowdError: ("unknown_crowd", 422),
    errors.InconsistentCountsError: ("inconsistent_counts", 422),
    errors.DuplicateGroupError: ("duplicate_group", 422),
    errors.FutureEpochError: ("future_epoch", 422),
    errors.UnknownChannelError: ("unknown_channel", 404),
    errors.NothingReceivedError: ("no_data", 404),
    errors.IncompleteBatchesError: ("incomplete", 404),
    errors.EpochsOpenError: ("epoch_open", 404),
    errors.StorageConflictError: ("storage_conflict", 503),
    errors.ShufflersUnavailableError: ("shufflers_unavailable", 503),
    errors.IntakeBusyError: ("busy", 503),
    errors.ChannelChangeRefusedError: ("channel_exists", 409),
}


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda k: k.__name__)
def test_codes_and_statuses_are_stable(kind: type[errors.AnalyzerError]) -> None:
    error = kind("a sentence")
    assert (error.code, status_of(error)) == EXPECTED[kind]
    assert isinstance(error, DomainError) and error.detail == "a sentence"


def test_one_base_catches_every_analyzer_refusal() -> None:
    refusals = {
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, errors.AnalyzerError)
    }
    concrete = refusals - {errors.AnalyzerError, errors.InconsistentBatchError}
    assert concrete == set(EXPECTED) | {errors.InvalidChannelError}
    assert issubclass(errors.BatchTooLargeError, TooLargeError)
    assert issubclass(errors.InvalidChannelError, ValueError)
