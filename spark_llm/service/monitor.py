"""Watching the service: ``/health`` (the process answers), ``/ready`` (its database and Spark session are
reachable: a load balancer sends it work), ``/metrics`` in Prometheus' text format, read from the store at each
scrape (so every server of a shared database reports the same queue) and from this host's engines and GPUs.
``conf/prometheus-alerts.yaml`` holds alert rules over these metrics."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any, Iterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from .access import owner, service_of

router = APIRouter()


@router.get("/health")
def health() -> dict:
    """The process is up and answers (a liveness probe)."""
    return {"status": "ok"}


@router.get("/ready")
def ready(request: Request) -> JSONResponse:
    """200 when the database answers and the Spark session is up, else 503 with what is not (a readiness probe)."""
    service = service_of(request)
    problems = []
    try:
        service.store.ping()
    except Exception as exc:  # the database is down or out of reach
        problems.append(f"database: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    scheduler = service.scheduler
    if scheduler.startup_error is not None:
        problems.append(f"spark: the session could not start: {scheduler.startup_error}")
    elif not scheduler.ready.is_set():
        problems.append("spark: the session is starting")
    body = {"status": "ready" if not problems else "not ready", "server": scheduler.holder, "problems": problems}
    return JSONResponse(body, status_code=200 if not problems else 503)


@router.get("/metrics")
def metrics(request: Request, who: str = Depends(owner)) -> Response:
    """The metrics, behind the API keys as the API (a Prometheus scrape gives one as its bearer token)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(service_of(request)))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _Collector:
    """The service's metrics at the moment of a scrape."""

    def __init__(self, service: Any):
        self.service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from .lifecycle import Status

        stats = self.service.store.stats()
        batches = GaugeMetricFamily("spark_llm_batches", "Batches by status (every server's)", labels=["status"])
        for status in Status:
            batches.add_metric([status.value], stats.batches.get(status.value, 0))
        yield batches
        yield GaugeMetricFamily("spark_llm_backlog_batches", "Batches created and not started yet",
                                value=stats.batches.get(Status.VALIDATING.value, 0))
        yield GaugeMetricFamily("spark_llm_backlog_requests", "Requests of unfinished batches not answered yet "
                                "(of the batches that have started: a batch's count is known once it is read)",
                                value=stats.requests_left)
        age = time.time() - stats.oldest_queued if stats.oldest_queued else 0.0
        yield GaugeMetricFamily("spark_llm_oldest_queued_batch_age_seconds", "Age of the oldest batch waiting to "
                                "start (0: none waits)", value=age)
        requests = CounterMetricFamily("spark_llm_requests", "Requests done, over every batch", labels=["outcome"])
        requests.add_metric(["completed"], stats.completed)
        requests.add_metric(["failed"], stats.failed)
        yield requests
        tokens = CounterMetricFamily("spark_llm_tokens", "Tokens of the batches done", labels=["kind"])
        tokens.add_metric(["input"], stats.input_tokens)
        tokens.add_metric(["output"], stats.output_tokens)
        yield tokens
        leases = GaugeMetricFamily("spark_llm_batches_running", "Batches each server runs now (its leases)",
                                   labels=["server"])
        for server, n in sorted(stats.leases.items()):
            leases.add_metric([server], n)
        yield leases
        scheduler = self.service.scheduler
        yield GaugeMetricFamily("spark_llm_spark_ready", "This server's Spark session is up",
                                value=1.0 if scheduler.ready.is_set() and scheduler.startup_error is None else 0.0)
        yield from _capacity(scheduler.spark if scheduler.ready.is_set() else None)
        yield from _engines()
        yield from _gpus()


def _capacity(spark: Any) -> Iterator[Any]:
    """The executors and GPUs this server's Spark application holds now
    (:func:`~spark_llm.engine_host.placement.cluster_capacity`: with dynamic allocation they follow the backlog);
    nothing before its session is up, nor over Spark Connect."""
    from prometheus_client.core import GaugeMetricFamily

    from ..engine_host.placement import cluster_capacity

    try:
        held = cluster_capacity(spark) if spark is not None else None
    except Exception:  # the session is stopping: no figures this scrape
        held = None
    if held is None:
        return
    yield GaugeMetricFamily("spark_llm_executors", "Live executors of this server's Spark application that run tasks "
                            "(a local master: its driver)", value=held.executors)
    yield GaugeMetricFamily("spark_llm_executor_gpus", "GPUs Spark gave this server's executors",
                            value=held.gpus)


def _engines() -> Iterator[Any]:
    """This host's engine processes (``spark-llm engines list``), ready or loading."""
    from prometheus_client.core import GaugeMetricFamily

    from prometheus_client.core import CounterMetricFamily

    from ..engine_host.client import engines_here
    from ..engine_host.directory import SlotFile
    from ..engine_host.protocol import SlotStats
    from ..host import read_record

    engines = GaugeMetricFamily("spark_llm_engines", "Engine processes of this host", labels=["slot", "state"])
    busy = CounterMetricFamily("spark_llm_engine_busy_seconds", "Seconds an engine of this host spent stepping "
                               "(its rate is the engine's busy fraction)", labels=["slot"])
    try:
        found = engines_here()
    except Exception:  # the engine directory is not usable here: no engines to report
        found = []
    for slot, info in found:
        engines.add_metric([slot.name, "ready" if info.listening else "loading"], 1)
        stats = SlotStats.of(read_record(slot.path(SlotFile.STATS)))
        if stats is not None and stats.pid == info.pid:  # the running server's, not a stopped one's
            busy.add_metric([slot.name], stats.busy_seconds)
    yield engines
    yield busy


#: nvidia-smi's query of each GPU's memory and utilisation (CSV, no units).
_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,utilization.gpu",
              "--format=csv,noheader,nounits"]


def _gpus() -> Iterator[Any]:
    """This host's GPUs as ``nvidia-smi`` reports them (nothing without it)."""
    from prometheus_client.core import GaugeMetricFamily

    if shutil.which("nvidia-smi") is None:
        return
    try:
        text = subprocess.run(_SMI_QUERY, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return
    used = GaugeMetricFamily("spark_llm_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
    total = GaugeMetricFamily("spark_llm_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
    busy = GaugeMetricFamily("spark_llm_gpu_utilization_ratio", "Share of the last sample period a kernel ran",
                             labels=["gpu"])
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        try:
            mib_used, mib_total, percent = float(parts[1]), float(parts[2]), float(parts[3])
        except ValueError:  # "[N/A]" on some boards
            continue
        used.add_metric([parts[0]], mib_used * (1 << 20))
        total.add_metric([parts[0]], mib_total * (1 << 20))
        busy.add_metric([parts[0]], percent / 100)
    yield from (used, total, busy)
