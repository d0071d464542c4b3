"""The report stage: the batch's counts, usage and errors from its tables (Spark aggregates, a row or a few each)
and its engine usage over all its runs from the metrics table, then batch.json and report.html."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from . import report_html, storage, write
from .background import SparkJobInBackground
from .batch import BatchError, BatchErrors, BatchObject, BatchResult, RunPlan, Tally
from .config import BatchConfig
from .context import RunContext
from .metrics import engine_usage
from .schemas import PartitionRecord

log = logging.getLogger(__name__)

#: Most unattributable lines (no usable custom_id) listed one by one in batch.json's errors.data.
MAX_LISTED_ERRORS = 1000


@dataclass(frozen=True)
class Tables:
    """What batch.json and report.html say of a batch's result tables: one aggregate over each table, plus the
    prompt-length histogram (a row per bucket) and the listed unattributable errors (only when there are any)."""

    tally: Tally
    endpoint: str                          #: the batch's endpoints, comma-joined (OpenAI batches have one)
    errors_by_code: dict[str, int]
    unattributed: BatchErrors              #: errors.data: the lines without a usable custom_id
    histogram: list[tuple[int, int]]       #: (bucket start, requests) over prompt_tokens

    @classmethod
    def read(cls, outputs: DataFrame, errors: Optional[DataFrame], buckets: int = 30,
             then: Callable[[int], None] = lambda rows: None) -> "Tables":
        """The outputs' queries here, the errors' in a driver thread at the same time (each query over a Delta
        table costs the driver a snapshot and a file listing, which overlap); that thread then calls ``then`` with
        the number of error rows (the report writes errors.jsonl there, knowing whether the table has any).
        ``errors`` None: the batch has no error rows (known without a query)."""
        errs = None if errors is None else SparkJobInBackground(errors.sparkSession, "spark_llm-error-tally",
                                                                lambda: _error_tally(errors, then))
        o = outputs.agg(F.count(F.lit(1)).alias("n"), F.sum("prompt_tokens").alias("pt"),
                        F.sum("completion_tokens").alias("ct"), F.max("prompt_tokens").alias("top"),
                        F.slice(F.array_sort(F.collect_set("endpoint")), 1, 8).alias("endpoints")).first()
        histogram = prompt_histogram(outputs, int(o["top"] or 0), buckets)
        if errs is None:
            then(0)
            by_code, unattributed = {}, BatchErrors()
        else:
            by_code, unattributed = errs.wait()
        tally = Tally(completed=int(o["n"]), failed=sum(by_code.values()), input_tokens=int(o["pt"] or 0),
                      output_tokens=int(o["ct"] or 0))
        return cls(tally=tally, endpoint=",".join(o["endpoints"] or []), errors_by_code=by_code,
                   unattributed=unattributed, histogram=histogram)


def _error_tally(errors: DataFrame, then: Callable[[int], None]) -> tuple[dict[str, int], BatchErrors]:
    """Error rows by code, and errors.data (the lines without a usable custom_id); then ``then(error rows)``."""
    by_code = errors.groupBy("code").agg(F.count(F.lit(1)).alias("n"),
                                         F.count_if(F.col("custom_id").isNull()).alias("unattributed")).collect()
    tally = ({r["code"]: int(r["n"]) for r in by_code},
             unattributed_errors(errors, sum(int(r["unattributed"]) for r in by_code)))
    then(sum(tally[0].values()))
    return tally


def prompt_histogram(outputs: DataFrame, top: int, buckets: int = 30) -> list[tuple[int, int]]:
    """(bucket start, requests) over prompt_tokens up to ``top``, computed by Spark (at most ``buckets`` rows)."""
    if not top:
        return []
    width = max(1, -(-top // buckets))
    rows = (outputs.groupBy((F.floor(F.col("prompt_tokens") / width) * width).alias("b"))
            .count().orderBy("b").collect())
    return [(int(r["b"]), int(r["count"])) for r in rows]


def unattributed_errors(errors: DataFrame, total: int, limit: int = MAX_LISTED_ERRORS) -> BatchErrors:
    """errors.data: the ``total`` lines without a usable custom_id, at most ``limit`` of them listed."""
    if not total:
        return BatchErrors()
    listed = (errors.where(F.col("custom_id").isNull()).orderBy("file", "line_number").limit(limit)
              .select("code", "message", "file", "line_number").collect())
    return BatchErrors(data=[BatchError(code=r["code"], message=r["message"], line=int(r["line_number"]),
                                        file=r["file"]) for r in listed], total=total)


# ---- the stage ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What the row-writing part of a run did."""

    plan: Optional[RunPlan]  #: the partition plan, None when nothing reached inference
    skipped: int            #: requests an earlier run of the batch had answered (resume)
    in_progress_at: int     #: when inference started
    records: tuple[PartitionRecord, ...] = ()  #: the metrics table's rows this run added (write.metrics_rows)
    error_rows: int = 0     #: the errors table's rows this run added (validation and inference)


