"""Prompt token counting with the model's tokenizer and chat template, and the context-length rule (both modes)."""

from __future__ import annotations

import json

import pytest

from conftest import chat_line, completion_line, validation_context
from spark_llm.schemas import TOKENIZED_SCHEMA
from spark_llm.tokenizers import get_tokenizer
from spark_llm.tokens import TokenContext, count_batches, count_row, count_rows
from spark_llm.validate import validate_batches


@pytest.fixture(scope="module")
def tok(tiny_model):
    return get_tokenizer(tiny_model)


def chat(text, **extra):
    return json.dumps({"messages": [{"role": "user", "content": text}], **extra})


def completion(*prompts):
    return json.dumps(list(prompts))


def test_chat_count_uses_the_chat_template(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=512, context_overflow="error")
    res = count_row(tok, "chat", chat("hello world"), json.dumps({"max_tokens": 4}), ctx)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\nhello world<|im_end|>")
    assert res["prompt_token_ids"] == [tok.encode(rendered, add_special_tokens=False)]
    assert res["prompt_tokens"] == len(res["prompt_token_ids"][0]) and res["error_code"] is None
    plain = count_row(tok, "completion", completion("hello world"), json.dumps({"max_tokens": 4}), ctx)
    assert plain["prompt_token_ids"][0][0] == tok.bos_token_id and plain["prompt_tokens"] < res["prompt_tokens"]


def test_tools_reach_the_chat_template(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=512, context_overflow="error")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = count_row(tok, "chat", chat("hi", tools=tools), json.dumps({"max_tokens": 4}), ctx)
    text = tok.decode(with_tools["prompt_token_ids"][0])
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert with_tools["prompt_tokens"] > count_row(tok, "chat", chat("hi"), json.dumps({"max_tokens": 4}),
                                                   ctx)["prompt_tokens"]


def test_a_prompt_list_counts_every_prompt_and_checks_the_longest(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=40, context_overflow="error")
    res = count_row(tok, "completion", completion("a b", [5, 6, 7]), json.dumps({"max_tokens": 4}), ctx)
    assert [len(p) for p in res["prompt_token_ids"]] == [len(tok.encode("a b")), 3]
    assert res["prompt_tokens"] == sum(len(p) for p in res["prompt_token_ids"])
    long = count_row(tok, "completion", completion("a", "data " * 80), json.dumps({"max_tokens": 4}), ctx)
    assert long["error_code"] == "context_length_exceeded" and "longest prompt" in long["error_message"]


def test_logit_bias_ids_are_checked_against_the_vocabulary(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=128, context_overflow="error")
    ok = count_row(tok, "completion", completion("a"), json.dumps({"max_tokens": 4, "logit_bias": {"5": 1}}), ctx)
    assert ok["error_code"] is None
    bad = count_row(tok, "completion", completion("a"),
                    json.dumps({"max_tokens": 4, "logit_bias": {str(len(tok)): 1}}), ctx)
    assert bad["error_code"] == "invalid_request" and f"ids 0..{len(tok) - 1}" in bad["error_message"]


def test_over_long_request_is_rejected_with_both_numbers(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=64, context_overflow="error")
    res = count_row(tok, "completion", completion("data " * 50), json.dumps({"max_tokens": 30}), ctx)
    assert res["error_code"] == "context_length_exceeded"
    n = res["prompt_tokens"]
    assert f"prompt has {n} tokens" in res["error_message"] and "max_tokens is 30" in res["error_message"]
    assert "64" in res["error_message"] and n + 30 > 64


def test_truncate_mode_lowers_max_tokens_when_the_prompt_fits(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=64, context_overflow="truncate")
    res = count_row(tok, "completion", completion("data " * 20), json.dumps({"max_tokens": 60, "min_tokens": 59}),
                    ctx)
    assert res["error_code"] is None
    new = 64 - res["prompt_tokens"]
    assert res["max_tokens"] == new and json.loads(res["sampling_json"])["max_tokens"] == new
    assert json.loads(res["sampling_json"])["min_tokens"] == new
    assert res["notes"] == f"max_tokens lowered from 60 to {new} to fit max_model_len 64"
    too_long = count_row(tok, "completion", completion("data " * 100), json.dumps({"max_tokens": 5}), ctx)
    assert too_long["error_code"] == "context_length_exceeded"


def test_huge_prompt_is_rejected_after_bounded_work(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=128, context_overflow="error")
    huge = "lorem ipsum dolor " * 200_000  # 3.6M characters
    res = count_row(tok, "chat", chat(huge), json.dumps({"max_tokens": 4}), ctx)
    assert res["error_code"] == "context_length_exceeded" and "at least" in res["error_message"]
    assert res["prompt_tokens"] <= 128 * 32  # only a bounded prefix was tokenized


