"""The dry run: what a batch would cost, before any GPU is booked.

``plan_batch(spark, cfg)`` (``spark-llm plan``) reads, validates and counts tokens exactly as a run does (the same
prepare stage, on the executors), loads no engine and writes nothing. It reports requests, error rows by code, prompt
tokens, the most output tokens the batch may generate, the partitions and waves a run would use, and an estimate of
engine time from a tokens/s figure: given, or measured by earlier runs (their metrics table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from . import storage
from .config import BatchConfig, ConfigError
from .context import RunPaths
from .engine import check_adapters, resolve, resolve_models
from .partition import estimate_cost, num_partitions, task_slots
from .prepare import prepare


@dataclass(frozen=True)
class BatchPlan:
    lines: int                       #: non-blank input lines
    requests: int                    #: lines that would reach the engine
    errors_by_code: dict[str, int]   #: lines that would become error rows, by code
    prompt_tokens: int               #: of the requests, after the chat template
    max_output_tokens: int           #: sum of n x max_tokens per prompt: the most the batch can generate
    partitions: int
    task_slots: int                  #: engines that would run at once
    waves: int
    tokens_per_second: Optional[float] = None   #: per engine, prompt + generated tokens
    tokens_per_second_source: str = ""

    @property
    def engine_seconds(self) -> Optional[float]:
        """Upper bound of the engines' busy time summed over engines (every request generating max_tokens)."""
        if not self.tokens_per_second:
            return None
        return (self.prompt_tokens + self.max_output_tokens) / self.tokens_per_second

    def summary(self) -> str:
        errors = ", ".join(f"{c} {n}" for c, n in sorted(self.errors_by_code.items(), key=lambda kv: -kv[1]))
        lines = [f"plan: {self.lines} lines: {self.requests} requests, {self.lines - self.requests} error rows"
                 + (f" ({errors})" if errors else ""),
                 f"  prompt tokens:      {self.prompt_tokens}",
                 f"  max output tokens:  {self.max_output_tokens} (n x max_tokens per prompt; generation usually stops "
                 f"sooner)",
                 f"  partitions / waves: {self.partitions} / {self.waves} ({self.task_slots} engines at once)"]
        if self.engine_seconds is not None:
            wall = self.engine_seconds / self.task_slots
            lines.append(f"  engine time:        at most {self.engine_seconds:.0f} engine-seconds, about {wall:.0f} s "
                         f"with {self.task_slots} engines, at {self.tokens_per_second:.0f} tokens/s per engine "
                         f"({self.tokens_per_second_source})")
        else:
            lines.append("  engine time:        unknown: pass --tokens-per-second, or run a batch first (its "
                         "metrics table gives the figure)")
        return "\n".join(lines)


def measured_tokens_per_second(spark: SparkSession, metrics_table: str) -> Optional[float]:
    """Tokens per second per engine over every partition an earlier run recorded in ``metrics_table``."""
    if not storage.table_exists(spark, metrics_table):
        return None
    row = storage.read_table(spark, metrics_table).agg(
        F.sum(F.col("prompt_tokens") + F.col("completion_tokens")).alias("t"), F.sum("engine_seconds").alias("s"))\
        .first()
    return float(row["t"]) / float(row["s"]) if row["s"] else None


def plan_batch(spark: SparkSession, config: BatchConfig, tokens_per_second: Optional[float] = None) -> BatchPlan:
    """The dry run of ``config``: nothing is written and no engine starts."""
    config.require("model")
    if not (config.input or config.input_table):
        raise ConfigError("no input: set --input (JSONL files or a Delta table path) or --input-table")
    models = resolve_models(resolve(config))
    cfg = models[0]
    for model in models:
        check_adapters(model.lora_modules, model.max_lora_rank)
    source = "given"
    if tokens_per_second is None and cfg.output_dir:
        tokens_per_second = measured_tokens_per_second(spark, RunPaths.from_config(cfg).metrics_table)
        source = "measured by earlier runs"
    # one aggregate over the prepared rows: per model and error code (null: the valid requests) the rows and their
    # tokens
    groups = (estimate_cost(prepare(spark, models)).groupBy("model", "error_code")
              .agg(F.count(F.lit(1)).alias("n"), F.sum("prompt_tokens").alias("prompt"),
                   F.sum("est_tokens").alias("est")).collect())  # a row per model and error code: metadata
    errors: dict[str, int] = {}
    for r in groups:
        if r["error_code"] is not None:
            errors[r["error_code"]] = errors.get(r["error_code"], 0) + int(r["n"])
    valid = {r["model"]: r for r in groups if r["error_code"] is None}
    totals = {key: sum(int(r[key] or 0) for r in valid.values()) for key in ("n", "prompt", "est")}
    slots = task_slots(spark, cfg.num_task_slots, cfg.tensor_parallel_size)
    partitions = waves = 0
    for model in models:  # each model is planned and run on its own (waves.infer_models)
        row = valid.get(model.served_model_name)
        if row is not None:
            model_slots = task_slots(spark, model.num_task_slots, model.tensor_parallel_size)
            parts = num_partitions(int(row["est"] or 0), model.target_tokens_per_partition, model_slots)
            partitions += parts
            waves += math.ceil(parts / (model.wave_partitions or 2 * model_slots))
    totals["requests"] = totals["n"]
    return BatchPlan(lines=int(totals["requests"]) + sum(errors.values()), requests=int(totals["requests"]),
                     errors_by_code=errors, prompt_tokens=int(totals["prompt"] or 0),
                     max_output_tokens=int(totals["est"] or 0) - int(totals["prompt"] or 0), partitions=partitions,
                     task_slots=slots, waves=waves,
                     tokens_per_second=tokens_per_second, tokens_per_second_source=source if tokens_per_second else "")
