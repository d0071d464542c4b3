"""A batch's runs, the scheduler's doing half: each batch runs as the job runs it (``run_batch`` over the uploaded
file, its rows in the shared tables) in a thread of its own (a :class:`Run`). Its progress moves the batch through
its life (:mod:`.lifecycle`, :class:`Progress`); a run that is cancelled or whose completion window runs out stops,
and one more run ends the batch, writing every request not answered as a ``batch_cancelled`` / ``batch_expired``
error row (``finish_unanswered``).

Everything a run needs is in the store and under the storage root: a batch that had started runs again with
``resume``, which writes only what no committed row answers, so every request ends in exactly one row."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import sqlalchemy.exc

from ..batch import BatchErrors, BatchResult, RequestCounts, failure_reason
from ..config import BatchConfig, ConfigError
from ..context import RunListener
from ..errors import BatchStopped, EngineStartError, ErrorCode, describe_exception
from ..media import BY_PURPOSE
from .files import FileStorage
from .lifecycle import Status
from .settings import ServiceSettings
from .store import BatchChange, BatchRecord, FileRecord, Store

log = logging.getLogger(__name__)

#: Seconds between a yielding run's looks for a cancel.
CHECK_SECONDS = 0.5
#: How a stopped batch ends: its status -> the code of the requests it did not run.
UNANSWERED_CODE = {Status.CANCELLED: ErrorCode.BATCH_CANCELLED.value, Status.EXPIRED: ErrorCode.BATCH_EXPIRED.value}


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@dataclass
class Run:
    """A batch's run in a thread of its own; ``stop`` is why it is being stopped (None: it is not)."""

    batch_id: str
    thread: Optional[threading.Thread] = None
    stop: Optional[Status] = None
    ending: bool = False  #: the run that ends the batch early (it is not stopped again)
    lost: bool = False  #: the lease went to another server: the run stops, and leaves the batch to it
    done: bool = False  #: the run has ended (its lease let go): no more renewals
    priority: Optional[str] = None
    #: how many times the run yielded its task slots to a high-priority batch (RunListener.yielded)
    yields: int = 0
    #: set while the run may submit inference waves; cleared while it yields
    may_infer: threading.Event = field(default_factory=lambda: _set(threading.Event()))
    committed_since_yield: bool = True  #: a wave was committed since the last yield (or there was none)
    halted: bool = False  #: the server is stopping: the run ends at its next check, the batch left to resume
    #: its inference waves run: the GPUs are its (from a model's first wave until its last has ended)
    inferring: bool = False
    has_inferred: bool = False  #: a wave of it was submitted: it is no batch waiting for GPUs any more
    #: what :meth:`begin_inference` does instead of setting those itself (the scheduler: that, and its hold on GPU
    #: executors let go, at once)
    on_infer: Optional[Callable[["Run"], None]] = None

    def begin_inference(self) -> None:
        """A model's first inference wave is about to start."""
        if self.on_infer is not None:
            self.on_infer(self)
        else:
            self.inferring = self.has_inferred = True

    def request_stop(self, why: Status) -> None:
        if self.stop is None and not self.ending:
            log.info("batch %s: stopping (%s)", self.batch_id, why.value)
            self.stop = why


class TableTurns(RunListener):
    """A run's writes of the shared tables in their turns: with ``take_turns`` (the tables on object storage, other
    servers on the same records) a write waits for the other servers' writes of that table (:meth:`writing`)."""

    def __init__(self, store: Optional[Store] = None, take_turns: bool = False):
        self.store, self.take_turns = store, take_turns

    def writing(self, table: str) -> ContextManager[None]:
        """On object storage the servers' commits to one Delta table take turns in the shared database: a commit
        there writes version N + 1 if no object of that name exists, a check and a write that two servers can both
        pass at once (S3 has no put-if-absent), and one of the two commits is lost. A local filesystem's commit
        is exclusive (a rename that does not replace), so nothing waits there."""
        if self.take_turns and self.store is not None:
            return self.store.turn(f"delta-table:{table}")
        return contextlib.nullcontext()


