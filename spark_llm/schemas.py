"""Spark schemas of each stage and of the result tables, and pydantic models of the OpenAI batch output lines."""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .endpoints import ENDPOINTS

S, L, I = T.StringType(), T.LongType(), T.IntegerType()


def _struct(*fields: tuple[str, T.DataType, bool]) -> T.StructType:
    return T.StructType([T.StructField(n, t, nullable) for n, t, nullable in fields])


#: validate.validate_batches output: one row per non-blank input line, a request or an error.
VALIDATED_SCHEMA = _struct(
    ("file", S, False), ("line_number", L, False), ("custom_id", S, True), ("url", S, True), ("kind", S, True),
    ("model", S, True),  # the served name of the model the request runs on (an adapter's base model)
    ("request", S, True), ("prompt_json", S, True), ("sampling_json", S, True), ("options_json", S, True),
    ("max_tokens", L, True),
    ("error_code", S, True), ("error_message", S, True), ("raw_line", S, True),
)

#: Column of the token stage's rows holding each request's place in the prefix order (partition.prefix_key).
PREFIX_COL = "prefix_key"

#: tokens.count_batches output.
TOKENIZED_SCHEMA = T.StructType(VALIDATED_SCHEMA.fields + [
    # one list per prompt: a completions request may hold several
    T.StructField("prompt_token_ids", T.ArrayType(T.ArrayType(I, containsNull=False), containsNull=False), True),
    T.StructField("prompt_tokens", L, True),
    T.StructField("est_tokens", L, True),  # the request's cost in the partition plan (tokens.estimated_tokens)
    T.StructField(PREFIX_COL, L, True),
    T.StructField("notes", S, True),
])

#: infer.infer_partition output: one row per request, a response or an engine error.
RESULT_SCHEMA = _struct(
    ("id", S, False), ("custom_id", S, True), ("file", S, True), ("line_number", L, True), ("endpoint", S, True),
    ("request_id", S, True), ("model", S, True), ("text", S, True), ("finish_reason", S, True),
    ("tool_calls", S, True), ("reasoning", S, True), ("prompt_tokens", L, True), ("completion_tokens", L, True),
    ("total_tokens", L, True), ("created", L, True),
    ("embeddings", T.ArrayType(T.ArrayType(T.FloatType())), True),
    ("flagged", T.BooleanType(), True), ("labels", T.ArrayType(S), True), ("scores", T.ArrayType(T.DoubleType()), True),
    ("category_scores", T.MapType(S, T.DoubleType()), True),
    ("response_body", S, True), ("request", S, True), ("notes", S, True), ("error_code", S, True),
    ("error_message", S, True),
    # the partition's metrics record (JSON, see metrics.py) on its first row, null on the others
    ("partition_metrics", S, True),
)

#: Field names of the stages' rows, in schema order (the plain-Python stages build dicts with these keys).
VALIDATED_FIELDS = tuple(VALIDATED_SCHEMA.fieldNames())
RESULT_FIELDS = tuple(RESULT_SCHEMA.fieldNames())

#: Column -> comment of the outputs table (docs/schemas.md is generated from these: scripts/make_docs.py).
OUTPUTS_COLUMNS: dict[str, tuple[T.DataType, str]] = {
    "batch_id": (S, "Batch run that produced the row"),
    "id": (S, "Batch line id (batch_req_...), the id field of output.jsonl"),
    "custom_id": (S, "custom_id exactly as given in the input line"),
    "request_id": (S, "response.request_id in output.jsonl"),
    "file": (S, "Input file the request came from"),
    "line_number": (L, "1-based line number of the request in its input file"),
    "endpoint": (S, f"Request url: {', '.join(ENDPOINTS)} (embeddings: the vectors also in the embeddings table)"),
    "model": (S, "Served model name"),
    "text": (S, "Answer text of the first choice (after any reasoning; JSON text for structured outputs); null "
                "when the answer is only tool calls"),
    "finish_reason": (S, "Why the first choice ended: stop, length or tool_calls"),
    "tool_calls": (S, "JSON array of the first choice's tool calls ([{id, type, function: {name, arguments}}]), "
                      "null when none"),
    "reasoning": (S, "The first choice's thinking, split from the answer by the reasoning_parser; null without one"),
    "prompt_tokens": (L, "Prompt tokens (after the chat template), equal to usage.prompt_tokens"),
    "completion_tokens": (L, "Generated tokens over all choices"),
    "total_tokens": (L, "prompt_tokens + completion_tokens"),
    "notes": (S, "Adjustments made to the request, e.g. max_tokens lowered to fit the context"),
    "created_at": (T.TimestampType(), "When the response was generated"),
    "flagged": (T.BooleanType(), "/v1/moderations: whether any input was flagged; null for other endpoints"),
    "labels": (T.ArrayType(S), "/v1/classify: each input's most probable label; /v1/moderations: the categories "
                               "flagged (any input), in OpenAI's order"),
    "scores": (T.ArrayType(T.DoubleType()), "/v1/classify: the probability of each input's label; /v1/score: each "
                                            "pair's score; /v1/rerank: each document's score, in the request's order"),
    "category_scores": (T.MapType(S, T.DoubleType()), "/v1/moderations: each OpenAI category's highest score over "
                                                      "the inputs (category_scores['hate'])"),
    "response_body": (S, "Full OpenAI ChatCompletion / Completion / Response object as JSON"),
    "request": (S, "The original input line as JSON (an image's data: URL as its size and hash)"),
}

