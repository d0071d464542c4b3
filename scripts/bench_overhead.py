#!/usr/bin/env python
"""Framework overhead: the same requests through one raw vLLM engine vs through the whole spark_llm job.

(a) raw: one process, one ``LLM.generate`` call over all prompts (chat template applied with the same tokenizer;
the engine's load not timed);
(b) job: ``run_batch`` on local Spark with the same engine settings (read, validate, count, plan, infer, Delta +
JSONL writes, report; the engine's load timed, the session's start not). Each runs in a process of its own, (a)
then (b), ``--repeat`` times: machines drift, so the ratio is the median of the pairs' ratios. The first pair's job
meets the model for the first time on this host (its tokenizer class not yet recorded), the later ones as every
later batch of that model does. Prints each pair, median wall times, tokens/s, the job's engine ``busy_fraction=``
(engine time / (engine slots x inference wall)), when the job's first engine call came and how long it took after
its last answer (medians); the last line is ``overhead_ratio=<job/raw>``.

    python scripts/bench_overhead.py --requests 5000                       # CPU, tiny model built on the fly
    python scripts/bench_overhead.py --requests 20000 --repeat 5           # five alternating pairs
    python scripts/bench_overhead.py --requests 20000 --dtype float32 --repeat 3   # a CPU with AVX2 only
    python scripts/bench_overhead.py --model /models/llama-3.1-8b --dtype bfloat16 --max-num-seqs 256 --slots 1
    python scripts/bench_overhead.py --dummy-weights --arch llama-8b       # GPU, 8B-shaped model, no download
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
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
    p.add_argument("--repeat", type=int, default=1,
                   help="pairs of (a) then (b), each in a process of its own; the ratio is the median of the pairs'")
    p.add_argument("--part", choices=["raw", "job"], default=None, help=argparse.SUPPRESS)  # one run, in a child
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from spark_llm.engine_host import apply_worker_env
    from spark_llm.session import LOCAL_ENV

    apply_worker_env()  # the raw engine runs in this process; the job's local workers inherit the same
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the raw engine's torch threads; the job's below
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    if args.part:
        seconds, tokens, extra = (raw_run if args.part == "raw" else job_run)(args, Path(args.work))
        print(json.dumps({"seconds": seconds, "tokens": tokens, **extra}))
        return 0

    work = Path(tempfile.mkdtemp(prefix="bench_overhead."))
    if args.model is None:
        if args.arch == "llama-8b":
            args.model = str(build_dummy_8b(work / "llama-8b-dummy"))
            args.dummy_weights = True
        else:
            from make_tiny_model import build_model

            args.model = str(build_model(work / "tiny-llm"))
    name = Path(args.model).name
    with open(work / "requests.jsonl", "w", encoding="utf-8") as f:
        for r in iter_requests(args.requests, args.seed, name, args.max_tokens):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--model", args.model,
             "--work", str(work)] + (["--dummy-weights"] if args.dummy_weights else [])
    pairs = []
    for n in range(args.repeat):
        runs = {}
        for part in ("raw", "job"):
            out = subprocess.run(child + ["--part", part], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"the {part} run failed:\n{out.stderr[-4000:]}")
            runs[part] = json.loads(out.stdout.strip().splitlines()[-1])
        pairs.append(runs)
        raw, job = runs["raw"], runs["job"]
        print(f"pair {n + 1}: raw {raw['seconds']:.1f} s, job {job['seconds']:.1f} s, "
              f"ratio {job['seconds'] / raw['seconds']:.3f}, busy_fraction {job['busy_fraction']}; the job's first "
              f"engine call at {job['first_call']:.1f} s, its end {job['after_last']:.1f} s after the last answer",
              flush=True)

    raw_s = statistics.median(r["raw"]["seconds"] for r in pairs)
    job_s = statistics.median(r["job"]["seconds"] for r in pairs)
    tokens = pairs[-1]["raw"]["tokens"]
    print(f"requests={args.requests} max_tokens={args.max_tokens} model={name} dtype={args.dtype} "
          f"cpu={cpu_vector_extension()} pairs={args.repeat} "
          f"engine_load_seconds={pairs[-1]['raw']['load_seconds']:.1f}")
    print(f"{'run (median)':<34}{'seconds':>9}{'tokens':>10}{'tokens/s':>10}")
    print(f"{'raw vLLM generate (1 engine)':<34}{raw_s:>9.1f}{tokens:>10}{tokens / raw_s:>10.0f}")
    print(f"{'spark_llm job (' + str(args.slots) + ' engine(s), all I/O)':<34}{job_s:>9.1f}"
          f"{pairs[-1]['job']['tokens']:>10}{pairs[-1]['job']['tokens'] / job_s:>10.0f}")
    print(f"completed={pairs[-1]['job']['completed']} failed={pairs[-1]['job']['failed']}")
    print(f"busy_fraction={statistics.median(r['job']['busy_fraction'] or 0 for r in pairs):.4f}")
    # the job's time outside the engine's work: its start (the engine's import and load among it, which the raw
    # run does not time) and its tail (the last commit, the OpenAI files, the report)
    print(f"job_first_call_seconds={statistics.median(r['job']['first_call'] for r in pairs):.1f} "
          f"job_tail_seconds={statistics.median(r['job']['after_last'] for r in pairs):.1f}")
    print(f"overhead_ratio={statistics.median(r['job']['seconds'] / r['raw']['seconds'] for r in pairs):.3f}")
    return 0


def cpu_vector_extension() -> str:
    """The widest vector extension of this host's CPU (Linux), printed beside the ratio: vLLM's CPU speed in each
    dtype depends on it (with AVX2 alone bfloat16 runs about 5x slower than float32), and so does the ratio."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return "unknown"
    return next((flag for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if flag in flags), "other")


