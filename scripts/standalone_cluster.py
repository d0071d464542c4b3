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

With ``--dynamic``, the cluster is elastic: dynamic allocation from no executor, executors without GPUs for reading
and validation, and GPU executors that the inference stage asks for (``--gpus-per-executor``); the driver program
(this script, :func:`drive`) runs the batch, then stays until Spark has removed the idle GPU executors and their
engines have ended, sampling the executor count (``executors``, and the seconds from the submit to the first
executor, to the batch's end and to every engine ended: ``first_executor_s``, ``completed_s``, ``released_s``).

    python scripts/standalone_cluster.py --model .cache/tiny-llm --out /tmp/elastic --dynamic

With ``--service``, the batch service runs on the elastic cluster (``spark-submit ... jobs/serve.py``, dynamic
allocation from no executor) and this script is its client: a burst of ``--batches`` batches created at once on the
idle service, each batch's lines checked once in its files, and the service's own ``/metrics`` sampled twice a
second (``spark_llm_executors``, ``spark_llm_executor_gpus``): the seconds from the first create to the first
executor, to every batch completed, and to no GPU held (``first_executor_s``, ``completed_s``, ``released_s``).
``--kill-node`` kills a worker in the middle of the burst, once the service holds every worker's GPUs (the
engine call holding the middle request waits for it).

    python scripts/standalone_cluster.py --model .cache/tiny-llm --out /tmp/service --service

The cluster is stopped at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

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


#: The jars S3A brings to a local session (session.s3a_package and what it depends on), by name.
S3A_JARS = ("hadoop-aws", "awssdk", "analyticsaccelerator", "wildfly-openssl")


