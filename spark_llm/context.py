"""One run's context: the session, the settings with everything derived already filled in, where each result goes,
and the channel the inference tasks report their metrics on. Made once by :meth:`RunContext.start`; every stage
takes it instead of a list of parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional

from pyspark.sql import SparkSession

from . import storage
from .config import BatchConfig
from .engine_host.placement import (EngineLayout, InferenceResources, config_added_executors, config_layout,
                                   inference_resources, resource_profile)
from .engine_host.protocol import EngineTask
from .metrics import ListParam
from .models import resolve, resolve_models, tasks_of
from .session import URGENT_POOL, default_parallelism, scheduler_pool
from .session_info import is_connect, local_task_threads, spark_conf


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes: the OpenAI files and the report under ``output_dir``, and the three Delta tables."""

    output_dir: str
    output_file: str
    error_file: str
    batch_file: str
    report_file: str
    settings_file: str  #: the run's settings (secrets masked), beside batch.json
    staging: str
    outputs_table: str
    errors_table: str
    metrics_table: str
    embeddings_table: str

    @classmethod
    def from_config(cls, cfg: BatchConfig) -> "RunPaths":
        out = (cfg.output_dir or "").rstrip("/")
        if cfg.output_table_prefix:  # managed catalog tables, shared by many batches
            tables = {name: f"{cfg.output_table_prefix}{name}"
                      for name in ("outputs", "errors", "metrics", "embeddings")}
        else:
            tables_dir = (cfg.tables_dir or f"{out}/delta").rstrip("/")
            tables = {name: f"{tables_dir}/{name}" for name in ("outputs", "errors", "metrics", "embeddings")}
            tables.update({k: v for k, v in (("outputs", cfg.outputs_table_path),
                                              ("errors", cfg.errors_table_path)) if v})
        return cls(output_dir=out, output_file=f"{out}/output.jsonl", error_file=f"{out}/errors.jsonl",
                   batch_file=f"{out}/batch.json", report_file=f"{out}/report.html",
                   settings_file=f"{out}/settings.json", staging=f"{out}/_staging",
                   outputs_table=tables["outputs"], errors_table=tables["errors"], metrics_table=tables["metrics"],
                   embeddings_table=tables["embeddings"])


class RunListener:
    """What a run tells whoever started it, as it happens (the batch service moves the batch's status and counts
    with it). Any call may raise :class:`~spark_llm.errors.BatchStopped` to end the run there; Spark jobs already
    running are the caller's to cancel (the run's job group is its batch id). This one hears nothing."""

    def validated(self, total: int, invalid: int, answered: int) -> None:
        """The batch is read and validated: ``total`` non-blank lines, ``invalid`` of them error rows this run
        writes now, ``answered`` already answered by an earlier run (resume); inference starts next."""

    def committed(self, responses: int, errors: int) -> None:
        """A wave's rows are committed: ``responses`` more outputs and ``errors`` more error rows."""

    def finalizing(self) -> None:
        """Every row is committed; the OpenAI files, batch.json and the report are written next."""

    def before_wave(self) -> int:
        """A wave's Spark job is submitted next. May block while the run yields its task slots to a more urgent
        batch (the batch service: see :func:`cancel_waves`); returns how many times the run has yielded, for
        :meth:`yielded`."""
        return 0

    def yielded(self, since: int) -> bool:
        """Whether the run yielded its slots after :meth:`before_wave` returned ``since``: the waves submitted
        then were cancelled (:func:`cancel_waves`) and run again, the run goes on."""
        return False

    def inference_ended(self) -> None:
        """Every inference wave of a model has ended (their commits may still run): the GPUs are free (the batch
        service then holds them for the batches that wait)."""

    def writing(self, table: str) -> ContextManager[None]:
        """A write of the result table ``table`` (its creation, an append, a delete) runs within this: the batch
        service makes the writes of its servers to one table on object storage take turns there, where a Delta
        commit is not exclusive (S3 has no put-if-absent: two commits of one version at once, one is lost)."""
        return contextlib.nullcontext()


#: The inference stages' ResourceProfiles, per session and resources (see RunContext.gpu_profile).
_PROFILES: "weakref.WeakKeyDictionary[SparkSession, dict[InferenceResources, Any]]" = weakref.WeakKeyDictionary()
_PROFILES_LOCK = threading.Lock()


def gpu_profile(spark: SparkSession, cfg: BatchConfig, layout: EngineLayout) -> Any:
    """The inference stage's ResourceProfile (its GPUs) of model ``cfg`` with engines ``layout``, or None (see
    placement.inference_resources): one per session and resources, so that every wave, model and batch of the
    session (and the batch service's hold on its GPUs) runs on the same executors."""
    conf = spark_conf(spark)
    wanted = inference_resources(conf, cfg.tensor_parallel_size, layout.feeds, config_added_executors(cfg, conf))
    if wanted is None:
        return None
    with _PROFILES_LOCK:  # the waves' threads ask at once: two profiles would be two sets of executors
        made = _PROFILES.setdefault(spark, {})
        if wanted not in made:
            made[wanted] = resource_profile(wanted)
        return made[wanted]


