"""What the endpoints share: value checks, the sampling surface, structured outputs and function tools.

Everything here is plain Python on JSON values; a problem is a :class:`~spark_llm.errors.RequestError` whose message
names the field and says what to change. The results are JSON-able dicts: ``SamplingParams`` keyword arguments
(``structured_outputs`` as the keyword arguments of vLLM's ``StructuredOutputsParams``), built into vLLM objects only
in the engine process (:mod:`~spark_llm.endpoints.engine_side`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional

from ..errors import ErrorCode, RequestError, truncate
from ..media import check_url

#: Request fields that carry no meaning for generation and are accepted and ignored.
HARMLESS_FIELDS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream", "stream_options",
                             "safety_identifier", "prompt_cache_key"})
#: Fields every generating endpoint maps onto SamplingParams the same way (OpenAI's and vLLM's extensions).
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos"})
_BIG = 2**31 - 1


@dataclass
class ResponseOptions:
    """What a request's answer needs from it beside the engine's outputs: set by its endpoint's ``check``, carried
    in the request's row as ``options_json`` (the fields that have a value), read by the inference task and the
    endpoint's ``respond``."""

    adapter: Optional[str] = None          #: the LoRA adapter the request's model names
    images: Optional[list[str]] = None     #: the image parts' URLs, in order (read by the inference task)
    audio: Optional[str] = None            #: the clip's URL (transcriptions, translations)
    sample_rate: Optional[int] = None      #: the Whisper model's rate the clip is decoded at
    tool_choice: Optional[str] = None      #: auto / named / required (a forced call is read from the answer)
    tools: Optional[list[dict]] = None     #: auto: the tools the engine's tool-call parser looks for
    tool_name: Optional[str] = None        #: named: the function called
    logprobs: Optional[int] = None         #: the alternatives per token the answer lists
    echo_prompt: bool = False              #: completions: the prompt before the answer's text
    echo: Optional[dict[str, Any]] = None  #: responses: the request's fields its answer repeats
    encoding_format: Optional[str] = None  #: embeddings: float or base64
    top_n: Optional[int] = None            #: rerank: the results kept
    documents: Optional[list[str]] = None  #: rerank: the texts its answer returns

    def to_json(self) -> str:
        given = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
        return json.dumps(given, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Optional[str]) -> "ResponseOptions":
        """The options of a request row (an older run's row may hold keys no longer read: they are left out)."""
        if not text:
            return cls()
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


@dataclass(frozen=True)
class Checked:
    """A request an endpoint accepted: what to tokenize, how to sample, and how to shape the answer."""

    prompt: Any                 #: JSON value the endpoint's ``render`` turns into token ids
    sampling: dict[str, Any]    #: SamplingParams keyword arguments (JSON-able)
    options: ResponseOptions = field(default_factory=ResponseOptions)


# ---- values -------------------------------------------------------------------------------------------------

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def json_type(v: Any) -> str:
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


def invalid(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_REQUEST, message)


def unsupported(message: str) -> RequestError:
    return RequestError(ErrorCode.UNSUPPORTED_PARAMETER, message)


