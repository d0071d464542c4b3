"""The inference stage, driver side: plan token-balanced partitions, then infer them a wave at a time.

Each wave runs its planned partitions through :func:`~spark_llm.infer.infer_partition` (one ``mapInPandas`` task
per partition), stages the results once as Parquet, checks that every planned request has exactly one result, and
commits them to the outputs and errors tables (one append each, at the same time as the partitions' records go to the
metrics table). Waves overlap (:data:`WAVES_IN_FLIGHT`): the engines start the next wave while the last one's
slowest partitions finish, and finished waves are committed from threads of their own, in wave order
(:data:`COMMITS_IN_FLIGHT`), while the next ones infer. A crash loses at most the waves not yet committed;
``--resume`` continues from the last commit.

In a local session the engines hold every task slot, so a commit's tasks and a wave's shuffle can only run when an
engine's task ends: there they run in a fair-scheduler pool served first (``session.scheduler_pool``), and a wave's
shuffle runs when the wave is submitted (a local checkpoint), not when its first task would start.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from . import faults, storage, write
from .background import EngineJob, SparkJobInBackground
from .batch import RunPlan
from .context import RunContext, waves_tag
from .infer import InferContext, infer_partition
from .metrics import ProgressReporter, progress_line
from .partition import PART_COL, PartitionPlan, materialize, plan_in_process, plan_partitions, plan_settings
from .prepare import LocalRows, Outcomes
from .schemas import RESULT_SCHEMA, PartitionRecord
from .session import FIRST_POOL, URGENT_POOL, WAVES_POOL, scheduler_pool
from .session_info import is_connect
from .warmup import EngineWarmup

log = logging.getLogger(__name__)

#: Columns of a planned request the inference task reads.
INFER_INPUT = ("id", "request_id", "custom_id", "file", "line_number", "url", "kind", "request", "sampling_json",
               "options_json", "prompt_token_ids", "prompt_tokens", "notes", PART_COL)


@dataclass(frozen=True)
class Wave:
    number: int
    of: int
    first: int   #: first planned partition
    count: int   #: planned partitions in this wave

    @property
    def label(self) -> str:
        return f"{self.number}/{self.of}" if self.of else str(self.number)  # of 0: the run's count not known yet


def waves_of(num_partitions: int, per_wave: int, before: int = 0) -> list[Wave]:
    """The waves over ``num_partitions`` planned partitions, numbered after the ``before`` waves of the run."""
    starts = range(0, num_partitions, per_wave)
    return [Wave(before + n, before + len(starts), first, min(per_wave, num_partitions - first))
            for n, first in enumerate(starts, 1)]


#: Waves whose inference runs at once: while the last tasks of one wave run, free task slots start the next wave's,
#: and a finished wave is committed while the next one infers.
WAVES_IN_FLIGHT = 2
#: Finished waves whose commits run or wait at once (in wave order): a commit never holds up submitting the next
#: wave, and a crash loses at most these and the waves in flight.
COMMITS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Committed:
    """What waves committed: the metrics table's new rows (as it got them: see write.metrics_rows) and the number
    of error rows and of outputs."""

    records: tuple[PartitionRecord, ...] = ()
    error_rows: int = 0
    responses: int = 0

    def __add__(self, other: "Committed") -> "Committed":
        return Committed(self.records + other.records, self.error_rows + other.error_rows,
                         self.responses + other.responses)


@dataclass(frozen=True)
class Inferred:
    """What a run's inference did: its partition plan (batch.json's ``partition_plan``; None when nothing reached
    inference) and what it committed."""

    plan: Optional[RunPlan] = None
    committed: Committed = Committed()


@dataclass(frozen=True)
class Numbering:
    """Waves and partitions the run numbered before this model's (a batch of several models numbers them across
    all its models, so that the metrics table and the journals tell every partition of a run apart)."""

    waves: int = 0
    partitions: int = 0


def infer_models(run: RunContext, valid: DataFrame, warmup: Optional[EngineWarmup] = None,
                 local: Optional[LocalRows] = None) -> Inferred:
    """Infer every valid request model by model (all partitions of one model, then the next: each engine slot
    loads each model once); the plan has one plan per model under ``models`` when the batch has several.
    ``local``: the plan columns of ``valid``'s rows, when this process holds them (planned here)."""
    if len(run.models) == 1:
        return infer_in_waves(run, valid, warmup, planned_here=local.valid() if local is not None else None)
    counts = local.valid_per_model() if local is not None else {
        r["model"]: int(r["count"]) for r in valid.groupBy("model").count().collect()}  # a row per model
    plans: dict[str, RunPlan] = {}
    committed = Committed()
    numbering = Numbering()
    for cfg in run.models:
        name = cfg.served_model_name or ""
        if not counts.get(name):
            continue
        if warmup is not None and cfg is not run.models[0]:
            warmup.close()  # it loads the main model, which has nothing to do
        log.info("batch %s: model %s: %d requests", run.batch_id, name, counts[name])
        inferred = infer_in_waves(run.for_model(cfg), valid.where(F.col("model") == name),
                                  warmup if cfg is run.models[0] else None, numbering,
                                  local.valid(name) if local is not None else None)
        plan = plans[name] = inferred.plan
        committed += inferred.committed
        numbering = Numbering(numbering.waves + plan.waves, numbering.partitions + plan.num_partitions)
    return Inferred(RunPlan.of_models(plans), committed)


