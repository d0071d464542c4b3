"""``/v1/rerank``: documents ordered by their relevance to a query on a cross-encoder, as vLLM's server (and Jina's
and Cohere's rerank APIs) take it: ``query``, ``documents``, ``top_n`` (0: all), ``return_documents``. Each
(query, document) pair is scored as :mod:`~spark_llm.endpoints.score` scores it; the answer is vLLM's
``RerankResponse``, the best first."""

from __future__ import annotations

from typing import Any

from ..engine_host.protocol import EngineTask
from . import common, score
from .common import Answer, Checked, Reply, invalid, json_type

URL = "/v1/rerank"
KIND = "rerank"
PARSE_REASONING = False
TASK = EngineTask.CLASSIFY
FIELDS = common.HARMLESS_FIELDS | {"query", "documents", "top_n", "return_documents", "use_activation"}
MAX_DOCUMENTS = score.MAX_PAIRS

prompt_texts, ADD_SPECIAL_TOKENS, unfit = score.prompt_texts, score.ADD_SPECIAL_TOKENS, score.unfit


def check(body: dict, ctx: Any) -> Checked:
    common.check_fields(body, FIELDS, URL)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise invalid(f"body.query must be a non-empty string, got {json_type(query)}")
    if body.get("documents") is None:
        raise invalid(f"body.documents is required for {URL}")
    documents = score.texts(body["documents"], "body.documents")
    if len(documents) > MAX_DOCUMENTS:
        raise invalid(f"body.documents holds {len(documents)} items; at most {MAX_DOCUMENTS} are allowed per request")
    options = common.ResponseOptions()
    if body.get("top_n") is not None:
        options.top_n = common.number(body, "top_n", 0, MAX_DOCUMENTS, integer=True)
    if common.boolean(body, "return_documents") is not False:  # the texts go back in the answer (the default)
        options.documents = documents
    return Checked([[query, d] for d in documents], common.classifier_settings(body), options)


def respond(outputs: list, reply: Reply) -> Answer:
    scores = [out.probs[0] for out in outputs]
    documents = reply.options.documents
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:reply.options.top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}} if documents else {}),
                "relevance_score": scores[i]} for i in order]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {"id": f"rerank-{common.id_suffix(reply.request_id)}", "model": reply.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}
    return Answer(body, None, None, tokens, 0, scores=scores)
