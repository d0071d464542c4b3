#!/usr/bin/env python
"""Where a spark_llm run spends its time: every Spark job it runs, by stage and call site, the driver's own time
by function, and the inference tasks' time inside and outside the engine.

Runs one batch on a local session with Spark's event log on and the driver under cProfile, then reads the event log
(job start/end, stage and task times), the cProfile dump and the batch's metrics table. Prints:

- the run's stages (the Spark job descriptions spark_llm sets) with their wall time and job count;
- every Spark action by call site (how many jobs it started and their time);
- the driver's slowest spark_llm functions (cumulative);
- the inference partitions: task time, engine time, the time around the engine call, engine-load waits.

    python scripts/profile_run.py --requests 20000 --slots 2            # tiny model built on the fly
    python scripts/profile_run.py --requests 2000 --slots 1 --keep      # keep the work dir (event log, .prof)
    python scripts/profile_run.py --master 'local[4]' --slots 2         # two engines, each fed by two tasks
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import glob
import json
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import write_requests  # noqa: E402  (the same requests)


def spark_jobs(event_log: Path) -> list[dict]:
    """One record per Spark job of the event log: start, end, description, call site, tasks."""
    jobs: dict[int, dict] = {}
    stage_job: dict[int, int] = {}
    for line in event_log.read_text().splitlines():
        e = json.loads(line)
        kind = e["Event"]
        if kind == "SparkListenerJobStart":
            props = e.get("Properties") or {}
            jobs[e["Job ID"]] = {"start": e["Submission Time"] / 1000, "end": None, "tasks": 0,
                                 "description": props.get("spark.job.description") or "",
                                 "site": props.get("callSite.short") or ""}
            for s in e["Stage Infos"]:
                stage_job[s["Stage ID"]] = e["Job ID"]
        elif kind == "SparkListenerJobEnd":
            jobs[e["Job ID"]]["end"] = e["Completion Time"] / 1000
        elif kind == "SparkListenerStageCompleted":
            info = e["Stage Info"]
            job = stage_job.get(info["Stage ID"])
            if job is not None and "Submission Time" in info:
                jobs[job]["tasks"] += info["Number of Tasks"]
    return [j for _, j in sorted(jobs.items()) if j["end"] is not None]


def idle_lines(metrics: list[dict]) -> list[str]:
    """Per engine: its partitions, busy seconds (the union of its partitions' spans in it: two tasks feed it at
    once), and where its idle time in the inference stage went (before its first partition, between partitions,
    after its last one while another engine still ran)."""
    from spark_llm.metrics import merged_spans

    start = min(m["started_at"] for m in metrics).timestamp()
    end = max(m["finished_at"] for m in metrics).timestamp()
    by_engine: dict[str, list[dict]] = collections.defaultdict(list)
    for m in metrics:
        by_engine[str(m.get("engine_slot"))].append(m)
    lines = [f"inference stage {end - start:.1f}s"]
    for slot, ms in sorted(by_engine.items()):
        spans = merged_spans([(m["engine_started_at"].timestamp(), m["engine_finished_at"].timestamp()) for m in ms])
        between = sum(b[0] - a[1] for a, b in zip(spans, spans[1:]))
        busy = sum(e - s for s, e in spans)
        lines.append(f"engine {slot}: {len(ms)} partitions, busy {busy:.1f}s, idle before the first "
                     f"{spans[0][0] - start:.1f}s, between partitions {between:.1f}s, after the last "
                     f"{end - spans[-1][1]:.1f}s")
    return lines


def stage_of(description: str, batch_id: str) -> str:
    """The stage a job belongs to: spark_llm's description after the batch id (Delta's own jobs prefix it)."""
    marker = f"spark_llm {batch_id}"
    if marker not in description:
        return "(no stage: session, table creation, background work)"
    rest = description.split(marker, 1)[1].lstrip(": ")
    return (rest.split(" - ")[0] or "(the run)").strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--mix", choices=["short", "gen"], default="short")
    p.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--slots", type=int, default=2, help="engines")
    p.add_argument("--tasks-per-engine", type=int, default=2,
                   help="inference tasks feeding each engine at once (as many as the master's task threads allow)")
    p.add_argument("--dtype", default="bfloat16",
                   help="bfloat16, or float32 on a CPU without native bf16 (AVX2 only), where bf16 runs ~5x slower")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (OMP_NUM_THREADS; vLLM's default: 1)")
    p.add_argument("--target-tokens-per-partition", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="skip torch.compile (as the CPU benchmarks do; on GPUs --no-enforce-eager)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="profile_run."))
    model = args.model
    if model is None:
        from make_tiny_model import build_model

        model = str(build_model(work / "tiny-llm"))
    input_path = work / "requests.jsonl"
    write_requests(input_path, args.requests, Path(model).name, args.max_tokens, args.mix)
    events = work / "events"
    events.mkdir()

    from spark_llm import BatchConfig, run_batch
    from spark_llm.session import get_session

    threads = args.threads  # torch threads per engine, as vLLM serves by default
    t0 = time.monotonic()
    spark = get_session(args.master, {"spark.ui.enabled": "false", "spark.eventLog.enabled": "true",
                                      "spark.eventLog.dir": str(events), "spark.eventLog.compress": "false",
                                      "spark.eventLog.rolling.enabled": "false",
                                      "spark.executorEnv.OMP_NUM_THREADS": str(threads)})
    session_s = time.monotonic() - t0
    cfg = BatchConfig(input=str(input_path), output_dir=str(work / "out"), model=model, batch_id="profile",
                      num_task_slots=args.slots, default_max_tokens=args.max_tokens, max_model_len=2048,
                      max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, dtype=args.dtype,
                      tasks_per_engine=args.tasks_per_engine,
                      **({"target_tokens_per_partition": args.target_tokens_per_partition}
                         if args.target_tokens_per_partition else {}))
    profile = cProfile.Profile()
    t1 = time.monotonic()
    profile.enable()
    result = run_batch(spark, cfg)
    profile.disable()
    run_s = time.monotonic() - t1
    metrics = [r.asDict() for r in spark.read.format("delta").load(result.batch.metadata["metrics_table"]).collect()]
    spark.stop()
    profile.dump_stats(str(work / "driver.prof"))
    [log] = [Path(f) for f in glob.glob(str(events / "*")) if not Path(f).name.startswith("appstatus")]

    jobs = spark_jobs(log)
    print(f"requests={args.requests} engines={args.slots} master={args.master} "
          f"tasks_per_engine={result.batch.partition_plan.task_slots // result.batch.partition_plan.engines} "
          f"dtype={args.dtype} session={session_s:.1f}s run={run_s:.1f}s "
          f"spark_jobs={len(jobs)} completed={result.completed} failed={result.failed} work={work}")
    print("\nstages (wall from their first job's start to their last job's end; stages overlap)")
    stages: dict[str, list] = collections.OrderedDict()
    for j in jobs:
        stages.setdefault(stage_of(j["description"], "profile"), []).append(j)
    for name, js in stages.items():
        wall = max(j["end"] for j in js) - min(j["start"] for j in js)
        print(f"  {name:<55} {wall:7.1f}s  {len(js):4d} jobs  {sum(j['tasks'] for j in js):5d} tasks")
    print("\nSpark actions by call site (jobs, seconds inside them)")
    sites: dict[str, list] = collections.defaultdict(list)
    for j in jobs:
        sites[j["site"].replace(str(ROOT) + "/", "") or "(Delta or Spark internal)"].append(j["end"] - j["start"])
    for site, times in sorted(sites.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(times):4d} jobs {sum(times):7.1f}s  {site}")
    print("\ndriver: slowest spark_llm functions (cumulative seconds)")
    stats = pstats.Stats(str(work / "driver.prof"))
    rows = [(v[3], f"{Path(k[0]).name}:{k[2]}") for k, v in stats.stats.items() if "/spark_llm/" in k[0]]
    for cum, name in sorted(rows, reverse=True)[:20]:
        print(f"  {cum:7.1f}s  {name}")
    print("\ninference partitions")
    task_s = sum((m["finished_at"] - m["started_at"]).total_seconds() for m in metrics)
    engine_s = sum(m["engine_seconds"] for m in metrics)
    wait_s = sum(m["engine_load_seconds"] for m in metrics)
    print(f"  partitions={len(metrics)} task_seconds={task_s:.1f} engine_seconds={engine_s:.1f} "
          f"engine_load_wait_seconds={wait_s:.1f} around_the_engine_seconds={task_s - engine_s - wait_s:.1f}")
    print(f"  busy_fraction={getattr(result.batch.partition_plan, 'busy_fraction', None)}")
    for line in idle_lines(metrics):
        print(f"  {line}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
