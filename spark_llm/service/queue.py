"""The queue's policy: in which order the scheduler considers the unfinished batches (a pure function; the
scheduler's loop runs it at every tick and starts what has room)."""

from __future__ import annotations

from typing import Sequence

from ..config import PRIORITIES
from .lifecycle import Status
from .store import BatchRecord


def queue_order(batches: Sequence[BatchRecord]) -> list[BatchRecord]:
    """``batches`` (unfinished, oldest first, as the store lists them) in the order they get their turn.

    1. By priority: every high batch before any normal one, every normal one before any low one.
    2. Within a priority, in rounds over the keys that own them: each key's oldest batch, then each key's second,
       and so on, so a key with a hundred batches queued takes one turn per round and the others' batches do not
       wait behind all of its own. A key's running batches count as its first turns: a key that runs one waits
       behind a key that runs none. (A running batch is at its place in this order too; the scheduler skips it.)
    3. Within a round, oldest first.
    """
    turns: dict[str, int] = {}
    ranked = []
    for age, batch in sorted(enumerate(batches), key=lambda a: a[1].status is Status.VALIDATING):  # started first
        turn = turns.get(batch.owner, 0)
        turns[batch.owner] = turn + 1
        ranked.append((PRIORITIES.index(batch.priority or "normal"), turn, age, batch))
    return [batch for *_, batch in sorted(ranked, key=lambda r: r[:3])]
