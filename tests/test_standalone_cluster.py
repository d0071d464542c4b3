"""The path a user takes when one machine is not enough: ``spark-submit --master spark://...`` on a real Spark
standalone cluster (the installed pyspark's own master and two workers, on this machine, each worker with two fake
GPUs and an engine directory of its own, as separate hosts would have), one worker killed mid-wave
(scripts/standalone_cluster.py): a batch job, the same with dynamic allocation, and the batch service on the elastic
cluster. Asserted from the batches' files and the engines' own records.

The engines are the stand-in (:data:`STANDIN`): what these drills prove is Spark's and the engine host's (placement
on each worker's GPUs, a node lost mid-wave, dynamic allocation, the service's hold on GPU executors), which the
stand-in goes through as vLLM does (the same engine servers, device locks, feeds and faults), without four vLLM
imports on two cores. vLLM's own failures are proven with vLLM (tests/test_sampling_seeds.py, tests/test_faults.py,
the tensor-parallel drill of tests/test_gpu_scheduling.py)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import ROOT, STANDIN_L4 as STANDIN
from drills import drill

pytestmark = pytest.mark.engine

REQUESTS, GPUS = 240, 2


def standalone(ctx, name: str, *flags: str, requests: int = REQUESTS, gpus: int = GPUS) -> dict:
    """scripts/standalone_cluster.py with ``flags``: what it printed, and the driver's log."""
    out = ctx.out(name)
    proc = ctx.run([sys.executable, ROOT / "scripts" / "standalone_cluster.py", "--model", ctx.tiny_model,
                    "--out", out, "--requests", requests, "--gpus", gpus, "--engine-standin", STANDIN, *flags],
                   timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["driver_log"] = (out / "driver.log").read_text(errors="replace")
    return got


@drill("standalone-kill-node")
def kill_node_drill(ctx) -> dict:
    return standalone(ctx, "standalone", "--kill-node")


@pytest.fixture(scope="module")
def cluster(lane) -> dict:
    return lane.result("standalone-kill-node")


@pytest.mark.drill("standalone-kill-node")
def test_every_line_exactly_once_though_a_worker_died_mid_wave(cluster):
    assert cluster["node_killed"] and "Lost executor" in cluster["driver_log"], cluster["driver_log"][-3000:]
    assert cluster["exit_code"] == 0 and cluster["status"] == "completed", cluster["driver_log"][-3000:]
    assert cluster["request_counts"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}
    assert sorted(cluster["output_ids"]) == sorted(f"r{i}" for i in range(REQUESTS)) and cluster["error_ids"] == []


@pytest.mark.drill("standalone-kill-node")
def test_each_worker_s_gpus_each_got_one_engine_and_never_two_at_once(cluster):
    for worker, events in cluster["events"].items():
        ready = sorted((e["slot"], e["pid"]) for e in events if e["event"] == "ready")
        assert [slot for slot, _ in ready] == [f"gpu-{i}" for i in range(GPUS)], (worker, events)
        lives: dict[str, list[tuple[float, float]]] = {}
        stops = {e["pid"]: e["time"] for e in events if e["event"] == "stop"}
        for e in events:
            if e["event"] == "start":
                for device in e["devices"]:
                    lives.setdefault(device, []).append((e["time"], stops.get(e["pid"], float("inf"))))
        for device, spans in lives.items():
            spans.sort()
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), (worker, device)


@pytest.mark.drill("standalone-kill-node")
def test_every_engine_ended_with_its_executor_the_killed_worker_s_while_the_batch_ran(cluster):
    """Engines watch their executor: the killed worker's stopped mid-batch (the GPUs are not held for a dead
    executor), the other worker's when the application ended and took its executor (script: engines_ended)."""
    stops = {w: [e for e in events if e["event"] == "stop"] for w, events in cluster["events"].items()}
    for worker, events in cluster["events"].items():
        started = {e["pid"] for e in events if e["event"] == "start"}
        assert {e["pid"] for e in stops[worker]} == started, (worker, events)
        assert all(e["reason"].startswith("executor gone") for e in stops[worker]), (worker, events)
    during = [w for w, ended in stops.items() if any(e["time"] < cluster["finalizing_at"] for e in ended)]
    assert len(during) == 1, (cluster["finalizing_at"], stops)


@drill("standalone-elastic")
def elastic_drill(ctx) -> dict:
    """The same cluster with dynamic allocation: no executor at the start, GPU executors added for inference
    (gpus_per_executor) and removed when idle while the application still runs."""
    return standalone(ctx, "elastic", "--dynamic")


@pytest.fixture(scope="module")
def elastic(lane) -> dict:
    return lane.result("standalone-elastic")


