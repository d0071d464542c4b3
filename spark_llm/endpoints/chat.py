"""``/v1/chat/completions``: messages (with tool calls and tool results), structured outputs, function tools.

The request becomes the chat template's inputs (``messages`` and ``tools``), SamplingParams keyword arguments and
the options the response body needs; the answer is a complete OpenAI ``ChatCompletion``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..engine_host.protocol import EngineTask
from ..errors import truncate
from . import common
from .common import Answer, Checked, Reply, invalid, json_type, number, unsupported

URL = "/v1/chat/completions"
KIND = "chat"
PARSE_REASONING = True  #: the engine's reasoning_parser splits thinking from the answer
TASK = EngineTask.GENERATE
FIELDS = (common.SAMPLING_FIELDS | common.HARMLESS_FIELDS
          | {"messages", "max_tokens", "max_completion_tokens", "n", "stop", "logprobs", "top_logprobs",
             "response_format", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"})

_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    images: list[str] = []  # the image parts' URLs, in order
    messages = _messages(body.get("messages"), ctx, images)
    tools = _tools(body.get("tools"), ctx)
    choice, named = common.tool_choice(body.get("tool_choice"), tools, _named, _NAMED)
    parallel = common.boolean(body, "parallel_tool_calls")
    options, tool_format = common.tool_choice_options(choice, named, tools or [], parallel, ctx)
    answer_format = common.response_format(body.get("response_format"), "body.response_format", ctx)
    if tool_format and answer_format:
        raise invalid("give response_format or a tool_choice that forces a call (required / a named function), "
                      "not both: both constrain the answer")
    sp = common.sampling(body, ctx, ("max_completion_tokens", "max_tokens"))
    if body.get("n") is not None:
        sp["n"] = number(body, "n", 1, ctx.max_n, integer=True)
    stops = common.stop_sequences(body, ctx)
    if stops:
        sp["stop"] = stops
    k = _logprobs(body)
    if k is not None:
        sp["logprobs"] = k
        options.logprobs = k
    if tool_format or answer_format:
        sp["structured_outputs"] = tool_format or answer_format
    prompt = common.template_inputs(messages, tools, choice, body.get("reasoning_effort"), "body.reasoning_effort")
    if images:
        options.images = images
    return Checked(prompt, sp, options)


ADD_SPECIAL_TOKENS = False  #: the chat template writes the special tokens itself


def prompt_texts(tokenizer: Any, prompt: dict) -> list[str]:
    """The chat template applied to the messages (and tools): the one text the engine will see."""
    return [tokenizer.apply_chat_template(prompt["messages"], tools=prompt.get("tools"), tokenize=False,
                                          add_generation_prompt=True, **prompt.get("template_kwargs", {}))]


def respond(outputs: list, reply: Reply) -> Answer:
    """A complete ``ChatCompletion`` for the engine's output (one prompt, ``n`` choices)."""
    out = outputs[0]
    k = reply.options.logprobs
    choices, reasoning_tokens, any_reasoning = [], 0, False
    for c in out.outputs:
        content, calls = common.answer_parts(c, reply.options, reply, c.index)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [{"id": call["id"], "type": "function",
                                      "function": {"name": call["name"], "arguments": call["arguments"]}}
                                     for call in calls]
        if c.reasoning is not None:
            message["reasoning"] = c.reasoning
            any_reasoning = True
        reasoning_tokens += c.reasoning_tokens
        reason = common.finish_reason(c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": _chat_logprobs(c, k),
                        "finish_reason": "tool_calls" if calls and reason == "stop" else reason})
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
    if any_reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    body = {"id": f"chatcmpl-{common.id_suffix(reply.request_id)}", "object": "chat.completion",
            "created": reply.created, "model": reply.model, "choices": choices, "usage": usage,
            "system_fingerprint": None}
    first = choices[0]["message"]
    return Answer(body, first["content"], choices[0]["finish_reason"], prompt_tokens, completion_tokens,
                  tool_calls=[c for c in first.get("tool_calls", [])] or None, reasoning=first.get("reasoning"))


# ---- request parts -------------------------------------------------------------------------------------------

