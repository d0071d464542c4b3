"""The scheduler: owns the server's Spark session and, in one loop, runs each batch as the job runs it,
``max_running_batches`` at a time, in the queue's order; the API never touches Spark. Its three halves have a module
each: what to start, pause or end is decided by the pure policies of :mod:`.queue`; a batch's run (the job, its
progress into the store, its end) is :mod:`.runs`; the hold on a batch among several servers is :mod:`.leases`.

Everything it needs is in the store and under the storage root: a server started again (after a crash or
``kill -9``) picks up every batch that is not final, and a batch that had started runs again, resuming."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import sqlalchemy.exc

from ..batch import TOKEN_LIMIT_EXCEEDED, BatchErrors
from ..config import BatchConfig
from ..context import cancel_batch_jobs, cancel_waves
from ..errors import describe_exception
from .audit import audit
from .capacity import GpuHold, engines_to_hold
from .files import FileStorage
from .leases import Leases, held_elsewhere
from .lifecycle import Status
from .queue import ends_early, has_room, over_token_limit, queue_order, to_pause
from .runs import BatchRunner, Run
from .settings import ServiceSettings
from .store import BatchChange, BatchRecord, Store

log = logging.getLogger(__name__)

#: Seconds between the scheduler's looks at the store when nothing wakes it.
TICK_SECONDS = 0.5
#: Bytes of a batch input file per input token, for the enqueued-token limit (JSONL around English text).
BYTES_PER_TOKEN = 4
#: Seconds between the scheduler's looks for files past their expiry.
EXPIRY_SECONDS = 30.0


class Scheduler:
    """Runs the batches of ``store`` on the session ``session()`` makes (in the scheduler's thread, so that the API
    answers while Spark starts). :meth:`wake` after a batch is created or cancelled."""

    def __init__(self, base: BatchConfig, settings: ServiceSettings, store: Store, files: FileStorage,
                 session: Callable[[], Any]):
        self.base, self.settings, self.store, self.files = base, settings, store, files
        self._session = session
        self.holder = settings.server()  #: this server's name in the leases it holds
        self.leases = Leases(store, self.holder, settings.lease_seconds, time.time())
        self._expired_at = 0.0
        self.spark: Any = None
        self.ready = threading.Event()  #: the Spark session is up
        self.startup_error: Optional[BaseException] = None
        self._running: dict[str, Run] = {}
        #: a high-priority batch's id -> the runs paused for it and the timer that lets them go on
        self._yielding: dict[str, tuple[list[Run], threading.Timer]] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: the hold on an elastic cluster's GPU executors while batches wait (None: their GPUs are not elastic)
        self.hold: Optional[GpuHold] = None
        self._hold_lock = threading.Lock()  #: a run's first wave and the loop's look at the backlog, one at a time
        self._tokens: dict[str, int] = {}  #: each unfinished batch's estimated input tokens
        self.runner = BatchRunner(base, settings, store, files, self._stopping)
        self._thread = threading.Thread(target=self._loop, name="spark_llm-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop running batches without ending them (a server started again resumes them) and the loop."""
        self._stopping.set()
        self._wake.set()
        live = [r for r in self._running.values() if not r.done]
        if self.hold is not None:
            self.hold.release()
        for running in live:
            running.halted = True
            running.may_infer.set()  # a run that yields ends now, at its check
            if self.spark is not None:
                try:
                    cancel_batch_jobs(self.spark, running.batch_id)
                except Exception as exc:  # the JVM went with the signal that stops the server: its jobs too
                    log.info("batch %s: its Spark jobs could not be cancelled (%s)", running.batch_id,
                             type(exc).__name__)  # its text may need the JVM too
        deadline = time.time() + timeout
        for running in live:
            if running.thread is not None:
                running.thread.join(max(0.0, deadline - time.time()))
        self._thread.join(max(0.0, deadline - time.time()))
        for running in live:  # another server may resume them now
            self.leases.release(running.batch_id)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.spark = self._session()
        except BaseException as exc:  # the server answers, and says why nothing runs
            self.startup_error = exc
            log.error("the Spark session could not start: %s", describe_exception(exc))
            return
        try:
            self.hold = GpuHold.of(self.spark, self.base)
        except Exception as exc:  # the batches' runs report settings that do not resolve
            log.info("no hold on GPU executors: %s", describe_exception(exc))
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
        for running in self.leases.renew(list(self._running.values()), now):
            cancel_batch_jobs(self.spark, running.batch_id)
        if now - self._expired_at >= EXPIRY_SECONDS:
            self._expired_at = now
            self.expire_files(now)
        weights = {policy.owner: policy.weight for policy in self.settings.policies().values()}
        unfinished = self.store.unfinished()
        for batch in queue_order(unfinished, weights):
            ends = ends_early(batch, now)
            running = self._running.get(batch.id)
            if running is not None:
                if ends is not None:
                    running.request_stop(ends)
                if (running.stop is not None and not running.ending) or running.lost:
                    cancel_batch_jobs(self.spark, batch.id)  # again each tick: a job the run started meanwhile
                continue
            if self._stopping.is_set():
                return
            if held_elsewhere(batch, self.holder, now):
                continue  # another server runs it
            if ends is not None:  # a short run without the engines: not counted against max_running_batches
                if self.leases.claim(batch.id):
                    self._launch(batch, lambda b, r, why=ends: self.runner.end_early(self.spark, b, r, why),
                                 ending=True)
            elif has_room(list(self._running.values()), batch.priority, self.settings.max_running_batches):
                if batch.runs == 0 and self.refused_for_tokens(batch):
                    continue
                if self.leases.claim(batch.id):
                    if batch.priority == "high":
                        self._yield_to(batch)
                    self._launch(self.store.batch(batch.id) or batch,
                                 lambda b, r: self.runner.run(self.spark, b, r))
        self._hold_for_backlog(unfinished, now)

    def _hold_for_backlog(self, unfinished: list[BatchRecord], now: float) -> None:
        """On an elastic cluster, hold the GPU engine slots the waiting batches would fill
        (:func:`~.capacity.engines_to_hold`: their input tokens, estimated from their files' bytes) while no batch
        of this server runs inference waves; a batch's first wave lets them go (:attr:`Run.on_infer`), and once
        its last wave has ended the hold takes the executors again, within a tick, well inside an idle timeout
        (while its waves' tasks still wait, the hold's would take their slots: Spark's fair pools share them)."""
        if self.hold is None:
            return
        runs = self._running
        waiting = [b for b in unfinished
                   if not held_elsewhere(b, self.holder, now) and b.status is not Status.CANCELLING
                   and not (b.id in runs and (runs[b.id].has_inferred or runs[b.id].ending))]
        self._tokens = {b.id: self._tokens[b.id] if b.id in self._tokens else self._input_tokens(b) for b in waiting}
        target = min(self.base.target_tokens_per_partition, self.settings.max_partition_tokens)
        with self._hold_lock:
            if self._stopping.is_set() or any(r.inferring and not r.done for r in runs.values()):
                self.hold.release()
            else:
                self.hold.hold(engines_to_hold(sum(self._tokens.values()), target, self.hold.engines))

    def _let_go(self, running: Run) -> None:
        """A run's first wave is about to start: the GPU executors held for the backlog are its now."""
        with self._hold_lock:
            running.inferring = running.has_inferred = True
            if self.hold is not None:
                self.hold.release()

    def _input_tokens(self, batch: BatchRecord) -> int:
        source = self.store.file(batch.input_file_id)
        return (source.bytes if source else 0) // BYTES_PER_TOKEN

    def expire_files(self, now: Optional[float] = None) -> list[str]:
        """Delete the files past their ``expires_after`` (input files no unfinished batch reads, output and error
        files past the batch's ``output_expires_after``): bytes and record, as OpenAI deletes them; the batches'
        rows in the Delta tables stay. The ids deleted."""
        gone = []
        for record in self.store.expired_files(now or time.time()):
            if self.store.delete_file(record.id) is not None:
                continue  # a batch created over it meanwhile reads it
            self.files.delete(record.location)
            audit("file.expired", owner=record.owner, file=record.id, bytes=record.bytes)
            gone.append(record.id)
        return gone

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

    def _go_on(self, paused: list[Run]) -> None:
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
        message = over_token_limit(tokens, batch.id, limit)
        if message is None:
            return False
        errors = BatchErrors(data=[{"code": TOKEN_LIMIT_EXCEEDED, "message": message}], total=1)
        self.store.move(batch.id, Status.FAILED, BatchChange(errors=errors))
        log.info("batch %s: failed: %s", batch.id, message)
        return True

    def _launch(self, batch: BatchRecord, body: Callable[[BatchRecord, Run], None], ending: bool = False) -> None:
        from pyspark import InheritableThread

        running = self._running[batch.id] = Run(batch.id, ending=ending, priority=batch.priority,
                                                on_infer=self._let_go)
        running.thread = InheritableThread(target=self._guarded, args=(body, batch, running),
                                           name=f"spark_llm-{batch.id}", daemon=True)
        running.thread.start()

    def _guarded(self, body: Callable[[BatchRecord, Run], None], batch: BatchRecord, running: Run) -> None:
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
                self.leases.release(batch.id)
            self._wake.set()
