"""run_batch(spark, config): read -> validate -> dedupe -> count tokens -> balance -> infer -> write -> report."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from . import report_html, write
from .config import BatchConfig, ConfigError
from .engine import EngineSpec, check_gpu_settings
from .errors import EngineStartError, ErrorCode, describe_exception
from .infer import FAULT_ENV, InferContext, infer_partition
from .partition import PART_COL, estimate_cost, materialize, plan_partitions, task_slots
from .read import read_input
from .report import (BatchResult, batch_object, counts, errors_by_code, prompt_histogram, to_json,
                     unattributed_errors)
from .schemas import (ERRORS_COLUMNS, METRICS_COLUMNS, OUTPUTS_COLUMNS, RESULT_SCHEMA, TOKENIZED_SCHEMA,
                      VALIDATED_SCHEMA)
from .metrics import ListParam, ProgressReporter, latest_records, progress_line
from .session import check_delta
from .tokens import TokenContext, count_batches
from .validate import ValidationContext, validate_batches

log = logging.getLogger(__name__)


def run_batch(spark: SparkSession, config: BatchConfig) -> BatchResult:
    """Run one batch end to end and return its :class:`~spark_llm.report.BatchResult`.

    Raises :class:`~spark_llm.config.ConfigError` for bad settings and
    :class:`~spark_llm.errors.EngineStartError` when no engine can start; every problem with a single request
    becomes an error row instead. With ``resume`` the run continues ``batch_id`` and writes only what is missing.
    """
    if not isinstance(config, BatchConfig):
        raise TypeError(f"config must be a spark_llm.BatchConfig, got {type(config).__name__}")
    config.require_ready()
    check_delta(spark)
    check_gpu_settings(dict(spark.sparkContext.getConf().getAll()), config.tensor_parallel_size)
    cfg = config.model_copy(update={"max_model_len": resolve_max_model_len(config)})
    batch_id = cfg.resolved_batch_id()
    out_dir = cfg.output_dir.rstrip("/")  # type: ignore[union-attr]
    outputs_table, errors_table = cfg.table_paths()
    paths = {"output_file": f"{out_dir}/output.jsonl", "error_file": f"{out_dir}/errors.jsonl",
             "batch_file": f"{out_dir}/batch.json", "report_file": f"{out_dir}/report.html",
             "outputs_table": outputs_table, "errors_table": errors_table, "metrics_table": cfg.metrics_table()}
    wall_start = time.time()
    created_at = _previous_created_at(spark, paths["batch_file"]) if cfg.resume else None
    created_at = created_at or int(time.time())
    _prepare_destination(spark, cfg, batch_id, out_dir, outputs_table, errors_table)
    log.info("batch %s: settings %s", batch_id, json.dumps(cfg.redacted(), default=str))

    sc = spark.sparkContext
    metrics = sc.accumulator([], ListParam())
    sc.setJobGroup(batch_id, f"spark_llm {batch_id}", interruptOnCancel=True)
    try:
        plan, skipped, in_progress_at = _run_requests(spark, cfg, batch_id, out_dir, outputs_table, errors_table,
                                                       metrics)
    except BaseException as exc:
        _write_failed_batch(spark, cfg, batch_id, created_at, paths, exc)
        raise
    return _finish(spark, cfg, batch_id, paths, metrics, plan, skipped, created_at, in_progress_at, wall_start)


def _run_requests(spark: SparkSession, cfg: BatchConfig, batch_id: str, out_dir: str, outputs_table: str,
                  errors_table: str, metrics: Any) -> tuple[Optional[dict], int, int]:
    """Read, validate, count, plan and infer: everything that writes rows. Returns the plan, the requests skipped
    as already answered (resume) and when inference started."""
    sc = spark.sparkContext
    sc.setJobDescription("spark_llm: read, validate and count tokens")
    requests = _prepare(spark, cfg, batch_id).persist(StorageLevel.MEMORY_AND_DISK)
    plan, skipped = None, 0
    try:
        if cfg.max_requests is not None:
            n = requests.count()
            if n > cfg.max_requests:
                raise ConfigError(f"input holds {n} requests, over max_requests={cfg.max_requests}; split the input "
                                  f"or raise the limit")
        in_progress_at = int(time.time())
        pending = requests
        if cfg.resume:
            done = _finished_ids(spark, cfg, batch_id, outputs_table, errors_table)
            pending = requests.join(done, "id", "left_anti")
            skipped = requests.count() - pending.count()
            log.info("batch %s: resuming, %d requests already answered", batch_id, skipped)
        sc.setJobDescription("spark_llm: write validation errors")
        write.insert_errors(_error_rows(pending.where(F.col("error_code").isNotNull()), batch_id,
                                        cfg.max_raw_line_chars), errors_table, batch_id)
        valid = estimate_cost(pending.where(F.col("error_code").isNull()))
        sc.setJobDescription("spark_llm: plan partitions")
        if not valid.limit(1).rdd.isEmpty():
            plan = _infer_in_waves(spark, cfg, valid, batch_id, out_dir, outputs_table, errors_table, metrics)
        elif cfg.resume:
            log.info("batch %s: nothing left to run; no new rows written", batch_id)
    finally:
        requests.unpersist()
    return plan, skipped, in_progress_at


def _finish(spark: SparkSession, cfg: BatchConfig, batch_id: str, paths: dict, metrics: Any, plan: Optional[dict],
            skipped: int, created_at: int, in_progress_at: int, wall_start: float) -> BatchResult:
    """Rebuild the OpenAI files from the tables, then write the metrics, batch.json and report.html."""
    sc = spark.sparkContext
    sc.setJobDescription("spark_llm: write OpenAI files and batch.json")
    outputs = _batch_rows(spark, paths["outputs_table"], batch_id)
    errors = _batch_rows(spark, paths["errors_table"], batch_id)
    write.write_jsonl(spark, write.output_lines(outputs), paths["output_file"])
    write.write_jsonl(spark, write.error_lines(errors), paths["error_file"])
    c = counts(outputs, errors)
    errors_data, errors_total = unattributed_errors(errors)
    finished = int(time.time())
    # OpenAI batches have one endpoint; ours may mix both (comma-joined), or have none when every line failed
    endpoint = ",".join(sorted(r["endpoint"] for r in outputs.select("endpoint").distinct().limit(2).collect()))
    batch = batch_object(batch_id=batch_id, endpoint=endpoint,
                         model=cfg.served_model_name or "", input_path=cfg.input or cfg.input_table or "",
                         status="completed", created_at=created_at, in_progress_at=in_progress_at,
                         finalizing_at=finished, completed_at=finished, failed_at=None, c=c,
                         errors_data=errors_data, errors_total=errors_total, paths=paths, plan=plan)
    records = latest_records(metrics.value)
    if records:
        write.append_rows(spark, [{**r, "batch_id": batch_id} for r in records], paths["metrics_table"],
                          METRICS_COLUMNS)
    write.write_text_atomic(spark, paths["batch_file"], to_json(batch))
    write.write_text_atomic(spark, paths["report_file"], report_html.render(
        batch, plan, records, prompt_histogram(outputs), errors_by_code(errors), time.time() - wall_start))
    sc.setJobDescription(None)
    result = BatchResult(batch_id=batch_id, status="completed", total=c["completed"] + c["failed"],
                         completed=c["completed"], failed=c["failed"], input_tokens=c["input_tokens"],
                         output_tokens=c["output_tokens"], output_dir=paths["output_file"].rsplit("/", 1)[0],
                         outputs_table=paths["outputs_table"], errors_table=paths["errors_table"],
                         output_file=paths["output_file"], error_file=paths["error_file"],
                         batch_file=paths["batch_file"], skipped=skipped, batch=batch)
    log.info("%s", result.summary())
    return result


#: batch.json ``errors.data`` codes of a batch that stopped (row-level problems never stop a batch).
BATCH_FAILURE_CODES = {EngineStartError: "engine_start_failed", ConfigError: "invalid_config"}


def _write_failed_batch(spark: SparkSession, cfg: BatchConfig, batch_id: str, created_at: int,
                        paths: dict, exc: BaseException) -> None:
    """Best effort: leave a batch.json with status "failed" and the reason in ``errors.data``, so a reader sees
    the run stopped and why (rerun with --resume to continue)."""
    try:
        now = int(time.time())
        code = next((c for t, c in BATCH_FAILURE_CODES.items() if isinstance(exc, t)), "batch_failed")
        reason = {"code": code, "message": describe_exception(exc), "param": None, "line": None}
        batch = batch_object(batch_id=batch_id, endpoint="", model=cfg.served_model_name or "",
                             input_path=cfg.input or cfg.input_table or "", status="failed", created_at=created_at,
                             in_progress_at=None, finalizing_at=None, completed_at=None, failed_at=now,
                             c={"completed": 0, "failed": 0, "input_tokens": 0, "output_tokens": 0},
                             errors_data=[reason], errors_total=1, paths=paths, plan=None)
        write.write_text_atomic(spark, paths["batch_file"], to_json(batch))
    except Exception:  # never hide the original error
        log.debug("could not write the failed batch.json", exc_info=True)


def _prepare_destination(spark: SparkSession, cfg: BatchConfig, batch_id: str, out_dir: str, outputs_table: str,
                         errors_table: str) -> None:
    """Output dir and tables ready: refuse to clobber earlier results unless told to overwrite or resume."""
    if not cfg.resume:
        write.prepare_output_dir(spark, out_dir, cfg.overwrite)
        for table in (outputs_table, errors_table):
            if write.table_exists(spark, table) and not write.read_table(spark, table).where(
                    F.col("batch_id") == batch_id).limit(1).rdd.isEmpty():
                if not cfg.overwrite:
                    raise ConfigError(f"table {table} already holds rows of batch {batch_id!r}; pass --resume to "
                                      f"continue that batch, --overwrite to redo it, or use a new --batch-id")
                write.delete_rows(spark, table, F.col("batch_id") == batch_id)
    else:
        write.mkdirs(spark, out_dir)
    write.ensure_table(spark, outputs_table, OUTPUTS_COLUMNS)
    write.ensure_table(spark, errors_table, ERRORS_COLUMNS)


def _finished_ids(spark: SparkSession, cfg: BatchConfig, batch_id: str, outputs_table: str,
                  errors_table: str) -> DataFrame:
    """Ids of this batch already answered, as of now; with retry_errors, transient engine errors are first removed
    (to be rerun)."""
    if cfg.retry_errors:
        write.delete_rows(spark, errors_table, (F.col("batch_id") == batch_id)
                          & (F.col("code") == ErrorCode.ENGINE_ERROR.value))
    # pinned snapshots: the waves about to commit must not change which requests count as pending
    ids = [write.read_table(spark, t, write.current_version(spark, t)).where(F.col("batch_id") == batch_id)
           .select("id") for t in (outputs_table, errors_table)]
    return ids[0].unionByName(ids[1]).distinct()


def _previous_created_at(spark: SparkSession, batch_file: str) -> Optional[int]:
    try:
        rows = spark.read.text(batch_file, wholetext=True).collect() if write.exists(spark, batch_file) else []
        return int(json.loads(rows[0]["value"])["created_at"]) if rows else None
    except Exception:  # unreadable summary of an interrupted run: start a new clock
        return None


def resolve_max_model_len(cfg: BatchConfig) -> int:
    """The configured max_model_len, else the model's max_position_embeddings (read from config.json)."""
    if cfg.max_model_len:
        return cfg.max_model_len
    config_file = Path(cfg.model or "") / "config.json"
    try:
        model_conf = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_file} to find the model's context length ({exc}); set "
                          f"--max-model-len / MAX_MODEL_LEN") from None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = model_conf.get(key) or (model_conf.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"{config_file} does not state a context length; set --max-model-len / MAX_MODEL_LEN")


