"""Storage, in one place: "a table by catalog name or by Delta path" and "a file on any Hadoop filesystem".

Files: with a classic session they go through Hadoop ``FileSystem`` streams in the driver's JVM (``file:/``,
``hdfs://``, ``s3a://``, ``abfss://``, ``dbfs:/`` ...); a Spark Connect session has no JVM in this process, so there
each file operation is a one-task Spark job whose Python worker uses pyarrow's filesystems
(:func:`~spark_llm.filesystems.python_filesystem`) on the cluster, where the paths are. Either way no data passes
through the Python driver, and every file we write appears whole, never half written (by rename, or on an object
store by the close of its one write). A store's refusal (no bucket, credentials refused, a file gone) becomes one
clear :class:`~spark_llm.config.ConfigError` (:func:`refusals_explained`). Tables go through Spark SQL and
DataFrame writes (appends, ``DELETE``, ``DESCRIBE HISTORY``, values as escaped literals), which work over both kinds
of session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Optional, Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from .config import ConfigError
from .schemas import table_schema
from .filesystems import python_filesystem, store_failure
from .session_info import is_connect

log = logging.getLogger(__name__)


# ---- files -------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def refusals_explained(path: str, setting: str) -> Iterator[None]:
    """A store's refusal raised within (:func:`~spark_llm.filesystems.store_failure`: a bucket that does not exist,
    credentials refused, a file gone mid-read) as one :class:`~spark_llm.config.ConfigError` that names ``setting``
    and ``path`` and says what to change, in place of a Java stack; any other failure as it is."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        if (failure := store_failure(str(exc))) is None:
            raise
        raise ConfigError(failure.message(path, setting)) from None


def _in_task(spark: SparkSession, op: Callable[..., Any], *args: Any) -> Any:
    """``op(*args)`` run in one Spark task (a Connect session's file operations); its JSON-able result."""
    import pandas as pd

    def task(batches: Iterator) -> Iterator:
        for _ in batches:
            pass
        yield pd.DataFrame({"result": [json.dumps(op(*args))]})

    return json.loads(spark.range(0, 1, 1, 1).mapInPandas(task, "result string").first()["result"])


def _py_info(path: str) -> str:
    """``missing``, ``file`` or ``dir`` (in a task)."""
    from pyarrow import fs

    filesystem, p = python_filesystem(path)
    kind = filesystem.get_file_info(p).type
    return {fs.FileType.File: "file", fs.FileType.Directory: "dir"}.get(kind, "missing")


def _py_delete(path: str) -> None:
    filesystem, p = python_filesystem(path)
    kind = _py_info(path)
    if kind == "dir":
        filesystem.delete_dir(p)
    elif kind == "file":
        filesystem.delete_file(p)


def _py_mkdirs(path: str) -> None:
    filesystem, p = python_filesystem(path)
    filesystem.create_dir(p, recursive=True)


def _py_list(path: str) -> list[str]:
    from pyarrow import fs

    filesystem, p = python_filesystem(path)
    return [i.path for i in filesystem.get_file_info(fs.FileSelector(p, allow_not_found=True))]


def _py_clear_dir(path: str) -> None:
    from pyarrow import fs

    filesystem, p = python_filesystem(path)
    for child in filesystem.get_file_info(fs.FileSelector(p, allow_not_found=True)):
        if child.type == fs.FileType.Directory:
            filesystem.delete_dir(child.path)
        else:
            filesystem.delete_file(child.path)


def _py_write_atomic(path: str, data: bytes) -> None:
    filesystem, p = python_filesystem(path)
    _py_replace(filesystem, p, lambda out: out.write(data))


def _py_replace(filesystem: Any, path: str, write: Callable[[Any], Any]) -> Any:
    """Write ``path`` through a temp file beside it and a rename (pyarrow); returns what ``write`` returned."""
    from pyarrow import fs

    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with filesystem.open_output_stream(tmp) as out:
        result = write(out)
    if filesystem.get_file_info(path).type != fs.FileType.NotFound:
        filesystem.delete_file(path)
    filesystem.move(tmp, path)
    return result

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


def _kind(spark: SparkSession, path: str) -> str:
    """``missing``, ``file`` or ``dir``."""
    if is_connect(spark):
        return _in_task(spark, _py_info, path)
    fs, hpath = _hadoop(spark, path)
    if not fs.exists(hpath):
        return "missing"
    return "dir" if fs.getFileStatus(hpath).isDirectory() else "file"


def exists(spark: SparkSession, path: str) -> bool:
    return _kind(spark, path) != "missing"


