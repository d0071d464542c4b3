"""A batch's life, as OpenAI's ``Batch.status`` shows it, written once for the API, the scheduler and recovery:
which status may follow which, the timestamp each sets, which are final.

    validating -> in_progress -> finalizing -> completed
         |             |             |
         +-------------+-------------+--> failed    (no line of the file is a batch request; the run failed)
         +-------------+--> cancelling -> cancelled (a cancel: what was answered, the rest as batch_cancelled)
         +-------------+--> expired                 (completion_window ran out: the rest as batch_expired)

A batch waits its turn in ``validating``; a server that restarts runs again every batch that is not final.
"""

from __future__ import annotations

from ..batch import Status


S = Status

#: status -> the statuses that may follow it.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING, S.EXPIRED}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.FAILED, S.CANCELLING, S.EXPIRED}),
    S.FINALIZING: frozenset({S.COMPLETED, S.FAILED, S.EXPIRED}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED}),
    S.COMPLETED: frozenset(), S.FAILED: frozenset(), S.CANCELLED: frozenset(), S.EXPIRED: frozenset(),
}

#: status -> the Batch field holding when the batch entered it.
TIMESTAMP: dict[Status, str] = {
    S.IN_PROGRESS: "in_progress_at", S.FINALIZING: "finalizing_at", S.COMPLETED: "completed_at",
    S.FAILED: "failed_at", S.CANCELLING: "cancelling_at", S.CANCELLED: "cancelled_at", S.EXPIRED: "expired_at",
}

FINAL = frozenset(s for s, after in TRANSITIONS.items() if not after)
#: final status -> the webhook event it sends (OpenAI's ``batch.completed``, ``batch.failed``, ...).
EVENT: dict[Status, str] = {s: f"batch.{s.value}" for s in sorted(FINAL)}
#: Statuses a cancel is accepted in (a finalizing batch has every answer already).
CANCELLABLE = frozenset({S.VALIDATING, S.IN_PROGRESS})


def sources(target: Status) -> frozenset[Status]:
    """The statuses ``target`` may follow."""
    return frozenset(s for s, after in TRANSITIONS.items() if target in after)