def delta_jars() -> list[str]:
    """spark-submit's arguments for Delta: the jars a local session resolved before, else the package."""
    from importlib.metadata import version

    import pyspark

    from spark_llm.session import recorded_delta_jars  # the jars a local session resolved and keeps

    # a local session resolved Delta's with S3A's: each executor would fetch S3A's 690 MB AWS SDK from the driver
    recorded = ",".join(j for j in (recorded_delta_jars(s3a=True) or "").split(",")
                        if j and not any(s in j for s in S3A_JARS))
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
    p.add_argument("--dynamic", action="store_true",
                   help="dynamic allocation: no executor at the start, GPU executors added for inference and "
                   "removed when idle while the application still runs")
    p.add_argument("--service", action="store_true",
                   help="the batch service on the elastic cluster (jobs/serve.py), driven from here: a burst of "
                   "--batches batches of --requests lines each on the idle service")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--max-running-batches", type=int, default=1, help="the service's batches run at once")
    p.add_argument("--engine-standin", default=None, help="the engine stand-in's rates (engine_standin) instead "
                   "of vLLM: the same engine servers, placement and faults, without vLLM's start and CPU")
    args = p.parse_args(argv)
    args.dynamic = args.dynamic or args.service
    import pyspark

    from scripts.fake_gpu_cluster import discovery_script, write_requests
    from spark_llm.engine_host import read_events
    from spark_llm.faults import FAULT_ENV
    from spark_llm.service.capacity import RELEASE_SETTINGS

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    script = discovery_script(out, args.gpus)
    write_requests(out / "in.jsonl", args.requests, Path(args.model).name)
    spark_home = os.path.dirname(pyspark.__file__)
    cluster = Cluster(out, spark_home)
    try:
        # elastic: a worker holds a reading executor and a GPU executor at once (2 cores each); the service's
        # workers have room for a GPU executor beside all the reading ones (maxExecutors: one per worker), as a
        # wave's tasks need the shuffle files the reading executors hold: Spark removes none of those while a wave
        # waits, and a GPU executor lost with its node must find cores on another
        per_worker = (args.workers + 1 if args.service else 2) if args.dynamic else 1
        engine_dirs = cluster.start(args.workers, per_worker * args.cores, args.gpus, script)
        conf = {
            "spark.executor.memory": "1g",
            "spark.task.maxFailures": "8",
            "spark.pyspark.python": sys.executable,
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.executorEnv.VLLM_CPU_KVCACHE_SPACE": "1",
        }
        gpu_settings: list[str] = []
        if args.dynamic:
            conf.update(ELASTIC, **{"spark.executor.cores": str(args.cores),
                                    "spark.dynamicAllocation.maxExecutors": str(args.workers)})
            gpu_settings = ["--gpus-per-executor", str(args.gpus)]
            if args.service:  # a server's session lives on: its reading executors go once idle (capacity.py)
                conf.update(dict.fromkeys(RELEASE_SETTINGS, "60s"))
        else:
            conf.update({"spark.executor.resource.gpu.amount": str(args.gpus),
                         "spark.executor.resource.gpu.discoveryScript": str(script)})
        if args.kill_node:
            middle = f"r{args.requests // 2}"
            faults = [f"kill_node_once:{out / 'node-killed'}:{middle}"]
            if args.service:  # the kill waits until the service holds every worker's GPUs (burst: KILL_RELEASE)
                faults.insert(0, f"hold_inference_until:{out / KILL_RELEASE}:{middle}")
            conf[f"spark.executorEnv.{FAULT_ENV}"] = ";".join(faults)
        target = max(1, args.requests * 22 // (4 * args.workers * args.gpus))  # about 4 partitions per engine
        engine = ["--model", args.model, "--max-model-len", "512", "--max-num-seqs", "32", "--dtype", "bfloat16",
                  "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--target-tokens-per-partition",
                  str(target), *gpu_settings,
                  *(["--engine-standin", args.engine_standin] if args.engine_standin else [])]
        if args.service:
            (out / "keys.txt").write_text(f"{SERVICE_KEY}\n")
            program = [str(ROOT / "jobs" / "serve.py"), "--storage", str(out / "service"), "--host", "127.0.0.1",
                       "--port", "0", "--api-keys", str(out / "keys.txt"), "--max-running-batches",
                       str(args.max_running_batches), *engine]
        elif args.dynamic:
            program = [str(Path(__file__).resolve()), "--drive", str(out / "executors.jsonl"),
                       *[a for d in engine_dirs for a in ("--engine-dir", str(d))], *engine, *batch_files(out)]
        else:
            program = [str(ROOT / "jobs" / "run_batch.py"), *engine, *batch_files(out)]
        cmd = [os.path.join(spark_home, "bin", "spark-submit"), "--master", cluster.url, *delta_jars(),
               *[a for k, v in conf.items() for a in ("--conf", f"{k}={v}")], *program]
        submitted = time.time()
        env = {**os.environ, "SPARK_HOME": spark_home, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
               "PYSPARK_DRIVER_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
        env.pop("SPARK_LLM_ENGINE_DIR", None)  # the workers' own
        with open(out / "driver.log", "wb") as log:
            if args.service:
                server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    got = burst(out, server, engine_dirs, args.batches, args.requests, Path(args.model).name,
                                every_gpu=args.workers * args.gpus)
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(server.pid, signal.SIGTERM)  # the service's clean stop
                    try:
                        server.wait(60)
                    except subprocess.TimeoutExpired:
                        os.killpg(server.pid, signal.SIGKILL)
                        server.wait()
                code = server.returncode
            else:
                code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1500).returncode
    finally:
        cluster.stop()
    if args.service:
        got.update(exit_code=code, node_killed=(out / "node-killed").exists(),
                   events={str(d.parent.name): read_events(d) for d in engine_dirs})
        print(json.dumps(got))
        return 0
    ended = engines_ended(engine_dirs)
    results = out / "results"
    batch = json.loads((results / "batch.json").read_text()) if (results / "batch.json").exists() else {}
    lines = {kind: [json.loads(line)["custom_id"] for line in (results / f"{kind}.jsonl").read_text().splitlines()]
             if (results / f"{kind}.jsonl").exists() else [] for kind in ("output", "errors")}
    got = {"exit_code": code, "request_counts": batch.get("request_counts"), "status": batch.get("status"),
           "finalizing_at": batch.get("finalizing_at"), "engines_ended": ended,
           "output_ids": lines["output"], "error_ids": lines["errors"],
           "node_killed": (out / "node-killed").exists(),
           "events": {str(d.parent.name): read_events(d) for d in engine_dirs}}
    if args.dynamic:
        got.update(elastic_timeline(out / "executors.jsonl", submitted))
    print(json.dumps(got))
    return 0


#: The service drill's API key.
SERVICE_KEY = "sk-standalone-drill"
#: The file that lets the service drill's node kill go (a ``hold_inference_until`` release, spark_llm.faults): made
#: once the service holds every worker's GPUs, so that the drill asserts a scale-out it waited for. Killed any
#: earlier, the first GPU executor can die before the second one registers, and the service never holds both.
KILL_RELEASE = "kill-go"
#: How long the held kill waits for every GPU at the most; then it goes, and the drill's figures show the shortfall.
KILL_HOLD_SECONDS = 300.0


def batch_files(out: Path) -> list[str]:
    """The batch job's input and results (the job drills)."""
    return ["--input", str(out / "in.jsonl"), "--output-dir", str(out / "results"), "--overwrite", "--batch-id",
            "standalone"]


def burst(out: Path, server: subprocess.Popen, engine_dirs: list[Path], batches: int, requests: int,
          model: str, every_gpu: int) -> dict:
    """The service drill's client: once the service answers, ``batches`` batches of ``requests`` lines created at
    once, each waited for; then until the service holds no GPU and every engine has ended. ``/metrics`` is sampled
    twice a second all along. A node kill held at its engine call (``KILL_RELEASE``) is let go once a sample shows
    ``every_gpu`` GPUs held."""
    import threading

    import httpx
    import openai

    from scripts.fake_gpu_cluster import write_requests

    log = out / "driver.log"
    port = None
    deadline = time.monotonic() + 300
    while port is None and time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the service ended before it answered:\n" + log.read_text(errors="replace")[-3000:])
        found = re.search(r"spark-llm serve: http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        port = int(found.group(1)) if found else None
        time.sleep(0.5)
    if port is None:
        raise TimeoutError("the service did not say where it listens within 300 s")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=SERVICE_KEY, max_retries=2, timeout=60)
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10,
                                 headers={"Authorization": f"Bearer {SERVICE_KEY}"}).text
            except httpx.HTTPError:
                continue
            held = {name: float(m.group(1)) for name in ("spark_llm_executors", "spark_llm_executor_gpus")
                    if (m := re.search(rf"^{name} ([0-9.]+)$", text, re.M))}
            if len(held) == 2:
                samples.append({"time": time.time(), "executors": int(held["spark_llm_executors"]),
                                "gpus": int(held["spark_llm_executor_gpus"])})
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    wait_for(lambda: len(samples) >= 2, 120, "the service's /metrics")
    sources = []
    for n in range(batches):
        write_requests(out / f"batch-{n}.jsonl", requests, model)
        sources.append(client.files.create(file=(f"batch-{n}.jsonl", (out / f"batch-{n}.jsonl").read_bytes()),
                                           purpose="batch"))
    created = time.time()
    ids = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
           for f in sources]
    final = ("completed", "failed", "expired", "cancelled")
    done: dict = {}
    deadline = time.monotonic() + 1200
    release, held = out / KILL_RELEASE, out / f"{KILL_RELEASE}.held"
    while len(done) < len(ids) and time.monotonic() < deadline:
        if held.exists() and not release.exists() and (
                any(s["gpus"] >= every_gpu for s in samples)
                or time.time() - held.stat().st_mtime > KILL_HOLD_SECONDS):
            release.touch()
        for batch_id in ids:
            if batch_id not in done and (batch := client.batches.retrieve(batch_id)).status in final:
                done[batch_id] = (batch, time.time())
        time.sleep(1.0)
    completed = max((t for _, t in done.values()), default=None)
    released = None
    if len(done) == len(ids):
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: samples[-1]["gpus"] == 0 and samples[-1]["time"] > completed, 180, "no GPU held")
            released = samples[-1]["time"]
    ended = engines_ended(engine_dirs, timeout=60) if released else False
    stop.set()
    sampler.join()

    def custom_ids(file_id: Optional[str]) -> list[str]:
        return [json.loads(line)["custom_id"] for line in client.files.content(file_id).text.splitlines()] \
            if file_id else []
    since = lambda t: round(t - created, 1) if t is not None else None  # noqa: E731
    first = next((s["time"] for s in samples if s["time"] >= created and s["executors"] > 0), None)
    return {"batches": [{"status": b.status, "output_ids": custom_ids(b.output_file_id),
                         "error_ids": custom_ids(b.error_file_id)} for b, _ in done.values()],
            "executors": [s["executors"] for s in samples], "gpus": [s["gpus"] for s in samples],
            "idle_before": [s["executors"] for s in samples if s["time"] < created],
            "first_executor_s": since(first), "completed_s": since(completed), "released_s": since(released),
            "engines_ended_in_app": ended, "app_ending_at": time.time()}


