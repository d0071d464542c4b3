"""Read OpenAI batch JSONL input as raw lines with their file and 1-based line number.

Spark's text source keeps every line (blank ones too) as raw bytes, so invalid UTF-8 survives to validation. Line
numbers are computed without a driver collect: each row's position inside its file split comes from
``monotonically_increasing_id`` (rows of one split are contiguous in one task), and a small per-split count table
(one row per split, i.e. metadata) gives each split's offset within its file.
"""

from __future__ import annotations

import logging

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from . import storage
from .config import ConfigError
from .schemas import json_string

log = logging.getLogger(__name__)


def read_lines(spark: SparkSession, path: str) -> DataFrame:
    """Raw input lines as ``value`` (binary), ``file`` (string) and ``line_number`` (long, 1-based).

    ``path`` is a file, a directory (its files, recursively; hidden ``_``/``.`` files skipped) or a glob on any
    Hadoop-compatible filesystem.
    """
    _check_exists(spark, path)
    reader = spark.read.format("text")
    if storage.is_dir(spark, path):
        reader = reader.option("recursiveFileLookup", "true")
    lines = reader.load(path).select(
        F.col("value").cast("binary").alias("value"),
        F.col("_metadata.file_path").alias("file"),
        F.col("_metadata.file_block_start").alias("block_start"),
        F.monotonically_increasing_id().alias("_pos"),
    )
    splits = lines.groupBy("file", "block_start").agg(F.count(F.lit(1)).alias("_n"), F.min("_pos").alias("_first"))
    earlier = Window.partitionBy("file").orderBy("block_start").rowsBetween(Window.unboundedPreceding, -1)
    splits = splits.withColumn("_offset", F.coalesce(F.sum("_n").over(earlier), F.lit(0)))
    return (
        lines.join(F.broadcast(splits.select("file", "block_start", "_offset", "_first")), ["file", "block_start"])
        .select("value", "file", (F.col("_offset") + F.col("_pos") - F.col("_first") + 1).alias("line_number"))
    )


def _check_exists(spark: SparkSession, path: str) -> None:
    if not storage.matches_any(spark, path):
        raise ConfigError(f"input {path!r} does not exist or matches no file (--input / STORAGE_INPUT_PATH)")


# ---- tables ------------------------------------------------------------------------------------------------------

def _json_value(df: DataFrame, name: str) -> "F.Column":
    """A column as raw JSON text: strings are taken to already hold JSON, structs/arrays/maps are serialised."""
    dtype = df.schema[name].dataType.typeName()
    if dtype == "string":  # text that is not JSON is kept as a JSON string, so the row keeps its id in the error
        return F.when(F.get_json_object(F.col(name), "$").isNull() & F.col(name).isNotNull(),
                      json_string(F.col(name))).otherwise(F.col(name))
    if dtype in ("struct", "array", "map"):
        return F.to_json(F.col(name))
    return json_string(F.col(name))


def _with_positions(df: DataFrame) -> DataFrame:
    """1-based row positions in the table's scan order, without a driver collect of rows (one count per partition).
    Stable while the table is unchanged."""
    marked = df.withColumn("_pos", F.monotonically_increasing_id())
    parts = marked.groupBy(F.spark_partition_id().alias("_pid")).agg(F.count(F.lit(1)).alias("_n"),
                                                                      F.min("_pos").alias("_first"))
    earlier = Window.orderBy("_pid").rowsBetween(Window.unboundedPreceding, -1)
    parts = parts.withColumn("_offset", F.coalesce(F.sum("_n").over(earlier), F.lit(0)))
    return (marked.withColumn("_pid", F.spark_partition_id())
            .join(F.broadcast(parts.select("_pid", "_offset", "_first")), "_pid")
            .withColumn("line_number", F.col("_offset") + F.col("_pos") - F.col("_first") + 1)
            .drop("_pid", "_offset", "_first", "_pos"))