@dataclass(frozen=True)
class RunContext:
    spark: SparkSession
    cfg: BatchConfig     #: resolved: batch_id, max_model_len and tokenizer are set
    paths: RunPaths
    created_at: int      #: the batch's creation time (kept across --resume runs)
    started: float       #: when this run started (time.time())
    #: Spark accumulator of per-partition records for the live progress line (see metrics.py); None over Spark
    #: Connect, which has no accumulators (the records also travel with the staged results, for the metrics table)
    metrics: Any
    run_id: str          #: this run of the batch (each --resume run is a new one)
    #: every model of the batch as a resolved config, the main model (``cfg``) first; one entry for most batches
    models: tuple[BatchConfig, ...] = ()
    #: writes of the result tables under way in the background (their creation, then the validation errors: see
    #: write.prepare_destination); every later read or write of the tables waits for them. None: nothing under way
    table_writes: Any = None
    listener: RunListener = RunListener()

    @classmethod
    def start(cls, spark: SparkSession, config: BatchConfig,
              listener: Optional[RunListener] = None) -> "RunContext":
        cfg = resolve(config)
        paths = RunPaths.from_config(cfg)
        created_at = (_previous_created_at(spark, paths.batch_file) if cfg.resume else None) or int(time.time())
        metrics = None if is_connect(spark) else spark.sparkContext.accumulator([], ListParam())
        return cls(spark=spark, cfg=cfg, paths=paths, created_at=created_at, started=time.time(),
                   metrics=metrics, run_id=uuid.uuid4().hex[:12], models=resolve_models(cfg),
                   listener=listener or RunListener())

    @property
    def has_embeddings(self) -> bool:
        """A model of the batch embeds: its vectors also go to the embeddings table."""
        return any(EngineTask.EMBED in tasks_of(m) for m in self.models or (self.cfg,))

    def for_model(self, cfg: BatchConfig) -> "RunContext":
        """This run with ``cfg`` (one of :attr:`models`) as the settings its inference stage reads."""
        return dataclasses.replace(self, cfg=cfg)

    @functools.cached_property
    def layout(self) -> EngineLayout:
        """The engines of this model (``cfg``) and the tasks that feed them (see engine.engine_layout)."""
        conf = spark_conf(self.spark)
        return config_layout(self.cfg, conf, lambda: default_parallelism(self.spark), local_task_threads(conf))

    @property
    def gpu_profile(self) -> Any:
        """The inference stage's ResourceProfile (its GPUs), or None: :func:`gpu_profile`."""
        return gpu_profile(self.spark, self.cfg, self.layout)

    @property
    def batch_id(self) -> str:
        return self.cfg.batch_id  # type: ignore[return-value]

    @property
    def tag(self) -> str:
        """The Spark Connect job tag of the run's jobs (see :func:`cancel_batch_jobs`)."""
        return batch_tag(self.batch_id)

    def describe(self, stage: str) -> None:
        """Name the Spark jobs that follow (shown in the Spark UI; a Connect session's jobs carry the run's tag)."""
        if not is_connect(self.spark):
            self.spark.sparkContext.setJobDescription(f"spark_llm {self.batch_id}: {stage}")

    def pool(self) -> Any:
        """A block whose Spark jobs (and those of threads it starts) a local session's fair scheduler serves by the
        batch's priority: a high-priority batch's in :data:`~spark_llm.session.URGENT_POOL`, ahead of the other
        batches' queued tasks (the batch service runs several on one session); others as they are."""
        return scheduler_pool(self.spark, URGENT_POOL) if self.cfg.priority == "high" else contextlib.nullcontext()

    @contextlib.contextmanager
    def job_group(self) -> Iterator[None]:
        """The run's Spark jobs in one cancellable group (a job tag over Spark Connect), cleared again when the run
        ends, success or not (the session may be a notebook's)."""
        if is_connect(self.spark):
            self.spark.addTag(self.tag)
            try:
                yield
            finally:
                self.spark.removeTag(self.tag)
            return
        sc = self.spark.sparkContext
        sc.setJobGroup(self.batch_id, f"spark_llm {self.batch_id}", interruptOnCancel=True)
        try:
            yield
        finally:
            for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
                sc.setLocalProperty(key, None)  # type: ignore[arg-type]

    def cancel_jobs(self) -> None:
        """Cancel the run's running Spark jobs."""
        cancel_batch_jobs(self.spark, self.batch_id)


def batch_tag(batch_id: str) -> str:
    """The Spark Connect job tag of a batch's runs."""
    return f"spark_llm-{batch_id}"


def cancel_batch_jobs(spark: SparkSession, batch_id: str) -> None:
    """Cancel the running Spark jobs of a batch's run (its job group, or its tag over Spark Connect: see
    :meth:`RunContext.job_group`), from any thread."""
    if is_connect(spark):
        spark.interruptTag(batch_tag(batch_id))
    else:
        spark.sparkContext.cancelJobGroup(batch_id)


def waves_tag(batch_id: str) -> str:
    """The Spark job tag of a batch's inference waves, apart from its other jobs (see :func:`cancel_waves`)."""
    return f"spark_llm-{batch_id}-waves"


def cancel_waves(spark: SparkSession, batch_id: str) -> None:
    """Cancel the inference waves a batch's run has submitted and not finished, and nothing else of it (its
    commits go on), so that their task slots go to a more urgent batch at once: Spark never preempts a running
    task, and one inference task holds its slot for a whole partition (minutes on a GPU). The run submits the
    cancelled waves again when it may (:meth:`RunListener.yielded`); nothing is committed twice, and the work of
    the cancelled tasks is lost. From any thread."""
    if is_connect(spark):
        spark.interruptTag(waves_tag(batch_id))
    else:
        spark.sparkContext.cancelJobsWithTag(waves_tag(batch_id))


def _previous_created_at(spark: SparkSession, batch_file: str) -> Optional[int]:
    try:
        text = storage.read_text(spark, batch_file)
        return int(json.loads(text)["created_at"]) if text else None
    except Exception:  # unreadable summary of an interrupted run: start a new clock
        return None
