"""One module per OpenAI endpoint, as vLLM keeps them under ``entrypoints/openai/``.

Each module owns its endpoint's whole surface and exposes the same names:

- ``URL`` (the batch line's ``url``), ``KIND`` (the short name in the ``kind`` column) and ``PARSE_REASONING``
  (whether the engine's reasoning parser splits its answers);
- ``check(body, ctx) -> Checked``: the request checks (a problem raises a ``RequestError`` that becomes the line's
  error row) and the engine inputs: the prompt to render, SamplingParams keyword arguments, response options;
- ``prompt_texts(tokenizer, prompt) -> list``: what the engine will see, one entry per prompt (a completions
  request may hold several): a text, encoded by the token stage with the tokenizer's special tokens when
  ``ADD_SPECIAL_TOKENS`` (many requests' texts in one tokenizer call), or token ids as given;
- ``respond(outputs, reply) -> Answer``: the complete OpenAI response body for the engine's outputs (one per prompt).

:mod:`~spark_llm.validate` checks only the batch-line envelope and dispatches here by ``url``; the token stage and
the inference task dispatch by ``kind``. A new endpoint is a new module added to :data:`ENDPOINTS`.
"""

from __future__ import annotations

from types import ModuleType

from . import chat, completions, embeddings, responses
from .common import Answer, Checked, Reply

ENDPOINTS: dict[str, ModuleType] = {m.URL: m for m in (chat, completions, responses, embeddings)}
#: What an engine of each runner serves.
SERVED_BY = {"generate": (chat.URL, completions.URL, responses.URL), "pooling": (embeddings.URL,)}
BY_KIND: dict[str, ModuleType] = {m.KIND: m for m in ENDPOINTS.values()}

__all__ = ["Answer", "BY_KIND", "Checked", "ENDPOINTS", "Reply", "SERVED_BY"]
