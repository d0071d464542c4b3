#!/usr/bin/env python
"""Framework overhead: the same requests through one raw vLLM engine vs through the whole spark_llm job.

(a) raw: one process, one ``LLM.generate`` call over all prompts (chat template applied with the same tokenizer);
(b) job: ``run_batch`` on local Spark with the same engine settings (read, validate, count, plan, infer, Delta +
JSONL writes, report). Prints wall times, tokens/s, the job's engine ``busy_fraction=`` (engine time / (engine slots
x inference wall)) and the ratio; the last line is ``overhead_ratio=<job/raw>``.

    python scripts/bench_overhead.py --requests 5000                       # CPU, tiny model built on the fly
    python scripts/bench_overhead.py --model /models/llama-3.1-8b --dtype bfloat16 --max-num-seqs 256 --slots 1
    python scripts/bench_overhead.py --dummy-weights --arch llama-8b       # GPU, 8B-shaped model, no download
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

WORDS = "the batch model token prompt spark data table output review product customer engine 数据 模型 推理".split()
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def iter_requests(n: int, seed: int, model_name: str, max_tokens: int) -> Iterator[dict]:
    """``n`` chat requests of 5-120 words, one at a time (large files are written without holding them)."""
    rng = random.Random(seed)
    for i in range(n):
        text = " ".join(rng.choices(WORDS, k=rng.randint(5, 120)))
        yield {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": model_name, "messages": [{"role": "user", "content": text}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


def make_requests(n: int, seed: int, model_name: str, max_tokens: int) -> list[dict]:
    return list(iter_requests(n, seed, model_name, max_tokens))


def build_dummy_8b(out: Path) -> Path:
    """An 8B-class Llama config + the tiny local tokenizer; vLLM loads it with load_format=dummy (random weights)."""
    from make_tiny_model import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, 0, 4096)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 1, **LLAMA_8B}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (vLLM load_format=dummy)")
    p.add_argument("--arch", choices=["tiny", "llama-8b"], default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--slots", type=int, default=1, help="engines the job runs at once (raw uses one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (OMP_NUM_THREADS; vLLM's default: 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from spark_llm.engine import apply_worker_env
    from spark_llm.session import LOCAL_ENV

    apply_worker_env()  # the raw engine runs in this process; the job's local workers inherit the same
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the raw engine's torch threads; the job's below
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)

    work = Path(tempfile.mkdtemp(prefix="bench_overhead."))
    model = args.model
    if model is None:
        if args.arch == "llama-8b":
            model = str(build_dummy_8b(work / "llama-8b-dummy"))
            args.dummy_weights = True
        else:
            from make_tiny_model import build_model

            model = str(build_model(work / "tiny-llm"))
    name = Path(model).name
    requests = make_requests(args.requests, args.seed, name, args.max_tokens)
    input_path = work / "requests.jsonl"
    input_path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in requests) + "\n", encoding="utf-8")
    engine_kwargs = {"load_format": "dummy"} if args.dummy_weights else {}
    llm_kwargs = dict(model=model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=0,
                      distributed_executor_backend="uni", **engine_kwargs)
    if args.kv_cache_memory_bytes:
        llm_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes

    # (a) raw engine -------------------------------------------------------------------------------------------
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(**llm_kwargs)
    load_s = time.monotonic() - t0
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(r["body"]["messages"], tokenize=False,
                                                                       add_generation_prompt=True),
                                               add_special_tokens=False)} for r in requests]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t1 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    raw_s = time.monotonic() - t1
    raw_tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    from spark_llm.engine import shutdown_engine

    shutdown_engine(llm)
    del llm, outs

    # (b) the full job -----------------------------------------------------------------------------------------
    from spark_llm import BatchConfig, run_batch
    from spark_llm.session import get_session

    # PySpark sets OMP_NUM_THREADS=spark.task.cpus (1) in its Python workers; give the job's engines the threads
    # the raw engine had, or the comparison measures thread counts instead of the framework.
    threads = args.threads
    spark = get_session(master=args.master, conf={"spark.ui.enabled": "false",
                                                  "spark.executorEnv.OMP_NUM_THREADS": str(threads)})
    cfg = BatchConfig(input=str(input_path), output_dir=str(work / "out"), model=model, dtype=args.dtype,
                      max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                      enforce_eager=args.enforce_eager, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      num_task_slots=args.slots, engine_kwargs=engine_kwargs, batch_id="bench")
    t2 = time.monotonic()
    result = run_batch(spark, cfg)
    job_s = time.monotonic() - t2
    spark.stop()
    job_tokens = result.input_tokens + result.output_tokens

    print(f"requests={args.requests} max_tokens={args.max_tokens} model={name} engine_load_seconds={load_s:.1f}")
    print(f"{'run':<34}{'seconds':>9}{'tokens':>10}{'tokens/s':>10}")
    print(f"{'raw vLLM generate (1 engine)':<34}{raw_s:>9.1f}{raw_tokens:>10}{raw_tokens / raw_s:>10.0f}")
    print(f"{'spark_llm job (' + str(args.slots) + ' engine(s), all I/O)':<34}{job_s:>9.1f}{job_tokens:>10}"
          f"{job_tokens / job_s:>10.0f}")
    print(f"completed={result.completed} failed={result.failed}")
    print(f"busy_fraction={(result.batch.partition_plan or {}).get('busy_fraction')}")
    print(f"overhead_ratio={job_s / raw_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
