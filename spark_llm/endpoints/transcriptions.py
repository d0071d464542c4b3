"""``/v1/audio/transcriptions``: an audio file's text, from a Whisper-shaped speech-to-text model (vLLM's
encoder-decoder generation); the answer is OpenAI's ``Transcription`` (``text``, and its ``usage`` in seconds of
audio, as OpenAI bills whisper-1).

A batch line gives the audio as vLLM's batch runner takes it, by ``file_url``: a ``data:`` URL (base64), a path or
storage URI under ``allowed_media_paths``, or an ``http(s)`` URL of an allowed media domain; or, as ``file``, the
id of an uploaded file the batch may read (``media_files``). The decoder's prompt is Whisper's: the start token,
the language (``language``, ISO-639-1; absent, the model writes it), the task and no timestamps, after the
request's ``prompt`` as the previous text. A clip is at most what the model hears at once (Whisper: 30 s): a
longer one is ``audio_too_large`` (split it first).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..engine_host.protocol import EngineTask
from ..errors import ErrorCode, RequestError
from ..media import AUDIO, check_url
from . import common
from .common import Answer, Checked, Reply, invalid, number, unsupported

URL = "/v1/audio/transcriptions"
KIND = "transcription"
PARSE_REASONING = False
TASK = EngineTask.TRANSCRIBE
WHISPER_TASK = "transcribe"  #: the task token of the decoder's prompt
FIELDS = common.HARMLESS_FIELDS | {"file_url", "file", "language", "prompt", "response_format", "temperature",
                                   "timestamp_granularities", "include", "seed", "top_p", "top_k", "min_p",
                                   "repetition_penalty", "presence_penalty", "frequency_penalty", "chunking_strategy"}
#: the decoder's budget, as openai-whisper's (half of Whisper's 448-token decoder context)
MAX_TOKENS = 224
#: the ISO-639-1 codes of the languages Whisper has a token for (vLLM's list for it)
LANGUAGES = frozenset(("af ar hy az be bs bg ca zh hr cs da nl en et fi fr gl de el he hi hu is id it ja kn kk ko lv "
                       "lt mk ms mr mi ne no fa pl pt ro ru sr sk sl es sw sv tl ta th tr uk ur vi cy").split())
#: the prompt is rendered by :func:`decoder_prompt`: its special tokens are Whisper's own, none added
ADD_SPECIAL_TOKENS = False


def check(body: dict, ctx: Any) -> Checked:
    return checked(body, ctx, URL, FIELDS, WHISPER_TASK)


def checked(body: dict, ctx: Any, url: str, fields: frozenset, task: str) -> Checked:
    """A transcription's or a translation's (``task``: Whisper's task token) request checked."""
    common.check_fields(body, fields, url)
    if ctx.hearing is None:
        raise RequestError(ErrorCode.UNSUPPORTED_ENDPOINT,
                           f"{ctx.served_model_name!r} has no audio feature extractor (preprocessor_config.json) to "
                           f"hear audio with; send {url} lines to a Whisper model")
    options = common.ResponseOptions(audio=_audio(body, ctx), sample_rate=ctx.hearing.sample_rate)
    language = body.get("language")
    if language is not None and (not isinstance(language, str) or language.lower() not in LANGUAGES):
        raise invalid(f"body.language must be an ISO-639-1 code Whisper knows (en, zh, de, ...), got "
                      f"{str(language)[:20]!r}")
    previous = body.get("prompt")
    if previous is not None and not isinstance(previous, str):
        raise invalid(f"body.prompt must be a string (the text before this clip), got {common.json_type(previous)}")
    fmt = body.get("response_format", "json")
    if fmt != "json":
        raise unsupported(f"body.response_format {fmt!r} is not supported in a batch: the output line's body is "
                          f"JSON (response_format json: text and usage); segments and subtitles need timestamps, "
                          f"which spark_llm does not decode")
    for key in ("timestamp_granularities", "include", "chunking_strategy"):
        if body.get(key) not in (None, [], "auto"):
            raise unsupported(f"body.{key} is not supported: spark_llm decodes text without timestamps or "
                              f"logprobs, one clip at a time")
    sp = _sampling(body)
    return Checked(decoder_prompt(task, language.lower() if language else None, previous), sp, options)


def _audio(body: dict, ctx: Any) -> str:
    """Where the request's audio is: ``file_url`` checked (:func:`~spark_llm.media.check_url`), or where the
    uploaded file ``file`` is stored."""
    if (body.get("file_url") is None) == (body.get("file") is None):
        raise invalid("give the audio as body.file_url (a data: URL, a path or an allowed URL), or as body.file (the "
                      "id of an uploaded file); exactly one of them")
    if body.get("file") is not None:
        return ctx.media.stored_file(body["file"], "body.file", AUDIO)
    return check_url(body["file_url"], ctx.media, "body.file_url", AUDIO)


def _sampling(body: dict) -> dict[str, Any]:
    """SamplingParams keyword arguments: greedy unless told otherwise (OpenAI's default temperature here is 0)."""
    sp: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    if body.get("temperature") is not None:
        sp["temperature"] = float(number(body, "temperature", 0, 1))
    if body.get("top_p") is not None:
        sp["top_p"] = float(number(body, "top_p", 0, 1, lo_open=True))
    if body.get("seed") is not None:
        sp["seed"] = number(body, "seed", -(2**63), 2**63 - 1, integer=True)
    if body.get("top_k") is not None and number(body, "top_k", -1, 2**31 - 1, integer=True) > 0:
        sp["top_k"] = body["top_k"]
    if body.get("min_p") is not None:
        sp["min_p"] = float(number(body, "min_p", 0, 1))
    if body.get("repetition_penalty") is not None:
        sp["repetition_penalty"] = float(number(body, "repetition_penalty", 0, 2, lo_open=True))
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) is not None:
            sp[key] = float(number(body, key, -2, 2))
    return sp


def decoder_prompt(task: str, language: Optional[str], previous: Optional[str]) -> str:
    """Whisper's decoder prompt: the previous text (``<|startofprev|>``), the start token, the language (absent:
    the model writes it), the task, no timestamps."""
    head = f"<|startofprev|>{previous}" if previous else ""
    if language is None:
        return f"{head}<|startoftranscript|>"
    return f"{head}<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"


def prompt_texts(tokenizer: Any, prompt: str) -> list:
    return [prompt]


def respond(outputs: list, reply: Reply) -> Answer:
    [out] = outputs
    choice = out.outputs[0]
    text = choice.text.strip()
    seconds = reply.audio_seconds
    usage = {"type": "duration", "seconds": math.ceil(seconds)} if seconds is not None else None
    body = {"text": text, **({"usage": usage} if usage else {})}
    return Answer(body, text, common.finish_reason(choice.finish_reason), len(out.prompt_token_ids),
                  len(choice.token_ids))