def finish(run: RunContext, outcome: Outcome) -> BatchResult:
    """The OpenAI files from the tables, the tallies of the tables and the partition records of every run, all at
    once, from driver threads (a 15-line batch spent 13 of its 50 s here one after the other, most of it the driver
    waiting on Delta snapshots and file listings); then batch.json and report.html.

    A run that is not a ``resume`` is the whole batch (an earlier run's rows were refused or deleted: see
    write.prepare_destination): its partition records are the ones it committed, and a run that wrote no error
    row has none to tally, so neither table is read again for them (each read of a Delta table that a run just
    wrote costs its new snapshot: about a second of a short run, on the cores the files are written with)."""
    run.listener.finalizing()
    run.describe("write OpenAI files, batch.json and the report")
    whole = not run.cfg.resume
    files = SparkJobInBackground(run.spark, "spark_llm-files", lambda: write.write_output_file(run))
    usage = None if whole else SparkJobInBackground(run.spark, "spark_llm-usage", lambda: batch_records(run))
    try:
        errors = None if whole and not outcome.error_rows else write.errors(run)
        tables = Tables.read(write.outputs(run), errors,
                             then=lambda rows: write.write_error_file(run, rows))  # errors.jsonl
        records = sorted_records(outcome.records) if usage is None else usage.wait()
        plan = (outcome.plan or RunPlan()).with_usage(engine_usage(records)) if records else outcome.plan
        batch = BatchObject.completed(run, tables.tally, tables.unattributed, tables.endpoint, plan,
                                      outcome.in_progress_at)
        report = report_html.render(batch, records, tables.histogram, tables.errors_by_code,
                                    time.time() - run.started, simulated=simulated(run.models or (run.cfg,)))
    finally:
        if usage is not None:
            usage.thread.join()
        files.wait()
    storage.write_text_atomic(run.spark, run.paths.settings_file,
                              json.dumps(run.cfg.redacted(), indent=2, default=str) + "\n")
    storage.write_text_atomic(run.spark, run.paths.report_file, report)
    storage.write_text_atomic(run.spark, run.paths.batch_file, batch.to_json())  # last: the batch is done
    result = BatchResult(batch=batch, paths=run.paths, skipped=outcome.skipped)
    log.debug("%s", result.summary())  # the command prints it; a notebook has result.summary()
    return result


def simulated(models: Sequence[BatchConfig]) -> Optional[str]:
    """The engine stand-ins that answered a batch's requests (its models' resolved configs), or None when vLLM
    did."""
    return ", ".join(dict.fromkeys(m.engine_standin for m in models if m.engine_standin)) or None


def batch_records(run: RunContext) -> list[PartitionRecord]:
    """The partition records of every run of the batch (committed wave by wave: see write.metrics_rows), so a
    resumed batch is reported whole. One small row per partition, never request rows."""
    if not storage.table_exists(run.spark, run.paths.metrics_table):
        return []
    rows = (storage.read_table(run.spark, run.paths.metrics_table).where(F.col("batch_id") == run.batch_id)
            .orderBy("started_at").collect())
    return [PartitionRecord.from_row(r) for r in rows]


def sorted_records(records: Sequence[PartitionRecord]) -> list[PartitionRecord]:
    """Metrics rows in :func:`batch_records`' order (by ``started_at``, unknown first)."""
    return sorted(records, key=lambda r: (r.started_at is not None, r.started_at or 0.0))


def write_failed_batch(run: RunContext, exc: BaseException) -> None:
    """Best effort: leave a batch.json with status "failed" and the reason (or "cancelled": see
    BatchObject.failed), so a reader sees the run stopped and why."""
    try:
        storage.write_text_atomic(run.spark, run.paths.batch_file, BatchObject.failed(run, exc).to_json())
    except Exception:  # never hide the original error
        log.debug("could not write the failed batch.json", exc_info=True)
