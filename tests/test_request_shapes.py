"""Every request shape of an OpenAI batch through the real job (the shared run's shapes.jsonl) and real vLLM:
structured outputs, function tools, the Responses API, logit_bias, prompt lists, seeds; and reasoning parsing on
an engine of its own."""

from __future__ import annotations

import json

import jsonschema
import pytest

from batch_lines import (BIASED_TOKEN, CHAT_TOOLS, PERSON, RESPONSES_TOOLS, SENTIMENT, SHAPES_FILE, TIME, WEATHER,
                         schema_format)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def rows(spark, shared_run):
    out = spark.read.format("delta").load(shared_run.result.outputs_table)
    return {r["custom_id"]: r.asDict() for r in out.where(out.file.endswith(SHAPES_FILE)).collect()}


@pytest.fixture(scope="module")
def errors(spark, shared_run):
    err = spark.read.format("delta").load(shared_run.result.errors_table)
    return {r["custom_id"]: r.asDict() for r in err.where(err.file.endswith(SHAPES_FILE)).collect()}


def body(row):
    return json.loads(row["response_body"])


def test_json_schema_enum_answer_is_one_of_the_values(rows):
    row = rows["so-enum"]
    assert row["finish_reason"] == "stop"
    assert json.loads(row["text"])["label"] in SENTIMENT["properties"]["label"]["enum"]
    assert row["text"] == body(row)["choices"][0]["message"]["content"]
    assert " " not in row["text"]  # compact_json: no whitespace between JSON tokens


def test_object_schema_answers_validate_whenever_they_stop(rows):
    for cid, schema in (("so-object", PERSON), ("so-json-object", {"type": "object"})):
        row = rows[cid]
        assert row["finish_reason"] in ("stop", "length")
        if row["finish_reason"] == "stop":
            jsonschema.validate(json.loads(row["text"]), schema)
    assert rows["so-text"]["finish_reason"] == "length"  # type text: unconstrained


def test_named_and_required_tool_calls_carry_valid_arguments(rows):
    from openai.types.chat import ChatCompletion

    named = ChatCompletion.model_validate(body(rows["tool-named"]))
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    assert named.choices[0].message.content is None
    if named.choices[0].finish_reason == "tool_calls":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert json.loads(rows["tool-named"]["tool_calls"])[0]["function"]["name"] == "get_weather"
    assert rows["tool-named"]["text"] is None

    required = ChatCompletion.model_validate(body(rows["tool-required"]))
    choice = required.choices[0]
    if choice.finish_reason == "tool_calls":
        calls = choice.message.tool_calls
        assert len(calls) == 1  # parallel_tool_calls false
        schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    else:
        assert choice.finish_reason == "length"


def test_auto_tool_choice_returns_text_or_calls(rows):
    from openai.types.chat import ChatCompletion

    auto = ChatCompletion.model_validate(body(rows["tool-auto"]))
    message = auto.choices[0].message
    assert message.tool_calls or message.content is not None
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tools reached the chat template: the same question costs more prompt tokens with them than without
    assert rows["tool-auto"]["prompt_tokens"] > rows["tool-none"]["prompt_tokens"]
    assert rows["tool-history"]["finish_reason"] in ("stop", "length")


def test_responses_bodies_are_complete_response_objects(rows):
    from openai.types.responses import Response

    text = Response.model_validate(body(rows["resp-text"]))
    assert text.object == "response" and text.id.startswith("resp_") and text.instructions == "Be brief."
    assert text.usage.input_tokens == rows["resp-text"]["prompt_tokens"]
    assert text.usage.output_tokens == rows["resp-text"]["completion_tokens"] <= 4
    assert text.usage.total_tokens == text.usage.input_tokens + text.usage.output_tokens
    if text.status == "incomplete":
        assert text.incomplete_details.reason == "max_output_tokens" and text.usage.output_tokens == 4
    assert text.output[0].type == "message" and text.output_text == rows["resp-text"]["text"]
    assert text.metadata == {"k": "v"} and text.max_output_tokens == 4

    items = Response.model_validate(body(rows["resp-items"]))
    if items.status == "completed":
        assert json.loads(items.output_text)["label"] in SENTIMENT["properties"]["label"]["enum"]
    assert items.text.format.type == "json_schema"

    tool = Response.model_validate(body(rows["resp-tool"]))
    calls = [item for item in tool.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    if tool.status == "completed":
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert json.loads(rows["resp-tool"]["tool_calls"])[0]["function"]["name"] == "get_weather"


def test_sampling_surface(rows, tiny_model):
    from openai.types import Completion
    from transformers import AutoTokenizer

    assert rows["seed-a"]["text"] == rows["seed-b"]["text"]  # the same seed at temperature 1: the same text
    biased = body(rows["logit-bias"])["choices"][0]
    token = AutoTokenizer.from_pretrained(tiny_model).decode([BIASED_TOKEN])
    assert biased["text"] == token * 4
    listed = Completion.model_validate(body(rows["comp-list"]))
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]  # prompt 0's two choices, then prompt 1's
    assert listed.usage.completion_tokens == 12 and listed.usage.prompt_tokens == rows["comp-list"]["prompt_tokens"]
    assert rows["max-completion"]["completion_tokens"] == 2
    echoed = Completion.model_validate(body(rows["comp-echo"]))  # echo: each prompt, then what was generated
    assert [c.text[:len(p)] for c, p in zip(echoed.choices, ["Once upon a time", "批量 处理"])] == \
        ["Once upon a time", "批量 处理"]
    assert all(len(c.text) > len(p) for c, p in zip(echoed.choices, ["Once upon a time", "批量 处理"]))


