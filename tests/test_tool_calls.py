"""A forced tool call that max_tokens cuts is still a tool call (as OpenAI answers it): the complete calls parsed,
the cut one with its arguments as generated. The parsing alone; tests/test_request_shapes.py runs it through the
engine's constrained decoding."""

from __future__ import annotations

from spark_llm.endpoints.common import ResponseOptions, tool_calls_from_output

REQUIRED = ResponseOptions(tool_choice="required")
NAMED = ResponseOptions(tool_choice="named", tool_name="get_weather")


def test_a_cut_array_gives_its_complete_calls_and_the_cut_one_as_generated():
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Pa'
    calls = tool_calls_from_output(text, REQUIRED, cut=True)
    assert calls == [{"name": "get_time", "arguments": '{"zone": "UTC"}', "complete": True},
                     {"name": "get_weather", "arguments": '{"city": "Pa', "complete": False}]


def test_a_cut_named_call_keeps_its_arguments_as_generated():
    assert tool_calls_from_output('{"city": "Tok', NAMED, cut=True) == [
        {"name": "get_weather", "arguments": '{"city": "Tok', "complete": False}]


def test_a_call_cut_before_its_name_is_left_out_and_an_uncut_broken_answer_is_no_call():
    assert tool_calls_from_output('[{"na', REQUIRED, cut=True) is None
    assert tool_calls_from_output('[{"name": "get_time", "parameters": {}}, {"na', REQUIRED, cut=True) == [
        {"name": "get_time", "arguments": "{}", "complete": True}]
    assert tool_calls_from_output('{"city": "Tok', NAMED, cut=False) is None  # not cut: not the JSON it was held to
    assert tool_calls_from_output('[{"name": "get_time", "parameters": {}}]', REQUIRED) == [
        {"name": "get_time", "arguments": "{}", "complete": True}]