class Progress(TableTurns):
    """A run's progress into the store: in_progress once validated, counts as waves commit, finalizing at the
    end; at each of these points a requested stop ends the run (:class:`BatchStopped`)."""

    def __init__(self, store: Store, running: Run, take_turns: bool = False):
        super().__init__(store, take_turns)
        self.running = running

    def _check(self) -> None:
        if self.running.lost:
            raise BatchStopped("lease lost")
        if self.running.halted:
            raise BatchStopped("server stopping")
        if self.running.stop is None:
            batch = self.store.batch(self.running.batch_id)
            if batch is not None and batch.status is Status.CANCELLING:
                self.running.request_stop(Status.CANCELLED)
        if self.running.stop is not None:
            raise BatchStopped(self.running.stop.value)

    def validated(self, total: int, invalid: int, answered: int) -> None:
        self._check()
        # a resumed run's earlier rows count as completed until the run ends and its tally splits them exactly
        counts = BatchChange(counts=RequestCounts(total=total, failed=invalid, completed=answered))
        if self.store.move(self.running.batch_id, Status.IN_PROGRESS, counts) is None:  # a resumed run
            self.store.update(self.running.batch_id, counts)

    def committed(self, responses: int, errors: int) -> None:
        self.running.committed_since_yield = True
        self.store.add_counts(self.running.batch_id, completed=responses, failed=errors)
        self._check()

    def finalizing(self) -> None:
        self.store.move(self.running.batch_id, Status.FINALIZING)

    def inference_ended(self) -> None:
        self.running.inferring = False

    def before_wave(self) -> int:
        while not self.running.may_infer.wait(CHECK_SECONDS):
            self._check()  # a cancel while it yields
        self._check()
        if not self.running.inferring:
            self.running.begin_inference()
        return self.running.yields

    def yielded(self, since: int) -> bool:
        return self.running.yields != since


class LeaseWatch(TableTurns):
    """The listener of a run that ends a batch early: it only stops when the lease goes to another server."""

    def __init__(self, running: Run, store: Optional[Store] = None, take_turns: bool = False):
        super().__init__(store, take_turns)
        self.running = running

    def _check(self) -> None:
        if self.running.lost:
            raise BatchStopped("lease lost")

    def validated(self, total: int, invalid: int, answered: int) -> None:
        self._check()

    def committed(self, responses: int, errors: int) -> None:
        self._check()


