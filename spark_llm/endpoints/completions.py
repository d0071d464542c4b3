"""``/v1/completions``: one prompt or a list of prompts (strings or token ids); the answer is a complete OpenAI
``Completion`` with ``n`` choices per prompt in OpenAI's order (prompt 0's choices, then prompt 1's ...)."""

from __future__ import annotations

from typing import Any, Optional

from ..engine_host.protocol import EngineTask
from . import common
from .common import Answer, Checked, Reply, number

URL = "/v1/completions"
KIND = "completion"
PARSE_REASONING = False  #: completions return the raw text, as vLLM's server does
TASK = EngineTask.GENERATE
FIELDS = (common.SAMPLING_FIELDS | common.HARMLESS_FIELDS
          | {"prompt", "max_tokens", "n", "stop", "logprobs", "response_format", "echo"})
MAX_PROMPTS = 2048  #: OpenAI's limit of prompts per request


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    prompts = common.text_or_token_inputs(body.get("prompt"), "body.prompt", URL, MAX_PROMPTS)
    sp = common.sampling(body, ctx, ("max_tokens",))
    if body.get("n") is not None:
        sp["n"] = number(body, "n", 1, ctx.max_n, integer=True)
    stops = common.stop_sequences(body, ctx)
    if stops:
        sp["stop"] = stops
    options = common.ResponseOptions()
    if body.get("logprobs") is not None:
        sp["logprobs"] = options.logprobs = number(body, "logprobs", 0, 5, integer=True)
    if common.boolean(body, "echo"):
        if options.logprobs is not None:  # OpenAI's answer would hold the prompt tokens' logprobs too
            raise common.unsupported("echo with logprobs is not supported (the prompt's tokens have no logprobs "
                                     "here); drop one of them")
        options.echo_prompt = True
    answer_format = common.response_format(body.get("response_format"), "body.response_format", ctx)
    if answer_format:  # a vLLM extension of the completions API
        sp["structured_outputs"] = answer_format
    return Checked(prompts, sp, options)


ADD_SPECIAL_TOKENS = True  #: text prompts get the tokenizer's special tokens (BOS), as vLLM's server does


def prompt_texts(tokenizer: Any, prompts: list) -> list:
    """One entry per prompt: a text prompt as given, a token-id prompt as its ids."""
    return [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]


def respond(outputs: list, reply: Reply) -> Answer:
    k = reply.options.logprobs
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for p, out in enumerate(outputs):
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            text = (out.prompt_text or "") + c.text if reply.options.echo_prompt else c.text
            choices.append({"index": p * len(out.outputs) + c.index, "text": text,
                            "logprobs": _completion_logprobs(c, k),
                            "finish_reason": common.finish_reason(c.finish_reason)})
    body = {"id": f"cmpl-{common.id_suffix(reply.request_id)}", "object": "text_completion",
            "created": reply.created, "model": reply.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "system_fingerprint": None}
    return Answer(body, choices[0]["text"], choices[0]["finish_reason"], prompt_tokens, completion_tokens)


def _completion_logprobs(choice: Any, k: Optional[int]) -> Optional[dict]:
    if choice.logprobs is None or k is None:
        return None
    tokens, token_lps, top, offsets, offset = [], [], [], [], 0
    for token, lp, tops in common.token_positions(choice, k):
        tokens.append(token)
        token_lps.append(lp)
        top.append({t.decoded_token or "": float(t.logprob) for t in tops})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}
