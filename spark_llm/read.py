"""Read OpenAI batch JSONL input as raw lines with their file and 1-based line number.

Spark's text source keeps every line (blank ones too) as raw bytes, so invalid UTF-8 survives to validation. Line
numbers are computed without a driver collect: each row's position inside its file split comes from
``monotonically_increasing_id`` (rows of one split are contiguous in one task), and a small per-split count table
(one row per split, i.e. metadata) gives each split's offset within its file.
"""

from __future__ import annotations

import glob
import logging
import os
import urllib.parse
from typing import Iterable, Iterator, Optional, Sequence

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from . import faults, storage
from .config import ConfigError
from .filesystems import python_filesystem
from .schemas import json_string

log = logging.getLogger(__name__)


#: Compressed inputs: their file size says nothing about their lines, so the over-long-line guard is off for them.
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4", ".snappy", ".deflate", ".xz", ".zstd")
#: Files of a table or sheet format, never JSON lines: a directory holding only these is not a batch's input.
_NOT_JSONL = (".parquet", ".orc", ".avro", ".csv", ".tsv", ".xlsx", ".crc", ".zip", ".tar")


def files_problem(path: str, files: Sequence[str]) -> Optional[str]:
    """What is wrong with the files an input directory or glob ``path`` lists, if anything: none (every name hidden,
    ``_``/``.``, as a Spark job's ``_SUCCESS``), or none that can hold JSON lines (a table's Parquet files, a CSV
    export). Files named otherwise (``part-00000``, ``*.jsonl``, ``*.txt``) are read: their lines are checked one by
    one."""
    if not files:
        return f"input {path!r} holds no file to read (names starting with _ or . are skipped) (--input)"
    if all(f.lower().endswith(_NOT_JSONL) for f in files):
        kinds = sorted({f.rsplit(".", 1)[-1].lower() for f in files})
        return (f"input {path!r} holds no JSONL file, only {', '.join(kinds)} ({len(files)} file(s), e.g. "
                f"{files[0]}): give the directory or file of the batch's JSON lines (--input), or a table as "
                f"--input-table or a Delta path")
    return None


def read_lines(spark: SparkSession, path: str, max_line_bytes: int = 16 << 20) -> DataFrame:
    """Raw input lines as ``value`` (binary), ``file`` (string), ``line_number`` (long, 1-based) and ``line_bytes``
    (the line's size where ``value`` holds only its first bytes: a line over ``max_line_bytes``; else null).

    ``path`` is a file, a directory (its files, recursively; hidden ``_``/``.`` files skipped) or a glob on any
    Hadoop-compatible filesystem.

    No line longer than ``max_line_bytes`` is ever held whole: Hadoop's line reader is told to step over such lines
    (which it does without a word), and each file's byte count is checked against the bytes of the lines read; a file
    that lost bytes that way is read again, streaming, by :func:`_stream_file_lines`, which keeps the first bytes of
    an over-long line and its size (a ``line_too_large`` row in validation) and every other line as it is.
    """
    _check_exists(spark, path)
    reader = spark.read.format("text")
    if storage.is_dir(spark, path):
        reader = reader.option("recursiveFileLookup", "true")
    files = reader.load(path).inputFiles()  # the listing Spark makes anyway: file names only
    if (problem := files_problem(path, files)) is not None:
        raise ConfigError(problem)
    guarded = not any(f.lower().endswith(_COMPRESSED) for f in files)
    if guarded:
        reader = reader.option("mapreduce.input.linerecordreader.line.maxlength", str(max_line_bytes + 1))
    else:
        log.warning("compressed input: lines are read whole, however long (max_line_bytes still applies to them)")
    lines = reader.load(path).select(
        F.col("value").cast("binary").alias("value"),
        F.col("_metadata.file_path").alias("file"),
        F.col("_metadata.file_block_start").alias("block_start"),
        F.col("_metadata.file_size").alias("file_size"),
        F.monotonically_increasing_id().alias("_pos"),
    )
    faults.before_reading_input()
    splits = lines.groupBy("file", "block_start").agg(
        F.count(F.lit(1)).alias("_n"), F.min("_pos").alias("_first"), F.sum(F.length("value")).alias("_bytes"),
        F.max("file_size").alias("file_size")).collect()  # a row per file split: metadata
    suspect = sorted(_files_missing_lines(splits, max_line_bytes)) if guarded else []
    table = spark.createDataFrame(
        [(r["file"], r["block_start"], r["_n"], r["_first"]) for r in splits],
        "file string, block_start long, _n long, _first long")
    earlier = Window.partitionBy("file").orderBy("block_start").rowsBetween(Window.unboundedPreceding, -1)
    table = table.withColumn("_offset", F.coalesce(F.sum("_n").over(earlier), F.lit(0)))
    numbered = (
        lines.where(~F.col("file").isin(suspect)) if suspect else lines
    ).join(F.broadcast(table.select("file", "block_start", "_offset", "_first")), ["file", "block_start"]).select(
        "value", "file", (F.col("_offset") + F.col("_pos") - F.col("_first") + 1).alias("line_number"),
        F.lit(None).cast("long").alias("line_bytes"))
    if not suspect:
        return numbered
    log.warning("%d input file(s) hold lines over max_line_bytes (%d): reading them again, streaming: %s",
                len(suspect), max_line_bytes, ", ".join(suspect[:5]))
    keep = max(_PREVIEW_BYTES, 1)
    streamed = (spark.createDataFrame([(f,) for f in suspect], "file string").repartition(len(suspect))
                .mapInPandas(lambda it: _stream_file_lines(it, max_line_bytes, keep), _STREAMED_SCHEMA))
    return numbered.unionByName(streamed)


