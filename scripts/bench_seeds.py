#!/usr/bin/env python
"""What per-request seeds cost vLLM's sampler: the same sampled requests without seeds and with a seed each.

One ``vllm.LLM`` in this process answers the same requests (temperature 1, ``max_tokens`` generated, EOS ignored)
in rounds, A B A B ...: A without seeds (every request draws from the engine's generator), B with a seed each
(``sampling_seeds: request``, the default). Prints the decode rate of each round and ``seeded_vs_unseeded=`` (the
median of the pairs' wall ratios B/A; above 1 is what per-request seeds cost).

vLLM's V1 model runner (CPUs, and GPUs without Triton) draws a seeded request's noise in a loop of its own at every
step; the tiny model's steps are so short that this is the cost's worst case. GPUs with Triton run vLLM's Model
Runner V2 by default, which draws every request from a seed of its own in one batched kernel whether or not the
request gives one (vllm/v1/worker/gpu/sample/gumbel.py): there a seed only rules out FlashInfer's fused
top-k/top-p sampler (vllm/v1/worker/gpu/sample/sampler.py). On a GPU:

    python scripts/bench_seeds.py --model /models/llama-3.1-8b --requests 2000 --max-tokens 256 \\
        --dtype bfloat16 --no-enforce-eager --kv-cache-memory-bytes 0
    python scripts/bench_seeds.py ... --top-p 0.9      # the FlashInfer case

Here: ``python scripts/bench_seeds.py`` (the tiny model, float32: see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / ".cache" / "tiny-llm"),
                   help="model directory (default: the tiny model scripts/demo.sh builds)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3, help="pairs of rounds (A without seeds, B with)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20, help="0: vLLM's own sizing (GPUs)")
    args = p.parse_args(argv)
    if not Path(args.model).is_dir():
        p.error(f"no model at {args.model}: run scripts/make_tiny_model.py --out {args.model} first")

    from vllm import LLM, SamplingParams

    from spark_llm.endpoints.common import request_seed

    engine = dict(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager, max_model_len=1024,
                  max_num_seqs=args.max_num_seqs, seed=0, distributed_executor_backend="uni")
    if args.kv_cache_memory_bytes:
        engine["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    llm = LLM(**engine)
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(24)]} for i in range(args.requests)]

    def params(seeded: bool) -> list:
        return [SamplingParams(temperature=1.0, top_p=args.top_p, max_tokens=args.max_tokens, ignore_eos=True,
                               seed=request_seed(0, f"r-{i}") if seeded else None) for i in range(args.requests)]

    def one_round(seeded: bool) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(seeded), use_tqdm=False)
        wall = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.requests * args.max_tokens
        return wall

    one_round(False)  # warm-up
    tokens = args.requests * args.max_tokens
    print(f"requests={args.requests} max_tokens={args.max_tokens} max_num_seqs={args.max_num_seqs} "
          f"top_p={args.top_p} dtype={args.dtype}")
    print(f"{'round':<7}{'unseeded tok/s':>16}{'seeded tok/s':>14}{'ratio':>8}")
    ratios = []
    for r in range(args.rounds):
        a, b = one_round(False), one_round(True)
        ratios.append(b / a)
        print(f"{r + 1:<7}{tokens / a:>16.0f}{tokens / b:>14.0f}{b / a:>8.3f}")
    print(f"seeded_vs_unseeded={statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
