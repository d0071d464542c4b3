#!/usr/bin/env python
"""Run a batch with ``spark-submit --master spark://...`` on a Spark standalone cluster started on this machine, and
print what happened.

The cluster is the installed pyspark's own: a master and ``--workers`` workers (``spark-class
org.apache.spark.deploy.{master.Master,worker.Worker}``), each worker with ``--cores`` cores, ``--gpus`` fake GPUs
(a discovery script that lists them, as ``scripts/get_gpus_resources.sh`` lists real ones) and an engine directory
of its own, as on separate hosts. The job is submitted as a user would (``jobs/run_batch.py``, Delta's jars, executor
GPUs, no task GPU amount, no ``spark.executor.cores``: a standalone executor takes its worker's cores). With
``--kill-node``, one worker daemon and its executor are killed (SIGKILL) as an engine call holding the middle request
starts (``kill_node_once``, spark_llm.faults). Prints one JSON object: the batch object's counts, the custom_ids of
the output and error files, and each worker's engine records (``events.jsonl``).

    python scripts/standalone_cluster.py --model .cache/tiny-llm --out /tmp/standalone --kill-node

The cluster is stopped at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {seconds:.0f}s")
        time.sleep(0.5)


class Cluster:
    """A standalone master and its workers, each a process group of its own (stopped together)."""

    def __init__(self, out: Path, spark_home: str):
        self.out, self.spark_home, self.procs = out, spark_home, []
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"

    def _daemon(self, name: str, args: list[str], env: dict) -> None:
        log = open(self.out / f"{name}.log", "ab")
        self.procs.append(subprocess.Popen([os.path.join(self.spark_home, "bin", "spark-class"), *args], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self, workers: int, cores: int, gpus: int, script: Path) -> list[Path]:
        # SPARK_LOCAL_IP: the daemons' web UIs bind it (else every interface)
        env = {**os.environ, "SPARK_HOME": self.spark_home, "SPARK_NO_DAEMONIZE": "1", "SPARK_LOCAL_IP": "127.0.0.1"}
        self._daemon("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                                str(self.port), "--webui-port", str(free_port())], env)
        wait_for(lambda: "I have been elected leader" in (self.out / "master.log").read_text(errors="replace"), 120,
                 "the master did not start")
        engine_dirs = []
        for i in range(workers):
            home = self.out / f"worker-{i}"
            (home / "work").mkdir(parents=True, exist_ok=True)
            (home / "engines").mkdir(exist_ok=True)
            conf = home / "worker.conf"
            conf.write_text(f"spark.worker.resource.gpu.amount {gpus}\n"
                            f"spark.worker.resource.gpu.discoveryScript {script}\n")
            # the worker's environment is its executors': each "host" has its own engine directory
            self._daemon(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores",
                                         str(cores), "--memory", "3g", "--work-dir", str(home / "work"),
                                         "--webui-port", str(free_port()), "--properties-file", str(conf), self.url],
                         {**env, "SPARK_LLM_ENGINE_DIR": str(home / "engines")})
            engine_dirs.append(home / "engines")
        wait_for(lambda: (self.out / "master.log").read_text(errors="replace").count("Registering worker") >= workers,
                 120, "the workers did not register")
        return engine_dirs

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def delta_jars() -> list[str]:
    """spark-submit's arguments for Delta: the jars a local session resolved before, else the package."""
    from importlib.metadata import version

    import pyspark

    from spark_llm.session import recorded_delta_jars  # the jars a local session resolved and keeps

    recorded = recorded_delta_jars()
    if recorded:
        return ["--jars", recorded]
    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    return ["--packages", f"io.delta:delta-spark_{spark_minor}_2.13:{version('delta-spark')}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="work directory (cluster logs, input, results, engine directories)")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores", type=int, default=2, help="cores of each worker")
    p.add_argument("--gpus", type=int, default=2, help="fake GPUs of each worker")
    p.add_argument("--kill-node", action="store_true",
                   help="kill one worker daemon and its executor as an engine call holding the middle request starts")
    args = p.parse_args(argv)
    import pyspark

    from scripts.fake_gpu_cluster import discovery_script, write_requests
    from spark_llm.engine_host import read_events
    from spark_llm.faults import FAULT_ENV

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    script = discovery_script(out, args.gpus)
    write_requests(out / "in.jsonl", args.requests, Path(args.model).name)
    spark_home = os.path.dirname(pyspark.__file__)
    cluster = Cluster(out, spark_home)
    try:
        engine_dirs = cluster.start(args.workers, args.cores, args.gpus, script)
        conf = {
            "spark.executor.resource.gpu.amount": str(args.gpus),
            "spark.executor.resource.gpu.discoveryScript": str(script),
            "spark.executor.memory": "1g",
            "spark.task.maxFailures": "8",
            "spark.pyspark.python": sys.executable,
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.executorEnv.VLLM_CPU_KVCACHE_SPACE": "1",
        }
        if args.kill_node:
            conf[f"spark.executorEnv.{FAULT_ENV}"] = f"kill_node_once:{out / 'node-killed'}:r{args.requests // 2}"
        target = max(1, args.requests * 22 // (4 * args.workers * args.gpus))  # about 4 partitions per engine
        cmd = [os.path.join(spark_home, "bin", "spark-submit"), "--master", cluster.url, *delta_jars(),
               *[a for k, v in conf.items() for a in ("--conf", f"{k}={v}")],
               str(ROOT / "jobs" / "run_batch.py"), "--model", args.model, "--input", str(out / "in.jsonl"),
               "--output-dir", str(out / "results"), "--overwrite", "--batch-id", "standalone",
               "--max-model-len", "512", "--max-num-seqs", "32", "--dtype", "bfloat16", "--enforce-eager",
               "--kv-cache-memory-bytes", str(64 << 20), "--target-tokens-per-partition", str(target)]
        env = {**os.environ, "SPARK_HOME": spark_home, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
               "PYSPARK_DRIVER_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
        env.pop("SPARK_LLM_ENGINE_DIR", None)  # the workers' own
        with open(out / "driver.log", "wb") as log:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1500).returncode
    finally:
        cluster.stop()
    ended = engines_ended(engine_dirs)
    results = out / "results"
    batch = json.loads((results / "batch.json").read_text()) if (results / "batch.json").exists() else {}
    lines = {kind: [json.loads(line)["custom_id"] for line in (results / f"{kind}.jsonl").read_text().splitlines()]
             if (results / f"{kind}.jsonl").exists() else [] for kind in ("output", "errors")}
    print(json.dumps({"exit_code": code, "request_counts": batch.get("request_counts"), "status": batch.get("status"),
                      "finalizing_at": batch.get("finalizing_at"), "engines_ended": ended,
                      "output_ids": lines["output"], "error_ids": lines["errors"],
                      "node_killed": (out / "node-killed").exists(),
                      "events": {str(d.parent.name): read_events(d) for d in engine_dirs}}))
    return 0


def engines_ended(engine_dirs: list[Path], timeout: float = 60.0) -> bool:
    """Wait until every engine that started has recorded its stop: each watches its executor (once a second), and
    the application's end takes the surviving executors too. False if one is still running after ``timeout``."""
    from spark_llm.engine_host import read_events

    deadline = time.monotonic() + timeout
    while True:
        events = [e for d in engine_dirs for e in read_events(d)]
        if {e["pid"] for e in events if e["event"] == "start"} <= {e["pid"] for e in events if e["event"] == "stop"}:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
