"""What the batch service holds of an elastic cluster's GPUs while batches wait: deciding (:func:`engines_to_hold`,
a pure policy) apart from doing (:class:`GpuHold`, a Spark job on the inference stage's executors).

With dynamic allocation and ``gpus_per_executor``, Spark adds GPU executors when a batch's first inference wave asks
for them and removes them after ``spark.dynamicAllocation.executorIdleTimeout`` without a task. Between the batches
of a backlog, the next batch is read, validated and counted on executors without GPUs first: longer than the idle
timeout, and its GPU executors go, to be added again, and every engine loaded again, a minute later. So while
batches wait and none is inferring, the service holds as many engine slots as the backlog would fill: their
executors stay (or come, and load their engines while the first batch is prepared), and are let go the moment a
batch's first wave starts, whose tasks take them.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

#: The Spark job group of the hold's job (cancelled to let the GPUs go).
HOLD_GROUP = "spark_llm-gpu-hold"


def engines_to_hold(backlog_tokens: int, tokens_per_partition: int, engines: int) -> int:
    """How many engine slots to hold for a backlog of ``backlog_tokens`` estimated input tokens: one per partition
    the backlog would make (``tokens_per_partition`` each, at least one for any backlog), at most the ``engines`` the
    cluster may give (``maxExecutors`` x GPUs per executor / tensor-parallel size); none without a backlog."""
    if backlog_tokens <= 0 or engines <= 0:
        return 0
    return min(engines, max(1, math.ceil(backlog_tokens / max(tokens_per_partition, 1))))


#: What lets a long-lived session's reading executors go once idle: Spark keeps an executor that holds cached blocks
#: (the batches' rows, Delta's table states) or shuffle files for as long as these say, unbounded by default.
CACHED_TIMEOUT = "spark.dynamicAllocation.cachedExecutorIdleTimeout"
SHUFFLE_TIMEOUT = "spark.dynamicAllocation.shuffleTracking.timeout"
RELEASE_SETTINGS = (CACHED_TIMEOUT, SHUFFLE_TIMEOUT)


def never_released(conf: Mapping[str, str]) -> list[str]:
    """The settings of :data:`RELEASE_SETTINGS` that a dynamic-allocation session ``conf`` leaves unbounded. Its
    reading executors then keep their cores for the server's life, and on nodes whose cores they fill no GPU
    executor can be added. Shuffle tracking's timeout only counts where shuffles are tracked (not with an external
    shuffle service)."""
    tracked = conf.get("spark.dynamicAllocation.shuffleTracking.enabled", "true").lower() == "true" and \
        conf.get("spark.shuffle.service.enabled", "false").lower() != "true"
    return [key for key in (RELEASE_SETTINGS if tracked else (CACHED_TIMEOUT,))
            if conf.get(key, "infinity") == "infinity"]


class GpuHold:
    """The service's hold on GPU executors of an elastic cluster: :meth:`hold` keeps ``n`` engine slots of the
    inference stage's ResourceProfile busy (a background Spark job of ``n`` x feeds tasks, their engines loaded:
    :func:`~spark_llm.warmup.hold_partition`), :meth:`release` cancels it. None of it on a cluster whose executors
    hold their GPUs for their life, or a local master: :meth:`of` returns None there."""

    def __init__(self, spark: Any, cfg: Any, layout: Any, profile: Any):
        self.spark, self.cfg, self.layout, self.profile = spark, cfg, layout, profile
        self.held = 0
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, spark: Any, base: Any) -> Optional["GpuHold"]:
        """The hold of a session whose GPU executors come and go (dynamic allocation with ``gpus_per_executor``)
        for the service's model ``base``; None otherwise."""
        from ..context import gpu_profile
        from ..engine_host.placement import config_added_executors, config_layout
        from ..models import resolve
        from ..session import default_parallelism
        from ..session_info import local_task_threads, spark_conf

        conf = spark_conf(spark)
        if config_added_executors(base, conf) is None:  # before the model is resolved: most sessions end here
            return None
        if unbounded := never_released(conf):
            log.warning("dynamic allocation: executors that hold cached rows or shuffle files are never removed "
                        "(%s unset): their cores are not given back to GPU executors between batches; set %s "
                        "(e.g. 120s)", ", ".join(unbounded), " and ".join(unbounded))
        cfg = resolve(base)
        layout = config_layout(cfg, conf, lambda: default_parallelism(spark), local_task_threads(conf))
        return cls(spark, cfg, layout, gpu_profile(spark, cfg, layout))

    @property
    def engines(self) -> int:
        """The most engines the cluster may give (the plan's count under dynamic allocation)."""
        return int(self.layout.engines)

    def hold(self, engines: int) -> None:
        """Hold ``engines`` engine slots (0: none); a different count than held lets the old hold go first."""
        with self._lock:
            if engines == self.held and self._thread is not None and self._thread.is_alive():
                return
            self._cancel()
            if engines <= 0:
                return
            self.held = engines
            self._thread = threading.Thread(target=self._run, args=(engines,), name="spark_llm-gpu-hold",
                                            daemon=True)
            self._thread.start()
            log.info("holding %d engine slot(s) of GPU executors for the batches waiting", engines)

    def release(self) -> None:
        """Let the held GPU executors go to the batch whose first wave starts now."""
        with self._lock:
            if self.held:
                log.info("GPU executors let go to the inference waves")
            self._cancel()

    def _cancel(self) -> None:
        if self.held:
            self.spark.sparkContext.cancelJobGroup(HOLD_GROUP)
            if self._thread is not None:
                self._thread.join(60)
        self.held, self._thread = 0, None

    def _run(self, engines: int) -> None:
        from ..config import config_view
        from ..engine_host.spec import EngineSpec, ProcessSettings
        from ..infer import InferContext
        from ..warmup import hold_partition

        sc = self.spark.sparkContext
        sc.setJobGroup(HOLD_GROUP, "spark_llm: hold GPU executors for the batches waiting", interruptOnCancel=True)
        ctx = InferContext(engine=EngineSpec.from_config(self.cfg), served_model_name=self.cfg.served_model_name or "",
                           batch_id="", process=config_view(ProcessSettings, self.cfg),
                           run_id=f"hold-{uuid.uuid4().hex[:12]}", place=self.layout.place)
        # a task of the profile takes 1/feeds of a GPU: Spark packs `feeds` of them on one GPU executor, and a hold
        # of one task per engine would get one executor whatever it holds
        tasks = engines * self.layout.feeds
        try:
            (self.spark.range(0, tasks, 1, numPartitions=tasks)
             .mapInPandas(lambda it: hold_partition(it, ctx), "slot string", profile=self.profile).collect())
        except Exception as exc:  # cancelled (the usual end), or an engine that could not start: a batch's run says
            log.debug("the hold on GPU executors ended: %s", str(exc).splitlines()[0] if str(exc) else exc)