def matches_any(spark: SparkSession, path_or_glob: str) -> bool:
    if is_connect(spark):  # the file source lists the path (globs expanded) when the read is analysed
        try:
            spark.read.format("text").load(path_or_glob).schema
            return True
        except Exception as exc:
            if "PATH_NOT_FOUND" in str(exc) or "does not exist" in str(exc):
                return False
            raise
    fs, hpath = _hadoop(spark, path_or_glob)
    matches = fs.globStatus(hpath)
    return matches is not None and len(matches) > 0


def is_dir(spark: SparkSession, path: str) -> bool:
    return _kind(spark, path) == "dir"


def delete(spark: SparkSession, path: str) -> None:
    if is_connect(spark):
        return _in_task(spark, _py_delete, path)
    fs, hpath = _hadoop(spark, path)
    if fs.exists(hpath):
        fs.delete(hpath, True)


def mkdirs(spark: SparkSession, path: str) -> None:
    if is_connect(spark):
        return _in_task(spark, _py_mkdirs, path)
    fs, hpath = _hadoop(spark, path)
    fs.mkdirs(hpath)


def _children(spark: SparkSession, path: str) -> int:
    if is_connect(spark):
        return len(_in_task(spark, _py_list, path))
    fs, hpath = _hadoop(spark, path)
    return len(fs.listStatus(hpath))