#: Dynamic allocation as the elastic drill runs it: from no executor, idle executors removed after 5 s (Spark's
#: default is 60 s), shuffle files tracked on the executors instead of an external shuffle service.
ELASTIC = {
    "spark.dynamicAllocation.enabled": "true",
    "spark.dynamicAllocation.shuffleTracking.enabled": "true",
    "spark.dynamicAllocation.minExecutors": "0",
    "spark.dynamicAllocation.initialExecutors": "0",
    "spark.dynamicAllocation.executorIdleTimeout": "5s",
}


def drive(record: Path, engine_dirs: list[Path], run_args: list[str]) -> int:
    """spark-submit's program in the elastic drill: the batch (``run_args``, as jobs/run_batch.py takes them), then
    the application stays until Spark has removed the idle GPU executors and their engines have ended; the executor
    count is sampled twice a second into ``record`` (JSON lines: time, executors; the batch's end, ``done``; the
    engines' end, ``engines_ended``)."""
    import threading

    from pyspark import SparkContext

    from spark_llm.cli import add_run_arguments, run_from_args

    stop = threading.Event()
    count = {"executors": -1}

    def note(**fields) -> None:
        with open(record, "a") as f:
            f.write(json.dumps({"time": time.time(), **fields}) + "\n")

    def sample() -> None:
        from pyspark.sql import SparkSession

        from spark_llm.engine_host.placement import cluster_capacity

        while not stop.wait(0.5):
            sc = SparkContext._active_spark_context  # set once the context has started
            if getattr(sc, "_jsc", None) is not None:
                held = cluster_capacity(SparkSession(sc))  # what the batch service's /metrics reports
                count["executors"] = held.executors
                note(executors=held.executors, gpus=held.gpus)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    parser = argparse.ArgumentParser(prog="standalone_cluster.py --drive")
    add_run_arguments(parser)
    code = run_from_args(parser.parse_args(run_args))
    sc = SparkContext._active_spark_context
    note(done=code, cached=[str(i.name()) for i in sc._jsc.sc().getRDDStorageInfo()])
    # the GPU executors go after spark.dynamicAllocation.executorIdleTimeout, and their engines with them; the
    # reading executors hold Delta's cached table states (cachedExecutorIdleTimeout: unbounded by default)
    ended = engines_ended(engine_dirs, timeout=120)
    time.sleep(1)  # a sample of the executors after the last engine's end
    note(engines_ended=ended, executors_left=count["executors"])
    stop.set()
    sampler.join()
    return code