def test_token_id_prompts_outside_the_vocabulary(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=128, context_overflow="error")
    res = count_row(tok, "completion", completion([1, 2, 10**6]), json.dumps({"max_tokens": 4}), ctx)
    assert res["error_code"] == "invalid_request" and "vocabulary" in res["error_message"]


def test_many_requests_counted_together_equal_each_counted_alone_and_a_bad_one_fails_alone(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=64, context_overflow="truncate")
    sampling = json.dumps({"max_tokens": 8})
    rows = [("chat", chat("hello world"), sampling),
            ("completion", completion("a b", [5, 6, 7]), sampling),
            ("completion", '["lone surrogate \\ud800"]', sampling),  # valid JSON the tokenizer refuses
            ("chat", json.dumps({"messages": 5}), sampling),  # the template fails on this one
            ("completion", completion("data " * 60), sampling),  # lowered max_tokens
            ("responses", chat("hi"), sampling)]
    together = count_rows(tok, rows, ctx)
    assert together == [count_row(tok, *row, ctx) for row in rows]
    assert [r["error_code"] for r in together] == [None, None, "invalid_request", "invalid_request", None, None]
    assert all(r["error_message"].startswith("prompt could not be tokenized: ") for r in together[2:4])
    assert together[4]["notes"].startswith("max_tokens lowered from 8 to ")
    assert together[0]["prompt_token_ids"] == [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)]


def test_token_stage_counts_a_batch_and_passes_error_rows_through(tok, tiny_model):
    import pandas as pd

    lines = [chat_line("a", "hello world", max_tokens=4), {"custom_id": "bad", "method": "GET"},
             completion_line("b", ["one", "two three"], max_tokens=60), chat_line("c", "data " * 200, max_tokens=8)]
    raw = pd.DataFrame({"value": [json.dumps(x).encode() for x in lines], "file": "f.jsonl",
                        "line_number": range(1, len(lines) + 1)})
    [validated] = validate_batches(iter([raw]), validation_context())
    ctx = TokenContext(tiny_model, max_model_len=128, context_overflow="error")
    [counted] = count_batches(iter([validated]), {"tiny-llm": ctx})
    assert list(counted.columns) == TOKENIZED_SCHEMA.fieldNames()
    rows = counted.astype(object).where(counted.notna(), None).to_dict("records")
    assert [r["error_code"] for r in rows] == [None, "invalid_method", None, "context_length_exceeded"]
    assert rows[1]["prompt_token_ids"] is None and rows[1]["error_message"].startswith("method must be POST")
    for r in (rows[0], rows[2], rows[3]):
        alone = count_row(tok, r["kind"], r["prompt_json"], validated["sampling_json"][r["line_number"] - 1], ctx)
        assert r["prompt_tokens"] == alone["prompt_tokens"]
        assert r["prompt_token_ids"] == (alone["prompt_token_ids"] if alone["error_code"] is None else None)
    assert len(rows[2]["prompt_token_ids"]) == 2 and rows[2]["est_tokens"] == rows[2]["prompt_tokens"] + 2 * 60
    assert rows[3]["prompt_tokens"] > 128 and rows[3]["est_tokens"] is None
    assert counted["max_tokens"].dtype == "Int64" and counted["prefix_key"].dtype == "Int64"


def test_tokenizers_load_without_torch_the_class_autotokenizer_chose_in_a_child_process(tiny_model, tmp_path):
    """AutoTokenizer imports torch to decide which class to load; the decision is made once per host in a child
    process and recorded, so no process that counts tokens imports torch (its first or later ones), and each gets
    AutoTokenizer's own class and token ids."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    probe = ("import json, sys; from spark_llm.tokenizers import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
             "print(json.dumps([type(t).__name__, 'torch' in sys.modules, t.encode(t.apply_chat_template("
             "[{'role': 'user', 'content': 'hello 世界'}], tokenize=False, add_generation_prompt=True), "
             "add_special_tokens=False)]))")
    env = {**__import__("os").environ, "SPARK_LLM_MODEL_CACHE": str(tmp_path)}
    first, second = (json.loads(subprocess.run([sys.executable, "-c", probe, tiny_model], env=env, check=True,
                                               capture_output=True, text=True).stdout) for _ in range(2))
    auto = AutoTokenizer.from_pretrained(tiny_model)
    expected = auto.encode(auto.apply_chat_template([{"role": "user", "content": "hello 世界"}], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False)
    assert not first[1] and not second[1]  # neither the process that had it decided nor the next imported torch
    assert first[0] == second[0] == type(auto).__name__
    assert first[2] == second[2] == expected and len(expected) > 5
    assert len(list(tmp_path.glob("tokenizer-class-*.txt"))) == 1


def test_a_worker_keeps_a_loaded_tokenizer_out_of_the_collector_s_walks_but_the_driver_does_not(spark, tiny_model):
    """pyspark runs gc.collect() after every task of a reused worker; a worker's tokenizer (kept for its life) is
    frozen out of those walks. The driver is a user's process: its collector is left as it is."""
    import gc

    import pandas as pd

    from spark_llm import tokenizers

    tokenizers._TOKENIZERS.pop(tiny_model, None)  # load it again here
    before = gc.get_freeze_count()
    get_tokenizer(tiny_model)
    assert gc.get_freeze_count() == before

    def probe(batches):
        import gc

        from spark_llm import tokenizers

        for _ in batches:
            tokenizers._TOKENIZERS.pop(tiny_model, None)
            frozen = gc.get_freeze_count()
            tokenizers.get_tokenizer(tiny_model)
            yield pd.DataFrame({"before": [frozen], "after": [gc.get_freeze_count()]})

    row = spark.range(1, numPartitions=1).mapInPandas(probe, "before long, after long").first()
    assert row["after"] > row["before"] > 0  # the worker daemon froze what it forked with, the tokenizer joined it


