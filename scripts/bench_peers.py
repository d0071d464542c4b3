#!/usr/bin/env python
"""spark_llm side by side with what a user would pick instead, on the same OpenAI batch file, in one run.

(a) raw: one ``vllm.LLM`` in this process, one ``generate`` call over the pre-tokenized prompts (the limit: no
    reading, no validation, no writing; engine load not counted);
(b) vLLM's own batch runner, whole process: ``python -m vllm.entrypoints.openai.run_batch -i FILE -o OUT --model ..``;
(c) spark_llm, whole process: ``spark-llm run`` on local Spark (session start, read, validate, count, plan, infer,
    Delta + JSONL writes, report).

Same model, engine settings, requests, cores and torch threads per engine (``--threads``, default 1: what vLLM
serves with when OMP_NUM_THREADS is unset) for all three ((a) and (b): one engine; (c): ``--slots`` engines,
``--slots 1`` for one engine as the others). Prints a table and the ratios ``vs_raw=`` (spark_llm wall / raw
wall) and ``vs_run_batch=`` (run_batch wall / spark_llm wall; above 1 means spark_llm is faster). With
``--repeat N`` (b) and (c) run N times in turn (b, c, b, c ...: a noisy machine drifts alike for both), the walls are
the medians and ``vs_run_batch`` the median of the N pairs' ratios.

    python scripts/bench_peers.py --requests 2000                    # CPU, tiny model built on the fly
    python scripts/bench_peers.py --requests 15 --slots 1 --repeat 3 --skip raw   # the smoke test, three pairs
    python scripts/bench_peers.py --requests 20000 --mix gen         # short, medium and long prompts
    python scripts/bench_peers.py --requests 2000 --mix sampled --dtype float32   # greedy, top_p, seeded and stop
    # on a GPU node (ordinary vllm installed), an 8B model:
    python scripts/bench_peers.py --model /models/llama-3.1-8b --requests 20000 --max-num-seqs 256 \\
        --master local[1] --slots 1 --no-enforce-eager
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_overhead import WORDS  # noqa: E402  (the same vocabulary of prompts)


#: The sampling shapes of ``--mix sampled``, a line each in turn: greedy with only max_tokens, then what users sample
#: with (a seed of their own; spark_llm seeds the other sampled lines itself)
SAMPLED_SHAPES = ({}, {"temperature": 0.8, "top_p": 0.9}, {"seed": 11, "temperature": 0.9},
                  {"temperature": 0.7, "stop": ["."]})


def write_requests(path: Path, n: int, model: str, max_tokens: int, mix: str, seed: int = 0) -> None:
    """``n`` chat requests, one line at a time: ``short`` 5-120 words; ``gen`` 60% short, 30% ~300, 10% ~900 words;
    ``sampled`` 60-240 words (about 100-400 tokens) in :data:`SAMPLED_SHAPES` in turn."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            if mix == "gen":
                words = rng.choice([rng.randint(5, 120)] * 6 + [rng.randint(250, 350)] * 3 + [rng.randint(800, 1000)])
            elif mix == "sampled":
                words = rng.randint(60, 240)
            else:
                words = rng.randint(5, 120)
            sampling = SAMPLED_SHAPES[i % len(SAMPLED_SHAPES)] if mix == "sampled" else {"temperature": 0}
            body = {"model": model, "messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=words))}],
                    "max_tokens": max_tokens, "ignore_eos": True, **sampling}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}, ensure_ascii=False) + "\n")


def timed(cmd: list[str], env: dict, log: Path) -> float:
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{cmd[:4]} failed with exit code {proc.returncode}; see {log}")
    return wall