def number(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False, integer: bool = False) -> Any:
    """``body[key]``, checked: a number (``integer``: an integer) in ``[lo, hi]`` (``lo_open``: ``(lo, hi]``)."""
    v = body[key]
    if integer and not is_int(v):
        raise invalid(f"body.{key} must be an integer, got {json_type(v)}")
    if not is_number(v):
        raise invalid(f"body.{key} must be a number, got {json_type(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise invalid(f"body.{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return v


def boolean(body: dict, key: str, where: str = "body") -> Optional[bool]:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise invalid(f"{where}.{key} must be a boolean, got {json_type(v)}")
    return v


#: The accepted-and-ignored fields' types, checked as strictly as OpenAI does (no coercion: ``"stream": 0`` is wrong).
_HARMLESS_TYPES = {"stream": bool, "store": bool, "user": str, "metadata": dict, "service_tier": str,
                   "stream_options": dict, "safety_identifier": str, "prompt_cache_key": str}
_TYPE_NAMES = {bool: "a boolean", str: "a string", dict: "an object"}


def classifier_settings(body: dict) -> dict[str, Any]:
    """PoolingParams keyword arguments of a request to a classifier (classify, score, rerank): its
    ``use_activation`` (false: the raw logits). ``max_tokens`` 0: nothing is generated, a request costs its input
    tokens in the partition plan (and is no pooling setting: :func:`~.engine_side.engine_params` drops it)."""
    settings: dict[str, Any] = {"max_tokens": 0}
    activation = boolean(body, "use_activation")
    if activation is not None:
        settings["use_activation"] = activation
    return settings


def check_fields(body: dict, allowed: frozenset, url: str) -> None:
    for key, kind in _HARMLESS_TYPES.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise invalid(f"body.{key} must be {_TYPE_NAMES[kind]}, got {json_type(body[key])}")
    if body.get("stream"):
        raise unsupported("stream must be false or absent in a batch request")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise unsupported(f"body field(s) not supported for {url}: {', '.join(unknown)}")


def text_content(content: Any, where: str, part_types: tuple[str, ...] = ("text",), *,
                 required: bool = True) -> Optional[str]:
    """A message's content as text: a string or a list of text parts (joined by newlines)."""
    if content is None:
        if required:
            raise invalid(f"{where} is required")
        return None
    if isinstance(content, str):
        if content == "" and required:
            raise invalid(f"{where} must not be empty")
        return content
    if isinstance(content, list):
        if not content and required:
            raise invalid(f"{where} must not be empty")
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"{where}[{j}] must be an object with a type")
            if part["type"] not in part_types:
                raise unsupported(f"{where}[{j}] has type {part['type']!r}; only {' / '.join(part_types)} parts "
                                  f"are supported (this job serves a text model)")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{j}].text must be a string")
            texts.append(part["text"])
        text = "\n".join(texts)
        if text == "" and required:
            raise invalid(f"{where} must not be empty")
        return text
    raise invalid(f"{where} must be a string or a list of text parts, got {json_type(content)}")


def user_content(content: Any, where: str, text_types: tuple[str, ...], image_type: str, ctx: Any,
                 images: list[str]) -> Any:
    """A user message's content: its text (as :func:`text_content`), or, when it holds image parts
    (``image_type``: chat's ``image_url``, Responses' ``input_image``), its parts as the chat template takes them,
    ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, each image's URL appended to ``images`` in order
    (checked by :func:`~spark_llm.media.check_url`; read when the tokens are counted)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == image_type
                                                 for p in content):
        return text_content(content, where, text_types)
    if not ctx.images:
        raise RequestError(ErrorCode.IMAGE_NOT_SUPPORTED,
                           f"{where} holds an image, and {ctx.served_model_name!r} has no vision encoder (its "
                           f"config.json names no vision_config); send images to a vision-language model")
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{at} must be an object with a type")
        if part["type"] == image_type:
            if image_type == "input_image" and part.get("file_id") is not None:  # an uploaded image (the service)
                images.append(ctx.media.stored_file(part["file_id"], f"{at}.file_id"))
            else:
                images.append(check_url(_image_url(part, at, image_type), ctx.media, at))
            parts.append({"type": "image"})
        elif part["type"] in text_types:
            if not isinstance(part.get("text"), str):
                raise invalid(f"{at}.text must be a string")
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise unsupported(f"{at} has type {part['type']!r}; only {' / '.join(text_types + (image_type,))} "
                              f"parts are supported")
    return parts


def _image_url(part: dict, where: str, image_type: str) -> Any:
    """The URL of an image part: chat's ``image_url.url`` (``detail`` accepted: the model's processor decides the
    resolution), Responses' ``image_url`` string."""
    if part.get("detail", "auto") not in ("auto", "low", "high"):
        raise invalid(f"{where}.detail must be auto, low or high")
    if image_type == "input_image":
        return part.get("image_url")
    value = part.get("image_url")
    if isinstance(value, dict):
        if value.get("detail", "auto") not in ("auto", "low", "high"):
            raise invalid(f"{where}.image_url.detail must be auto, low or high")
        return value.get("url")
    raise invalid(f"{where}.image_url must be an object with a url, got {json_type(value)}")


