"""Parse and validate OpenAI batch lines. Every non-blank line becomes one request row or one error row; nothing raises.

The functions here are plain Python (no Spark) so they can be tested exhaustively; :func:`validate_batches` applies
them to the raw-line DataFrame in ``mapInPandas`` (the prepare stage, :mod:`spark_llm.prepare`, then flags repeated
``custom_id``\\ s).
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional, Sequence

from .audio import Hearing, hearing
from .endpoints import ENDPOINTS, SERVED_BY, TASK_MODELS
from .engine_host.protocol import EngineTask
from .endpoints.common import json_type as _json_type
from .errors import LINE_LEVEL_CODES, ErrorCode, RequestError, truncate
from .media import MediaPolicy, without_data_urls
from .schemas import VALIDATED_FIELDS

_BOM = b"\xef\xbb\xbf"


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
    structured_outputs_backend: str
    tool_call_parser: Optional[str]
    runner: str   #: resolved: generate or pooling
    lora_modules: dict[str, str]
    moderation_labels: dict[str, str]
    #: what the model's engines do (:func:`~spark_llm.models.model_tasks`), and so which endpoints it serves
    tasks: tuple[EngineTask, ...] = field(default=(EngineTask.GENERATE,), metadata={"derived": True})
    #: a classifier's labels by class index (:func:`~spark_llm.models.class_labels`)
    labels: tuple[str, ...] = field(default=(), metadata={"derived": True})
    #: the model reads token type ids (:func:`~spark_llm.models.reads_token_types`)
    token_types: bool = field(default=False, metadata={"derived": True})
    #: the batch's other models (their own contexts): a request naming one of them runs there
    others: tuple["ValidationContext", ...] = field(default=(), metadata={"derived": True})
    #: the model has a vision encoder: image parts are accepted (see models.takes_images)
    images: bool = field(default=False, metadata={"derived": True})
    #: how a speech-to-text model hears (:func:`~spark_llm.audio.hearing`); None: the model takes no audio
    hearing: Optional[Hearing] = field(default=None, metadata={"derived": True})
    #: where images may come from and how large they may be
    media: MediaPolicy = field(default=MediaPolicy(), metadata={"derived": True})

    @classmethod
    def of_models(cls, models: Sequence[Any]) -> "ValidationContext":
        """The context of a batch's models (resolved configs, the main model first)."""
        from .config import config_view
        from .models import class_labels, local_copy, model_tasks, reads_token_types, takes_images

        contexts = []
        for m in models:
            directory = local_copy(m.model, weights=False) if m.model else ""
            tasks = model_tasks(directory, m.runner)
            contexts.append(replace(config_view(cls, m), media=MediaPolicy.of(m), images=takes_images(directory),
                                    tasks=tasks, labels=class_labels(directory),
                                    token_types=reads_token_types(directory),
                                    hearing=hearing(directory) if EngineTask.TRANSCRIBE in tasks else None))
        first, *rest = contexts
        return replace(first, others=tuple(rest))

    @property
    def urls(self) -> tuple[str, ...]:
        """The endpoints of the tasks the model's engines do."""
        return tuple(url for task in self.tasks for url in SERVED_BY[task])

    def unfit(self, url: str) -> Optional[str]:
        """Why a ``url`` line cannot run on this model (its engines do another task, or the endpoint asks more of the
        model: see the endpoint's ``unfit``), or None."""
        if url not in self.urls:
            return (f"{self.served_model_name!r} is {' and '.join(TASK_MODELS[t] for t in self.tasks)}, which serves "
                    f"{', '.join(self.urls)}")
        return ENDPOINTS[url].unfit(self) if hasattr(ENDPOINTS[url], "unfit") else None

    def route(self, model: str) -> tuple["ValidationContext", Optional[str]]:
        """The context of the model ``model`` names and the LoRA adapter it names (None: the base model)."""
        for ctx in (self, *self.others):
            if model == ctx.served_model_name:
                return ctx, None
            if model in ctx.lora_modules:
                return ctx, model
        raise KeyError(model)

    def names(self) -> list[str]:
        """Every name body.model may give: each model's served name, then its adapters."""
        return [n for ctx in (self, *self.others) for n in (ctx.served_model_name, *sorted(ctx.lora_modules))]


def validate_line(raw: bytes | str | None, file: str, line_number: int, ctx: ValidationContext,
                  size: Optional[int] = None) -> Optional[dict]:
    """Validate one raw input line. Returns ``None`` for a blank line, else a row dict with ``VALIDATED_FIELDS``:
    either a request (``error_code`` None) or an error row (``error_code`` set). ``size``: the line's size when
    ``raw`` holds only its first bytes (a line over max_line_bytes, see read.py)."""
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
    size = len(data) if size is None else size
    try:
        if size > ctx.max_line_bytes:
            row["raw_line"] = _raw_preview(data, ctx.max_raw_line_chars)
            raise RequestError(ErrorCode.LINE_TOO_LARGE,
                               f"line is {size} bytes, over the limit of {ctx.max_line_bytes} (max_line_bytes); "
                               f"split it, or raise max_line_bytes if it is meant to be one request")
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
        row["request"] = without_data_urls(text)  # the images travel in options_json
        row["raw_line"] = None
    except RequestError as err:
        row["error_code"], row["error_message"] = err.code.value, err.message
        for key in ("url", "kind", "model", "request", "prompt_json", "sampling_json", "options_json", "max_tokens"):
            row[key] = None
        if err.code.value in LINE_LEVEL_CODES:  # the line's custom_id, whenever it shows one, for attribution
            row["custom_id"] = recover_custom_id(data[:_RECOVERY_BYTES] if size > ctx.max_line_bytes else data)
    return row


