"""Failpoints: named places on the commit paths where a test can crash the process for real
(issue 49, fault 7: docs/reliability.md, "A crash at every commit point").

``failpoint("shuffler.close.group_before_commit")`` does nothing unless the environment
variable :data:`ENV` (read once, when this module is imported) names the point; then the
process writes one line to stderr and SIGKILLs itself: no ``finally``, no shutdown hook, no
transaction ended, nothing flushed — what a power cut or the OOM killer leaves. A point
placed inside a transaction (``…before_commit``) leaves it uncommitted; one placed after the
commit (``…after_commit``) leaves it committed with nothing that follows done.

Testing only (docs/operations.md, "Failpoints (testing only)"): unset, a call costs one truth
test of an empty set. Every point is listed in :data:`POINTS` with what it crashes between; a
name the variable gives that is not listed is refused at import, so a typo cannot make a
crash test pass by never crashing.
"""

from __future__ import annotations

import os
import signal

#: The variable naming the armed points, comma-separated.
ENV = "ESA_FAILPOINTS"

#: Every failpoint, in the order a group's contributions meet them: name → where it crashes.
POINTS: dict[str, str] = {
    "shuffler.close.after_epoch_closed": "the epoch's close persisted, its group not evaluated",
    "shuffler.close.after_parts_staged": "the batch dealt, signed and its parts staged; the "
    "group's outcome not written",
    "shuffler.close.group_before_commit": "the group's outcome, its batch and the deletions "
    "written in their transaction, not committed",
    "shuffler.close.group_after_commit": "the group's evaluation committed, nothing forwarded",
    "shuffler.forward.after_lease": "a part's forwarding lease committed, the part not sent",
    "shuffler.forward.after_post": "a part acknowledged by the analyzer, the acknowledgement "
    "not recorded",
    "shuffler.forward.ack_before_commit": "the acknowledgement written in its transaction, "
    "not committed",
    "shuffler.forward.ack_after_commit": "the acknowledgement committed",
    "analyzer.intake.after_part_committed": "a part stored, not answered and not opened",
    "analyzer.fold.after_opening": "a stored part's fragments opened, not folded in",
    "analyzer.fold.part_before_commit": "a part (not its batch's last) folded in its "
    "transaction, not committed",
    "analyzer.fold.batch_before_commit": "a batch's last part folded, the batch's receipt, "
    "accumulator and epoch charge written in their transaction, not committed",
    "analyzer.fold.after_commit": "a part's fold committed, the fragments seen not yet "
    "remembered in memory",
    "analyzer.close.before_commit": "an epoch's closure written in its transaction, not committed",
    "analyzer.close.after_commit": "an epoch's closure committed",
    "analyzer.release.before_commit": "a published release written in its transaction, not "
    "committed",
    "analyzer.release.after_commit": "a published release committed, not answered",
}


def _armed(value: str) -> frozenset[str]:
    """The points ``value`` names (comma-separated).

    Raises:
        ValueError: a name that is no failpoint.
    """
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = sorted(names - POINTS.keys())
    if unknown:
        raise ValueError(f"{ENV} names unknown failpoints {unknown}; known: {sorted(POINTS)}")
    return names


ARMED = _armed(os.environ.get(ENV, ""))


def failpoint(name: str) -> None:
    """Crash here (SIGKILL) if :data:`ENV` armed ``name``; otherwise nothing."""
    if ARMED and name in ARMED:
        os.write(2, f"failpoint {name}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def refuse_in_production(environment: str) -> None:
    """Refuse to start a production service with a failpoint armed: a stray ``ESA_FAILPOINTS``
    in a unit file would crash it at a commit point again after every restart.

    Raises:
        ValueError: ``environment`` is production and :data:`ENV` arms a point.
    """
    if ARMED and environment == "production":
        raise ValueError(f"{ENV} arms {sorted(ARMED)}: failpoints are for tests, never production")