def text_or_token_inputs(value: Any, where: str, url: str, limit: int) -> list:
    """A completions ``prompt`` / embeddings ``input``: a string, token ids, or a list of up to ``limit`` of either,
    as a list."""
    if value is None:
        raise invalid(f"{where} is required for {url}")
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_int(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(f"{where} must be a non-empty string, a list of token ids, or a list of either")
    if len(value) > limit:
        raise invalid(f"{where} holds {len(value)} items; at most {limit} are allowed per request")
    for j, item in enumerate(value):
        at = where if len(value) == 1 else f"{where}[{j}]"
        if isinstance(item, str):
            if item == "":
                raise invalid(f"{at} must not be empty")
        elif not (isinstance(item, list) and item and all(is_int(t) and t >= 0 for t in item)):
            raise invalid(f"{at} must be a non-empty string or a list of non-negative token ids")
    return value


# ---- sampling ------------------------------------------------------------------------------------------------

def sampling(body: dict, ctx: Any, max_tokens_keys: tuple[str, ...]) -> dict[str, Any]:
    """SamplingParams keyword arguments for the fields of :data:`SAMPLING_FIELDS` and the endpoint's max-tokens
    field(s) (the first one given wins; two different values are an error)."""
    sp: dict[str, Any] = {}
    given = [k for k in max_tokens_keys if body.get(k) is not None]
    if len(given) == 2 and body[given[0]] != body[given[1]]:
        raise invalid(f"give {given[0]} or {given[1]}, not both")
    sp["max_tokens"] = number(body, given[0], 1, _BIG, integer=True) if given else ctx.default_max_tokens
    sp["temperature"] = (float(number(body, "temperature", 0, 2)) if body.get("temperature") is not None
                         else ctx.default_temperature)
    sp["top_p"] = (float(number(body, "top_p", 0, 1, lo_open=True)) if body.get("top_p") is not None
                   else ctx.default_top_p)
    if body.get("seed") is not None:
        sp["seed"] = number(body, "seed", -(2**63), 2**63 - 1, integer=True)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) is not None:
            sp[key] = float(number(body, key, -2, 2))
    if body.get("logit_bias") is not None:
        sp["logit_bias"] = logit_bias(body["logit_bias"])
    if body.get("top_k") is not None:
        top_k = number(body, "top_k", -1, _BIG, integer=True)
        if top_k > 0:
            sp["top_k"] = top_k
    if body.get("min_p") is not None:
        sp["min_p"] = float(number(body, "min_p", 0, 1))
    if body.get("repetition_penalty") is not None:
        sp["repetition_penalty"] = float(number(body, "repetition_penalty", 0, 2, lo_open=True))
    if body.get("min_tokens") is not None:
        sp["min_tokens"] = number(body, "min_tokens", 0, sp["max_tokens"], integer=True)
    if boolean(body, "ignore_eos") is not None:
        sp["ignore_eos"] = body["ignore_eos"]
    return sp


#: below this temperature vLLM samples greedily, and a seed means nothing (vllm.sampling_params._SAMPLING_EPS)
GREEDY_BELOW = 1e-5


