"""The engine stand-in: answers like a vLLM engine at the speed of a GPU, for measuring the job's own costs.

On this project's CPU machines vLLM is always the slowest part of a batch, so what the job itself costs (reading,
validating, counting tokens, partitioning, committing, writing) is never seen at the speed of a GPU. Selected by the
``engine_standin`` setting (never by default), the engine server builds a :class:`StandInLLM` instead of a
``vllm.LLM``: the same server, protocol, streaming, priorities and isolation feed it, and it answers each request
with deterministic tokens of the requested length (``max_tokens``, or drawn per request from a long-tail mix:
:class:`~.rates.AnswerLengths`) after the time its :class:`Rates` give, sleeping
rather than computing, so it costs almost no CPU. No vLLM or torch is imported.

**The rate model** (:class:`Scheduler`, pure: a virtual clock, no sleeping): up to ``max_num_seqs`` sequences run at
once, as in vLLM's continuous batching. A decode step makes one token of every running sequence and takes
``max_num_seqs / decode_tokens_per_second`` whatever the batch's size (decoding is bound by reading the weights,
once per step), so a full batch makes ``decode_tokens_per_second``; a request's prompt costs
``prompt tokens / prefill_tokens_per_second`` in the step that admits it, its first token included. A pooling call
(embeddings, classification) costs its prompts' tokens at the prefill rate. The engine takes ``start_seconds`` to
load.

**Faults**, for the fault tests at scale: a generation request whose ``stop`` list holds :data:`FAIL_MARKER` makes
the step that admits it raise (the server's isolation finds it: one ``engine_error`` row); one holding
:data:`DIE_MARKER` kills the engine as a dead tensor-parallel worker would (``Executor failed.``: the engine is rebuilt
and the request set aside).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from ..errors import EngineStartError
from .protocol import EngineRequest, Parse, RequestFailure
from .rates import PROFILES, Rates, parse_rates


#: A generation request whose ``stop`` list holds this fails in the engine (an ``engine_error`` row).
FAIL_MARKER = "spark-llm-standin:fail"
#: A generation request whose ``stop`` list holds this kills the engine.
DIE_MARKER = "spark-llm-standin:die"
#: The longest a stand-in step sleeps: requests that arrive meanwhile join the batch at the next step, as in vLLM.
MAX_STEP_SECONDS = 0.1
#: The stand-in's vocabulary: its token ids index these words.
WORDS = tuple("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
              "quebec romeo sierra tango uniform victor whiskey xray yankee zulu one two three four five six".split())


# ---- the rate model --------------------------------------------------------------------------------------------

@dataclass
class Seq:
    """A request in the stand-in: its id, prompt and answer lengths (and, in the engine, what it answers from)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    prompt: Sequence[int] = ()
    params: dict = field(default_factory=dict)


@dataclass
class Scheduler:
    """The rate model on a virtual clock (see the module docs): :meth:`step` admits what fits, advances to the next
    finish (at most ``max_seconds``) and says how long that took and which sequences finished."""

    rates: Rates
    max_seconds: float = MAX_STEP_SECONDS
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  #: heap of (finish step, order, sequence)
    steps: int = 0     #: decode steps so far
    admitted: int = 0  #: sequences admitted so far (the heap's tie-breaker)

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def abort(self, request_ids: set[str]) -> None:
        self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
        self.running = [r for r in self.running if r[2].request_id not in request_ids]
        heapq.heapify(self.running)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> tuple[float, list[Seq], list[Seq]]:
        """Seconds this stretch takes, the sequences it admitted, and those that finished in it."""
        prefill, admitted = 0, []
        while self.waiting and len(self.running) < self.rates.max_num_seqs:
            seq = self.waiting.popleft()
            prefill += seq.prompt_tokens
            # the prefill makes the first token; each later one takes a decode step
            heapq.heappush(self.running, (self.steps + max(seq.output_tokens - 1, 0), self.admitted, seq))
            self.admitted += 1
            admitted.append(seq)
        seconds = prefill / self.rates.prefill_tokens_per_second
        if self.running:
            step = self.rates.step_seconds
            most = max(1, int(self.max_seconds / step)) if step > 0 and math.isfinite(self.max_seconds) else 1 << 62
            ahead = max(0, min(self.running[0][0] - self.steps, most))
            self.steps += ahead
            seconds += ahead * step
        finished = []
        while self.running and self.running[0][0] <= self.steps:
            finished.append(heapq.heappop(self.running)[2])
        return seconds, admitted, finished