def raw_generate(model: str, input_path: Path, engine: dict, max_tokens: int) -> tuple[float, int]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, distributed_executor_backend="uni", seed=0, **engine)
    tok = llm.get_tokenizer()
    lines = [json.loads(x) for x in input_path.read_text(encoding="utf-8").splitlines()]
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(r["body"]["messages"], tokenize=False,
                                                                       add_generation_prompt=True),
                                               add_special_tokens=False)} for r in lines]
    sampling = ("temperature", "top_p", "seed", "stop")
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                             **{"temperature": 0.0, **{k: r["body"][k] for k in sampling if k in r["body"]}})
              for r in lines]
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - t0
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    from spark_llm.engine_host.spec import shutdown_engine

    shutdown_engine(llm)
    return wall, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--mix", choices=["short", "gen", "sampled"], default="short")
    p.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--slots", type=int, default=2, help="spark_llm's engines (task slots)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per engine (OMP_NUM_THREADS); vLLM serves with 1 when it is unset, as (a) and (b) run")
    p.add_argument("--skip", choices=["raw", "run_batch", "spark_llm"], action="append", default=[])
    p.add_argument("--repeat", type=int, default=1, help="runs of (b) and (c), in turn; medians are reported")
    p.add_argument("--keep", action="store_true", help="keep the work directory (the input, outputs and logs)")
    args = p.parse_args(argv)
    from spark_llm.engine_host import apply_worker_env
    from spark_llm.session import LOCAL_ENV

    apply_worker_env()  # every engine below gets the same environment (and so the same CPU KV-cache size)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # and the same torch threads per engine
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    work = Path(tempfile.mkdtemp(prefix="bench_peers."))
    model = args.model
    if model is None:
        from make_tiny_model import build_model

        model = str(build_model(work / "tiny-llm"))
    name = Path(model).name
    input_path = work / "requests.jsonl"
    write_requests(input_path, args.requests, name, args.max_tokens, args.mix)
    engine = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
              "enforce_eager": args.enforce_eager}
    env = dict(os.environ)
    results: dict[str, tuple[float, str]] = {}

    if "raw" not in args.skip:
        wall, tokens = raw_generate(model, input_path, engine, args.max_tokens)
        results["raw"] = (wall, f"{tokens / wall:.0f}")
    walls: dict[str, list[float]] = {"run_batch": [], "spark_llm": []}
    tokens = 0
    for n in range(args.repeat):
        if "run_batch" not in args.skip:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(input_path),
                   "-o", str(work / f"run_batch.{n}.out.jsonl"), "--model", model, "--served-model-name", name,
                   "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                   "--max-model-len", str(args.max_model_len), "--seed", "0"]
            if args.enforce_eager:
                cmd.append("--enforce-eager")
            walls["run_batch"].append(timed(cmd, env, work / f"run_batch.{n}.log"))
        if "spark_llm" not in args.skip:
            out = work / f"spark_llm_out.{n}"
            cmd = [str(Path(sys.executable).parent / "spark-llm"), "run", "--input", str(input_path),
                   "--output-dir", str(out), "--model", model, "--batch-id", "peers",
                   "--master", args.master, "--num-task-slots", str(args.slots), "--dtype", args.dtype,
                   "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                   "--default-max-tokens", str(args.max_tokens)]
            cmd.append("--enforce-eager" if args.enforce_eager else "--no-enforce-eager")
            conf = work / "peers.yaml"  # the session's settings (a YAML file's spark: section)
            conf.write_text(f"spark:\n  spark.executorEnv.OMP_NUM_THREADS: '{args.threads}'\n"
                            f"  spark.ui.enabled: 'false'\n")
            walls["spark_llm"].append(timed(cmd + ["--config", str(conf)], env, work / f"spark_llm.{n}.log"))
            batch = json.loads((out / "batch.json").read_text())
            tokens = batch["usage"]["total_tokens"]
            print(f"busy_fraction={batch['partition_plan'].get('busy_fraction')}")
    if walls["run_batch"]:
        results["run_batch"] = (statistics.median(walls["run_batch"]), "-")
    if walls["spark_llm"]:
        wall = statistics.median(walls["spark_llm"])
        results["spark_llm"] = (wall, f"{tokens / wall:.0f}")

    print(f"requests={args.requests} mix={args.mix} max_tokens={args.max_tokens} model={name} "
          f"cores={os.cpu_count()}" + (f" work={work}" if args.keep else ""))
    print(f"{'run':<44}{'wall s':>9}{'tokens/s':>10}")
    labels = {"raw": "(a) raw LLM.generate, 1 engine (no I/O)", "run_batch": "(b) vllm run_batch, whole process",
              "spark_llm": f"(c) spark-llm run, whole process, {args.slots} engine(s)"}
    for key, (wall, tps) in results.items():
        print(f"{labels[key]:<44}{wall:>9.1f}{tps:>10}")
    if "spark_llm" in results and "raw" in results:
        print(f"vs_raw={results['spark_llm'][0] / results['raw'][0]:.3f}")
    if "spark_llm" in results and "run_batch" in results:
        ratios = [b / c for b, c in zip(walls["run_batch"], walls["spark_llm"])]
        if args.repeat > 1:
            print("pairs (run_batch s, spark_llm s): " + ", ".join(
                f"({b:.1f}, {c:.1f})" for b, c in zip(walls["run_batch"], walls["spark_llm"])))
        print(f"vs_run_batch={statistics.median(ratios):.3f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