ERRORS_COLUMNS: dict[str, tuple[T.DataType, str]] = {
    "batch_id": (S, "Batch run that produced the row"),
    "id": (S, "Batch line id (batch_req_...), the id field of errors.jsonl"),
    "custom_id": (S, "custom_id as given; null when the line had no usable custom_id"),
    "file": (S, "Input file of the failed line"),
    "line_number": (L, "1-based line number of the failed line in its input file"),
    "code": (S, "Error code (see docs/reliability.md: error codes)"),
    "message": (S, "What was wrong and what to change"),
    "raw_line": (S, "The input line, cut to max_raw_line_chars characters"),
    "created_at": (T.TimestampType(), "When the error was recorded"),
}

#: Column -> comment of the embeddings table: the vectors of /v1/embeddings requests as a real column.
EMBEDDINGS_COLUMNS: dict[str, tuple[T.DataType, str]] = {
    "batch_id": (S, "Batch run that produced the row"),
    "id": (S, "Batch line id (batch_req_...) of the request, as in the outputs table"),
    "custom_id": (S, "custom_id of the request"),
    "input_index": (L, "Position of the input in the request's input list (0 for a single input)"),
    "dimensions": (L, "Length of the vector"),
    "embedding": (T.ArrayType(T.FloatType()), "The embedding vector (float32, as the model returned it)"),
    "created_at": (T.TimestampType(), "When the embedding was computed"),
}

#: Columns each result table keeps Delta file statistics for (min/max/nulls, ``delta.dataSkippingStatsColumns``, set
#: when spark_llm creates the table): the keys a SQL reader looks rows up by, and the time. Delta's default is a
#: table's first 32 columns, the long JSON texts (response bodies, raw lines) included, whose statistics skip
#: nothing and cost every commit: 0.8 s instead of 1.5 s for a wave of 3,300 outputs rows here.
OUTPUTS_STATS = ("id", "custom_id", "request_id", "created_at")
ERRORS_STATS = ("id", "custom_id", "code", "created_at")
EMBEDDINGS_STATS = ("id", "custom_id", "input_index", "created_at")

def _column(dtype: T.DataType, comment: str, default: Any = dataclasses.MISSING) -> Any:
    """A field of a table's record: its Spark type and its column comment in the field's metadata."""
    return dataclasses.field(default=default, metadata={"type": dtype, "comment": comment})


D, TS = T.DoubleType(), T.TimestampType()


