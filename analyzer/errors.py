"""What the analyzer refuses: one base class, one subclass per meaning, no HTTP.

Each class has a stable ``code`` and a :class:`~runtime.errors.Kind` that
:data:`runtime.http.STATUS` turns into a status at the edge (every code and status:
docs/architecture.md, "Analyzer internals"). Callers catch :class:`AnalyzerError`::

    AnalyzerError (a runtime.errors.DomainError)
    ├── InvalidChannelError, MalformedBatchError (── IncompleteBodyError),
    │       UnsupportedMediaTypeError, BatchTooLargeError
    ├── UnknownShufflerError, BadSignatureError, AdminTokenError
    ├── InconsistentBatchError (422): BatchForUnknownChannelError, BelowMinCrowdError,
    │       UnknownCrowdError, InconsistentCountsError, DuplicateGroupError
    ├── UnknownChannelError, NothingReceivedError (404) ── IncompleteBatchesError
    └── ShufflersUnavailableError, IntakeBusyError, StorageConflictError
"""

from __future__ import annotations

from runtime.errors import BadAdminTokenError, DomainError, Kind, TooLargeError


class AnalyzerError(DomainError):
    """Anything the analyzer refuses."""


class InvalidChannelError(AnalyzerError, ValueError):
    """A configured channel whose mechanism is unknown or whose parameters do not validate."""

    code = "invalid_channel"
    kind = Kind.INVALID


class MalformedBatchError(AnalyzerError):
    """The body is not a batch (docs/protocol.md, "Batches and parts")."""

    code = "malformed"
    kind = Kind.INVALID


class IncompleteBodyError(MalformedBatchError):
    """The connection ended before the part's body did (the client went away, or the server's
    body deadline cut it off): a part cut short is never verified or stored."""

    code = "incomplete_body"


class UnsupportedMediaTypeError(AnalyzerError):
    """A batch sent with a ``Content-Type`` other than ``application/json`` (a missing one is
    read as JSON)."""

    code = "unsupported_media_type"
    kind = Kind.UNSUPPORTED_MEDIA


class BatchTooLargeError(AnalyzerError, TooLargeError):
    """A batch body over ``max_batch_bytes``."""

    code = "too_large"
    kind = Kind.TOO_LARGE


class UnknownShufflerError(AnalyzerError):
    """The batch names a shuffler that is not in the registry."""

    code = "unknown_shuffler"
    kind = Kind.UNAUTHENTICATED


class BadSignatureError(AnalyzerError):
    """The ``ESA-Signature`` is missing, not the base64 of a 64-byte Ed25519 signature, or does
    not verify for the shuffler."""

    code = "bad_signature"
    kind = Kind.UNAUTHENTICATED


class BadPreauthError(AnalyzerError):
    """The ``ESA-Preauth`` header (:mod:`common.preauth`) is missing, malformed, outside its
    window, not signed by the shuffler, or names another body: refused before an intake slot is
    taken (or, for the body, after reading it)."""

    code = "bad_preauth"
    kind = Kind.UNAUTHENTICATED


class AdminTokenError(BadAdminTokenError, AnalyzerError):
    """An admin route (``POST /v1/channels/{id}/releases``) without ``Authorization: Bearer
    <admin token>``."""


class InconsistentBatchError(AnalyzerError):
    """A well-formed batch that the channel's configuration cannot hold."""

    code = "inconsistent"
    kind = Kind.UNPROCESSABLE


class BatchForUnknownChannelError(InconsistentBatchError):
    """A batch for a channel that is not configured."""

    code = "unknown_channel"


class BelowMinCrowdError(InconsistentBatchError):
    """A batch of fewer contributions than the channel's ``min_crowd``."""

    code = "below_min_crowd"


class UnknownCrowdError(InconsistentBatchError):
    """A batch for a crowd its channel does not declare (``ChannelConfig.crowds``: crowds come
    from the signed channel config, never from what a sender names)."""

    code = "unknown_crowd"


class InconsistentCountsError(InconsistentBatchError):
    """Fragments the batch's contributions cannot carry: more than they can, or, once every
    part is in, fewer than they must (:meth:`common.mechanisms.Mechanism.fragment_count`)."""

    code = "inconsistent_counts"


class FutureEpochError(InconsistentBatchError):
    """A batch for an epoch that starts later than this analyzer's clock plus
    ``epoch_skew_seconds``: a shuffler sends a group's batch only once its epoch closed, so one
    from the future is a shuffler's wrong clock or a forgery (it would make a release cover
    only made-up epochs)."""

    code = "future_epoch"


class DuplicateGroupError(InconsistentBatchError):
    """A second batch for a (shuffler, channel, crowd, epoch) whose batch was already received:
    a shuffler evaluates each group once, so a second one could only count its users twice."""

    code = "duplicate_group"


class UnknownChannelError(AnalyzerError):
    """A request about a channel that is not configured."""

    code = "unknown_channel"
    kind = Kind.NOT_FOUND


class ChannelChangeRefusedError(AnalyzerError):
    """A change to a live channel's parameters, to a retired channel, or an id taken: a
    channel's privacy parameters never change while it runs (add a new channel instead)."""

    code = "channel_exists"
    kind = Kind.CONFLICT


class NothingReceivedError(AnalyzerError):
    """Nothing was received that the requested release could be computed from."""

    code = "no_data"
    kind = Kind.NOT_FOUND


class IncompleteBatchesError(NothingReceivedError):
    """Every batch of the requested range still has parts missing or unopened (a
    release never uses a batch with missing parts)."""

    code = "incomplete"


class EpochsOpenError(NothingReceivedError):
    """No epoch of the requested range is settled yet: some shuffler serving the channel has
    not delivered its batch and the epoch's close timeout has not passed (a release never lets
    one shuffler's batch be read by difference)."""

    code = "epoch_open"


class ShufflersUnavailableError(AnalyzerError):
    """The collection config cannot be served yet: a registered shuffler's signed descriptor
    has not been fetched (or expired), and devices only use keys a shuffler vouched for."""

    code = "shufflers_unavailable"
    kind = Kind.UNAVAILABLE


class IntakeBusyError(AnalyzerError):
    """Every slot of the claimed sender for reading a batch part before its signature is
    checked is taken (:class:`analyzer.slots.IntakeSlots`): each such read may buffer the
    largest legal part, so their number bounds what unauthenticated requests can make the
    analyzer hold (shufflers retry after ``Retry-After``)."""

    code = "busy"
    kind = Kind.UNAVAILABLE


class StorageConflictError(AnalyzerError):
    """Concurrent writers kept colliding on one accumulator; nothing was stored."""

    code = "storage_conflict"
    kind = Kind.UNAVAILABLE
