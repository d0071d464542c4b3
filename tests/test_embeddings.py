"""/v1/embeddings on a pooling engine (the tiny sentence-transformers model, make_tiny_model.py --kind embedding,
found to be one from its directory and run in vLLM's pooling runner): vectors for every input, floats or base64, the
embeddings table as a real column, and the lines a pooling model cannot serve as error rows."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from conftest import MODEL_NAME, chat_line, engine_settings, write_jsonl

pytestmark = pytest.mark.engine

HIDDEN = 256  # the tiny model's hidden size: the length of its embeddings


def embedding_line(custom_id: str, inputs, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": MODEL_NAME, "input": inputs, **body}}


LINES = [
    (embedding_line("emb-1", "the weather in Paris"), "ok"),
    (embedding_line("emb-list", ["spark batch", "delta table", "vLLM engine"]), "ok"),
    (embedding_line("emb-ids", [[5, 6, 7], [8, 9]]), "ok"),
    (embedding_line("emb-b64", "the weather in Paris", encoding_format="base64"), "ok"),
    (embedding_line("emb-dims", "x", dimensions=8), "engine_error"),  # not a Matryoshka model: vLLM refuses it
    (embedding_line("emb-empty", ""), "invalid_request"),
    (embedding_line("emb-format", "x", encoding_format="int8"), "invalid_request"),
    (embedding_line("emb-long", "word " * 1200), "context_length_exceeded"),
    (chat_line("a-chat-line", "Hello"), "unsupported_endpoint"),  # a pooling model does not chat
]


@pytest.fixture(scope="module")
def embedded(spark, tiny_model, embedding_model, tmp_path_factory):
    from spark_llm import BatchConfig, run_batch

    root = tmp_path_factory.mktemp("embeddings")
    write_jsonl(root / "in.jsonl", [line for line, _ in LINES])
    # the model given as a URI: each host (here: this one) copies it once, for both engines; runner auto finds its
    # sentence-transformers files
    settings = {**engine_settings(tiny_model), "model": f"file://{embedding_model}", "lora_modules": {}}
    result = run_batch(spark, BatchConfig(input=str(root / "in.jsonl"), output_dir=str(root / "out"),
                                          batch_id="b-emb", **settings))
    write_jsonl(root / "again.jsonl", [LINES[0][0]])
    again = run_batch(spark, BatchConfig(input=str(root / "again.jsonl"), output_dir=str(root / "again"),
                                         batch_id="b-emb-again", **settings))
    return result, again


def bodies(spark, result) -> dict:
    return {r["custom_id"]: json.loads(r["response_body"])
            for r in spark.read.format("delta").load(result.outputs_table).collect()}


def test_every_line_once_with_vectors_of_the_model_size(spark, embedded):
    from openai.types import CreateEmbeddingResponse

    result, _ = embedded
    errors = {r["custom_id"]: r["code"] for r in spark.read.format("delta").load(result.errors_table).collect()}
    got = bodies(spark, result)
    assert {**{cid: "ok" for cid in got}, **errors} == {line["custom_id"]: code for line, code in LINES}
    for cid in ("emb-1", "emb-list", "emb-ids"):
        parsed = CreateEmbeddingResponse.model_validate(got[cid])
        assert [d.index for d in parsed.data] == list(range(len(parsed.data)))
        assert all(len(d.embedding) == HIDDEN for d in parsed.data)
        assert parsed.usage.prompt_tokens == parsed.usage.total_tokens > 0 and parsed.model == MODEL_NAME
        # mean-pooled and normalised, as the model's modules.json says: unit length
        assert all(sum(x * x for x in d.embedding) == pytest.approx(1.0, abs=1e-3) for d in parsed.data)
    assert len(got["emb-list"]["data"]) == 3 and got["emb-ids"]["usage"]["prompt_tokens"] == 5


def test_a_model_given_as_a_uri_is_copied_once_for_the_host(embedded, model_cache, embedding_model):
    from pathlib import Path

    full = [p for p in model_cache.iterdir() if (p / "model.safetensors").exists()]
    assert len(full) == 1, list(model_cache.iterdir())
    weights = (Path(embedding_model) / "model.safetensors").read_bytes()
    assert (full[0] / "model.safetensors").read_bytes() == weights
    assert not list(model_cache.glob("*.partial-*"))


def test_base64_decodes_to_the_float_answer_and_reruns_are_identical(spark, embedded):
    result, again = embedded
    got = bodies(spark, result)
    floats = got["emb-1"]["data"][0]["embedding"]
    raw = base64.b64decode(got["emb-b64"]["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)
    assert bodies(spark, again)["emb-1"]["data"][0]["embedding"] == floats


def test_the_embeddings_table_holds_each_vector_as_a_column(spark, embedded):
    result, _ = embedded
    table = spark.read.format("delta").load(result.batch.metadata["embeddings_table"])
    rows = {(r["custom_id"], r["input_index"]): r for r in table.collect()}
    assert sorted(rows) == [("emb-1", 0), ("emb-b64", 0), ("emb-ids", 0), ("emb-ids", 1), ("emb-list", 0),
                            ("emb-list", 1), ("emb-list", 2)]
    assert all(r["dimensions"] == HIDDEN == len(r["embedding"]) for r in rows.values())
    body = bodies(spark, result)["emb-list"]["data"][2]["embedding"]
    assert rows[("emb-list", 2)]["embedding"] == pytest.approx(body, abs=1e-6)
    # cosine similarity in SQL, as docs/tables.md shows it: the same text twice is 1
    table.createOrReplaceTempView("emb")
    cos = spark.sql("""
        SELECT aggregate(zip_with(a.embedding, b.embedding, (x, y) -> x * y), 0D, (s, v) -> s + v)
               / sqrt(aggregate(a.embedding, 0D, (s, v) -> s + v * v) * aggregate(b.embedding, 0D, (s, v) -> s + v * v))
               AS cosine
        FROM emb a JOIN emb b ON a.custom_id = 'emb-1' AND b.custom_id = 'emb-b64'""").first()["cosine"]
    assert cos == pytest.approx(1.0, abs=1e-5)


def test_lines_a_pooling_model_cannot_serve_say_why(spark, embedded):
    result, _ = embedded
    errors = {r["custom_id"]: r["message"] for r in spark.read.format("delta").load(result.errors_table).collect()}
    assert "Matryoshka" in errors["emb-dims"] and "dimensions" in errors["emb-dims"]
    assert "embedding model" in errors["a-chat-line"] and "/v1/embeddings" in errors["a-chat-line"]
    assert "1024" in errors["emb-long"]