def request_seed(batch_seed: int, custom_id: str, prompt: int = 0) -> int:
    """The seed of a sampled request that gives none (``sampling_seeds: request``): made of the batch's seed, the
    request's ``custom_id`` (unique in a batch) and which of its prompts it is, so that no two requests of a batch
    share a random stream and each answer is the same however the batch was partitioned. 63 bits: vLLM gives an
    ``n > 1`` request's choices ``seed + i``, and torch takes seeds below 2**64."""
    digest = hashlib.blake2b(f"{batch_seed}\x00{custom_id}\x00{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def with_request_seed(sampling_kwargs: dict[str, Any], batch_seed: int, custom_id: str, prompt: int = 0) -> dict:
    """``sampling_kwargs`` with :func:`request_seed` when the request samples and gives no seed of its own (a seed
    it gives keeps vLLM's meaning); as they are otherwise (greedy requests, pooling requests)."""
    if sampling_kwargs.get("seed") is not None or sampling_kwargs.get("temperature", 0.0) < GREEDY_BELOW:
        return sampling_kwargs
    return {**sampling_kwargs, "seed": request_seed(batch_seed, custom_id, prompt)}


def logit_bias(value: Any) -> dict[str, float]:
    """``{"token id": bias}`` with ids as decimal strings and biases in [-100, 100]. The ids are checked against the
    vocabulary when the prompt is tokenized (:func:`check_token_ids`)."""
    if not isinstance(value, dict):
        raise invalid(f"body.logit_bias must be an object mapping token ids to biases, got {json_type(value)}")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise invalid(f"body.logit_bias keys must be token ids (decimal strings), got {truncate(key, 40)!r}")
        if not is_number(bias) or not -100 <= bias <= 100:
            raise invalid(f"body.logit_bias[{key!r}] must be a number in [-100, 100], got {truncate(str(bias), 40)}")
        out[str(int(key))] = float(bias)
    return out


def stop_sequences(body: dict, ctx: Any) -> Optional[list[str]]:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("body.stop must be a non-empty string or a list of them")
    if len(stops) > ctx.max_stop_sequences:
        raise invalid(f"body.stop has {len(stops)} strings; at most {ctx.max_stop_sequences} are allowed")
    return stops or None


def check_token_ids(sampling_kwargs: dict, vocab_size: int) -> Optional[str]:
    """What is wrong with the token ids a request names (logit_bias), given the tokenizer's vocabulary; else None."""
    bad = sorted(int(k) for k in (sampling_kwargs.get("logit_bias") or {}) if int(k) >= vocab_size)
    if bad:
        return (f"body.logit_bias names token id(s) {', '.join(map(str, bad[:5]))} outside the model's vocabulary "
                f"(ids 0..{vocab_size - 1})")
    return None


# ---- structured outputs --------------------------------------------------------------------------------------

def response_format(fmt: Any, where: str, ctx: Any) -> Optional[dict[str, Any]]:
    """``StructuredOutputsParams`` keyword arguments for an OpenAI ``response_format`` (chat) or ``text.format``
    (Responses; the json_schema fields sit in the format itself rather than under ``json_schema``)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid(f"{where} must be an object with a type (text, json_object or json_schema)")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise invalid(f"{where}.type must be text, json_object or json_schema, got {truncate(kind, 60)!r}")
    nested = where.endswith("response_format")  # chat nests name/schema/strict under json_schema
    spec, inner = (fmt.get("json_schema"), f"{where}.json_schema") if nested else (fmt, where)
    if not isinstance(spec, dict):
        raise invalid(f"{inner} must be an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise invalid(f"{inner}.name must be a non-empty string of at most 64 characters")
    boolean(spec, "strict", inner)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise invalid(f"{inner}.schema must be a JSON Schema object, got {json_type(schema)}")
    check_schema(schema, f"{inner}.schema", ctx)
    return {"json": schema}


def check_schema(schema: dict, where: str, ctx: Any) -> None:
    """The schema is valid JSON Schema and the structured-output backend can compile it (checked here, on the
    executors, before any engine time is spent)."""
    problem = _schema_problem(json.dumps(schema, sort_keys=True), ctx.structured_outputs_backend)
    if problem:
        raise invalid(f"{where} cannot be used: {problem}")


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str, backend: str) -> Optional[str]:
    """Batches repeat one schema on every line: each distinct schema is checked once per worker."""
    schema = json.loads(schema_json)
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema comes with vLLM
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            return f"not a valid JSON Schema: {truncate(exc.message, 300)}"
    if backend in ("auto", "xgrammar"):
        try:
            import xgrammar
        except ImportError:  # no backend here to ask: the engine reports what it cannot compile
            return None
        try:
            xgrammar.Grammar.from_json_schema(schema_json, any_whitespace=False)
        except Exception as exc:
            if backend == "xgrammar":
                reason = str(exc).rsplit(": ", 1)[-1] if ": " in str(exc) else str(exc)
                return f"the xgrammar structured-output backend cannot compile it ({truncate(reason, 300)})"
    return None


# ---- function tools ------------------------------------------------------------------------------------------

#: Tool types the Responses API hosts on OpenAI's side; they need OpenAI's servers, not a model.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "computer_use", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")


def function_tool(name: Any, params: Any, description: Any, where: str, ctx: Any) -> dict:
    """One function tool, normalised to ``{"name", "description", "parameters"}``."""
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise invalid(f"{where}.name must be 1-64 letters, digits, _ or -, got {truncate(json.dumps(name), 70)}")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"{where}.parameters must be a JSON Schema object, got {json_type(params)}")
    check_schema(params, f"{where}.parameters", ctx)
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string")
    return {"name": name, "description": description, "parameters": params}


def check_tool_names(tools: list[dict], where: str) -> None:
    names = [t["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise invalid(f"{where} defines function(s) {', '.join(dup)} more than once")


def tool_choice(choice: Any, tools: Optional[list[dict]], named: Callable[[dict], str],
                named_form: str) -> tuple[str, Optional[str]]:
    """``tool_choice`` reduced to ``none`` / ``auto`` / ``required`` / ``named`` (+ the function's name); the
    default is ``auto`` with tools, else ``none``. ``named`` reads the name from the endpoint's object form (and
    raises for an object that names no function)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"body.tool_choice must be none, auto, required or {named_form}, got "
                          f"{truncate(choice, 40)!r}")
        if choice != "none" and not tools:
            raise invalid(f"body.tool_choice {choice} needs body.tools")
        return choice, None
    if not isinstance(choice, dict):
        raise invalid(f"body.tool_choice must be none, auto, required or {named_form}")
    name = named(choice)
    if not tools:
        raise invalid("body.tool_choice names a function but body.tools is empty")
    return "named", name