#: How much of an over-long line is searched for its custom_id.
_RECOVERY_BYTES = 64 * 1024
#: A custom_id at the start of a broken line: a JSON object's (``{"custom_id": ...``), a Python dict's repr
#: (``{'custom_id': '...'``), or the one physical line of a pretty-printed object that holds it
#: (``  "custom_id": "...",``).
_LEADING_ID = re.compile(r"""^\s*\{?\s*(["'])custom_id\1\s*:\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'"""
                         r"""|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|True|False)""")


def recover_custom_id(data: bytes) -> Optional[str]:
    """The custom_id a broken line shows, as a string: decoded with replacement characters, parsed leniently
    (NaN, extra data after the object), else read from its start (:data:`_LEADING_ID`); a non-string value as its
    JSON text (``12345`` -> ``"12345"``). None when the line shows none (or ``null``)."""
    text = data.decode("utf-8", "replace")
    value: Any = None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        value = obj.get("custom_id")
    else:  # not an object (a pretty-printed object's line starts as a string) or not JSON
        match = _LEADING_ID.match(text)
        if match:
            with contextlib.suppress(ValueError, SyntaxError):
                literal = match.group(2)
                value = ast.literal_eval(literal) if literal[0] == "'" or literal in ("True", "False") else \
                    json.loads(literal)
    if value is None:
        return None
    cid = value if isinstance(value, str) else truncate(json.dumps(value, ensure_ascii=False), 200)
    return cid.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate escape cannot be stored


def _raw_preview(data: bytes, limit: int) -> str:
    return truncate(data[: limit * 4 + 4].decode("utf-8", "replace"), limit) or ""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: A JSON escape of a UTF-16 surrogate (``\ud83d`` of a pair, or a lone one).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_json(text: str) -> dict:
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(ErrorCode.INVALID_JSON, "line is JSON nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise RequestError(ErrorCode.INVALID_JSON, f"line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RequestError(ErrorCode.INVALID_JSON, f"line is JSON but not an object (got {_json_type(obj)})")
    if _SURROGATE_ESCAPE.search(text) is None:  # the text is valid UTF-8: only an escape can make a surrogate
        return obj
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
    if not isinstance(url, str) or url not in ENDPOINTS:
        got = "missing" if "url" not in obj else truncate(json.dumps(url, ensure_ascii=False), 120)
        raise RequestError(ErrorCode.UNSUPPORTED_ENDPOINT,
                           f"url must be one of {', '.join(ENDPOINTS)}, got {got}")
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"unknown top-level field(s): {', '.join(extra)}")
    if "body" not in obj or not isinstance(obj["body"], dict):
        got = "missing" if "body" not in obj else _json_type(obj["body"])
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body must be a JSON object, got {got}")
    body = obj["body"]
    routes = ctx
    ctx, adapter = _check_model(body, routes)
    unfit = ctx.unfit(url)
    if unfit is not None:
        serving = [c.served_model_name for c in (routes, *routes.others) if c.unfit(url) is None]
        where = (f"set body.model to {' or '.join(map(repr, serving))}" if serving else
                 f"send {url} lines to a batch with a model for them")
        raise RequestError(ErrorCode.UNSUPPORTED_ENDPOINT, f"{unfit}; {where}")
    endpoint = ENDPOINTS[url]
    checked = endpoint.check(body, ctx)
    if adapter is not None:  # the engine runs the base model with this LoRA adapter; the response names it
        checked.options.adapter = adapter
    row.update(url=url, kind=endpoint.KIND, model=ctx.served_model_name, prompt_json=_dumps(checked.prompt),
               sampling_json=_dumps(checked.sampling), options_json=checked.options.to_json(),
               max_tokens=checked.sampling["max_tokens"])


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _check_model(body: dict, ctx: ValidationContext) -> tuple[ValidationContext, Optional[str]]:
    """The context of the model the request names and its LoRA adapter (None for a base model); a model this job
    does not serve is an error."""
    if "model" not in body or body["model"] is None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "body.model is required")
    model = body["model"]
    if not isinstance(model, str):
        raise RequestError(ErrorCode.INVALID_REQUEST, f"body.model must be a string, got {_json_type(model)}")
    try:
        return ctx.route(model)
    except KeyError:
        names = ctx.names()
        served = (f"use {names[0]!r}" if len(names) == 1 else
                  f"use one of {', '.join(repr(n) for n in names[:20])}" + (" ..." if len(names) > 20 else ""))
        raise RequestError(ErrorCode.MODEL_NOT_FOUND,
                           f"model {truncate(model, 200)!r} is not served by this job; {served}") from None


# ---- Spark glue ----------------------------------------------------------------------------------------------

def validate_batches(batches: Iterator, ctx: ValidationContext) -> Iterator:
    """mapInPandas body: raw lines (``value`` bytes, ``file``, ``line_number``) -> validated rows."""
    import pandas as pd

    for pdf in batches:
        rows = []
        sizes = pdf["line_bytes"] if "line_bytes" in pdf else [None] * len(pdf)
        for raw, file, line, size in zip(pdf["value"], pdf["file"], pdf["line_number"], sizes):
            row = validate_line(raw, file, int(line), ctx, None if size is None or pd.isna(size) else int(size))
            if row is not None:
                rows.append(row)
        out = pd.DataFrame(rows, columns=list(VALIDATED_FIELDS))
        out["line_number"] = out["line_number"].astype("int64")
        out["max_tokens"] = out["max_tokens"].astype("Int64")
        yield out
