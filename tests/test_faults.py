"""Reliability: hostile input end to end (on the shared run), an empty file, an engine that cannot start, limits, and
logs free of prompt text. (The worker killed mid-partition is in the shared run too: test_end_to_end.)"""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from batch_lines import HOSTILE_FILE, OK, SECRET_PROMPT
from conftest import MODEL_NAME, chat_line, completion_line, engine_settings, write_jsonl
from spark_llm import BatchConfig, ConfigError, EngineStartError, run_batch


@pytest.fixture(scope="module")
def hostile(shared_run):
    """The shared run, its outcomes on hostile.jsonl keyed by line number."""
    expected = {line: e for (file, line), e in shared_run.expected.items() if file == HOSTILE_FILE}
    return shared_run.result, expected, shared_run.logs


def _in_hostile_file(rows):
    return [r for r in rows if r["file"].endswith("/" + HOSTILE_FILE)]


@pytest.mark.engine
def test_hostile_input_every_line_answered_once_with_the_right_code(spark, hostile):
    result, expected, _ = hostile
    outs = _in_hostile_file(spark.read.format("delta").load(result.outputs_table).collect())
    errs = _in_hostile_file(spark.read.format("delta").load(result.errors_table).collect())
    got = {}
    for r in outs:
        got.setdefault(r["line_number"], []).append(OK)
    for r in errs:
        got.setdefault(r["line_number"], []).append(r["code"])
    assert {n: v for n, v in got.items() if len(v) != 1} == {}
    assert {n: v[0] for n, v in got.items()} == expected
    ids = [r["custom_id"] for r in outs]
    assert len(ids) == len(set(ids)) == sum(1 for e in expected.values() if e == OK)
    assert {"Case", "case", "case ", "a\u00a0b", "a b", "no-trailing-newline"} <= set(ids)
    assert len([i for i in ids if unicodedata.normalize("NFC", i) == "café"]) == 2
    huge = next(r for r in errs if r["custom_id"] == "huge-prompt")
    assert "at least" in huge["message"] and len(huge["raw_line"]) <= 2048
    # broken lines carry the custom_id they show (bad bytes, a BOM inside the object, a lone surrogate, a number)
    carried = {r["custom_id"]: r["code"] for r in errs if r["code"] in ("invalid_json", "invalid_encoding",
                                                                      "invalid_custom_id")}
    assert {"bad-bytes": "invalid_encoding", "bom-mid": "invalid_json", "surrogate": "invalid_encoding",
            "17": "invalid_custom_id", "Case": "invalid_json"}.items() <= carried.items()
    assert len({r["id"] for r in outs + errs}) == len(outs) + len(errs)  # "Case" twice, two different line ids


@pytest.mark.engine
def test_info_logs_hold_no_prompt_or_response_text(spark, hostile):
    result, _, records = hostile
    text = "\n".join(records)
    assert "partition plan" in text and "committed" in text  # the run did log at INFO
    assert SECRET_PROMPT not in text
    first = spark.read.format("delta").load(result.outputs_table).where(F.col("custom_id") == "bom-start").first()
    assert first["text"] and first["text"] not in text


def test_empty_input_gives_empty_results_and_no_engine(spark, tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    result = run_batch(spark, BatchConfig(input=str(tmp_path / "empty.jsonl"), output_dir=str(tmp_path / "out"),
                                          model=str(tmp_path / "no-model-needed"), max_model_len=128))
    assert (result.total, result.completed, result.failed) == (0, 0, 0)
    assert Path(result.output_file).read_text() == "" and Path(result.error_file).read_text() == ""
    assert spark.read.format("delta").load(result.outputs_table).count() == 0
    batch = json.loads(Path(result.batch_file).read_text())
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0} and batch["status"] == "completed"


def test_max_requests_limit_stops_before_inference(spark, tmp_path, tiny_model):
    write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}") for i in range(5)])
    with pytest.raises(ConfigError, match="5 requests, over max_requests=3"):
        run_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"),
                                     max_requests=3, **engine_settings(tiny_model)))


