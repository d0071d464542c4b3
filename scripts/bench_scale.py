#!/usr/bin/env python
"""Scaling: the full job at growing request counts; per-request cost and the driver's peak memory.

Runs ``run_batch`` on local Spark for each size (small max_tokens) and prints seconds, seconds per 1k requests, and
the driver's peak RSS (Python driver and the Spark driver JVM). The last line is
``scale_ratio=<per-request cost at the largest size / at the smallest>``: near or below 1 means fixed costs amortise
and nothing grows with the data on the driver.

With ``--hostile-fraction 0.1`` every tenth line is one of the test suite's hostile lines (tests/batch_lines.py: bad
bytes, broken JSON, every envelope and body mistake, duplicates, a 5 MB prompt; the large ones once), and each size
also prints whether every non-blank line ended as exactly one output or error row (``accounted``).

    python scripts/bench_scale.py --sizes 1000,10000,100000 [--hostile-fraction 0.1]

With ``--engine-standin`` the engines are the stand-in (spark_llm/engine_host/standin.py: answers at a GPU's rates,
no vLLM), so the job's own costs show at GPU speed; ``--mix`` generates chat, completions, Responses and embeddings
lines of 5 to 400 words. Each size then also prints the seconds of each stage (read, validate and count tokens;
inference and commits; output files and report) and the engines' busy fraction, and the last lines are
``lines_per_second=``, ``per_core=`` (lines a second per core of the Spark master), ``driver_peak_mb=`` (Python +
JVM driver) and ``busy_fraction=`` of the largest size:

    python scripts/bench_scale.py --sizes 100000,1000000 --mix --hostile-fraction 0.01 --engine-standin free
    python scripts/bench_scale.py --sizes 100000 --mix --engine-standin h200-8b,start_seconds=0 --max-tokens 128
    python scripts/bench_scale.py --sizes 1000000 --mix --hostile-fraction 0.01 --engine-standin free \
        --kill-in-wave 10    # kill -9 mid-batch, then --resume: still every line once
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def killed_run(cfg, master: str, wave_dir: Path) -> None:
    """Run ``cfg`` in a process group of its own and kill the group (``kill -9``) once ``wave_dir`` (a wave's
    staging directory: the wave is under way) exists."""
    import signal
    import subprocess

    code = ("import sys; from spark_llm import BatchConfig; from spark_llm.pipeline import run_batch; "
            "from spark_llm.session import get_session; "
            "run_batch(get_session(master=sys.argv[2], conf={'spark.ui.enabled': 'false'}), "
            "BatchConfig.model_validate_json(sys.argv[1]))")
    proc = subprocess.Popen([sys.executable, "-c", code, cfg.model_dump_json(), master], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not wave_dir.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the run to kill ended (exit {proc.returncode}) before {wave_dir} appeared")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed the first run (kill -9 of its process group) while {wave_dir.name} ran", flush=True)


def _jvm_live_mb(spark) -> float:
    """The driver JVM's heap in use after a full collection: what it holds, not what it grew into."""
    runtime = spark.sparkContext._jvm.java.lang.Runtime.getRuntime()
    spark.sparkContext._jvm.java.lang.System.gc()
    return (runtime.totalMemory() - runtime.freeMemory()) / (1 << 20)


def _make_tiny_model(*args: str) -> None:
    import subprocess

    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), *args], check=True,
                   stdout=subprocess.DEVNULL)


def _jvm_peak_mb(spark) -> float:
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_input(path: Path, requests, hostile_fraction: float) -> int:
    """The requests as JSONL, every ``1/hostile_fraction``-th line replaced by a hostile one; returns the non-blank
    lines written."""
    hostile: list = []
    if hostile_fraction:
        sys.path.insert(0, str(ROOT / "tests"))
        from batch_lines import hostile_cases

        hostile = [line for line, _ in hostile_cases()]
    every = round(1 / hostile_fraction) if hostile_fraction else 0
    big_written, k, nonblank = set(), 0, 0
    with open(path, "wb") as f:
        for i, r in enumerate(requests):
            line = json.dumps(r, ensure_ascii=False).encode()
            if every and i % every == every - 1:
                h = hostile[k % len(hostile)]
                k += 1
                h = h if isinstance(h, bytes) else json.dumps(h, ensure_ascii=False).encode()
                if len(h) > 100_000:  # the 5 MB prompt and the deep nesting: once each
                    if h in big_written:
                        h = b'{"custom_id": "cut", "body": '
                    big_written.add(h)
                line = h
            nonblank += bool(line.strip())
            f.write(line + b"\n")
    return nonblank


def accounted(spark, result, nonblank: int) -> str:
    """Whether every non-blank line ended as exactly one output or error row."""
    from pyspark.sql import functions as F

    both = (spark.read.format("delta").load(result.outputs_table).select("file", "line_number")
            .unionByName(spark.read.format("delta").load(result.errors_table).select("file", "line_number")))
    r = both.agg(F.count(F.lit(1)).alias("rows"), F.countDistinct("file", "line_number").alias("lines")).first()
    return "yes" if r["rows"] == r["lines"] == nonblank else f"NO ({r['rows']} rows, {r['lines']} lines, {nonblank})"


#: The ``--mix`` of endpoints, by share of the lines.
MIX = (("/v1/chat/completions", 0.55), ("/v1/completions", 0.2), ("/v1/responses", 0.15), ("/v1/embeddings", 0.1))


