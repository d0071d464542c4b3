"""What the engine process does for the endpoints: vLLM ``SamplingParams`` (or ``PoolingParams``) from the JSON
keyword arguments the endpoint modules build, and the reasoning / tool-call parsing of answers with vLLM's parser
registries.

This module imports vLLM; only the engine process (:mod:`~spark_llm.engine_host.server`) imports it, where vLLM and the
model's tokenizer are loaded anyway, so Spark's Python workers never pay for them.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..engine_host.protocol import Choice, EngineRequest, Parse
from ..errors import EngineStartError

log = logging.getLogger(__name__)


def engine_params(request: EngineRequest) -> Any:
    """vLLM's settings for an :class:`~spark_llm.engine_host.protocol.EngineRequest`: ``SamplingParams`` from the
    keyword arguments its endpoint's ``check`` made for a generation, ``PoolingParams`` for a pooling task (the
    embeddings endpoint's ``dimensions``; ``max_tokens``, kept for the token stage's cost, is no pooling setting)."""
    from vllm import PoolingParams, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if not request.task.generates:
        return PoolingParams(**{k: v for k, v in request.params.items() if k != "max_tokens"})
    kw = dict(request.params)
    if kw.get("structured_outputs"):
        kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    if kw.get("logit_bias"):
        kw["logit_bias"] = {int(k): float(v) for k, v in kw["logit_bias"].items()}
    return SamplingParams(**kw)


class Parsers:
    """The engine's reasoning parser and tool-call parser (vLLM registry names; either may be unset)."""

    def __init__(self, tokenizer: Any, tool_call_parser: Optional[str], reasoning_parser: Optional[str]):
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        self.tokenizer = tokenizer
        self.tool_parser_cls = _lookup(ToolParserManager, ToolParserManager.get_tool_parser, tool_call_parser,
                                       "tool_call_parser")
        cls = _lookup(ReasoningParserManager, ReasoningParserManager.get_reasoning_parser, reasoning_parser,
                      "reasoning_parser")
        try:
            self.reasoning = cls(tokenizer) if cls else None
        except Exception as exc:
            raise EngineStartError(f"reasoning_parser {reasoning_parser!r} does not fit this model's tokenizer: "
                                   f"{exc}") from None

    def parse(self, choice: Choice, parse: Parse) -> None:
        """Split ``choice.text`` into reasoning, answer and tool calls (in place) as ``parse`` asks; nothing when
        there is no parser for it."""
        reasoning_wanted = parse.reasoning and self.reasoning is not None
        tools = parse.tools
        if not reasoning_wanted and not (tools and self.tool_parser_cls):
            return
        request = _chat_request(tools)
        content: Optional[str] = choice.text
        if reasoning_wanted:
            choice.reasoning, content = self.reasoning.extract_reasoning(choice.text, request)
            counted = self.reasoning.count_reasoning_tokens(choice.token_ids)
            if not counted and choice.reasoning:  # thinking opened by the chat template, not by a generated tag
                counted = (len(self.tokenizer.encode(choice.reasoning, add_special_tokens=False)) if content
                           else len(choice.token_ids))
            choice.reasoning_tokens = counted
        if tools and self.tool_parser_cls and content:
            info = self.tool_parser_cls(self.tokenizer).extract_tool_calls(content, request)
            if info.tools_called:
                choice.tool_calls = [{"name": c.function.name, "arguments": c.function.arguments}
                                     for c in info.tool_calls]
                content = info.content
        choice.content = content
        choice.parsed = True


def _lookup(manager: Any, get: Any, name: Optional[str], setting: str) -> Any:
    if not name:
        return None
    try:
        return get(name)
    except KeyError:
        known = ", ".join(sorted(manager.list_registered()))
        raise EngineStartError(f"{setting} {name!r} is not in vLLM's registry; known: {known}") from None


def _chat_request(tools: Optional[list[dict]]) -> Any:
    """The request object vLLM's parsers are written against."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    fn_tools = [{"type": "function", "function": {k: v for k, v in t.items() if v is not None and k != "strict"}}
                for t in tools or []]
    return ChatCompletionRequest(model="batch", messages=[{"role": "user", "content": ""}],
                                 tools=fn_tools or None, tool_choice="auto" if fn_tools else None)
