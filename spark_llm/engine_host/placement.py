"""Where a run's engines go: the GPUs a task owns, how many engines run at once and how many tasks feed each
(:class:`EngineLayout`), the inference stage's resource profile, and the driver-side check of Spark's GPU settings.

When Spark schedules GPUs, a task's ``TaskContext.resources()["gpu"].addresses`` are the devices it owns; its engine
runs with ``CUDA_VISIBLE_DEVICES`` set to exactly those (:mod:`~spark_llm.engine_host.client`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from ..config import BatchConfig, ConfigError
from ..errors import EngineStartError
from ..session_info import is_connect, is_local_master
from .directory import Slot

log = logging.getLogger(__name__)


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


def _amount(spark_conf: Mapping[str, str], key: str) -> float:
    try:
        return float(spark_conf.get(key) or 0)
    except ValueError:
        raise ConfigError(f"{key} is {spark_conf.get(key)!r}, not a number") from None


def dynamic_allocation(spark_conf: Mapping[str, str]) -> bool:
    """Spark adds and removes executors as the backlog asks (a local master has no dynamic allocation)."""
    return str(spark_conf.get("spark.dynamicAllocation.enabled", "")).lower() == "true" and \
        not is_local_master(spark_conf)


@dataclass(frozen=True)
class AddedExecutors:
    """The executors with GPUs that the inference stage asks Spark to add (dynamic allocation, ``gpus_per_executor``):
    ``gpus`` each, listed by ``discovery_script`` on the executor (YARN, Kubernetes) and of ``vendor`` (Kubernetes)."""

    gpus: int
    discovery_script: str = ""
    vendor: str = ""


def added_executors(spark_conf: Mapping[str, str], gpus_per_executor: Optional[int],
                    discovery_script: Optional[str] = None) -> Optional[AddedExecutors]:
    """:class:`AddedExecutors` of a run with ``gpus_per_executor`` under dynamic allocation, else None (executors
    have their GPUs from the start, ``spark.executor.resource.gpu.amount``, or none)."""
    if not gpus_per_executor or not dynamic_allocation(spark_conf):
        return None
    vendor = "nvidia.com" if str(spark_conf.get("spark.master", "")).startswith("k8s://") else ""
    return AddedExecutors(gpus_per_executor, discovery_script or "", vendor)


def with_added_gpus(spark_conf: Mapping[str, str], added: Optional[AddedExecutors]) -> dict[str, str]:
    """``spark_conf`` as the inference stage's executors have it: with ``added`` executors, their GPUs as
    ``spark.executor.resource.gpu.amount`` (what the engine layout counts)."""
    conf = dict(spark_conf)
    if added is not None:
        conf["spark.executor.resource.gpu.amount"] = str(added.gpus)
    return conf


#: spark.dynamicAllocation.maxExecutors when unset (Int.MaxValue): no bound the plan could spread partitions over.
UNBOUNDED_EXECUTORS = 2**31 - 1


def _max_executors(spark_conf: Mapping[str, str]) -> int:
    """spark.dynamicAllocation.maxExecutors, 0 when unset or unbounded."""
    value = int(spark_conf.get("spark.dynamicAllocation.maxExecutors", "0") or 0)
    return 0 if value >= UNBOUNDED_EXECUTORS else value


def check_gpu_settings(spark_conf: dict[str, str], tensor_parallel_size: int, *,
                       gpus_per_executor: Optional[int] = None, engines: Optional[int] = None) -> None:
    """Driver-side check of Spark's GPU settings against the engine, one clear message per mistake: the GPUs of one
    inference task are those of one engine (``tensor_parallel_size`` of them), or a share of one GPU (``1/N``, N
    tasks feeding one engine); with dynamic allocation, the inference stage's executors ask for their GPUs
    (``gpus_per_executor``), and how many of them the plan spreads over is bounded (``engines``, or
    ``spark.dynamicAllocation.maxExecutors``)."""
    task, executor = (_amount(spark_conf, f"spark.{k}.resource.gpu.amount") for k in ("task", "executor"))
    if gpus_per_executor:
        _check_added_gpus(spark_conf, tensor_parallel_size, gpus_per_executor, engines, task, executor)
        spark_conf = with_added_gpus(spark_conf, AddedExecutors(gpus_per_executor))
        task, executor = 0.0, float(gpus_per_executor)
    elif executor and not task and dynamic_allocation(spark_conf):
        raise ConfigError(
            "spark.dynamicAllocation.enabled is true and spark.executor.resource.gpu.amount gives every executor "
            "GPUs, so the executors that read and validate hold GPUs (and, with the requests cached on them, keep "
            "them) while the inference stage waits for executors of its own. Set gpus_per_executor to the GPUs of "
            "an executor instead (spark_llm asks for GPU executors on the inference stage alone) and unset "
            "spark.executor.resource.gpu.amount; or keep it and set spark.task.resource.gpu.amount="
            f"{tensor_parallel_size if tensor_parallel_size > 1 else '1/N (0.5 for two tasks per engine)'} so that "
            "every stage asks for GPUs; or set spark.dynamicAllocation.enabled=false")
    _check_gpu_amounts(spark_conf, tensor_parallel_size, task, executor)
    _check_executor_room(spark_conf, tensor_parallel_size, task, executor)


def _check_added_gpus(spark_conf: dict[str, str], tensor_parallel_size: int, gpus_per_executor: int,
                      engines: Optional[int], task: float, executor: float) -> None:
    """``gpus_per_executor``: GPU executors added by dynamic allocation for the inference stage alone."""
    if not dynamic_allocation(spark_conf):
        raise ConfigError(
            "gpus_per_executor asks for GPU executors as dynamic allocation adds them, but dynamic allocation is "
            "off (spark.dynamicAllocation.enabled is not true, or a local master): executors then have their "
            "GPUs from the start; set spark.executor.resource.gpu.amount instead")
    if executor or task:
        raise ConfigError(
            "gpus_per_executor gives the inference stage's executors their GPUs, but "
            f"spark.{'executor' if executor else 'task'}.resource.gpu.amount is set too, which gives every "
            "executor (or every stage) GPUs: the executors that read and validate would hold GPUs that no "
            "engine uses. Unset it")
    if gpus_per_executor < tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size is {tensor_parallel_size} but gpus_per_executor is "
                          f"{gpus_per_executor}: one engine's GPUs must be on one executor")
    if not engines and not _max_executors(spark_conf):
        raise ConfigError(
            "with dynamic allocation, set spark.dynamicAllocation.maxExecutors to the most GPU executors the "
            "batch may hold (the plan spreads its partitions over their engines, and Spark adds executors as "
            "they are needed), or num_task_slots to the engines")


def _check_gpu_amounts(spark_conf: dict[str, str], tensor_parallel_size: int, task: float, executor: float) -> None:
    """A task's GPUs are one engine's (or a share of one GPU), an executor's hold whole engines."""
    if task and task != tensor_parallel_size and not (tensor_parallel_size == 1 and _shares(task)):
        raise ConfigError(
            f"spark.task.resource.gpu.amount is {spark_conf['spark.task.resource.gpu.amount']} but "
            f"tensor_parallel_size is {tensor_parallel_size}: each inference task must own exactly the GPUs of one "
            "engine" + (" or, with one GPU per engine, 1/N of it (N tasks feeding it)" if tensor_parallel_size == 1
                         else "") + ". Better, leave spark.task.resource.gpu.amount unset: spark_llm asks for the "
            "GPUs on the inference stage alone (stage-level scheduling; tasks_per_engine sets the share)")
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


