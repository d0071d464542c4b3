"""Sampled answers that do not depend on how the batch was partitioned: a request without a seed draws from a seed
of its own (the batch's seed and its custom_id), not from its engine's stream, which every engine starts from the
same seed."""

from __future__ import annotations

import json
import os
import random
import socket
from collections import Counter
from pathlib import Path

import pytest

from conftest import MEETING_PREFIX, chat_line, engine_settings, eventually, write_jsonl
from spark_llm.config import BatchConfig
from spark_llm.endpoints.common import request_seed, with_request_seed
from spark_llm.engine_host.spec import EngineSpec, engine_seed, seeded_for

PROMPT = "Tell me a story about a cat."
SAMPLES = 12


# ---- the seeds, without an engine ----------------------------------------------------------------------------------

def test_a_request_seed_is_made_of_the_batch_seed_the_custom_id_and_the_prompt():
    seeds = {request_seed(0, f"s-{i}", k) for i in range(1000) for k in range(3)}
    assert len(seeds) == 3000 and all(0 <= s < 2 ** 63 for s in seeds)
    assert request_seed(0, "a") == request_seed(0, "a")  # whatever process, partition or run makes it
    assert request_seed(1, "a") != request_seed(0, "a")


def test_only_a_sampled_request_without_a_seed_of_its_own_gets_one():
    sampled = {"temperature": 0.7, "max_tokens": 4}
    assert with_request_seed(sampled, 0, "a") == {**sampled, "seed": request_seed(0, "a")}
    assert with_request_seed({**sampled, "seed": 5}, 0, "a")["seed"] == 5  # vLLM's meaning kept
    assert "seed" not in with_request_seed({"temperature": 0.0, "max_tokens": 4}, 0, "a")  # greedy
    assert with_request_seed({"encoding_format": "float"}, 0, "a") == {"encoding_format": "float"}  # pooling


def test_with_engine_seeds_each_engine_process_gets_a_seed_of_its_own():
    assert len({engine_seed(0, f"cpu-1-{n}", "host", pid) for n in range(4) for pid in (10, 11)}) == 8
    spec = EngineSpec.from_config(BatchConfig(model="m", seed=3, sampling_seeds="engine"))
    own = seeded_for(spec, "cpu-1-0")
    assert own.settings.seed == engine_seed(3, "cpu-1-0", socket.gethostname(), os.getpid())
    assert own.llm_kwargs()["seed"] == own.settings.seed and "sampling_seeds" not in own.llm_kwargs()
    same = EngineSpec.from_config(BatchConfig(model="m", seed=3))
    assert seeded_for(same, "cpu-1-0") is same and same.llm_kwargs()["seed"] == 3  # vLLM's engine seed as set


# ---- on the real engine --------------------------------------------------------------------------------------------

