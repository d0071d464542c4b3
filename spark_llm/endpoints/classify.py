"""``/v1/classify``: vLLM's classification endpoint (its server's ``/classify``) on a sequence classifier: inputs
(strings or token ids, one or many); the answer is vLLM's ``ClassificationResponse``, each input's class
probabilities with the most probable class's label."""

from __future__ import annotations

from typing import Any

from ..engine_host.protocol import EngineTask
from . import common, completions
from .common import Answer, Checked, Reply

URL = "/v1/classify"
KIND = "classification"
PARSE_REASONING = False
TASK = EngineTask.CLASSIFY
FIELDS = common.HARMLESS_FIELDS | {"input", "use_activation"}
MAX_INPUTS = 2048

prompt_texts, ADD_SPECIAL_TOKENS = completions.prompt_texts, completions.ADD_SPECIAL_TOKENS


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    inputs = common.text_or_token_inputs(body.get("input"), "body.input", URL, MAX_INPUTS)
    return Checked(inputs, common.classifier_settings(body))


def respond(outputs: list, reply: Reply) -> Answer:
    names = reply.classes.labels
    data, labels, scores = [], [], []
    for i, out in enumerate(outputs):
        best = max(range(len(out.probs)), key=out.probs.__getitem__)
        label = names[best] if best < len(names) else f"LABEL_{best}"
        data.append({"index": i, "label": label, "probs": out.probs, "num_classes": len(out.probs)})
        labels.append(label)
        scores.append(out.probs[best])
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {"id": f"classify-{common.id_suffix(reply.request_id)}", "object": "list", "created": reply.created,
            "model": reply.model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    return Answer(body, None, None, tokens, 0, labels=labels, scores=scores)
