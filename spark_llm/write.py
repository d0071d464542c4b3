"""The result tables and the OpenAI files: where a run's rows go, exactly once.

Rows reach the ``outputs`` and ``errors`` Delta tables by plain appends, each request's once: a run writes only the
requests that no row of either table answers as of its start (:func:`pending`, with ``resume``; without it a batch
that has rows is refused or, with ``overwrite``, deleted first), every planned request in exactly one wave, and a
wave's rows in one atomic commit per table, so a resumed run never adds a second row for a request (one writer per
batch: two runs of one batch at the same time are not guarded against). ``output.jsonl`` and ``errors.jsonl`` are
rebuilt from the tables at the end of a run by Spark (see :func:`~spark_llm.storage.write_single_text_file`); no
row passes through the driver.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, replace
from typing import Callable, Iterator

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from . import faults, storage
from .background import SparkJobInBackground
from .config import ConfigError
from .context import RunContext
from .engine_host.protocol import EngineTask
from .errors import UNANSWERED_CODES, ErrorCode
from .models import tasks_of
from .partition import PartitionPlan
from .schemas import (EMBEDDINGS_COLUMNS, EMBEDDINGS_STATS, ERRORS_COLUMNS, ERRORS_STATS, METRICS_COLUMNS,
                      OUTPUTS_COLUMNS, OUTPUTS_STATS, PartitionRecord, json_string)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def turn(run: RunContext, table: str) -> Iterator[None]:
    """A write of a result table (its creation, an append, a delete) in its turn: the run's listener's
    (:meth:`~spark_llm.context.RunListener.writing`: the batch service's servers take turns on object storage)."""
    faults.before_table_write()
    with run.listener.writing(table):
        yield


def prepare_destination(run: RunContext) -> RunContext:
    """Output dir and tables ready: refuse to clobber earlier results unless told to overwrite or resume. The tables
    are created (or given the columns a newer spark_llm adds) in the background, while the batch is prepared;
    returns the run with that under way (every read and write of the tables waits for it)."""
    spark, cfg, paths = run.spark, run.cfg, run.paths
    with storage.refusals_explained(paths.output_dir, "--output-dir"):  # the run's first touch of the output's store
        if cfg.resume:
            storage.mkdirs(spark, paths.output_dir)
        else:
            storage.prepare_output_dir(spark, paths.output_dir, cfg.overwrite)
    for table in (paths.outputs_table, paths.errors_table) if not cfg.resume else ():
        if storage.table_exists(spark, table) and not _batch_rows(run, table).isEmpty():
            if not cfg.overwrite:
                raise ConfigError(f"table {table} already holds rows of batch {run.batch_id!r}; pass --resume "
                                  f"to continue that batch, --overwrite to redo it, or use a new --batch-id")
            # redone: every table forgets the batch (a later --resume or report must not count the old runs)
            for other in (paths.outputs_table, paths.errors_table, paths.metrics_table, paths.embeddings_table):
                with turn(run, other):
                    storage.delete_rows(spark, other, run.batch_id)
            break
    tables = [(paths.outputs_table, OUTPUTS_COLUMNS, OUTPUTS_STATS),
              (paths.errors_table, ERRORS_COLUMNS, ERRORS_STATS),
              (paths.metrics_table, METRICS_COLUMNS, ())]  # made now, not by the first wave's commit
    if run.has_embeddings:
        tables.append((paths.embeddings_table, EMBEDDINGS_COLUMNS, EMBEDDINGS_STATS))

    def create() -> None:
        for table, columns, stats in tables:
            with turn(run, table):
                storage.ensure_table(spark, table, columns, stats)
    return replace(run, table_writes=SparkJobInBackground(spark, "spark_llm-tables", create))


def wait_for_writes(run: RunContext, quietly: bool = False) -> None:
    """Wait for the writes under way (see :attr:`RunContext.table_writes`); raise what failed, unless ``quietly``
    (a run that failed already: its tables are still made, its own error is the one to report)."""
    if run.table_writes is not None:
        try:
            run.table_writes.wait()
        except Exception:
            if not quietly:
                raise


def _batch_rows(run: RunContext, table: str, version: int | None = None) -> DataFrame:
    wait_for_writes(run)
    return storage.read_table(run.spark, table, version).where(F.col("batch_id") == run.batch_id)


def outputs(run: RunContext) -> DataFrame:
    return _batch_rows(run, run.paths.outputs_table)


def errors(run: RunContext) -> DataFrame:
    return _batch_rows(run, run.paths.errors_table)


def pending(run: RunContext, requests: DataFrame) -> DataFrame:
    """With ``resume``, the requests without a row in either table yet. The rows of requests an earlier run ended
    without running (:data:`~spark_llm.errors.UNANSWERED_CODES`) are removed first, to be run now, unless this run
    ends the batch too (``finish_unanswered``: they stay as they are); with ``retry_errors`` transient engine errors
    are removed as well."""
    codes = [] if run.cfg.finish_unanswered else list(UNANSWERED_CODES)
    if run.cfg.retry_errors:
        codes.append(ErrorCode.ENGINE_ERROR.value)
    if codes:
        with turn(run, run.paths.errors_table):
            storage.delete_rows(run.spark, run.paths.errors_table, run.batch_id, codes)
    # pinned snapshots: the waves about to commit must not change which requests count as pending
    done = [_batch_rows(run, t, storage.current_version(run.spark, t)).select("id")
            for t in (run.paths.outputs_table, run.paths.errors_table)]
    return requests.join(done[0].unionByName(done[1]).distinct(), "id", "left_anti")


# ---- rows ----------------------------------------------------------------------------------------------------

def _table_rows(df: DataFrame, columns: dict, derived: dict) -> DataFrame:
    """The table's columns from ``df``: same-named columns as they are, the others from ``derived``."""
    return df.select([derived.get(name, F.col(name)).alias(name) for name in columns])


def error_rows(df: DataFrame, run: RunContext) -> DataFrame:
    """Rows that carry ``error_code`` (validation or inference) as errors-table rows, the raw line cut to
    ``max_raw_line_chars``."""
    limit = run.cfg.max_raw_line_chars
    raw = F.coalesce(F.col("raw_line"), F.col("request")) if "raw_line" in df.columns else F.col("request")
    cut = F.when(F.length(raw) > limit, F.concat(F.substring(raw, 1, max(limit - 1, 0)), F.lit("…"))).otherwise(raw)
    return _table_rows(df.where(F.col("error_code").isNotNull()), ERRORS_COLUMNS, {
        "batch_id": F.lit(run.batch_id), "code": F.col("error_code"), "message": F.col("error_message"),
        "raw_line": cut, "created_at": F.current_timestamp()})


def output_rows(results: DataFrame, run: RunContext) -> DataFrame:
    """Inference results that got a response, as outputs-table rows."""
    return _table_rows(results.where(F.col("error_code").isNull()), OUTPUTS_COLUMNS, {
        "batch_id": F.lit(run.batch_id), "created_at": F.timestamp_seconds("created")})


def embedding_rows(results: DataFrame, run: RunContext) -> DataFrame:
    """The vectors of the embedding responses, one row per input, as embeddings-table rows."""
    exploded = (results.where(F.col("error_code").isNull() & F.col("embeddings").isNotNull())
                .select("*", F.posexplode("embeddings").alias("input_index", "embedding")))
    return _table_rows(exploded, EMBEDDINGS_COLUMNS, {
        "batch_id": F.lit(run.batch_id), "dimensions": F.size("embedding"),
        "created_at": F.timestamp_seconds("created")})


def unanswered_rows(pending: DataFrame, code: str) -> DataFrame:
    """The pending rows, each valid request (no ``error_code`` yet) made an error row with ``code`` (one of
    :data:`~spark_llm.errors.UNANSWERED_CODES`): a batch ended before they ran."""
    unanswered = F.col("error_code").isNull()
    return pending.withColumns({
        "error_code": F.when(unanswered, F.lit(code)).otherwise(F.col("error_code")),
        "error_message": F.when(unanswered, F.lit(UNANSWERED_CODES[code])).otherwise(F.col("error_message"))})


def insert_errors(run: RunContext, rows: DataFrame) -> None:
    wait_for_writes(run)
    with turn(run, run.paths.errors_table):
        storage.append_rows(rows, run.paths.errors_table, ERRORS_COLUMNS)


def insert_errors_meanwhile(run: RunContext, rows: DataFrame) -> RunContext:
    """:func:`insert_errors` in the background (validation errors, while the requests infer); returns the run
    whose later reads and writes of the tables wait for it."""
    return replace(run, table_writes=SparkJobInBackground(run.spark, "spark_llm-errors",
                                                          lambda: insert_errors(run, rows)))


def commit_wave(run: RunContext, results: DataFrame, responses: int, errors: int,
                records: list[PartitionRecord], plan: PartitionPlan) -> list[PartitionRecord]:
    """One wave's inference results (``responses`` + ``errors`` rows) into their tables and its partitions' records
    into the metrics table: one write per table (none for a table that gets no rows), all at once, since writes
    of different tables do not conflict. Returns the metrics table's new rows (:func:`metrics_rows`)."""
    wait_for_writes(run)
    rows = metrics_rows(run, records, plan)
    writes: list[Callable[[], None]] = []

    def append(table: str, added: DataFrame, columns: dict) -> None:
        with turn(run, table):
            storage.append_rows(added, table, columns)
    if responses:
        writes.append(lambda: append(run.paths.outputs_table, output_rows(results, run), OUTPUTS_COLUMNS))
        if EngineTask.EMBED in tasks_of(run.cfg):  # the model this wave ran on
            writes.append(lambda: append(run.paths.embeddings_table, embedding_rows(results, run),
                                         EMBEDDINGS_COLUMNS))
    if errors:
        writes.append(lambda: insert_errors(run, error_rows(results, run)))
    if rows:
        def metrics() -> None:
            with turn(run, run.paths.metrics_table):
                storage.append_records(run.spark, [asdict(r) for r in rows], run.paths.metrics_table,
                                       METRICS_COLUMNS)
        writes.append(metrics)
    others = [SparkJobInBackground(run.spark, f"spark_llm-commit-{n}", w) for n, w in enumerate(writes[1:])]
    try:
        if writes:
            writes[0]()
    finally:
        for other in others:
            other.wait()
    return rows


def metrics_rows(run: RunContext, records: list[PartitionRecord], plan: PartitionPlan) -> list[PartitionRecord]:
    """A wave's partition records (one small row each) as the metrics table gets them, with the run's layout, so
    that the table, the report and batch.json describe every run of the batch, including one that crashed after
    this wave."""
    return [replace(r, batch_id=run.batch_id, run_id=run.run_id, task_slots=plan.task_slots,
                    engines=plan.engines or plan.task_slots) for r in records]


# ---- OpenAI JSONL -----------------------------------------------------------------------------------------------

def output_lines(outputs: DataFrame) -> DataFrame:
    """output.jsonl lines: ``{"id","custom_id","response":{"status_code":200,"request_id","body"},"error":null}``."""
    line = F.concat(
        F.lit('{"id":'), json_string(F.col("id")), F.lit(',"custom_id":'), json_string(F.col("custom_id")),
        F.lit(',"response":{"status_code":200,"request_id":'), json_string(F.col("request_id")),
        F.lit(',"body":'), F.col("response_body"), F.lit('},"error":null}'))
    return outputs.orderBy("file", "line_number").select(line.alias("value"))


def error_lines(errors: DataFrame) -> DataFrame:
    """errors.jsonl lines: ``{"id","custom_id","response":null,"error":{"code","message"}}``."""
    line = F.concat(
        F.lit('{"id":'), json_string(F.col("id")), F.lit(',"custom_id":'), json_string(F.col("custom_id")),
        F.lit(',"response":null,"error":{"code":'), json_string(F.col("code")),
        F.lit(',"message":'), json_string(F.col("message")), F.lit("}}"))
    return errors.orderBy("file", "line_number").select(line.alias("value"))


def write_output_file(run: RunContext) -> None:
    """output.jsonl of the whole batch (every run of it), rebuilt from the outputs table."""
    storage.write_single_text_file(run.spark, output_lines(outputs(run)), run.paths.output_file)


def write_error_file(run: RunContext, rows: int) -> None:
    """errors.jsonl of the whole batch, rebuilt from the errors table, which holds ``rows`` rows of it (as the
    report's tally of the table found): none, an empty file, without reading the table again."""
    if rows:
        storage.write_single_text_file(run.spark, error_lines(errors(run)), run.paths.error_file)
    else:
        storage.write_text_atomic(run.spark, run.paths.error_file, "")
