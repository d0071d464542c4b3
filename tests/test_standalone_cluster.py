"""The path a user takes when one machine is not enough: ``spark-submit --master spark://...`` on a real Spark
standalone cluster (the installed pyspark's own master and two workers, on this machine, each worker with two fake
GPUs and an engine directory of its own, as separate hosts would have), one worker killed mid-wave
(scripts/standalone_cluster.py). Asserted from the batch's files and the engines' own records."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.engine

REQUESTS, GPUS = 240, 2


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("standalone")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "standalone_cluster.py"), "--model", tiny_model,
                           "--out", str(out), "--requests", str(REQUESTS), "--gpus", str(GPUS), "--kill-node"],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["driver_log"] = (out / "driver.log").read_text(errors="replace")
    return got


def test_every_line_exactly_once_though_a_worker_died_mid_wave(cluster):
    assert cluster["node_killed"] and "Lost executor" in cluster["driver_log"], cluster["driver_log"][-3000:]
    assert cluster["exit_code"] == 0 and cluster["status"] == "completed", cluster["driver_log"][-3000:]
    assert cluster["request_counts"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}
    assert sorted(cluster["output_ids"]) == sorted(f"r{i}" for i in range(REQUESTS)) and cluster["error_ids"] == []


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
