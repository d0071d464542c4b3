"""The whole job on the engine stand-in at 100,000 lines (issue 44's exactly-once at scale): chat, completions,
Responses and embeddings lines, 1% hostile, every non-blank line exactly once in the tables and the OpenAI files,
every answer marked simulated, a request the stand-in fails one engine_error row, and a request that kills the
stand-in's engine one engine_error row after the engine was rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import _load_script

pytestmark = pytest.mark.engine

LINES = 100_000


@pytest.fixture(scope="module")
def standin_run(spark, tiny_model, embedding_model, tmp_path_factory):
    from spark_llm import BatchConfig
    from spark_llm.engine_host.standin import DIE_MARKER, FAIL_MARKER
    from spark_llm.pipeline import run_batch

    bench = _load_script("bench_scale")
    root = tmp_path_factory.mktemp("standin")
    path = root / "in.jsonl"
    marked = [{"custom_id": f"marked-{kind}", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "tiny-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                        "stop": [marker]}} for kind, marker in (("fail", FAIL_MARKER), ("die", DIE_MARKER))]
    # first: every 100th line is replaced by a hostile one
    lines = marked + list(bench.iter_mixed(LINES - len(marked), 7, "tiny-llm", "tiny-embed", 8))
    nonblank = bench.write_input(path, lines, 0.01)
    cfg = BatchConfig(input=str(path), output_dir=str(root / "out"), batch_id="b-standin", model=tiny_model,
                      served_model_name="tiny-llm", max_model_len=1024, num_task_slots=2,
                      target_tokens_per_partition=400_000, engine_standin="h200-8b,start_seconds=0,"
                      "decode_tokens_per_second=1e6,prefill_tokens_per_second=1e7",
                      models=[{"name": "tiny-embed", "path": embedding_model, "max_model_len": 512}])
    return run_batch(spark, cfg), nonblank


def test_every_line_exactly_once_in_the_tables_and_the_files(spark, standin_run):
    from pyspark.sql import functions as F

    result, nonblank = standin_run
    outputs = spark.read.format("delta").load(result.outputs_table)
    errors = spark.read.format("delta").load(result.errors_table)
    both = outputs.select("file", "line_number").unionByName(errors.select("file", "line_number"))
    counted = both.agg(F.count(F.lit(1)).alias("rows"), F.countDistinct("file", "line_number").alias("lines")).first()
    assert counted["rows"] == counted["lines"] == nonblank
    assert result.batch.request_counts.total == nonblank
    assert result.completed == outputs.count() > 0.95 * nonblank
    files = Path(result.paths.output_file), Path(result.paths.error_file)
    in_files = sum(1 for f in files for _ in f.open())
    assert in_files == nonblank
    endpoints = {r["endpoint"] for r in outputs.select("endpoint").distinct().collect()}
    assert endpoints == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"}


def test_every_answer_is_marked_simulated(spark, standin_run):
    from pyspark.sql import functions as F

    result, _ = standin_run
    outputs = spark.read.format("delta").load(result.outputs_table)
    assert outputs.where(~F.col("notes").contains("engine stand-in")).count() == 0
    chat = json.loads(outputs.where(F.col("endpoint") == "/v1/chat/completions").first()["response_body"])
    assert chat["system_fingerprint"] == "spark-llm-standin:h200-8b"
    assert 'id="simulated"' in Path(result.paths.report_file).read_text()


def test_the_stand_in_s_failure_and_death_are_one_error_row_each(spark, standin_run):
    from pyspark.sql import functions as F

    result, _ = standin_run
    errors = spark.read.format("delta").load(result.errors_table).where(F.col("custom_id").startswith("marked-"))
    got = {r["custom_id"]: (r["code"], r["message"]) for r in errors.collect()}
    assert set(got) == {"marked-fail", "marked-die"} and {c for c, _ in got.values()} == {"engine_error"}
    assert "spark-llm-standin:fail" in got["marked-fail"][1]
    assert "died twice while running this request" in got["marked-die"][1]  # set aside after the engine's rebuilds
