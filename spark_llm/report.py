"""The batch summary, shaped like OpenAI's batch object, computed with Spark aggregates (one row each)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

#: Most unattributable lines (no usable custom_id) listed one by one in batch.json's errors.data.
MAX_LISTED_ERRORS = 1000


@dataclass
class BatchResult:
    """What :func:`spark_llm.run_batch` returns: counts, usage, paths and the OpenAI-style batch object."""

    batch_id: str
    status: str
    total: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    output_dir: str
    outputs_table: str
    errors_table: str
    output_file: str
    error_file: str
    batch_file: str
    skipped: int = 0
    batch: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def summary(self) -> str:
        resumed = f" ({self.skipped} already answered before this run)" if self.skipped else ""
        return (f"batch {self.batch_id}: {self.status}; {self.total} requests, {self.completed} completed, "
                f"{self.failed} failed{resumed}; tokens in {self.input_tokens}, out {self.output_tokens}\n"
                f"  outputs table: {self.outputs_table}\n  errors table:  {self.errors_table}\n"
                f"  output file:   {self.output_file}\n  error file:    {self.error_file}\n"
                f"  batch object:  {self.batch_file}")


def counts(outputs: DataFrame, errors: DataFrame) -> dict[str, int]:
    o = outputs.agg(F.count(F.lit(1)).alias("n"), F.sum("prompt_tokens").alias("pt"),
                    F.sum("completion_tokens").alias("ct")).first()
    e = errors.agg(F.count(F.lit(1)).alias("n")).first()
    return {"completed": int(o["n"]), "failed": int(e["n"]), "input_tokens": int(o["pt"] or 0),
            "output_tokens": int(o["ct"] or 0)}


def prompt_histogram(outputs: DataFrame, buckets: int = 30) -> list[tuple[int, int]]:
    """(bucket start, requests) over prompt_tokens, computed by Spark (at most ``buckets`` rows)."""
    top = outputs.agg(F.max("prompt_tokens")).first()[0]
    if not top:
        return []
    width = max(1, -(-int(top) // buckets))
    rows = (outputs.groupBy((F.floor(F.col("prompt_tokens") / width) * width).alias("b"))
            .count().orderBy("b").collect())
    return [(int(r["b"]), int(r["count"])) for r in rows]


def errors_by_code(errors: DataFrame) -> dict[str, int]:
    return {r["code"]: int(r["count"]) for r in errors.groupBy("code").count().collect()}


def unattributed_errors(errors: DataFrame, limit: int = MAX_LISTED_ERRORS) -> tuple[list[dict], int]:
    """errors.data entries for lines without a usable custom_id (bounded), and how many there are in all."""
    rows = errors.where(F.col("custom_id").isNull())
    total = rows.count()
    listed = (rows.orderBy("file", "line_number").limit(limit)
              .select("code", "message", "file", "line_number").collect())
    data = [{"code": r["code"], "message": r["message"], "param": None, "line": int(r["line_number"]),
             "file": r["file"]} for r in listed]
    return data, total


def batch_object(*, batch_id: str, endpoint: str, model: str, input_path: str, status: str,
                 created_at: int, in_progress_at: Optional[int], finalizing_at: Optional[int],
                 completed_at: Optional[int],
                 failed_at: Optional[int], c: dict[str, int], errors_data: list[dict], errors_total: int,
                 paths: dict[str, str], plan: Optional[dict]) -> dict[str, Any]:
    total = c["completed"] + c["failed"]
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "model": model,
        "errors": {"object": "list", "data": errors_data, "total": errors_total},
        "input_file_id": input_path,
        "completion_window": "24h",
        "status": status,
        "output_file_id": paths["output_file"],
        "error_file_id": paths["error_file"],
        "created_at": created_at,
        "in_progress_at": in_progress_at,
        "expires_at": None,
        "finalizing_at": finalizing_at,
        "completed_at": completed_at,
        "failed_at": failed_at,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": total, "completed": c["completed"], "failed": c["failed"]},
        "usage": {"input_tokens": c["input_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": c["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": c["input_tokens"] + c["output_tokens"]},
        # OpenAI's metadata is a map of strings: the table and report locations
        "metadata": {"outputs_table": paths["outputs_table"], "errors_table": paths["errors_table"],
                     "metrics_table": paths["metrics_table"], "report_file": paths["report_file"]},
        "partition_plan": plan,  # spark_llm's own field: how the requests were spread over partitions
    }


def to_json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"
