"""The prepare stage: raw lines -> validated, deduplicated, tokenized rows with their batch line ids.

Everything before inference that looks at single requests: reading (:mod:`~spark_llm.read`), validation
(:mod:`~spark_llm.validate`), duplicate ``custom_id``\\ s, token counting (:mod:`~spark_llm.tokens`) and the stable
per-line ids the result tables are keyed by. Rows that fail anywhere carry ``error_code``; none are dropped.

On Spark's executors, or, for a JSONL input on this machine in a local session small enough (:func:`prepares_here`),
in the driver's own process with the same functions over pandas, a chunk of lines at a time, the rows then handed
to Spark as one Arrow table (their counts and partition plan made here too, :class:`LocalRows`): a few Python
workers starting cold and the JVM's first jobs cost a small batch more than its work does. A larger one of those
comes in two parts (:func:`prepare_in_parts`): its first lines infer while a driver thread prepares the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .config import BatchConfig, ConfigError, config_view
from .errors import LINE_LEVEL_CODES, ErrorCode
from .media import MediaPolicy
from .read import read_input
from .schemas import PREFIX_COL, TOKENIZED_SCHEMA, VALIDATED_SCHEMA
from .tokens import TokenContext, count_batches
from .validate import ValidationContext, validate_batches


#: The prepare stage's rows: the token stage's and their line ids (:func:`with_line_ids`).
PREPARED_SCHEMA = T.StructType(TOKENIZED_SCHEMA.fields + [T.StructField("id", T.StringType()),
                                                          T.StructField("request_id", T.StringType())])

#: Largest input (bytes of JSONL files on this machine) a local session prepares in the driver's process
#: (:func:`prepares_here`): its rows pass through the driver on their way to Spark.
LOCAL_PREPARE_BYTES = 32 << 20
#: What the prepare stage's Spark jobs cost before their work (cold Python workers, the JVM's first jobs, the
#: duplicates' shuffle), beside a loading engine: 9.5 s on two cores for a 2,000-line input.
SPARK_PREPARE_SECONDS = 9.5
#: Bytes of JSONL one core reads, validates and counts tokens of per second, beside a loading engine.
PREPARE_BYTES_PER_SECOND = 1.5e6


@dataclass(frozen=True)
class LocalRows:
    """The plan columns (:data:`LOCAL_COLUMNS`) of every row of an input prepared in this process, as an Arrow
    table: the run counts and plans them here (:func:`~spark_llm.partition.plan_in_process`), without the Spark
    jobs that would (8 of a 15-line run's 56, seconds of the two cores' CPU); the lines passed through this process
    anyway."""

    table: Any

    def outcomes(self) -> "Outcomes":
        return Outcomes(rows=self.table.num_rows, errors=self.table.num_rows - self.table["error_code"].null_count)

    def valid(self, model: Optional[str] = None) -> Any:
        """The rows that run (no error_code), of ``model`` or of every model."""
        import pyarrow.compute as pc

        keep = pc.is_null(self.table["error_code"])
        if model is not None:
            keep = pc.and_(keep, pc.equal(self.table["model"], model))
        return self.table.filter(keep)

    def valid_per_model(self) -> dict[str, int]:
        """Rows that run, per model."""
        import pyarrow.compute as pc

        counts = pc.value_counts(self.valid()["model"])
        return {c["values"].as_py(): c["counts"].as_py() for c in counts}


#: The columns of :class:`LocalRows`: what the counts and the partition plan read.
LOCAL_COLUMNS = ("model", "error_code", "id", PREFIX_COL, "est_tokens")


@dataclass(frozen=True)
class Prepared:
    """The prepare stage's result: every line as one row, and their plan columns when prepared in this process."""

    rows: DataFrame
    local: Optional[LocalRows] = None


def prepare(spark: SparkSession, models: Sequence[BatchConfig]) -> DataFrame:
    """Every non-blank input line as one row: a request with its prompt token ids and the model it runs on, or an
    error. ``models``: the batch's models as resolved configs, the main one first
    (:func:`~spark_llm.models.resolve_models`); the ids depend on their batch_id."""
    return prepared(spark, models).rows