def test_a_lora_adapter_answers_under_its_name(rows, errors, spark, shared_run):
    from conftest import ADAPTER, MODEL_NAME

    base, lora = rows["base-story"], rows["lora-story"]
    assert (base["model"], body(base)["model"]) == (MODEL_NAME, MODEL_NAME)
    assert (lora["model"], body(lora)["model"]) == (ADAPTER, ADAPTER) and rows["lora-comp"]["model"] == ADAPTER
    assert base["prompt_tokens"] == lora["prompt_tokens"] and base["text"] != lora["text"]  # the adapter's weights
    assert ADAPTER in errors["no-such-adapter"]["message"]


def test_bad_shapes_are_error_rows_that_say_what_to_change(errors, shared_run):
    expected = {k: v for k, v in shared_run.expected.items() if k[0] == SHAPES_FILE and v != "ok"}
    assert {(e["file"].rsplit("/", 1)[-1], e["line_number"]): e["code"] for e in errors.values()} == expected
    assert "Lookbehind" in errors["bad-schema-compile"]["message"]
    assert "'objectx'" in errors["bad-schema"]["message"]
    assert all(name in errors["bad-tool-choice"]["message"] for name in ("send_email", "get_weather"))
    assert "999999" in errors["bad-logit-id"]["message"] and "vocabulary" in errors["bad-logit-id"]["message"]
    assert "previous_response_id" in errors["resp-prev"]["message"]
    assert "web_search_preview" in errors["resp-hosted"]["message"]
    assert "store" in errors["resp-store"]["message"]


# ---- reasoning: an engine of its own, with vLLM's deepseek_r1 parser ----------------------------------------

@pytest.fixture(scope="module")
def thinking_engine(tiny_model):
    """An engine with reasoning_parser deepseek_r1, in a slot of this test process (beside the Spark executors'
    engines, which keep theirs), stopped when the module ends."""
    from conftest import engine_settings
    from spark_llm.config import BatchConfig
    from spark_llm.engine_host import EngineSpec
    from spark_llm.engine_host import ProcessSettings, TaskPlace, engine_for
    from spark_llm.engine_host.client import stop_engines_on

    cfg = BatchConfig(**{**engine_settings(tiny_model), "reasoning_parser": "deepseek_r1"}).resolved(1024)
    with engine_for(EngineSpec.from_config(cfg), ProcessSettings(0, "WARNING"), TaskPlace()) as engine:
        yield engine
    stop_engines_on(engine.slot)


def ask(engine, tok, body: dict, endpoint):
    from spark_llm.endpoints import Reply
    from spark_llm.engine_host import EngineRequest, Parse
    from spark_llm.tokens import render_prompt
    from conftest import validation_context

    checked = endpoint.check({"model": "tiny-llm", **body}, validation_context(tool_call_parser="hermes"))
    [ids], _ = render_prompt(tok, endpoint.KIND, checked.prompt)
    [out] = engine.generate([EngineRequest(ids, checked.sampling, endpoint.TASK, Parse(endpoint.PARSE_REASONING))])
    return out, endpoint.respond([out], Reply("req_0123456789abcdef", "tiny-llm", 1, checked.options))