def elastic_timeline(record: Path, submitted: float) -> dict:
    """What :func:`drive` recorded: the executor counts sampled, what stayed cached, and the seconds from the submit
    to the first executor, to the batch's end and to the GPU executors' engines all ended (None where it did not
    happen)."""
    notes = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    counts = [n for n in notes if "executors" in n]
    done = next((n for n in notes if "done" in n), {})
    end = next((n for n in notes if "engines_ended" in n), {})
    first = next((n["time"] for n in counts if n["executors"] > 0), None)
    since = lambda t: round(t - submitted, 1) if t is not None else None  # noqa: E731
    return {"executors": [n["executors"] for n in counts], "gpus": [n.get("gpus", 0) for n in counts],
            "cached": done.get("cached"),
            "first_executor_s": since(first), "completed_s": since(done.get("time")),
            "released_s": since(end.get("time")) if end.get("engines_ended") else None,
            "engines_ended_in_app": bool(end.get("engines_ended")), "executors_left": end.get("executors_left"),
            "app_ending_at": end.get("time")}


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
    if len(sys.argv) > 1 and sys.argv[1] == "--drive":  # spark-submit's program in the elastic drill
        driver = argparse.ArgumentParser(allow_abbrev=False)
        driver.add_argument("--drive", type=Path)
        driver.add_argument("--engine-dir", type=Path, action="append", default=[])
        known, rest = driver.parse_known_args()
        sys.exit(drive(known.drive, known.engine_dir, rest))
    sys.exit(main())
