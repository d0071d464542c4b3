"""Sampled answers that do not depend on how the batch was partitioned: a request without a seed draws from a seed
of its own (the batch's seed and its custom_id), not from its engine's stream, which every engine starts from the
same seed."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from conftest import MEETING_PREFIX, chat_line, engine_settings, write_jsonl
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
    assert own.settings["seed"] == engine_seed(3, "cpu-1-0", socket.gethostname(), os.getpid())
    assert own.llm_kwargs()["seed"] == own.settings["seed"] and "sampling_seeds" not in own.llm_kwargs()
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
    assert (first.batch.partition_plan["num_partitions"], metrics) == (2, 2)  # a partition per engine
    answers = _answers(first.output_dir)
    sampled = [answers[sample(i)][0] for i in range(SAMPLES)] + answers[sample("n3")]
    assert len(set(sampled)) == len(sampled), sampled  # independent draws: none shared
    assert answers[sample("own-seed-a")] == answers[sample("own-seed-b")]  # a seed given keeps vLLM's meaning

    again = run_batch(spark, BatchConfig(**{**settings, "target_tokens_per_partition": 60},
                                         output_dir=str(tmp_path / "more"), batch_id="b-samples-again"))
    assert again.batch.partition_plan["num_partitions"] > first.batch.partition_plan["num_partitions"]
    assert _answers(again.output_dir) == answers