@pytest.mark.engine
def test_engine_that_cannot_start_stops_the_job_with_one_clear_message(spark, tmp_path, tiny_model, engine_dir):
    from openai.types import Batch

    from spark_llm.engine_host import EngineSpec

    from spark_llm.models import resolve
    from spark_llm.engine_host import read_events

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    write_jsonl(tmp_path / "in.jsonl", [chat_line("a"), completion_line("b")])
    settings = {**engine_settings(tiny_model), "model": str(broken), "served_model_name": MODEL_NAME}
    with pytest.raises(EngineStartError) as info:
        run_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"), **settings))
    message = str(info.value)
    assert "could not start the engine" in message and str(broken) in message
    assert "gpu_memory_utilization" in message and "Traceback" not in message
    batch = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert batch["status"] == "failed" and batch["failed_at"] and batch["completed_at"] is None
    [reason] = batch["errors"]["data"]
    assert reason["code"] == "engine_start_failed" and "could not start the engine" in reason["message"]
    Batch.model_validate(batch)
    # the task's retries (8 attempts in the local session) did not load the model again: one try per engine slot
    key = EngineSpec.from_config(resolve(BatchConfig(**settings))).key
    tries = lambda: len([e for e in read_events(engine_dir) if e["key"] == key and e["event"] == "start"])  # noqa
    first = tries()
    assert 1 <= first <= 2  # which of the two slots the tasks reached is Spark's choice
    # the next run tries again (the cause may be fixed by then), once per slot its tasks reach
    with pytest.raises(EngineStartError):
        run_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "again"),
                                     **settings))
    assert 1 <= tries() - first <= 2


def test_a_missing_lora_adapter_stops_the_batch_before_any_work(spark, tmp_path, tiny_model):
    write_jsonl(tmp_path / "in.jsonl", [chat_line("a")])
    settings = {**engine_settings(tiny_model), "lora_modules": {"gone": str(tmp_path / "no-adapter-here")}}
    with pytest.raises(ConfigError, match="LoRA adapter 'gone'.*--lora-modules gone="):
        run_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"), **settings))
    batch = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "invalid_config"
    assert spark.read.format("delta").load(str(tmp_path / "out" / "delta" / "outputs")).count() == 0


@pytest.mark.engine
def test_a_line_larger_than_the_jvm_heap_is_one_error_row_and_its_neighbours_are_answered(spark, tmp_path,
                                                                                          tiny_model):
    """A broken concatenation: one 2.5 GB line (the test session's JVM has a 2 GB heap) between two requests. It is
    never held whole: it becomes one line_too_large row with its line number and first bytes."""
    heap = spark.sparkContext.getConf().get("spark.driver.memory")
    assert heap == "2g"
    path = tmp_path / "in.jsonl"
    huge = 2_500_000_000
    with open(path, "wb") as f:
        f.write(json.dumps(chat_line("before", temperature=0, max_tokens=2)).encode() + b"\n")
        head = b'{"custom_id": "huge-line", "body": "'
        f.write(head)
        block = b"x" * (64 << 20)
        written = 0
        while written < huge:
            f.write(block[:min(len(block), huge - written)])
            written += min(len(block), huge - written)
        f.write(b'"}\n')
        f.write(json.dumps(chat_line("after", temperature=0, max_tokens=2)).encode() + b"\n")
    try:
        result = run_batch(spark, BatchConfig(input=str(path), output_dir=str(tmp_path / "out"),
                                              **engine_settings(tiny_model)))
    finally:
        path.unlink()  # 2.5 GB of disk
    answered = {r["custom_id"] for r in spark.read.format("delta").load(result.outputs_table).collect()}
    [error] = spark.read.format("delta").load(result.errors_table).collect()
    assert answered == {"before", "after"} and (result.completed, result.failed) == (2, 1)
    assert (error["custom_id"], error["code"], error["line_number"]) == ("huge-line", "line_too_large", 2)
    assert f"line is {len(head) + huge + 2} bytes" in error["message"] and error["raw_line"].startswith('{"custom_id": "huge-line"')


def test_a_failure_from_the_jvm_is_one_readable_line():
    from spark_llm.errors import describe_exception

    class Py4JJavaError(Exception):
        pass

    exc = Py4JJavaError("An error occurred while calling o123.collect.\n: org.apache.spark.SparkException: Job "
                        "aborted due to stage failure: Task 0 in stage 3.0 failed 8 times\n\tat org.apache.spark."
                        "scheduler.DAGScheduler.failJob(DAGScheduler.scala:1)\nCaused by: java.lang.OutOfMemoryError:"
                        " Java heap space\n\tat java.base/java.util.Arrays.copyOf(Arrays.java:3537)\n")
    assert describe_exception(exc) == ("org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in "
                                       "stage 3.0 failed 8 times (cause: java.lang.OutOfMemoryError: Java heap space)")
    assert describe_exception(ValueError("bad")) == "ValueError: bad"