def tool_choice_options(choice: Any, named: Optional[str], tools: list[dict], parallel: Optional[bool],
                        ctx: Any) -> tuple[ResponseOptions, Optional[dict]]:
    """``(options, structured outputs)`` for a tool choice already reduced to ``none`` / ``auto`` / ``required`` /
    ``named`` (+ the function's name). ``required`` and a named function constrain the output to the tools' JSON
    schemas, as vLLM's server does; ``auto`` needs the configured tool-call parser."""
    if not tools or choice == "none":
        return ResponseOptions(), None
    if choice == "auto":
        if not ctx.tool_call_parser:
            raise unsupported("tool_choice auto (the default when tools are given) needs a tool-call parser: set the "
                              "job's tool_call_parser (e.g. hermes, llama3_json, mistral) to the one of your model, "
                              "or give tool_choice required or a named function")
        return ResponseOptions(tool_choice="auto", tools=tools), None
    if choice == "named":
        by_name = {t["name"]: t for t in tools}
        if named not in by_name:
            raise invalid(f"tool_choice names function {truncate(str(named), 70)!r}, which is not in tools "
                          f"({', '.join(by_name)})")
        return ResponseOptions(tool_choice="named", tool_name=named), {"json": by_name[named]["parameters"]}
    items = {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["name"]]}, "parameters": t["parameters"]},
         "required": ["name", "parameters"]} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if parallel is False:
        schema["maxItems"] = 1
    return ResponseOptions(tool_choice="required"), {"json": schema}


def tool_calls_from_output(content: Optional[str], options: ResponseOptions, cut: bool = False
                           ) -> Optional[list[dict]]:
    """``[{"name", "arguments", "complete"}]`` read from a constrained answer (``required``: a JSON array of
    ``{name, parameters}``; ``named``: the arguments object); None when the choice was not constrained, or its answer
    is not the JSON it was held to. An answer ``cut`` by max_tokens is still a tool call, as OpenAI answers it: the
    complete calls parsed, the cut one with its arguments as generated (``complete`` False)."""
    mode = options.tool_choice
    if mode not in ("named", "required") or content is None:
        return None
    try:
        value = json.loads(content)
    except ValueError:
        if not cut:
            return None
        if mode == "named":
            return [{"name": options.tool_name, "arguments": content, "complete": False}]
        return _cut_calls(content)
    if mode == "named":  # the answer is the arguments, exactly as generated
        return [{"name": options.tool_name, "arguments": content, "complete": True}]
    if not isinstance(value, list):
        return None
    return [{"name": c.get("name"), "arguments": json.dumps(c.get("parameters", {}), ensure_ascii=False),
             "complete": True} for c in value if isinstance(c, dict)]


_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CUT_PARAMETERS = re.compile(r'"parameters"\s*:\s*')


def _cut_calls(text: str) -> Optional[list[dict]]:
    """The calls of a ``required`` answer (a JSON array of ``{name, parameters}``) cut short: each complete element
    parsed, then the cut one, when its name was generated, with the parameters text as far as it went."""
    decoder, calls = json.JSONDecoder(), []
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return None
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            element, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        if isinstance(element, dict):
            calls.append({"name": element.get("name"), "complete": True,
                          "arguments": json.dumps(element.get("parameters", {}), ensure_ascii=False)})
    rest = text[at:]
    name, parameters = _CUT_NAME.search(rest), _CUT_PARAMETERS.search(rest)
    if name:
        arguments = rest[parameters.end():] if parameters else ""
        calls.append({"name": json.loads(f'"{name.group(1)}"'), "arguments": arguments, "complete": False})
    return calls or None


