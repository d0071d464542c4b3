"""The leases, the scheduler's holding half: several servers may share the store, and each batch is run by the one
server that holds its lease (:meth:`~.store.Store.claim`), renewed while it runs. A server that dies loses its leases
after ``lease_seconds`` and another takes the batch over, resuming it; a server that cannot renew for most of that
long (it lost the database) stops its runs first, so two servers never run one batch at once."""

from __future__ import annotations

import contextlib
import logging
from typing import Sequence

from ..errors import describe_exception
from .runs import Run
from .store import BatchRecord, Store

log = logging.getLogger(__name__)

#: The share of a lease a server goes on without reaching the database before it stops its runs.
HOLD_WITHOUT_DATABASE = 0.8


def held_elsewhere(batch: BatchRecord, holder: str, now: float) -> bool:
    """Whether another server than ``holder`` holds ``batch``'s lease at ``now`` (it runs the batch)."""
    return batch.lease_holder not in (None, holder) and (batch.lease_until or 0) > now


class Leases:
    """This server's (``holder``'s) leases on the batches it runs, ``seconds`` long, in ``store``."""

    def __init__(self, store: Store, holder: str, seconds: float, now: float):
        self.store, self.holder, self.seconds = store, holder, seconds
        self._renewed_at = self._held_at = now

    def claim(self, batch_id: str) -> bool:
        """Take ``batch_id``'s lease: False when another server holds it (it runs the batch)."""
        return self.store.claim(batch_id, self.holder, self.seconds)

    def release(self, batch_id: str) -> None:
        """Let ``batch_id``'s lease go (another server may run it now); a database out of reach lets it run out."""
        with contextlib.suppress(Exception):
            self.store.release(batch_id, self.holder)

    def renew(self, runs: Sequence[Run], now: float) -> list[Run]:
        """Renew the leases of ``runs``, every sixth of a lease; the runs that lost theirs, marked ``lost``: their
        lease went to another server, or (all of them) the database could not be reached for most of a lease."""
        if not runs:
            self._held_at = now  # nothing held: the database's reach is measured from the next run on
            return []
        if now - self._renewed_at < self.seconds / 6:
            return []
        self._renewed_at = now
        ids = [r.batch_id for r in runs if not r.lost and not r.done]
        try:
            held = self.store.renew(ids, self.holder, self.seconds)
            self._held_at = now
        except Exception as exc:
            if now - self._held_at < HOLD_WITHOUT_DATABASE * self.seconds:
                log.warning("could not renew the batches' leases (%s); trying again", describe_exception(exc))
                return []
            log.error("the database was out of reach for %.0fs: stopping this server's runs before their leases "
                      "run out (another server resumes them)", now - self._held_at)
            held = set()
        lost = [r for r in runs if r.batch_id in ids and r.batch_id not in held]
        for run in lost:
            log.warning("batch %s: its lease went to another server; stopping this run", run.batch_id)
            run.lost = True
        return lost
