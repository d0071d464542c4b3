"""The dry run: what a batch would cost, before any GPU is booked.

``plan_batch(spark, cfg)`` (``spark-llm plan``) reads, validates and counts tokens exactly as a run does (the same
prepare stage, on the executors), loads no engine and writes nothing. It reports requests, error rows by code, prompt
tokens, the most output tokens the batch may generate, the partitions and waves a run would use, and an estimate of
engine time from a tokens/s figure: given, or measured by earlier runs (their metrics table).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from . import storage
from .config import BatchConfig, ConfigError
from .context import RunPaths
from .engine_host.placement import EngineLayout, config_layout
from .models import check_adapters, resolve, resolve_models
from .partition import plan_settings
from .prepare import prepare
from .session import default_parallelism, local_session_conf
from .session_info import local_parallelism, local_task_threads, spark_conf


@dataclass(frozen=True)
class BatchPlan:
    lines: int                       #: non-blank input lines
    requests: int                    #: lines that would reach the engine
    errors_by_code: dict[str, int]   #: lines that would become error rows, by code
    prompt_tokens: int               #: of the requests, after the chat template
    max_output_tokens: int           #: sum of n x max_tokens per prompt: the most the batch can generate
    partitions: int
    engines: int                     #: engines that would run at once
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
                 f"  partitions / waves: {self.partitions} / {self.waves} ({self.engines} engines at once)"]
        if self.engine_seconds is not None:
            wall = self.engine_seconds / self.engines
            lines.append(f"  engine time:        at most {self.engine_seconds:.0f} engine-seconds, about {wall:.0f} s "
                         f"with {self.engines} engines, at {self.tokens_per_second:.0f} tokens/s per engine "
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


@dataclass(frozen=True)
class Group:
    """The prepared rows of one model with one error code (None: the requests that would run)."""

    model: str
    error_code: Optional[str]
    rows: int
    prompt_tokens: int
    est_tokens: int


def plan_batch(spark: SparkSession, config: BatchConfig, tokens_per_second: Optional[float] = None) -> BatchPlan:
    """The dry run of ``config``: nothing is written and no engine starts."""
    models = _models(config)
    source = "given"
    if tokens_per_second is None and models[0].output_dir:
        tokens_per_second = measured_tokens_per_second(spark, RunPaths.from_config(models[0]).metrics_table)
        source = "measured by earlier runs"
    # one aggregate over the prepared rows: per model and error code (null: the valid requests) the rows and their
    # tokens
    rows = (prepare(spark, models).groupBy("model", "error_code")
            .agg(F.count(F.lit(1)).alias("n"), F.sum("prompt_tokens").alias("prompt"),
                 F.sum("est_tokens").alias("est")).collect())  # a row per model and error code: metadata
    groups = [Group(r["model"], r["error_code"], int(r["n"]), int(r["prompt"] or 0), int(r["est"] or 0))
              for r in rows]
    conf = spark_conf(spark)
    return _plan(groups, models, lambda m: config_layout(m, conf, lambda: default_parallelism(spark),
                                                         local_task_threads(conf)), tokens_per_second, source)


#: Largest input the dry run reads in its own process (:func:`plan_local`); a larger one is planned on Spark,
#: whose tasks validate and count it in parallel.
LOCAL_PLAN_BYTES = 64 << 20


def plan_local(config: BatchConfig, master: Optional[str] = None, tokens_per_second: Optional[float] = None,
               settings: Optional[Mapping[str, str]] = None) -> BatchPlan:
    """:func:`plan_batch` for JSONL files on this machine, in this process: the same reading, validation, duplicate
    and token-counting rules over pandas, without starting Spark (a cold JVM costs more than the work of a small
    batch). ``master`` and ``settings``: the local master and the session settings (the config's ``spark:``) a run
    would use. The tokens/s figure of earlier runs comes from the last batch.json in the output directory."""
    from .prepare import local_groups

    models = _models(config)
    source = "given"
    if tokens_per_second is None and models[0].output_dir:
        tokens_per_second = _batch_json_tokens_per_second(RunPaths.from_config(models[0]).batch_file)
        source = "measured by earlier runs"
    local_cores(master or "local[2]")  # a local master, or one clear message
    conf = local_session_conf(master, settings)
    groups = [Group(**g) for g in local_groups(models)]
    return _plan(groups, models, lambda m: config_layout(m, conf, lambda: local_parallelism(conf),
                                                         local_task_threads(conf)), tokens_per_second, source)


def local_cores(master: str) -> int:
    """Task slots of a local master: ``local[N]`` (or ``local[N,F]``) N, ``local[*]`` the machine's cores."""
    match = re.fullmatch(r"local(?:\[([0-9]+|\*)(?:,[0-9]+)?\])?", master.strip())
    if not match:
        raise ConfigError(f"--master {master!r} is not a local master (local, local[N], local[*])")
    n = match.group(1) or "1"
    return os.cpu_count() or 1 if n == "*" else int(n)


def _batch_json_tokens_per_second(path: str) -> Optional[float]:
    try:
        plan = json.loads(Path(path.removeprefix("file:")).read_text()).get("partition_plan") or {}
    except (OSError, ValueError):
        return None
    value = plan.get("engine_tokens_per_second")
    return float(value) if value else None


def _models(config: BatchConfig) -> tuple[BatchConfig, ...]:
    config.require("model")
    if not (config.input or config.input_table):
        raise ConfigError("no input: set --input (JSONL files or a Delta table path) or --input-table")
    models = resolve_models(resolve(config))
    for model in models:
        check_adapters(model.lora_modules, model.max_lora_rank)
    return models


def _plan(groups: list[Group], models: tuple[BatchConfig, ...], layout: Callable[[BatchConfig], EngineLayout],
          tokens_per_second: Optional[float], source: str) -> BatchPlan:
    """The plan from the prepared rows' groups: each model is planned and run on its own (waves.infer_models)."""
    errors: dict[str, int] = {}
    for g in groups:
        if g.error_code is not None:
            errors[g.error_code] = errors.get(g.error_code, 0) + g.rows
    valid = {g.model: g for g in groups if g.error_code is None}
    requests = sum(g.rows for g in valid.values())
    prompt = sum(g.prompt_tokens for g in valid.values())
    est = sum(g.est_tokens for g in valid.values())
    partitions = waves = 0
    for model in models:
        g = valid.get(model.served_model_name)
        if g is not None:
            model_layout = layout(model)
            parts = plan_settings(model, model_layout).partitions(g.est_tokens, g.rows)
            partitions += parts
            waves += math.ceil(parts / (model.wave_partitions or 2 * model_layout.tasks))
    return BatchPlan(lines=requests + sum(errors.values()), requests=requests, errors_by_code=errors,
                     prompt_tokens=prompt, max_output_tokens=est - prompt, partitions=partitions,
                     engines=layout(models[0]).engines, waves=waves, tokens_per_second=tokens_per_second,
                     tokens_per_second_source=source if tokens_per_second else "")
