"""How fast an engine stand-in is (:mod:`~spark_llm.engine_host.standin`): its rates, the named profiles, and the
``engine_standin`` setting that names them, read here so that the setting is checked without the stand-in."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class AnswerLengths:
    """How many tokens the stand-in answers a request, below its ``max_tokens`` (which still cuts an answer, as
    ``length``; a shorter one ends as ``stop``): about ``median`` (0.5 to 1.5 times it), except a ``tail`` fraction
    of the requests, whose answers are ``times`` the median, as a few long answers of a real batch are. Drawn from a
    hash of the request (its prompt, seed and choice), so a request has the same length in every run and
    partitioning. The setting: ``answers=MEDIAN`` or ``answers=MEDIAN/TAILxTIMES`` (``answers=64/0.05x10``)."""

    median: int
    tail: float = 0.0
    times: float = 1.0

    def tokens(self, key: bytes, max_tokens: int) -> int:
        draw = hashlib.blake2b(key, digest_size=8, person=b"answer-len").digest()
        u, v = int.from_bytes(draw[:4], "big") / 2 ** 32, int.from_bytes(draw[4:], "big") / 2 ** 32
        length = self.median * self.times if u < self.tail else self.median * (0.5 + v)
        return max(1, min(max_tokens, round(length)))

    @classmethod
    def parse(cls, text: str) -> "AnswerLengths":
        """``MEDIAN`` or ``MEDIAN/TAILxTIMES``; ValueError saying so."""
        median, _, tail = text.partition("/")
        fraction, _, times = tail.partition("x")
        try:
            lengths = cls(int(median), float(fraction or 0), float(times or 1))
        except ValueError:
            raise ValueError(f"answers={text!r}: MEDIAN or MEDIAN/TAILxTIMES, as 64 or 64/0.05x10") from None
        if lengths.median < 1 or not 0 <= lengths.tail <= 1 or lengths.times < 1:
            raise ValueError(f"answers={text!r}: a median of 1 or more, a tail fraction from 0 to 1, times 1 or more")
        return lengths


@dataclass(frozen=True)
class Rates:
    """How fast a stand-in engine is (the model: :mod:`~spark_llm.engine_host.standin`)."""

    prefill_tokens_per_second: float
    decode_tokens_per_second: float  #: generated tokens per second of the whole engine with a full batch
    max_num_seqs: int                #: sequences decoded at once
    start_seconds: float = 0.0       #: the engine's load
    #: the answers' lengths; None: each request's ``max_tokens``, as a request that never stops early
    answers: Optional[AnswerLengths] = None

    @property
    def step_seconds(self) -> float:
        return self.max_num_seqs / self.decode_tokens_per_second


#: Named rates, after a GPU class and model size: an 8B model in bf16 with vLLM's offline defaults (1024 sequences on
#: an H100 or H200), decode rates after MLPerf Inference's Llama-3.1-8B offline results (5,777 tokens/s on one
#: H100 with vLLM), prefill at about half of the GPU's dense bf16 peak. ``free`` costs nothing: the job's own ceiling.
PROFILES = {
    "h200-8b": Rates(prefill_tokens_per_second=30_000, decode_tokens_per_second=8_000, max_num_seqs=1024,
                     start_seconds=60),
    "h100-8b": Rates(prefill_tokens_per_second=20_000, decode_tokens_per_second=5_800, max_num_seqs=1024,
                     start_seconds=60),
    "l4-8b": Rates(prefill_tokens_per_second=4_000, decode_tokens_per_second=900, max_num_seqs=256,
                   start_seconds=90),
    "free": Rates(prefill_tokens_per_second=math.inf, decode_tokens_per_second=math.inf, max_num_seqs=1024,
                  start_seconds=0),
}

def parse_rates(value: str) -> Rates:
    """The rates a setting names: a profile (:data:`PROFILES`), optionally followed by fields of :class:`Rates` to
    change, e.g. ``h200-8b`` or ``h200-8b,start_seconds=0,max_num_seqs=256``, and ``answers=`` the answers'
    lengths (:class:`AnswerLengths`). Raises ValueError with what is allowed."""
    name, *changes = [part.strip() for part in value.split(",")]
    if name not in PROFILES:
        raise ValueError(f"unknown engine stand-in {name!r}: one of {', '.join(PROFILES)}, optionally followed by "
                         f",field=value (fields: {', '.join(Rates.__dataclass_fields__)})")
    rates = PROFILES[name]
    for change in changes:
        key, _, number = change.partition("=")
        key = key.strip()
        if key == "answers":
            rates = replace(rates, answers=AnswerLengths.parse(number.strip()))
            continue
        if key not in Rates.__dataclass_fields__:
            raise ValueError(f"engine stand-in {value!r}: no field {key!r} (fields: "
                             f"{', '.join(Rates.__dataclass_fields__)})")
        try:
            parsed = int(number) if key == "max_num_seqs" else float(number)
        except ValueError:
            raise ValueError(f"engine stand-in {value!r}: {key} must be a number, not {number!r}") from None
        if parsed < 0 or (parsed == 0 and key != "start_seconds"):
            raise ValueError(f"engine stand-in {value!r}: {key} must be positive")
        rates = replace(rates, **{key: parsed})
    return rates
