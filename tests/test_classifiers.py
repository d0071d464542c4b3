"""The classifying endpoints in one batch beside chat: /v1/moderations and /v1/classify on a sequence classifier
(the tiny Llama with a head over OpenAI's moderation categories, make_tiny_model.py --kind classifier), /v1/score and
/v1/rerank on a cross-encoder (its one-label sibling, --kind cross-encoder): OpenAI's ModerationCreateResponse and
vLLM's classify, score and rerank responses for every good line, the typed result columns in SQL, and an error row
that says what to change for every bad one. The label map and the flagging rule are unit-tested here without an
engine."""

from __future__ import annotations

import json
import math

import pytest

from conftest import (CLASSIFIER_MODEL, MODEL_NAME, RERANKER_MODEL, chat_line, engine_settings, validation_context,
                      write_jsonl)

THRESHOLD = 0.7  #: the run's moderation_threshold: the tiny head's random scores spread over (0, 1)


def moderation_line(custom_id: str, inputs, model: str = CLASSIFIER_MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/moderations",
            "body": {"model": model, "input": inputs, **body}}


def classify_line(custom_id: str, inputs, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/classify",
            "body": {"model": CLASSIFIER_MODEL, "input": inputs, **body}}


def score_line(custom_id: str, model: str = RERANKER_MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/score", "body": {"model": model, **body}}


def rerank_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/rerank", "body": {"model": RERANKER_MODEL, **body}}


TEXTS = ["I will find you and hurt you", "have a nice day", "the weather in Paris", "批量 处理 审核"]
QUERY = "what is Spark"
DOCS = ["Spark runs batch jobs on a cluster", "今天天气很好", "a recipe for bread", "Delta Lake stores tables"]

#: custom_id -> (line, "ok" or the error code)
LINES = {
    "mod-one": (moderation_line("mod-one", TEXTS[0]), "ok"),
    "mod-list": (moderation_line("mod-list", TEXTS), "ok"),
    "mod-parts": (moderation_line("mod-parts", [{"type": "text", "text": "have a nice"},
                                                {"type": "text", "text": "day"}]), "ok"),
    "cls-list": (classify_line("cls-list", TEXTS), "ok"),
    "cls-raw": (classify_line("cls-raw", TEXTS[0], use_activation=False), "ok"),
    "cls-ids": (classify_line("cls-ids", [5, 6, 7, 8]), "ok"),
    "score-1n": (score_line("score-1n", text_1=QUERY, text_2=DOCS), "ok"),
    "score-nn": (score_line("score-nn", queries=[QUERY, "bread"], items=[DOCS[0], DOCS[2]]), "ok"),
    "score-docs": (score_line("score-docs", queries=QUERY, documents=DOCS[1]), "ok"),
    "rerank-top": (rerank_line("rerank-top", query=QUERY, documents=DOCS, top_n=2), "ok"),
    "rerank-bare": (rerank_line("rerank-bare", query=QUERY, documents=DOCS, return_documents=False), "ok"),
    "chat": (chat_line("chat", "Hello", temperature=0), "ok"),  # the generating model in the same batch
    "mod-image": (moderation_line("mod-image", [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]),
                  "unsupported_parameter"),
    "mod-empty": (moderation_line("mod-empty", ""), "invalid_request"),
    "mod-number": (moderation_line("mod-number", 42), "invalid_request"),
    "mod-field": (moderation_line("mod-field", "x", dimensions=8), "unsupported_parameter"),
    "mod-long": (moderation_line("mod-long", "word " * 800), "context_length_exceeded"),
    "mod-on-llm": (moderation_line("mod-on-llm", "x", model=MODEL_NAME), "unsupported_endpoint"),
    "chat-on-classifier": (chat_line("chat-on-classifier", model=CLASSIFIER_MODEL), "unsupported_endpoint"),
    "cls-activation": (classify_line("cls-activation", "x", use_activation="yes"), "invalid_request"),
    "score-uneven": (score_line("score-uneven", text_1=["a", "b"], text_2=["c", "d", "e"]), "invalid_request"),
    "score-names": (score_line("score-names", text_1="a", items=["b"]), "invalid_request"),
    "score-on-moderation": (score_line("score-on-moderation", model=CLASSIFIER_MODEL, text_1="a", text_2="b"),
                            "unsupported_endpoint"),
    "score-truncate": (score_line("score-truncate", text_1="a", text_2="b", max_tokens_per_doc=8),
                       "unsupported_parameter"),
    "rerank-no-query": (rerank_line("rerank-no-query", documents=DOCS), "invalid_request"),
    "rerank-top-n": (rerank_line("rerank-top-n", query=QUERY, documents=DOCS, top_n=-1), "invalid_request"),
    "rerank-long": (rerank_line("rerank-long", query=QUERY, documents=["fine", "word " * 800]),
                    "context_length_exceeded"),
    "mod-on-reranker": (moderation_line("mod-on-reranker", "x", model=RERANKER_MODEL), "unsupported_endpoint"),
}


@pytest.fixture(scope="module")
def moderated(spark, tiny_model, classifier_model, reranker_model, tmp_path_factory):
    from spark_llm import BatchConfig, run_batch

    root = tmp_path_factory.mktemp("moderations")
    write_jsonl(root / "in.jsonl", [line for line, _ in LINES.values()])
    cfg = BatchConfig(input=str(root / "in.jsonl"), output_dir=str(root / "out"), batch_id="b-mod",
                      models=[{"name": CLASSIFIER_MODEL, "path": classifier_model, "max_model_len": 512},
                              {"name": RERANKER_MODEL, "path": reranker_model, "max_model_len": 512}],
                      moderation_threshold=THRESHOLD, **engine_settings(tiny_model))
    return run_batch(spark, cfg)


def outputs(spark, result) -> dict:
    return {r["custom_id"]: r for r in spark.read.format("delta").load(result.outputs_table).collect()}


@pytest.mark.engine
def test_every_line_once_answered_in_openais_and_vllms_shapes(spark, moderated):
    from openai.types import ModerationCreateResponse

    rows = outputs(spark, moderated)
    errors = {r["custom_id"]: r["code"] for r in spark.read.format("delta").load(moderated.errors_table).collect()}
    assert {**{cid: "ok" for cid in rows}, **errors} == {cid: want for cid, (_, want) in LINES.items()}
    bodies = {cid: json.loads(r["response_body"]) for cid, r in rows.items()}
    for cid, inputs in (("mod-one", 1), ("mod-list", len(TEXTS)), ("mod-parts", 1)):
        parsed = ModerationCreateResponse.model_validate(bodies[cid])
        assert parsed.model == CLASSIFIER_MODEL and len(parsed.results) == inputs
        for res in parsed.results:
            scores = res.category_scores.model_dump(by_alias=True)
            flags = res.categories.model_dump(by_alias=True)
            assert len(scores) == 13 and all(0.0 < s < 1.0 for s in scores.values())
            assert flags == {c: s >= THRESHOLD for c, s in scores.items()}
            assert res.flagged == any(flags.values())
    classified = bodies["cls-list"]
    assert classified["object"] == "list" and classified["usage"]["completion_tokens"] == 0
    assert [d["index"] for d in classified["data"]] == list(range(len(TEXTS)))
    assert bodies["cls-ids"]["usage"]["prompt_tokens"] == 4  # token ids as given
    assert rows["chat"]["model"] == MODEL_NAME and rows["cls-list"]["model"] == CLASSIFIER_MODEL


@pytest.mark.engine
def test_moderation_scores_are_the_classifiers_probabilities_under_openais_names(spark, moderated):
    from spark_llm.config import MODERATION_CATEGORIES

    bodies = {cid: json.loads(r["response_body"]) for cid, r in outputs(spark, moderated).items()}
    classified = bodies["cls-list"]["data"]
    moderated_list = bodies["mod-list"]["results"]
    # the tiny model's labels are OpenAI's categories in its order: the same text, the same probabilities
    for probs, res in zip([d["probs"] for d in classified], moderated_list):
        assert [res["category_scores"][c] for c in MODERATION_CATEGORIES] == pytest.approx(probs, abs=1e-5)
    assert all(d["label"] == MODERATION_CATEGORIES[max(range(13), key=d["probs"].__getitem__)] for d in classified)
    assert bodies["mod-one"]["results"][0]["category_scores"] == pytest.approx(moderated_list[0]["category_scores"],
                                                                              abs=1e-5)
    # use_activation false: the raw logits, whose sigmoid is the multi-label classifier's probability
    raw = bodies["cls-raw"]["data"][0]["probs"]
    assert any(x < 0 for x in raw) and [1 / (1 + math.exp(-x)) for x in raw] == pytest.approx(classified[0]["probs"],
                                                                                               abs=1e-4)
    # the parts of one multi-modal input are moderated together, as one text
    assert len(bodies["mod-parts"]["results"]) == 1


@pytest.mark.engine
def test_the_typed_columns_answer_sql(spark, moderated):
    table = spark.read.format("delta").load(moderated.outputs_table)
    table.createOrReplaceTempView("moderated")
    bodies = {cid: json.loads(r["response_body"]) for cid, r in outputs(spark, moderated).items()}
    flagged = {r["custom_id"] for r in spark.sql("SELECT custom_id FROM moderated WHERE flagged").collect()}
    assert flagged == {cid for cid, b in bodies.items() if cid.startswith("mod-")
                       and any(res["flagged"] for res in b["results"])}
    row = spark.sql("SELECT labels, category_scores['hate'] AS hate, flagged FROM moderated "
                    "WHERE custom_id = 'mod-list'").first()
    results = bodies["mod-list"]["results"]
    assert row["hate"] == pytest.approx(max(res["category_scores"]["hate"] for res in results), abs=1e-6)
    assert set(row["labels"]) == {c for res in results for c, on in res["categories"].items() if on}
    cls = spark.sql("SELECT labels, scores, flagged FROM moderated WHERE custom_id = 'cls-list'").first()
    assert cls["labels"] == [d["label"] for d in bodies["cls-list"]["data"]] and cls["flagged"] is None
    assert cls["scores"] == pytest.approx([max(d["probs"]) for d in bodies["cls-list"]["data"]], abs=1e-6)
    chat = spark.sql("SELECT labels, scores, category_scores FROM moderated WHERE custom_id = 'chat'").first()
    assert (chat["labels"], chat["scores"], chat["category_scores"]) == (None, None, None)


@pytest.mark.engine
def test_bad_lines_say_what_to_change(spark, moderated):
    errors = {r["custom_id"]: r["message"] for r in spark.read.format("delta").load(moderated.errors_table).collect()}
    assert "text parts only" in errors["mod-image"]
    assert f"set body.model to {CLASSIFIER_MODEL!r}" in errors["mod-on-llm"]
    assert "classification model" in errors["chat-on-classifier"] and "/v1/moderations" in \
        errors["chat-on-classifier"]
    assert "512" in errors["mod-long"] and "dimensions" in errors["mod-field"]
    assert "3" in errors["score-uneven"] and "one text_1" in errors["score-uneven"]
    assert "text_1 and text_2" in errors["score-names"] and "max_tokens_per_doc" in errors["score-truncate"]
    assert "cross-encoder" in errors["score-on-moderation"] and f"{RERANKER_MODEL!r}" in errors["score-on-moderation"]
    assert "moderation_labels" in errors["mod-on-reranker"]


@pytest.mark.engine
def test_scores_are_the_cross_encoders_relevance_of_each_pair(spark, moderated, reranker_model):
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    rows = outputs(spark, moderated)
    bodies = {cid: json.loads(r["response_body"]) for cid, r in rows.items()}
    one_to_many = bodies["score-1n"]
    assert one_to_many["object"] == "list" and [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    scores = [d["score"] for d in one_to_many["data"]]
    # the pair as the tokenizer's pair encoding, scored by the model itself (transformers, float32): the same
    tokenizer = AutoTokenizer.from_pretrained(reranker_model)
    model = LlamaForSequenceClassification.from_pretrained(reranker_model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tokenizer(text=QUERY, text_pair=d, return_tensors="pt")).logits)[0, 0].item()
                    for d in DOCS]
    assert scores == pytest.approx(expected, abs=0.03) and len(set(scores)) == len(DOCS)
    assert one_to_many["usage"]["prompt_tokens"] == sum(len(tokenizer(text=QUERY, text_pair=d)["input_ids"])
                                                        for d in DOCS)
    # lists pair up; queries + documents is the same as text_1 + text_2
    paired = [d["score"] for d in bodies["score-nn"]["data"]]
    assert paired[0] == pytest.approx(scores[0], abs=1e-6) and len(paired) == 2
    assert bodies["score-docs"]["data"][0]["score"] == pytest.approx(scores[1], abs=1e-6)
    # rerank: the same scores, best first, cut to top_n, with the documents unless told not to
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    top = bodies["rerank-top"]["results"]
    assert [r["index"] for r in top] == best[:2]
    assert [r["document"]["text"] for r in top] == [DOCS[i] for i in best[:2]]
    assert [r["relevance_score"] for r in top] == pytest.approx([scores[i] for i in best[:2]], abs=1e-6)
    bare = bodies["rerank-bare"]["results"]
    assert [r["index"] for r in bare] == best and all("document" not in r for r in bare)
    # SQL: every pair's score in the request's order
    assert rows["rerank-top"]["scores"] == pytest.approx(scores, abs=1e-6)
    assert rows["score-nn"]["scores"] == pytest.approx(paired, abs=1e-6)


