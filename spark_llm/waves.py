"""The inference stage, driver side: plan token-balanced partitions, then infer them a wave at a time.

Each wave runs its planned partitions through :func:`~spark_llm.infer.infer_partition` (one ``mapInPandas`` task
per partition), stages the results once as Parquet, checks that every planned request has exactly one result, and
commits them to the outputs and errors tables (one MERGE each). Waves overlap (:data:`WAVES_IN_FLIGHT`): the engines
start the next wave while the last one's slowest partitions finish and while it is committed. A crash loses at most
the waves not yet committed; ``--resume`` continues from the last commit.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Optional

from pyspark.sql import DataFrame

from . import faults, storage, write
from .context import RunContext
from .config import config_view
from .engine import EngineSpec
from .engine_service import ProcessSettings
from .errors import EngineStartError
from .infer import InferContext, infer_partition
from .metrics import ProgressReporter, latest_records, progress_line
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


#: Waves whose inference runs at once: while the last tasks of one wave run, free task slots start the next wave's,
#: and a finished wave is committed while the next one infers.
WAVES_IN_FLIGHT = 2


def infer_in_waves(run: RunContext, valid: DataFrame) -> dict:
    """Infer every valid request (rows with ``est_tokens``) and commit the results; returns the partition plan.

    Waves are pipelined: wave k+1 is submitted (a Spark job of its own, from a driver thread) while wave k still
    runs, so no engine waits for the slowest partition of a wave, and wave k is committed while the next waves
    infer. Commits stay one at a time and in wave order; a crash loses at most the waves not yet committed."""
    slots = task_slots(run.spark, run.cfg.num_task_slots, run.cfg.tensor_parallel_size)
    run.describe("plan partitions")
    assigned, plan = plan_partitions(valid, target_tokens=run.cfg.target_tokens_per_partition, slots=slots,
                                     prefix_aware=run.cfg.prefix_aware_partitions)
    ictx = InferContext(engine=EngineSpec.from_config(run.cfg), served_model_name=run.cfg.served_model_name or "",
                        batch_id=run.batch_id, process=config_view(ProcessSettings, run.cfg),
                        metrics=run.metrics)
    waves = waves_of(plan.num_partitions, run.cfg.wave_partitions or 2 * slots)
    current = {"wave": f"0/{len(waves)}"}
    total = sum(plan.requests_per_partition)
    line = lambda: progress_line(run.batch_id, run.metrics.value, total, run.started, current["wave"])  # noqa: E731
    in_flight: deque[_WaveJob] = deque()
    try:
        with ProgressReporter(line, run.cfg.progress_interval_seconds):
            for wave in waves:
                if len(in_flight) == WAVES_IN_FLIGHT:
                    _commit(run, plan, in_flight.popleft())
                in_flight.append(_WaveJob.start(run, assigned, wave, replace(ictx, wave=wave.number)))
                current["wave"] = wave.label
            while in_flight:
                _commit(run, plan, in_flight.popleft())
        storage.delete(run.spark, run.paths.staging)
    except BaseException:
        run.spark.sparkContext.cancelJobGroup(run.batch_id)  # the waves still inferring
        for job in in_flight:
            job.thread.join()
        raise
    finally:
        plan.release()
    return plan.as_dict()


@dataclass
class _WaveJob:
    """One wave's inference, running as its own Spark job in a driver thread that inherits the run's job group."""

    wave: Wave
    staging: str
    thread: Any = None
    error: Optional[BaseException] = None

    @classmethod
    def start(cls, run: RunContext, assigned: DataFrame, wave: Wave, ictx: InferContext) -> "_WaveJob":
        from pyspark import InheritableThread

        job = cls(wave, f"{run.paths.staging}/wave-{wave.number}")
        job.thread = InheritableThread(target=job._run, args=(run, assigned, ictx),
                                       name=f"spark_llm-wave-{wave.number}", daemon=True)
        job.thread.start()
        return job

    def _run(self, run: RunContext, assigned: DataFrame, ictx: InferContext) -> None:
        try:
            run.describe(f"infer wave {self.wave.label}")
            requests = materialize(assigned, self.wave.first, self.wave.count).select(*INFER_INPUT)
            results = requests.mapInPandas(lambda it: infer_partition(it, ictx), RESULT_SCHEMA,
                                           profile=run.gpu_profile)
            results.write.mode("overwrite").parquet(self.staging)
        except BaseException as exc:
            self.error = exc

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise engine_failure(self.error) from None


def _commit(run: RunContext, plan: PartitionPlan, job: _WaveJob) -> None:
    """Wait for a wave's inference, check that every planned request has one result, commit them to both tables."""
    job.wait()
    wave = job.wave
    staged = run.spark.read.parquet(job.staging)
    planned, got = sum(plan.requests_per_partition[wave.first:wave.first + wave.count]), count_outcomes(staged)
    if got.rows != planned:  # the conservation check: one result per planned request
        raise RuntimeError(f"wave {wave.label}: {got.rows} results for {planned} planned requests; nothing of this "
                           f"wave was committed, rerun with --resume")
    run.describe(f"commit wave {wave.label}")
    write.commit_results(run, staged, responses=got.ok, errors=got.errors)
    write.commit_metrics(run, [r for r in latest_records(run.metrics.value) if r["wave"] == wave.number],
                         plan.task_slots)
    log.info("batch %s: wave %s committed (%d partitions)", run.batch_id, wave.label, wave.count)
    faults.maybe_exit_after_wave(wave.number)


_ENGINE_ERR = re.compile(r"EngineStartError: (.+?)(?:\n|$)")


def engine_failure(exc: Exception) -> Exception:
    """An executor-side engine start failure as one clear driver-side error; other failures as they are."""
    match = _ENGINE_ERR.search(str(exc))
    return EngineStartError(match.group(1)) if match else exc