@pytest.mark.drill("standalone-elastic")
def test_with_dynamic_allocation_a_batch_from_no_executor_gets_gpu_executors_and_answers_every_line_once(elastic):
    assert elastic["exit_code"] == 0 and elastic["status"] == "completed", elastic["driver_log"][-3000:]
    assert sorted(elastic["output_ids"]) == sorted(f"r{i}" for i in range(REQUESTS)) and elastic["error_ids"] == []
    assert elastic["executors"][0] == 0 and max(elastic["executors"]) >= 2, elastic["executors"]
    for worker, events in elastic["events"].items():  # each worker's GPU executor ran an engine per GPU
        assert sorted(e["slot"] for e in events if e["event"] == "ready") == [f"gpu-{i}" for i in range(GPUS)], \
            (worker, events)
    assert "engines ready on" not in elastic["driver_log"]  # no warm-up job asking Spark for every executor at once


@pytest.mark.drill("standalone-elastic")
def test_idle_gpu_executors_and_their_engines_go_while_the_application_still_runs(elastic):
    """Two reading executors and two GPU executors (one per worker) at the most; the GPU executors removed when idle,
    their engines ending with them, while the driver still runs. The reading executors stay: Delta's cached table
    states are theirs (docs/gpu.md: cachedExecutorIdleTimeout)."""
    assert elastic["engines_ended_in_app"], elastic["executors"]
    assert max(elastic["executors"]) == 4 and elastic["executors_left"] <= 2, elastic["executors"]
    # the GPUs the application held (cluster_capacity, the service's spark_llm_executor_gpus): both workers' two
    # while they inferred, none at the end
    assert max(elastic["gpus"]) == 2 * GPUS and elastic["gpus"][-1] == 0, elastic["gpus"]
    for worker, events in elastic["events"].items():
        stops = [e for e in events if e["event"] == "stop"]
        assert {e["pid"] for e in stops} == {e["pid"] for e in events if e["event"] == "start"}, (worker, events)
        assert all(e["reason"].startswith("executor gone") and e["time"] < elastic["app_ending_at"] for e in stops)
    print(f"elastic: first executor {elastic['first_executor_s']} s, completed {elastic['completed_s']} s, "
          f"GPU executors and engines gone {elastic['released_s']} s after the submit")


SERVICE_BATCHES, SERVICE_REQUESTS, SERVICE_GPUS = 3, 40, 1  # a GPU a worker: two engine loads on these two cores


@drill("standalone-service")
def service_drill(ctx) -> dict:
    """The batch service on the same elastic cluster (spark-submit jobs/serve.py), idle, then a burst of three
    batches created at once through openai-python; one worker killed as an engine call holding r20 starts, which
    waits until the service holds both workers' GPUs (the drill lets it go then)."""
    return standalone(ctx, "service", "--service", "--kill-node", "--batches", str(SERVICE_BATCHES),
                      requests=SERVICE_REQUESTS, gpus=SERVICE_GPUS)


@pytest.fixture(scope="module")
def service(lane) -> dict:
    return lane.result("standalone-service")


@pytest.mark.drill("standalone-service")
def test_the_idle_elastic_service_holds_no_executor_then_gets_gpus_for_its_backlog_and_gives_them_back(service):
    assert service["idle_before"] and set(service["idle_before"]) == {0}, service["executors"]
    assert max(service["gpus"]) == 2 * SERVICE_GPUS and service["gpus"][-1] == 0, service["gpus"]
    assert service["engines_ended_in_app"], service["events"]
    print(f"service: first executor {service['first_executor_s']} s, all {SERVICE_BATCHES} batches completed "
          f"{service['completed_s']} s, no GPU held {service['released_s']} s after the first create")


@pytest.mark.drill("standalone-service")
def test_the_service_s_hold_on_the_backlog_asks_spark_for_a_gpu_executor_per_engine_it_holds(service):
    """Before the first wave, the service holds an engine per GPU for the burst's backlog (capacity.GpuHold), and
    the hold's job asks dynamic allocation for as many GPU executors (the inference profile's desired total, as
    Spark's ExecutorAllocationManager logs it). Its tasks take a share of a GPU each (two feeds an engine): a task
    an engine once packed the whole hold onto one executor."""
    log = service["driver_log"]
    held = re.search(r"holding (\d+) engine slot\(s\) of GPU executors", log)
    before_wave = log[held.end():log.index("GPU executors let go to the inference waves", held.end())]
    asked = [int(n) for n in re.findall(r"new desired total will be (\d+) for resource profile id: [1-9]", before_wave)]
    assert int(held.group(1)) == 2 * SERVICE_GPUS and max(asked, default=0) == 2 * SERVICE_GPUS, asked


@pytest.mark.drill("standalone-service")
def test_three_batches_on_the_elastic_service_each_complete_every_line_once_though_a_worker_died(service):
    assert service["node_killed"] and "Lost executor" in service["driver_log"], service["driver_log"][-3000:]
    assert len(service["batches"]) == SERVICE_BATCHES
    for batch in service["batches"]:
        assert batch["status"] == "completed" and batch["error_ids"] == [], batch
        assert sorted(batch["output_ids"]) == sorted(f"r{i}" for i in range(SERVICE_REQUESTS))
    for worker, events in service["events"].items():  # the dead worker's engines too: gone with their executor
        started = {e["pid"] for e in events if e["event"] == "start"}
        assert started and {e["pid"] for e in events if e["event"] == "stop"} == started, (worker, events)
