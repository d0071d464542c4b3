"""The lines of the shared end-to-end run: every validation rule, hostile bytes and a fault-injected request, in
three input files. Each builder returns (file name, line number) -> expected outcome (OK or an error code)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

from conftest import (ADAPTER, KILL_CUSTOM_ID, MODEL_NAME, POISON_ENGINE_ID, POISON_WORKER_ID, chat_line,
                      completion_line, write_jsonl)

OK = "ok"
SECRET_PROMPT = "zebra-violet-secret-prompt"
HOSTILE_FILE = "hostile.jsonl"


def build_e2e_input(root: Path) -> dict[tuple[str, int], str]:
    """a.jsonl and b.jsonl: every rule once; returns (file name, line number) -> expected outcome (OK or a code)."""
    a = [
        chat_line("chat-greedy", "Summarize: Spark runs tasks in parallel.", temperature=0, max_tokens=6),
        chat_line("zh-1", "请总结以下文本的核心观点：批量推理可以降低成本。", temperature=0, max_tokens=5),
        "",
        b"\xef\xbb\xbf" + json.dumps(chat_line("bom-in-line", temperature=0)).encode(),
        json.dumps(chat_line("crlf", temperature=0)) + "\r",
        chat_line("n2", "Name a color.", n=2, temperature=0.8, seed=1, max_tokens=4),
        chat_line("lp", "Say yes.", temperature=0, max_tokens=3, logprobs=True, top_logprobs=2),
        completion_line("comp-1", "Once upon a time", temperature=0, max_tokens=5, logprobs=2, stop=["\n\n"]),
        completion_line("comp-ids", [5, 6, 7, 8], temperature=0, max_tokens=4),
        chat_line("  spaced id ", temperature=0, max_tokens=2),
        "this is not json",
        "[1, 2, 3]",
        b'{"custom_id": "bad-utf8", "body": "\xff"}',
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},
        {**chat_line("get"), "method": "GET"},
        {**chat_line("embed"), "url": "/v1/embeddings"},
        {**chat_line("no-body"), "body": None},
        chat_line("wrong-model") | {"body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}},
        chat_line("empty-msgs") | {"body": {"model": MODEL_NAME, "messages": []}},
        chat_line("bad-role") | {"body": {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}},
        chat_line("stream", stream=True),
        chat_line("hot", temperature=3),
        chat_line("tools", tools=[]),
        completion_line("too-long", "word " * 1200, max_tokens=8),
        chat_line("chat-greedy", "a duplicate of line 1"),
        # valid for the API, but over the engine's max_logprobs (3): the real engine rejects this one request
        chat_line("engine-reject", "Hi", temperature=0, max_tokens=2, logprobs=True, top_logprobs=5),
    ]
    b = [
        chat_line("zh-1", "a duplicate of a line in another file"),
        completion_line("comp-b", "The weather today", temperature=0, max_tokens=4),
        "{truncated",
        chat_line(KILL_CUSTOM_ID, "The worker answering this dies once.", temperature=0, max_tokens=2),
        chat_line(POISON_WORKER_ID, "The worker dies whenever this is in flight.", temperature=0, max_tokens=2),
        chat_line(POISON_ENGINE_ID, "The engine dies whenever this is in flight.", temperature=0, max_tokens=2),
    ]
    expected_a = [OK, OK, None, OK, OK, OK, OK, OK, OK, OK, "invalid_json", "invalid_json", "invalid_encoding",
                  "invalid_custom_id", "invalid_method", "unsupported_endpoint", "invalid_request",
                  "model_not_found", "invalid_request", "invalid_request", "unsupported_parameter", "invalid_request",
                  "invalid_request", "context_length_exceeded", "duplicate_custom_id", "engine_error"]
    expected_b = ["duplicate_custom_id", OK, "invalid_json", OK, "engine_error", "engine_error"]
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "a.jsonl", a)
    write_jsonl(root / "b.jsonl", b)
    expected = {("a.jsonl", i + 1): e for i, e in enumerate(expected_a) if e is not None}
    expected.update({("b.jsonl", i + 1): e for i, e in enumerate(expected_b)})
    return expected


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
        (json.dumps(chat_line("h-crlf", temperature=0, max_tokens=2)).encode() + b"\r", OK),
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
        ({**env("resp-url"), "url": "/v1/responses"}, "unsupported_parameter"),  # chat's messages sent to Responses
        ({k: v for k, v in env("h-no-body").items() if k != "body"}, "invalid_request"),
        ({**env("null-body"), "body": None}, "invalid_request"),
        ({**env("list-body"), "body": []}, "invalid_request"),
        # a broken line showing a custom_id is attributed to it but does not claim it: the valid "Case" still runs
        (b'{"custom_id": "Case", "method": "POST",}', "invalid_json"),
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
        (env("h-stream", stream=True), "unsupported_parameter"),
        (env("n0", n=0), "invalid_request"),
        (env("temp-neg", temperature=-1), "invalid_request"),
        (env("top-p-0", top_p=0), "invalid_request"),
        (env("top-p-big", top_p=1.01), "invalid_request"),
        (env("pen", presence_penalty=2.5), "invalid_request"),
        (env("max0", max_tokens=0), "invalid_request"),
        (env("stops", stop=["a", "b", "c", "d", "e"]), "invalid_request"),
        (env("lp-type", logprobs="yes"), "invalid_request"),
        (env("h-tools", tools=[{"type": "function"}]), "invalid_request"),
        (env("fmt", response_format={"type": "xml"}), "invalid_request"),
        (completion_line("echo", echo=True, logprobs=2), "unsupported_parameter"),
        (completion_line("comp-ok", temperature=0, max_tokens=3), OK),
    ]
    return cases


def build_hostile_input(root: Path) -> dict[tuple[str, int], str]:
    """hostile.jsonl: the cases above, the last line without a trailing newline."""
    cases = hostile_cases()
    data = b"\n".join(c if isinstance(c, bytes) else json.dumps(c, ensure_ascii=False).encode() for c, _ in cases)
    last = json.dumps(chat_line("no-trailing-newline", temperature=0, max_tokens=2)).encode()
    (root / HOSTILE_FILE).write_bytes(data + b"\n" + last)
    expected = {(HOSTILE_FILE, i + 1): e for i, (_, e) in enumerate(cases) if e is not None}
    expected[(HOSTILE_FILE, len(cases) + 1)] = OK
    return expected


# ---- request shapes: structured outputs, tools, the Responses API, the rest of the sampling surface ---------------

SHAPES_FILE = "shapes.jsonl"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"], "additionalProperties": False}
SENTIMENT = {"type": "object", "properties": {"label": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
             "required": ["label"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
BIASED_TOKEN = 309  #: " to" in the tiny tokenizer; logit_bias +100 on it makes it every generated token


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def on_model(line: dict, model: str) -> dict:
    return {**line, "body": {**line["body"], "model": model}}


def responses_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": {"model": MODEL_NAME, **body}}


def shapes_cases() -> list[tuple[dict, str]]:
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    return [
        (chat_line("so-enum", "Is this review positive? Great phone.", temperature=0, max_tokens=40,
                   response_format=schema_format("sentiment", SENTIMENT)), OK),
        (chat_line("so-object", "Describe a person.", temperature=0.7, seed=3, max_tokens=60,
                   response_format=schema_format("person", PERSON)), OK),
        (chat_line("so-json-object", "Give JSON.", temperature=0, max_tokens=40,
                   response_format={"type": "json_object"}), OK),
        (chat_line("so-text", "Say hi.", temperature=0, max_tokens=3, response_format={"type": "text"}), OK),
        (chat_line("tool-named", "Weather in Tokyo for 3 days?", temperature=0, max_tokens=40, tools=CHAT_TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}}), OK),
        (chat_line("tool-required", "Weather or time?", temperature=0.8, seed=5, max_tokens=80, tools=CHAT_TOOLS,
                   tool_choice="required", parallel_tool_calls=False), OK),
        (chat_line("tool-auto", "Weather in Paris?", temperature=0, max_tokens=8, tools=CHAT_TOOLS), OK),
        (chat_line("tool-none", "Hi", temperature=0, max_tokens=3, tools=CHAT_TOOLS, tool_choice="none"), OK),
        (chat_line("tool-history", temperature=0, max_tokens=4, tools=CHAT_TOOLS) | {
            "body": {"model": MODEL_NAME, "messages": history, "tools": CHAT_TOOLS, "temperature": 0,
                     "max_tokens": 4}}, OK),
        (responses_line("resp-text", input="Say something.", instructions="Be brief.", max_output_tokens=4,
                        temperature=0, metadata={"k": "v"}, store=False), OK),
        (responses_line("resp-items", temperature=0, max_output_tokens=40, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "function_call", "call_id": "call_9", "name": "get_weather",
             "arguments": '{"city": "Paris", "days": 1}'},
            {"type": "function_call_output", "call_id": "call_9", "output": "rain"},
            {"role": "user", "content": "Summarize as JSON."}],
            text={"format": {"type": "json_schema", "name": "sentiment", "schema": SENTIMENT, "strict": True}},
            tools=RESPONSES_TOOLS, tool_choice="none"), OK),
        (responses_line("resp-tool", input="Weather in Oslo?", temperature=0, max_output_tokens=40,
                        tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_weather"}), OK),
        (chat_line("seed-a", "Tell a story.", temperature=1.0, seed=1234, max_tokens=8), OK),
        (chat_line("seed-b", "Tell a story.", temperature=1.0, seed=1234, max_tokens=8), OK),
        (completion_line("logit-bias", "Once", temperature=1.0, max_tokens=4, logit_bias={str(BIASED_TOKEN): 100}),
         OK),
        (completion_line("comp-list", ["Once upon", [5, 6, 7]], temperature=0.8, seed=2, max_tokens=3, n=2), OK),
        (chat_line("max-completion", "Hi", temperature=0, max_completion_tokens=2), OK),
        (completion_line("comp-echo", ["Once upon a time", "批量 处理"], temperature=0, max_tokens=3, echo=True),
         OK),
        # a LoRA adapter: the same prompt on the base model and on the adapter
        (chat_line("base-story", "Tell a story about Spark.", temperature=0, max_tokens=6), OK),
        (on_model(chat_line("lora-story", "Tell a story about Spark.", temperature=0, max_tokens=6), ADAPTER), OK),
        (on_model(completion_line("lora-comp", "Once upon", temperature=0, max_tokens=3), ADAPTER), OK),
        (on_model(chat_line("no-such-adapter"), "tiny-lora-v2"), "model_not_found"),
        # refused, each with its reason; the rest of the batch runs
        (chat_line("bad-schema", response_format=schema_format("x", {"type": "objectx"})), "invalid_request"),
        (chat_line("bad-schema-compile", response_format=schema_format(
            "x", {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}})),
         "invalid_request"),
        (chat_line("bad-schema-name", response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
         "invalid_request"),
        (chat_line("bad-format-type", response_format={"type": "yaml"}), "invalid_request"),
        (chat_line("bad-tool-choice", tools=CHAT_TOOLS,
                   tool_choice={"type": "function", "function": {"name": "send_email"}}), "invalid_request"),
        (chat_line("bad-tool-type", tools=[{"type": "retrieval"}]), "invalid_request"),
        (chat_line("bad-both", tools=CHAT_TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "invalid_request"),
        (completion_line("bad-logit-id", logit_bias={"999999": 5}), "invalid_request"),
        (completion_line("bad-logit-value", logit_bias={"5": 500}), "invalid_request"),
        (responses_line("resp-prev", input="hi", previous_response_id="resp_123"), "unsupported_parameter"),
        (responses_line("resp-hosted", input="hi", tools=[{"type": "web_search_preview"}]), "unsupported_parameter"),
        (responses_line("resp-store", input="hi", store=True), "unsupported_parameter"),
        (responses_line("resp-no-input"), "invalid_request"),
    ]


def build_shapes_input(root: Path) -> dict[tuple[str, int], str]:
    cases = shapes_cases()
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / SHAPES_FILE, [c for c, _ in cases])
    return {(SHAPES_FILE, i + 1): e for i, (_, e) in enumerate(cases)}
