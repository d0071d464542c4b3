"""The whole job on real Spark, real Delta and real vLLM (CPU) with the tiny model: every rule on one input (the
shared run, see conftest.py and batch_lines.py), run twice: with a classic session, and over Spark Connect (a local
Connect server with Delta). The tables and files are read back with the classic session either way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

from batch_lines import OK
from conftest import ADAPTER, KILL_CUSTOM_ID, MODEL_NAME, POISON_ENGINE_ID, POISON_WORKER_ID, ROOT, engine_settings
from spark_llm import BatchConfig, ConfigError, run_batch
from spark_llm.report_html import PLOTS
from spark_llm.schemas import ERRORS_COLUMNS, ERRORS_STATS, OUTPUTS_COLUMNS, OUTPUTS_STATS, BatchOutputLine

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["classic", pytest.param("connect", marks=pytest.mark.drill("connect"))])
def session_run(request):
    """The shared run (classic session) or the same batch over Spark Connect."""
    return request.getfixturevalue("shared_run" if request.param == "classic" else "connect_run")


@pytest.fixture(scope="module")
def run(session_run):
    return session_run.result, session_run.expected, session_run.root


def outputs_df(spark, result):
    return spark.read.format("delta").load(result.outputs_table)


def errors_df(spark, result):
    return spark.read.format("delta").load(result.errors_table)


def test_every_line_ends_exactly_once_in_the_delta_tables(spark, run):
    result, expected, _ = run
    outs = outputs_df(spark, result).collect()
    errs = errors_df(spark, result).collect()
    seen = {}
    for r in outs:
        seen.setdefault((r["file"].rsplit("/", 1)[-1], r["line_number"]), []).append(OK)
    for r in errs:
        seen.setdefault((r["file"].rsplit("/", 1)[-1], r["line_number"]), []).append(r["code"])
    assert {k: v for k, v in seen.items() if len(v) != 1} == {}
    assert {k: v[0] for k, v in seen.items()} == expected
    assert len({r["custom_id"] for r in outs}) == len(outs)
    assert result.total == len(expected) and result.completed == len(outs) and result.failed == len(errs)
    assert {r["batch_id"] for r in outs + errs} == {"b-e2e"}


def test_error_rows_are_attributed(spark, run):
    result, _, _ = run
    errs = {(r["file"].rsplit("/", 1)[-1], r["line_number"]): r for r in errors_df(spark, result).collect()}
    dup = errs[("a.jsonl", 25)]
    assert dup["custom_id"] == "chat-greedy" and "line 1" in dup["message"]
    cross = errs[("b.jsonl", 1)]
    assert cross["custom_id"] == "zh-1" and "line 2 of" in cross["message"] and "a.jsonl" in cross["message"]
    assert errs[("a.jsonl", 11)]["custom_id"] is None and errs[("a.jsonl", 11)]["raw_line"] == "this is not json"
    # a broken line that shows its custom_id is attributed to it; the code still says what is wrong
    assert (errs[("a.jsonl", 13)]["custom_id"], errs[("a.jsonl", 13)]["code"]) == ("bad-utf8", "invalid_encoding")
    too_long = errs[("a.jsonl", 24)]
    assert too_long["custom_id"] == "too-long" and "1024" in too_long["message"] and "max_tokens is 8" in too_long["message"]
    assert errs[("a.jsonl", 18)]["custom_id"] == "wrong-model"
    engine = errs[("a.jsonl", 26)]
    assert engine["custom_id"] == "engine-reject" and engine["code"] == "engine_error" and "logprobs" in engine["message"]
    assert all(r["id"].startswith("batch_req_") for r in errs.values())


def test_custom_ids_are_echoed_exactly(spark, run):
    result, _, _ = run
    ids = {r["custom_id"] for r in outputs_df(spark, result).collect()}
    assert "  spaced id " in ids and "bom-in-line" in ids and "crlf" in ids


def test_openai_files_match_the_tables_and_validate(spark, run):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    result, expected, _ = run
    out_lines = [json.loads(x) for x in Path(result.output_file).read_text(encoding="utf-8").splitlines()]
    err_lines = [json.loads(x) for x in Path(result.error_file).read_text(encoding="utf-8").splitlines()]
    assert len(out_lines) == result.completed and len(err_lines) == result.failed
    assert len(out_lines) + len(err_lines) == len(expected)
    ids = [x["id"] for x in out_lines + err_lines]
    assert len(set(ids)) == len(ids)
    for line in out_lines:
        parsed = BatchOutputLine.model_validate(line)
        assert parsed.error is None and parsed.response.status_code == 200
        body = parsed.response.body
        model = {"chat.completion": ChatCompletion, "text_completion": Completion, "response": Response}
        obj = model[body["object"]].model_validate(body)
        usage = body["usage"]
        assert obj.model in (MODEL_NAME, ADAPTER) and usage["total_tokens"] == usage.get(
            "prompt_tokens", usage.get("input_tokens")) + usage.get("completion_tokens", usage.get("output_tokens"))
        assert obj.id.endswith(parsed.response.request_id.split("_", 1)[1])
    for line in err_lines:
        parsed = BatchOutputLine.model_validate(line)
        assert parsed.response is None and parsed.error.code and parsed.error.message
    assert {x["custom_id"] for x in out_lines} == {r["custom_id"] for r in outputs_df(spark, result).collect()}


def test_delta_tables_read_back_like_the_files(spark, run):
    result, _, _ = run
    from_file = (spark.read.text(result.output_file)
                 .select(F.get_json_object("value", "$.custom_id").alias("custom_id"),
                         F.coalesce(F.get_json_object("value", "$.response.body.usage.completion_tokens"),
                                    F.get_json_object("value", "$.response.body.usage.output_tokens"))
                         .cast("long").alias("completion_tokens")))
    from_table = outputs_df(spark, result).select("custom_id", "completion_tokens")
    assert_df_equality(from_table, from_file, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)
    errors_from_file = spark.read.text(result.error_file).select(
        F.get_json_object("value", "$.id").alias("id"), F.get_json_object("value", "$.error.code").alias("code"))
    assert_df_equality(errors_df(spark, result).select("id", "code"), errors_from_file, ignore_row_order=True,
                       ignore_nullable=True, ignore_metadata=True)


def test_tables_carry_column_comments(spark, run):
    result, _, _ = run
    for df, columns in ((outputs_df(spark, result), OUTPUTS_COLUMNS), (errors_df(spark, result), ERRORS_COLUMNS)):
        assert df.columns == list(columns)
        assert all(f.metadata.get("comment") == columns[f.name][1] for f in df.schema.fields)


def test_result_tables_keep_file_statistics_on_their_keys_only(run):
    result, _, _ = run
    for table, stats in ((result.outputs_table, OUTPUTS_STATS), (result.errors_table, ERRORS_STATS)):
        added = [json.loads(line)["add"] for log in sorted(Path(table, "_delta_log").glob("*.json"))
                 for line in log.read_text().splitlines() if '"add"' in line]
        assert added, table  # the run appended files
        for action in added:
            recorded = json.loads(action["stats"])
            assert set(recorded["nullCount"]) == set(stats), table  # not the response bodies or raw lines


def test_responses_content_and_usage(spark, run, tiny_model):
    from transformers import AutoTokenizer

    result, _, _ = run
    rows = {r["custom_id"]: r for r in outputs_df(spark, result).collect()}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for cid in ("chat-greedy", "zh-1", "n2", "lp"):
        row = rows[cid]
        messages = json.loads(row["request"])["body"]["messages"]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert row["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    for row in rows.values():
        usage = json.loads(row["response_body"])["usage"]
        assert usage.get("prompt_tokens", usage.get("input_tokens")) == row["prompt_tokens"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) == row["completion_tokens"]
    assert rows["chat-greedy"]["completion_tokens"] == 6 and rows["chat-greedy"]["finish_reason"] == "length"
    n2 = json.loads(rows["n2"]["response_body"])
    assert [c["index"] for c in n2["choices"]] == [0, 1] and n2["usage"]["completion_tokens"] <= 8
    lp = json.loads(rows["lp"]["response_body"])["choices"][0]["logprobs"]["content"]
    assert len(lp) == 3 and all(len(p["top_logprobs"]) == 2 and p["logprob"] <= 0 for p in lp)
    clp = json.loads(rows["comp-1"]["response_body"])["choices"][0]["logprobs"]
    assert len(clp["tokens"]) == len(clp["token_logprobs"]) == len(clp["top_logprobs"]) == 5
    assert json.loads(rows["comp-ids"]["response_body"])["usage"]["prompt_tokens"] == 4


def test_batch_object(spark, run):
    from openai.types import Batch

    result, _, _ = run
    batch = json.loads(Path(result.batch_file).read_text())
    parsed = Batch.model_validate(batch)  # openai-python's own model of the batch object
    assert batch == json.loads(result.batch.to_json())
    assert parsed.request_counts.total == result.total and all(isinstance(v, str) for v in parsed.metadata.values())
    assert parsed.endpoint == "/v1/chat/completions,/v1/completions,/v1/responses"  # this batch mixes all three
    outs = outputs_df(spark, result).agg(F.sum("prompt_tokens"), F.sum("completion_tokens")).first()
    assert batch["id"] == "b-e2e" and batch["object"] == "batch" and batch["status"] == "completed"
    assert batch["request_counts"] == {"total": result.total, "completed": result.completed, "failed": result.failed}
    assert batch["usage"]["input_tokens"] == outs[0] and batch["usage"]["output_tokens"] == outs[1]
    assert batch["usage"]["total_tokens"] == outs[0] + outs[1]
    assert batch["created_at"] <= batch["in_progress_at"] <= batch["completed_at"]
    listed = sorted((e["file"].rsplit("/", 1)[-1], e["line"], e["code"]) for e in batch["errors"]["data"])
    unattributed = errors_df(spark, result).where(F.col("custom_id").isNull()).count()
    assert len(listed) == batch["errors"]["total"] == unattributed
    # only the lines that show no custom_id at all (a.jsonl 13 is broken UTF-8 but shows "bad-utf8")
    assert [e for e in listed if e[0] != "hostile.jsonl"] == [("a.jsonl", 11, "invalid_json"),
                                                              ("a.jsonl", 12, "invalid_json"),
                                                              ("a.jsonl", 14, "invalid_custom_id"),
                                                              ("b.jsonl", 3, "invalid_json")]
    plan = batch["partition_plan"]
    # every request that reached the engine was planned: the completed ones, the one the engine rejected and the two
    # poison requests
    assert plan["num_partitions"] == plan["task_slots"] == 4 and plan["engines"] == 2  # two engines, two tasks each
    assert sum(plan["requests_per_partition"]) == result.completed + 3
    # the run's settings beside it, whole (the console and the INFO log do not carry them)
    settings = json.loads(Path(result.batch_file).with_name("settings.json").read_text())
    assert (settings["batch_id"], settings["max_model_len"], settings["max_num_seqs"]) == ("b-e2e", 1024, 8)


def test_non_empty_output_dir_is_refused(spark, run, tiny_model):
    result, _, root = run
    cfg = BatchConfig(input=str(root / "input"), output_dir=result.output_dir, **engine_settings(tiny_model))
    with pytest.raises(ConfigError, match="not empty.*--overwrite"):
        run_batch(spark, cfg)
    assert Path(result.output_file).exists()


def test_metrics_table_agrees_with_the_outputs(spark, run):
    result, _, _ = run
    metrics = spark.read.format("delta").load(result.batch.metadata["metrics_table"]) \
        .where(F.col("batch_id") == "b-e2e").collect()
    outs = outputs_df(spark, result).agg(F.sum("prompt_tokens"), F.sum("completion_tokens")).first()
    plan = result.batch.partition_plan
    assert sorted(m["partition"] for m in metrics) == list(range(plan.num_partitions))
    assert sum(m["rows"] for m in metrics) == sum(plan.requests_per_partition)
    assert sum(m["prompt_tokens"] for m in metrics) == outs[0] == result.batch.usage.input_tokens
    assert sum(m["completion_tokens"] for m in metrics) == outs[1] == result.batch.usage.output_tokens
    assert sum(json.loads(m["errors_by_code"]).get("engine_error", 0) for m in metrics) == 3  # 1 rejected, 2 poison
    assert all(m["engine_seconds"] > 0 and m["finished_at"] >= m["started_at"] for m in metrics)
    # busy fraction: the time each engine had requests of some partition, over (engines x the run's inference
    # wall), one run; counted here on a 10 ms grid
    assert len({m["run_id"] for m in metrics}) == 1 and {m["task_slots"] for m in metrics} == {plan.task_slots}
    assert {m["engines"] for m in metrics} == {plan.engines} and plan.task_slots % plan.engines == 0
    assert all(m["engine_started_at"] <= m["engine_finished_at"] for m in metrics)
    start = min(m["started_at"] for m in metrics).timestamp()
    wall = max(m["finished_at"] for m in metrics).timestamp() - start
    busy_ticks = 0
    for engine in {(m["engine_slot"], m["engine_pid"]) for m in metrics}:
        ticks = set()
        for m in metrics:
            if (m["engine_slot"], m["engine_pid"]) == engine:
                ticks.update(range(round((m["engine_started_at"].timestamp() - start) * 100),
                                   round((m["engine_finished_at"].timestamp() - start) * 100)))
        busy_ticks += len(ticks)
    busy = busy_ticks / 100 / (plan.engines * wall)
    assert plan.runs == 1 and plan.busy_fraction == pytest.approx(busy, abs=5e-3) and 0 < busy <= 1
    assert f"engines busy {plan.busy_fraction:.1%}" in result.summary()
    # the engines' prefix-cache counts: per partition in the table, per request in the bodies, the same total
    details = [json.loads(r["response_body"])["usage"] for r in outputs_df(spark, result).collect()]
    cached = sum((u.get("prompt_tokens_details") or u.get("input_tokens_details"))["cached_tokens"] for u in details)
    assert sum(m["cached_prompt_tokens"] for m in metrics) == cached
    assert plan.prefix_cache_hit_rate == round(cached / outs[0], 4)


def test_report_html_has_the_summary_and_plots(run):
    result, expected, _ = run
    page = Path(result.batch.metadata["report_file"]).read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and "Batch b-e2e" in page
    for name in PLOTS:  # inline SVG, one bar per partition in the per-partition plots
        assert f'<svg role="img" aria-label="{name}"' in page
    partitions = len(result.batch.partition_plan.tokens_per_partition)
    balance = page.split(f'aria-label="{PLOTS[1]}"')[1].split("</svg>")[0]
    assert balance.count("<rect") == partitions
    invalid_json = sum(1 for outcome in expected.values() if outcome == "invalid_json")
    assert "<td>engine_error</td><td>3</td>" in page and f"<td>invalid_json</td><td>{invalid_json}</td>" in page
    busy = result.batch.partition_plan.busy_fraction
    assert f"<th>engine busy fraction (busy time / (engines x inference wall))</th><td>{busy:.1%}</td>" in page


def test_progress_line_in_driver_log(run, session_run):
    result, _, _ = run
    progress = [m for m in session_run.logs if m.startswith("progress b-e2e: wave ")]
    assert progress, session_run.logs
    engine_errors = 3  # one request the engine rejects, two poison requests
    assert f"requests {result.completed + engine_errors}/{result.completed + engine_errors} (100.0%)" in progress[-1]
    assert "tok/s" in progress[-1] and "eta" in progress[-1]


def test_worker_killed_mid_partition_is_retried_exactly_once(spark, run, session_run):
    result, _, _ = run
    assert session_run.kill_marker.exists()  # the worker holding KILL_CUSTOM_ID's partition really died after its engine call
    killed = outputs_df(spark, result).where(F.col("custom_id") == KILL_CUSTOM_ID).collect()
    assert len(killed) == 1 and killed[0]["completion_tokens"] == 2
    assert Path(result.output_file).read_text().count(f'"custom_id":"{KILL_CUSTOM_ID}"') == 1


def test_poison_requests_are_set_aside_and_the_rest_of_their_partitions_answered(spark, run, session_run, tiny_model):
    """One request kills its Python worker, one its engine process, on every attempt (spark_llm.faults): each ends
    as one engine_error row, every other line as expected (test_every_line_ends_exactly_once_in_the_delta_tables)."""
    from spark_llm.engine_host import EngineSpec
    from spark_llm.models import resolve
    from spark_llm.engine_host import read_events

    result, _, _ = run
    poison = errors_df(spark, result).where(F.col("custom_id").isin(POISON_WORKER_ID, POISON_ENGINE_ID)).collect()
    assert sorted((r["custom_id"], r["code"]) for r in poison) == [(POISON_ENGINE_ID, "engine_error"),
                                                                  (POISON_WORKER_ID, "engine_error")]
    assert all("died twice while running this request" in r["message"] for r in poison)
    metrics = spark.read.format("delta").load(result.batch.metadata["metrics_table"]).collect()
    # each was in flight at two deaths at least, one death may hold both: the deaths are on record ...
    assert sum(m["engine_deaths"] for m in metrics if m["batch_id"] == "b-e2e") >= 3
    # ... and the engine killed under a live worker was rebuilt in place (twice at least) during the run
    key = EngineSpec.from_config(resolve(BatchConfig(**engine_settings(tiny_model)))).key
    rebuilt = [e for e in read_events(session_run.engine_dir) if e["event"] == "ready" and e["key"] == key
               and result.batch.created_at <= e["time"] <= result.batch.completed_at]
    assert len(rebuilt) >= 2
    # the journal of the run went with the staging area
    assert not Path(result.output_dir, "_staging").exists()


def test_dry_run_plans_the_same_batch_without_an_engine_or_writes(spark, run, tiny_model, tmp_path, engine_dir):
    from spark_llm import plan_batch
    from spark_llm.engine_host import read_events

    import time

    result, expected, root = run
    began = time.time()
    untouched = tmp_path / "never-written"
    plan = plan_batch(spark, BatchConfig(input=str(root / "input"), output_dir=str(untouched),
                                         **engine_settings(tiny_model)), tokens_per_second=100.0)
    errors = errors_df(spark, result).where(F.col("code") != "engine_error").groupBy("code").count().collect()
    assert plan.errors_by_code == {r["code"]: r["count"] for r in errors}
    # + the one the engine rejects and the two poison requests
    assert plan.lines == len(expected) and plan.requests == result.completed + 3
    # the same token counts as the run: its prompts, plus the three short ones that ended as engine errors
    assert 0 < plan.prompt_tokens - result.batch.usage.input_tokens < 3 * 32
    assert plan.max_output_tokens >= result.batch.usage.output_tokens
    assert (plan.partitions, plan.waves) == (result.batch.partition_plan.num_partitions, 1)
    assert plan.engine_seconds == (plan.prompt_tokens + plan.max_output_tokens) / 100.0
    assert "engine time" in plan.summary() and "100 tokens/s" in plan.summary()
    # nothing written, no engine started (engines of earlier runs may still be recording their stops)
    assert not untouched.exists() and [e for e in read_events(engine_dir)
                                       if e["event"] == "start" and e["time"] >= began] == []


def test_the_local_dry_run_plans_what_the_spark_one_does(spark, shared_run, tiny_model, tmp_path):
    """The dry run of a small local input runs in the CLI's own process (no JVM); on the shared run's ordinary,
    hostile and request-shape files it gives the plan the Spark dry run gives."""
    from spark_llm import plan_batch
    from spark_llm.plan import plan_local

    cfg = BatchConfig(input=str(shared_run.root / "input"), output_dir=str(tmp_path / "none"),
                      **engine_settings(tiny_model))
    assert plan_local(cfg, "local[4]", tokens_per_second=100.0) == plan_batch(spark, cfg, tokens_per_second=100.0)


def test_spark_llm_plan_of_a_local_file_starts_no_jvm_and_imports_no_vllm(shared_run, tiny_model, tmp_path):
    """The command a user types: a file whose name needs quoting in its URI, planned in the command's process."""
    import shutil

    source = sorted((shared_run.root / "input").glob("*.jsonl"))[0]
    path = tmp_path / "my batch%.jsonl"
    shutil.copy(source, path)
    settings = engine_settings(tiny_model)
    args = ["plan", "--input", str(path), "--output-dir", str(tmp_path / "none"), "--model", settings["model"],
            "--max-model-len", str(settings["max_model_len"]), "--tokens-per-second", "100"]
    probe = ("import sys; from pyspark import SparkContext; from spark_llm.cli import main; rc = main(sys.argv[1:]); "
             "print('probe', rc, SparkContext._gateway is None, 'vllm' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.stdout.splitlines()[-1:] == ["probe 0 True False"], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "plan: " in proc.stdout and "100 tokens/s" in proc.stdout


def test_a_small_local_input_is_prepared_in_process_into_the_rows_spark_s_executors_make(spark, shared_run,
                                                                                           tiny_model):
    """A local session prepares a small JSONL input in the driver's process (no Python workers, no first Spark
    jobs); on the shared run's ordinary, hostile and request-shape files every column of every row is what the
    executors make: validation, duplicates (and their messages), token ids, prefix keys, line ids."""
    from spark_llm.models import resolve, resolve_models
    from spark_llm.prepare import prepare_in_process, prepare_on_spark, prepares_in_process

    cfg = BatchConfig(input=str(shared_run.root / "input"), output_dir="/tmp/unused", batch_id="b-parity",
                      **engine_settings(tiny_model))
    models = resolve_models(resolve(cfg))
    assert prepares_in_process(spark, cfg)  # what a run in this session does with it

    def rows(df):
        return sorted((r.asDict(recursive=True) for r in df.collect()), key=lambda r: (r["file"], r["line_number"]))
    in_process, on_spark = rows(prepare_in_process(spark, models).rows), rows(prepare_on_spark(spark, models))
    assert len(in_process) == len(shared_run.expected) and in_process == on_spark
    assert {r["error_code"] for r in in_process} >= {None, "duplicate_custom_id", "invalid_json", "invalid_encoding"}


def test_a_large_local_input_prepared_in_two_parts_infers_the_first_while_the_rest_is_prepared(
        spark, tiny_model, tmp_path, monkeypatch):
    """From prepare.PARTS_BYTES on (lowered here), a local input prepared in the driver's process comes in two parts:
    the first wave of the first HEAD_LINES lines is submitted before the rest is prepared; the listener hears the
    whole input's counts before any commit; duplicates are found across the parts; every line ends exactly once;
    batch.json's plan joins the parts' plans."""
    import threading

    from conftest import chat_line, write_jsonl
    from spark_llm import pipeline, prepare
    from spark_llm.context import RunListener

    monkeypatch.setattr(prepare, "PARTS_BYTES", 0)
    monkeypatch.setattr(prepare, "HEAD_LINES", 10)
    lines = [chat_line(f"p{i}", f"Count to {i}.", temperature=0, max_tokens=2) for i in range(30)]
    lines[4], lines[22] = "not json", chat_line("p1", "a duplicate of line 2, in the second part")
    source = write_jsonl(tmp_path / "parts.jsonl", lines)
    wave_submitted, heard = threading.Event(), []

    class Heard(RunListener):
        def validated(self, total, invalid, answered):
            heard.append(("validated", total, invalid))

        def committed(self, responses, errors):
            heard.append(("committed", responses, errors))

        def before_wave(self):
            wave_submitted.set()
            return 0
    rest_waited_for_the_first_wave = []
    prepare_rest = prepare.PreparingRest._prepare

    def after_the_first_wave(self, chunks):
        rest_waited_for_the_first_wave.append(wave_submitted.wait(timeout=120))
        prepare_rest(self, chunks)
    monkeypatch.setattr(prepare.PreparingRest, "_prepare", after_the_first_wave)

    cfg = BatchConfig(input=str(source), output_dir=str(tmp_path / "out"), batch_id="b-parts",
                      **engine_settings(tiny_model))
    result = pipeline.run_batch(spark, cfg, Heard())

    assert rest_waited_for_the_first_wave == [True]
    assert heard[0] == ("validated", 30, 2) and [h[0] for h in heard[1:]] == ["committed"] * (len(heard) - 1)
    assert sum(h[1] for h in heard[1:]) == result.completed == 28
    out = spark.read.format("delta").load(result.outputs_table)
    err = spark.read.format("delta").load(result.errors_table)
    assert sorted(r.line_number for r in out.select("line_number").collect() + err.select("line_number").collect()) \
        == list(range(1, 31))
    assert {(r.line_number, r.code) for r in err.collect()} == {(5, "invalid_json"), (23, "duplicate_custom_id")}
    plan = result.batch.partition_plan
    assert plan.waves == 2 and sum(plan.requests_per_partition) == 28
    assert plan.num_partitions == len(plan.tokens_per_partition) == len(plan.requests_per_partition) > 1