def _prepare(spark: SparkSession, cfg: BatchConfig, batch_id: str) -> DataFrame:
    """Raw lines -> validated, deduplicated, tokenized rows with their batch line ids."""
    vctx = ValidationContext(
        served_model_name=cfg.served_model_name or "", default_max_tokens=cfg.default_max_tokens,
        default_temperature=cfg.default_temperature, default_top_p=cfg.default_top_p,
        max_line_bytes=cfg.max_line_bytes, max_raw_line_chars=cfg.max_raw_line_chars,
        max_stop_sequences=cfg.max_stop_sequences, max_n=cfg.max_n)
    tctx = TokenContext(tokenizer_path=cfg.tokenizer or cfg.model or "", max_model_len=int(cfg.max_model_len or 0),
                        context_overflow=cfg.context_overflow)
    lines = read_input(spark, cfg)
    validated = lines.mapInPandas(lambda it: validate_batches(it, vctx), VALIDATED_SCHEMA)
    deduped = mark_duplicates(validated)
    tokenized = deduped.mapInPandas(lambda it: count_batches(it, tctx), TOKENIZED_SCHEMA)
    return with_line_ids(tokenized, batch_id)


def mark_duplicates(df: DataFrame) -> DataFrame:
    """The first line (by file, line number) of each custom_id keeps its fate; later lines become
    duplicate_custom_id errors that name the first line."""
    with_id = df.where(F.col("custom_id").isNotNull())
    w = Window.partitionBy("custom_id").orderBy("file", "line_number")
    ranked = (with_id.withColumn("_rank", F.row_number().over(w))
              .withColumn("_first_line", F.first("line_number").over(w))
              .withColumn("_first_file", F.first("file").over(w)))
    dup = F.col("_rank") > 1
    message = F.concat(F.lit("custom_id is already used by line "), F.col("_first_line").cast("string"),
                       F.when(F.col("_first_file") != F.col("file"), F.concat(F.lit(" of "), F.col("_first_file")))
                       .otherwise(F.lit("")), F.lit("; only the first occurrence runs"))
    marked = ranked.select(
        *[c for c in df.columns if c not in ("error_code", "error_message", "raw_line")],
        F.when(dup, F.lit(ErrorCode.DUPLICATE_CUSTOM_ID.value)).otherwise(F.col("error_code")).alias("error_code"),
        F.when(dup, message).otherwise(F.col("error_message")).alias("error_message"),
        F.when(dup, F.coalesce(F.col("raw_line"), F.col("request"))).otherwise(F.col("raw_line")).alias("raw_line"),
    )
    return marked.select(df.columns).unionByName(df.where(F.col("custom_id").isNull()))