def _answers(output_dir: str) -> dict[str, list[str]]:
    out = {}
    for line in Path(output_dir, "output.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["custom_id"]] = [c["message"]["content"] for c in row["response"]["body"]["choices"]]
    return out


@pytest.mark.engine
def test_one_prompt_sampled_many_times_over_two_engines_gives_distinct_answers_whatever_the_partitioning(
        spark, tiny_model, tmp_path):
    """The engines start for this test (a batch seed of their own), so they start from the same seed, as every
    engine of a batch does; the two partitions of the first run meet before their engine calls (spark_llm.faults),
    so they are on the two engines at once. The second run cuts the same batch into more partitions on engines
    that have answered other requests since: every answer is the same per custom_id."""
    from spark_llm import run_batch

    sample = lambda i: f"{MEETING_PREFIX}{i}"  # noqa: E731
    lines = [chat_line(sample(i), PROMPT, temperature=1.0, max_tokens=16) for i in range(SAMPLES)]
    lines += [chat_line(sample("n3"), PROMPT, temperature=1.0, max_tokens=16, n=3),
              chat_line(sample("own-seed-a"), PROMPT, temperature=1.0, max_tokens=16, seed=42),
              chat_line(sample("own-seed-b"), PROMPT, temperature=1.0, max_tokens=16, seed=42)]
    write_jsonl(tmp_path / "in.jsonl", lines)
    settings = {**engine_settings(tiny_model), "seed": 7, "input": str(tmp_path / "in.jsonl")}
    first = run_batch(spark, BatchConfig(**settings, output_dir=str(tmp_path / "two"), batch_id="b-samples"))
    assert first.completed == len(lines)
    metrics = spark.read.format("delta").load(first.batch.metadata["metrics_table"]) \
        .where("batch_id = 'b-samples'").select("engine_slot").distinct().count()
    assert (first.batch.partition_plan.num_partitions, metrics) == (2, 2)  # a partition per engine
    answers = _answers(first.output_dir)
    sampled = [answers[sample(i)][0] for i in range(SAMPLES)] + answers[sample("n3")]
    assert len(set(sampled)) == len(sampled), sampled  # independent draws: none shared
    assert answers[sample("own-seed-a")] == answers[sample("own-seed-b")]  # a seed given keeps vLLM's meaning

    again = run_batch(spark, BatchConfig(**{**settings, "target_tokens_per_partition": 60},
                                         output_dir=str(tmp_path / "more"), batch_id="b-samples-again"))
    assert again.batch.partition_plan.num_partitions > first.batch.partition_plan.num_partitions
    assert _answers(again.output_dir) == answers


WORDS = "the cat sat on a warm mat and told a long story about the sea".split()
#: A line's sampling settings by its number: greedy with only max_tokens, then the sampled shapes users send
SHAPES = ({}, {"temperature": 0.8, "top_p": 0.9}, {"seed": 11, "temperature": 0.9}, {"temperature": 0.7, "stop": ["."]},
          {"temperature": 1.0, "top_k": 5}, {"temperature": 1.0, "min_p": 0.1}, {"temperature": 0.8, "n": 2})


def _mixed_lines(count: int) -> list[dict]:
    """Chat lines of every shape in :data:`SHAPES`, with prompts of about 420 to 930 tokens, each its own draw of
    words (no prefix the engine has cached): the engines' batches (8 sequences) hold more prompt tokens than a
    step's budget (vLLM's 4,096 on a CPU), so a chunking engine would prefill prompts in parts."""
    def prompt(i: int) -> str:
        rng = random.Random(i)
        return " ".join(rng.choice(WORDS) for _ in range(250 + (i * 97) % 300))
    return [chat_line(f"mix-{i}", prompt(i), max_tokens=8, **SHAPES[i % len(SHAPES)]) for i in range(count)]


@pytest.mark.engine
def test_a_mix_of_sampling_shapes_with_long_prompts_is_answered_once_whatever_the_partitioning(
        spark, tiny_model, tmp_path, engine_dir):
    """vLLM rewinds the random stream of a request whose prompt a step prefilled in part, which a CPU generator
    cannot do: with chunked prefill, every step that held a seeded request mid-prefill failed, and the isolation
    that followed left the engines stepping for ever. Here every line is answered, and a sampled line's answer is
    the same when the batch is cut into more partitions."""
    from spark_llm import run_batch
    from spark_llm.engine_host import read_events

    lines = _mixed_lines(210)
    write_jsonl(tmp_path / "in.jsonl", lines)
    settings = {**engine_settings(tiny_model), "input": str(tmp_path / "in.jsonl")}
    failed_steps = lambda: [e for e in read_events(engine_dir) if e["event"] == "step_failed"]  # noqa: E731
    before = len(failed_steps())
    first = run_batch(spark, BatchConfig(**settings, output_dir=str(tmp_path / "one"), batch_id="b-mix"))
    assert (first.completed, first.failed) == (len(lines), 0)
    assert failed_steps()[before:] == []  # answered by the engines' steps, not rescued by an isolation
    answers = _answers(first.output_dir)
    assert sorted(answers) == sorted(line["custom_id"] for line in lines)
    assert all(len(answers[f"mix-{i}"]) == 2 for i in range(6, len(lines), len(SHAPES)))  # n=2

    sampled = [line for i, line in enumerate(lines[:42]) if i % len(SHAPES)]
    write_jsonl(tmp_path / "sampled.jsonl", sampled)
    again = run_batch(spark, BatchConfig(**{**settings, "input": str(tmp_path / "sampled.jsonl"),
                                            "target_tokens_per_partition": 2_000},
                                         output_dir=str(tmp_path / "more"), batch_id="b-mix"))
    assert again.batch.partition_plan.num_partitions > 2
    assert _answers(again.output_dir) == {line["custom_id"]: answers[line["custom_id"]] for line in sampled}


@pytest.mark.engine
def test_an_engine_whose_every_step_fails_is_rebuilt_once_then_stops_the_batch_with_its_message(
        spark, tiny_model, tmp_path, engine_dir):
    """Chunked prefill chosen in engine_kwargs, with a step budget smaller than every prompt: each seeded request
    fails every step on the CPU, alone as together (vLLM's own failure, not one made up). The engine is the one at
    fault, not the requests: it is rebuilt once, and the batch stops with vLLM's message and what to change."""
    import time

    from spark_llm import EngineStartError, run_batch
    from spark_llm.engine_host import EngineSpec, read_events
    from spark_llm.models import resolve

    lines = [line for i, line in enumerate(_mixed_lines(24)) if i % len(SHAPES)][:16]
    write_jsonl(tmp_path / "in.jsonl", lines)
    base = engine_settings(tiny_model)
    # an engine rebuilt under a task that Spark then kills (the job failed on the other engine) is never called:
    # it stops after the idle timeout
    settings = {**base, "input": str(tmp_path / "in.jsonl"), "max_num_batched_tokens": 64,
                "engine_kwargs": {**base["engine_kwargs"], "enable_chunked_prefill": True},
                "engine_idle_timeout_seconds": 10}
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        run_batch(spark, BatchConfig(**settings, output_dir=str(tmp_path / "out"), batch_id="b-every-step"))
    seconds = time.monotonic() - t0
    message = str(info.value)
    assert "CPU Generator does not use offset" in message and "enable_chunked_prefill" in message
    assert "also after the engine was rebuilt" in message and "Traceback" not in message
    batch = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "engine_start_failed"
    key = EngineSpec.from_config(resolve(BatchConfig(**settings))).key
    events = [e for e in read_events(engine_dir) if e["key"] == key]
    assert {e["error"] for e in events if e["event"] == "step_failed"} == {
        "RuntimeError: CPU Generator does not use offset"}
    starts = Counter(e["slot"] for e in events if e["event"] == "start")
    assert starts and all(n == 2 for n in starts.values()), starts  # each engine built, then rebuilt once
    stops = lambda: len([e for e in read_events(engine_dir) if e["key"] == key and e["event"] == "stop"])  # noqa
    eventually(lambda: stops() == sum(starts.values()), "every engine of these settings stopped")
    print(f"every-step fault: the batch stopped {seconds:.1f} s after its start")