# ---- without an engine -----------------------------------------------------------------------------------------

def test_labels_map_to_categories_by_name_or_by_the_setting():
    from spark_llm.endpoints.moderations import classes

    labels = ("toxic", "HATE_THREATENING", "self_harm", "Violence", "violence-graphic", "neutral", "sexual")
    got = classes(labels, {"toxic": "harassment", "sexual": ""}, 0.5)
    assert got.categories == ("harassment", "hate/threatening", "self-harm", "violence", "violence/graphic", None,
                              None)
    assert got.labels == labels and got.threshold == 0.5


def test_a_category_scores_its_best_label_and_flags_at_the_threshold():
    from spark_llm.endpoints import Classes
    from spark_llm.endpoints.moderations import result

    meaning = Classes(("insult", "threat", "hate", "ok"), ("harassment", "harassment", "hate", None), 0.6)
    scores, flagged = result([0.2, 0.65, 0.6, 0.99], meaning)
    assert scores["harassment"] == 0.65 and scores["hate"] == 0.6 and scores["violence"] == 0.0
    assert flagged == ["harassment", "hate"]  # at the threshold counts; OpenAI's order; "ok" counts for nothing
    assert result([0.59, 0.1, 0.1, 1.0], meaning)[1] == []


def test_moderation_lines_on_a_classifier_whose_labels_map_to_nothing_say_to_map_them():
    from spark_llm.engine_host.protocol import EngineTask
    from spark_llm.validate import validate_line
    from dataclasses import replace

    ctx = replace(validation_context(), tasks=(EngineTask.CLASSIFY,), labels=("positive", "negative"))
    line = json.dumps(moderation_line("m", "x", model=MODEL_NAME))
    row = validate_line(line, "f", 1, ctx)
    assert row["error_code"] == "unsupported_endpoint" and "moderation_labels" in row["error_message"]
    mapped = replace(ctx, moderation_labels={"negative": "harassment"})
    assert validate_line(line, "f", 1, mapped)["error_code"] is None


def test_pairs_go_to_a_one_label_classifier_that_needs_no_token_types():
    from dataclasses import replace

    from spark_llm.engine_host.protocol import EngineTask
    from spark_llm.validate import validate_line

    ctx = replace(validation_context(), tasks=(EngineTask.CLASSIFY,), labels=("LABEL_0",))
    line = json.dumps(score_line("s", model=MODEL_NAME, text_1="q", text_2=["a", "b"]))
    row = validate_line(line, "f", 1, ctx)
    assert row["error_code"] is None and json.loads(row["prompt_json"]) == [["q", "a"], ["q", "b"]]
    bert = validate_line(line, "f", 1, replace(ctx, token_types=True))
    assert bert["error_code"] == "unsupported_endpoint" and "token type ids" in bert["error_message"]
    moderation = replace(ctx, labels=tuple("abc"))
    assert "has 3 labels" in validate_line(line, "f", 1, moderation)["error_message"]


def test_a_moderation_labels_setting_naming_no_category_stops_the_batch():
    from spark_llm import BatchConfig

    with pytest.raises(ValueError, match="toxicity is no OpenAI moderation category"):
        BatchConfig(moderation_labels={"toxic": "toxicity"})