def iter_mixed(n: int, seed: int, model: str, embed_model: str, max_tokens: int):
    """``n`` lines of :data:`MIX`'s endpoints, prompts of 5 to 400 words (most short), one at a time."""
    import random

    from bench_overhead import WORDS

    rng = random.Random(seed)
    urls, weights = zip(*MIX)
    for i in range(n):
        url = rng.choices(urls, weights)[0]
        text = " ".join(rng.choices(WORDS, k=min(400, int(rng.paretovariate(1.2) * 5))))
        if url == "/v1/chat/completions":
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        elif url == "/v1/completions":
            body = {"model": model, "prompt": text, "max_tokens": max_tokens}
        elif url == "/v1/responses":
            body = {"model": model, "input": text, "max_output_tokens": max(max_tokens, 16)}
        else:
            body = {"model": embed_model, "input": text}
        yield {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


class StageClock:
    """A run listener that notes when the run's stages end (see spark_llm.context.RunListener)."""

    def __init__(self) -> None:
        from spark_llm.context import RunListener

        self.t0, self.marks = time.monotonic(), {}
        clock = self

        class Listener(RunListener):
            def validated(self, total: int, invalid: int, answered: int) -> None:
                clock.marks["read, validate, tokens"] = time.monotonic()

            def finalizing(self) -> None:
                clock.marks["inference and commits"] = time.monotonic()
        self.listener = Listener()

    def stages(self, end: float) -> dict[str, float]:
        marks = {**self.marks, "output files and report": end}
        out, before = {}, self.t0
        for name, at in marks.items():
            out[name], before = at - before, at
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default=None)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--target-tokens-per-partition", type=int, default=500_000)
    p.add_argument("--hostile-fraction", type=float, default=0.0)
    p.add_argument("--engine-standin", default=None, help="the engine stand-in's rates (engine_standin), e.g. free "
                   "or h200-8b,start_seconds=0: no vLLM")
    p.add_argument("--mix", action="store_true", help="chat, completions, Responses and embeddings lines")
    p.add_argument("--kill-in-wave", type=int, default=0, help="the largest size first runs in a process of its "
                   "own, killed (SIGKILL, with its Spark JVM) while wave N runs; then it is resumed (--resume) and "
                   "timed and checked as usual")
    args = p.parse_args(argv)
    from spark_llm.engine_host import apply_worker_env
    from spark_llm.session import LOCAL_ENV

    apply_worker_env()  # the raw engine runs in this process; the job's local workers inherit the same
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)

    from bench_overhead import iter_requests
    from spark_llm import BatchConfig
    from spark_llm.pipeline import run_batch
    from spark_llm.session import get_session

    work = Path(tempfile.mkdtemp(prefix="bench_scale."))
    model = args.model
    # the models are built by processes of their own: torch's memory is not the driver's peak
    if model is None:
        model = str(work / "tiny-llm")
        _make_tiny_model("--out", model)
    embed_model = None
    if args.mix:
        embed_model = str(work / "tiny-embed")
        _make_tiny_model("--out", embed_model, "--kind", "embedding", "--base", model)
    spark = get_session(master=args.master, conf={"spark.ui.enabled": "false"})
    cores = spark.sparkContext.defaultParallelism
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        path = work / f"in-{n}.jsonl"
        lines = (iter_mixed(n, n, Path(model).name, "tiny-embed", args.max_tokens) if args.mix
                 else iter_requests(n, n, Path(model).name, args.max_tokens))
        nonblank = write_input(path, lines, args.hostile_fraction)
        extra = [{"name": "tiny-embed", "path": embed_model, "kind": "embed"}] if embed_model else []
        cfg = BatchConfig(input=str(path), output_dir=str(work / f"out-{n}"), model=model, dtype="bfloat16",
                          max_num_seqs=args.max_num_seqs, max_model_len=2048, enforce_eager=True,
                          target_tokens_per_partition=args.target_tokens_per_partition, batch_id=f"scale-{n}",
                          engine_standin=args.engine_standin, models=extra)
        if args.kill_in_wave and n == sizes[-1]:
            killed_run(cfg, args.master, work / f"out-{n}" / "_staging" / f"wave-{args.kill_in_wave}")
            cfg = cfg.model_copy(update={"resume": True})
        clock = StageClock()
        result = run_batch(spark, cfg, clock.listener)
        end = time.monotonic()
        secs = end - clock.t0
        py_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        busy = getattr(result.batch.partition_plan, "busy_fraction", None)
        rows.append((n, secs, result.completed, py_mb, _jvm_peak_mb(spark), accounted(spark, result, nonblank),
                     clock.stages(end), busy, _jvm_live_mb(spark)))
    spark.stop()
    print(f"{'lines':>9}{'seconds':>9}{'s/1k req':>10}{'completed':>11}{'py driver MB':>14}{'JVM driver MB':>15}"
          f"{'JVM live MB':>13}{'busy':>7}  accounted")
    for n, secs, done, py_mb, jvm_mb, ok, _, busy, live_mb in rows:
        print(f"{n:>9}{secs:>9.1f}{secs / n * 1000:>10.2f}{done:>11}{py_mb:>14.0f}{jvm_mb:>15.0f}{live_mb:>13.0f}"
              f"{busy if busy is not None else float('nan'):>7.3f}  {ok}")
    for n, *_, stages, _, _ in rows:
        print(f"stages at {n} lines: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    first, last = rows[0], rows[-1]
    print(f"scale_ratio={(last[1] / last[0]) / (first[1] / first[0]):.3f}")
    print(f"lines_per_second={last[0] / last[1]:.1f}")
    print(f"per_core={last[0] / last[1] / cores:.1f}")
    print(f"driver_peak_mb={last[3] + last[4]:.0f}")
    print(f"busy_fraction={last[7] if last[7] is not None else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