def test_a_worker_waits_for_the_engine_deciding_the_tokenizer_class_and_loads_what_it_recorded(tiny_model,
                                                                                              tmp_path):
    """The engine process imports transformers' configuration classes (and torch) anyway: it holds the decision while
    it imports, then takes it; a process counting tokens meanwhile waits for the record instead of deciding (here it
    could not: its own way of deciding is taken away) and never imports torch."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    env = {**__import__("os").environ, "SPARK_LLM_MODEL_CACHE": str(tmp_path)}
    engine = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom spark_llm.engine_host.server import tokenizer_class_decided\n"
         "from spark_llm.engine_host.spec import EngineSettings, EngineSpec\n"
         "with tokenizer_class_decided(EngineSpec(EngineSettings(model=sys.argv[1]))):\n"
         "    print('importing', flush=True)\n    time.sleep(2)\n", tiny_model], env=env, stdout=subprocess.PIPE,
        text=True)
    assert engine.stdout.readline().strip() == "importing"
    probe = ("import sys; from spark_llm import tokenizers; tokenizers._decide_class = None; "
             "t = tokenizers.load_tokenizer(sys.argv[1]); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, tiny_model], env=env, check=True, capture_output=True,
                         text=True).stdout
    assert engine.wait(timeout=60) == 0
    assert out.split() == [type(AutoTokenizer.from_pretrained(tiny_model)).__name__, "False"]
    [record] = tmp_path.glob("tokenizer-class-*.txt")


def test_an_engine_does_not_wait_for_another_process_deciding_the_tokenizer_class(tiny_model, tmp_path,
                                                                                  monkeypatch):
    """A worker's child deciding the class holds the host's lock for seconds (it imports torch); an engine start
    must not wait for it: it leaves the decision to that process."""
    from spark_llm import tokenizers
    from spark_llm.host import locked

    monkeypatch.setenv("SPARK_LLM_MODEL_CACHE", str(tmp_path))
    record = tokenizers._class_record(tiny_model)
    with locked(tokenizers.decision_lock(record), wait=0.0) as held:
        assert held
        with tokenizers.deciding_tokenizer_class(tiny_model):  # returns at once: another process is deciding
            pass
        assert not record.exists()
    with tokenizers.deciding_tokenizer_class(tiny_model):
        pass
    assert record.exists() and tokenizers._recorded_class(record) is not None


def test_the_engine_process_decides_the_tokenizer_class_without_importing_spark(tiny_model, tmp_path):
    """The engine process is vLLM's: what it imports of ours to serve (its module, the tokenizer decision, the
    endpoints' engine side) must not pull in pyspark or pandas, the token stage's."""
    import subprocess
    import sys

    probe = ("import sys\nfrom spark_llm.engine_host.server import tokenizer_class_decided\n"
             "from spark_llm.endpoints import engine_side\n"
             "from spark_llm.engine_host.spec import EngineSettings, EngineSpec\n"
             "with tokenizer_class_decided(EngineSpec(EngineSettings(model=sys.argv[1]))):\n    pass\n"
             "print(sorted(m for m in ('pyspark', 'pandas', 'py4j') if m in sys.modules))\n")
    env = {**__import__("os").environ, "SPARK_LLM_MODEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe, tiny_model], env=env, check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"
    assert len(list(tmp_path.glob("tokenizer-class-*.txt"))) == 1  # it did decide (transformers, torch imported)