def with_line_ids(df: DataFrame, batch_id: str) -> DataFrame:
    """Stable, unique per-line ids from the batch id and the custom_id (file and line for lines without a usable
    or with a duplicate custom_id)."""
    by_line = F.concat(F.lit("\u0000"), F.col("file"), F.lit(":"), F.col("line_number").cast("string"))
    unique_id = F.col("custom_id").isNotNull() & (F.coalesce(F.col("error_code"), F.lit("")) != F.lit(
        ErrorCode.DUPLICATE_CUSTOM_ID.value))
    ident = F.when(unique_id, F.col("custom_id")).otherwise(by_line)
    digest = F.sha2(F.concat(F.lit(batch_id + "\u0000"), ident), 256)
    return df.select("*", F.concat(F.lit("batch_req_"), F.substring(digest, 1, 32)).alias("id"),
                     F.concat(F.lit("req_"), F.substring(digest, 33, 32)).alias("request_id"))


def _error_rows(df: DataFrame, batch_id: str, max_raw: int) -> DataFrame:
    raw = F.coalesce(F.col("raw_line"), F.col("request"))
    cut = F.when(F.length(raw) > max_raw, F.concat(F.substring(raw, 1, max(max_raw - 1, 0)), F.lit("…"))) \
        .otherwise(raw)
    return df.select(F.lit(batch_id).alias("batch_id"), "id", "custom_id", "file", "line_number",
                     F.col("error_code").alias("code"), F.col("error_message").alias("message"),
                     cut.alias("raw_line"), F.current_timestamp().alias("created_at"))


