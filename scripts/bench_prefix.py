#!/usr/bin/env python
"""Prefix-aware partitions against plain token-balanced ones, on requests that share long system prompts.

The same batch runs twice in one Spark session (after a few requests that load the engines): requests spread by
estimated tokens only (``prefix_aware_partitions=False``), then with requests sharing a leading prefix kept in one
partition, adjacent.
Prints vLLM's prefix-cache hit rate (cached prompt tokens / prompt tokens, from the engines' own counts in the
metrics table), the wall and engine time of each run, and ``prefix_speedup=`` (plain wall / prefix-aware wall).

The effect shows when the engines cannot keep every shared prefix cached at once: many distinct prefixes, small
KV cache, many partitions. Defaults follow that shape on a CPU; on a GPU give the real model and sizes:

    python scripts/bench_prefix.py                                   # CPU, tiny model, 5,000 requests
    python scripts/bench_prefix.py --requests 1000 --prompts 20      # quicker
    python scripts/bench_prefix.py --model /models/llama-3.1-8b --requests 50000 --prompts 200 \\
        --kv-cache-memory-bytes 0 --no-enforce-eager --master 'local[1]' --slots 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

WORDS = ("policy customer refund invoice delivery warranty product review support agent escalate priority "
         "contract clause payment account shipping return exchange defect quality").split()


def write_requests(path: Path, n: int, prompts: int, prompt_words: int, model: str, max_tokens: int) -> None:
    rng = random.Random(0)
    systems = [f"You are support agent #{k}. Rules: " + " ".join(rng.choices(WORDS, k=prompt_words))
               for k in range(prompts)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "system", "content": systems[rng.randrange(prompts)]},
                                 {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 30)))}]}
            f.write(json.dumps({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--prompts", type=int, default=20, help="distinct system prompts")
    p.add_argument("--prompt-words", type=int, default=250, help="words per system prompt (~500 tokens)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    p.add_argument("--partitions-tokens", type=int, default=60_000, help="target_tokens_per_partition")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=8 << 20,
                   help="engine KV cache (small, so that not every prefix stays cached); 0: vLLM's sizing")
    p.add_argument("--dtype", default="bfloat16",
                   help="float32 on a CPU without native bf16 (AVX2 only), where bfloat16 runs ~5x slower")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (OMP_NUM_THREADS; vLLM's default: 1)")
    args = p.parse_args(argv)

    from spark_llm import BatchConfig, run_batch
    from spark_llm.session import get_session

    work = Path(tempfile.mkdtemp(prefix="bench_prefix."))
    model = args.model
    if model is None:
        from make_tiny_model import build_model

        model = str(build_model(work / "tiny-llm"))
    name = Path(model).name
    input_path = work / "requests.jsonl"
    write_requests(input_path, args.requests, args.prompts, args.prompt_words, name, args.max_tokens)
    threads = args.threads  # torch threads per engine, as vLLM serves by default
    spark = get_session(master=args.master, conf={"spark.ui.enabled": "false",
                                                  "spark.executorEnv.OMP_NUM_THREADS": str(threads)})
    warm = work / "warm.jsonl"  # a few requests first, so that neither measured run pays for loading the engines
    write_requests(warm, 8, 2, 5, name, 1)
    rows = []
    for aware in (None, False, True):
        label = {None: "warm-up", False: "plain", True: "prefix-aware"}[aware]
        cfg = BatchConfig(input=str(warm if aware is None else input_path), output_dir=str(work / label),
                          model=model, batch_id=label,
                          dtype=args.dtype, max_model_len=2048, max_num_seqs=64, enforce_eager=args.enforce_eager,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes or None, num_task_slots=args.slots,
                          target_tokens_per_partition=args.partitions_tokens, prefix_aware_partitions=bool(aware),
                          # different engine settings would restart the engines between the runs; these do not
                          default_max_tokens=args.max_tokens)
        t0 = time.monotonic()
        result = run_batch(spark, cfg)
        wall = time.monotonic() - t0
        if aware is None:
            continue
        metrics = spark.read.format("delta").load(result.batch.metadata["metrics_table"]).collect()
        cached = sum(m["cached_prompt_tokens"] or 0 for m in metrics)
        prompt = sum(m["prompt_tokens"] for m in metrics)
        rows.append((label, wall, sum(m["engine_seconds"] for m in metrics), cached / prompt if prompt else 0.0,
                     len(metrics), result.batch.partition_plan.balance_ratio))
    spark.stop()
    print(f"requests={args.requests} system_prompts={args.prompts} prompt_words={args.prompt_words} "
          f"kv_cache_bytes={args.kv_cache_memory_bytes} model={name}")
    print(f"{'partitions':<14}{'wall s':>9}{'engine s':>10}{'hit rate':>10}{'parts':>7}{'balance':>9}")
    for label, wall, engine_s, hit, parts, balance in rows:
        print(f"{label:<14}{wall:>9.1f}{engine_s:>10.1f}{hit:>10.1%}{parts:>7}{balance:>9.3f}")
    print(f"prefix_speedup={rows[0][1] / rows[1][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