@dataclass(frozen=True)
class _Part:
    """Requests planned together (all of a model's, or a part of an input prepared in parts), their plan, and the
    inference tasks' context, whose partition numbers follow the run's earlier parts'."""

    valid: DataFrame
    plan: PartitionPlan
    ictx: InferContext
    waves: int


#: What the waves of an input prepared in parts ask for once the first part's first wave infers: the rest, as
#: (the run, whose later writes wait for the rest's validation errors; its valid requests; their plan columns).
Rest = Callable[[], tuple[RunContext, DataFrame, Any]]


def infer_in_waves(run: RunContext, valid: DataFrame, warmup: Optional[EngineWarmup] = None,
                   numbering: Numbering = Numbering(), planned_here: Any = None,
                   rest: Optional[Rest] = None) -> Inferred:
    """Infer every valid request (rows with ``est_tokens``) of one model (``run.cfg``) and commit the results.
    ``valid`` is read by the planning and by every wave: a filter of a persisted frame.
    ``planned_here``: the plan columns of ``valid``'s rows (:class:`~spark_llm.prepare.LocalRows`), when this
    process holds them: planned here, without Spark jobs. ``rest``: when ``valid`` is the first part of an input
    prepared in parts (:func:`~spark_llm.prepare.prepare_in_parts`), the rest, asked for once the first wave is
    submitted and planned after it; no wave is committed before (the run's validation comes with the rest).

    Waves are pipelined: wave k+1 is submitted (a Spark job of its own, from a driver thread) while wave k still
    runs, so no engine waits for the slowest partition of a wave; when wave k ends, wave k+2 is submitted and wave
    k's commit starts in the background, so the engines always have the next wave while earlier ones commit.
    Commits stay one at a time and in wave order; a crash loses at most the waves not yet committed."""
    if warmup is not None:
        warmup.wait()
    return _WaveLoop(run, numbering).run(valid, planned_here, rest)