def _infer_in_waves(spark: SparkSession, cfg: BatchConfig, valid: DataFrame, batch_id: str, out_dir: str,
                    outputs_table: str, errors_table: str, metrics: Any) -> dict:
    """Plan token-balanced partitions, then infer them a wave at a time, one Delta commit per table per wave."""
    slots = task_slots(spark, cfg.num_task_slots)
    assigned, plan = plan_partitions(valid, target_tokens=cfg.target_tokens_per_partition, slots=slots)
    wave = cfg.wave_partitions or 2 * slots
    base_ctx = InferContext(engine=EngineSpec.from_config(cfg), served_model_name=cfg.served_model_name or "",
                            batch_id=batch_id, metrics=metrics)
    staging = f"{out_dir}/_staging/results"
    waves = range(0, plan.num_partitions, wave)
    state = {"wave": f"0/{len(waves)}"}
    total = sum(plan.requests_per_partition)
    started = time.time()
    line = lambda: progress_line(batch_id, metrics.value, total, started, state["wave"])  # noqa: E731
    with ProgressReporter(line, cfg.progress_interval_seconds):
        for number, first in enumerate(waves, start=1):
            state["wave"] = f"{number}/{len(waves)}"
            _run_wave(spark, cfg, assigned, plan, first, min(wave, plan.num_partitions - first), number, len(waves),
                      replace(base_ctx, wave=number), batch_id, staging, outputs_table, errors_table)
    write.delete(spark, f"{out_dir}/_staging")
    plan.release()
    return plan.as_dict()


