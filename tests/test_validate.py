"""Every validation rule, on plain Python (no Spark): each line is a request, an error row with a precise code, or
(only when blank) nothing."""

from __future__ import annotations

import json

import pytest

from conftest import chat_line, completion_line, validation_context
from spark_llm.schemas import VALIDATED_FIELDS
from spark_llm.endpoints import chat
from spark_llm.validate import ValidationContext, validate_line

CTX = validation_context(default_max_tokens=32, max_line_bytes=4096,
                        max_raw_line_chars=50)


def check(line, ctx: ValidationContext = CTX) -> dict:
    raw = line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode("utf-8")
    row = validate_line(raw, "f.jsonl", 7, ctx)
    assert row is not None and set(row) == set(VALIDATED_FIELDS)
    assert row["line_number"] == 7 and row["file"] == "f.jsonl"
    return row


def code_of(line) -> str | None:
    return check(line)["error_code"]


def with_body(**changes) -> dict:
    line = chat_line("a")
    line["body"].update(changes)
    return line


def test_valid_chat_request_is_normalised():
    row = check(chat_line("id-1", temperature=0, max_tokens=5, stop="\n", seed=3, user="u1"))
    assert row["error_code"] is None and row["error_message"] is None and row["raw_line"] is None
    assert row["custom_id"] == "id-1" and row["url"] == "/v1/chat/completions" and row["kind"] == "chat"
    assert json.loads(row["prompt_json"]) == {"messages": [{"role": "user", "content": "Hello there"}]}
    assert json.loads(row["sampling_json"]) == {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "stop": ["\n"],
                                                "seed": 3}
    assert row["max_tokens"] == 5 and json.loads(row["request"])["custom_id"] == "id-1"


def test_valid_completion_request_and_defaults():
    row = check(completion_line("c-1", prompt="Hi"))
    assert row["error_code"] is None and row["kind"] == "completion"
    assert json.loads(row["prompt_json"]) == ["Hi"]
    assert json.loads(row["sampling_json"]) == {"max_tokens": 32, "temperature": 1.0, "top_p": 1.0}


@pytest.mark.parametrize("raw", [b"", b"   ", b"\t\r", b"\xef\xbb\xbf", b"\r"])
def test_blank_lines_are_ignored(raw):
    assert validate_line(raw, "f", 1, CTX) is None


def test_bom_and_crlf_are_tolerated():
    raw = b"\xef\xbb\xbf" + json.dumps(chat_line("bom")).encode() + b"\r"
    row = check(raw)
    assert row["error_code"] is None and row["custom_id"] == "bom"


def test_custom_id_is_echoed_exactly():
    for cid in ["  spaced  ", "UPPER", "caf\u00e9", "cafe\u0301", "a\u00a0b", "任务-1"]:
        assert check(chat_line(cid))["custom_id"] == cid


