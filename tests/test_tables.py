"""Delta and catalog tables in (OpenAI shape and plain columns, checked at the prepare stage: read and validation,
no engine), one full run from a catalog table into managed result tables, and exactly-once resume after a hard
crash."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from conftest import MODEL_NAME, ROOT, chat_line, engine_settings, write_jsonl
from spark_llm import BatchConfig, ConfigError, run_batch, storage
from spark_llm.faults import FAULT_ENV
from spark_llm.prepare import prepare
from spark_llm.schemas import OUTPUTS_COLUMNS


def prepared(spark, tiny_model, **settings) -> dict:
    """The prepare stage's rows for a table input, by (custom_id, line_number)."""
    cfg = BatchConfig(output_dir="/unused", batch_id="tbl", **engine_settings(tiny_model), **settings)
    rows = prepare(spark, [cfg.resolved(max_model_len=cfg.max_model_len)]).collect()
    return {(r["custom_id"], r["line_number"]): r for r in rows}


def valid(rows: dict) -> dict:
    return {cid: r for (cid, _), r in rows.items() if r["error_code"] is None}


def errors(rows: dict) -> set:
    return {(cid, r["error_code"]) for (cid, _), r in rows.items() if r["error_code"] is not None}


def max_tokens(row) -> int:
    return json.loads(row["sampling_json"])["max_tokens"]


def test_delta_path_input_openai_shape(spark, tiny_model, tmp_path):
    rows = [("t-1", "POST", "/v1/chat/completions", json.dumps(chat_line("ignored", "Hi", max_tokens=3)["body"])),
            ("t-2", "POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})),
            ("t-3", "POST", "/v1/chat/completions", "{not json"),
            ("t-4", "GET", "/v1/chat/completions", json.dumps(chat_line("x")["body"]))]
    table = str(tmp_path / "requests")
    spark.createDataFrame(rows, "custom_id string, method string, url string, body string") \
        .coalesce(1).write.format("delta").save(table)
    got = prepared(spark, tiny_model, input=table)
    ok = valid(got)
    assert set(ok) == {"t-1", "t-2"} and max_tokens(ok["t-1"]) == 3 and ok["t-2"]["kind"] == "completion"
    assert errors(got) == {("t-3", "invalid_request"), ("t-4", "invalid_method")}
    assert {r["file"] for r in got.values()} == {table}
    assert sorted(line for _, line in got) == [1, 2, 3, 4]


def test_only_a_directory_with_a_committed_delta_log_is_a_delta_path(spark, tmp_path):
    """Inputs and result tables are told apart by the path: a JSONL file, a plain directory and an empty
    ``_delta_log`` (a table whose first commit never landed) are not Delta tables; a committed table is."""
    jsonl = tmp_path / "requests.jsonl"
    jsonl.write_text(json.dumps(chat_line("a", "hi")) + "\n")
    (tmp_path / "plain").mkdir()
    (tmp_path / "unborn" / "_delta_log").mkdir(parents=True)
    spark.range(3).write.format("delta").save(str(tmp_path / "table"))
    found = {name: storage.is_delta_path(spark, str(tmp_path / name))
             for name in ("requests.jsonl", "plain", "unborn", "table", "missing")}
    assert found == {"requests.jsonl": False, "plain": False, "unborn": False, "table": True, "missing": False}


def test_result_tables_are_made_with_comments_partitions_and_stats_columns_and_gain_new_columns(spark, tmp_path):
    """ensure_table makes the table a run appends to (every column, its comment, batch_id partitions, statistics on
    the chosen columns only); on a table an older spark_llm made it adds the columns that one lacked."""
    from spark_llm.schemas import ERRORS_COLUMNS, ERRORS_STATS

    path = str(tmp_path / "errors")
    storage.ensure_table(spark, path, ERRORS_COLUMNS, ERRORS_STATS)
    table = storage.read_table(spark, path)
    assert [(f.name, f.dataType, f.metadata.get("comment")) for f in table.schema.fields] == \
        [(name, dtype, comment) for name, (dtype, comment) in ERRORS_COLUMNS.items()]
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
    assert detail["partitionColumns"] == ["batch_id"]
    assert detail["properties"]["delta.dataSkippingStatsColumns"] == ",".join(ERRORS_STATS)

    older = str(tmp_path / "older")
    kept = {n: c for n, c in ERRORS_COLUMNS.items() if n != "raw_line"}
    storage.ensure_table(spark, older, kept)
    storage.append_rows(spark.createDataFrame([("b", "e-1", "invalid_json")], "batch_id string, id string, code string")
                        .select(*[F.col(n) if n in ("batch_id", "id", "code") else F.lit(None).alias(n) for n in kept]),
                        older, kept)
    storage.ensure_table(spark, older, ERRORS_COLUMNS, ERRORS_STATS)
    grown = storage.read_table(spark, older)
    assert grown.columns == [*kept, "raw_line"]  # added at the end
    assert grown.schema["raw_line"].metadata.get("comment") == ERRORS_COLUMNS["raw_line"][1]
    assert [(r["id"], r["raw_line"]) for r in grown.collect()] == [("e-1", None)]


def test_catalog_table_with_a_struct_body(spark, tiny_model):
    spark.sql("CREATE DATABASE IF NOT EXISTS llm")
    make_struct_table(spark, "llm.struct_requests_prepared")
    got = prepared(spark, tiny_model, input_table="llm.struct_requests_prepared", id_column="request_key")
    assert list(valid(got)) == ["101"] and max_tokens(valid(got)["101"]) == 2
    assert errors(got) == {("102", "model_not_found")}


def test_plain_columns_with_system_prompt_and_derived_ids(spark, tiny_model, tmp_path):
    table = str(tmp_path / "plain")
    spark.createDataFrame([("What is Spark?", 3, 0.0), ("什么是批量推理？", None, None), ("What is Spark?", 3, 0.0)],
                          "question string, mt int, temp double").coalesce(1).write.format("delta").save(table)
    got = prepared(spark, tiny_model, input=table, prompt_column="question", system_prompt="Answer briefly.",
                   max_tokens_column="mt", temperature_column="temp")
    ok = valid(got)
    assert len(ok) == 2 and all(cid.startswith("row-") for cid in ok)
    # identical rows derive the same id: the second is reported as a duplicate of the first
    assert [code for _, code in errors(got)] == ["duplicate_custom_id"]
    first = next(r for r in ok.values() if r["line_number"] == 1)
    request = json.loads(first["request"])
    assert request["body"]["messages"] == [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "What is Spark?"}]
    assert max_tokens(first) == 3 and request["body"]["temperature"] == 0.0
    second = next(r for r in ok.values() if r["line_number"] == 2)
    assert "max_tokens" not in json.loads(second["request"])["body"]  # null columns fall back to the defaults
    assert max_tokens(second) == engine_settings(tiny_model)["default_max_tokens"]