def table_lines(df: DataFrame, cfg, source: str) -> DataFrame:
    """Rows of a table as OpenAI batch lines (``value`` binary, ``file`` = source, ``line_number`` = row position),
    so they go through exactly the same validation as JSONL lines."""
    cols = set(df.columns)
    id_col = cfg.id_column or ("custom_id" if "custom_id" in cols else None)
    for name in [id_col, cfg.prompt_column, cfg.messages_column, cfg.system_prompt_column, cfg.max_tokens_column,
                 cfg.temperature_column]:
        if name and name not in cols:
            raise ConfigError(f"column {name!r} is not in {source}; its columns are {', '.join(sorted(cols))}")
    if id_col:
        cid = F.col(id_col).cast("string")
    else:
        cid = F.concat(F.lit("row-"), F.substring(F.sha2(F.to_json(F.struct(*[F.col(c) for c in df.columns])),
                                                         256), 1, 16))
    if cfg.prompt_column or cfg.messages_column:
        url, body = F.lit(cfg.table_endpoint), _plain_body(df, cfg)
        method = F.lit("POST")
    elif cfg.body_column in cols:
        body = _json_value(df, cfg.body_column)
        url = F.col("url").cast("string") if "url" in cols else F.lit("/v1/chat/completions")
        method = F.col("method").cast("string") if "method" in cols else F.lit("POST")
    else:
        raise ConfigError(f"{source} has no {cfg.body_column!r} column (OpenAI shape); for plain columns set "
                          f"prompt_column or messages_column (--prompt-column / --messages-column)")
    line = F.concat(F.lit('{"custom_id":'), json_string(cid), F.lit(',"method":'), json_string(method),
                    F.lit(',"url":'), json_string(url), F.lit(',"body":'), F.coalesce(body, F.lit("null")), F.lit("}"))
    positioned = _with_positions(df.select(line.alias("_line")))
    return positioned.select(F.encode("_line", "UTF-8").alias("value"), F.lit(source).alias("file"),
                             F.col("line_number").cast("long"))


def _plain_body(df: DataFrame, cfg) -> "F.Column":
    """A request body built from plain columns: model, prompt or messages, optional system prompt and sampling."""
    fields = [F.lit(cfg.served_model_name).alias("model")]
    if cfg.max_tokens_column:
        fields.append(F.col(cfg.max_tokens_column).alias("max_tokens"))
    if cfg.temperature_column:
        fields.append(F.col(cfg.temperature_column).alias("temperature"))
    if cfg.table_endpoint == "/v1/completions":
        if not cfg.prompt_column:
            raise ConfigError("completions from a table need prompt_column (--prompt-column)")
        return F.to_json(F.struct(*fields, F.col(cfg.prompt_column).cast("string").alias("prompt")))
    scalar = F.to_json(F.struct(*fields))  # '{...}' with null fields left out
    if cfg.messages_column:
        messages = _json_value(df, cfg.messages_column)
    else:
        user = F.to_json(F.struct(F.lit("user").alias("role"),
                                  F.col(cfg.prompt_column).cast("string").alias("content")))
        messages = F.concat(F.lit("["), user, F.lit("]"))
        system = (F.col(cfg.system_prompt_column).cast("string") if cfg.system_prompt_column
                  else F.lit(cfg.system_prompt) if cfg.system_prompt else None)
        if system is not None:
            sys_msg = F.to_json(F.struct(F.lit("system").alias("role"), system.alias("content")))
            messages = F.when(system.isNull(), messages).otherwise(
                F.concat(F.lit("["), sys_msg, F.lit(","), user, F.lit("]")))
    # splice the messages in as the last field of the body object
    return F.concat(scalar.substr(F.lit(1), F.length(scalar) - 1), F.lit(',"messages":'),
                    F.coalesce(messages, F.lit("null")), F.lit("}"))


def read_input(spark: SparkSession, cfg) -> DataFrame:
    """The run's input as raw lines: a catalog table, a Delta table path, or JSONL files (``cfg`` has passed
    :meth:`~spark_llm.config.BatchConfig.require_ready`)."""
    if cfg.input_table:
        try:
            df = spark.read.table(cfg.input_table)
        except Exception as exc:
            raise ConfigError(f"cannot read input table {cfg.input_table!r}: {str(exc).splitlines()[0]}") from None
        return table_lines(df, cfg, cfg.input_table)
    _check_exists(spark, cfg.input)
    if storage.is_delta_path(spark, cfg.input):
        return table_lines(spark.read.format("delta").load(cfg.input), cfg, cfg.input)
    return read_lines(spark, cfg.input)
