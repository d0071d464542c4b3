"""``/v1/score``: vLLM's relevance scores of text pairs on a cross-encoder (a sequence classifier with one label),
as vLLM's server and ``run_batch`` take them: ``text_1`` / ``text_2`` (or ``queries`` with ``items`` or
``documents``), each a string or a list; one first text scores against every second text, or the lists pair up.
The answer is vLLM's ``ScoreResponse``.

Each pair is one prompt, encoded as vLLM's cross-encoder scoring encodes it: the tokenizer's pair encoding
(``tokenizer(text=first, text_pair=second)``, the model's separator between them), classified by the engine; the
score is the one label's probability (sigmoid, or the activation the model's config names). Rerankers that need a
score template (LLM-as-reranker models such as Qwen3-Reranker) are not covered.
"""

from __future__ import annotations

from typing import Any, Optional

from ..engine_host.protocol import EngineTask
from . import common
from .common import Answer, Checked, Reply, invalid, json_type

URL = "/v1/score"
KIND = "score"
PARSE_REASONING = False
TASK = EngineTask.CLASSIFY
#: the names vLLM takes for the two sides of the pairs (one name of each pair of names per request)
SIDES = (("text_1", "text_2"), ("queries", "items"), ("queries", "documents"))
FIELDS = common.HARMLESS_FIELDS | {"use_activation"} | {name for pair in SIDES for name in pair}
MAX_PAIRS = 2048
ADD_SPECIAL_TOKENS = False  #: the pair encoding adds them


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    named = {name for pair in SIDES for name in pair if name in body}
    given = [pair for pair in SIDES if set(pair) == named]
    if not given:
        raise invalid("give the texts to score as text_1 and text_2 (or queries and items, or queries and "
                      "documents), one pair of names")
    first_name, second_name = given[0]
    firsts, seconds = texts(body[first_name], f"body.{first_name}"), texts(body[second_name], f"body.{second_name}")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise invalid(f"body.{first_name} holds {len(firsts)} texts and body.{second_name} {len(seconds)}: give "
                      f"one {first_name} to score against each {second_name}, or as many as there are")
    pairs = [[firsts[0] if len(firsts) == 1 else firsts[i], second] for i, second in enumerate(seconds)]
    if len(pairs) > MAX_PAIRS:
        raise invalid(f"the request holds {len(pairs)} pairs; at most {MAX_PAIRS} are allowed per request")
    return Checked(pairs, common.classifier_settings(body))


def unfit(ctx: Any) -> Optional[str]:
    """Why a classifier cannot score pairs (it is no cross-encoder: one label), or None."""
    if len(ctx.labels) != 1:
        return (f"scores need a cross-encoder (a sequence classifier with one label), and {ctx.served_model_name!r} "
                f"has {len(ctx.labels)} labels")
    if ctx.token_types:  # its pairs would be scored without the segment ids that tell query from document
        return (f"{ctx.served_model_name!r} reads token type ids (a BERT-style cross-encoder), which spark_llm does "
                f"not pass to the engine yet; use a cross-encoder without them (XLM-RoBERTa or decoder based)")
    return None


def texts(value: Any, where: str) -> list[str]:
    """One side of the pairs: a non-empty string or a non-empty list of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise invalid(f"{where} must be a string or a non-empty list of strings, got {json_type(value)}")
    for j, item in enumerate(items):
        at = where if isinstance(value, str) else f"{where}[{j}]"
        if not isinstance(item, str):
            raise invalid(f"{at} must be a string, got {json_type(item)}")
        if not item:
            raise invalid(f"{at} must not be empty")
    return items


def prompt_texts(tokenizer: Any, pairs: list) -> list:
    """Each (first, second) pair as token ids: the tokenizer's pair encoding, with its special tokens."""
    return [list(tokenizer(text=first, text_pair=second)["input_ids"]) for first, second in pairs]


def respond(outputs: list, reply: Reply) -> Answer:
    scores = [out.probs[0] for out in outputs]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {"id": f"score-{common.id_suffix(reply.request_id)}", "object": "list", "created": reply.created,
            "model": reply.model, "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    return Answer(body, None, None, tokens, 0, scores=scores)
