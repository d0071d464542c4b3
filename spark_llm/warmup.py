"""The engines' warm-up: they load while the driver reads, validates and counts the batch, and, for a ``local[N]``
session that spark_llm starts itself, while its JVM starts.

Called from one place each: :func:`start_before_session` by whoever makes the session (``spark-llm run``,
``spark-llm serve``), :class:`EngineWarmup` by :func:`~spark_llm.pipeline.run_batch`; the inference waves
(:mod:`~spark_llm.waves`) wait for it. The executor side is :func:`warm_partition` (GPU clusters) and
:func:`prestart_partition` (Spark Connect on a local master).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Mapping, Optional

from .background import EngineJob
from .config import BatchConfig, config_view
from .context import RunContext
from .engine_host.client import Executor, engine_for, prestart, prestart_slots
from .engine_host.placement import (TaskPlace, config_added_executors, config_layout, has_gpus, inference_profile,
                                    task_gpus)
from .engine_host.spec import EngineSpec, ProcessSettings
from .infer import InferContext
from .models import resolve
from .session import local_executor, local_session_conf, local_worker_env, set_local_environment
from .session_info import is_connect, is_local_master, local_parallelism, local_task_threads, spark_conf

log = logging.getLogger(__name__)


def start_before_session(config: BatchConfig, settings: Mapping[str, str], master: Optional[str],
                         remote: Optional[str]) -> bool:
    """Before a process makes a ``local[N]`` session of its own (``spark-llm run``, ``spark-llm serve``): the main
    model's CPU engines start loading before the session's JVM does (the JVM, Delta and the first jobs take seconds
    a loading engine can use), named by this process, as the session will name its executor
    (:data:`~spark_llm.engine_host.LOCAL_EXECUTOR_ENV`), and ending with it. The run's warm-up
    (:func:`prestart_here`) finds them starting. A head start only: False, and nothing started, for a remote session,
    one that pyspark's launcher (``spark-submit``) started already, another master, or settings that do not resolve
    here (the run says why)."""
    if remote or "PYSPARK_GATEWAY_PORT" in os.environ:
        return False
    conf = local_session_conf(master, settings)
    if not is_local_master(conf) or has_gpus(conf):
        return False
    try:
        cfg = resolve(config)
    except Exception:  # the run reports bad settings with its own message
        return False
    set_local_environment()  # the environment the session's JVM and Python workers will have
    executor = Executor(os.getpid(), local_worker_env(conf))
    layout = config_layout(cfg, conf, lambda: local_parallelism(conf), local_task_threads(conf))
    spec, process = EngineSpec.from_config(cfg), config_view(ProcessSettings, cfg)
    prestart_slots(spec, process, layout.place.local_slots(executor.pid), executor)
    return True


class EngineWarmup(EngineJob):
    """The engines load while the driver reads, validates and counts the batch; loading a model takes from seconds
    (a small one on a CPU) to minutes (a large one on GPUs), and the engines would otherwise sit idle until then.

    - GPU clusters: a Spark job of one task per engine slot, in the inference stage's resource profile, run from a
      driver thread; each task holds its GPUs until their engine is ready, and inference tasks then find it.
      :meth:`wait` blocks until the engines are up; one that could not start stops the batch there.
    - Local masters (one executor, on this host, the driver's own JVM): this process starts each CPU slot's engine
      loading (:func:`prestart_here`), no Spark job; over Spark Connect (the executor is the server's) a job of one
      quick task per CPU slot does it (:func:`prestart_partition`). Either way the prepare stage
      keeps every task slot, and the first inference task of a slot waits for its engine.
    - Other clusters without GPUs: nothing (which executor's slots the inference tasks will take is not known).
    - Dynamic allocation with ``gpus_per_executor``: nothing; the executors Spark adds as the first wave asks for
      them start their engines in its first tasks.
    """

    def __init__(self, run: RunContext, blocking: bool):
        self.run, self.blocking = run, blocking
        super().__init__(run.spark, "spark_llm-warmup", self._load)

    @classmethod
    def start(cls, run: RunContext) -> Optional["EngineWarmup"]:
        if run.cfg.finish_unanswered:  # nothing will run
            return None
        conf = spark_conf(run.spark)
        if config_added_executors(run.cfg, conf) is not None:
            return None  # a job per engine would have Spark add every executor it may, before any is needed
        if has_gpus(conf):
            return cls(run, blocking=True)
        if is_local_master(conf) and not is_connect(run.spark) and prestart_here(run, conf):
            return None
        return cls(run, blocking=False) if is_local_master(conf) else None

    def _load(self) -> None:
        run = self.run
        run.describe("load the engines")
        engines = run.layout.engines
        ictx = InferContext.of_run(run)
        body = warm_partition if self.blocking else prestart_partition
        # a task per engine, each on whole GPUs: shares of a GPU would put two of them on one engine
        profile = inference_profile(spark_conf(run.spark), run.cfg.tensor_parallel_size)
        started = (run.spark.range(0, engines, 1, numPartitions=engines)
                   .mapInPandas(lambda it: body(it, ictx), "slot string, started boolean",
                                profile=profile).collect())  # one small row per engine
        names = ", ".join(sorted(r["slot"] for r in started))
        if self.blocking:
            log.info("batch %s: engines ready on %s", run.batch_id, names)
        else:
            log.info("batch %s: engines loading on %s", run.batch_id, names)

    @classmethod
    @contextlib.contextmanager
    def started(cls, run: RunContext) -> Iterator[Optional["EngineWarmup"]]:
        """:meth:`start`, closed when the block ends."""
        warmup = cls.start(run)
        try:
            yield warmup
        finally:
            if warmup is not None:
                warmup.close()

    def close(self) -> None:
        """Stop waiting for engines nothing will use (no request left to infer, or the run failed before)."""
        if self.thread.is_alive():
            self.run.cancel_jobs()  # the run's only job still running
            self.thread.join()


def prestart_here(run: RunContext, conf: dict[str, str]) -> bool:
    """The engines of a local session's CPU slots start loading, from this process (their executor is this
    session's JVM): seconds sooner than from a Spark job's tasks, whose Python workers would first start and import
    what they run, on the cores the engines load on. False when this process cannot (a cluster that does not let
    the driver call into its JVM, say): the warm-up job does it then."""
    try:
        ictx = InferContext.of_run(run)
        executor = Executor(local_executor(run.spark), local_worker_env(conf))
        slots = ictx.place.local_slots(executor.pid)
        prestart_slots(ictx.engine, ictx.process, slots, executor, ictx.run_id)
    except Exception as exc:  # only a head start
        log.info("batch %s: the engines start from a warm-up job (%s)", run.batch_id, exc)
        return False
    log.info("batch %s: engines loading on %s", run.batch_id, ", ".join(s.name for s in slots))
    return True


def warm_partition(batches: Iterator, ctx: InferContext) -> Iterator:
    """mapInPandas body of the warm-up job on GPU clusters: make sure the engine of this task's GPUs is running
    (started if needed, the slot held until it is ready), one row per task: the slot and whether this task started
    it."""
    import pandas as pd

    for _ in batches:
        gpus = task_gpus(ctx.engine.tensor_parallel_size)
        with engine_for(ctx.engine, ctx.process, TaskPlace(gpus=tuple(gpus) if gpus else None), ctx.run_id,
                        ahead=True) as engine:
            yield pd.DataFrame({"slot": [engine.slot.name], "started": [engine.started_here]})


def hold_partition(batches: Iterator, ctx: InferContext) -> Iterator:
    """mapInPandas body of the batch service's hold on GPU executors (:class:`~spark_llm.service.capacity.GpuHold`):
    the engine of this task's GPUs started (or found) as :func:`warm_partition` does, then the task keeps its
    executor busy, so that dynamic allocation neither removes it idle nor gives its GPUs away, until the hold's job
    is cancelled (the next batch's first wave is about to start). It yields nothing."""
    import time

    for _ in batches:
        gpus = task_gpus(ctx.engine.tensor_parallel_size)
        with engine_for(ctx.engine, ctx.process, ctx.place.with_gpus(gpus), ctx.run_id, ahead=True):  # a feed
            pass
        while True:  # ended by the job's cancellation, which kills this Python worker
            time.sleep(60)
    yield from ()


def prestart_partition(batches: Iterator, ctx: InferContext) -> Iterator:
    """mapInPandas body of the warm-up job on local masters: task ``n`` starts local slot ``n``'s engine loading and
    returns at once (the inference tasks wait for it); one row per task: the slot and whether it was started."""
    import pandas as pd
    from pyspark import TaskContext

    for _ in batches:
        slot = ctx.place.local_slots()[TaskContext.get().partitionId()]
        started = prestart(ctx.engine, ctx.process, slot, run_id=ctx.run_id)
        yield pd.DataFrame({"slot": [slot.name], "started": [started]})
