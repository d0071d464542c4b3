"""How fast an engine stand-in is (:mod:`~spark_llm.engine_host.standin`): its rates, the named profiles, and the
``engine_standin`` setting that names them, read here so that the setting is checked without the stand-in."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rates:
    """How fast a stand-in engine is (the model: :mod:`~spark_llm.engine_host.standin`)."""

    prefill_tokens_per_second: float
    decode_tokens_per_second: float  #: generated tokens per second of the whole engine with a full batch
    max_num_seqs: int                #: sequences decoded at once
    start_seconds: float = 0.0       #: the engine's load

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
    change, e.g. ``h200-8b`` or ``h200-8b,start_seconds=0,max_num_seqs=256``. Raises ValueError with what is
    allowed."""
    name, *changes = [part.strip() for part in value.split(",")]
    if name not in PROFILES:
        raise ValueError(f"unknown engine stand-in {name!r}: one of {', '.join(PROFILES)}, optionally followed by "
                         f",field=value (fields: {', '.join(Rates.__dataclass_fields__)})")
    rates = PROFILES[name]
    for change in changes:
        key, _, number = change.partition("=")
        key = key.strip()
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