def prepared(spark: SparkSession, models: Sequence[BatchConfig]) -> Prepared:
    """:func:`prepare`, with the plan columns of an input prepared in this process (:func:`prepares_in_process`)."""
    if prepares_in_process(spark, models[0]):
        return prepare_in_process(spark, models)
    return Prepared(prepare_on_spark(spark, models))


def prepare_on_spark(spark: SparkSession, models: Sequence[BatchConfig]) -> DataFrame:
    """:func:`prepare` as Spark jobs: each stage a ``mapInPandas`` over the raw lines on the executors."""
    cfg = models[0]
    vctx = ValidationContext.of_models(models)
    tctx = {m.served_model_name: replace(config_view(TokenContext, m), media=MediaPolicy.of(m)) for m in models}
    lines = read_input(spark, cfg)
    validated = lines.mapInPandas(lambda it: validate_batches(it, vctx), VALIDATED_SCHEMA)
    deduped = mark_duplicates(validated)
    tokenized = deduped.mapInPandas(lambda it: count_batches(it, tctx), TOKENIZED_SCHEMA)
    return with_line_ids(tokenized, cfg.batch_id or "")


def prepares_here(input_bytes: int, task_threads: int) -> bool:
    """Whether ``input_bytes`` of JSONL are prepared sooner in this process than by Spark's jobs on a local master
    of ``task_threads`` task threads. Here the work takes ``b / r`` seconds (``r``:
    :data:`PREPARE_BYTES_PER_SECOND`); on Spark a fixed ``f`` (:data:`SPARK_PREPARE_SECONDS`) plus the same work
    over the threads, ``f + b / (r t)``. So here while ``b <= f r t / (t - 1)``: 28.5 MB on two threads, 15 MB on
    thirty-two, always on one; and never past :data:`LOCAL_PREPARE_BYTES`."""
    if input_bytes > LOCAL_PREPARE_BYTES:
        return False
    if task_threads <= 1:
        return True
    return input_bytes <= SPARK_PREPARE_SECONDS * PREPARE_BYTES_PER_SECOND * task_threads / (task_threads - 1)


def prepares_in_process(spark: SparkSession, cfg: BatchConfig) -> bool:
    """The run's input is prepared in this process (:func:`prepare_in_process`): a classic local session (its
    executor is this machine) and JSONL files on this machine that :func:`prepares_here` says are sooner done here."""
    return _bytes_prepared_in_process(spark, cfg) is not None


def _bytes_prepared_in_process(spark: SparkSession, cfg: BatchConfig) -> Optional[int]:
    """The size of the run's input when it is prepared in this process (:func:`prepares_in_process`), else None."""
    from .session_info import is_connect, is_local_master, local_task_threads, spark_conf

    conf = spark_conf(spark)
    if cfg.input_table or is_connect(spark) or not is_local_master(conf):
        return None
    return _bytes_prepared_here(cfg, local_task_threads(conf) or 1)


def _bytes_prepared_here(cfg: BatchConfig, task_threads: int) -> Optional[int]:
    """The size of the input when it is JSONL files on this machine that :func:`prepares_here` prepares in this
    process, else None."""
    from .read import local_input_bytes

    size = local_input_bytes(cfg)
    return size if size is not None and prepares_here(size, task_threads) else None


def preload_tokenizers(config: BatchConfig, task_threads: int) -> bool:
    """``spark-llm run`` on a local master of ``task_threads`` task threads that it starts itself: when the input
    is to be prepared in this process (:func:`prepares_here`), load its models' tokenizers in a thread of this
    process while the session's JVM starts, for :func:`prepare_in_process` to find loaded (importing transformers
    and loading the tokenizer is 3.7 s of a 15-line run's 27 s when it waits for the session). A head start only:
    False, and nothing loaded, when the input is not such a file or the settings do not resolve here; a tokenizer
    that fails to load fails the prepare stage's own load, with its message."""
    import threading

    from .models import resolve, resolve_models
    from .tokenizers import get_tokenizer

    if _bytes_prepared_here(config, task_threads) is None:
        return False
    try:
        paths = list(dict.fromkeys(m.tokenizer for m in resolve_models(resolve(config))))
    except Exception:  # the run reports bad settings with its own message
        return False

    def load() -> None:
        for path in paths:
            try:
                get_tokenizer(path)
            except Exception:  # said again, and reported, when the prepare stage loads it
                return
    threading.Thread(target=load, name="spark_llm-tokenizers", daemon=True).start()
    return True


