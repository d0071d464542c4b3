"""``/v1/embeddings``: inputs (strings or token ids, one or many) embedded by a pooling engine; the answer is OpenAI's
``CreateEmbeddingResponse`` with one vector per input, as floats or base64 (little-endian float32, as OpenAI)."""

from __future__ import annotations

import base64
import struct
from typing import Any

from ..engine_host.protocol import EngineTask
from . import common, completions
from .common import Answer, Checked, Reply, invalid, number

URL = "/v1/embeddings"
KIND = "embedding"
PARSE_REASONING = False
TASK = EngineTask.EMBED
FIELDS = common.HARMLESS_FIELDS | {"input", "encoding_format", "dimensions"}
MAX_INPUTS = 2048  #: OpenAI's limit of inputs per request

#: the tokenizer's special tokens around text inputs, token-id inputs as given
prompt_texts, ADD_SPECIAL_TOKENS = completions.prompt_texts, completions.ADD_SPECIAL_TOKENS


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    inputs = common.text_or_token_inputs(body.get("input"), "body.input", URL, MAX_INPUTS)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid(f"body.encoding_format must be float or base64, got {fmt!r}")
    pooling: dict[str, Any] = {"max_tokens": 0}  # nothing is generated: the cost of a request is its input tokens
    if body.get("dimensions") is not None:
        pooling["dimensions"] = number(body, "dimensions", 1, 1 << 16, integer=True)
    return Checked(inputs, pooling, common.ResponseOptions(encoding_format=fmt))


def respond(outputs: list, reply: Reply) -> Answer:
    b64 = reply.options.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": _base64(out.embedding) if b64 else out.embedding} for i, out in enumerate(outputs)]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {"object": "list", "data": data, "model": reply.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return Answer(body, None, None, tokens, 0, embeddings=[out.embedding for out in outputs])


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
