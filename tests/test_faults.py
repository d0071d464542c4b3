"""Reliability: hostile input end to end, an empty file, a worker killed mid-partition, an engine that cannot start,
limits, and logs free of prompt text."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from conftest import MODEL_NAME, capture_logs, chat_line, completion_line, engine_settings, write_jsonl
from spark_llm import BatchConfig, ConfigError, EngineStartError, run_batch
from spark_llm.infer import FAULT_ENV

OK = "ok"
SECRET_PROMPT = "zebra-violet-secret-prompt"


def body(**kw):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **kw}


def env(cid, **kw):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body(**kw)}


def hostile_cases() -> list[tuple[object, str | None]]:
    """(line, expected outcome); None for lines that are blank and produce nothing."""
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    cases: list[tuple[object, str | None]] = [
        (b"\xef\xbb\xbf" + json.dumps(chat_line("bom-start", SECRET_PROMPT, temperature=0, max_tokens=2)).encode(), OK),
        (b'{"custom_id": "bad-bytes", "x": "\xc3\x28"}', "invalid_encoding"),
        (b'{"custom_id": "bom-mid",\xef\xbb\xbf "method": "POST"}', "invalid_json"),
        (json.dumps(chat_line("crlf", temperature=0, max_tokens=2)).encode() + b"\r", OK),
        (b'{"custom_id": "surrogate", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-llm", "messages": [{"role": "user", "content": "\\ud800"}]}}', "invalid_encoding"),
        (b"", None),
        (b"not json at all", "invalid_json"),
        (b"42", "invalid_json"),
        (b"null", "invalid_json"),
        (b"[" * 50000 + b"]" * 50000, "invalid_json"),
        (json.dumps(chat_line("huge-prompt", "word " * 1_000_000)).encode(), "context_length_exceeded"),
        # envelope: each field missing, null, wrong type, empty
        ({k: v for k, v in env("x").items() if k != "custom_id"}, "invalid_custom_id"),
        ({**env("x"), "custom_id": None}, "invalid_custom_id"),
        ({**env("x"), "custom_id": 17}, "invalid_custom_id"),
        ({**env("x"), "custom_id": ""}, "invalid_custom_id"),
        ({k: v for k, v in env("no-method").items() if k != "method"}, "invalid_method"),
        ({**env("null-method"), "method": None}, "invalid_method"),
        ({**env("int-method"), "method": 1}, "invalid_method"),
        ({**env("put"), "method": "PUT"}, "invalid_method"),
        ({k: v for k, v in env("no-url").items() if k != "url"}, "unsupported_endpoint"),
        ({**env("null-url"), "url": None}, "unsupported_endpoint"),
        ({**env("empty-url"), "url": ""}, "unsupported_endpoint"),
        ({**env("v2-url"), "url": "/v2/chat/completions"}, "unsupported_endpoint"),
        ({**env("slash-url"), "url": "/v1/chat/completions/"}, "unsupported_endpoint"),
        ({**env("resp-url"), "url": "/v1/responses"}, "unsupported_endpoint"),
        ({k: v for k, v in env("no-body").items() if k != "body"}, "invalid_request"),
        ({**env("null-body"), "body": None}, "invalid_request"),
        ({**env("list-body"), "body": []}, "invalid_request"),
        # custom_ids that differ only by case, whitespace, normal form or a non-breaking space: all distinct
        (chat_line("Case", temperature=0, max_tokens=2), OK),
        (chat_line("case", temperature=0, max_tokens=2), OK),
        (chat_line("case ", temperature=0, max_tokens=2), OK),
        (chat_line(nfc, temperature=0, max_tokens=2), OK),
        (chat_line(nfd, temperature=0, max_tokens=2), OK),
        (chat_line("a\u00a0b", temperature=0, max_tokens=2), OK),
        (chat_line("a b", temperature=0, max_tokens=2), OK),
        (chat_line("case", "again"), "duplicate_custom_id"),
        (chat_line("case", "and again"), "duplicate_custom_id"),
        # body
        (env("model-other", model="gpt-4o"), "model_not_found"),
        (env("model-case", model="Tiny-LLM"), "model_not_found"),
        (env("model-space", model="tiny-llm "), "model_not_found"),
        (env("model-empty", model=""), "model_not_found"),
        (env("msgs-empty", messages=[]), "invalid_request"),
        (env("msgs-str", messages="hi"), "invalid_request"),
        (env("msgs-items", messages=[1, 2]), "invalid_request"),
        (env("msgs-role", messages=[{"role": "god", "content": "x"}]), "invalid_request"),
        (env("msgs-content", messages=[{"role": "user", "content": {"a": 1}}]), "invalid_request"),
        (env("msgs-blank", messages=[{"role": "user", "content": ""}]), "invalid_request"),
        (env("stream", stream=True), "unsupported_parameter"),
        (env("n0", n=0), "invalid_request"),
        (env("temp-neg", temperature=-1), "invalid_request"),
        (env("top-p-0", top_p=0), "invalid_request"),
        (env("top-p-big", top_p=1.01), "invalid_request"),
        (env("pen", presence_penalty=2.5), "invalid_request"),
        (env("max0", max_tokens=0), "invalid_request"),
        (env("stops", stop=["a", "b", "c", "d", "e"]), "invalid_request"),
        (env("lp-type", logprobs="yes"), "invalid_request"),
        (env("tools", tools=[{"type": "function"}]), "unsupported_parameter"),
        (env("fmt", response_format={"type": "json_object"}), "unsupported_parameter"),
        (completion_line("echo", echo=True), "unsupported_parameter"),
        (completion_line("comp-ok", temperature=0, max_tokens=3), OK),
    ]
    return cases


@pytest.fixture(scope="module")
def hostile(spark, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    cases = hostile_cases()
    (root / "in").mkdir()
    data = b"\n".join(c if isinstance(c, bytes) else json.dumps(c, ensure_ascii=False).encode() for c, _ in cases)
    last = json.dumps(chat_line("no-trailing-newline", temperature=0, max_tokens=2)).encode()
    (root / "in" / "hostile.jsonl").write_bytes(data + b"\n" + last)  # last line without newline
    expected = {i + 1: e for i, (_, e) in enumerate(cases) if e is not None}
    expected[len(cases) + 1] = OK
    with capture_logs() as records:
        result = run_batch(spark, BatchConfig(input=str(root / "in"), output_dir=str(root / "out"),
                                              batch_id="hostile", **engine_settings(tiny_model)))
    return result, expected, records


def test_hostile_input_every_line_answered_once_with_the_right_code(spark, hostile):
    result, expected, _ = hostile
    outs = spark.read.format("delta").load(result.outputs_table).collect()
    errs = spark.read.format("delta").load(result.errors_table).collect()
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
    out_lines = Path(result.output_file).read_text(encoding="utf-8").splitlines()
    err_lines = Path(result.error_file).read_text(encoding="utf-8").splitlines()
    assert len(out_lines) == len(outs) and len(err_lines) == len(errs)
    huge = next(r for r in errs if r["custom_id"] == "huge-prompt")
    assert "at least" in huge["message"] and len(huge["raw_line"]) <= 2048


def test_info_logs_hold_no_prompt_or_response_text(spark, hostile):
    result, _, records = hostile
    text = "\n".join(records)
    assert "settings" in text and "completed" in text  # the run did log at INFO
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
def test_worker_killed_mid_partition_is_retried_exactly_once(spark, tmp_path, tiny_model):
    lines = [chat_line(f"k{i}", f"question {i}", temperature=0, max_tokens=2) for i in range(12)]
    write_jsonl(tmp_path / "in.jsonl", lines)
    marker = tmp_path / "killed.marker"
    spark.sparkContext.environment[FAULT_ENV] = f"kill_worker_once:{marker}"
    try:
        result = run_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"),
                                              **engine_settings(tiny_model)))
    finally:
        del spark.sparkContext.environment[FAULT_ENV]
    assert marker.exists()  # a worker really died
    outs = spark.read.format("delta").load(result.outputs_table)
    assert result.completed == 12 and result.failed == 0
    assert outs.count() == 12 and outs.select("custom_id").distinct().count() == 12
    assert len(Path(result.output_file).read_text().splitlines()) == 12


@pytest.mark.engine
def test_engine_that_cannot_start_stops_the_job_with_one_clear_message(spark, tmp_path, tiny_model):
    from openai.types import Batch

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
