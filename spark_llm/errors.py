"""Error codes (OpenAI style) and the helpers that turn a failure into an error row."""

from __future__ import annotations

import re
from enum import Enum


class ErrorCode(str, Enum):
    """Every ``code`` an error row can carry. docs/reliability.md says when each is used."""

    INVALID_ENCODING = "invalid_encoding"          # line is not valid UTF-8 / holds lone surrogates
    LINE_TOO_LARGE = "line_too_large"              # line longer than max_line_bytes
    INVALID_JSON = "invalid_json"                  # not JSON, not an object, or nested too deeply
    INVALID_CUSTOM_ID = "invalid_custom_id"        # custom_id missing, null, not a string or empty
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"    # a later line repeats an earlier custom_id
    INVALID_METHOD = "invalid_method"              # method missing or not POST
    UNSUPPORTED_ENDPOINT = "unsupported_endpoint"  # url not one of the served endpoints
    INVALID_REQUEST = "invalid_request"            # body / messages / prompt / parameter malformed
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field the engine cannot honour
    MODEL_NOT_FOUND = "model_not_found"            # body.model is not the served model name
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over max_model_len
    ENGINE_ERROR = "engine_error"                  # the engine failed on this one request
    INVALID_IMAGE_URL = "invalid_image_url"        # an image's URL or path refused, missing or unreadable
    INVALID_IMAGE_FORMAT = "invalid_image_format"  # not an image, or a format not supported
    IMAGE_PARSE_ERROR = "image_parse_error"        # a corrupt or truncated image
    IMAGE_TOO_LARGE = "image_too_large"            # over max_image_bytes or max_image_pixels
    IMAGE_NOT_SUPPORTED = "image_not_supported"    # an image sent to a model without a vision encoder
    INVALID_AUDIO_URL = "invalid_audio_url"        # an audio file's URL or path refused, missing or unreadable
    INVALID_AUDIO_FORMAT = "invalid_audio_format"  # not audio, or a format not supported
    AUDIO_PARSE_ERROR = "audio_parse_error"        # a corrupt or truncated audio file
    AUDIO_TOO_LARGE = "audio_too_large"            # over max_audio_bytes, or longer than the model hears at once
    BATCH_CANCELLED = "batch_cancelled"            # the batch was cancelled before the request ran
    BATCH_EXPIRED = "batch_expired"                # the batch's completion window ran out before it ran


#: Codes found before a line's custom_id could be read: such a row's custom_id, when it shows one, was recovered from
#: the raw line for attribution only; it does not claim the id (no duplicate check, ids by file and line).
LINE_LEVEL_CODES = (ErrorCode.INVALID_ENCODING.value, ErrorCode.LINE_TOO_LARGE.value, ErrorCode.INVALID_JSON.value,
                    ErrorCode.INVALID_CUSTOM_ID.value)


#: Codes of requests that never ran because their batch was ended early (OpenAI lists them in a cancelled or expired
#: batch's error file); a later ``--resume`` of the batch runs them after all.
UNANSWERED_CODES = {ErrorCode.BATCH_CANCELLED.value: "The batch was cancelled before this request ran.",
                    ErrorCode.BATCH_EXPIRED.value: "This request could not be executed before the batch's "
                                                   "completion window expired."}


class RequestError(Exception):
    """A request-level problem: becomes an error row with ``code`` and ``message``, never stops the job."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class EngineStartError(RuntimeError):
    """The engine could not be built on an executor; the job stops with this message."""

    _REMOTE = re.compile(r"EngineStartError: (.+?)(?:\n|$)")

    @classmethod
    def from_job(cls, exc: BaseException) -> BaseException:
        """A Spark job's failure whose executor-side cause is an engine start failure, as that one clear error;
        other failures as they are."""
        match = cls._REMOTE.search(str(exc))
        return cls(match.group(1)) if match else exc


class BatchStopped(Exception):
    """Raised into a run to end it early (a cancel, an expired completion window): ``status`` is the batch status it
    ends with, ``cancelled`` or ``expired``. What was committed stays; the rest runs on ``--resume``."""

    def __init__(self, status: str = "cancelled"):
        super().__init__(f"the batch was {status}")
        self.status = status


def truncate(text: str | None, limit: int) -> str | None:
    """Cut ``text`` to ``limit`` characters, marking the cut with an ellipsis."""
    if text is None or len(text) <= limit:
        return text
    return text[: max(limit - 1, 0)] + "…"


def describe_exception(exc: BaseException, limit: int = 1000) -> str:
    """``"<ExceptionType>: <message>"``, bounded; for a failure that comes from the JVM (a Spark job that failed for
    good, an ``OutOfMemoryError``), its first line and its root cause, without the Java and Py4J stack traces."""
    text = str(exc)
    if "\n\tat " in text or "Py4J" in type(exc).__name__ or "JVM stacktrace" in text:
        lines = [x.strip().lstrip(": ") for x in text.splitlines()
                 if x.strip() and not x.lstrip().startswith("at ") and not x.startswith("An error occurred while")]
        causes = [m.group(1) for x in lines[:400] if (m := _JAVA_CAUSE.match(x))]
        first = lines[0] if lines else type(exc).__name__
        text = first if not causes or causes[-1] in first else f"{first} (cause: {causes[-1]})"
        return truncate(text, limit) or type(exc).__name__
    return truncate(f"{type(exc).__name__}: {text}", limit) or type(exc).__name__


_JAVA_CAUSE = re.compile(r"^(?:Caused by: )?((?:[\w$]+\.)*[\w$]*(?:Error|Exception): .+)$")
