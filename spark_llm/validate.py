"""Parse and validate OpenAI batch lines. Every non-blank line becomes one request row or one error row; nothing raises.

The functions here are plain Python (no Spark) so they can be tested exhaustively; :func:`validate_batches` applies
them to the raw-line DataFrame in ``mapInPandas`` (the prepare stage, :mod:`spark_llm.prepare`, then flags repeated
``custom_id``\\ s).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .errors import ErrorCode, RequestError, truncate
from .schemas import VALIDATED_FIELDS

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
_URL_KIND = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
_BOM = b"\xef\xbb\xbf"

_CHAT_ROLES = {"system", "developer", "user", "assistant"}
_MESSAGE_KEYS = {"role", "content", "name"}
#: Request fields that carry no meaning for generation and are accepted and ignored.
HARMLESS_FIELDS = {"model", "user", "metadata", "store", "service_tier", "stream", "stream_options"}
_COMMON_SAMPLING = {"max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                    "frequency_penalty", "logprobs",
                    # vLLM extensions to the OpenAI API that map 1:1 onto SamplingParams
                    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos"}
_CHAT_FIELDS = _COMMON_SAMPLING | {"messages", "max_completion_tokens", "top_logprobs"} | HARMLESS_FIELDS
_COMPLETION_FIELDS = _COMMON_SAMPLING | {"prompt"} | HARMLESS_FIELDS


@dataclass(frozen=True)
class ValidationContext:
    """What validation needs to know about the run; shipped to the executors inside the UDF closure. The fields
    are the config's settings of the same names (:func:`~spark_llm.config.config_view`)."""

    served_model_name: str
    default_max_tokens: int
    default_temperature: float
    default_top_p: float
    max_line_bytes: int
    max_raw_line_chars: int
    max_stop_sequences: int
    max_n: int


def validate_line(raw: bytes | str | None, file: str, line_number: int, ctx: ValidationContext) -> Optional[dict]:
    """Validate one raw input line. Returns ``None`` for a blank line, else a row dict with ``VALIDATED_FIELDS``:
    either a request (``error_code`` None) or an error row (``error_code`` set)."""
    row = dict.fromkeys(VALIDATED_FIELDS)
    row["file"], row["line_number"] = file, line_number
    if raw is None:
        return None
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    if data.endswith(b"\r"):
        data = data[:-1]
    if not data.strip():
        return None
    try:
        if len(data) > ctx.max_line_bytes:
            row["raw_line"] = _raw_preview(data, ctx.max_raw_line_chars)
            raise RequestError(ErrorCode.LINE_TOO_LARGE,
                               f"line is {len(data)} bytes, over the limit of {ctx.max_line_bytes} (max_line_bytes)")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            row["raw_line"] = _raw_preview(data, ctx.max_raw_line_chars)
            raise RequestError(ErrorCode.INVALID_ENCODING,
                               f"line is not valid UTF-8 (bad byte 0x{data[exc.start]:02x} at byte {exc.start})")
        row["raw_line"] = truncate(text, ctx.max_raw_line_chars)
        obj = _parse_json(text)
        row["custom_id"] = _custom_id(obj)
        _check_envelope(obj, row, ctx)
        row["request"] = text
        row["raw_line"] = None
    except RequestError as err:
        row["error_code"], row["error_message"] = err.code.value, err.message
        for key in ("url", "kind", "request", "prompt_json", "sampling_json", "max_tokens"):
            row[key] = None
    return row