class BatchRunner:
    """Runs one batch of ``store`` at a time per call, with the server's job settings ``base``; ``stopping`` is set
    while the server stops (a run that ends then leaves its batch to resume)."""

    def __init__(self, base: BatchConfig, settings: ServiceSettings, store: Store, files: FileStorage,
                 stopping: threading.Event):
        self.base, self.settings, self.store, self.files = base, settings, store, files
        self.stopping = stopping
        #: the shared tables are on object storage and other servers may write them: their commits take turns
        self.take_turns = store.shared and settings.local_storage() is None

    def config(self, batch: BatchRecord, resume: bool, finish_unanswered: Optional[str] = None) -> BatchConfig:
        """The job's settings for ``batch``: the server's, over its input file, into its directory and the shared
        tables, under its id."""
        source = self.store.file(batch.input_file_id)
        if source is None:
            raise ConfigError(f"the input file {batch.input_file_id} is gone")
        return self.base.model_copy(update=dict(
            input=source.location, output_dir=self.files.location("batches", batch.id), batch_id=batch.id,
            tables_dir=self.files.location("tables"), resume=resume, overwrite=False,
            finish_unanswered=finish_unanswered, priority=batch.priority or "normal",
            media_files=self.media_of(batch.owner),
            target_tokens_per_partition=min(self.base.target_tokens_per_partition,
                                            self.settings.max_partition_tokens)))

    def media_of(self, owner: str) -> dict[str, str]:
        """``owner``'s uploaded images (purpose vision) and audio files (purpose user_data), which its batches'
        Responses lines name by ``file_id`` and its transcriptions by ``file``: file id -> where it is stored.
        Another key's are not among them."""
        return {f.id: f.location for purpose in BY_PURPOSE
                for f in self.store.files(owner, purpose, 1_000_000, None, False)[0]}

    def run(self, spark: Any, batch: BatchRecord, running: Run) -> None:
        from ..pipeline import run_batch

        self.store.update(batch.id, BatchChange(runs=batch.runs + 1))
        log.info("batch %s: run %d starts", batch.id, batch.runs + 1)
        try:
            result = run_batch(spark, self.config(batch, resume=batch.runs > 0), Progress(self.store, running,
                                                                                           self.take_turns))
        except BaseException as exc:
            if running.lost:
                log.info("batch %s: left to the server that holds it now", batch.id)
            elif isinstance(exc, sqlalchemy.exc.DBAPIError):  # not the batch's fault: it runs again, resuming
                log.warning("batch %s: the database went out of reach during its run; it resumes later", batch.id)
            elif running.stop is not None:
                self.end_early(spark, batch, running, running.stop)
            elif self.stopping.is_set():
                log.info("batch %s: left to resume when the server starts again", batch.id)
            elif isinstance(exc, (ConfigError, EngineStartError)) or batch.runs + 1 >= self.settings.max_runs:
                self.fail(batch, exc)
            else:
                log.warning("batch %s: run %d failed (%s); it runs again, resuming", batch.id, batch.runs + 1,
                            describe_exception(exc))
            return
        self.record(batch, result)

    def end_early(self, spark: Any, batch: BatchRecord, running: Run, why: Status) -> None:
        """A run that writes what was not answered as error rows, then the batch ``why`` (cancelled, expired)."""
        from ..pipeline import run_batch

        running.ending = True
        log.info("batch %s: ending as %s", batch.id, why.value)
        try:
            result = run_batch(spark, self.config(batch, resume=True, finish_unanswered=UNANSWERED_CODE[why]),
                               LeaseWatch(running, self.store, self.take_turns))
        except BaseException as exc:
            if not self.stopping.is_set() and not running.lost:
                self.fail(batch, exc)
            return
        self.record(batch, result)

    def fail(self, batch: BatchRecord, exc: BaseException) -> None:
        log.error("batch %s: failed: %s", batch.id, describe_exception(exc))
        errors = BatchErrors(data=[failure_reason(exc)], total=1)
        self.store.move(batch.id, Status.FAILED, BatchChange(errors=errors))

    def record(self, batch: BatchRecord, result: BatchResult) -> None:
        """The run's batch object into the store: counts, usage, the output and error files, the final status."""
        b = result.batch
        # errors.data names lines of the input file by its id, not by where the server keeps it
        errors = b.errors.model_copy(update={"data": [e.model_copy(update={"file": batch.input_file_id})
                                                      for e in b.errors.data]})
        tally = BatchChange(counts=b.request_counts, input_tokens=b.usage.input_tokens,
                            output_tokens=b.usage.output_tokens, model=b.model or None,
                            errors=errors if b.errors.data else None)
        if b.status == "completed" and _not_a_batch_file(result):
            self.store.move(batch.id, Status.FAILED, dataclasses.replace(tally, errors=errors))
            log.info("batch %s: failed: no line of its file is a batch request", batch.id)
            return
        current = self.store.batch(batch.id)
        change = dataclasses.replace(
            tally, output_file_id=self.register(batch, "output", result.output_file, b.request_counts.completed),
            error_file_id=self.register(batch, "error", result.error_file, b.request_counts.failed))
        if b.status == "completed" and current is not None and current.status is Status.CANCELLING:
            target = Status.CANCELLED  # a cancel that came when every request was answered already
        else:
            target = Status(b.status)
        if target is Status.COMPLETED:
            self.store.move(batch.id, Status.FINALIZING)  # when the run did not say (a resumed, finished run)
        moved = self.store.move(batch.id, target, change)
        log.info("batch %s: %s (%d completed, %d failed)", batch.id, (moved or current or batch).status.value,
                 b.request_counts.completed, b.request_counts.failed)

    def register(self, batch: BatchRecord, kind: str, location: str, lines: int) -> Optional[str]:
        """The batch's output or error file as a file of its owner (the same id on every run: registering it
        again is a no-op); None when it has no line, as OpenAI leaves the id out."""
        if not lines:
            return None
        id = "file-" + hashlib.sha256(f"{batch.id}:{kind}".encode()).hexdigest()[:24]
        if self.store.file(id) is None:
            now = int(time.time())
            self.store.add_file(FileRecord(
                id=id, owner=batch.owner, filename=f"{batch.id}_{kind}.jsonl", purpose="batch_output",
                bytes=self.files.size(location) or 0, created_at=now, location=location,
                expires_at=now + batch.output_expires_after if batch.output_expires_after else None))
        return id


def _not_a_batch_file(result: BatchResult) -> bool:
    """No line of the file is a batch request: every line is an error without a usable custom_id."""
    b = result.batch
    return b.request_counts.completed == 0 and b.request_counts.total > 0 and b.errors.total == b.request_counts.total