# ---- the engine ------------------------------------------------------------------------------------------------

def answer_tokens(prompt: Sequence[int], seed: Any, choice: int, count: int) -> list[int]:
    """The stand-in's answer: ``count`` token ids made of the prompt, the request's seed and the choice's index, so
    the same request gets the same answer wherever and whenever it runs."""
    start = hashlib.blake2b(repr((tuple(prompt[-64:]), len(prompt), seed, choice)).encode(),
                            digest_size=4).digest()
    first = int.from_bytes(start, "big")
    return [(first + 7 * k) % len(WORDS) for k in range(count)]


def max_tokens(params: dict) -> int:
    """A request's ``max_tokens`` as the stand-in reads it (16, vLLM's default, when it has none)."""
    return max(int(params.get("max_tokens") or 16), 1)


def answer_lengths(rates: Rates, prompt: Sequence[int], params: dict) -> list[int]:
    """Each choice's answer length in tokens: its request's ``max_tokens`` (the default), or drawn for the request
    from the rates' :class:`~.rates.AnswerLengths` and cut at ``max_tokens``."""
    most = max_tokens(params)
    choices = range(int(params.get("n") or 1))
    if rates.answers is None:
        return [most for _ in choices]
    return [rates.answers.tokens(repr((tuple(prompt[-64:]), len(prompt), params.get("seed"), k)).encode(), most)
            for k in choices]


def decode(token_ids: Sequence[int]) -> str:
    return " ".join(WORDS[t % len(WORDS)] for t in token_ids)


class _Tokenizer:
    """What the engine server asks of a tokenizer (echo's decode), in the stand-in's words."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode(token_ids)


class Parsers:
    """The stand-in's answers hold no reasoning or tool calls: nothing to parse."""

    def __init__(self) -> None:
        self.tokenizer = _Tokenizer()

    def parse(self, choice: Any, parse: Parse) -> None:
        return None


def engine_inputs(request: EngineRequest) -> "tuple[dict, Any] | RequestFailure":
    """The stand-in's prompt and settings of a request: its token ids and its settings as they came (no vLLM)."""
    return {"prompt_token_ids": request.token_ids}, request.params


def _choice(index: int, tokens: list[int], logprobs: Optional[int], cut: bool) -> SimpleNamespace:
    lps = None
    if logprobs is not None:
        lps = [{t: SimpleNamespace(logprob=-1.0, rank=1, decoded_token=WORDS[t])} for t in tokens]
    reason = "length" if cut else "stop"
    return SimpleNamespace(index=index, text=decode(tokens), token_ids=tokens, finish_reason=reason, logprobs=lps)


