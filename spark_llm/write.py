"""Delta result tables and the OpenAI-format JSONL files, written through Spark and Hadoop streams.

The JSONL files are written by Spark as part files and then concatenated into one file by the JVM (Hadoop
``FileSystem`` streams), so no row passes through the Python driver. Every final file appears by rename, never half
written.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from .config import ConfigError
from .schemas import ERRORS_COLUMNS, OUTPUTS_COLUMNS, json_string, table_schema

log = logging.getLogger(__name__)


# ---- Hadoop filesystem helpers -------------------------------------------------------------------------------

def _fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    fs.setWriteChecksum(False)  # no .crc side files next to the results on local filesystems
    return fs, hpath


def exists(spark: SparkSession, path: str) -> bool:
    fs, hpath = _fs(spark, path)
    return bool(fs.exists(hpath))


def delete(spark: SparkSession, path: str) -> None:
    fs, hpath = _fs(spark, path)
    if fs.exists(hpath):
        fs.delete(hpath, True)


def mkdirs(spark: SparkSession, path: str) -> None:
    fs, hpath = _fs(spark, path)
    fs.mkdirs(hpath)


def prepare_output_dir(spark: SparkSession, output_dir: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite``; then clear it."""
    fs, hpath = _fs(spark, output_dir)
    if fs.exists(hpath):
        if not fs.getFileStatus(hpath).isDirectory():
            raise ConfigError(f"output dir {output_dir!r} is a file, not a directory")
        if len(fs.listStatus(hpath)) > 0:
            if not overwrite:
                raise ConfigError(f"output dir {output_dir!r} is not empty; choose another --output-dir or pass "
                                  f"--overwrite to replace its contents")
            log.warning("overwriting the contents of %s", output_dir)
            for status in fs.listStatus(hpath):
                fs.delete(status.getPath(), True)
    fs.mkdirs(hpath)


def write_text_atomic(spark: SparkSession, path: str, text: str) -> None:
    """Write a small text file (e.g. batch.json) through a temp file and a rename."""
    fs, hpath = _fs(spark, path)
    tmp = spark.sparkContext._jvm.org.apache.hadoop.fs.Path(path + ".tmp")
    out = fs.create(tmp, True)
    try:
        out.write(bytearray(text.encode("utf-8")))
    finally:
        out.close()
    _replace(fs, tmp, hpath)


def _replace(fs: Any, src: Any, dst: Any) -> None:
    if fs.exists(dst):
        fs.delete(dst, False)
    if not fs.rename(src, dst):
        raise IOError(f"could not rename {src.toString()} to {dst.toString()}")


def merge_parts(spark: SparkSession, parts_dir: str, dest: str) -> None:
    """Concatenate the ``part-*`` files of ``parts_dir`` (in name order) into ``dest``, atomically, in the JVM."""
    jvm = spark.sparkContext._jvm
    fs, src = _fs(spark, parts_dir)
    _, dst = _fs(spark, dest)
    tmp = jvm.org.apache.hadoop.fs.Path(dest + ".tmp")
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    parts = sorted((s.getPath() for s in fs.listStatus(src) if s.getPath().getName().startswith("part-")),
                   key=lambda p: p.getName())
    out = fs.create(tmp, True)
    try:
        for part in parts:
            stream = fs.open(part)
            try:
                jvm.org.apache.hadoop.io.IOUtils.copyBytes(stream, out, conf, False)
            finally:
                stream.close()
    finally:
        out.close()
    _replace(fs, tmp, dst)
    fs.delete(src, True)


# ---- Delta tables -----------------------------------------------------------------------------------------------

def _is_name(table: str) -> bool:
    """Catalog names (catalog.schema.table) have no slash or scheme; everything else is a Delta path."""
    return "/" not in table and ":" not in table


def table_exists(spark: SparkSession, table: str) -> bool:
    if _is_name(table):
        return bool(spark.catalog.tableExists(table))
    return exists(spark, table.rstrip("/") + "/_delta_log")


def read_table(spark: SparkSession, table: str, version: Optional[int] = None) -> DataFrame:
    """The table, or its snapshot at ``version`` (Delta time travel) so that later commits do not change it."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.table(table) if _is_name(table) else reader.load(table)


def current_version(spark: SparkSession, table: str) -> int:
    return int(_delta(spark, table).history(1).select("version").first()[0])


def _delta(spark: SparkSession, table: str) -> Any:
    from delta.tables import DeltaTable

    return DeltaTable.forName(spark, table) if _is_name(table) else DeltaTable.forPath(spark, table)


def _save(writer: Any, table: str) -> None:
    """Write to a catalog table by name or to a Delta path."""
    if _is_name(table):
        writer.saveAsTable(table)
    else:
        writer.save(table)


def _conform(df: DataFrame, columns: dict) -> DataFrame:
    """Select the table's columns in order, cast, with their comments as column metadata."""
    return df.select([F.col(name).cast(dtype).alias(name, metadata={"comment": comment})
                      for name, (dtype, comment) in columns.items()])


def ensure_table(spark: SparkSession, table: str, columns: dict) -> None:
    """Create the (empty) Delta table, partitioned by batch_id, with column comments, if it does not exist."""
    if table_exists(spark, table):
        return
    empty = spark.createDataFrame([], table_schema(columns))
    _save(_conform(empty, columns).write.format("delta").partitionBy("batch_id"), table)


def insert_new(df: DataFrame, table: str, columns: dict, batch_id: str) -> None:
    """Insert the rows whose (batch_id, id) is not in the table yet: one Delta MERGE, so a retried or resumed write
    never adds a second row for the same request."""
    spark = df.sparkSession
    source = _conform(df, columns).alias("s")
    quoted = batch_id.replace("'", "''")
    (_delta(spark, table).alias("t")
     .merge(source, f"t.batch_id = '{quoted}' AND t.id = s.id")
     .whenNotMatchedInsertAll()
     .execute())


def append_rows(spark: SparkSession, rows: list[dict], table: str, columns: dict) -> None:
    """Append a few small records (e.g. one per partition) to a Delta table, created on first use."""
    from datetime import datetime, timezone

    def cell(name: str, dtype: Any, value: Any) -> Any:
        if dtype.typeName() == "timestamp" and isinstance(value, (int, float)):
            return datetime.fromtimestamp(value, timezone.utc)
        return value

    data = [tuple(cell(n, t, r.get(n)) for n, (t, _) in columns.items()) for r in rows]
    df = _conform(spark.createDataFrame(data, table_schema(columns)), columns)
    _save(df.write.format("delta").mode("append").partitionBy("batch_id"), table)


def delete_rows(spark: SparkSession, table: str, condition: Column) -> None:
    if table_exists(spark, table):
        _delta(spark, table).delete(condition)


def insert_outputs(df: DataFrame, table: str, batch_id: str) -> None:
    insert_new(df, table, OUTPUTS_COLUMNS, batch_id)


def insert_errors(df: DataFrame, table: str, batch_id: str) -> None:
    insert_new(df, table, ERRORS_COLUMNS, batch_id)


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


def write_jsonl(spark: SparkSession, lines: DataFrame, dest: str) -> None:
    """Write a one-column ``value`` frame as a single JSONL file at ``dest`` (part files, then a JVM merge)."""
    parts_dir = dest + ".parts"
    delete(spark, parts_dir)
    lines.write.mode("overwrite").option("lineSep", "\n").text(parts_dir)
    merge_parts(spark, parts_dir, dest)