def test_catalog_table_plain_messages_column(spark, tiny_model):
    spark.sql("CREATE DATABASE IF NOT EXISTS llm")
    spark.createDataFrame(
        [("doc-1", [("system", "Be brief."), ("user", "Summarize: Spark is fast.")], 2),
         ("doc-2", [("user", "")], 2)],
        "doc_id string, convo array<struct<role: string, content: string>>, budget int",
    ).write.format("delta").saveAsTable("llm.plain_requests")
    got = prepared(spark, tiny_model, input_table="llm.plain_requests", id_column="doc_id",
                   messages_column="convo", max_tokens_column="budget")
    ok = valid(got)
    assert list(ok) == ["doc-1"] and max_tokens(ok["doc-1"]) == 2
    assert json.loads(ok["doc-1"]["request"])["body"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [(cid, r["error_code"], r["file"]) for (cid, _), r in got.items() if r["error_code"]] == [
        ("doc-2", "invalid_request", "llm.plain_requests")]


def test_plain_columns_need_a_prompt_or_body(spark, tiny_model, tmp_path):
    table = str(tmp_path / "nothing")
    spark.createDataFrame([("a",)], "text string").write.format("delta").save(table)
    with pytest.raises(ConfigError, match="no 'body' column"):
        prepared(spark, tiny_model, input=table)


def make_struct_table(spark, name: str) -> None:
    df = spark.createDataFrame(
        [(101, {"model": MODEL_NAME, "max_tokens": 2}, "Say hi"), (102, {"model": "other", "max_tokens": 2}, "x")],
        "request_key long, params struct<model: string, max_tokens: int>, question string")
    body = F.struct(F.col("params.model").alias("model"), F.col("params.max_tokens").alias("max_tokens"),
                    F.array(F.struct(F.lit("user").alias("role"), F.col("question").alias("content"))).alias("messages"))
    df.select("request_key", body.alias("body")).write.format("parquet").saveAsTable(name)


@pytest.mark.engine
def test_catalog_table_run_into_managed_result_tables_and_the_same_batch_id(spark, tiny_model, tmp_path):
    spark.sql("CREATE DATABASE IF NOT EXISTS llm")
    make_struct_table(spark, "llm.struct_requests")
    settings = dict(input_table="llm.struct_requests", id_column="request_key", output_table_prefix="llm.batch_",
                    batch_id="tbl-b", **engine_settings(tiny_model))
    result = run_batch(spark, BatchConfig(output_dir=str(tmp_path / "out"), **settings))
    assert result.outputs_table == "llm.batch_outputs" and result.completed == 1 and result.failed == 1
    outs = spark.table("llm.batch_outputs").where("batch_id = 'tbl-b'").collect()
    assert [(r["custom_id"], r["completion_tokens"]) for r in outs] == [("101", 2)]
    errs = spark.table("llm.batch_errors").where("batch_id = 'tbl-b'").collect()
    assert [(r["custom_id"], r["code"]) for r in errs] == [("102", "model_not_found")]
    comments = {r["col_name"]: r["comment"] for r in spark.sql("DESCRIBE TABLE llm.batch_outputs").collect()}
    assert comments["prompt_tokens"] == OUTPUTS_COLUMNS["prompt_tokens"][1]
    assert Path(result.output_file).read_text().count("\n") == 1
    assert spark.table("llm.batch_metrics").where("batch_id = 'tbl-b'").count() >= 1

    # the same batch id again: refused without --resume (nothing runs), redone with --overwrite
    with pytest.raises(ConfigError, match="already holds rows of batch 'tbl-b'.*--resume"):
        run_batch(spark, BatchConfig(output_dir=str(tmp_path / "o2"), **settings))
    again = run_batch(spark, BatchConfig(output_dir=str(tmp_path / "o3"), overwrite=True, **settings))
    assert again.completed == 1 and again.failed == 1
    assert spark.table("llm.batch_outputs").where("batch_id = 'tbl-b'").count() == 1
    assert spark.table("llm.batch_errors").where("batch_id = 'tbl-b'").count() == 1
    # the redone batch's metrics are its one run's: the report and a later --resume do not count the first run
    runs = spark.table("llm.batch_metrics").where("batch_id = 'tbl-b'").select("run_id").distinct().count()
    assert runs == 1 and again.batch.partition_plan.runs == 1


@pytest.mark.engine
def test_crash_after_first_wave_then_resume_is_exactly_once_on_s3(spark, s3, tiny_model, tmp_path):
    """The driver dies (exit 137, as kill -9) after its first wave's commit, everything in a bucket: input, tables,
    staging, files; the resumed run answers each line once. The dying run's session takes its S3A settings from the
    config's spark: section, as a user's does: its secret key is in none of the objects either run wrote, no line
    the dying one logged, and not on its Spark UI's environment page (read while the run is held before reading
    its input), and has Delta's and S3A's jars on its JVM's class path, none copied into its temporary directory."""
    import time
    import urllib.request

    import yaml

    from conftest import _load_script

    client = s3.client()
    client.create_bucket(Bucket="crashy")
    lines = [chat_line(f"w{i:02d}", f"request number {i} " * (1 + i % 5), temperature=0, max_tokens=4)
             for i in range(6)]
    lines.append(chat_line("rejected", "Hi", max_tokens=2, logprobs=True, top_logprobs=5))  # engine_error
    lines.append("garbage line")
    client.put_object(Bucket="crashy", Key="in/in.jsonl",
                      Body=write_jsonl(tmp_path / "in.jsonl", lines).read_bytes())
    source, out = "s3a://crashy/in/in.jsonl", "s3a://crashy/out"
    config = tmp_path / "s3.yaml"
    ui_port = _load_script("standalone_cluster").free_port()
    config.write_text(yaml.safe_dump({"spark": {**{f"spark.hadoop.{k}": v for k, v in s3.hadoop_settings().items()},
                                                "spark.ui.enabled": "true", "spark.ui.port": str(ui_port)}}))
    settings = engine_settings(tiny_model)
    args = [sys.executable, "-m", "spark_llm.cli", "run", "--config", str(config), "--input", source,
            "--output-dir", out, "--batch-id", "crashy", "--master", "local[1]", "--wave-partitions", "1",
            "--target-tokens-per-partition", "60", "--num-task-slots", "1"]
    for key in ("model", "served_model_name", "max_model_len", "max_num_seqs", "dtype", "kv_cache_memory_bytes",
                "default_max_tokens"):
        args += ["--" + key.replace("_", "-"), str(settings[key])]
    args += ["--enforce-eager", "--engine-kwargs", json.dumps(settings["engine_kwargs"])]  # the same engine as below
    release = tmp_path / "release"
    env = {**os.environ, FAULT_ENV: f"exit_after_wave:1;hold_read_until:{release}", "SPARK_LOCAL_IP": "127.0.0.1"}
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True, cwd=ROOT)
        try:
            while not (tmp_path / "release.held").exists():  # the run is under way, its input listed
                assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
                time.sleep(0.1)
            ui = f"http://127.0.0.1:{ui_port}"
            [app] = json.loads(urllib.request.urlopen(f"{ui}/api/v1/applications", timeout=30).read())
            environment = urllib.request.urlopen(f"{ui}/api/v1/applications/{app['id']}/environment",
                                                 timeout=30).read().decode()
            page = urllib.request.urlopen(f"{ui}/environment/", timeout=30).read().decode()
        finally:
            release.touch()
        proc.wait(timeout=600)
        stderr.seek(0)
        log = stderr.read()
    secret = _load_script("s3_server").SECRET_KEY
    assert '"spark.hadoop.fs.s3a.secret.key", "*********(redacted)"' in environment  # Spark's redaction.regex
    assert "Spark Properties" in page
    assert secret not in environment and secret not in page and secret not in log
    # a local session with the jars an earlier one resolved has them on its JVM's class path, none copied for it
    classpath = json.loads(environment)["classpathEntries"]
    assert not [path for path, source in classpath if source != "System Classpath"], classpath
    for jar in ("delta-spark", "hadoop-aws", "awssdk_bundle"):
        assert [path for path, _ in classpath if jar in path.rsplit("/", 1)[-1]], (jar, classpath)
    assert proc.returncode == 137, log[-3000:]
    assert "fault injection: driver exits after wave 1" in log
    waves = re.search(r"wave 1/(\d+) committed", log)
    assert waves and int(waves.group(1)) >= 3, log[-3000:]  # a handful of requests over several waves
    first_wave = spark.read.format("delta").load(f"{out}/delta/outputs").count()
    assert 0 < first_wave < 6

    cfg = dict(input=source, output_dir=out, batch_id="crashy", resume=True,
               **{**settings, "target_tokens_per_partition": 60})  # the rest in one wave
    resumed = run_batch(spark, BatchConfig(**cfg))
    outs = spark.read.format("delta").load(resumed.outputs_table)
    errs = spark.read.format("delta").load(resumed.errors_table)
    assert resumed.skipped >= first_wave + 1  # the first wave's rows and the validation error were not redone
    assert outs.count() == 6 and outs.select("custom_id").distinct().count() == 6
    assert sorted(r["code"] for r in errs.collect()) == ["engine_error", "invalid_json"]
    read = lambda name: client.get_object(Bucket="crashy", Key=f"out/{name}")["Body"].read().decode()  # noqa: E731
    assert len(read("output.jsonl").splitlines()) == 6
    assert json.loads(read("batch.json"))["request_counts"] == {"total": 8, "completed": 6, "failed": 2}
    written = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="crashy", Prefix="out/")
               for o in page.get("Contents", [])]
    assert "out/settings.json" in written
    assert not [k for k in written if secret.encode() in client.get_object(Bucket="crashy", Key=k)["Body"].read()]

    # the report describes the whole batch: the crashed run's committed wave and the resumed run's waves
    metrics = spark.read.format("delta").load(f"{out}/delta/metrics").collect()
    plan = resumed.batch.partition_plan
    assert plan.runs == 2 == len({m["run_id"] for m in metrics})
    assert plan.partitions_run == len(metrics) and sum(m["rows"] for m in metrics) == 7  # 6 answered + 1 rejected

    done = run_batch(spark, BatchConfig(**cfg))  # a finished batch: nothing new
    assert done.skipped == 8 and done.completed == 6 and done.failed == 2
    assert done.batch.partition_plan.runs == 2 and done.batch.partition_plan.engine_seconds > 0
    retried = run_batch(spark, BatchConfig(**{**cfg, "retry_errors": True}))  # the engine error runs again, once
    assert retried.skipped == 7
    assert spark.read.format("delta").load(resumed.errors_table).count() == 2
    assert spark.read.format("delta").load(resumed.outputs_table).count() == 6