def prepare_in_process(spark: SparkSession, models: Sequence[BatchConfig]) -> Prepared:
    """:func:`prepare` of a small local input in this process (:func:`prepared_chunks`, :func:`line_ids`), handed
    to Spark as one Arrow table; the same rows, in the same schema, as Spark's executors make."""
    return _handed_to_spark(spark, list(_arrow_chunks(models)))


#: A local input prepared in this process from this size on is prepared in two parts (:func:`prepare_in_parts`).
PARTS_BYTES = 4 * 2**20
#: The lines of the first part, whose requests infer while the rest is prepared: on this machine's CPU engine
#: 4,096 requests take longer than preparing 16,000 more lines does.
HEAD_LINES = 4096


def prepares_in_parts(input_bytes: int) -> bool:
    """Whether a local input of ``input_bytes`` that is prepared in this process (:func:`prepares_in_process`) is
    prepared in two parts: when it takes seconds (4 MiB is 2.7 s here) that loaded engines would wait for."""
    return input_bytes >= PARTS_BYTES


def prepares_in_parts_here(spark: SparkSession, cfg: BatchConfig) -> bool:
    """The run's input is prepared in this process (:func:`prepares_in_process`), in two parts
    (:func:`prepares_in_parts`)."""
    size = _bytes_prepared_in_process(spark, cfg)
    return size is not None and prepares_in_parts(size)


def prepare_in_parts(spark: SparkSession, models: Sequence[BatchConfig]) -> tuple[Prepared, "PreparingRest"]:
    """:func:`prepare_in_process` in two parts: the first :data:`HEAD_LINES` lines now, and a thread of this
    process preparing the rest meanwhile (:class:`PreparingRest`), so that the first part's requests infer while
    it does. Duplicates of a ``custom_id`` are found across both parts, as in one."""
    import itertools

    import pyarrow as pa

    def rows_of(chunk: Any, start: int, stop: int) -> Any:  # copies: Spark does not take every slice of an array
        return chunk.take(pa.array(range(start, stop), pa.int64()))

    chunks = _arrow_chunks(models)
    head: list = []
    rows = 0
    for chunk in chunks:
        take = min(chunk.num_rows, HEAD_LINES - rows)
        head.append(rows_of(chunk, 0, take))
        rows += take
        if rows >= HEAD_LINES:
            chunks = itertools.chain([rows_of(chunk, take, chunk.num_rows)], chunks)
            break
    return _handed_to_spark(spark, head), PreparingRest(chunks)


class PreparingRest:
    """The rest of an input prepared in two parts (:func:`prepare_in_parts`), prepared by a thread of this
    process; :meth:`wait` hands it to Spark."""

    def __init__(self, chunks: Iterator):
        import threading

        self.chunks: list = []
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._prepare, args=(chunks,), name="spark_llm-prepare", daemon=True)
        self.thread.start()

    def _prepare(self, chunks: Iterator) -> None:
        try:
            self.chunks.extend(chunks)
        except BaseException as exc:  # raised by wait, in the run's thread
            self.error = exc

    def wait(self, spark: SparkSession) -> Prepared:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return _handed_to_spark(spark, self.chunks)


def _arrow_chunks(models: Sequence[BatchConfig]) -> Iterator:
    """:func:`prepared_chunks` with their line ids, as Arrow tables in :data:`PREPARED_SCHEMA`."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(PREPARED_SCHEMA)
    batch_id = models[0].batch_id or ""
    for pdf in prepared_chunks(models):
        yield pa.Table.from_pandas(line_ids(pdf, batch_id)[list(PREPARED_SCHEMA.fieldNames())], schema=schema,
                                   preserve_index=False)


def _handed_to_spark(spark: SparkSession, chunks: list) -> Prepared:
    """Prepared rows made in this process, as one Arrow table, handed to Spark."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    table = pa.concat_tables(chunks) if chunks else to_arrow_schema(PREPARED_SCHEMA).empty_table()
    return Prepared(spark.createDataFrame(table, PREPARED_SCHEMA), LocalRows(table.select(list(LOCAL_COLUMNS))))


