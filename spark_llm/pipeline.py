"""run_batch(spark, config): the table of contents of a run.

    check settings -> context -> [the engines start loading, in the background] -> destination
    -> prepare (read, validate, dedupe, count tokens, ids) -> validation errors
    -> infer model by model, in waves (plan; infer and commit, two waves in flight)
       (a large local input prepared in this process: in two parts, the first part's first wave inferring while
       the rest is prepared, validated and planned)
       (or, ending a batch early with finish_unanswered: every unanswered request an error row)
    -> report (files, batch.json, report.html)

Each stage lives in its own module and takes the run's :class:`~spark_llm.context.RunContext`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from . import storage, write
from .batch import BatchResult
from .config import BatchConfig
from .context import RunContext, RunListener
from .engine_host.isolation import retry_budget_warning
from .engine_host.placement import check_gpu_settings
from .models import check_adapters
from .prepare import (Outcomes, Prepared, PreparingRest, check_size, count_outcomes, prepare_in_parts, prepared,
                      prepares_in_parts_here)
from .report import Outcome, finish, write_failed_batch
from .session import check_delta
from .session_info import spark_conf
from .waves import Inferred, infer_in_waves, infer_models
from .warmup import EngineWarmup

log = logging.getLogger(__name__)


def run_batch(spark: SparkSession, config: BatchConfig, listener: Optional[RunListener] = None) -> BatchResult:
    """Run one batch end to end and return its :class:`~spark_llm.batch.BatchResult`.

    Raises :class:`~spark_llm.config.ConfigError` for bad settings and
    :class:`~spark_llm.errors.EngineStartError` when no engine can start; every problem with a single request
    becomes an error row instead. With ``resume`` the run continues ``batch_id`` and writes only what is missing.
    ``listener`` hears the run's progress and may stop it (see :class:`~spark_llm.context.RunListener`).
    """
    if not isinstance(config, BatchConfig):
        raise TypeError(f"config must be a spark_llm.BatchConfig, got {type(config).__name__}")
    config.require_ready()
    check_delta(spark)
    conf = spark_conf(spark)
    check_gpu_settings(conf, config.tensor_parallel_size, gpus_per_executor=config.gpus_per_executor,
                       engines=config.num_task_slots)
    if (warning := retry_budget_warning(conf)) is not None:
        log.warning("%s", warning)
    run = RunContext.start(spark, config, listener)
    with run.job_group(), run.pool(), EngineWarmup.started(run) as warmup:  # engines load while it is prepared
        run = write.prepare_destination(run)
        log.debug("batch %s: settings %s", run.batch_id, json.dumps(run.cfg.redacted(), default=str))
        try:
            for model in run.models:
                check_adapters(model.lora_modules, model.max_lora_rank)
            outcome = _write_rows(run, warmup)
        except BaseException as exc:
            write.wait_for_writes(run, quietly=True)  # a failed batch's tables exist too
            write_failed_batch(run, exc)
            raise
        return finish(run, outcome)


def _write_rows(run: RunContext, warmup: Optional[EngineWarmup]) -> Outcome:
    """Every pending line to one row: validation errors first, then inference in waves."""
    run.describe("read, validate and count tokens")
    if _in_parts(run):
        return _write_rows_in_parts(run, warmup, *prepare_in_parts(run.spark, run.models))
    ready = prepared(run.spark, run.models)
    requests = ready.rows.persist(StorageLevel.MEMORY_AND_DISK)
    pending = requests
    try:
        with storage.refusals_explained(run.cfg.input_table or run.cfg.input,  # the input's lines are read here
                                        "--input-table" if run.cfg.input_table else "--input"):
            counts = ready.local.outcomes() if ready.local is not None else count_outcomes(requests)
        check_size(counts, run.cfg)
        in_progress_at = int(time.time())
        todo = counts
        if run.cfg.resume:  # persisted: the plan and every wave read it
            pending = write.pending(run, requests).persist(StorageLevel.MEMORY_AND_DISK)
            todo = count_outcomes(pending)
            log.info("batch %s: resuming, %d requests already answered", run.batch_id, counts.rows - todo.rows)
        run.listener.validated(counts.rows, todo.errors, counts.rows - todo.rows)
        failing = pending
        if run.cfg.finish_unanswered:  # the batch ends here: what is left becomes error rows
            failing = write.unanswered_rows(pending, run.cfg.finish_unanswered)
            todo = Outcomes(rows=todo.rows, errors=todo.rows)
        if todo.errors:  # committed while the requests infer
            run = write.insert_errors_meanwhile(run, write.error_rows(failing, run))
        inferred = Inferred()
        if todo.ok:
            inferred = infer_models(run, pending.where(F.col("error_code").isNull()), warmup,
                                    None if run.cfg.resume else ready.local)  # resumed: fewer rows pending than held
        elif run.cfg.resume:
            log.info("batch %s: nothing left to run; no new rows written", run.batch_id)
        write.wait_for_writes(run)  # they read the prepared rows: done before those are released
    finally:
        if pending is not requests:
            pending.unpersist()
        requests.unpersist()
    return Outcome(plan=inferred.plan, skipped=counts.rows - todo.rows, in_progress_at=in_progress_at,
                   records=inferred.committed.records, error_rows=todo.errors + inferred.committed.error_rows)


def _in_parts(run: RunContext) -> bool:
    """The run's input is prepared in two parts (:func:`~spark_llm.prepare.prepares_in_parts_here`): a run of one
    model over every line (not a resume, nor one ending the batch), without ``max_requests`` (whose check must
    come before any inference)."""
    cfg = run.cfg
    return (len(run.models) == 1 and not cfg.resume and not cfg.finish_unanswered and cfg.max_requests is None
            and prepares_in_parts_here(run.spark, cfg))


def _write_rows_in_parts(run: RunContext, warmup: Optional[EngineWarmup], head: Prepared,
                         rest: PreparingRest) -> Outcome:
    """:func:`_write_rows` of an input prepared in two parts: the first part's first wave infers while the rest
    is prepared; then the whole input's counts go to the listener, its validation errors are committed in the
    background, and the rest is planned, all before any wave is committed."""
    held = [head.rows.persist(StorageLevel.MEMORY_AND_DISK)]
    in_progress_at = int(time.time())
    counts, writing = head.local.outcomes(), run  # the whole input's, once the rest is in; the run writing errors

    def the_rest() -> tuple[RunContext, DataFrame, Any]:
        nonlocal counts, writing
        ready = rest.wait(run.spark)
        held.append(ready.rows.persist(StorageLevel.MEMORY_AND_DISK))
        counts += ready.local.outcomes()
        run.listener.validated(counts.rows, counts.errors, 0)
        if counts.errors:  # committed while the requests infer
            writing = write.insert_errors_meanwhile(run, write.error_rows(held[0].unionByName(held[1]), run))
        return writing, _valid(held[1]), ready.local.valid()

    try:
        inferred = Inferred()
        if head.local.valid().num_rows:
            inferred = infer_in_waves(run, _valid(held[0]), warmup, planned_here=head.local.valid(), rest=the_rest)
        else:  # nothing of the first part infers: the rest alone, as a whole input
            run_now, valid, here = the_rest()
            if here.num_rows:
                inferred = infer_in_waves(run_now, valid, warmup, planned_here=here)
        write.wait_for_writes(writing)  # they read the prepared rows: done before those are released
    finally:
        for rows in held:
            rows.unpersist()
    return Outcome(plan=inferred.plan, skipped=0, in_progress_at=in_progress_at,
                   records=inferred.committed.records, error_rows=counts.errors + inferred.committed.error_rows)


def _valid(rows: DataFrame) -> DataFrame:
    """The requests that infer: rows without an error."""
    return rows.where(F.col("error_code").isNull())
