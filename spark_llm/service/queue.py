"""The queue's policy, the scheduler's deciding half: in which order the unfinished batches get their turn, whether
one more may start, which running ones yield to an urgent one, which must end early, and which a key's token limit
refuses. Pure functions of records (no store, no Spark, no clock of their own); the scheduler's loop
(:mod:`.scheduler`) runs them at every tick and does what they decide."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from ..config import PRIORITIES
from .lifecycle import Status
from .store import BatchRecord

if TYPE_CHECKING:
    from .runs import Run


def queue_order(batches: Sequence[BatchRecord], weights: Mapping[str, int] = {}) -> list[BatchRecord]:
    """``batches`` (unfinished, oldest first, as the store lists them) in the order they get their turn.

    1. By priority: every high batch before any normal one, every normal one before any low one.
    2. Within a priority, in rounds over the keys that own them: each key's oldest batch, then each key's second,
       and so on, so a key with a hundred batches queued takes one turn per round and the others' batches do not
       wait behind all of its own. A key of weight w (``weights[owner]``, else 1) takes w turns a round (its w
       oldest), so while both have batches queued a key of weight 3 gets three run for every one of a key of
       weight 1. A key's running batches count as its first turns: a key that runs one waits behind a key that
       runs none. (A running batch is at its place in this order too; the scheduler skips it.)
    3. Within a round, oldest first.
    """
    turns: dict[str, int] = {}
    ranked = []
    for age, batch in sorted(enumerate(batches), key=lambda a: a[1].status is Status.VALIDATING):  # started first
        turn = turns.get(batch.owner, 0)
        turns[batch.owner] = turn + 1
        ranked.append((PRIORITIES.index(batch.priority or "normal"), turn // weights.get(batch.owner, 1), age, batch))
    return [batch for *_, batch in sorted(ranked, key=lambda r: r[:3])]


def has_room(running: Sequence[Run], priority: Optional[str], max_running: int) -> bool:
    """Whether a batch of ``priority`` may start beside the ``running`` ones: ``max_running`` run at once, and one
    high-priority batch more (it runs beside them on the same engines, so a small urgent batch does not wait for a
    large one to end; the large one goes on). A run that is ending the batch early takes no room."""
    live = [r for r in running if not r.ending]
    if len(live) < max_running:
        return True
    return priority == "high" and len(live) == max_running and not any(r.priority == "high" for r in live)


def to_pause(running: Sequence[Run]) -> list[Run]:
    """The runs that yield their task slots to a high-priority batch now: those of other priorities that may infer
    and have committed a wave since they last yielded (so that a stream of urgent batches does not starve one)."""
    return [r for r in running
            if not r.ending and r.priority != "high" and r.committed_since_yield and r.may_infer.is_set()]


def ends_early(batch: BatchRecord, now: float) -> Optional[Status]:
    """How ``batch`` must end before its requests are all answered (cancelled, expired), or None: it runs on."""
    if batch.status is Status.CANCELLING:
        return Status.CANCELLED
    if batch.expired(now) and batch.status in (Status.VALIDATING, Status.IN_PROGRESS):
        return Status.EXPIRED
    return None


def over_token_limit(tokens: Mapping[str, int], batch_id: str, limit: Optional[int]) -> Optional[str]:
    """Why ``batch_id`` may not start when its key's unfinished batches hold ``tokens`` (batch id -> estimated input
    tokens, the batch's own among them) against the key's enqueued-token ``limit``, as OpenAI says it; None: it may."""
    if limit is None or sum(tokens.values()) <= limit:
        return None
    return (f"Enqueued token limit reached: this key's unfinished batches hold about {sum(tokens.values()):,} "
            f"input tokens with this one ({tokens.get(batch_id, 0):,}); its limit is {limit:,} enqueued "
            "tokens. Try submitting fewer requests, or wait for earlier batches to complete.")