#: How much of an over-long line is kept: enough for its custom_id and the error row's preview.
_PREVIEW_BYTES = 64 * 1024
_STREAMED_SCHEMA = "value binary, file string, line_number long, line_bytes long"


def _files_missing_lines(splits: list, max_line_bytes: int) -> set[str]:
    """Files whose lines do not add up to their size: Hadoop's reader stepped over a line there."""
    per_file: dict[str, list[int]] = {}
    for r in splits:
        agg = per_file.setdefault(r["file"], [0, 0, int(r["file_size"] or 0)])
        agg[0] += int(r["_n"])
        agg[1] += int(r["_bytes"] or 0)
    return {f for f, (n, kept, size) in per_file.items() if may_have_skipped(size, kept, n, max_line_bytes)}


def may_have_skipped(file_size: int, kept_bytes: int, lines: int, max_line_bytes: int) -> bool:
    """Whether a file of ``file_size`` bytes whose ``lines`` lines read hold ``kept_bytes`` may have had a line over
    ``max_line_bytes`` stepped over. Each line ends in 1 or 2 bytes (LF, CR or CRLF; the last maybe none), so without
    a skipped line ``file_size - kept_bytes`` is at most ``2 x lines``; a skipped line adds more than
    ``max_line_bytes``, which only hides below ``2 x lines`` when a file has more lines than ``max_line_bytes``."""
    rest = file_size - kept_bytes
    return rest > 2 * lines or (lines >= max_line_bytes and rest > max_line_bytes)


def _stream_file_lines(batches: Iterator, max_line_bytes: int, keep: int) -> Iterator:
    """mapInPandas body: the lines of each file named in the batches, streamed (8 MiB at a time) with Hadoop's line
    ends (LF, CRLF, CR) and numbers; a line over ``max_line_bytes`` as its first ``keep`` bytes and its size."""
    import pandas as pd

    for pdf in batches:
        for file in pdf["file"]:
            rows: list[tuple] = []
            for row in split_lines(_chunks(file), max_line_bytes, keep):
                rows.append((row[0], file, row[1], row[2]))
                if len(rows) >= 4096:
                    yield pd.DataFrame(rows, columns=["value", "file", "line_number", "line_bytes"])
                    rows = []
            if rows:
                yield pd.DataFrame(rows, columns=["value", "file", "line_number", "line_bytes"])


def _chunks(uri: str, size: int = 8 << 20) -> Iterator[bytes]:
    """The bytes of a file Spark names (``_metadata.file_path``: a ``file:`` URI is URI-quoted)."""
    filesystem, path = python_filesystem(local_path(uri) if uri.startswith("file:") else uri)
    with filesystem.open_input_stream(path) as f:
        while chunk := f.read(size):
            yield chunk


def split_lines(chunks: Iterable[bytes], max_line_bytes: int, keep: int) -> Iterator[tuple]:
    """``(value, line_number, line_bytes)`` per line of a byte stream, as Hadoop's line reader splits it (LF, CRLF and
    a lone CR end a line; no empty line after a final line end; a UTF-8 byte order mark at the start dropped); a line
    over ``max_line_bytes`` is kept as its first ``keep`` bytes with its size, never held whole."""
    part = bytearray()
    size, number, after_cr = 0, 0, False
    for chunk in _without_bom(chunks):
        i, n = 0, len(chunk)
        if after_cr and n:
            after_cr = False
            if chunk[0] == 0x0A:  # the LF of a CRLF split across chunks
                i = 1
        next_lf, next_cr = chunk.find(b"\n", i), chunk.find(b"\r", i)
        while i < n:
            if 0 <= next_lf < i:
                next_lf = chunk.find(b"\n", i)
            if 0 <= next_cr < i:
                next_cr = chunk.find(b"\r", i)
            ends = [e for e in (next_lf, next_cr) if e >= 0]
            end = min(ends) if ends else n
            if size < max(keep, max_line_bytes + 1):
                part += chunk[i:min(end, i + max(keep, max_line_bytes + 1) - size)]
            size += end - i
            if not ends:
                break
            number += 1
            yield _line(part, size, number, max_line_bytes, keep)
            part, size = bytearray(), 0
            i = end + 1
            if chunk[end] == 0x0D:
                if end + 1 < n and chunk[end + 1] == 0x0A:
                    i += 1
                elif end + 1 == n:
                    after_cr = True
    if size or part:
        number += 1
        yield _line(part, size, number, max_line_bytes, keep)