def _messages(messages: Any, ctx: Any, images: list[str]) -> list[dict]:
    if messages is None:
        raise invalid(f"body.messages is required for {URL}")
    if not isinstance(messages, list):
        raise invalid(f"body.messages must be a list, got {json_type(messages)}")
    if not messages:
        raise invalid("body.messages must not be empty")
    return [_message(msg, f"body.messages[{i}]", ctx, images) for i, msg in enumerate(messages)]


def _message(msg: Any, where: str, ctx: Any, images: list[str]) -> dict:
    if not isinstance(msg, dict):
        raise invalid(f"{where} must be an object, got {json_type(msg)}")
    role = msg.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        got = "missing" if "role" not in msg else truncate(json.dumps(role, ensure_ascii=False), 60)
        raise invalid(f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {got}")
    extra = sorted(set(msg) - _MESSAGE_KEYS)
    if extra:
        raise unsupported(f"{where} field(s) not supported: {', '.join(extra)}")
    if role != "assistant" and "tool_calls" in msg:
        raise invalid(f"{where}.tool_calls is only allowed on assistant messages")
    if role == "assistant" and msg.get("tool_calls"):
        out: dict[str, Any] = {"role": "assistant",
                               "content": common.text_content(msg.get("content"), f"{where}.content",
                                                              ("text", "refusal"), required=False) or ""}
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(_list(msg["tool_calls"], f"{where}.tool_calls"))]
        return out
    if role == "user":  # images come in user turns, as OpenAI takes them
        content = common.user_content(msg.get("content"), f"{where}.content", ("text",), "image_url", ctx, images)
    else:
        content = common.text_content(msg.get("content"), f"{where}.content",
                                      ("text", "refusal") if role == "assistant" else ("text",))
    out = {"role": "system" if role == "developer" else role, "content": content}
    if role == "tool":
        if not isinstance(msg.get("tool_call_id"), str) or not msg["tool_call_id"]:
            raise invalid(f"{where}.tool_call_id is required on tool messages (the id of the call it answers)")
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise invalid(f"{where} must be a list, got {json_type(value)}")
    return value


def _history_call(call: Any, where: str) -> dict:
    """An earlier assistant turn's tool call, as chat templates read it (arguments as an object when they are
    JSON, the way vLLM's server hands them to templates)."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("function"), dict):
        raise invalid(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{name, arguments}}}}")
    fn = call["function"]
    if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise invalid(f"{where}.function needs a name and arguments (a JSON string)")
    try:
        arguments: Any = json.loads(fn["arguments"])
    except ValueError:
        arguments = fn["arguments"]
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _tools(tools: Any, ctx: Any) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not _list(tools, "body.tools"):
        raise invalid("body.tools must not be empty; leave it out for a request without tools")
    out = []
    for j, tool in enumerate(tools):
        where = f"body.tools[{j}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            got = tool.get("type") if isinstance(tool, dict) else json_type(tool)
            raise invalid(f"{where} must be a function tool {{\"type\": \"function\", \"function\": {{...}}}}; "
                          f"got type {truncate(str(got), 40)!r}")
        fn = tool["function"]
        out.append(common.function_tool(fn.get("name"), fn.get("parameters"), fn.get("description"),
                                        f"{where}.function", ctx))
    common.check_tool_names(out, "body.tools")
    return out


_NAMED = '{"type": "function", "function": {"name": ...}}'


def _named(choice: dict) -> str:
    if choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise invalid(f"body.tool_choice must be none, auto, required or {_NAMED}")
    return choice["function"].get("name")


def _logprobs(body: dict) -> Optional[int]:
    lp = common.boolean(body, "logprobs")
    if body.get("top_logprobs") is not None:
        top = number(body, "top_logprobs", 0, 20, integer=True)
        if not lp:
            raise invalid("body.top_logprobs requires logprobs: true")
        return top
    return 0 if lp else None


def _chat_logprobs(choice: Any, k: Optional[int]) -> Optional[dict]:
    if choice.logprobs is None or k is None:
        return None
    content = [{"token": token, "logprob": lp, "bytes": common.token_bytes(token),
                "top_logprobs": [{"token": t.decoded_token or "", "logprob": float(t.logprob),
                                  "bytes": common.token_bytes(t.decoded_token or "")} for t in tops]}
               for token, lp, tops in common.token_positions(choice, k)]
    return {"content": content, "refusal": None}
