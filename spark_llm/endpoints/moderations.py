"""``/v1/moderations``: OpenAI's moderation of text inputs, answered by a sequence classifier (vLLM's classify task)
whose labels map to OpenAI's categories; the answer is OpenAI's ``ModerationCreateResponse``, one result per input.

A category's score is the probability of the model's label for it (the highest, when several labels count for one
category); it is flagged at ``moderation_threshold`` or above, and a result is flagged when any category is. OpenAI's
categories the model has no label for score 0 and are never flagged. The probabilities are what the model's config
asks vLLM for: sigmoid for a multi-label classifier (``problem_type: multi_label_classification``, as moderation
models are), else softmax over the labels.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ..config import MODERATION_CATEGORIES
from ..engine_host.protocol import EngineTask
from . import common, completions
from .common import Answer, Checked, Classes, Reply, invalid, json_type, unsupported

URL = "/v1/moderations"
KIND = "moderation"
PARSE_REASONING = False
TASK = EngineTask.CLASSIFY
FIELDS = common.HARMLESS_FIELDS | {"input"}
MAX_INPUTS = 2048

#: text inputs get the tokenizer's special tokens, as vLLM's classify endpoint does
prompt_texts, ADD_SPECIAL_TOKENS = completions.prompt_texts, completions.ADD_SPECIAL_TOKENS


def categories(labels: Sequence[str], mapping: Mapping[str, str]) -> tuple[Optional[str], ...]:
    """The OpenAI category each of a classifier's ``labels`` counts for: ``mapping[label]`` when given ("" for
    none), else the category its name spells, compared without case and with ``_`` or ``-`` for ``/``
    (``HATE_THREATENING``, ``self_harm``); a label naming no category counts for none."""
    spelled = {_spelling(c): c for c in MODERATION_CATEGORIES}
    return tuple((mapping[label] or None) if label in mapping else spelled.get(_spelling(label)) for label in labels)


def classes(labels: Sequence[str], mapping: Mapping[str, str], threshold: float) -> Classes:
    """The meaning of a classifier's ``labels`` for moderation (:func:`categories`) and its flagging threshold."""
    return Classes(tuple(labels), categories(labels, mapping), threshold)


def _spelling(name: str) -> str:
    return name.lower().replace("/", "_").replace("-", "_").replace(" ", "_")


def unfit(ctx: Any) -> Optional[str]:
    """Why a classifier cannot moderate (none of its labels maps to a category), or None."""
    if any(categories(ctx.labels, ctx.moderation_labels)):
        return None
    return (f"none of {ctx.served_model_name!r}'s labels ({', '.join(ctx.labels[:8]) or 'none'}) is an OpenAI "
            f"moderation category: map them with the moderation_labels setting (label -> category, e.g. toxic -> "
            f"harassment)")


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    value = body.get("input")
    if value is None:
        raise invalid(f"body.input is required for {URL}")
    if isinstance(value, list) and value and all(isinstance(p, dict) for p in value):
        inputs = [_parts_text(value)]  # multi-modal parts are one input, as OpenAI moderates them together
    else:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise invalid(f"body.input must be a string, a list of strings or a list of text parts, got "
                          f"{json_type(value)}")
        if len(value) > MAX_INPUTS:
            raise invalid(f"body.input holds {len(value)} items; at most {MAX_INPUTS} are allowed per request")
        inputs = value
    for j, text in enumerate(inputs):
        if not text:
            raise invalid(f"body.input{'' if len(inputs) == 1 else f'[{j}]'} must not be empty")
    return Checked(inputs, {"max_tokens": 0})


def _parts_text(parts: list[dict]) -> str:
    texts = []
    for j, part in enumerate(parts):
        if part.get("type") == "image_url":
            raise unsupported(f"body.input[{j}] is an image; spark_llm moderates text with a text classifier: send "
                              f"the text parts only")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"body.input[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}})")
        texts.append(part["text"])
    return "\n".join(texts)


def result(probs: Sequence[float], meaning: Classes) -> tuple[dict[str, float], list[str]]:
    """Each OpenAI category's score (0 for one the model has no label for) and the flagged categories, in OpenAI's
    order."""
    scores = dict.fromkeys(MODERATION_CATEGORIES, 0.0)
    for p, category in zip(probs, meaning.categories):
        if category is not None:
            scores[category] = max(scores[category], float(p))
    return scores, [c for c in MODERATION_CATEGORIES if scores[c] >= meaning.threshold]


def respond(outputs: list, reply: Reply) -> Answer:
    results, highest, flagged_any = [], dict.fromkeys(MODERATION_CATEGORIES, 0.0), set()
    for out in outputs:
        scores, flagged = result(out.probs, reply.classes)
        results.append({"flagged": bool(flagged), "categories": {c: c in flagged for c in MODERATION_CATEGORIES},
                        "category_scores": scores,
                        "category_applied_input_types": {c: ["text"] for c in MODERATION_CATEGORIES}})
        highest = {c: max(highest[c], scores[c]) for c in MODERATION_CATEGORIES}
        flagged_any.update(flagged)
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {"id": f"modr-{common.id_suffix(reply.request_id)}", "model": reply.model, "results": results}
    return Answer(body, None, None, tokens, 0, flagged=bool(flagged_any),
                  labels=[c for c in MODERATION_CATEGORIES if c in flagged_any], category_scores=highest)

