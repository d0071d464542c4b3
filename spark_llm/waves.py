"""The inference stage, driver side: plan token-balanced partitions, then infer them a wave at a time.

Each wave runs its planned partitions through :func:`~spark_llm.infer.infer_partition` (one ``mapInPandas`` task
per partition), stages the results once as Parquet, checks that every planned request has exactly one result, and
commits them to the outputs and errors tables (one MERGE each). A crash loses at most the wave in flight; ``--resume``
continues from the last commit.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

from pyspark.sql import DataFrame

from . import faults, storage, write
from .context import RunContext
from .config import config_view
from .engine import EngineSpec
from .engine_service import ProcessSettings
from .errors import EngineStartError
from .infer import InferContext, infer_partition
from .metrics import ProgressReporter, progress_line
from .partition import PART_COL, PartitionPlan, materialize, plan_partitions, task_slots
from .prepare import count_outcomes
from .schemas import RESULT_SCHEMA

log = logging.getLogger(__name__)

#: Columns of a planned request the inference task reads.
INFER_INPUT = ("id", "request_id", "custom_id", "file", "line_number", "url", "kind", "request", "sampling_json",
               "options_json", "prompt_token_ids", "prompt_tokens", "notes", PART_COL)


@dataclass(frozen=True)
class Wave:
    number: int
    of: int
    first: int   #: first planned partition
    count: int   #: planned partitions in this wave

    @property
    def label(self) -> str:
        return f"{self.number}/{self.of}"


def waves_of(num_partitions: int, per_wave: int) -> list[Wave]:
    starts = range(0, num_partitions, per_wave)
    return [Wave(n, len(starts), first, min(per_wave, num_partitions - first)) for n, first in enumerate(starts, 1)]


def infer_in_waves(run: RunContext, valid: DataFrame) -> dict:
    """Infer every valid request (rows with ``est_tokens``) and commit the results; returns the partition plan."""
    slots = task_slots(run.spark, run.cfg.num_task_slots, run.cfg.tensor_parallel_size)
    run.describe("plan partitions")
    assigned, plan = plan_partitions(valid, target_tokens=run.cfg.target_tokens_per_partition, slots=slots)
    ictx = InferContext(engine=EngineSpec.from_config(run.cfg), served_model_name=run.cfg.served_model_name or "",
                        batch_id=run.batch_id, process=config_view(ProcessSettings, run.cfg),
                        metrics=run.metrics)
    waves = waves_of(plan.num_partitions, run.cfg.wave_partitions or 2 * slots)
    current = {"wave": f"0/{len(waves)}"}
    total = sum(plan.requests_per_partition)
    line = lambda: progress_line(run.batch_id, run.metrics.value, total, run.started, current["wave"])  # noqa: E731
    try:
        with ProgressReporter(line, run.cfg.progress_interval_seconds):
            for wave in waves:
                current["wave"] = wave.label
                _run_wave(run, assigned, plan, wave, replace(ictx, wave=wave.number))
        storage.delete(run.spark, run.paths.staging)
    finally:
        plan.release()
    return plan.as_dict()


def _run_wave(run: RunContext, assigned: DataFrame, plan: PartitionPlan, wave: Wave, ictx: InferContext) -> None:
    """Infer one wave's partitions, stage the results once, check them, commit them to both tables."""
    run.describe(f"infer wave {wave.label}")
    requests = materialize(assigned, wave.first, wave.count).select(*INFER_INPUT)
    results = requests.mapInPandas(lambda it: infer_partition(it, ictx), RESULT_SCHEMA, profile=run.gpu_profile)
    staging = f"{run.paths.staging}/results"
    try:
        results.write.mode("overwrite").parquet(staging)
    except Exception as exc:
        raise engine_failure(exc) from None
    staged = run.spark.read.parquet(staging)
    planned, got = sum(plan.requests_per_partition[wave.first:wave.first + wave.count]), count_outcomes(staged)
    if got.rows != planned:  # the conservation check: one result per planned request
        raise RuntimeError(f"wave {wave.label}: {got.rows} results for {planned} planned requests; nothing of this "
                           f"wave was committed, rerun with --resume")
    run.describe(f"commit wave {wave.label}")
    write.commit_results(run, staged, responses=got.ok, errors=got.errors)
    log.info("batch %s: wave %s committed (%d partitions)", run.batch_id, wave.label, wave.count)
    faults.maybe_exit_after_wave(wave.number)


_ENGINE_ERR = re.compile(r"EngineStartError: (.+?)(?:\n|$)")


def engine_failure(exc: Exception) -> Exception:
    """An executor-side engine start failure as one clear driver-side error; other failures as they are."""
    match = _ENGINE_ERR.search(str(exc))
    return EngineStartError(match.group(1)) if match else exc