@pytest.mark.parametrize("raw,code", [
    (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-llm", "messages": [{"role": "user", "content": "\xff"}]}}', "invalid_encoding"),
    (b'{"custom_id": "x", "body": "\\ud800"}', "invalid_encoding"),
    (b'not json', "invalid_json"),
    (b'{"custom_id": "x",', "invalid_json"),
    (b'[1, 2]', "invalid_json"),
    (b'"just a string"', "invalid_json"),
    (b'{"custom_id": "x", "n": NaN}', "invalid_json"),
    (b'{"custom_id": "x", "pad": "' + b"a" * 5000 + b'"}', "line_too_large"),
])
def test_malformed_lines(raw, code):
    row = check(raw)
    assert row["error_code"] == code, row["error_message"]
    assert row["raw_line"] is not None and len(row["raw_line"]) <= CTX.max_raw_line_chars
    assert row["kind"] is None and row["request"] is None


def test_deeply_nested_json_is_an_error_not_a_crash():
    ctx = validation_context(max_line_bytes=1 << 20)
    for raw in (b"[" * 100000 + b"]" * 100000, b'{"a":' * 50000 + b"1" + b"}" * 50000):
        row = validate_line(raw, "f", 1, ctx)
        assert row["error_code"] == "invalid_json" and "nested too deeply" in row["error_message"]


@pytest.mark.parametrize("line,carried", [
    ({"method": "POST", "url": "/v1/chat/completions", "body": {}}, None),
    ({"custom_id": None, "method": "POST"}, None),
    ({"custom_id": 12345, "method": "POST"}, "12345"),
    ({"custom_id": "", "method": "POST"}, ""),
    ({"custom_id": ["a"], "method": "POST"}, '["a"]'),
])
def test_an_unusable_custom_id_is_an_error_that_still_carries_what_the_line_gave(line, carried):
    row = check(line)
    assert row["error_code"] == "invalid_custom_id" and row["custom_id"] == carried


DEEP = b"[" * 50000 + b"]" * 50000


@pytest.mark.parametrize("raw,code,carried", [
    (b'{"custom_id": "u8", "body": {"messages": [{"role": "user", "content": "\xff"}]}}', "invalid_encoding", "u8"),
    (b'{"custom_id": "sur", "body": "\\ud800"}', "invalid_encoding", "sur"),
    (b'{"custom_id": "nan", "body": {"temperature": NaN}}', "invalid_json", "nan"),
    (b'{"custom_id": "inf", "n": -Infinity}', "invalid_json", "inf"),
    (b'{"custom_id": "extra", "method": "POST"} {"more": 1}', "invalid_json", "extra"),
    (b'{"custom_id": "comma", "method": "POST",}', "invalid_json", "comma"),
    (b'{"custom_id": "cut", "method": "PO', "invalid_json", "cut"),
    (b'{"custom_id": "deep", "body": ' + DEEP + b"}", "invalid_json", "deep"),
    (b'{"custom_id": 7, "method": "POST",}', "invalid_json", "7"),
    (b'{"custom_id": "big", "pad": "' + b"a" * 5000 + b'"}', "line_too_large", "big"),
    (b'{"custom_id": "\xff\xfe", "x": 1}', "invalid_encoding", "\ufffd\ufffd"),
    (b"{'custom_id': 'python-repr', 'method': 'POST', 'body': {}}", "invalid_json", "python-repr"),
    (b'  "custom_id": "pretty-printed",', "invalid_json", "pretty-printed"),
    (b"{'custom_id': 'it\\'s', 'x': None}", "invalid_json", "it's"),
    (b"not json at all", "invalid_json", None),
    (b'[{"custom_id": "in-a-list"}]', "invalid_json", None),
    (b'{"method": "POST", "body": ' + DEEP + b', "custom_id": "late"}', "invalid_json", None),
])
def test_a_broken_line_is_attributed_to_the_custom_id_it_shows(raw, code, carried):
    row = check(raw, validation_context(max_line_bytes=4096 if code == "line_too_large" else 1 << 20))
    assert (row["error_code"], row["custom_id"]) == (code, carried), row["error_message"]


@pytest.mark.parametrize("changes", [{"stream": 0}, {"stream": "false"}, {"store": 1}, {"metadata": "x"},
                                     {"user": 5}, {"logprobs": 1}, {"n": 2.0}, {"max_tokens": 8.0}, {"seed": True},
                                     {"parallel_tool_calls": 0}, {"ignore_eos": "yes"}])
def test_types_are_strict_as_openai_has_them(changes):
    row = check(with_body(**changes))
    assert row["error_code"] == "invalid_request" and next(iter(changes)) in row["error_message"]


@pytest.mark.parametrize("change,code", [
    ({"method": "GET"}, "invalid_method"),
    ({"method": None}, "invalid_method"),
    ({"url": "/v1/embeddings"}, "unsupported_endpoint"),
    ({"url": "/v2/chat/completions"}, "unsupported_endpoint"),
    ({"url": "/v1/chat/completions/"}, "unsupported_endpoint"),
    ({"url": 5}, "unsupported_endpoint"),
    ({"body": None}, "invalid_request"),
    ({"body": "text"}, "invalid_request"),
    ({"extra": 1}, "invalid_request"),
])
def test_envelope_rules(change, code):
    line = chat_line("a")
    line.update(change)
    row = check(line)
    assert row["error_code"] == code, row["error_message"]
    assert row["custom_id"] == "a"


def test_missing_method_url_body():
    for key, code in [("method", "invalid_method"), ("url", "unsupported_endpoint"), ("body", "invalid_request")]:
        line = chat_line("a")
        del line[key]
        assert code_of(line) == code


def test_lowercase_post_is_accepted():
    line = chat_line("a")
    line["method"] = "post"
    assert code_of(line) is None


@pytest.mark.parametrize("model,code", [
    ("other", "model_not_found"), ("TINY-LLM", "model_not_found"), ("tiny-llm ", "model_not_found"),
    ("", "model_not_found"), (None, "invalid_request"), (3, "invalid_request"),
])
def test_model_must_be_the_served_name(model, code):
    assert code_of(with_body(model=model)) == code


@pytest.mark.parametrize("messages,code", [
    ([], "invalid_request"),
    ("hello", "invalid_request"),
    (None, "invalid_request"),
    (["hello"], "invalid_request"),
    ([{"content": "no role"}], "invalid_request"),
    ([{"role": "wizard", "content": "x"}], "invalid_request"),
    ([{"role": "user"}], "invalid_request"),
    ([{"role": "user", "content": ""}], "invalid_request"),
    ([{"role": "user", "content": None}], "invalid_request"),
    ([{"role": "user", "content": 5}], "invalid_request"),
    ([{"role": "user", "content": []}], "invalid_request"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_not_supported"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "invalid_request"),
    ([{"role": "user", "content": "x", "audio": {}}], "unsupported_parameter"),
    ([{"role": "tool", "content": "x"}], "invalid_request"),
    ([{"role": "tool", "content": "x", "tool_call_id": "call_1"}], None),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], None),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}],
     "invalid_request"),
])
def test_messages_rules(messages, code):
    assert code_of(with_body(messages=messages)) == code