class _WaveLoop:
    """The waves of one model's requests as :func:`infer_in_waves` runs them: the parts planned, the waves not yet
    submitted (``queue``), those inferring (``in_flight``, at most :data:`WAVES_IN_FLIGHT`) and the commits running
    or waiting (``commits``, at most :data:`COMMITS_IN_FLIGHT`)."""

    def __init__(self, run: RunContext, numbering: Numbering):
        self.ctx, self.numbering = run, numbering  # ctx: the run's, replaced by the rest's once it is prepared
        self.target, self.aware = plan_settings(run.cfg, run.layout), run.cfg.prefix_aware_partitions
        self.per_wave = run.cfg.wave_partitions or 2 * run.layout.tasks
        self.parts: list[_Part] = []
        self.queue: deque[tuple[_Part, Wave]] = deque()
        self.in_flight: deque[_WaveJob] = deque()
        self.commits: deque[_CommitJob] = deque()
        self.committed = Committed()  # by the waves committed so far
        self.wave_label = ""  # the wave submitted last, for the progress line

    def run(self, valid: DataFrame, planned_here: Any, rest: Optional[Rest]) -> Inferred:
        first = self._plan(valid, planned_here, self.numbering, count_known=rest is None)
        self.wave_label = Wave(self.numbering.waves, self.queue[-1][1].of if self.queue else 0, 0, 0).label
        try:
            with ProgressReporter(self._progress, self.ctx.cfg.progress_interval_seconds):
                while self.queue:
                    self._submit_next()
                    if rest is not None:  # the first wave infers while the rest is prepared
                        self._plan_the_rest(rest, len(first))
                        rest = None
                while self.in_flight:
                    self._commit(self._oldest_finished())
                self.ctx.listener.inference_ended()
                while self.commits:
                    self._count(self.commits.popleft())
            storage.delete(self.ctx.spark, self.ctx.paths.staging)
        except BaseException:
            self.ctx.cancel_jobs()  # the waves still inferring
            for job in [*self.in_flight, *self.commits]:
                job.thread.join()
            raise
        return Inferred(RunPlan.joined([RunPlan(**p.plan.as_dict(), waves=p.waves) for p in self.parts]),
                        self.committed)

    def _plan(self, valid: DataFrame, here: Any, before: Numbering, count_known: bool = True) -> list[Wave]:
        """Plan ``valid``'s partitions and queue their waves, numbered after ``before``'s; without
        ``count_known``, the run's count of waves is not known yet (it comes with the rest)."""
        self.ctx.describe("plan partitions")
        plan = plan_in_process(here, self.target, prefix_aware=self.aware) if here is not None else \
            plan_partitions(valid, self.target, prefix_aware=self.aware)
        waves = waves_of(plan.num_partitions, self.per_wave, before.waves)
        part = _Part(valid, plan, InferContext.of_run(self.ctx, before.partitions), len(waves))
        self.parts.append(part)
        self.queue.extend((part, w if count_known else replace(w, of=0)) for w in waves)
        return waves

    def _plan_the_rest(self, ask: Rest, first_waves: int) -> None:
        """The rest of an input prepared in parts, planned after the waves of the first part."""
        self.ctx, valid_rest, here = ask()
        first = self.parts[0]
        done = Numbering(self.numbering.waves + first_waves, self.numbering.partitions + first.plan.num_partitions)
        more = self._plan(valid_rest, here, done) if here.num_rows else []
        total = self.numbering.waves + first_waves + len(more)
        for i, (p, w) in enumerate(self.queue):  # every wave not yet submitted, with the run's count
            self.queue[i] = (p, replace(w, of=total))

    def _submit_next(self) -> None:
        """Submit the next queued wave; when as many waves as may are inferring, the oldest's end first (its slots
        are free: the next wave takes them before the oldest is committed)."""
        part, wave = self.queue.popleft()
        done = self._oldest_finished() if len(self.in_flight) == WAVES_IN_FLIGHT else None
        self.in_flight.append(self._submit(part, wave))
        self.wave_label = wave.label
        if done is not None:
            self._commit(done)

    def _submit(self, part: _Part, wave: Wave) -> "_WaveJob":
        epoch = self.ctx.listener.before_wave()
        # the calls of a wave cancelled for a yield left in-flight markers that are no engine deaths: after a yield
        # the partitions keep their journals apart (a real poison request is found again there)
        journal = f"{part.ictx.journal}/yield-{epoch}" if epoch and part.ictx.journal else part.ictx.journal
        return _WaveJob(self.ctx, part, wave, replace(part.ictx, wave=wave.number, journal=journal), epoch)

    def _oldest_finished(self) -> "_WaveJob":
        """The oldest wave in flight once it has ended, popped. When the run yielded its slots meanwhile (the
        waves were cancelled), every wave in flight that did not end runs again, in order, when the run may."""
        while True:
            job = self.in_flight[0]
            try:
                job.wait()
                return self.in_flight.popleft()
            except Exception:
                if not self.ctx.listener.yielded(job.epoch):
                    raise
            log.info("batch %s: wave %s yielded its task slots to a more urgent batch; it runs again",
                     self.ctx.batch_id, job.wave.label)
            for i, other in enumerate(self.in_flight):
                other.thread.join()
                if other.error is not None:  # cancelled (a real failure fails again)
                    self.in_flight[i] = self._submit(other.part, other.wave)

    def _commit(self, job: "_WaveJob") -> None:
        """Commit a finished wave in the background, after the one before; a bounded number at a time."""
        self.commits.append(_CommitJob(self.ctx, job, self.commits[-1] if self.commits else None))
        while len(self.commits) > COMMITS_IN_FLIGHT or (self.commits and not self.commits[0].thread.is_alive()):
            self._count(self.commits.popleft())

    def _count(self, job: "_CommitJob") -> None:
        wave = job.result()
        self.committed += wave
        self.ctx.listener.committed(wave.responses, wave.error_rows)

    def _progress(self) -> str:
        """The progress line: live from the tasks where the session has accumulators, else as the waves commit
        (Spark Connect)."""
        run, model = self.ctx, self.ctx.cfg.served_model_name
        label = run.batch_id if len(run.models) < 2 else f"{run.batch_id} ({model})"  # several models: one each
        records = [r for r in (run.metrics.value if run.metrics is not None else self.committed.records)
                   if r.model == model]
        total = sum(sum(p.plan.requests_per_partition) for p in self.parts)
        return progress_line(label, records, total, run.started, self.wave_label)


