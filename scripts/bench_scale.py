#!/usr/bin/env python
"""Scaling: the full job at growing request counts; per-request cost and the driver's peak memory.

Runs ``run_batch`` on local Spark for each size (small max_tokens) and prints seconds, seconds per 1k requests, and
the driver's peak RSS (Python driver and the Spark driver JVM). The last line is
``scale_ratio=<per-request cost at the largest size / at the smallest>``: near or below 1 means fixed costs amortise
and nothing grows with the data on the driver.

    python scripts/bench_scale.py --sizes 1000,10000,100000
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default=None)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--target-tokens-per-partition", type=int, default=500_000)
    args = p.parse_args(argv)
    from spark_llm.engine import apply_worker_env
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
        with open(path, "w", encoding="utf-8") as f:
            for r in iter_requests(n, n, Path(model).name, args.max_tokens):
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        cfg = BatchConfig(input=str(path), output_dir=str(work / f"out-{n}"), model=model, dtype="bfloat16",
                          max_num_seqs=args.max_num_seqs, max_model_len=2048, enforce_eager=True,
                          target_tokens_per_partition=args.target_tokens_per_partition, batch_id=f"scale-{n}")
        t0 = time.monotonic()
        result = run_batch(spark, cfg)
        secs = time.monotonic() - t0
        py_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append((n, secs, result.completed, py_mb, _jvm_peak_mb(spark)))
    spark.stop()
    print(f"{'requests':>9}{'seconds':>9}{'s/1k req':>10}{'completed':>11}{'py driver MB':>14}{'JVM driver MB':>15}")
    for n, secs, done, py_mb, jvm_mb in rows:
        print(f"{n:>9}{secs:>9.1f}{secs / n * 1000:>10.2f}{done:>11}{py_mb:>14.0f}{jvm_mb:>15.0f}")
    first, last = rows[0], rows[-1]
    print(f"scale_ratio={(last[1] / last[0]) / (first[1] / first[0]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
