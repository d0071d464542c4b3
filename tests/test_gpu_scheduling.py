"""GPU scheduling on a real multi-process cluster without GPUs: Spark's local-cluster master, one executor whose
discovery script reports two fake GPUs (scripts/fake_gpu_cluster.py), the engines running vLLM on the CPU. Asserted
from the engine processes' own records and the metrics table: with one GPU per engine (GPUs asked for by the
inference stage only, half a GPU per task: two tasks feed each engine), and with a tensor-parallel group of two (spark.task.resource.gpu.amount=2, the engine a real
TP=2 vLLM on two CPU cores). And an executor lost for real: two executors, one JVM killed mid-wave."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT, STANDIN_L4
from drills import drill

pytestmark = pytest.mark.engine

GPUS = 2
REQUESTS = 240


def run_cluster(ctx, name: str, *args: str) -> dict:
    proc = ctx.run([sys.executable, ROOT / "scripts" / "fake_gpu_cluster.py", "--model", ctx.tiny_model,
                    "--out", ctx.out(name), "--gpus", GPUS, *args], timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "log": proc.stderr}


@drill("fake-gpu-cluster")
def fake_gpu_cluster(ctx) -> dict:
    return run_cluster(ctx, "fake-gpu-cluster", "--requests", str(REQUESTS))


@pytest.fixture(scope="module")
def cluster(lane) -> dict:
    return lane.result("fake-gpu-cluster")


@pytest.mark.drill("fake-gpu-cluster")
def test_every_line_once_on_the_fake_gpu_cluster(cluster):
    assert (cluster["completed"], cluster["failed"], cluster["output_lines"]) == (REQUESTS, 0, REQUESTS)
    assert cluster["partitions"] >= 8 and sum(m["rows"] for m in cluster["metrics"]) == REQUESTS
    assert len({m["wave"] for m in cluster["metrics"]}) >= 2  # several waves, engines kept between them
    # what the application holds, as the batch service's /metrics reports it (cluster_capacity)
    assert cluster["capacity"] == {"executors": 1, "gpus": GPUS}


@pytest.mark.drill("fake-gpu-cluster")
def test_no_gpu_ever_has_two_live_engines(cluster):
    spans: dict[str, list[tuple[float, float]]] = {}
    stops = {e["pid"]: e["time"] for e in cluster["events"] if e["event"] == "stop"}
    for e in cluster["events"]:
        if e["event"] == "start":
            for device in e["devices"]:
                spans.setdefault(device, []).append((e["time"], stops.get(e["pid"], float("inf"))))
    assert set(spans) == {str(i) for i in range(GPUS)}
    for device, lives in spans.items():
        lives.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(lives, lives[1:])), (device, lives)


@pytest.mark.drill("fake-gpu-cluster")
def test_each_gpu_engine_is_built_once_for_the_batch(cluster):
    ready = [e for e in cluster["events"] if e["event"] == "ready"]
    assert sorted(d for e in ready for d in e["devices"]) == [str(i) for i in range(GPUS)]
    # the engines were loaded by the warm-up job while the batch was being prepared: no inference task waited for one
    assert [m for m in cluster["metrics"] if m["engine_load_seconds"] > 0] == []
    assert "engines ready on gpu-0, gpu-1" in cluster["log"]


@pytest.mark.drill("fake-gpu-cluster")
def test_a_partition_is_answered_by_the_engine_of_the_gpus_its_task_held(cluster):
    devices_of = {e["pid"]: e["devices"] for e in cluster["events"] if e["event"] == "ready"}
    for m in cluster["metrics"]:
        assert m["gpus"] and m["engine_slot"] == f"gpu-{m['gpus']}", m
        assert devices_of[m["engine_pid"]] == m["gpus"].split(","), m
    assert {m["gpus"] for m in cluster["metrics"]} == {str(i) for i in range(GPUS)}


@pytest.mark.drill("fake-gpu-cluster")
def test_only_inference_asks_for_gpus_and_two_tasks_feed_each_gpu_s_engine(cluster):
    assert cluster["cpu_tasks_at_once"] > GPUS  # reading, validation, counting: every core
    assert cluster["tasks_per_engine"] == 2
    assert cluster["inference_tasks_at_once"] <= 2 * GPUS  # inference: half a GPU per task
    assert cluster["tasks_at_once_per_gpus"] == {str(i): 2 for i in range(GPUS)}  # each engine fed by two at once


@drill("tensor-parallel-group")
def tensor_parallel_group(ctx) -> dict:
    return run_cluster(ctx, "tensor-parallel", "--requests", "32", "--tensor-parallel-size", "2",
                       "--task-gpu-amount", "2", "--target-tokens-per-partition", "400")


@pytest.mark.drill("tensor-parallel-group")
def test_a_tensor_parallel_group_gets_one_engine_on_all_its_gpus(lane):
    group = lane.result("tensor-parallel-group")
    assert (group["completed"], group["failed"], group["output_lines"]) == (32, 0, 32)
    ready = [e for e in group["events"] if e["event"] == "ready"]
    assert [(e["slot"], e["devices"]) for e in ready] == [("gpu-0,1", ["0", "1"])]
    assert {(m["gpus"], m["engine_pid"]) for m in group["metrics"]} == {("0,1", ready[0]["pid"])}


KILLED_EXECUTOR_REQUESTS = 120


@drill("killed-executor")
def killed_executor(ctx) -> dict:
    return run_cluster(ctx, "killed-executor", "--requests", str(KILLED_EXECUTOR_REQUESTS), "--gpus", "0",
                       "--executors", "2", "--cores", "1", "--kill-executor",
                       "--engine-standin", STANDIN_L4)


@pytest.mark.drill("killed-executor")
def test_an_executor_killed_mid_wave_loses_nothing(lane):
    """Two executors without GPUs; one executor's JVM is killed (SIGKILL) as an engine call holding the middle
    request starts. Spark reruns its tasks on the other executor; the batch finishes with every line exactly once.
    The engine stand-in answers (an L4's rates): the drill is about Spark's retry and the partition's journal."""
    requests = KILLED_EXECUTOR_REQUESTS
    got = lane.result("killed-executor")
    assert got["executor_killed"] and "Lost executor" in got["log"]
    assert (got["completed"], got["failed"], got["output_lines"]) == (requests, 0, requests)
    assert sum(m["rows"] for m in got["metrics"]) == requests
    assert sorted(m["partition"] for m in got["metrics"]) == list(range(got["partitions"]))
    # the killed task's engine call was on record: its retry ran the partition isolating, and set nothing aside
    assert sum(m["engine_deaths"] for m in got["metrics"]) == 1


BAD_GPU_REQUESTS = 120


@drill("bad-gpu")
def bad_gpu(ctx) -> dict:
    return run_cluster(ctx, "bad-gpu", "--requests", str(BAD_GPU_REQUESTS), "--bad-gpu", "1",
                       "--engine-standin", "free")


@pytest.mark.drill("bad-gpu")
def test_a_gpu_whose_engine_cannot_start_hands_its_tasks_to_the_other_gpu(lane):
    """Every engine start on fake GPU 1 fails (fail_engine_start_on_gpu, as an ECC error would): the tasks Spark
    gives GPU 1 feed GPU 0's engine instead, and the batch completes with every line once (before, each such task
    failed, and Spark's retries, offered GPU 1 again first, failed the batch). The engine stand-in answers: the
    drill is about placement."""
    requests = BAD_GPU_REQUESTS
    got = lane.result("bad-gpu")
    assert (got["completed"], got["failed"], got["output_lines"]) == (requests, 0, requests)
    assert sum(m["rows"] for m in got["metrics"]) == requests
    assert {e["slot"] for e in got["events"] if e["event"] == "ready"} == {"gpu-0"}
    # GPU 1's engine was tried by at most the tasks that asked for it at once, then never again in the run
    tried = [e for e in got["events"] if e["event"] == "start" and e["slot"] == "gpu-1"]
    assert 1 <= len(tried) <= got["tasks_per_engine"]
    assert {m["engine_slot"] for m in got["metrics"]} == {"gpu-0"}
    assert "1" in {m["gpus"] for m in got["metrics"]}  # tasks that held GPU 1, answered by GPU 0's engine