_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_inputs(messages: list[dict], tools: Optional[list[dict]], choice: str, effort: Any,
                    where: str) -> dict[str, Any]:
    """What the chat template renders: the messages, the function tools (unless tool_choice is none) and the
    reasoning effort (a template variable of reasoning models, as vLLM passes it)."""
    prompt: dict[str, Any] = {"messages": messages}
    if tools and choice != "none":
        prompt["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}}
                           for t in tools]
    if effort is not None:
        if effort not in _EFFORTS:
            raise invalid(f"{where} must be one of {', '.join(_EFFORTS)}")
        prompt["template_kwargs"] = {"reasoning_effort": effort}
    return prompt


def call_id(request_id: str, choice: int, k: int) -> str:
    """A deterministic ``call_...`` id: the same request gives the same ids on a rerun."""
    return "call_" + hashlib.sha256(f"{request_id}/{choice}/{k}".encode()).hexdigest()[:24]


# ---- answers -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Classes:
    """What a classifier's class probabilities mean (:attr:`~spark_llm.engine_host.protocol.EngineTask.CLASSIFY`):
    its labels by class index, the OpenAI moderation category each counts for (None: none), and the score at which a
    category is flagged. Made once per run of the model (:func:`~spark_llm.endpoints.moderations.classes`)."""

    labels: tuple[str, ...] = ()
    categories: tuple[Optional[str], ...] = ()
    threshold: float = 0.5


@dataclass(frozen=True)
class Reply:
    """What every response body needs besides the engine's outputs."""

    request_id: str     #: batch_req-derived id; the body's id uses its suffix
    model: str
    created: int
    options: ResponseOptions
    classes: Classes = Classes()  #: the model's classes, for the classifying endpoints
    audio_seconds: Optional[float] = None  #: the clip's length as the inference task read it (transcriptions)


@dataclass
class Answer:
    """An endpoint's response body and the row fields read from it (first choice)."""

    body: dict[str, Any]
    text: Optional[str]
    finish_reason: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    tool_calls: Optional[list[dict]] = None
    reasoning: Optional[str] = None
    embeddings: Optional[list[list[float]]] = None  #: one vector per input (embeddings endpoint)
    #: the typed result columns of the outputs table (:data:`~spark_llm.schemas.OUTPUTS_COLUMNS`) for SQL readers
    flagged: Optional[bool] = None                      #: moderations: any input flagged
    labels: Optional[list[str]] = None                  #: classify: each input's label; moderations: flagged ones
    scores: Optional[list[float]] = None                #: classify: each label's probability; score, rerank: pairs'
    category_scores: Optional[dict[str, float]] = None  #: moderations: each category's highest score


def finish_reason(reason: Optional[str]) -> str:
    return reason if reason in ("stop", "length") else (reason or "stop")


def id_suffix(request_id: str) -> str:
    return request_id.split("_", 1)[1]


def token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def token_positions(choice: Any, k: int) -> Any:
    """Per generated token: its text, its logprob and the k most likely alternatives (rank 1..k)."""
    for tok_id, pos in zip(choice.token_ids, choice.logprobs):
        chosen = pos.get(tok_id)
        token = (chosen.decoded_token if chosen is not None else None) or ""
        tops = sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        yield token, (float(chosen.logprob) if chosen is not None else None), tops


def answer_parts(choice: Any, options: ResponseOptions, reply: Reply, index: int) -> tuple[Optional[str], list[dict]]:
    """The answer text and the tool calls (``[{"id", "name", "arguments"}]``) of one choice: calls found by the
    engine's tool-call parser (``auto``) or read from a constrained answer (``required`` / named)."""
    content = choice.content if choice.parsed else choice.text
    calls = choice.tool_calls
    if calls is None:
        calls = tool_calls_from_output(content, options, cut=finish_reason(choice.finish_reason) == "length")
        if calls is not None:
            content = None
    calls = [{"id": call_id(reply.request_id, index, k), **c} for k, c in enumerate(calls or [])]
    return content, calls
