"""The scheduler: owns the server's Spark session and runs each batch as the job runs it (``run_batch`` over the
uploaded file, its rows in the shared tables), ``max_running_batches`` at a time, in the queue's order (by priority,
then in rounds over the keys: :func:`.queue.queue_order`); the API never touches Spark. It moves a batch through its
life (:mod:`.lifecycle`) as the run reports it (:class:`_Progress`), stops a run that is cancelled or whose
completion window runs out, and then ends the batch with one more run that writes every request not answered as a
``batch_cancelled`` / ``batch_expired`` error row (``finish_unanswered``).

Everything it needs is in the store and under the storage root: a server started again (after a crash or
``kill -9``) picks up every batch that is not final, and a batch that had started runs again with ``resume``, which
writes only what no committed row answers, so every request ends in exactly one row.

Several servers may share the store (and the storage root): each batch is run by the one server that holds its
**lease** (:meth:`~.store.Store.claim`), renewed while it runs. A server that dies loses its leases after
``lease_seconds`` and another takes the batch over, resuming it; a server that cannot renew for that long (it lost
the database) stops its runs first, so two servers never run one batch at once."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sqlalchemy.exc

from ..batch import TOKEN_LIMIT_EXCEEDED, BatchErrors, BatchResult, failure_reason
from ..config import BatchConfig, ConfigError
from ..context import RunListener, cancel_batch_jobs, cancel_waves
from ..errors import BatchStopped, EngineStartError, ErrorCode, describe_exception
from .audit import audit
from .files import FileStorage
from .lifecycle import Status
from .queue import queue_order
from .settings import ServiceSettings
from .store import BatchRecord, FileRecord, Store

log = logging.getLogger(__name__)

#: Seconds between the scheduler's looks at the store when nothing wakes it.
TICK_SECONDS = 0.5
#: Bytes of a batch input file per input token, for the enqueued-token limit (JSONL around English text).
BYTES_PER_TOKEN = 4
#: Seconds between the scheduler's looks for files past their expiry.
EXPIRY_SECONDS = 30.0
#: How a stopped batch ends: its status -> the code of the requests it did not run.
UNANSWERED_CODE = {Status.CANCELLED: ErrorCode.BATCH_CANCELLED.value, Status.EXPIRED: ErrorCode.BATCH_EXPIRED.value}


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@dataclass
class _Running:
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

    def request_stop(self, why: Status) -> None:
        if self.stop is None and not self.ending:
            log.info("batch %s: stopping (%s)", self.batch_id, why.value)
            self.stop = why


def has_room(running: list[_Running], priority: Optional[str], max_running: int) -> bool:
    """Whether a batch of ``priority`` may start beside the ``running`` ones: ``max_running`` run at once, and one
    high-priority batch more (it runs beside them on the same engines, so a small urgent batch does not wait for a
    large one to end; the large one goes on). A run that is ending the batch early takes no room."""
    live = [r for r in running if not r.ending]
    if len(live) < max_running:
        return True
    return priority == "high" and len(live) == max_running and not any(r.priority == "high" for r in live)


def to_pause(running: list[_Running]) -> list[_Running]:
    """The runs that yield their task slots to a high-priority batch now: those of other priorities that may infer
    and have committed a wave since they last yielded (so that a stream of urgent batches does not starve one)."""
    return [r for r in running
            if not r.ending and r.priority != "high" and r.committed_since_yield and r.may_infer.is_set()]


class _Progress(RunListener):
    """A run's progress into the store: in_progress once validated, counts as waves commit, finalizing at the
    end; at each of these points a requested stop ends the run (:class:`BatchStopped`)."""

    def __init__(self, store: Store, running: _Running):
        self.store, self.running = store, running

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
        counts = dict(total=total, failed=invalid, completed=answered)
        if self.store.move(self.running.batch_id, Status.IN_PROGRESS, **counts) is None:  # a resumed run
            self.store.update(self.running.batch_id, **counts)

    def committed(self, responses: int, errors: int) -> None:
        self.running.committed_since_yield = True
        self.store.add_counts(self.running.batch_id, completed=responses, failed=errors)
        self._check()

    def finalizing(self) -> None:
        self.store.move(self.running.batch_id, Status.FINALIZING)

    def before_wave(self) -> int:
        while not self.running.may_infer.wait(TICK_SECONDS):
            self._check()  # a cancel while it yields
        self._check()
        return self.running.yields

    def yielded(self, since: int) -> bool:
        return self.running.yields != since


class _LeaseWatch(RunListener):
    """The listener of a run that ends a batch early: it only stops when the lease goes to another server."""

    def __init__(self, running: _Running):
        self.running = running

    def _check(self) -> None:
        if self.running.lost:
            raise BatchStopped("lease lost")

    def validated(self, total: int, invalid: int, answered: int) -> None:
        self._check()

    def committed(self, responses: int, errors: int) -> None:
        self._check()


class Scheduler:
    """Runs the batches of ``store`` on the session ``session()`` makes (in the scheduler's thread, so that the API
    answers while Spark starts). :meth:`wake` after a batch is created or cancelled."""

    def __init__(self, base: BatchConfig, settings: ServiceSettings, store: Store, files: FileStorage,
                 session: Callable[[], Any]):
        self.base, self.settings, self.store, self.files = base, settings, store, files
        self._session = session
        self.holder = settings.server()  #: this server's name in the leases it holds
        self._renewed_at = self._held_at = time.time()
        self._expired_at = 0.0
        self.spark: Any = None
        self.ready = threading.Event()  #: the Spark session is up
        self.startup_error: Optional[BaseException] = None
        self._running: dict[str, _Running] = {}
        #: a high-priority batch's id -> the runs paused for it and the timer that lets them go on
        self._yielding: dict[str, tuple[list[_Running], threading.Timer]] = {}
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
            running.halted = True
            running.may_infer.set()  # a run that yields ends now, at its check
            if self.spark is not None:
                cancel_batch_jobs(self.spark, running.batch_id)
        deadline = time.time() + timeout
        for running in list(self._running.values()):
            if running.thread is not None:
                running.thread.join(max(0.0, deadline - time.time()))
        self._thread.join(max(0.0, deadline - time.time()))
        for running in list(self._running.values()):  # another server may resume them now
            with contextlib.suppress(Exception):
                self.store.release(running.batch_id, self.holder)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.spark = self._session()
        except BaseException as exc:  # the server answers, and says why nothing runs
            self.startup_error = exc
            log.error("the Spark session could not start: %s", describe_exception(exc))
            return
        self.ready.set()
        failing = False
        while not self._stopping.is_set():
            try:
                self._tick()
                failing = False
            except sqlalchemy.exc.DBAPIError as exc:  # the database is out of reach: the next tick tries again
                if not failing:
                    log.warning("the database is out of reach (%s); trying again", str(exc).splitlines()[0])
                failing = True
            except Exception:
                log.exception("scheduler tick failed")
            self._wake.wait(TICK_SECONDS)
            self._wake.clear()

    def _tick(self) -> None:
        now = time.time()
        for running in [r for r in self._running.values() if r.thread is not None and not r.thread.is_alive()]:
            del self._running[running.batch_id]
        self._renew(now)
        if now - self._expired_at >= EXPIRY_SECONDS:
            self._expired_at = now
            self.expire_files(now)
        for batch in queue_order(self.store.unfinished()):
            ends = self._ends_early(batch, now)
            running = self._running.get(batch.id)
            if running is not None:
                if ends is not None:
                    running.request_stop(ends)
                if (running.stop is not None and not running.ending) or running.lost:
                    cancel_batch_jobs(self.spark, batch.id)  # again each tick: a job the run started meanwhile
                continue
            if self._stopping.is_set():
                return
            if batch.lease_holder not in (None, self.holder) and (batch.lease_until or 0) > now:
                continue  # another server runs it
            lease = self.settings.lease_seconds
            if ends is not None:  # a short run without the engines: not counted against max_running_batches
                if self.store.claim(batch.id, self.holder, lease):
                    self._launch(batch, lambda b, r, why=ends: self._end_early(b, r, why), ending=True)
            elif self._has_room(batch):
                if batch.runs == 0 and self.refused_for_tokens(batch):
                    continue
                if self.store.claim(batch.id, self.holder, lease):
                    if batch.priority == "high":
                        self._yield_to(batch)
                    self._launch(self.store.batch(batch.id) or batch, self._run)

    def expire_files(self, now: Optional[float] = None) -> list[str]:
        """Delete the files past their ``expires_after`` (input files no unfinished batch reads, output and error
        files past the batch's ``output_expires_after``): bytes and record, as OpenAI deletes them; the batches'
        rows in the Delta tables stay. The ids deleted."""
        gone = []
        for record in self.store.expired_files(now or time.time()):
            self.files.delete(record.location)
            self.store.delete_file(record.id)
            audit("file.expired", owner=record.owner, file=record.id, bytes=record.bytes)
            gone.append(record.id)
        return gone

    def _renew(self, now: float) -> None:
        """Renew the leases of the batches this server runs, every sixth of ``lease_seconds``; a run whose lease
        went to another server, or every run when the database could not be reached for most of a lease, stops."""
        lease = self.settings.lease_seconds
        if not self._running:
            self._held_at = now  # nothing held: the database's reach is measured from the next run on
            return
        if now - self._renewed_at < lease / 6:
            return
        self._renewed_at = now
        ids = [r.batch_id for r in self._running.values() if not r.lost and not r.done]
        try:
            held = self.store.renew(ids, self.holder, lease)
            self._held_at = now
        except Exception as exc:
            if now - self._held_at < 0.8 * lease:
                log.warning("could not renew the batches' leases (%s); trying again", describe_exception(exc))
                return
            log.error("the database was out of reach for %.0fs: stopping this server's runs before their leases "
                      "run out (another server resumes them)", now - self._held_at)
            held = set()
        for running in self._running.values():
            if running.batch_id in ids and running.batch_id not in held:
                log.warning("batch %s: its lease went to another server; stopping this run", running.batch_id)
                running.lost = True
                cancel_batch_jobs(self.spark, running.batch_id)

    def _has_room(self, batch: BatchRecord) -> bool:
        return has_room(list(self._running.values()), batch.priority, self.settings.max_running_batches)

    def _yield_to(self, urgent: BatchRecord) -> None:
        """The running batches pause their inference for the high-priority ``urgent`` one (:func:`cancel_waves`):
        with the slots to itself it takes about its time on an idle server (FAIR pools alone leave its every
        Spark job waiting for an inference task of the others to end a partition: 32 s instead of 2.9 s for 15
        lines beside a 20,000-line batch here). They go on when it ends, or after ``max_yield_seconds``; a run
        yields again only after committing a wave, so a stream of urgent batches does not starve it."""
        if not self.settings.max_yield_seconds:
            return
        pausing = to_pause(list(self._running.values()))
        for running in pausing:
            log.info("batch %s: yields its task slots to the high-priority batch %s", running.batch_id, urgent.id)
            running.yields += 1
            running.committed_since_yield = False
            running.may_infer.clear()
            cancel_waves(self.spark, running.batch_id)
        if pausing:
            timer = threading.Timer(self.settings.max_yield_seconds, self._go_on, args=(pausing,))
            timer.daemon = True
            timer.start()
            self._yielding[urgent.id] = (pausing, timer)

    def _go_on(self, paused: list[_Running]) -> None:
        for running in paused:
            running.may_infer.set()

    def refused_for_tokens(self, batch: BatchRecord) -> bool:
        """Fail ``batch`` with ``token_limit_exceeded`` when it and its key's other unfinished batches hold more
        input tokens than the key's ``max_enqueued_tokens`` (estimated as bytes / 4, before the batch is read)."""
        limit = self.settings.policy(batch.owner).max_enqueued_tokens
        if limit is None:
            return False
        tokens = {}
        for other in self.store.unfinished_of(batch.owner):
            source = self.store.file(other.input_file_id)
            tokens[other.id] = (source.bytes if source else 0) // BYTES_PER_TOKEN
        if sum(tokens.values()) <= limit:
            return False
        message = (f"Enqueued token limit reached: this key's unfinished batches hold about {sum(tokens.values()):,} "
                   f"input tokens with this one ({tokens.get(batch.id, 0):,}); its limit is {limit:,} enqueued "
                   "tokens. Try submitting fewer requests, or wait for earlier batches to complete.")
        errors = BatchErrors(data=[{"code": TOKEN_LIMIT_EXCEEDED, "message": message}], total=1)
        self.store.move(batch.id, Status.FAILED, errors=errors.model_dump(exclude_none=True))
        log.info("batch %s: failed: %s", batch.id, message)
        return True

    @staticmethod
    def _ends_early(batch: BatchRecord, now: float) -> Optional[Status]:
        if batch.status is Status.CANCELLING:
            return Status.CANCELLED
        if batch.expired(now) and batch.status in (Status.VALIDATING, Status.IN_PROGRESS):
            return Status.EXPIRED
        return None

    def _launch(self, batch: BatchRecord, body: Callable[[BatchRecord, _Running], None], ending: bool = False) -> None:
        from pyspark import InheritableThread

        running = self._running[batch.id] = _Running(batch.id, ending=ending, priority=batch.priority)
        running.thread = InheritableThread(target=self._guarded, args=(body, batch, running),
                                           name=f"spark_llm-{batch.id}", daemon=True)
        running.thread.start()

    def _guarded(self, body: Callable[[BatchRecord, _Running], None], batch: BatchRecord, running: _Running) -> None:
        try:
            body(batch, running)
        except Exception:
            log.exception("batch %s: the scheduler failed on it", batch.id)
        finally:
            running.done = True
            paused, timer = self._yielding.pop(batch.id, ([], None))
            if timer is not None:
                timer.cancel()
            self._go_on(paused)
            if not running.lost and not self._stopping.is_set():
                with contextlib.suppress(Exception):
                    self.store.release(batch.id, self.holder)
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
            finish_unanswered=finish_unanswered, priority=batch.priority or "normal",
            media_files=self.images_of(batch.owner),
            target_tokens_per_partition=min(self.base.target_tokens_per_partition,
                                            self.settings.max_partition_tokens)))

    def images_of(self, owner: str) -> dict[str, str]:
        """``owner``'s uploaded images (purpose vision), which its batches' Responses lines may name by file_id:
        file id -> where it is stored. Another key's are not among them."""
        images, _ = self.store.files(owner, "vision", 1_000_000, None, False)
        return {f.id: f.location for f in images}

    def _run(self, batch: BatchRecord, running: _Running) -> None:
        from ..pipeline import run_batch

        self.store.update(batch.id, runs=batch.runs + 1)
        log.info("batch %s: run %d starts", batch.id, batch.runs + 1)
        try:
            result = run_batch(self.spark, self.config(batch, resume=batch.runs > 0), _Progress(self.store, running))
        except BaseException as exc:
            if running.lost:
                log.info("batch %s: left to the server that holds it now", batch.id)
            elif isinstance(exc, sqlalchemy.exc.DBAPIError):  # not the batch's fault: it runs again, resuming
                log.warning("batch %s: the database went out of reach during its run; it resumes later", batch.id)
            elif running.stop is not None:
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
            result = run_batch(self.spark, self.config(batch, resume=True, finish_unanswered=UNANSWERED_CODE[why]),
                               _LeaseWatch(running))
        except BaseException as exc:
            if not self._stopping.is_set() and not running.lost:
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
