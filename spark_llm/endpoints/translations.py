"""``/v1/audio/translations``: an audio file's speech in English, from a Whisper-shaped model (its ``translate``
task); the answer is OpenAI's ``Translation`` (``text``). The same request as :mod:`.transcriptions` (vLLM's batch
shape, ``file_url`` or ``file``) but for the language: Whisper's translation is told the language spoken, so
``language`` (ISO-639-1) is required here."""

from __future__ import annotations

from typing import Any

from ..engine_host.protocol import EngineTask
from . import transcriptions
from .common import Answer, Checked, Reply, invalid

URL = "/v1/audio/translations"
KIND = "translation"
PARSE_REASONING = False
TASK = EngineTask.TRANSCRIBE
FIELDS = transcriptions.FIELDS - {"timestamp_granularities", "include", "chunking_strategy"}
ADD_SPECIAL_TOKENS = transcriptions.ADD_SPECIAL_TOKENS
prompt_texts = transcriptions.prompt_texts


def check(body: dict, ctx: Any) -> Checked:
    if body.get("language") is None:
        raise invalid("body.language is required for a translation: the ISO-639-1 code of the language spoken (de, "
                      "zh, ...), which Whisper's translate task is told")
    return transcriptions.checked(body, ctx, URL, FIELDS, "translate")


def respond(outputs: list, reply: Reply) -> Answer:
    answer = transcriptions.respond(outputs, reply)
    answer.body.pop("usage", None)  # OpenAI's Translation is its text alone
    return answer