def _check_executor_room(spark_conf: dict[str, str], tensor_parallel_size: int, task: float, executor: float) -> None:
    """An executor runs a task for each of its engines at once, and its Python workers may hold GPU memory."""
    cores, cpus = executor_cores(spark_conf), int(_amount(spark_conf, "spark.task.cpus") or 1)
    per_executor = int(executor // tensor_parallel_size) if executor else 0
    if per_executor and cores is not None and cores // cpus < per_executor:
        default = "" if spark_conf.get("spark.executor.cores") else ", spark.executor.cores unset: the default"
        raise ConfigError(
            f"executors have {executor:g} GPU(s), room for {per_executor} engine(s), but run {cores // cpus} task(s) "
            f"at once ({cores} core(s){default}; spark.task.cpus={cpus}): the other GPUs would never get an engine. "
            f"Set spark.executor.cores to at least {per_executor * cpus} ({2 * per_executor * cpus} for two tasks per "
            f"engine)")
    if per_executor and not task and cores is None and tensor_parallel_size == 1:
        log.warning("spark.executor.cores is unset, so how many inference tasks an executor runs at once is not known "
                    "here: each GPU's engine is fed by one task; set spark.executor.cores (at least %d) to let two "
                    "tasks feed each engine", 2 * per_executor * cpus)
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
class TaskPlace:
    """Where a task feeds an engine: the slot of its GPUs (Spark's GPU scheduling), else the first free feed of a
    local master's ``local_engines`` slots (each pinned to its group of ``local_devices`` where the host has GPUs
    that Spark does not schedule, else a CPU slot), else an engine of its own. ``feeds``: tasks that feed one engine
    at once."""

    gpus: Optional[tuple[str, ...]] = None
    local_engines: Optional[int] = None
    local_devices: tuple[tuple[str, ...], ...] = ()
    feeds: int = 1
    #: engines of one executor under Spark's GPU scheduling: with more than one, a task whose GPUs cannot start an
    #: engine feeds another GPU's (see :func:`~spark_llm.engine_host.client.engine_for`)
    executor_engines: int = 1

    def with_gpus(self, gpus: Sequence[str]) -> "TaskPlace":
        """This place for a task Spark gave ``gpus`` (none: as it is)."""
        return replace(self, gpus=tuple(gpus)) if gpus else self

    def local_slots(self, executor: Optional[int] = None) -> list[Slot]:
        """The local master's engine slots: one per device group, else ``local_engines`` CPU slots (of this
        executor, or of ``executor``)."""
        if self.local_devices:
            return [Slot.for_gpus(group) for group in self.local_devices]
        return [Slot.cpu(n, executor) for n in range(self.local_engines or 1)]


@dataclass(frozen=True)
class EngineLayout:
    """Engines that run at once (across the cluster) and inference tasks that feed each of them at once
    (:class:`~spark_llm.engine_host.client.Feed`), so :attr:`tasks` inference tasks run at once: what the partition
    plan rounds to and a wave holds twice. ``local_engines``: the engines of a local master's host, where Spark's
    scheduling does not bound them, else None; ``local_devices``: their GPUs, a group per engine, where the host
    has GPUs."""

    engines: int
    feeds: int = 1
    local_engines: Optional[int] = None
    local_devices: tuple[tuple[str, ...], ...] = ()
    executor_engines: int = 1  #: engines of one executor (its GPUs // tensor_parallel_size) under GPU scheduling

    @property
    def tasks(self) -> int:
        return self.engines * self.feeds

    @property
    def place(self) -> TaskPlace:
        """Where this layout's inference tasks feed engines (their GPUs, if Spark assigns them any, added in the
        task)."""
        return TaskPlace(local_engines=self.local_engines, local_devices=self.local_devices, feeds=self.feeds,
                         executor_engines=self.executor_engines)


@dataclass(frozen=True)
class LocalMaster:
    """A local master's host: its task threads and the GPUs its engines may use (:func:`local_gpus`)."""

    threads: int
    gpus: tuple[str, ...] = ()


def local_gpus() -> tuple[str, ...]:
    """The GPUs of this host that a local master's engines may use, as ``CUDA_VISIBLE_DEVICES`` names them: that
    variable's list where it is set, else the indices ``nvidia-smi`` lists (none without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1")
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in listed.splitlines() if line.strip().isdigit())


def executor_cores(spark_conf: Mapping[str, str]) -> Optional[int]:
    """Cores of an executor: ``spark.executor.cores``, else the cluster manager's default (1 on YARN and Kubernetes;
    a ``local-cluster[N,C,M]`` worker's C); None where the default is a worker's every core (standalone)."""
    if spark_conf.get("spark.executor.cores"):
        return int(spark_conf["spark.executor.cores"])
    master = spark_conf.get("spark.master", "")
    if master.startswith(("yarn", "k8s://")):
        return 1
    match = re.fullmatch(r"local-cluster\[\s*\d+\s*,\s*(\d+)\s*,\s*\d+\s*\]", master.strip())
    return int(match.group(1)) if match else None


def engine_layout(spark_conf: Mapping[str, str], *, engines: Optional[int], tasks_per_engine: int,
                  tensor_parallel_size: int, parallelism: Callable[[], int],
                  local: Optional[LocalMaster] = None) -> EngineLayout:
    """The layout of a run's engines (``engines``: the configured number, else derived):

    - GPU scheduling: executors x (executor GPUs // tensor_parallel_size) engines; with one GPU per engine,
      ``tasks_per_engine`` tasks share each GPU, as many as the executor's cores take (:func:`executor_cores`:
      Spark gives a GPU's shares to tasks first come, first served, so tasks that do not fit every GPU would leave
      the last GPUs without an engine); a tensor-parallel group is fed by one task (Spark cannot give two tasks one
      set of several GPUs). A fraction set for every stage (``spark.task.resource.gpu.amount``) decides the share
      instead.
    - a local master (``local``): one engine per group of ``tensor_parallel_size`` of the host's GPUs, each pinned
      to them; without GPUs, the engines (default: the parallelism) share its cores; each fed by up to
      ``tasks_per_engine`` of its task threads.
    - other clusters without GPUs: an engine per running task.
    """
    conf = dict(spark_conf)
    task, executor = (_amount(conf, f"spark.{k}.resource.gpu.amount") for k in ("task", "executor"))
    if executor:
        per_executor = max(1, int(executor // tensor_parallel_size))
        # dynamic allocation: the most executors Spark may add (spark.executor.instances is only its start)
        executors = _max_executors(conf) if dynamic_allocation(conf) else int(
            conf.get("spark.executor.instances", "0") or 0)
        if task:
            feeds = _shares(task) if tensor_parallel_size == 1 else 1
        else:
            feeds = tasks_per_engine if tensor_parallel_size == 1 else 1
            cores, cpus = executor_cores(conf), int(_amount(conf, "spark.task.cpus") or 1)
            # cores unknown (a standalone executor takes its worker's): one task per GPU, which any core count runs
            feeds = min(feeds, cores // (cpus * per_executor)) if cores else 1
        feeds = max(1, feeds)
        count = engines or (executors * per_executor if executors else max(1, parallelism() // feeds))
        return EngineLayout(count, feeds, executor_engines=per_executor)
    if local is not None:
        groups = [local.gpus[i:i + tensor_parallel_size]
                  for i in range(0, len(local.gpus) - tensor_parallel_size + 1, tensor_parallel_size)]
        if groups:
            groups = groups[:engines] if engines else groups
            count = len(groups)
        else:
            count = engines or max(1, parallelism())
        return EngineLayout(count, max(1, min(tasks_per_engine, local.threads // count)), local_engines=count,
                            local_devices=tuple(tuple(g) for g in groups))
    return EngineLayout(engines or max(1, parallelism()))


def has_gpus(spark_conf: dict[str, str]) -> bool:
    """Executors have GPUs (Spark's GPU scheduling is on)."""
    return _amount(spark_conf, "spark.executor.resource.gpu.amount") > 0


def config_layout(cfg: BatchConfig, spark_conf: Mapping[str, str], parallelism: Callable[[], int],
                  local_threads: Optional[int]) -> EngineLayout:
    """:func:`engine_layout` of model ``cfg`` in a session with settings ``spark_conf`` (a local master's with
    ``local_threads`` task threads, whose host's GPUs its engines use unless Spark schedules GPUs)."""
    local = None
    if local_threads:
        local = LocalMaster(local_threads, () if has_gpus(dict(spark_conf)) else local_gpus())
    spark_conf = with_added_gpus(spark_conf, config_added_executors(cfg, spark_conf))
    return engine_layout(spark_conf, engines=cfg.num_task_slots, tasks_per_engine=cfg.tasks_per_engine,
                         tensor_parallel_size=cfg.tensor_parallel_size, parallelism=parallelism, local=local)


def config_added_executors(cfg: BatchConfig, spark_conf: Mapping[str, str]) -> Optional[AddedExecutors]:
    """:func:`added_executors` of model ``cfg``."""
    return added_executors(spark_conf, cfg.gpus_per_executor, cfg.gpu_discovery_script)


@dataclass(frozen=True)
class InferenceResources:
    """What the inference stage's tasks ask Spark for (:func:`inference_resources`): ``cpus`` and ``gpus`` each, and
    on ``added`` executors (dynamic allocation)."""

    cpus: int
    gpus: float
    added: Optional[AddedExecutors] = None


def inference_resources(spark_conf: Mapping[str, str], tensor_parallel_size: int, feeds: int = 1,
                        added: Optional[AddedExecutors] = None) -> Optional[InferenceResources]:
    """The inference stage's resources: ``tensor_parallel_size`` GPUs per task, or 1/``feeds`` of one GPU (that many
    tasks feeding its engine), so that only that stage asks for GPUs (Spark's stage-level scheduling); with
    ``added`` executors (dynamic allocation), also the GPUs of the executors Spark adds for it, whose other
    resources (cores, memory) are the default executor's. None when executors have no GPUs or every task already
    asks for them (``spark.task.resource.gpu.amount``)."""
    if added is None and (not _amount(spark_conf, "spark.executor.resource.gpu.amount") or
                          _amount(spark_conf, "spark.task.resource.gpu.amount")):
        return None
    cpus = int(_amount(spark_conf, "spark.task.cpus") or 1)
    gpus = 1.0 / feeds if tensor_parallel_size == 1 and feeds > 1 else tensor_parallel_size
    return InferenceResources(cpus, gpus, added)


def resource_profile(resources: InferenceResources) -> Any:
    """A new ResourceProfile of ``resources``. Spark tells profiles apart by their ids, not by what they ask for:
    a run builds its profile once and gives it to every wave, or each wave would wait for executors of its own
    while the last wave's sit idle (see :attr:`~spark_llm.context.RunContext.gpu_profile`)."""
    from pyspark.resource import ExecutorResourceRequests, ResourceProfileBuilder, TaskResourceRequests

    builder = ResourceProfileBuilder().require(TaskResourceRequests().cpus(resources.cpus)
                                               .resource("gpu", resources.gpus))
    added = resources.added
    if added is not None:
        builder.require(ExecutorResourceRequests().resource("gpu", added.gpus, added.discovery_script, added.vendor))
    return builder.build


def inference_profile(spark_conf: dict[str, str], tensor_parallel_size: int, feeds: int = 1,
                      added: Optional[AddedExecutors] = None) -> Any:
    """A ResourceProfile of :func:`inference_resources`, or None."""
    resources = inference_resources(spark_conf, tensor_parallel_size, feeds, added)
    return resource_profile(resources) if resources is not None else None


def unscheduled_gpus(place: TaskPlace, host_gpus: Sequence[str]) -> Optional[str]:
    """Why a task may not start an engine of its own: it runs on a cluster's executor (not a local master, whose
    engines are pinned to the host's GPUs) whose host has GPUs ``host_gpus``, and Spark gave it none (GPU scheduling
    off). Its engine would not be pinned: every task's would take 90% of GPU 0, all but one fail, and the batch
    with them. None: it may."""
    if place.gpus or place.local_engines is not None or not host_gpus:
        return None
    return (f"this executor's host has GPUs ({', '.join(host_gpus)}) but Spark assigned this task none: Spark's GPU "
            "scheduling is off, so each task's engine would take GPU 0 and all but one fail. Set "
            "spark.executor.resource.gpu.amount to the GPUs of an executor and "
            "spark.executor.resource.gpu.discoveryScriptPath (docs/gpu.md), or hide the GPUs from the executors "
            "(CUDA_VISIBLE_DEVICES='') to run on CPU")


def task_gpus(tensor_parallel_size: int) -> Optional[list[str]]:
    """The GPU addresses Spark assigned the running task (None outside Spark or without GPU scheduling)."""
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        resources = ctx.resources() if ctx is not None else None
    except Exception:  # outside Spark
        resources = None
    return select_gpus(resources, tensor_parallel_size)


@dataclass(frozen=True)
class Capacity:
    """What a Spark application holds now: its live executors that run tasks (a local master's driver, else the
    executors but the driver) and their GPUs."""

    executors: int
    gpus: int


def cluster_capacity(spark: Any) -> Optional[Capacity]:
    """The live executors of ``spark``'s application and the GPUs Spark gave them, from its status store (what the
    Spark UI's Executors page shows); None over Spark Connect, whose client has no view of them."""
    if is_connect(spark):
        return None
    local = is_local_master({"spark.master": spark.sparkContext.master})  # its driver runs the tasks
    summaries = spark.sparkContext._jsc.sc().statusStore().executorList(True).iterator()  # the live ones
    executors = gpus = 0
    while summaries.hasNext():
        summary = summaries.next()
        if summary.id() == "driver" and not local:
            continue
        executors += 1
        gpu = summary.resources().get("gpu")
        if gpu.isDefined():
            gpus += len(gpu.get().addresses())
    return Capacity(executors, gpus)