def test_reasoning_is_split_from_the_answer_and_counted(thinking_engine, tiny_model):
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response
    from spark_llm.endpoints import chat, responses
    from spark_llm.tokenizers import get_tokenizer

    tok = get_tokenizer(tiny_model)
    # the tiny model never closes its thinking: everything it generates is reasoning, there is no answer yet
    out, answer = ask(thinking_engine, tok, {"messages": [{"role": "user", "content": "Think."}],
                                             "temperature": 0, "max_tokens": 6}, chat)
    choice = ChatCompletion.model_validate(answer.body).choices[0]
    assert out.outputs[0].reasoning == out.outputs[0].text and answer.reasoning == out.outputs[0].text
    assert choice.message.content is None and answer.text is None
    assert answer.body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}

    # "</think>" forced as the first token ends the thinking; the json_schema then constrains the answer after it
    end = tok.convert_tokens_to_ids("</think>")
    body = {"messages": [{"role": "user", "content": "Label it."}], "temperature": 0, "max_tokens": 30,
            "logit_bias": {str(end): 100}, "response_format": schema_format("s", SENTIMENT)}
    out, answer = ask(thinking_engine, tok, body, chat)
    assert out.outputs[0].token_ids[0] == end
    assert answer.reasoning == "" and answer.finish_reason == "stop"
    assert json.loads(answer.text)["label"] in SENTIMENT["properties"]["label"]["enum"]

    out, answer = ask(thinking_engine, tok, {"input": "Think.", "temperature": 0, "max_output_tokens": 5},
                      responses)
    parsed = Response.model_validate(answer.body)
    assert parsed.output[0].type == "reasoning" and parsed.output[0].content[0].text == out.outputs[0].text
    assert parsed.usage.output_tokens_details.reasoning_tokens == 5 and parsed.status == "incomplete"


# ---- a forced tool call that max_tokens cuts: an engine without the reasoning parser ------------------------------

@pytest.fixture(scope="module")
def plain_engine(tiny_model):
    from conftest import engine_settings
    from spark_llm.config import BatchConfig
    from spark_llm.engine_host import EngineSpec, ProcessSettings, TaskPlace, engine_for
    from spark_llm.engine_host.client import stop_engines_on

    cfg = BatchConfig(**engine_settings(tiny_model)).resolved(1024)
    with engine_for(EngineSpec.from_config(cfg), ProcessSettings(0, "WARNING"), TaskPlace()) as engine:
        yield engine
    stop_engines_on(engine.slot)


def test_a_forced_tool_call_cut_by_max_tokens_is_still_a_tool_call(plain_engine, tiny_model):
    """tool_choice required or named, chat and Responses, max_tokens ending inside the call's arguments: the call
    comes back in tool_calls (function_call items), its arguments as generated, finish reason length."""
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response
    from spark_llm.endpoints import chat, responses
    from spark_llm.tokenizers import get_tokenizer

    tok = get_tokenizer(tiny_model)

    def cut_inside_city(whole) -> int:
        """max_tokens that ends a token or so into the city's name of ``whole``'s answer."""
        text, ids = whole.outputs[0].text, whole.outputs[0].token_ids
        inside = text.index('"city"') + len('"city": "') + 1
        return next(k for k in range(1, len(ids)) if len(tok.decode(ids[:k])) >= inside)

    def ask_chat(choice, n):
        return ask(plain_engine, tok, {"messages": [{"role": "user", "content": "Weather in Tokyo?"}],
                                       "temperature": 0, "max_tokens": n, "tools": [CHAT_TOOLS[0]],
                                       "tool_choice": choice, "parallel_tool_calls": False}, chat)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole, answer = ask_chat(choice, 200)
        assert answer.finish_reason == "tool_calls" and whole.outputs[0].finish_reason == "stop", answer.body
        cut, answer = ask_chat(choice, cut_inside_city(whole))
        text = whole.outputs[0].text
        assert cut.outputs[0].finish_reason == "length" and text.startswith(cut.outputs[0].text)
        message = ChatCompletion.model_validate(answer.body).choices[0]
        assert message.finish_reason == "length" and message.message.content is None
        [call] = message.message.tool_calls
        assert call.function.name == "get_weather" and '"city"' in call.function.arguments
        assert call.function.arguments in text and not call.function.arguments.endswith("}")

    def ask_responses(n):
        return ask(plain_engine, tok, {"input": "Weather in Tokyo?", "temperature": 0, "max_output_tokens": n,
                                       "tools": RESPONSES_TOOLS, "tool_choice": "required",
                                       "parallel_tool_calls": False}, responses)
    whole, _ = ask_responses(200)
    _, answer = ask_responses(cut_inside_city(whole))
    body = Response.model_validate(answer.body)
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    [item] = [o for o in body.output if o.type == "function_call"]
    assert item.name == "get_weather" and item.status == "incomplete" and '"city"' in item.arguments