def engine_args(args) -> dict:
    """The engine settings both runs share."""
    engine_kwargs = {"load_format": "dummy"} if args.dummy_weights else {}
    llm_kwargs = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=0,
                      distributed_executor_backend="uni", **engine_kwargs)
    if args.kv_cache_memory_bytes:
        llm_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return llm_kwargs


def raw_run(args, work: Path) -> tuple[float, int, dict]:
    """(a) one raw engine in this process, one ``generate`` over every prompt, pre-tokenized with the chat
    template (the engine's load not timed)."""
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(**engine_args(args))
    load_s = time.monotonic() - t0
    tok = llm.get_tokenizer()
    with open(work / "requests.jsonl", encoding="utf-8") as f:
        messages = [json.loads(line)["body"]["messages"] for line in f]
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                               add_special_tokens=False)} for m in messages]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t1 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    raw_s = time.monotonic() - t1
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return raw_s, tokens, {"load_seconds": load_s}


def job_run(args, work: Path) -> tuple[float, int, dict]:
    """(b) the whole job on a local session started before the clock starts (its engine's load is timed)."""
    from pyspark.sql import functions as F

    from spark_llm import BatchConfig, run_batch, storage
    from spark_llm.session import get_session

    # PySpark sets OMP_NUM_THREADS=spark.task.cpus (1) in its Python workers; give the job's engines the threads
    # the raw engine had, or the comparison measures thread counts instead of the framework.
    spark = get_session(master=args.master, conf={"spark.ui.enabled": "false",
                                                  "spark.executorEnv.OMP_NUM_THREADS": str(args.threads)})
    engine = engine_args(args)
    out = Path(tempfile.mkdtemp(prefix="out.", dir=work))
    cfg = BatchConfig(input=str(work / "requests.jsonl"), output_dir=str(out), model=args.model, dtype=args.dtype,
                      max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                      enforce_eager=args.enforce_eager, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      num_task_slots=args.slots, engine_kwargs={k: v for k, v in engine.items()
                                                                if k == "load_format"}, batch_id="bench")
    t0, began = time.monotonic(), time.time()
    result = run_batch(spark, cfg)
    job_s = time.monotonic() - t0
    calls = (storage.read_table(spark, result.paths.metrics_table)  # a row per partition
             .agg(F.min("engine_started_at").alias("first"), F.max("engine_finished_at").alias("last")).first())
    spark.stop()
    return job_s, result.input_tokens + result.output_tokens, {
        "busy_fraction": getattr(result.batch.partition_plan, "busy_fraction", None), "completed": result.completed,
        "failed": result.failed, "first_call": calls["first"].timestamp() - began,
        "after_last": job_s - (calls["last"].timestamp() - began)}


if __name__ == "__main__":
    sys.exit(main())