def prepare_output_dir(spark: SparkSession, output_dir: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite``; then clear it."""
    kind = _kind(spark, output_dir)
    if kind == "file":
        raise ConfigError(f"output dir {output_dir!r} is a file, not a directory")
    if kind == "dir" and _children(spark, output_dir) > 0:
        if not overwrite:
            raise ConfigError(f"output dir {output_dir!r} is not empty; choose another --output-dir or pass "
                              f"--overwrite to replace its contents")
        log.warning("overwriting the contents of %s", output_dir)
        if is_connect(spark):
            _in_task(spark, _py_clear_dir, output_dir)
        else:
            fs, hpath = _hadoop(spark, output_dir)
            for status in fs.listStatus(hpath):
                fs.delete(status.getPath(), True)
    mkdirs(spark, output_dir)


def read_text(spark: SparkSession, path: str) -> Optional[str]:
    """A small text file's contents (e.g. an earlier batch.json), or None when it does not exist."""
    if not exists(spark, path):
        return None
    rows = spark.read.text(path, wholetext=True).collect()  # one row: the file
    return rows[0]["value"] if rows else ""


#: Schemes of object stores where a written object appears whole when its writer closes, or not at all (S3A and GCS
#: upload on close, in parts for a large one; a writer that dies leaves an upload nobody sees): a file written there
#: needs no temp object and rename, which on S3 is a copy of the whole object.
WHOLE_ON_CLOSE_SCHEMES = ("s3a", "s3", "s3n", "gs")


def appears_whole_on_close(path: str) -> bool:
    """``path`` is on an object store where a file appears whole or not at all (:data:`WHOLE_ON_CLOSE_SCHEMES`)."""
    return path.split("://", 1)[0].lower() in WHOLE_ON_CLOSE_SCHEMES if "://" in path else False


def write_text_atomic(spark: SparkSession, path: str, text: str) -> None:
    """Write a small text file (e.g. batch.json) whole or not at all: through a temp file and a rename, or, on an
    object store (:func:`appears_whole_on_close`), in place."""
    if is_connect(spark):
        return _in_task(spark, _py_write_atomic, path, text.encode("utf-8"))
    with _writer(spark, path) as (fs, hpath):
        in_place = appears_whole_on_close(path)
        tmp = hpath if in_place else hpath.suffix(".tmp")
        with _created(fs, tmp, in_place) as out:
            out.write(bytearray(text.encode("utf-8")))
        if not in_place:
            _replace(fs, tmp, hpath)


@contextlib.contextmanager
def _created(fs: Any, hpath: Any, in_place: bool) -> Iterator[Any]:
    """A new file's output stream, closed when the block ends; when it fails, an object written in place is
    aborted (its upload dropped: closing would publish what was written so far)."""
    out = fs.create(hpath, True)
    try:
        yield out
    except BaseException:
        if in_place:
            out.abort()  # Hadoop's Abortable (S3A): nothing appears
        else:
            out.close()  # a temp file, never renamed
        raise
    out.close()


def _replace(fs: Any, src: Any, dst: Any) -> None:
    if fs.exists(dst):
        fs.delete(dst, False)
    if not fs.rename(src, dst):
        raise IOError(f"could not rename {src.toString()} to {dst.toString()}")


def write_single_text_file(spark: SparkSession, lines: DataFrame, dest: str) -> None:
    """Write a one-column ``value`` frame as one text file at ``dest``: Spark writes part files, then the JVM
    concatenates them (in name order, i.e. the frame's order) through a temp file and a rename. Over Spark Connect
    one task streams the (ordered) frame into the file instead. On an object store (:func:`appears_whole_on_close`)
    the concatenation goes straight to ``dest``, without the temp file's copy."""
    if is_connect(spark):
        return _write_in_one_task(lines, dest)
    jvm = spark.sparkContext._jvm
    parts_dir = dest + ".parts"
    delete(spark, parts_dir)
    lines.write.mode("overwrite").option("lineSep", "\n").text(parts_dir)
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    with _writer(spark, dest) as (fs, dst):
        src = jvm.org.apache.hadoop.fs.Path(parts_dir)
        in_place = appears_whole_on_close(dest)
        tmp = dst if in_place else dst.suffix(".tmp")
        parts = sorted((s.getPath() for s in fs.listStatus(src) if s.getPath().getName().startswith("part-")),
                       key=lambda p: p.getName())
        with _created(fs, tmp, in_place) as out:
            for part in parts:
                stream = fs.open(part)
                try:
                    jvm.org.apache.hadoop.io.IOUtils.copyBytes(stream, out, conf, False)
                finally:
                    stream.close()
        if not in_place:
            _replace(fs, tmp, dst)
        fs.delete(src, True)


def _write_in_one_task(lines: DataFrame, dest: str) -> None:
    import pandas as pd

    def copy(batches: Iterator, out: Any) -> int:
        n = 0
        for pdf in batches:
            if len(pdf):
                out.write(("\n".join(pdf["value"]) + "\n").encode("utf-8"))
                n += len(pdf)
        return n

    def task(batches: Iterator) -> Iterator:
        filesystem, p = python_filesystem(dest)
        yield pd.DataFrame({"lines": [_py_replace(filesystem, p, lambda out: copy(batches, out))]})

    lines.coalesce(1).mapInPandas(task, "lines long").collect()  # one row: the count


# ---- tables ------------------------------------------------------------------------------------------------------

def sql_string(value: str) -> str:
    """A SQL string literal (Delta's DELETE does not bind parameter markers)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sql_name(table: str) -> str:
    """The table in SQL: a quoted catalog name, or ``delta.`path```."""
    if is_table_name(table):
        return ".".join(f"`{part.replace('`', '``')}`" for part in table.split("."))
    path = table.rstrip("/")
    if ":" not in path and not path.startswith("/"):  # Delta reads only absolute paths as paths
        path = os.path.abspath(path)
    return f"delta.`{path.replace('`', '``')}`"


def is_table_name(table: str) -> bool:
    """Catalog names (catalog.schema.table) have no slash or scheme; everything else is a Delta path."""
    return "/" not in table and ":" not in table


def is_delta_path(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` is a Delta table. With a classic session, a path that is no directory with a ``_delta_log``
    (a JSONL file, a glob, a table not created yet) is answered by the filesystem in milliseconds, the rest by
    Delta's ``isDeltaTable`` (the log's latest version: 0.3 s cold, then milliseconds). Over Spark Connect by
    DESCRIBE DETAIL, which also computes the table's state: seconds of the driver's time the first time in a
    session."""
    if not is_connect(spark):
        if not is_dir(spark, path.rstrip("/") + "/_delta_log"):
            return False
        from delta.tables import DeltaTable

        return bool(DeltaTable.isDeltaTable(spark, path))
    try:
        spark.sql(f"DESCRIBE DETAIL {sql_name(path)}").collect()  # one row of metadata
        return True
    except Exception as exc:
        text = str(exc)
        if any(k in text for k in ("DELTA_MISSING_DELTA_TABLE", "not a Delta table", "DELTA_PATH_DOES_NOT_EXIST",
                                   "PATH_NOT_FOUND", "doesn't exist", "does not exist", "DELTA_TABLE_NOT_FOUND",
                                   "TABLE_OR_VIEW_NOT_FOUND")):
            return False
        raise


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


def current_version(spark: SparkSession, table: str) -> int:
    return int(spark.sql(f"DESCRIBE HISTORY {sql_name(table)} LIMIT 1").select("version").first()[0])


def _save(writer: Any, table: str) -> None:
    if is_table_name(table):
        writer.saveAsTable(table)
    else:
        writer.save(table)


def conform(df: DataFrame, columns: dict) -> DataFrame:
    """Select the table's columns in order, cast, with their comments as column metadata."""
    return df.select([F.col(name).cast(dtype).alias(name, metadata={"comment": comment})
                      for name, (dtype, comment) in columns.items()])


#: What Delta says when two writers create one table at once: the second commit of version 0, or a creation that
#: finds the other's version 0 being written (its _delta_log already there).
CONCURRENT_CREATE = ("DELTA_PROTOCOL_CHANGED", "DELTA_METADATA_CHANGED", "ProtocolChangedException",
                     "DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION")


def ensure_table(spark: SparkSession, table: str, columns: dict, stats_columns: Sequence[str] = ()) -> None:
    """Create the (empty) Delta table, partitioned by batch_id, with column comments and file statistics on
    ``stats_columns`` only (Delta's default when empty), if it does not exist: one DDL statement, a Delta commit
    and no Spark job (writing an empty frame took a job and 1.5-2 s more of the driver's time per table); add the
    columns a table made by an earlier version of spark_llm lacks (they read as null for its older rows)."""
    if table_exists(spark, table):
        have = {f.name for f in read_table(spark, table).schema.fields}
        missing = {n: column for n, column in columns.items() if n not in have}
        if missing:
            spark.sql(f"ALTER TABLE {sql_name(table)} ADD COLUMNS ({column_ddl(missing)})")
        return
    properties = (f" TBLPROPERTIES ('delta.dataSkippingStatsColumns' = {sql_string(','.join(stats_columns))})"
                  if stats_columns else "")
    try:
        spark.sql(f"CREATE TABLE IF NOT EXISTS {sql_name(table)} ({column_ddl(columns)}) USING delta "
                  f"PARTITIONED BY (batch_id){properties}")
    except Exception as exc:
        # another writer made it at the same moment (two servers of the batch service starting their first batches
        # on shared tables): the table is there, or about to be, as wanted
        if not any(code in str(exc) for code in CONCURRENT_CREATE) or not _made_by_another(spark, table):
            raise


def _made_by_another(spark: SparkSession, table: str, seconds: float = 30.0) -> bool:
    """Whether ``table``, which this process failed to create, is readable within ``seconds``: another writer made
    it. Read rather than :func:`table_exists`: the failed creation leaves this JVM's cached Delta log without the
    table, and ``isDeltaTable`` goes on answering from it; a read updates it. Not waited for: a path with no
    ``_delta_log`` (a directory of other files, which no writer is making a table of)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            read_table(spark, table).schema
            return True
        except Exception:
            if time.monotonic() > deadline or (
                    not is_table_name(table) and not is_dir(spark, table.rstrip("/") + "/_delta_log")):
                return False
            time.sleep(0.5)


def column_ddl(columns: dict) -> str:
    """``columns`` (name -> (type, comment)) as SQL column definitions (nullable, as Delta makes the columns of a
    table it creates)."""
    return ", ".join(f"`{name.replace('`', '``')}` {dtype.simpleString()} COMMENT {sql_string(comment)}"
                     for name, (dtype, comment) in columns.items())


def append_rows(df: DataFrame, table: str, columns: dict) -> None:
    """Append ``df`` as the table's columns: one blind Delta append, which reads nothing of the table (a MERGE that
    inserted only new ids read every id of the batch's partition at every wave, a cost growing with the batch) and
    never conflicts with other appends. Exactly-once is the caller's: a run writes only requests that no committed
    row answers (:func:`~spark_llm.write.pending`), each once, one writer per batch."""
    _save(conform(df, columns).write.format("delta").mode("append"), table)


def append_records(spark: SparkSession, records: list[dict], table: str, columns: dict) -> None:
    """Append a few small records (e.g. one per partition) to a Delta table, created on first use. The records
    reach Spark as an Arrow table, which the JVM reads itself: a list of rows would start Python workers to
    unpickle them (two new workers, a second or more of a short run's commit)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    def cell(dtype: Any, value: Any) -> Any:
        if dtype.typeName() == "timestamp" and isinstance(value, (int, float)):
            return datetime.fromtimestamp(value, timezone.utc)
        return value

    schema = table_schema(columns)
    data = pa.Table.from_pylist([{n: cell(t, r.get(n)) for n, (t, _) in columns.items()} for r in records],
                                schema=to_arrow_schema(schema, timezone="UTC"))
    df = conform(spark.createDataFrame(data, schema), columns)
    # mergeSchema: a table made by an earlier version of spark_llm gains the newer columns
    _save(df.write.format("delta").mode("append").option("mergeSchema", "true").partitionBy("batch_id"), table)


def delete_rows(spark: SparkSession, table: str, batch_id: str, codes: Sequence[str] = ()) -> None:
    """Delete a batch's rows (those with one of the error ``codes`` only, when given). A delete that matches no row
    commits nothing."""
    if table_exists(spark, table):
        where = f"batch_id = {sql_string(batch_id)}"
        if codes:
            where += f" AND code IN ({', '.join(sql_string(c) for c in codes)})"
        spark.sql(f"DELETE FROM {sql_name(table)} WHERE {where}")
