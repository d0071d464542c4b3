"""Delta and catalog tables in (OpenAI shape and plain columns), managed result tables out, and exactly-once resume
after a hard crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from conftest import MODEL_NAME, ROOT, chat_line, engine_settings, write_jsonl
from spark_llm import BatchConfig, ConfigError, run_batch
from spark_llm.infer import FAULT_ENV
from spark_llm.schemas import OUTPUTS_COLUMNS

pytestmark = pytest.mark.engine


def by_id(spark, result):
    outs = {r["custom_id"]: r for r in spark.read.format("delta").load(result.outputs_table).collect()}
    errs = {(r["custom_id"], r["line_number"]): r for r in spark.read.format("delta").load(result.errors_table).collect()}
    return outs, errs


def test_delta_path_input_openai_shape(spark, tiny_model, tmp_path):
    rows = [("t-1", "POST", "/v1/chat/completions", json.dumps(chat_line("ignored", "Hi", max_tokens=3)["body"])),
            ("t-2", "POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})),
            ("t-3", "POST", "/v1/chat/completions", "{not json"),
            ("t-4", "GET", "/v1/chat/completions", json.dumps(chat_line("x")["body"]))]
    table = str(tmp_path / "requests")
    spark.createDataFrame(rows, "custom_id string, method string, url string, body string") \
        .coalesce(1).write.format("delta").save(table)
    result = run_batch(spark, BatchConfig(input=table, output_dir=str(tmp_path / "out"), batch_id="tbl-a",
                                          **engine_settings(tiny_model)))
    outs, errs = by_id(spark, result)
    assert set(outs) == {"t-1", "t-2"} and outs["t-1"]["completion_tokens"] == 3
    assert {(cid, e["code"]) for (cid, _), e in errs.items()} == {("t-3", "invalid_request"), ("t-4", "invalid_method")}
    assert all(e["file"] == table for e in errs.values())
    assert sorted(r["line_number"] for r in list(outs.values()) + list(errs.values())) == [1, 2, 3, 4]


def test_catalog_table_input_body_struct_and_managed_result_tables(spark, tiny_model, tmp_path):
    spark.sql("CREATE DATABASE IF NOT EXISTS llm")
    df = spark.createDataFrame(
        [(101, {"model": MODEL_NAME, "max_tokens": 2}, "Say hi"), (102, {"model": "other", "max_tokens": 2}, "x")],
        "request_key long, params struct<model: string, max_tokens: int>, question string")
    body = F.struct(F.col("params.model").alias("model"), F.col("params.max_tokens").alias("max_tokens"),
                    F.array(F.struct(F.lit("user").alias("role"), F.col("question").alias("content"))).alias("messages"))
    df.select("request_key", body.alias("body")).write.format("parquet").saveAsTable("llm.struct_requests")
    result = run_batch(spark, BatchConfig(input_table="llm.struct_requests", id_column="request_key",
                                          output_table_prefix="llm.batch_", output_dir=str(tmp_path / "out"),
                                          batch_id="tbl-b", **engine_settings(tiny_model)))
    assert result.outputs_table == "llm.batch_outputs" and result.completed == 1 and result.failed == 1
    outs = spark.table("llm.batch_outputs").where("batch_id = 'tbl-b'").collect()
    assert [r["custom_id"] for r in outs] == ["101"]
    errs = spark.table("llm.batch_errors").where("batch_id = 'tbl-b'").collect()
    assert [(r["custom_id"], r["code"]) for r in errs] == [("102", "model_not_found")]
    comments = {r["col_name"]: r["comment"] for r in spark.sql("DESCRIBE TABLE llm.batch_outputs").collect()}
    assert comments["prompt_tokens"] == OUTPUTS_COLUMNS["prompt_tokens"][1]
    assert Path(result.output_file).read_text().count("\n") == 1


def test_plain_columns_with_system_prompt_and_derived_ids(spark, tiny_model, tmp_path):
    table = str(tmp_path / "plain")
    spark.createDataFrame([("What is Spark?", 3, 0.0), ("什么是批量推理？", None, None), ("What is Spark?", 3, 0.0)],
                          "question string, mt int, temp double").coalesce(1).write.format("delta").save(table)
    result = run_batch(spark, BatchConfig(
        input=table, prompt_column="question", system_prompt="Answer briefly.", max_tokens_column="mt",
        temperature_column="temp", output_dir=str(tmp_path / "out"), batch_id="tbl-c", **engine_settings(tiny_model)))
    outs, errs = by_id(spark, result)
    assert len(outs) == 2 and all(cid.startswith("row-") for cid in outs)
    # identical rows derive the same id: the second is reported as a duplicate of the first
    assert [e["code"] for e in errs.values()] == ["duplicate_custom_id"]
    first = next(r for r in outs.values() if r["line_number"] == 1)
    request = json.loads(first["request"])
    assert request["body"]["messages"] == [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "What is Spark?"}]
    assert first["completion_tokens"] == 3 and request["body"]["temperature"] == 0.0
    second = next(r for r in outs.values() if r["line_number"] == 2)
    assert "max_tokens" not in json.loads(second["request"])["body"]  # null columns fall back to the defaults
    assert second["completion_tokens"] == 8


def test_catalog_table_plain_messages_column(spark, tiny_model, tmp_path):
    spark.sql("CREATE DATABASE IF NOT EXISTS llm")
    spark.createDataFrame(
        [("doc-1", [("system", "Be brief."), ("user", "Summarize: Spark is fast.")], 2),
         ("doc-2", [("user", "")], 2)],
        "doc_id string, convo array<struct<role: string, content: string>>, budget int",
    ).write.format("delta").saveAsTable("llm.plain_requests")
    result = run_batch(spark, BatchConfig(input_table="llm.plain_requests", id_column="doc_id",
                                          messages_column="convo", max_tokens_column="budget",
                                          output_dir=str(tmp_path / "out"), batch_id="tbl-d",
                                          **engine_settings(tiny_model)))
    outs, errs = by_id(spark, result)
    assert list(outs) == ["doc-1"] and outs["doc-1"]["completion_tokens"] == 2
    assert json.loads(outs["doc-1"]["request"])["body"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [(cid, e["code"], e["file"]) for (cid, _), e in errs.items()] == [
        ("doc-2", "invalid_request", "llm.plain_requests")]


def test_plain_columns_need_a_prompt_or_body(spark, tiny_model, tmp_path):
    table = str(tmp_path / "nothing")
    spark.createDataFrame([("a",)], "text string").write.format("delta").save(table)
    with pytest.raises(ConfigError, match="no 'body' column"):
        run_batch(spark, BatchConfig(input=table, output_dir=str(tmp_path / "out"), **engine_settings(tiny_model)))


def test_same_batch_id_is_refused_without_resume(spark, tiny_model, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [chat_line("only", max_tokens=1)])
    shared = str(tmp_path / "shared_outputs")
    settings = dict(input=str(tmp_path / "in.jsonl"), batch_id="same", outputs_table_path=shared,
                    errors_table_path=str(tmp_path / "shared_errors"), **engine_settings(tiny_model))
    run_batch(spark, BatchConfig(output_dir=str(tmp_path / "o1"), **settings))
    with pytest.raises(ConfigError, match="already holds rows of batch 'same'.*--resume"):
        run_batch(spark, BatchConfig(output_dir=str(tmp_path / "o2"), **settings))
    again = run_batch(spark, BatchConfig(output_dir=str(tmp_path / "o3"), overwrite=True, **settings))
    assert spark.read.format("delta").load(shared).where("batch_id = 'same'").count() == again.completed == 1


def test_crash_after_first_wave_then_resume_is_exactly_once(spark, tiny_model, tmp_path):
    lines = [chat_line(f"w{i:02d}", f"request number {i} " * (1 + i % 5), temperature=0, max_tokens=4)
             for i in range(24)]
    lines.append(chat_line("rejected", "Hi", max_tokens=2, logprobs=True, top_logprobs=5))  # engine_error
    lines.append("garbage line")
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    settings = engine_settings(tiny_model)
    args = [sys.executable, "-m", "spark_llm.cli", "run", "--input", str(tmp_path / "in.jsonl"),
            "--output-dir", str(out), "--batch-id", "crashy", "--master", "local[2]", "--wave-partitions", "1",
            "--target-tokens-per-partition", "150", "--num-task-slots", "2"]
    for key in ("model", "served_model_name", "max_model_len", "max_num_seqs", "dtype", "kv_cache_memory_bytes",
                "default_max_tokens"):
        args += ["--" + key.replace("_", "-"), str(settings[key])]
    args.append("--enforce-eager")
    env = {**os.environ, FAULT_ENV: "exit_after_wave:1"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert "wave 1/" in proc.stderr and "fault injection: driver exits after wave 1" in proc.stderr
    first_wave = spark.read.format("delta").load(str(out / "delta/outputs")).count()
    assert 0 < first_wave < 24

    cfg = dict(input=str(tmp_path / "in.jsonl"), output_dir=str(out), batch_id="crashy", resume=True,
               wave_partitions=1, **{**settings, "target_tokens_per_partition": 150})
    resumed = run_batch(spark, BatchConfig(**cfg))
    outs = spark.read.format("delta").load(resumed.outputs_table)
    errs = spark.read.format("delta").load(resumed.errors_table)
    assert resumed.skipped >= first_wave + 1  # the first wave's rows and the validation error were not redone
    assert outs.count() == 24 and outs.select("custom_id").distinct().count() == 24
    assert sorted(r["code"] for r in errs.collect()) == ["engine_error", "invalid_json"]
    assert len(Path(resumed.output_file).read_text().splitlines()) == 24
    assert json.loads(Path(resumed.batch_file).read_text())["request_counts"] == {"total": 26, "completed": 24,
                                                                                  "failed": 2}

    done = run_batch(spark, BatchConfig(**cfg))  # a finished batch: nothing new
    assert done.skipped == 26 and done.completed == 24 and done.failed == 2
    retried = run_batch(spark, BatchConfig(**{**cfg, "retry_errors": True}))  # the engine error runs again, once
    assert retried.skipped == 25
    assert spark.read.format("delta").load(resumed.errors_table).count() == 2
    assert spark.read.format("delta").load(resumed.outputs_table).count() == 24