def prepared_chunks(models: Sequence[BatchConfig]) -> Iterator:
    """The token stage's rows of local JSONL files (:func:`~spark_llm.read.local_files`), computed in this process:
    the same reading, validation, duplicate and token-counting functions as :func:`prepare`'s Spark jobs, over
    pandas, a chunk of lines at a time (only the first line of each custom_id is kept in memory)."""
    from .read import local_files, local_lines

    cfg = models[0]
    vctx = ValidationContext.of_models(models)
    tctx = {m.served_model_name: replace(config_view(TokenContext, m), media=MediaPolicy.of(m)) for m in models}
    first: dict[str, tuple[str, int]] = {}
    for lines in local_lines(local_files(cfg.input or "") or [], cfg.max_line_bytes):
        for validated in validate_batches(iter([lines]), vctx):
            mark_duplicates_in_order(validated, first)
            yield from count_batches(iter([validated]), tctx)


def local_groups(models: Sequence[BatchConfig]) -> list[dict]:
    """:func:`prepare` of local JSONL files in this process, for the dry run (:func:`prepared_chunks`); returns per
    model and error code (None: the requests that would run) the rows and their prompt and estimated tokens."""
    groups: dict[tuple, list[int]] = {}
    for counted in prepared_chunks(models):
        for model, code, prompt, est in zip(counted["model"], counted["error_code"], counted["prompt_tokens"],
                                            counted["est_tokens"]):
            g = groups.setdefault((model, code), [0, 0, 0])
            g[0] += 1
            g[1] += 0 if code is not None or prompt is None else int(prompt)
            g[2] += 0 if code is not None or est is None else int(est)
    return [{"model": m, "error_code": c, "rows": n, "prompt_tokens": p, "est_tokens": e}
            for (m, c), (n, p, e) in groups.items()]


def mark_duplicates_in_order(pdf, first: dict[str, tuple[str, int]]) -> None:
    """:func:`mark_duplicates` for lines that come in (file, line number) order, in place: a line claiming a
    custom_id in ``first`` (custom_id -> its first line's file and number) becomes a duplicate that names that line,
    as :func:`mark_duplicates` words it; the others add theirs."""
    cols = {c: pdf.columns.get_loc(c) for c in ("error_code", "error_message", "raw_line")}
    for i, (cid, code, file, line, raw, request) in enumerate(zip(
            pdf["custom_id"], pdf["error_code"], pdf["file"], pdf["line_number"], pdf["raw_line"], pdf["request"])):
        if cid is None or code in LINE_LEVEL_CODES:
            continue
        if cid not in first:
            first[cid] = (file, int(line))
            continue
        first_file, first_line = first[cid]
        pdf.iat[i, cols["error_code"]] = ErrorCode.DUPLICATE_CUSTOM_ID.value
        pdf.iat[i, cols["error_message"]] = duplicate_message(first_line, first_file, file)
        pdf.iat[i, cols["raw_line"]] = raw if raw is not None else request


def duplicate_message(first_line: int, first_file: str, file: str) -> str:
    """The message of a duplicate_custom_id row (:func:`mark_duplicates` builds the same text in Spark)."""
    where = f" of {first_file}" if first_file != file else ""
    return f"custom_id is already used by line {first_line}{where}; only the first occurrence runs"


@dataclass(frozen=True)
class Outcomes:
    """How many rows a frame of requests or results holds, and how many of them are errors."""

    rows: int
    errors: int

    @property
    def ok(self) -> int:
        return self.rows - self.errors

    def __add__(self, other: "Outcomes") -> "Outcomes":
        return Outcomes(self.rows + other.rows, self.errors + other.errors)


def count_outcomes(df: DataFrame) -> Outcomes:
    """One aggregate (a single row reaches the driver)."""
    r = df.agg(F.count(F.lit(1)).alias("rows"), F.count("error_code").alias("errors")).first()
    return Outcomes(rows=int(r["rows"]), errors=int(r["errors"]))


