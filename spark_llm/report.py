"""The report stage: the batch's counts, usage and errors from its tables (Spark aggregates, a row or a few each)
and its engine usage over all its runs from the metrics table, then batch.json and report.html."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from . import report_html, storage, write
from .batch import BatchError, BatchErrors, BatchObject, BatchResult, Tally
from .context import RunContext
from .metrics import engine_usage

log = logging.getLogger(__name__)

#: Most unattributable lines (no usable custom_id) listed one by one in batch.json's errors.data.
MAX_LISTED_ERRORS = 1000


def tally(outputs: DataFrame, errors: DataFrame) -> Tally:
    o = outputs.agg(F.count(F.lit(1)).alias("n"), F.sum("prompt_tokens").alias("pt"),
                    F.sum("completion_tokens").alias("ct")).first()
    e = errors.agg(F.count(F.lit(1)).alias("n")).first()
    return Tally(completed=int(o["n"]), failed=int(e["n"]), input_tokens=int(o["pt"] or 0),
                 output_tokens=int(o["ct"] or 0))


def prompt_histogram(outputs: DataFrame, buckets: int = 30) -> list[tuple[int, int]]:
    """(bucket start, requests) over prompt_tokens, computed by Spark (at most ``buckets`` rows)."""
    top = outputs.agg(F.max("prompt_tokens")).first()[0]
    if not top:
        return []
    width = max(1, -(-int(top) // buckets))
    rows = (outputs.groupBy((F.floor(F.col("prompt_tokens") / width) * width).alias("b"))
            .count().orderBy("b").collect())
    return [(int(r["b"]), int(r["count"])) for r in rows]


def errors_by_code(errors: DataFrame) -> dict[str, int]:
    return {r["code"]: int(r["count"]) for r in errors.groupBy("code").count().collect()}


def unattributed_errors(errors: DataFrame, limit: int = MAX_LISTED_ERRORS) -> BatchErrors:
    """errors.data: the lines without a usable custom_id (at most ``limit`` listed), and how many there are."""
    rows = errors.where(F.col("custom_id").isNull())
    listed = (rows.orderBy("file", "line_number").limit(limit)
              .select("code", "message", "file", "line_number").collect())
    return BatchErrors(data=[BatchError(code=r["code"], message=r["message"], line=int(r["line_number"]),
                                        file=r["file"]) for r in listed], total=rows.count())


def endpoint_of(outputs: DataFrame) -> str:
    """The batch's endpoint: OpenAI batches have one; ours may mix them (comma-joined), or have none when every line
    failed."""
    return ",".join(sorted(r["endpoint"] for r in outputs.select("endpoint").distinct().limit(8).collect()))


# ---- the stage ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What the row-writing part of a run did."""

    plan: Optional[dict]    #: the partition plan, None when nothing reached inference
    skipped: int            #: requests an earlier run of the batch had answered (resume)
    in_progress_at: int     #: when inference started


def finish(run: RunContext, outcome: Outcome) -> BatchResult:
    """The OpenAI files from the tables, then batch.json and report.html."""
    run.describe("write OpenAI files, batch.json and the report")
    write.write_openai_files(run)
    outputs, errors = write.outputs(run), write.errors(run)
    records = batch_records(run)
    plan = {**(outcome.plan or {}), **engine_usage(records)} if records else outcome.plan
    batch = BatchObject.completed(run, tally(outputs, errors), unattributed_errors(errors), endpoint_of(outputs),
                                  plan, outcome.in_progress_at)
    storage.write_text_atomic(run.spark, run.paths.batch_file, batch.to_json())
    storage.write_text_atomic(run.spark, run.paths.report_file, report_html.render(
        batch.model_dump(), records, prompt_histogram(outputs), errors_by_code(errors), time.time() - run.started))
    result = BatchResult(batch=batch, paths=run.paths, skipped=outcome.skipped)
    log.info("%s", result.summary())
    return result


def batch_records(run: RunContext) -> list[dict]:
    """The partition records of every run of the batch (committed wave by wave: see write.commit_metrics), so a
    resumed batch is reported whole. One small row per partition, never request rows."""
    if not storage.table_exists(run.spark, run.paths.metrics_table):
        return []
    rows = (storage.read_table(run.spark, run.paths.metrics_table).where(F.col("batch_id") == run.batch_id)
            .orderBy("started_at").collect())
    return [{**r.asDict(), "started_at": r["started_at"].timestamp(), "finished_at": r["finished_at"].timestamp()}
            for r in rows]


def write_failed_batch(run: RunContext, exc: BaseException) -> None:
    """Best effort: leave a batch.json with status "failed" and the reason, so a reader sees the run stopped and
    why."""
    try:
        storage.write_text_atomic(run.spark, run.paths.batch_file, BatchObject.failed(run, exc).to_json())
    except Exception:  # never hide the original error
        log.debug("could not write the failed batch.json", exc_info=True)
