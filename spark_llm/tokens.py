"""Prompt token counting with the served model's tokenizer and chat template, and the context-length guard.

Runs on the executors. The tokenizer is loaded once per Python worker. The token ids computed here are the ones the
engine receives, so ``prompt_tokens`` in the outputs equals the engine's ``usage.prompt_tokens`` by construction.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from .endpoints import BY_KIND
from .endpoints.common import check_token_ids
from .errors import ErrorCode
from .partition import prefix_key
from .schemas import PREFIX_COL

log = logging.getLogger(__name__)

_TOKENIZERS: dict[str, Any] = {}
_LOCK = threading.Lock()
#: Characters per token no real tokenizer exceeds on average; prompts longer than max_model_len * this are counted on
#: a prefix only, which bounds the work a million-token prompt can cause on one worker.
_MAX_CHARS_PER_TOKEN = 32


def get_tokenizer(path: str) -> Any:
    """The tokenizer for ``path``, loaded once per Python worker."""
    with _LOCK:
        tok = _TOKENIZERS.get(path)
        if tok is None:
            from .models import local_copy

            tok = load_tokenizer(local_copy(path, weights=False))  # a URI's copy on this host
            tok.model_max_length = sys.maxsize  # the context guard here decides; silence transformers' warning
            _TOKENIZERS[path] = tok
            log.info("loaded tokenizer %s", path)
        return tok


#: Files whose contents decide which tokenizer class transformers' AutoTokenizer picks for a model directory.
_CLASS_INPUTS = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json")


def load_tokenizer(model_dir: str) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir)``. The class it picks is recorded on this host (per tokenizer
    files and transformers version, in the model cache), and later processes load that class directly:
    AutoTokenizer decides by way of transformers' model configuration classes, which import torch, seconds of every
    Python worker's start for a tokenizer that needs none of it."""
    from .models import cache_dir

    import transformers

    stamp = [transformers.__version__, os.path.abspath(model_dir)]
    for name in _CLASS_INPUTS:
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(model_dir, name))
            stamp.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    record = cache_dir() / f"tokenizer-class-{hashlib.sha256(repr(stamp).encode()).hexdigest()[:20]}.txt"
    with contextlib.suppress(OSError, ValueError, ImportError, AttributeError):
        module, _, name = record.read_text().strip().partition(":")
        return getattr(importlib.import_module(module), name).from_pretrained(model_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cls = type(tok)
    if cls.__module__.startswith("transformers.") and getattr(importlib.import_module(cls.__module__),
                                                              cls.__name__, None) is cls:
        with contextlib.suppress(OSError):  # only a shortcut: without it, the next process asks AutoTokenizer
            tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{cls.__module__}:{cls.__name__}\n")
            os.replace(tmp, record)
    return tok


@dataclass(frozen=True)
class TokenContext:
    """The config's settings of the same names, resolved (:meth:`~spark_llm.config.BatchConfig.resolved`)."""

    tokenizer: str
    max_model_len: int
    context_overflow: str


def render_prompt(tokenizer: Any, kind: str, prompt: Any,
                  char_limit: Optional[int] = None) -> tuple[list[list[int]], bool]:
    """Token ids the engine will see, one list per prompt (the endpoint's rendering: the chat template applied to
    messages and tools, or the completion prompts), and whether only the first ``char_limit`` characters were
    tokenized."""
    return BY_KIND[kind].render(tokenizer, prompt, char_limit)


def estimated_tokens(prompt_tokens: int, prompts: int, sampling: dict, max_tokens: int) -> int:
    """A request's cost in the partition plan: its prompt tokens, plus the most it can generate (prompts x n x
    max_tokens; generation usually stops sooner)."""
    return prompt_tokens + prompts * int(sampling.get("n") or 1) * max_tokens


def count_row(tokenizer: Any, kind: str, prompt_json: str, sampling_json: str, ctx: TokenContext) -> dict:
    """Token ids, counts and the context-length decision for one valid request."""
    prompt = json.loads(prompt_json)
    sampling = json.loads(sampling_json)
    max_tokens = int(sampling["max_tokens"])
    ids, truncated = render_prompt(tokenizer, kind, prompt, ctx.max_model_len * _MAX_CHARS_PER_TOKEN)
    longest = max(len(p) for p in ids)
    if truncated and longest + max_tokens <= ctx.max_model_len:  # pathological chars/token: count it all
        ids, truncated = render_prompt(tokenizer, kind, prompt)
        longest = max(len(p) for p in ids)
    n_prompt = sum(len(p) for p in ids)
    out = {"prompt_token_ids": ids, "prompt_tokens": n_prompt, "max_tokens": max_tokens, "notes": None,
           "est_tokens": estimated_tokens(n_prompt, len(ids), sampling, max_tokens),
           "sampling_json": sampling_json, "error_code": None, "error_message": None}
    vocab = len(tokenizer)
    problem = check_token_ids(sampling, vocab)
    if problem is None and any(p and max(p) >= vocab for p in ids):
        problem = f"body.prompt holds token ids outside the vocabulary (size {vocab})"
    if problem is not None:
        out.update(error_code=ErrorCode.INVALID_REQUEST.value, error_message=problem)
        return out
    if longest + max_tokens > ctx.max_model_len:
        fits_alone = longest < ctx.max_model_len and not truncated
        if ctx.context_overflow == "truncate" and fits_alone:
            new_max = ctx.max_model_len - longest
            sampling["max_tokens"] = new_max
            if sampling.get("min_tokens", 0) > new_max:
                sampling["min_tokens"] = new_max
            out.update(max_tokens=new_max, sampling_json=json.dumps(sampling),
                       est_tokens=estimated_tokens(n_prompt, len(ids), sampling, new_max),
                       notes=f"max_tokens lowered from {max_tokens} to {new_max} to fit max_model_len "
                             f"{ctx.max_model_len}")
        else:
            at_least = "at least " if truncated else ""
            which = "prompt" if len(ids) == 1 else "longest prompt"
            out.update(error_code=ErrorCode.CONTEXT_LENGTH_EXCEEDED.value,
                       error_message=f"{which} has {at_least}{longest} tokens and max_tokens is {max_tokens}: "
                                     f"{at_least}{longest + max_tokens} tokens, over the model's maximum context "
                                     f"length of {ctx.max_model_len}")
    return out


def count_batches(batches: Iterator, contexts: TokenContext | Mapping[str, TokenContext]) -> Iterator:
    """mapInPandas body: adds prompt_token_ids, prompt_tokens, est_tokens, prefix_key and notes; error rows pass
    through.
    ``contexts``: one context, or one per served model name (each row is counted for its ``model``)."""
    import pandas as pd

    tokenizers: dict[str, Any] = {}
    for pdf in batches:
        ids_col, n_col, est_col, key_col, notes_col = [], [], [], [], []
        pdf = pdf.copy()
        for i in range(len(pdf)):
            if pdf["error_code"].iat[i] is not None:
                ids_col.append(None)
                n_col.append(None)
                est_col.append(None)
                key_col.append(None)
                notes_col.append(None)
                continue
            ctx = contexts if isinstance(contexts, TokenContext) else contexts[pdf["model"].iat[i]]
            tokenizer = tokenizers.get(ctx.tokenizer)
            if tokenizer is None:
                tokenizer = tokenizers[ctx.tokenizer] = get_tokenizer(ctx.tokenizer)
            try:
                res = count_row(tokenizer, pdf["kind"].iat[i], pdf["prompt_json"].iat[i],
                                pdf["sampling_json"].iat[i], ctx)
            except Exception as exc:  # a template or tokenizer failure on one request is that request's error
                res = {"prompt_token_ids": None, "prompt_tokens": None, "notes": None,
                       "sampling_json": pdf["sampling_json"].iat[i], "max_tokens": pdf["max_tokens"].iat[i],
                       "error_code": ErrorCode.INVALID_REQUEST.value,
                       "error_message": f"prompt could not be tokenized: {type(exc).__name__}: {exc}"[:1000]}
            if res["error_code"] is not None:
                pdf.iat[i, pdf.columns.get_loc("error_code")] = res["error_code"]
                pdf.iat[i, pdf.columns.get_loc("error_message")] = res["error_message"]
                ids_col.append(None)
                n_col.append(res["prompt_tokens"])
                est_col.append(None)
                key_col.append(None)
                notes_col.append(None)
                continue
            pdf.iat[i, pdf.columns.get_loc("sampling_json")] = res["sampling_json"]
            pdf.iat[i, pdf.columns.get_loc("max_tokens")] = res["max_tokens"]
            ids_col.append(res["prompt_token_ids"])
            n_col.append(res["prompt_tokens"])
            est_col.append(res["est_tokens"])
            options = pdf["options_json"].iat[i]
            key_col.append(prefix_key(res["prompt_token_ids"][0],
                                      json.loads(options).get("adapter") if options else None))
            notes_col.append(res["notes"])
        pdf["prompt_token_ids"] = ids_col
        pdf["prompt_tokens"] = pd.array(n_col, dtype="Int64")
        pdf["est_tokens"] = pd.array(est_col, dtype="Int64")
        pdf[PREFIX_COL] = pd.array(key_col, dtype="Int64")
        pdf["notes"] = notes_col
        yield pdf
