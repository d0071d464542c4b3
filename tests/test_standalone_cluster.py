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


def test_the_killed_worker_s_engines_ended_with_it(cluster):
    """Its engines watch their executor: with it gone they stop (the GPUs are not held for a dead application)."""
    ended = [w for w, events in cluster["events"].items()
             if any(e["event"] == "stop" and e["reason"].startswith("executor gone") for e in events)]
    assert len(ended) == 1, cluster["events"]
