"""One module per OpenAI endpoint, as vLLM keeps them under ``entrypoints/openai/``.

Each module owns its endpoint's whole surface and exposes the same names:

- ``URL`` (the batch line's ``url``), ``KIND`` (the short name in the ``kind`` column), ``TASK`` (the
  :class:`~spark_llm.engine_host.protocol.EngineTask` an engine does for it, and so which models serve it) and
  ``PARSE_REASONING`` (whether the engine's reasoning parser splits its answers);
- ``check(body, ctx) -> Checked``: the request checks (a problem raises a ``RequestError`` that becomes the line's
  error row) and the engine inputs: the prompt to render, SamplingParams keyword arguments, response options;
- ``prompt_texts(tokenizer, prompt) -> list``: what the engine will see, one entry per prompt (a completions
  request may hold several): a text, encoded by the token stage with the tokenizer's special tokens when
  ``ADD_SPECIAL_TOKENS`` (many requests' texts in one tokenizer call), or token ids as given;
- ``respond(outputs, reply) -> Answer``: the complete OpenAI response body for the engine's outputs (one per prompt);
- optionally ``unfit(ctx) -> str | None``: why a model whose engines do ``TASK`` cannot serve the endpoint after all
  (a classifier's labels decide between moderations and scores), None when it can.

:mod:`~spark_llm.validate` checks only the batch-line envelope and dispatches here by ``url``; the token stage and
the inference task dispatch by ``kind``. A new endpoint is a new module added to :data:`ENDPOINTS`.
"""

from __future__ import annotations

from types import ModuleType

from ..engine_host.protocol import EngineTask
from . import (chat, classify, completions, embeddings, moderations, rerank, responses, score, transcriptions,
               translations)
from .common import Answer, Checked, Classes, Reply

ENDPOINTS: dict[str, ModuleType] = {m.URL: m for m in (chat, completions, responses, embeddings, moderations,
                                                        classify, score, rerank, transcriptions, translations)}
BY_KIND: dict[str, ModuleType] = {m.KIND: m for m in ENDPOINTS.values()}
#: The urls a model serves whose engines do each task: those of the endpoints that need it.
SERVED_BY: dict[EngineTask, tuple[str, ...]] = {task: tuple(m.URL for m in ENDPOINTS.values() if m.TASK is task)
                                                for task in EngineTask}
#: What a model doing each task is, in the words of a line sent to the wrong one.
TASK_MODELS = {EngineTask.GENERATE: "a text generation model", EngineTask.EMBED: "an embedding model",
               EngineTask.CLASSIFY: "a classification model", EngineTask.TRANSCRIBE: "a speech-to-text model"}

__all__ = ["Answer", "BY_KIND", "Checked", "Classes", "ENDPOINTS", "Reply", "SERVED_BY", "TASK_MODELS"]