def _without_bom(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """A byte stream without the UTF-8 byte order mark it may open with (Hadoop's line reader drops it too)."""
    it = iter(chunks)
    head = b""
    for chunk in it:
        head += chunk
        if len(head) >= 3:
            break
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:]
    if head:
        yield head
    yield from it


def _line(part: bytearray, size: int, number: int, max_line_bytes: int, keep: int) -> tuple:
    if size > max_line_bytes:
        return bytes(part[:keep]), number, size
    return bytes(part), number, None


# ---- local files, read in this process (the dry run of a small local batch: no Spark) -----------------------

def local_files(path: str) -> Optional[list[str]]:
    """The files ``path`` names when it is JSONL on this machine, as Spark lists them (a file; a directory's files,
    recursively, hidden ``_`` / ``.`` names skipped; a glob), sorted as their URIs; None when Spark must read it (a
    remote filesystem, a Delta table, compressed files, a Hadoop glob with braces)."""
    if path.startswith("file:"):
        path = "/" + path[len("file:"):].lstrip("/")
    elif "://" in path or "{" in path:
        return None
    roots = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
    files: list[str] = []
    for root in roots:
        if os.path.isdir(root):
            if os.path.isdir(os.path.join(root, "_delta_log")):
                return None
            for parent, dirs, names in os.walk(root):
                dirs[:] = [d for d in dirs if not _hidden(d)]
                files.extend(os.path.join(parent, n) for n in names if not _hidden(n))
        elif os.path.isfile(root):
            files.append(root)
    if any(f.lower().endswith(_COMPRESSED) for f in files):
        return None
    return sorted(_hadoop_uri(f) for f in files)


def local_input_bytes(config) -> Optional[int]:
    """Bytes of the input when it is JSONL files (not compressed) on this machine, which this process can read
    itself (the dry run's :func:`~spark_llm.plan.plan_local`, a small batch's in-process prepare), not a Delta table
    or a catalog table; else None."""
    files = local_files(config.input) if config.input and not config.input_table else None
    return sum(os.path.getsize(local_path(f)) for f in files) if files else None


def local_path(uri: str) -> str:
    """The path on this machine of a :func:`local_files` URI."""
    return urllib.parse.unquote(uri[len("file:"):])


def _hadoop_uri(path: str) -> str:
    """A local file as Spark names it (``_metadata.file_path``): ``file:/abs/path``, URI-quoted."""
    return "file:" + urllib.parse.quote(os.path.abspath(path), safe="/=:@!$&'()*+,;~")


def _hidden(name: str) -> bool:
    """Names Spark's file listing skips."""
    return name.startswith(".") or (name.startswith("_") and "=" not in name) or name.endswith("._COPYING_")


def local_lines(files: list[str], max_line_bytes: int, rows: int = 4096) -> Iterator:
    """The raw lines of local ``files`` (URIs, in order) as :func:`read_lines` gives them (``value``, ``file``,
    ``line_number``, ``line_bytes``), in pandas frames of up to ``rows`` lines."""
    import pandas as pd

    keep = max(_PREVIEW_BYTES, 1)
    columns = ["value", "file", "line_number", "line_bytes"]
    batch: list[tuple] = []
    for file in files:
        for value, number, size in split_lines(_chunks(file), max_line_bytes, keep):
            batch.append((value, file, number, size))
            if len(batch) >= rows:
                yield pd.DataFrame(batch, columns=columns)
                batch = []
    if batch:
        yield pd.DataFrame(batch, columns=columns)


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
                             F.col("line_number").cast("long"), F.lit(None).cast("long").alias("line_bytes"))


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
    with storage.refusals_explained(cfg.input, "--input"):
        _check_exists(spark, cfg.input)
        if storage.is_delta_path(spark, cfg.input):
            return table_lines(spark.read.format("delta").load(cfg.input), cfg, cfg.input)
        return read_lines(spark, cfg.input, cfg.max_line_bytes)