def _raw_preview(data: bytes, limit: int) -> str:
    return truncate(data[: limit * 4 + 4].decode("utf-8", "replace"), limit) or ""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(text: str) -> dict:
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(ErrorCode.INVALID_JSON, "line is JSON nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise RequestError(ErrorCode.INVALID_JSON, f"line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RequestError(ErrorCode.INVALID_JSON, f"line is JSON but not an object (got {_json_type(obj)})")
    try:  # lone surrogates (\ud800) decode in Python but cannot be written as UTF-8 anywhere downstream
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(ErrorCode.INVALID_ENCODING,
                           "line holds a lone surrogate escape (e.g. \\ud800) that is not valid Unicode") from None
    except RecursionError:
        raise RequestError(ErrorCode.INVALID_JSON, "line is JSON nested too deeply to process") from None
    return obj


def _custom_id(obj: dict) -> str:
    if "custom_id" not in obj:
        raise RequestError(ErrorCode.INVALID_CUSTOM_ID, "custom_id is missing")
    cid = obj["custom_id"]
    if not isinstance(cid, str):
        raise RequestError(ErrorCode.INVALID_CUSTOM_ID,
                           f"custom_id must be a string, got {_json_type(cid)} {truncate(json.dumps(cid), 80)}")
    if cid == "":
        raise RequestError(ErrorCode.INVALID_CUSTOM_ID, "custom_id must not be empty")
    return cid


def _check_envelope(obj: dict, row: dict, ctx: ValidationContext) -> None:
    method = obj.get("method")
    if not isinstance(method, str) or method.upper() != "POST":
        got = "missing" if "method" not in obj else truncate(repr(method), 60)
        raise RequestError(ErrorCode.INVALID_METHOD, f"method must be POST, got {got}")
    url = obj.get("url")
    if not isinstance(url, str) or url not in _URL_KIND:
        got = "missing" if "url" not in obj else truncate(json.dumps(url, ensure_ascii=False), 120)
        raise RequestError(ErrorCode.UNSUPPORTED_ENDPOINT,
                           f"url must be one of {', '.join(_URL_KIND)}, got {got}")
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"unknown top-level field(s): {', '.join(extra)}")
    if "body" not in obj or not isinstance(obj["body"], dict):
        got = "missing" if "body" not in obj else _json_type(obj["body"])
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body must be a JSON object, got {got}")
    body = obj["body"]
    kind = _URL_KIND[url]  # type: ignore[index]
    _check_model(body, ctx)
    if body.get("stream") not in (None, False):
        raise RequestError(ErrorCode.UNSUPPORTED_PARAMETER, "stream must be false or absent in a batch request")
    allowed = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"body field(s) not supported for {url}: {', '.join(unknown)}")
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    sampling = sampling_params(body, kind, ctx)
    row.update(url=url, kind=kind, prompt_json=json.dumps(prompt, ensure_ascii=False),
               sampling_json=json.dumps(sampling), max_tokens=sampling["max_tokens"])


def _check_model(body: dict, ctx: ValidationContext) -> None:
    if "model" not in body or body["model"] is None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "body.model is required")
    model = body["model"]
    if not isinstance(model, str):
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body.model must be a string, got {_json_type(model)}")
    if model != ctx.served_model_name:
        raise RequestError(ErrorCode.MODEL_NOT_FOUND,
                           f"model {truncate(model, 200)!r} is not served by this job; use "
                           f"{ctx.served_model_name!r}")


