#!/usr/bin/env python
"""Benchmark token-aware partitioning against Spark's plain repartition(n) on a skewed input.

Generates a seeded OpenAI batch file (log-normal prompt lengths, varied max_tokens), runs only the stages before
inference (read -> validate -> count tokens with the model's tokenizer -> plan) on local Spark and prints, for the
token-aware plan and for ``repartition(n)`` of the same rows: partitions, max/mean estimated tokens per partition and
seconds. The last line is ``partition_balance=<max/mean of the token-aware plan>`` (target <= 1.05).

    python scripts/bench_partition.py --requests 100000 --slots 8
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ("the batch model token prompt spark data table output error review product customer engine "
         "partition summary 数据 模型 推理 批量 任务 结果").split()


def make_input(path: Path, n: int, seed: int, model: str) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            words = max(1, min(int(rng.lognormvariate(4.0, 1.1)), 3000))
            text = " ".join(rng.choices(WORDS, k=words))
            body = {"model": model, "messages": [{"role": "user", "content": text}],
                    "max_tokens": rng.choice([16, 64, 128, 256, 512])}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--slots", type=int, default=8, help="task slots (GPU engines) to plan for")
    p.add_argument("--target-tokens", type=int, default=None,
                   help="target estimated tokens per partition (default: total / (4 * slots))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    p.add_argument("--master", default="local[2]")
    args = p.parse_args(argv)

    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from spark_llm.config import BatchConfig
    from spark_llm.partition import balance
    from spark_llm.prepare import prepare
    from spark_llm.session import get_session

    work = Path(tempfile.mkdtemp(prefix="bench_partition."))
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_tiny_model import build_model

        model = str(build_model(work / "tiny-llm"))
    name = Path(model).name
    input_path = work / "requests.jsonl"
    make_input(input_path, args.requests, args.seed, name)
    spark = get_session(master=args.master, conf={"spark.ui.enabled": "false"})
    cfg = BatchConfig(model=model, input=str(input_path), output_dir=str(work / "out"), max_model_len=1 << 20,
                      batch_id="bench")

    t0 = time.monotonic()
    requests = prepare(spark, [cfg.resolved(max_model_len=cfg.max_model_len)]).where(F.col("error_code").isNull())
    valid = requests.persist(StorageLevel.MEMORY_AND_DISK)
    n_valid = valid.count()
    total = valid.agg(F.sum("est_tokens")).first()[0]
    count_s = time.monotonic() - t0
    target = args.target_tokens or math.ceil(total / (4 * args.slots))

    t1 = time.monotonic()
    planned, plan = balance(valid, target_tokens=target, slots=args.slots)
    aware = [r["t"] for r in planned.groupBy(F.spark_partition_id().alias("p"))
             .agg(F.sum("est_tokens").alias("t")).collect()]
    aware_s = time.monotonic() - t1

    t2 = time.monotonic()
    plain = [r["t"] for r in valid.repartition(plan.num_partitions).groupBy(F.spark_partition_id().alias("p"))
             .agg(F.sum("est_tokens").alias("t")).collect()]
    plain_s = time.monotonic() - t2

    def ratio(xs, parts):
        return max(xs) / (sum(xs) / parts)

    print(f"requests={n_valid} estimated_tokens={total} slots={args.slots} target_per_partition={target} "
          f"count_tokens_seconds={count_s:.1f}")
    print(f"{'plan':<22}{'partitions':>11}{'max/mean':>10}{'seconds':>9}")
    print(f"{'token-aware':<22}{plan.num_partitions:>11}{ratio(aware, plan.num_partitions):>10.3f}{aware_s:>9.1f}")
    print(f"{'repartition(n)':<22}{plan.num_partitions:>11}{ratio(plain, plan.num_partitions):>10.3f}{plain_s:>9.1f}")
    valid.unpersist()
    spark.stop()
    print(f"partition_balance={ratio(aware, plan.num_partitions):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