class StandInLLM:
    """The part of ``vllm.LLM`` the engine server uses (``enqueue``, ``llm_engine.step``, ``abort_request``, whole
    calls of ``generate``, ``embed`` and ``classify``), answered by the rate model (see the module docs)."""

    def __init__(self, rates: Rates, model_dir: Optional[str] = None, sleep: Any = time.sleep):
        self.rates, self.sleep = rates, sleep
        self.scheduler = Scheduler(rates)
        self.clock = 0.0  #: when the engine's work so far ends (time.monotonic)
        self.ids = 0
        config = _model_config(model_dir)
        self.hidden_size = int(config.get("hidden_size") or 8)
        self.num_labels = max(len(config.get("id2label") or {}), 1)
        self.llm_engine = SimpleNamespace(
            step=self.step, abort_request=self.abort_request,
            vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rates.max_num_seqs)))
        self._wait(rates.start_seconds)

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    def _wait(self, seconds: float) -> None:
        """Take ``seconds`` of engine time after the work before it (or now, if the engine was idle)."""
        now = time.monotonic()
        self.clock = max(self.clock, now) + seconds
        if self.clock > now:
            self.sleep(self.clock - now)

    # ---- the stepped engine ------------------------------------------------------------------------------

    def enqueue(self, prompts: list[dict], params: list[dict], lora_request: Any = None,
                use_tqdm: bool = False) -> list[str]:
        ids = []
        for prompt, p in zip(prompts, params):
            self.ids += 1
            rid = str(self.ids)
            tokens = prompt["prompt_token_ids"]
            self.scheduler.add(Seq(rid, len(tokens), max(answer_lengths(self.rates, tokens, p)), tokens, p))
            ids.append(f"{rid}-standin")
        return ids

    def abort_request(self, request_ids: Sequence[str], internal: bool = False) -> None:
        self.scheduler.abort({r.split("-", 1)[0] for r in request_ids})

    def step(self) -> list[SimpleNamespace]:
        seconds, admitted, finished = self.scheduler.step()
        for seq in admitted:
            self._check_markers(seq.params)
        self._wait(seconds)
        return [self._output(seq.request_id, seq.prompt, seq.params) for seq in finished]

    @staticmethod
    def _check_markers(params: dict) -> None:
        stop = params.get("stop") or ()
        if DIE_MARKER in stop:
            raise RuntimeError("Executor failed.")  # what vLLM raises once a worker is gone: the engine is dead
        if FAIL_MARKER in stop:
            raise ValueError(f"the engine stand-in failed this request as its stop list asks ({FAIL_MARKER})")

    def _output(self, rid: str, tokens: Sequence[int], params: dict) -> SimpleNamespace:
        """A finished request as vLLM's ``RequestOutput`` reads: ``n`` choices, each of its :func:`answer_lengths`."""
        most = max_tokens(params)
        choices = [_choice(k, answer_tokens(tokens, params.get("seed"), k, count), params.get("logprobs"),
                           cut=count == most) for k, count in enumerate(answer_lengths(self.rates, tokens, params))]
        return SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=tokens, num_cached_tokens=0,
                               outputs=choices)

    # ---- whole calls (the isolating path, pooling engines) -----------------------------------------------

    def generate(self, prompts: list[dict], params: list[dict], lora_request: Any = None,
                 use_tqdm: bool = False) -> list[SimpleNamespace]:
        for p in params:
            self._check_markers(p)
        scheduler = Scheduler(self.rates, max_seconds=math.inf)
        for k, (prompt, p) in enumerate(zip(prompts, params)):
            tokens = prompt["prompt_token_ids"]
            scheduler.add(Seq(str(k), len(tokens), max(answer_lengths(self.rates, tokens, p))))
        seconds = 0.0
        while scheduler.busy:
            seconds += scheduler.step()[0]
        self._wait(seconds)
        return [self._output(str(k), prompt["prompt_token_ids"], p)
                for k, (prompt, p) in enumerate(zip(prompts, params))]

    def _pooled(self, prompts: list[dict]) -> None:
        self._wait(sum(len(p["prompt_token_ids"]) for p in prompts) / self.rates.prefill_tokens_per_second)

    def embed(self, prompts: list[dict], pooling_params: list[dict], lora_request: Any = None,
              use_tqdm: bool = False) -> list[SimpleNamespace]:
        self._pooled(prompts)
        outs = []
        for prompt, p in zip(prompts, pooling_params):
            size = int(p.get("dimensions") or self.hidden_size)
            tokens = answer_tokens(prompt["prompt_token_ids"], None, 0, size)
            vector = [t / len(WORDS) - 0.5 for t in tokens]
            norm = math.sqrt(sum(x * x for x in vector)) or 1.0
            outs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], num_cached_tokens=0,
                                        outputs=SimpleNamespace(embedding=[x / norm for x in vector])))
        return outs

    def classify(self, prompts: list[dict], pooling_params: list[dict], lora_request: Any = None,
                 use_tqdm: bool = False) -> list[SimpleNamespace]:
        self._pooled(prompts)
        outs = []
        for prompt in prompts:
            weights = [t + 1 for t in answer_tokens(prompt["prompt_token_ids"], None, 0, self.num_labels)]
            total = sum(weights)
            outs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], num_cached_tokens=0,
                                        outputs=SimpleNamespace(probs=[w / total for w in weights])))
        return outs


def _model_config(model_dir: Optional[str]) -> dict:
    """The model directory's config.json (sizes of embeddings and classes), or nothing."""
    if not model_dir:
        return {}
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def build_standin(spec: Any) -> StandInLLM:
    """The stand-in engine of an :class:`~spark_llm.engine_host.spec.EngineSpec` (its ``engine_standin`` names the
    rates)."""
    try:
        rates = parse_rates(spec.standin)
    except ValueError as exc:
        raise EngineStartError(str(exc)) from None
    model = spec.model
    return StandInLLM(rates, model if isinstance(model, str) and os.path.isdir(model) else None)


__all__ = ["DIE_MARKER", "FAIL_MARKER", "PROFILES", "Parsers", "Rates", "Scheduler", "StandInLLM", "answer_lengths",
           "build_standin", "engine_inputs", "parse_rates"]
