"""The scheduler: owns the server's Spark session and runs each batch as the job runs it (``run_batch`` over the
uploaded file, its rows in the shared tables), ``max_running_batches`` at a time, oldest first; the API never touches
Spark. It moves a batch through its life (:mod:`.lifecycle`) as the run reports it (:class:`_Progress`), stops a run
that is cancelled or whose completion window runs out, and then ends the batch with one more run that writes every
request not answered as a ``batch_cancelled`` / ``batch_expired`` error row (``finish_unanswered``).

Everything it needs is in the store and under the storage root: a server started again (after a crash or
``kill -9``) picks up every batch that is not final, and a batch that had started runs again with ``resume``, which
writes only what no committed row answers, so every request ends in exactly one row."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..batch import BatchErrors, BatchResult, failure_reason
from ..config import BatchConfig, ConfigError
from ..context import RunListener, cancel_batch_jobs
from ..errors import BatchStopped, EngineStartError, ErrorCode, describe_exception
from .files import FileStorage
from .lifecycle import Status
from .settings import ServiceSettings
from .store import BatchRecord, FileRecord, Store

log = logging.getLogger(__name__)

#: Seconds between the scheduler's looks at the store when nothing wakes it.
TICK_SECONDS = 0.5
#: How a stopped batch ends: its status -> the code of the requests it did not run.
UNANSWERED_CODE = {Status.CANCELLED: ErrorCode.BATCH_CANCELLED.value, Status.EXPIRED: ErrorCode.BATCH_EXPIRED.value}


@dataclass
class _Running:
    """A batch's run in a thread of its own; ``stop`` is why it is being stopped (None: it is not)."""

    batch_id: str
    thread: Optional[threading.Thread] = None
    stop: Optional[Status] = None
    ending: bool = False  #: the run that ends the batch early (it is not stopped again)

    def request_stop(self, why: Status) -> None:
        if self.stop is None and not self.ending:
            log.info("batch %s: stopping (%s)", self.batch_id, why.value)
            self.stop = why


class _Progress(RunListener):
    """A run's progress into the store: in_progress once validated, counts as waves commit, finalizing at the
    end; at each of these points a requested stop ends the run (:class:`BatchStopped`)."""

    def __init__(self, store: Store, running: _Running):
        self.store, self.running = store, running

    def _check(self) -> None:
        if self.running.stop is None:
            batch = self.store.batch(self.running.batch_id)
            if batch is not None and batch.status is Status.CANCELLING:
                self.running.request_stop(Status.CANCELLED)
        if self.running.stop is not None:
            raise BatchStopped(self.running.stop.value)

    def validated(self, total: int, invalid: int, answered: int) -> None:
        self._check()
        # a resumed run's earlier rows count as completed until the run ends and its tally splits them exactly
        counts = dict(total=total, failed=invalid, completed=answered)
        if self.store.move(self.running.batch_id, Status.IN_PROGRESS, **counts) is None:  # a resumed run
            self.store.update(self.running.batch_id, **counts)

    def committed(self, responses: int, errors: int) -> None:
        self.store.add_counts(self.running.batch_id, completed=responses, failed=errors)
        self._check()

    def finalizing(self) -> None:
        self.store.move(self.running.batch_id, Status.FINALIZING)


