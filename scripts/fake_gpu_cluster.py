#!/usr/bin/env python
"""Run a batch on a Spark ``local-cluster`` whose executors report fake GPUs, and print what the engines did.

A drill for GPU scheduling on a machine without GPUs (the tests run it; it also shows the settings a real cluster
needs): one executor with ``--gpus`` fake GPU addresses (a discovery script that lists them), no
``spark.task.resource.gpu.amount`` (spark_llm asks for GPUs on the inference stage only: half a GPU per task, two
tasks feeding each engine), vLLM on the CPU. Prints one JSON object: the batch's counts, the per-partition metrics
(GPU addresses held, engine slot and process), the engine processes' own records (``events.jsonl``), how many tasks
a CPU-only stage ran at once and how many inference tasks held each GPU at once.

    python scripts/fake_gpu_cluster.py --model .cache/tiny-llm --requests 240 --gpus 2 --out /tmp/fake-gpu

Also a drill for a lost executor: ``--gpus 0 --executors 2 --kill-executor`` kills one executor's JVM as an engine
call holding the middle request starts (``kill_executor_once``, spark_llm.faults); the batch must still finish with
every line exactly once.

And a drill for a bad GPU: ``--bad-gpu 1`` makes every engine start on GPU 1 fail (``fail_engine_start_on_gpu``);
the tasks Spark gives GPU 1 feed GPU 0's engine instead and the batch completes. ``--engine-standin free`` runs the
engine stand-in instead of vLLM (no model load: the drill is about placement, not answers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def discovery_script(directory: Path, gpus: int) -> Path:
    script = directory / "fake_gpus.sh"
    addresses = ", ".join(f'"{i}"' for i in range(gpus))
    script.write_text(f"#!/usr/bin/env bash\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
    script.chmod(0o755)
    return script


def write_requests(path: Path, requests: int, model: str) -> None:
    """``requests`` short chat lines (custom_ids r0, r1, ...) for ``model``."""
    with open(path, "w") as f:
        for i in range(requests):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "max_tokens": 2, "temperature": 0,
                                         "messages": [{"role": "user", "content": f"question {i}"}]}}) + "\n")


def concurrency(spans: list[tuple[float, float]]) -> int:
    """Most spans open at one moment."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def cpu_stage_concurrency(spark, tasks: int) -> int:
    """A stage without a ResourceProfile: how many of its tasks ran at once."""
    import pandas as pd

    def sleepy(batches):
        start = time.time()
        for _ in batches:
            pass
        time.sleep(2.0)
        yield pd.DataFrame({"start": [start], "end": [time.time()]})

    rows = spark.range(0, tasks, 1, tasks).mapInPandas(sleepy, "start double, end double").collect()
    return concurrency([(r["start"], r["end"]) for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="work directory (input, results, engine directory)")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--gpus", type=int, default=2, help="fake GPUs of each executor (0: no GPU scheduling)")
    p.add_argument("--executors", type=int, default=1)
    p.add_argument("--cores", type=int, default=4, help="cores of each executor")
    p.add_argument("--kill-executor", action="store_true",
                   help="kill one executor's JVM as an engine call holding the middle request starts")
    p.add_argument("--bad-gpu", default=None, help="a GPU address whose engine cannot start")
    p.add_argument("--engine-standin", default=None, help="the engine stand-in's rates (engine_standin) instead "
                   "of vLLM")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--task-gpu-amount", type=int, default=None,
                   help="set spark.task.resource.gpu.amount for every stage (default: unset, so that spark_llm asks "
                        "for GPUs on the inference stage only)")
    p.add_argument("--target-tokens-per-partition", type=int, default=None,
                   help="default: about 8 partitions per engine")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import pyspark

    from spark_llm import BatchConfig, run_batch
    from spark_llm.engine_host import ENGINE_DIR_ENV, read_events
    from spark_llm.engine_host.placement import cluster_capacity
    from spark_llm.faults import FAULT_ENV
    from spark_llm.session import get_session

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engines = out / "engines"
    engines.mkdir(exist_ok=True)
    os.environ[ENGINE_DIR_ENV] = str(engines)
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))  # local-cluster launches executors
    # whose Python workers run this interpreter (PySpark reads it from the driver's environment, not its settings)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    script = discovery_script(out, args.gpus)
    write_requests(out / "in.jsonl", args.requests, Path(args.model).name)
    conf = {
        "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
        f"spark.executorEnv.{ENGINE_DIR_ENV}": str(engines),
        "spark.task.maxFailures": "8",
    }
    if args.gpus:
        conf.update({"spark.worker.resource.gpu.amount": str(args.gpus),
                     "spark.worker.resource.gpu.discoveryScript": str(script),
                     "spark.executor.resource.gpu.amount": str(args.gpus),
                     "spark.executor.resource.gpu.discoveryScript": str(script)})
    faults = []
    if args.kill_executor:
        faults.append(f"kill_executor_once:{out / 'executor-killed'}:r{args.requests // 2}")
    if args.bad_gpu is not None:
        faults.append(f"fail_engine_start_on_gpu:{args.bad_gpu}")
    if faults:
        conf[f"spark.executorEnv.{FAULT_ENV}"] = ";".join(faults)
    if args.task_gpu_amount:
        conf["spark.task.resource.gpu.amount"] = str(args.task_gpu_amount)
    if args.tensor_parallel_size > 1:  # the CPU stand-in for a GPU group: one core per tensor-parallel rank
        cpus = os.cpu_count() or 1
        conf["spark.executorEnv.VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(rank % cpus) for rank in range(args.tensor_parallel_size))
    spark = get_session(master=f"local-cluster[{args.executors},{args.cores},2048]", conf=conf)
    try:
        # (with a task GPU amount every stage runs one task per GPU group: nothing to measure)
        cpu_tasks_at_once = None if args.task_gpu_amount else cpu_stage_concurrency(spark, 2 * args.cores)
        slots = (args.gpus // args.tensor_parallel_size or args.cores) * args.executors
        target = args.target_tokens_per_partition or max(1, args.requests * 22 // (8 * slots))
        result = run_batch(spark, BatchConfig(
            input=str(out / "in.jsonl"), output_dir=str(out / "results"), overwrite=True, batch_id="fake-gpu",
            model=args.model, max_model_len=512, max_num_seqs=32, dtype="bfloat16", enforce_eager=True,
            kv_cache_memory_bytes=64 << 20, tensor_parallel_size=args.tensor_parallel_size, num_task_slots=slots,
            target_tokens_per_partition=target, engine_standin=args.engine_standin))
        held = cluster_capacity(spark)  # what the batch service's /metrics reports of the application
        metrics = [r.asDict() for r in spark.read.format("delta").load(result.batch.metadata["metrics_table"])
                   .select("partition", "wave", "rows", "gpus", "engine_slot", "engine_pid", "engine_load_seconds",
                           "engine_deaths", "started_at", "finished_at").collect()]
    finally:
        spark.stop()
    print(json.dumps({
        "completed": result.completed, "failed": result.failed, "total": result.total,
        "output_lines": len(Path(result.output_file).read_text().splitlines()),
        "partitions": result.batch.partition_plan.num_partitions, "cpu_tasks_at_once": cpu_tasks_at_once,
        "executor_killed": (out / "executor-killed").exists(),
        "capacity": {"executors": held.executors, "gpus": held.gpus},
        "tensor_parallel_size": args.tensor_parallel_size,
        "inference_tasks_at_once": concurrency([(m["started_at"].timestamp(), m["finished_at"].timestamp())
                                                for m in metrics]),
        "tasks_at_once_per_gpus": {g: concurrency([(m["started_at"].timestamp(), m["finished_at"].timestamp())
                                                   for m in metrics if m["gpus"] == g])
                                   for g in sorted({m["gpus"] for m in metrics})},
        "tasks_per_engine": result.batch.partition_plan.task_slots // result.batch.partition_plan.engines,
        "metrics": [{k: v for k, v in m.items() if k not in ("started_at", "finished_at")} for m in metrics],
        "events": read_events(engines),
    }, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
