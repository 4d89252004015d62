"""Closing one group: ESA-revisited Algorithm 3 applied to a whole group, its batch dealt,
signed and stored (docs/shuffler.md, "Evaluating a group").

The sequence lives here; every step's transaction is the store's
(:class:`shuffler.store.ContributionStore`), and the draws and the dealing are the batcher's
(:class:`shuffler.batcher.Batcher`). Three steps, so the write lock is held only for the
last: (1) read the group's ids and fragment counts, draw the deletion once and pick the
survivors; (2) deal the survivors' fragments into one shuffled sequence, sign it as parts and
store them ``staged``, each in its own short transaction; (3) under the write lock, check that
the group is as read and record the outcome with the batch (or, if not, unstage it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from common.wire import ChannelPolicy
from runtime.failpoints import failpoint
from shuffler.batcher import Batcher, Deletion, Evaluation, GroupStatus, ReleasedBatch
from shuffler.records import GroupKey
from shuffler.store import ContributionStore
from shuffler.store_queries import Ids, VanishedError

#: (kept contributions, their fragments) → the crowd the analyzer verifies for such a batch.
CrowdCheck = Callable[[int, int], int]


def close_group(
    store: ContributionStore,
    key: GroupKey,
    batcher: Batcher,
    policy: ChannelPolicy,
    now: float,
    crowd: CrowdCheck | None = None,
) -> Evaluation | None:
    """Apply Algorithm 3 to the group, whole, and store its outcome.

    None when nothing waits in the group, when it was evaluated already (here or by another
    replica, which holds it right now), or when it changed meanwhile (evaluated again in a later
    round). ``crowd``: the crowd the analyzer will verify for (kept, fragments); a batch it would
    withhold below ``min_crowd`` is held here instead, as Algorithm 3 holds a small group.

    Raises:
        sqlalchemy.exc.IntegrityError: another worker recorded this group first.
    """
    with store.exclusive(key) as mine:
        if not mine:
            return None
        group = store.group_to_evaluate(key)
        if group is None:
            return None
        ids, sizes = group
        deletion = batcher.decide(int(ids.size), policy)
        batch = None
        if deletion.status is GroupStatus.RELEASED:
            picked = batcher.survivors(int(ids.size), deletion.kept)
            fragments = int(sizes[picked].sum())
            if crowd is not None and crowd(deletion.kept, fragments) < policy.min_crowd:
                deletion = Deletion(GroupStatus.HELD, deletion.n, 0)
            else:
                batch = _deal_and_stage(store, batcher, key, ids[picked], fragments, now)
                if batch is None:
                    return None
                failpoint("shuffler.close.after_parts_staged")
        return _record(store, key, ids, deletion, batch, now)


def _deal_and_stage(
    store: ContributionStore,
    batcher: Batcher,
    key: GroupKey,
    survivors: Ids,
    fragments: int,
    now: float,
) -> ReleasedBatch | None:
    """Step 2: deal the survivors' fragments (read in chunks, the read ended once dealt) and
    store every signed part ``staged``; None (nothing left staged) when a survivor's row
    vanished meanwhile. Any failure deletes what was staged."""
    n = int(survivors.size)
    try:
        with (
            contextlib.closing(store.survivor_fragments(key, survivors)) as chunks,
            batcher.release(key, n, fragments, chunks, store.spill_directory()) as release,
        ):
            chunks.close()  # the survivors are dealt: end the read before staging
            store.stage_parts(release, now)
    except VanishedError:
        return None
    return release.batch


def _record(
    store: ContributionStore,
    key: GroupKey,
    ids: Ids,
    deletion: Deletion,
    batch: ReleasedBatch | None,
    now: float,
) -> Evaluation | None:
    """Step 3: the outcome recorded with its batch, or the batch unstaged when the group was
    evaluated elsewhere first or changed (a row read in step 1 vanished), or on any failure."""
    try:
        recorded = store.record_group(key, ids, deletion, batch, now)
    except BaseException:
        if batch is not None:
            store.unstage(batch.batch_id)
        raise
    if not recorded:
        if batch is not None:
            store.unstage(batch.batch_id)
        return None
    failpoint("shuffler.close.group_after_commit")
    return Evaluation(deletion, batch)
