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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default=None)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--target-tokens-per-partition", type=int, default=500_000)
    p.add_argument("--hostile-fraction", type=float, default=0.0)
    args = p.parse_args(argv)
    from spark_llm.engine_host import apply_worker_env
    from spark_llm.session import LOCAL_ENV

    apply_worker_env()  # the raw engine runs in this process; the job's local workers inherit the same
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)

    from bench_overhead import iter_requests
    from spark_llm import BatchConfig, run_batch
    from spark_llm.session import get_session

    work = Path(tempfile.mkdtemp(prefix="bench_scale."))
    model = args.model
    if model is None:
        from make_tiny_model import build_model

        model = str(build_model(work / "tiny-llm"))
    spark = get_session(master=args.master, conf={"spark.ui.enabled": "false"})
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        path = work / f"in-{n}.jsonl"
        nonblank = write_input(path, iter_requests(n, n, Path(model).name, args.max_tokens), args.hostile_fraction)
        cfg = BatchConfig(input=str(path), output_dir=str(work / f"out-{n}"), model=model, dtype="bfloat16",
                          max_num_seqs=args.max_num_seqs, max_model_len=2048, enforce_eager=True,
                          target_tokens_per_partition=args.target_tokens_per_partition, batch_id=f"scale-{n}")
        t0 = time.monotonic()
        result = run_batch(spark, cfg)
        secs = time.monotonic() - t0
        py_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append((n, secs, result.completed, py_mb, _jvm_peak_mb(spark), accounted(spark, result, nonblank)))
    spark.stop()
    print(f"{'lines':>9}{'seconds':>9}{'s/1k req':>10}{'completed':>11}{'py driver MB':>14}{'JVM driver MB':>15}"
          f"  accounted")
    for n, secs, done, py_mb, jvm_mb, ok in rows:
        print(f"{n:>9}{secs:>9.1f}{secs / n * 1000:>10.2f}{done:>11}{py_mb:>14.0f}{jvm_mb:>15.0f}  {ok}")
    first, last = rows[0], rows[-1]
    print(f"scale_ratio={(last[1] / last[0]) / (first[1] / first[0]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
