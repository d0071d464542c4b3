"""Several models in one batch: requests routed by body.model to the tiny Llama, its LoRA adapter and the tiny
embedding model (an extra model), inference model by model, every line once with the right model in its response,
and the model as a dimension of the metrics table, batch.json and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ADAPTER, MODEL_NAME, capture_logs, chat_line, engine_settings, write_jsonl

pytestmark = pytest.mark.engine

EMBED = "tiny-embed"  #: the extra model's served name


def embedding_line(custom_id: str, text, model: str = EMBED) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": text}}


#: custom_id -> (line, the model its response names, or the error code)
LINES = {
    **{f"base-{i}": (chat_line(f"base-{i}", f"Tell me about {i}", temperature=0), MODEL_NAME) for i in range(6)},
    **{f"lora-{i}": (chat_line(f"lora-{i}", f"Tell me about {i}", model=ADAPTER, temperature=0), ADAPTER)
       for i in range(4)},
    **{f"emb-{i}": (embedding_line(f"emb-{i}", [f"document {i}", "a shared sentence"]), EMBED) for i in range(6)},
    "chat-on-embed": (chat_line("chat-on-embed", model=EMBED), "unsupported_endpoint"),
    "embed-on-llm": (embedding_line("embed-on-llm", "x", model=MODEL_NAME), "unsupported_endpoint"),
    "no-such-model": (chat_line("no-such-model", model="gpt-4o"), "model_not_found"),
}


@pytest.fixture(scope="module")
def mixed(spark, tiny_model, embedding_model, tmp_path_factory):
    from spark_llm import BatchConfig, run_batch

    root = tmp_path_factory.mktemp("multi")
    write_jsonl(root / "in.jsonl", [line for line, _ in LINES.values()])
    # the extra model as --extra-model NAME=PATH gives it: kind auto (its sentence-transformers files say embed)
    cfg = BatchConfig(input=str(root / "in.jsonl"), output_dir=str(root / "out"), batch_id="b-multi",
                      models=[{"name": EMBED, "path": embedding_model, "max_model_len": 512}],
                      **engine_settings(tiny_model))
    with capture_logs() as messages:
        result = run_batch(spark, cfg)
    return result, messages


def test_every_line_once_with_the_model_it_named(spark, mixed):
    result, _ = mixed
    from openai.types import CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    outputs = spark.read.format("delta").load(result.outputs_table).collect()
    errors = spark.read.format("delta").load(result.errors_table).collect()
    got = {**{r["custom_id"]: json.loads(r["response_body"])["model"] for r in outputs},
           **{r["custom_id"]: r["code"] for r in errors}}
    assert len(outputs) + len(errors) == len(got) == len(LINES)
    assert got == {cid: want for cid, (_, want) in LINES.items()}
    assert {r["custom_id"]: r["model"] for r in outputs} == {cid: m for cid, m in got.items() if cid in
                                                            {r["custom_id"] for r in outputs}}
    bodies = {r["custom_id"]: json.loads(r["response_body"]) for r in outputs}
    ChatCompletion.model_validate(bodies["lora-0"])
    vectors = CreateEmbeddingResponse.model_validate(bodies["emb-0"])
    assert [len(d.embedding) for d in vectors.data] == [256, 256]
    # the adapter changes the base model's greedy answers: it really ran
    answer = lambda cid: bodies[cid]["choices"][0]["message"]["content"]  # noqa: E731
    assert [answer(f"base-{i}") for i in range(4)] != [answer(f"lora-{i}") for i in range(4)]


def test_errors_say_which_model_serves_the_request(spark, mixed):
    result, _ = mixed
    errors = {r["custom_id"]: r["message"] for r in spark.read.format("delta").load(result.errors_table).collect()}
    assert f"set body.model to {MODEL_NAME!r}" in errors["chat-on-embed"]
    assert f"set body.model to {EMBED!r}" in errors["embed-on-llm"]
    assert f"one of {MODEL_NAME!r}, {ADAPTER!r}, {EMBED!r}" in errors["no-such-model"]


def test_models_run_one_after_the_other_and_the_metrics_say_which(spark, mixed):
    result, logs = mixed
    metrics = spark.read.format("delta").load(result.batch.metadata["metrics_table"]).orderBy("started_at").collect()
    order = [r["model"] for r in metrics]
    assert set(order) == {MODEL_NAME, EMBED}
    assert order == sorted(order, key=[MODEL_NAME, EMBED].index)  # every partition of one model, then the next
    last_llm = max(r["finished_at"] for r in metrics if r["model"] == MODEL_NAME)
    assert all(r["started_at"] >= last_llm for r in metrics if r["model"] == EMBED)
    assert len({r["partition"] for r in metrics}) == len(metrics)  # numbered across the models
    rows = {m: sum(r["rows"] for r in metrics if r["model"] == m) for m in (MODEL_NAME, EMBED)}
    assert rows == {MODEL_NAME: 10, EMBED: 6}
    # each engine slot loaded each model once: one engine process per slot and model answered all its partitions
    processes: dict[tuple[str, str], set[int]] = {}
    for r in metrics:
        processes.setdefault((r["engine_slot"], r["model"]), set()).add(r["engine_pid"])
    assert all(len(pids) == 1 for pids in processes.values()), processes
    # the progress line follows each model's own requests
    last = {m: [x for x in logs if x.startswith(f"progress b-multi ({m})")][-1] for m in (MODEL_NAME, EMBED)}
    assert "requests 10/10 (100.0%)" in last[MODEL_NAME] and "requests 6/6 (100.0%)" in last[EMBED]


def test_batch_json_and_the_report_name_every_model(mixed):
    result, _ = mixed
    batch = result.batch
    assert batch.model == f"{MODEL_NAME},{EMBED}"
    plan = batch.partition_plan
    assert set(plan.models) == {MODEL_NAME, EMBED}
    assert plan.num_partitions == sum(p.num_partitions for p in plan.models.values())
    assert "embeddings_table" in batch.metadata
    report = Path(batch.metadata["report_file"]).read_text()
    assert "<h2>Models</h2>" in report and f"<td>{EMBED}</td>" in report


def test_the_dry_run_plans_each_model(spark, tiny_model, embedding_model, tmp_path):
    from spark_llm import BatchConfig
    from spark_llm.plan import plan_batch

    write_jsonl(tmp_path / "in.jsonl", [line for line, _ in LINES.values()])
    plan = plan_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), **engine_settings(tiny_model),
                                         models=[{"name": EMBED, "path": embedding_model, "max_model_len": 512}]))
    assert (plan.lines, plan.requests) == (len(LINES), 16)
    assert plan.errors_by_code == {"unsupported_endpoint": 2, "model_not_found": 1}
    # each model's requests fit what its two engines run at once (8 sequences each): a partition per engine, not
    # one per inference task (two engines, two tasks each)
    assert plan.partitions == 4