@dataclasses.dataclass(kw_only=True)
class PartitionRecord:
    """One inference partition, as the metrics table keeps it (a row each; :data:`METRICS_COLUMNS` follows from
    these fields): made by its task (spark_llm.infer), staged with its results and sent to the driver's progress
    line (spark_llm.metrics), given the run's layout when its wave commits (write.metrics_rows), read back for a
    resumed batch's report. Times are epoch seconds here, timestamps in the table."""

    batch_id: Optional[str] = _column(S, "Batch the partition belongs to", None)
    run_id: Optional[str] = _column(S, "Run of the batch (a --resume run is a new run) that inferred the partition",
                                    None)
    task_slots: Optional[int] = _column(L, "Inference tasks that ran at once, as the run planned (engines x "
                                           "tasks_per_engine)", None)
    engines: Optional[int] = _column(L, "Engines the run planned for; busy_fraction's denominator", None)
    wave: int = _column(L, "Wave (Delta commit) number, from 1")
    partition: int = _column(L, "Planned partition index (numbered across the run's models)")
    model: Optional[str] = _column(S, "Served name of the model the partition ran on (a batch may have several: "
                                      "see models)", None)
    worker_pid: Optional[int] = _column(L, "Python worker process that ran the partition", None)
    engine_slot: Optional[str] = _column(S, "Engine slot that answered: gpu-<addresses> (the task's GPUs), or "
                                            "cpu-<executor pid>-<n>", None)
    engine_pid: Optional[int] = _column(L, "Engine process that answered (one per slot for the executor's life)",
                                        None)
    gpus: Optional[str] = _column(S, "GPU addresses Spark gave the task (empty without GPU scheduling)", None)
    rows: int = _column(L, "Requests in the partition")
    prompt_tokens: int = _column(L, "Prompt tokens of the partition's successful requests", 0)
    cached_prompt_tokens: Optional[int] = _column(
        L, "Prompt tokens the engine served from its prefix cache (vLLM's num_cached_tokens); / prompt_tokens is the "
           "partition's prefix-cache hit rate", None)
    completion_tokens: int = _column(L, "Generated tokens of the partition's successful requests", 0)
    engine_deaths: Optional[int] = _column(L, "Engine deaths while the partition ran, earlier attempts' included "
                                              "(see engine_host/isolation.py)", None)
    engine_load_seconds: Optional[float] = _column(D, "Seconds the task waited for its engine to load (0 when it "
                                                      "was ready: loaded by the warm-up or an earlier task)", None)
    engine_seconds: Optional[float] = _column(D, "Seconds the partition's requests were in the engine (its "
                                                 "streamed call; the slot's other feeder may have been in it too)",
                                              None)
    engine_started_at: Optional[float] = _column(TS, "When the partition's first requests went to the engine", None)
    engine_finished_at: Optional[float] = _column(TS, "When its last answer came back; the union of these spans per "
                                                      "engine is the engine's busy time", None)
    tokens_per_second: Optional[float] = _column(D, "(prompt + generated tokens) / engine_seconds", None)
    errors_by_code: str = _column(S, "JSON object: error code -> count in this partition", "{}")
    started_at: Optional[float] = _column(TS, "When the task started", None)
    finished_at: Optional[float] = _column(TS, "When the task finished", None)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PartitionRecord":
        return cls(**json.loads(text))

    @classmethod
    def from_row(cls, row: Any) -> "PartitionRecord":
        """A row of the metrics table (a table written by an earlier version may lack a column: its default)."""
        values = row.asDict()
        return cls(**{f.name: _epoch(values[f.name]) for f in dataclasses.fields(cls) if f.name in values})

    def errors(self) -> dict[str, int]:
        """The partition's error rows by code."""
        return json.loads(self.errors_by_code or "{}")


def _epoch(value: Any) -> Any:
    return value.timestamp() if isinstance(value, datetime.datetime) else value


#: Column -> (type, comment) of the metrics table, one row per inference partition: :class:`PartitionRecord`'s.
METRICS_COLUMNS: dict[str, tuple[T.DataType, str]] = {
    f.name: (f.metadata["type"], f.metadata["comment"]) for f in dataclasses.fields(PartitionRecord)}


def json_string(col: Column) -> Column:
    """A string column as a JSON string literal (``null`` when null), built in Spark: ``to_json`` of a one-element
    array, without the brackets."""
    as_array = F.to_json(F.array(col))
    return F.coalesce(as_array.substr(F.lit(2), F.length(as_array) - 2), F.lit("null"))


def table_schema(columns: dict[str, tuple[T.DataType, str]]) -> T.StructType:
    return T.StructType([T.StructField(name, dtype, name not in ("batch_id", "id", "file", "line_number"),
                                       metadata={"comment": comment})
                         for name, (dtype, comment) in columns.items()])


# ---- OpenAI batch file lines (pydantic) ------------------------------------------------------------------------

class BatchResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchError(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of output.jsonl or errors.jsonl, as OpenAI's Batch API shapes them."""

    model_config = ConfigDict(extra="forbid")
    id: str
    custom_id: Optional[str]
    response: Optional[BatchResponse]
    error: Optional[BatchError]