class Scheduler:
    """Runs the batches of ``store`` on the session ``session()`` makes (in the scheduler's thread, so that the API
    answers while Spark starts). :meth:`wake` after a batch is created or cancelled."""

    def __init__(self, base: BatchConfig, settings: ServiceSettings, store: Store, files: FileStorage,
                 session: Callable[[], Any]):
        self.base, self.settings, self.store, self.files = base, settings, store, files
        self._session = session
        self.spark: Any = None
        self.ready = threading.Event()  #: the Spark session is up
        self.startup_error: Optional[BaseException] = None
        self._running: dict[str, _Running] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spark_llm-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop running batches without ending them (a server started again resumes them) and the loop."""
        self._stopping.set()
        self._wake.set()
        for running in list(self._running.values()):
            if self.spark is not None:
                cancel_batch_jobs(self.spark, running.batch_id)
        deadline = time.time() + timeout
        for running in list(self._running.values()):
            if running.thread is not None:
                running.thread.join(max(0.0, deadline - time.time()))
        self._thread.join(max(0.0, deadline - time.time()))

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.spark = self._session()
        except BaseException as exc:  # the server answers, and says why nothing runs
            self.startup_error = exc
            log.error("the Spark session could not start: %s", describe_exception(exc))
            return
        self.ready.set()
        while not self._stopping.is_set():
            try:
                self._tick()
            except Exception:  # a database hiccup: the next tick tries again
                log.exception("scheduler tick failed")
            self._wake.wait(TICK_SECONDS)
            self._wake.clear()

    def _tick(self) -> None:
        now = time.time()
        for running in [r for r in self._running.values() if r.thread is not None and not r.thread.is_alive()]:
            del self._running[running.batch_id]
        for batch in self.store.unfinished():
            ends = self._ends_early(batch, now)
            running = self._running.get(batch.id)
            if running is not None:
                if ends is not None:
                    running.request_stop(ends)
                if running.stop is not None and not running.ending:
                    cancel_batch_jobs(self.spark, batch.id)  # again each tick: a job the run started meanwhile
                continue
            if self._stopping.is_set():
                return
            if ends is not None:  # a short run without the engines: not counted against max_running_batches
                self._launch(batch, lambda b, r, why=ends: self._end_early(b, r, why), ending=True)
            elif sum(not r.ending for r in self._running.values()) < self.settings.max_running_batches:
                self._launch(batch, self._run)

    @staticmethod
    def _ends_early(batch: BatchRecord, now: float) -> Optional[Status]:
        if batch.status is Status.CANCELLING:
            return Status.CANCELLED
        if batch.expired(now) and batch.status in (Status.VALIDATING, Status.IN_PROGRESS):
            return Status.EXPIRED
        return None

    def _launch(self, batch: BatchRecord, body: Callable[[BatchRecord, _Running], None], ending: bool = False) -> None:
        from pyspark import InheritableThread

        running = self._running[batch.id] = _Running(batch.id, ending=ending)
        running.thread = InheritableThread(target=self._guarded, args=(body, batch, running),
                                           name=f"spark_llm-{batch.id}", daemon=True)
        running.thread.start()

    def _guarded(self, body: Callable[[BatchRecord, _Running], None], batch: BatchRecord, running: _Running) -> None:
        try:
            body(batch, running)
        except Exception:
            log.exception("batch %s: the scheduler failed on it", batch.id)
        finally:
            self._wake.set()

    # ---- one batch -----------------------------------------------------------------------------------------------
    def config(self, batch: BatchRecord, resume: bool, finish_unanswered: Optional[str] = None) -> BatchConfig:
        """The job's settings for ``batch``: the server's, over its input file, into its directory and the shared
        tables, under its id."""
        source = self.store.file(batch.input_file_id)
        if source is None:
            raise ConfigError(f"the input file {batch.input_file_id} is gone")
        return self.base.model_copy(update=dict(
            input=source.location, output_dir=self.files.location("batches", batch.id), batch_id=batch.id,
            tables_dir=self.files.location("tables"), resume=resume, overwrite=False,
            finish_unanswered=finish_unanswered))

    def _run(self, batch: BatchRecord, running: _Running) -> None:
        from ..pipeline import run_batch

        self.store.update(batch.id, runs=batch.runs + 1)
        log.info("batch %s: run %d starts", batch.id, batch.runs + 1)
        try:
            result = run_batch(self.spark, self.config(batch, resume=batch.runs > 0), _Progress(self.store, running))
        except BaseException as exc:
            if running.stop is not None:
                self._end_early(batch, running, running.stop)
            elif self._stopping.is_set():
                log.info("batch %s: left to resume when the server starts again", batch.id)
            elif isinstance(exc, (ConfigError, EngineStartError)) or batch.runs + 1 >= self.settings.max_runs:
                self._fail(batch, exc)
            else:
                log.warning("batch %s: run %d failed (%s); it runs again, resuming", batch.id, batch.runs + 1,
                            describe_exception(exc))
            return
        self._record(batch, result)

    def _end_early(self, batch: BatchRecord, running: _Running, why: Status) -> None:
        """A run that writes what was not answered as error rows, then the batch ``why`` (cancelled, expired)."""
        from ..pipeline import run_batch

        running.ending = True
        log.info("batch %s: ending as %s", batch.id, why.value)
        try:
            result = run_batch(self.spark, self.config(batch, resume=True, finish_unanswered=UNANSWERED_CODE[why]))
        except BaseException as exc:
            if not self._stopping.is_set():
                self._fail(batch, exc)
            return
        self._record(batch, result)

    def _fail(self, batch: BatchRecord, exc: BaseException) -> None:
        log.error("batch %s: failed: %s", batch.id, describe_exception(exc))
        errors = BatchErrors(data=[failure_reason(exc)], total=1)
        self.store.move(batch.id, Status.FAILED, errors=errors.model_dump(exclude_none=True))

    def _record(self, batch: BatchRecord, result: BatchResult) -> None:
        """The run's batch object into the store: counts, usage, the output and error files, the final status."""
        b = result.batch
        counts = dict(total=b.request_counts.total, completed=b.request_counts.completed,
                      failed=b.request_counts.failed, input_tokens=b.usage.input_tokens,
                      output_tokens=b.usage.output_tokens, model=b.model or None)
        # errors.data names lines of the input file by its id, not by where the server keeps it
        errors = b.errors.model_copy(update={"data": [e.model_copy(update={"file": batch.input_file_id})
                                                      for e in b.errors.data]}).model_dump(exclude_none=True)
        if b.status == "completed" and _not_a_batch_file(result):
            self.store.move(batch.id, Status.FAILED, errors=errors, **counts)
            log.info("batch %s: failed: no line of its file is a batch request", batch.id)
            return
        current = self.store.batch(batch.id)
        files = dict(output_file_id=self._register(batch, "output", result.output_file, b.request_counts.completed),
                     error_file_id=self._register(batch, "error", result.error_file, b.request_counts.failed))
        if b.status == "completed" and current is not None and current.status is Status.CANCELLING:
            target = Status.CANCELLED  # a cancel that came when every request was answered already
        else:
            target = Status(b.status)
        if target is Status.COMPLETED:
            self.store.move(batch.id, Status.FINALIZING)  # when the run did not say (a resumed, finished run)
        moved = self.store.move(batch.id, target, errors=errors if b.errors.data else None, **counts, **files)
        log.info("batch %s: %s (%d completed, %d failed)", batch.id, (moved or current or batch).status.value,
                 counts["completed"], counts["failed"])

    def _register(self, batch: BatchRecord, kind: str, location: str, lines: int) -> Optional[str]:
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
