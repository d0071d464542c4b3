"""Storage, in one place: "a table by catalog name or by Delta path" and "a file on any Hadoop filesystem".

Files go through Hadoop ``FileSystem`` streams in the JVM (``file:/``, ``hdfs://``, ``s3a://``, ``abfss://``,
``dbfs:/`` ...), so no data passes through the Python driver, and every file we write appears by rename, never half
written. Tables go through delta-spark with Column conditions (no SQL strings to escape).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timezone
from typing import Any, Iterator, Optional

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from .config import ConfigError
from .schemas import table_schema

log = logging.getLogger(__name__)


# ---- files -------------------------------------------------------------------------------------------------------

def _hadoop(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's (JVM-wide cached) FileSystem for ``path``, and the path: for reads and deletes."""
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    return hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hpath


@contextlib.contextmanager
def _writer(spark: SparkSession, path: str) -> Iterator[tuple[Any, Any]]:
    """A FileSystem instance of our own for writing ``path``: without ``.crc`` side files next to the results, a
    setting that must not leak into the JVM-wide cached instance everyone else uses. Closed after use."""
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = jvm.org.apache.hadoop.fs.FileSystem.newInstance(hpath.toUri(), spark.sparkContext._jsc.hadoopConfiguration())
    fs.setWriteChecksum(False)
    try:
        yield fs, hpath
    finally:
        fs.close()


def exists(spark: SparkSession, path: str) -> bool:
    fs, hpath = _hadoop(spark, path)
    return bool(fs.exists(hpath))


def matches_any(spark: SparkSession, path_or_glob: str) -> bool:
    fs, hpath = _hadoop(spark, path_or_glob)
    matches = fs.globStatus(hpath)
    return matches is not None and len(matches) > 0


def is_dir(spark: SparkSession, path: str) -> bool:
    fs, hpath = _hadoop(spark, path)
    return bool(fs.exists(hpath) and fs.getFileStatus(hpath).isDirectory())


def delete(spark: SparkSession, path: str) -> None:
    fs, hpath = _hadoop(spark, path)
    if fs.exists(hpath):
        fs.delete(hpath, True)


def mkdirs(spark: SparkSession, path: str) -> None:
    fs, hpath = _hadoop(spark, path)
    fs.mkdirs(hpath)


def prepare_output_dir(spark: SparkSession, output_dir: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite``; then clear it."""
    fs, hpath = _hadoop(spark, output_dir)
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


def read_text(spark: SparkSession, path: str) -> Optional[str]:
    """A small text file's contents (e.g. an earlier batch.json), or None when it does not exist."""
    if not exists(spark, path):
        return None
    rows = spark.read.text(path, wholetext=True).collect()  # one row: the file
    return rows[0]["value"] if rows else ""


def write_text_atomic(spark: SparkSession, path: str, text: str) -> None:
    """Write a small text file (e.g. batch.json) through a temp file and a rename."""
    with _writer(spark, path) as (fs, hpath):
        tmp = hpath.suffix(".tmp")
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


def write_single_text_file(spark: SparkSession, lines: DataFrame, dest: str) -> None:
    """Write a one-column ``value`` frame as one text file at ``dest``: Spark writes part files, then the JVM
    concatenates them (in name order, i.e. the frame's order) through a temp file and a rename."""
    jvm = spark.sparkContext._jvm
    parts_dir = dest + ".parts"
    delete(spark, parts_dir)
    lines.write.mode("overwrite").option("lineSep", "\n").text(parts_dir)
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    with _writer(spark, dest) as (fs, dst):
        src = jvm.org.apache.hadoop.fs.Path(parts_dir)
        tmp = dst.suffix(".tmp")
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


# ---- tables ------------------------------------------------------------------------------------------------------

def is_table_name(table: str) -> bool:
    """Catalog names (catalog.schema.table) have no slash or scheme; everything else is a Delta path."""
    return "/" not in table and ":" not in table


def is_delta_path(spark: SparkSession, path: str) -> bool:
    from delta.tables import DeltaTable

    return bool(DeltaTable.isDeltaTable(spark, path.rstrip("/")))


def table_exists(spark: SparkSession, table: str) -> bool:
    if is_table_name(table):
        return bool(spark.catalog.tableExists(table))
    return is_delta_path(spark, table)


def read_table(spark: SparkSession, table: str, version: Optional[int] = None) -> DataFrame:
    """The table, or its snapshot at ``version`` (Delta time travel) so that later commits do not change it."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.table(table) if is_table_name(table) else reader.load(table)


def _delta(spark: SparkSession, table: str) -> Any:
    from delta.tables import DeltaTable

    return DeltaTable.forName(spark, table) if is_table_name(table) else DeltaTable.forPath(spark, table)


def current_version(spark: SparkSession, table: str) -> int:
    return int(_delta(spark, table).history(1).select("version").first()[0])


def _save(writer: Any, table: str) -> None:
    if is_table_name(table):
        writer.saveAsTable(table)
    else:
        writer.save(table)


def conform(df: DataFrame, columns: dict) -> DataFrame:
    """Select the table's columns in order, cast, with their comments as column metadata."""
    return df.select([F.col(name).cast(dtype).alias(name, metadata={"comment": comment})
                      for name, (dtype, comment) in columns.items()])


def ensure_table(spark: SparkSession, table: str, columns: dict) -> None:
    """Create the (empty) Delta table, partitioned by batch_id, with column comments, if it does not exist; add the
    columns a table made by an earlier version of spark_llm lacks (they read as null for its older rows)."""
    if table_exists(spark, table):
        have = {f.name for f in read_table(spark, table).schema.fields}
        missing = [(n, t, c) for n, (t, c) in columns.items() if n not in have]
        if missing:
            ref = table if is_table_name(table) else f"delta.`{table.rstrip('/')}`"
            added = ", ".join(f"`{n}` {t.simpleString()} COMMENT '{c.replace(chr(39), '')}'" for n, t, c in missing)
            spark.sql(f"ALTER TABLE {ref} ADD COLUMNS ({added})")
        return
    empty = spark.createDataFrame([], table_schema(columns))
    _save(conform(empty, columns).write.format("delta").partitionBy("batch_id"), table)


def insert_new(df: DataFrame, table: str, columns: dict, batch_id: str) -> None:
    """Insert the rows whose (batch_id, id) is not in the table yet: one Delta MERGE, so a retried or resumed write
    never adds a second row for the same request."""
    target = _delta(df.sparkSession, table).alias("t")
    condition = (F.col("t.batch_id") == F.lit(batch_id)) & (F.col("t.id") == F.col("s.id"))
    target.merge(conform(df, columns).alias("s"), condition).whenNotMatchedInsertAll().execute()


def append_records(spark: SparkSession, records: list[dict], table: str, columns: dict) -> None:
    """Append a few small records (e.g. one per partition) to a Delta table, created on first use."""

    def cell(dtype: Any, value: Any) -> Any:
        if dtype.typeName() == "timestamp" and isinstance(value, (int, float)):
            return datetime.fromtimestamp(value, timezone.utc)
        return value

    data = [tuple(cell(t, r.get(n)) for n, (t, _) in columns.items()) for r in records]
    df = conform(spark.createDataFrame(data, table_schema(columns)), columns)
    # mergeSchema: a table made by an earlier version of spark_llm gains the newer columns
    _save(df.write.format("delta").mode("append").option("mergeSchema", "true").partitionBy("batch_id"), table)


def delete_rows(spark: SparkSession, table: str, condition: Column) -> None:
    if table_exists(spark, table):
        _delta(spark, table).delete(condition)