def test_missing_messages_and_text_parts():
    line = chat_line("a")
    del line["body"]["messages"]
    assert code_of(line) == "invalid_request"
    row = check(with_body(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}]))
    assert row["error_code"] is None
    assert json.loads(row["prompt_json"]) == {"messages": [{"role": "system", "content": "a\nb"}]}


@pytest.mark.parametrize("prompt,code", [
    ("", "invalid_request"), (None, "invalid_request"), (5, "invalid_request"), ([], "invalid_request"),
    ([1, -2], "invalid_request"), (["a", ""], "invalid_request"), ([["a"]], "invalid_request"),
    (["single"], None), ([1, 2, 3], None), (["a", "b"], None), (["a", [1, 2]], None),
])
def test_completion_prompt_rules(prompt, code):
    assert check(completion_line("p", prompt=prompt))["error_code"] == code


@pytest.mark.parametrize("changes,code", [
    ({"stream": True}, "unsupported_parameter"),
    ({"stream": False}, None),
    ({"tools": []}, "invalid_request"),
    ({"response_format": {"type": "json_object"}}, None),
    ({"logit_bias": {"5": -100, "7": 2.5}}, None),
    ({"logit_bias": {"five": 1}}, "invalid_request"),
    ({"logit_bias": {"5": 101}}, "invalid_request"),
    ({"logit_bias": [1]}, "invalid_request"),
    ({"functions": [{"name": "f"}]}, "unsupported_parameter"),
    ({"metadata": {"a": "b"}, "user": "x", "store": False}, None),
    ({"temperature": "hot"}, "invalid_request"),
    ({"temperature": -0.1}, "invalid_request"),
    ({"temperature": 2.5}, "invalid_request"),
    ({"temperature": True}, "invalid_request"),
    ({"top_p": 0}, "invalid_request"),
    ({"top_p": 1.5}, "invalid_request"),
    ({"top_p": 1}, None),
    ({"n": 0}, "invalid_request"),
    ({"n": 1.5}, "invalid_request"),
    ({"n": 2}, None),
    ({"max_tokens": 0}, "invalid_request"),
    ({"max_tokens": "10"}, "invalid_request"),
    ({"max_completion_tokens": 3}, None),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "invalid_request"),
    ({"presence_penalty": 2.1}, "invalid_request"),
    ({"frequency_penalty": -2.5}, "invalid_request"),
    ({"frequency_penalty": -2}, None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request"),
    ({"stop": [1]}, "invalid_request"),
    ({"stop": ""}, "invalid_request"),
    ({"seed": 1.5}, "invalid_request"),
    ({"logprobs": 3}, "invalid_request"),
    ({"top_logprobs": 2}, "invalid_request"),
    ({"logprobs": True, "top_logprobs": 25}, "invalid_request"),
    ({"logprobs": True, "top_logprobs": 2}, None),
])
def test_chat_sampling_rules(changes, code):
    row = check(with_body(**changes))
    assert row["error_code"] == code, row["error_message"]


