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

from .config import ConfigError

log = logging.getLogger(__name__)


def read_lines(spark: SparkSession, path: str) -> DataFrame:
    """Raw input lines as ``value`` (binary), ``file`` (string) and ``line_number`` (long, 1-based).

    ``path`` is a file, a directory (its files, recursively; hidden ``_``/``.`` files skipped) or a glob on any
    Hadoop-compatible filesystem.
    """
    _check_exists(spark, path)
    reader = spark.read.format("text")
    if _is_dir(spark, path):
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


def _fs_path(spark: SparkSession, path: str):
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    return hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hpath


def _check_exists(spark: SparkSession, path: str) -> None:
    fs, hpath = _fs_path(spark, path)
    matches = fs.globStatus(hpath)
    if matches is None or len(matches) == 0:
        raise ConfigError(f"input {path!r} does not exist or matches no file (--input / STORAGE_INPUT_PATH)")


def _is_dir(spark: SparkSession, path: str) -> bool:
    fs, hpath = _fs_path(spark, path)
    return fs.exists(hpath) and fs.getFileStatus(hpath).isDirectory()
