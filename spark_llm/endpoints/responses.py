"""``/v1/responses``: the Responses API as a batch endpoint, answered with complete OpenAI ``Response`` objects.

``input`` (a string or message / ``function_call`` / ``function_call_output`` items) and ``instructions`` become
chat messages, rendered with the model's chat template like a chat request. Everything that needs OpenAI's server
state (``previous_response_id``, ``conversation``, ``background``, ``store: true``) or a hosted tool is an
``unsupported_parameter`` error row: a batch job has neither.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..engine_host.protocol import EngineTask
from ..errors import truncate
from . import chat, common
from .common import Answer, Checked, Reply, invalid, json_type, unsupported

URL = "/v1/responses"
KIND = "responses"
PARSE_REASONING = True
TASK = EngineTask.GENERATE
FIELDS = (common.SAMPLING_FIELDS | common.HARMLESS_FIELDS
          | {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "parallel_tool_calls",
             "reasoning", "truncation", "include"}
          | {"previous_response_id", "conversation", "background"})  # refused below with the reason
_STATEFUL = ("previous_response_id", "conversation")
_TEXT_PARTS = ("input_text", "output_text", "text")

prompt_texts, ADD_SPECIAL_TOKENS = chat.prompt_texts, chat.ADD_SPECIAL_TOKENS  # the chat template's


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    for key in _STATEFUL:
        if body.get(key) is not None:
            raise unsupported(f"body.{key} needs conversation state stored on OpenAI's servers, which a batch job "
                              f"does not have: put the earlier turns in body.input instead")
    if body.get("background"):
        raise unsupported("body.background: a batch request already runs in the background; drop it")
    if body.get("store"):
        raise unsupported("body.store: true asks OpenAI's servers to keep the response; a batch job writes every "
                          "response to its output tables instead. Set store to false or drop it")
    if body.get("include"):
        raise unsupported("body.include: no extra output data (logprobs, encrypted reasoning, sources) is "
                          "available from this job; drop it")
    if body.get("truncation") not in (None, "disabled"):
        raise unsupported("body.truncation auto is not supported: over-long inputs are context_length_exceeded "
                          "errors (see context_overflow)")
    images: list[str] = []  # the input_image parts' URLs, in order
    messages = _messages(body.get("input"), body.get("instructions"), ctx, images)
    tools = _tools(body.get("tools"), ctx)
    choice, named = common.tool_choice(body.get("tool_choice"), tools, _named, _NAMED)
    parallel = common.boolean(body, "parallel_tool_calls")
    options, tool_format = common.tool_choice_options(choice, named, tools or [], parallel, ctx)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise invalid(f"body.text must be an object, got {json_type(text)}")
    fmt = (text or {}).get("format")
    answer_format = common.response_format(fmt, "body.text.format", ctx)
    if tool_format and answer_format:
        raise invalid("give text.format or a tool_choice that forces a call (required / a named function), not "
                      "both: both constrain the answer")
    sp = common.sampling(body, ctx, ("max_output_tokens",))
    if tool_format or answer_format:
        sp["structured_outputs"] = tool_format or answer_format
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid(f"body.reasoning must be an object, got {json_type(reasoning)}")
    prompt = common.template_inputs(messages, tools, choice, (reasoning or {}).get("effort"),
                                    "body.reasoning.effort")
    options.echo = {
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": sp["temperature"], "top_p": sp["top_p"], "parallel_tool_calls": parallel is not False,
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                   "parameters": t["parameters"], "strict": t.get("strict", True)} for t in tools or []],
        "text": {"format": fmt or {"type": "text"}},
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
    }
    if images:
        options.images = images
    return Checked(prompt, sp, options)


def respond(outputs: list, reply: Reply) -> Answer:
    """A complete ``Response``: a reasoning item (when the reasoning parser found thinking), then the message
    and/or function calls."""
    out, suffix = outputs[0], common.id_suffix(reply.request_id)
    c = out.outputs[0]
    content, calls = common.answer_parts(c, reply.options, reply, 0)
    cut = common.finish_reason(c.finish_reason) == "length"
    items: list[dict[str, Any]] = []
    if c.reasoning is not None:
        items.append({"type": "reasoning", "id": f"rs_{suffix}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": c.reasoning}]})
    if content or not calls:
        items.append({"type": "message", "id": f"msg_{suffix}", "role": "assistant",
                      "status": "incomplete" if cut else "completed",
                      "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}]})
    for k, call in enumerate(calls):
        items.append({"type": "function_call", "id": f"fc_{suffix}_{k}", "call_id": call["id"],
                      "name": call["name"], "arguments": call["arguments"],
                      "status": "completed" if call.get("complete", True) else "incomplete"})
    input_tokens, output_tokens = len(out.prompt_token_ids), len(c.token_ids)
    body = {
        "id": f"resp_{suffix}", "object": "response", "created_at": reply.created, "model": reply.model,
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items, "previous_response_id": None, "reasoning": None, "store": False,
        "truncation": "disabled", "user": None,
        **(reply.options.echo or {}),
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                                                           "cache_write_tokens": 0},
                  "output_tokens": output_tokens,
                  "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                  "total_tokens": input_tokens + output_tokens},
    }
    tool_calls = [{"id": call["id"], "type": "function",
                   "function": {"name": call["name"], "arguments": call["arguments"]}} for call in calls]
    return Answer(body, content, "length" if cut else ("tool_calls" if calls else "stop"), input_tokens,
                  output_tokens, tool_calls=tool_calls or None, reasoning=c.reasoning)


# ---- request parts -------------------------------------------------------------------------------------------

def _messages(items: Any, instructions: Any, ctx: Any, images: list[str]) -> list[dict]:
    messages: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid(f"body.instructions must be a string, got {json_type(instructions)}")
        messages.append({"role": "system", "content": instructions})
    if items is None:
        raise invalid(f"body.input is required for {URL}")
    if isinstance(items, str):
        if not items:
            raise invalid("body.input must not be empty")
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("body.input must be a non-empty string or a non-empty list of input items")
    for j, item in enumerate(items):
        where = f"body.input[{j}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object, got {json_type(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant, got "
                              f"{truncate(json.dumps(role), 40)}")
            if role == "user":
                text = common.user_content(item.get("content"), f"{where}.content", _TEXT_PARTS, "input_image",
                                           ctx, images)
            else:
                text = common.text_content(item.get("content"), f"{where}.content", _TEXT_PARTS + ("refusal",))
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = _history_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # consecutive calls are one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}.call_id must be the call_id of the function_call it answers")
            output = common.text_content(item.get("output"), f"{where}.output", _TEXT_PARTS, required=False)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output or ""})
        elif kind == "reasoning":
            continue  # earlier turns' thinking is not shown to the model again (as chat templates do)
        else:
            raise unsupported(f"{where} has type {truncate(str(kind), 40)!r}; input items may be messages with "
                              f"text, function_call and function_call_output")
    if not any(m["role"] != "system" for m in messages):
        raise invalid("body.input holds no user, assistant or tool turn")
    return messages


def _history_call(item: dict, where: str) -> dict:
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str) \
            or not isinstance(item.get("call_id"), str):
        raise invalid(f"{where} (function_call) needs call_id, name and arguments (a JSON string)")
    try:
        arguments: Any = json.loads(item["arguments"])
    except ValueError:
        arguments = item["arguments"]
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def _tools(tools: Any, ctx: Any) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid(f"body.tools must be a list, got {json_type(tools)}")
    out = []
    for j, tool in enumerate(tools):
        where = f"body.tools[{j}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in common.HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith("web_search")):
            raise unsupported(f"{where} is the hosted tool {kind!r}, which runs on OpenAI's servers; only function "
                              f"tools can be served by a batch job")
        if kind != "function":
            raise invalid(f"{where} must be a function tool {{\"type\": \"function\", \"name\", \"parameters\"}}, "
                          f"got type {truncate(str(kind), 40)!r}")
        fn = common.function_tool(tool.get("name"), tool.get("parameters"), tool.get("description"), where, ctx)
        fn["strict"] = common.boolean(tool, "strict", where) is not False
        out.append(fn)
    common.check_tool_names(out, "body.tools")
    return out or None


_NAMED = '{"type": "function", "name": ...}'


def _named(choice: dict) -> str:
    if choice.get("type") != "function":
        raise unsupported(f"body.tool_choice of type {truncate(str(choice.get('type')), 40)!r} is not supported; use "
                          f"none, auto, required or {_NAMED}")
    return choice.get("name")