def test_completion_logprobs_is_an_int():
    assert check(completion_line("p", logprobs=True))["error_code"] == "invalid_request"
    assert check(completion_line("p", logprobs=6))["error_code"] == "invalid_request"
    assert check(completion_line("p", logprobs=2, echo=False))["error_code"] is None
    row = check(completion_line("p", logprobs=2, echo=True))
    assert row["error_code"] == "unsupported_parameter" and "echo with logprobs" in row["error_message"]
    assert json.loads(check(completion_line("p", echo=True))["options_json"]) == {"echo_prompt": True}
    assert check(completion_line("p", echo="yes"))["error_code"] == "invalid_request"
    assert json.loads(check(completion_line("p", logprobs=2))["sampling_json"])["logprobs"] == 2


def test_openai_to_vllm_sampling_mapping():
    body = {"max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x", "y"], "seed": 5,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": True, "top_logprobs": 3, "top_k": 40,
            "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True}
    body.update(model="tiny-llm", messages=[{"role": "user", "content": "x"}], logit_bias={"5": -100})
    assert chat.check(body, CTX).sampling == {
        "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x", "y"], "seed": 5,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 3, "top_k": 40, "min_p": 0.1,
        "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "logit_bias": {"5": -100.0}}
    assert chat.check({**body, "top_logprobs": None}, CTX).sampling["logprobs"] == 0


def test_error_rows_keep_custom_id_and_a_bounded_raw_line():
    row = check(with_body(model="gpt-4o", messages=[{"role": "user", "content": "x" * 500}]))
    assert row["error_code"] == "model_not_found" and row["custom_id"] == "a"
    assert "tiny-llm" in row["error_message"] and "gpt-4o" in row["error_message"]
    assert len(row["raw_line"]) == CTX.max_raw_line_chars and row["raw_line"].endswith("…")


def test_requests_are_routed_to_the_model_or_adapter_they_name():
    from spark_llm.config import BatchConfig

    cfg = BatchConfig(model="/m/tiny-llm", lora_modules={"fin": "/m/fin"},
                      models=[{"name": "e5", "path": "/m/e5", "kind": "embed", "max_model_len": 512}])
    # no model directories here: resolved as engine.resolve_models would, with the runners the kinds say
    models = [c.resolved(max_model_len=2048, runner="generate") for c in cfg.resolved(2048).per_model()]
    ctx = ValidationContext.of_models(models)
    assert ctx.names() == ["tiny-llm", "fin", "e5"]

    def line(model, url="/v1/chat/completions"):
        body = {"model": model, **({"input": "x"} if "embeddings" in url else
                                   {"messages": [{"role": "user", "content": "hi"}]})}
        return json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body})

    assert validate_line(line("tiny-llm"), "f", 1, ctx)["model"] == "tiny-llm"
    row = validate_line(line("fin"), "f", 1, ctx)
    assert row["model"] == "tiny-llm" and json.loads(row["options_json"])["adapter"] == "fin"
    row = validate_line(line("e5", "/v1/embeddings"), "f", 1, ctx)
    assert (row["error_code"], row["model"], row["kind"]) == (None, "e5", "embedding")
    chat_on_e5 = validate_line(line("e5"), "f", 1, ctx)
    assert chat_on_e5["error_code"] == "unsupported_endpoint" and "set body.model to 'tiny-llm'" in \
        chat_on_e5["error_message"]
    embed_on_llm = validate_line(line("fin", "/v1/embeddings"), "f", 1, ctx)
    assert embed_on_llm["error_code"] == "unsupported_endpoint" and "'e5'" in embed_on_llm["error_message"]
    unknown = validate_line(line("gpt-4o"), "f", 1, ctx)
    assert unknown["error_code"] == "model_not_found" and unknown["model"] is None
    assert "one of 'tiny-llm', 'fin', 'e5'" in unknown["error_message"]