def _run_wave(spark: SparkSession, cfg: BatchConfig, assigned: DataFrame, plan, first: int, count: int,
              number: int, n_waves: int, ictx: InferContext, batch_id: str, staging: str, outputs_table: str,
              errors_table: str) -> None:
    """Infer planned partitions first..first+count-1, stage the results once, commit them to both tables."""
    spark.sparkContext.setJobDescription(f"spark_llm: infer wave {number}/{n_waves}")
    keep = materialize(assigned, first, count).select(
        "id", "request_id", "custom_id", "file", "line_number", "url", "kind", "request", "sampling_json",
        "prompt_token_ids", "prompt_tokens", "notes", PART_COL)
    results = keep.mapInPandas(lambda it: infer_partition(it, ictx), RESULT_SCHEMA)
    try:
        results.write.mode("overwrite").parquet(staging)
    except Exception as exc:
        raise _engine_failure(exc) from None
    staged = spark.read.parquet(staging)
    planned, got = sum(plan.requests_per_partition[first:first + count]), staged.count()
    if got != planned:  # the conservation check: one result per planned request
        raise RuntimeError(f"wave {number}: {got} results for {planned} planned requests; nothing of this wave "
                           f"was committed, rerun with --resume")
    spark.sparkContext.setJobDescription(f"spark_llm: commit wave {number}/{n_waves}")
    ok = staged.where(F.col("error_code").isNull()).select(
        F.lit(batch_id).alias("batch_id"), "id", "custom_id", "request_id", "file", "line_number",
        F.col("url").alias("endpoint"), "model", "text", "finish_reason", "prompt_tokens", "completion_tokens",
        "total_tokens", "notes", F.timestamp_seconds("created").alias("created_at"), "response_body", "request")
    write.insert_outputs(ok, outputs_table, batch_id)
    failed = staged.where(F.col("error_code").isNotNull()).withColumn("raw_line", F.lit(None).cast("string"))
    write.insert_errors(_error_rows(failed, batch_id, cfg.max_raw_line_chars), errors_table, batch_id)
    log.info("batch %s: wave %d/%d committed (%d partitions)", batch_id, number, n_waves, count)
    _maybe_exit_after_wave(number)


def _maybe_exit_after_wave(number: int) -> None:
    """Fault injection for resume tests and drills: ``exit_after_wave:N`` ends the driver hard after wave N."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec.startswith("exit_after_wave:") and int(spec.split(":", 1)[1]) == number:
        log.error("fault injection: driver exits after wave %d", number)
        logging.shutdown()
        os._exit(137)


_ENGINE_ERR = re.compile(r"EngineStartError: (.+?)(?:\n|$)")


def _engine_failure(exc: Exception) -> Exception:
    """Turn an executor-side engine start failure into one clear driver-side error."""
    match = _ENGINE_ERR.search(str(exc))
    if match:
        return EngineStartError(match.group(1))
    return exc


def _batch_rows(spark: SparkSession, table: str, batch_id: str) -> DataFrame:
    return write.read_table(spark, table).where(F.col("batch_id") == batch_id)