class _WaveJob(EngineJob):
    """One wave's inference, a Spark job of its own, its results staged as Parquet."""

    def __init__(self, run: RunContext, part: _Part, wave: Wave, ictx: InferContext, epoch: int = 0):
        self.part, self.wave, self.staging = part, wave, f"{run.paths.staging}/wave-{wave.number}"
        self.epoch = epoch  #: the run's yield count when it was submitted (RunListener.yielded)
        super().__init__(run.spark, f"spark_llm-wave-{wave.number}", lambda: self._infer(run, ictx))

    def _infer(self, run: RunContext, ictx: InferContext) -> None:
        run.describe(f"infer wave {self.wave.label}")
        tag = waves_tag(run.batch_id)  # this thread's jobs only, so that cancel_waves leaves the commits alone
        run.spark.addTag(tag) if is_connect(run.spark) else run.spark.sparkContext.addJobTag(tag)
        requests = materialize(self.part.valid, self.part.plan, self.wave.first, self.wave.count).select(*INFER_INPUT)
        if ictx.place.local_engines:  # a local session: its engines hold every task slot
            with scheduler_pool(run.spark, FIRST_POOL):
                requests = requests.localCheckpoint(eager=True)  # the shuffle now, not when an engine waits for it
        results = requests.mapInPandas(lambda it: infer_partition(it, ictx), RESULT_SCHEMA, profile=run.gpu_profile)
        pool = URGENT_POOL if run.cfg.priority == "high" else WAVES_POOL
        with scheduler_pool(run.spark, pool):  # in order, beside the commits' pool
            results.write.mode("overwrite").parquet(self.staging)


class _CommitJob(SparkJobInBackground):
    """A finished wave's commit (:func:`_commit`) from a driver thread of its own, after the commit of the wave
    before (``after``; one that failed stops this one), so that committing never holds up the next waves."""

    def __init__(self, run: RunContext, job: _WaveJob, after: Optional["_CommitJob"]):
        super().__init__(run.spark, f"spark_llm-commit-{job.wave.number}", lambda: self._run_after(run, job, after))

    @staticmethod
    def _run_after(run: RunContext, job: _WaveJob, after: Optional["_CommitJob"]) -> Committed:
        if after is not None:
            after.wait()
        return _commit(run, job.part.plan, job)

    def result(self) -> Committed:
        """Wait for the commit; what it committed."""
        return self.wait()


def _commit(run: RunContext, plan: PartitionPlan, job: _WaveJob) -> Committed:
    """Wait for a wave's inference, check that every planned request has one result, commit them to both tables
    and the partitions' records to the metrics table."""
    job.wait()
    with scheduler_pool(run.spark, FIRST_POOL):  # the next free task slot, not the last
        return _commit_staged(run, plan, job)


def _commit_staged(run: RunContext, plan: PartitionPlan, job: _WaveJob) -> Committed:
    wave = job.wave
    run.describe(f"commit wave {wave.label}")
    staged = run.spark.read.schema(RESULT_SCHEMA).parquet(job.staging)  # as written: no job to infer it
    faults.before_commit(staged)
    planned = sum(plan.requests_per_partition[wave.first:wave.first + wave.count])
    got, records = _staged_outcomes(staged)
    if got.rows != planned:  # the conservation check: one result per planned request
        raise RuntimeError(f"wave {wave.label}: {got.rows} results for {planned} planned requests; nothing of this "
                           f"wave was committed, rerun with --resume")
    rows = write.commit_wave(run, staged, got.ok, got.errors, records, plan)
    log.info("batch %s: wave %s committed (%d partitions)", run.batch_id, wave.label, wave.count)
    faults.maybe_exit_after_wave(wave.number)
    return Committed(tuple(rows), got.errors, got.ok)


def _staged_outcomes(staged: DataFrame) -> tuple[Outcomes, list[PartitionRecord]]:
    """Rows and error rows of a staged wave and its partitions' metrics records, in one aggregate (one row, one
    small record per partition, reaches the driver)."""
    r = staged.agg(F.count(F.lit(1)).alias("rows"), F.count("error_code").alias("errors"),
                   F.collect_list("partition_metrics").alias("records")).first()
    records = sorted((PartitionRecord.from_json(x) for x in r["records"]), key=lambda rec: rec.partition)
    return Outcomes(rows=int(r["rows"]), errors=int(r["errors"])), records