def _messages(body: dict) -> list[dict]:
    if "messages" not in body:
        raise RequestError(ErrorCode.INVALID_REQUEST, "body.messages is required for /v1/chat/completions")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body.messages must be a list, got {_json_type(messages)}")
    if not messages:
        raise RequestError(ErrorCode.INVALID_REQUEST, "body.messages must not be empty")
    out = []
    for i, msg in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(ErrorCode.INVALID_REQUEST, f"{where} must be an object, got {_json_type(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            got = "missing" if "role" not in msg else truncate(json.dumps(role, ensure_ascii=False), 60)
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"{where}.role must be one of {', '.join(sorted(_CHAT_ROLES))}, got {got}")
        extra = sorted(set(msg) - _MESSAGE_KEYS)
        if extra:
            raise RequestError(ErrorCode.UNSUPPORTED_PARAMETER, f"{where} field(s) not supported: {', '.join(extra)}")
        content = _content_text(msg.get("content"), f"{where}.content", "content" in msg)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content_text(content: Any, where: str, present: bool) -> str:
    if not present or content is None:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"{where} is required")
    if isinstance(content, str):
        if content == "":
            raise RequestError(ErrorCode.INVALID_REQUEST, f"{where} must not be empty")
        return content
    if isinstance(content, list):
        if not content:
            raise RequestError(ErrorCode.INVALID_REQUEST, f"{where} must not be empty")
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(ErrorCode.INVALID_REQUEST, f"{where}[{j}] must be an object with a type")
            if part["type"] != "text":
                raise RequestError(ErrorCode.UNSUPPORTED_PARAMETER,
                                   f"{where}[{j}] has type {part['type']!r}; only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise RequestError(ErrorCode.INVALID_REQUEST, f"{where}[{j}].text must be a string")
            texts.append(part["text"])
        text = "\n".join(texts)
        if text == "":
            raise RequestError(ErrorCode.INVALID_REQUEST, f"{where} must not be empty")
        return text
    raise RequestError(ErrorCode.INVALID_REQUEST,
                       f"{where} must be a string or a list of text parts, got {_json_type(content)}")


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "body.prompt is required for /v1/completions")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt == "":
            raise RequestError(ErrorCode.INVALID_REQUEST, "body.prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "body.prompt holds several prompts; put each one on its own line with its own custom_id")
    raise RequestError(ErrorCode.INVALID_REQUEST,
                       "body.prompt must be a non-empty string or a list of non-negative token ids")


# ---- sampling parameters -------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _num(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False, integer: bool = False) -> Any:
    v = body[key]
    if integer and not _is_int(v):
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body.{key} must be an integer, got {_json_type(v)}")
    if not _is_number(v):
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body.{key} must be a number, got {_json_type(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body.{key} must be in {left}{lo}, {hi}], got {v}")
    return v


def sampling_params(body: dict, kind: str, ctx: ValidationContext) -> dict[str, Any]:
    """Map an OpenAI request body to vLLM ``SamplingParams`` keyword arguments (validated)."""
    big = float(2**31 - 1)
    sp: dict[str, Any] = {}
    max_keys = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    if kind == "chat" and len(max_keys) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise RequestError(ErrorCode.INVALID_REQUEST, "give max_tokens or max_completion_tokens, not both")
    sp["max_tokens"] = _num(body, max_keys[0], 1, big, integer=True) if max_keys else ctx.default_max_tokens
    sp["temperature"] = float(_num(body, "temperature", 0, 2)) if body.get("temperature") is not None \
        else ctx.default_temperature
    sp["top_p"] = float(_num(body, "top_p", 0, 1, lo_open=True)) if body.get("top_p") is not None \
        else ctx.default_top_p
    if body.get("n") is not None:
        sp["n"] = _num(body, "n", 1, ctx.max_n, integer=True)
    if body.get("seed") is not None:
        sp["seed"] = _num(body, "seed", -(2**63), 2**63 - 1, integer=True)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) is not None:
            sp[key] = float(_num(body, key, -2, 2))
    if body.get("stop") is not None:
        stop = body["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(ErrorCode.INVALID_REQUEST, "body.stop must be a non-empty string or a list of them")
        if len(stops) > ctx.max_stop_sequences:
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"body.stop has {len(stops)} strings; at most {ctx.max_stop_sequences} are allowed")
        if stops:
            sp["stop"] = stops
    _logprobs(body, kind, sp)
    if body.get("top_k") is not None:
        top_k = _num(body, "top_k", -1, big, integer=True)
        if top_k > 0:
            sp["top_k"] = top_k
    if body.get("min_p") is not None:
        sp["min_p"] = float(_num(body, "min_p", 0, 1))
    if body.get("repetition_penalty") is not None:
        sp["repetition_penalty"] = float(_num(body, "repetition_penalty", 0, 2, lo_open=True))
    if body.get("min_tokens") is not None:
        sp["min_tokens"] = _num(body, "min_tokens", 0, sp["max_tokens"], integer=True)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise RequestError(ErrorCode.INVALID_REQUEST, "body.ignore_eos must be a boolean")
        sp["ignore_eos"] = body["ignore_eos"]
    return sp


def _logprobs(body: dict, kind: str, sp: dict[str, Any]) -> None:
    lp = body.get("logprobs")
    if kind == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise RequestError(ErrorCode.INVALID_REQUEST, f"body.logprobs must be a boolean, got {_json_type(lp)}")
        if body.get("top_logprobs") is not None:
            top = _num(body, "top_logprobs", 0, 20, integer=True)
            if not lp:
                raise RequestError(ErrorCode.INVALID_REQUEST, "body.top_logprobs requires logprobs: true")
            sp["logprobs"] = top
        elif lp:
            sp["logprobs"] = 0
    elif lp is not None:
        sp["logprobs"] = _num(body, "logprobs", 0, 5, integer=True)


# ---- Spark glue ----------------------------------------------------------------------------------------------

def validate_batches(batches: Iterator, ctx: ValidationContext) -> Iterator:
    """mapInPandas body: raw lines (``value`` bytes, ``file``, ``line_number``) -> validated rows."""
    import pandas as pd

    for pdf in batches:
        rows = []
        for raw, file, line in zip(pdf["value"], pdf["file"], pdf["line_number"]):
            row = validate_line(raw, file, int(line), ctx)
            if row is not None:
                rows.append(row)
        out = pd.DataFrame(rows, columns=list(VALIDATED_FIELDS))
        out["line_number"] = out["line_number"].astype("int64")
        out["max_tokens"] = out["max_tokens"].astype("Int64")
        yield out