def check_size(counts: Outcomes, cfg: BatchConfig) -> None:
    """Stop before any inference when the input holds more than ``max_requests`` lines."""
    if cfg.max_requests is not None and counts.rows > cfg.max_requests:
        raise ConfigError(f"input holds {counts.rows} requests, over max_requests={cfg.max_requests}; split the "
                          f"input or raise the limit")


def mark_duplicates(df: DataFrame) -> DataFrame:
    """The first line (by file, line number) of each custom_id keeps its fate; later lines become
    duplicate_custom_id errors that name the first line. One pass over ``df``: lines that claim no custom_id (none,
    or one recovered from a broken line) each form a group of their own."""
    claims = F.col("custom_id").isNotNull() & ~F.coalesce(F.col("error_code").isin(*LINE_LEVEL_CODES), F.lit(False))
    group = F.when(claims, F.concat(F.lit("c"), F.col("custom_id"))).otherwise(
        F.concat(F.lit("l"), F.col("file"), F.lit(":"), F.col("line_number").cast("string")))
    w = Window.partitionBy(group).orderBy("file", "line_number")
    ranked = (df.withColumn("_rank", F.row_number().over(w))
              .withColumn("_first_line", F.first("line_number").over(w))
              .withColumn("_first_file", F.first("file").over(w)))
    dup = F.col("_rank") > 1
    message = F.concat(F.lit("custom_id is already used by line "), F.col("_first_line").cast("string"),
                       F.when(F.col("_first_file") != F.col("file"), F.concat(F.lit(" of "), F.col("_first_file")))
                       .otherwise(F.lit("")), F.lit("; only the first occurrence runs"))
    marked = {
        "error_code": F.when(dup, F.lit(ErrorCode.DUPLICATE_CUSTOM_ID.value)).otherwise(F.col("error_code")),
        "error_message": F.when(dup, message).otherwise(F.col("error_message")),
        "raw_line": F.when(dup, F.coalesce(F.col("raw_line"), F.col("request"))).otherwise(F.col("raw_line")),
    }
    return ranked.select([marked[c].alias(c) if c in marked else F.col(c) for c in df.columns])


def line_ids(pdf, batch_id: str):
    """:func:`with_line_ids` over pandas, in place (and returned): the same ids from the same digest."""
    import hashlib

    no_id = {ErrorCode.DUPLICATE_CUSTOM_ID.value, *LINE_LEVEL_CODES}
    ids, request_ids = [], []
    for cid, code, file, line in zip(pdf["custom_id"], pdf["error_code"], pdf["file"], pdf["line_number"]):
        ident = cid if cid is not None and code not in no_id else f"\u0000{file}:{int(line)}"
        digest = hashlib.sha256(f"{batch_id}\u0000{ident}".encode("utf-8")).hexdigest()
        ids.append("batch_req_" + digest[:32])
        request_ids.append("req_" + digest[32:64])
    pdf["id"], pdf["request_id"] = ids, request_ids
    return pdf


def with_line_ids(df: DataFrame, batch_id: str) -> DataFrame:
    """Stable, unique per-line ids from the batch id and the custom_id (file and line for lines without a usable
    custom_id, with a duplicate one, or with one recovered from a broken line)."""
    by_line = F.concat(F.lit("\u0000"), F.col("file"), F.lit(":"), F.col("line_number").cast("string"))
    unique_id = F.col("custom_id").isNotNull() & ~F.coalesce(F.col("error_code"), F.lit("")).isin(
        ErrorCode.DUPLICATE_CUSTOM_ID.value, *LINE_LEVEL_CODES)
    ident = F.when(unique_id, F.col("custom_id")).otherwise(by_line)
    digest = F.sha2(F.concat(F.lit(batch_id + "\u0000"), ident), 256)
    return df.select("*", F.concat(F.lit("batch_req_"), F.substring(digest, 1, 32)).alias("id"),
                     F.concat(F.lit("req_"), F.substring(digest, 33, 32)).alias("request_id"))
