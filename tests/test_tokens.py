"""Prompt token counting with the model's tokenizer and chat template, and the context-length rule (both modes)."""

from __future__ import annotations

import json

import pytest

from spark_llm.tokens import TokenContext, count_row, get_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model):
    return get_tokenizer(tiny_model)


def chat(text):
    return json.dumps([{"role": "user", "content": text}])


def test_chat_count_uses_the_chat_template(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=512, context_overflow="error")
    res = count_row(tok, "chat", chat("hello world"), json.dumps({"max_tokens": 4}), ctx)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\nhello world<|im_end|>")
    assert res["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert res["prompt_tokens"] == len(res["prompt_token_ids"]) and res["error_code"] is None
    plain = count_row(tok, "completion", json.dumps("hello world"), json.dumps({"max_tokens": 4}), ctx)
    assert plain["prompt_token_ids"][0] == tok.bos_token_id and plain["prompt_tokens"] < res["prompt_tokens"]


def test_over_long_request_is_rejected_with_both_numbers(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=64, context_overflow="error")
    res = count_row(tok, "completion", json.dumps("data " * 50), json.dumps({"max_tokens": 30}), ctx)
    assert res["error_code"] == "context_length_exceeded"
    n = res["prompt_tokens"]
    assert f"prompt has {n} tokens" in res["error_message"] and "max_tokens is 30" in res["error_message"]
    assert "64" in res["error_message"] and n + 30 > 64


def test_truncate_mode_lowers_max_tokens_when_the_prompt_fits(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=64, context_overflow="truncate")
    res = count_row(tok, "completion", json.dumps("data " * 20), json.dumps({"max_tokens": 60, "min_tokens": 59}),
                    ctx)
    assert res["error_code"] is None
    new = 64 - res["prompt_tokens"]
    assert res["max_tokens"] == new and json.loads(res["sampling_json"])["max_tokens"] == new
    assert json.loads(res["sampling_json"])["min_tokens"] == new
    assert res["notes"] == f"max_tokens lowered from 60 to {new} to fit max_model_len 64"
    too_long = count_row(tok, "completion", json.dumps("data " * 100), json.dumps({"max_tokens": 5}), ctx)
    assert too_long["error_code"] == "context_length_exceeded"


def test_huge_prompt_is_rejected_after_bounded_work(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=128, context_overflow="error")
    huge = "lorem ipsum dolor " * 200_000  # 3.6M characters
    res = count_row(tok, "chat", chat(huge), json.dumps({"max_tokens": 4}), ctx)
    assert res["error_code"] == "context_length_exceeded" and "at least" in res["error_message"]
    assert res["prompt_tokens"] <= 128 * 32  # only a bounded prefix was tokenized


def test_token_id_prompts_outside_the_vocabulary(tok, tiny_model):
    ctx = TokenContext(tiny_model, max_model_len=128, context_overflow="error")
    res = count_row(tok, "completion", json.dumps([1, 2, 10**6]), json.dumps({"max_tokens": 4}), ctx)
    assert res["error_code"] == "invalid_request" and "vocabulary" in res["error_message"]
