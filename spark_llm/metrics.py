"""Per-partition inference metrics and the driver's progress line.

Each inference task makes one small record (rows, tokens, engine load and run time, errors by code) and sends it
two ways: on its first result row (``partition_metrics``), so that it is staged and committed with the wave into the
``metrics`` Delta table (which ``batch.json`` and ``report.html`` read), and, on classic sessions, to a Spark
accumulator that feeds the live progress line (Spark Connect has no accumulators: its progress line moves as waves
commit). A retried task may report twice to the accumulator; the last report of each (wave, partition) wins.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pyspark.accumulators import AccumulatorParam

from .schemas import PartitionRecord

log = logging.getLogger(__name__)


class ListParam(AccumulatorParam):
    """Accumulates lists of small records."""

    def zero(self, value: list) -> list:
        return []

    def addInPlace(self, value1: list, value2: list) -> list:
        value1.extend(value2)
        return value1


def latest_records(records: Sequence[PartitionRecord]) -> list[PartitionRecord]:
    """One record per (wave, partition): the last one reported (a retried task reports again)."""
    best: dict[tuple[int, int], PartitionRecord] = {}
    for rec in records:
        key = (rec.wave, rec.partition)
        if key not in best or (rec.finished_at or 0) >= (best[key].finished_at or 0):
            best[key] = rec
    return [best[k] for k in sorted(best)]


@dataclass(frozen=True)
class EngineUsage:
    """How busy the engines were over a batch's partitions (batch.json's ``partition_plan`` has these fields)."""

    runs: int
    partitions_run: int
    engine_seconds: float           #: the engines' busy time, each engine's spans united
    inference_wall_seconds: float   #: each run's first partition's start to its last one's end, summed
    busy_fraction: Optional[float]  #: engine_seconds / (engines x inference wall)
    engine_tokens_per_second: Optional[float]
    prefix_cache_hit_rate: Optional[float]


def engine_usage(records: Sequence[PartitionRecord]) -> EngineUsage:
    """How busy the engines were over a batch's partitions (of one run or of all its runs: records carry their
    ``run_id`` and ``engines``): ``busy_fraction`` = engine busy seconds / (engines x inference wall time), where a
    run's inference wall runs from its first partition's start to its last partition's end, and an engine's busy
    time is the union of the spans its partitions' requests were in it (two tasks feed an engine at once, so their
    spans overlap; records of older runs without spans count their engine_seconds)."""
    runs: dict[str, list[PartitionRecord]] = {}
    for rec in records:
        runs.setdefault(str(rec.run_id), []).append(rec)
    busy = wall = capacity = 0.0
    for recs in runs.values():
        span = max(r.finished_at or 0 for r in recs) - min(r.started_at or 0 for r in recs)
        engines = max(int(r.engines or r.task_slots or 0) for r in recs) or len({r.engine_slot for r in recs})
        wall += span
        capacity += span * engines
        by_engine: dict[Any, list[tuple[float, float]]] = {}
        for r in recs:
            if r.engine_started_at is None or r.engine_finished_at is None:
                busy += float(r.engine_seconds or 0)
            else:
                by_engine.setdefault((r.engine_slot, r.engine_pid), []).append(
                    (float(r.engine_started_at), float(r.engine_finished_at)))
        busy += sum(union_seconds(spans) for spans in by_engine.values())
    prompt = sum(int(r.prompt_tokens or 0) for r in records)
    cached = sum(int(r.cached_prompt_tokens or 0) for r in records)
    tokens = prompt + sum(int(r.completion_tokens or 0) for r in records)
    return EngineUsage(runs=len(runs), partitions_run=len(records), engine_seconds=round(busy, 3),
                       inference_wall_seconds=round(wall, 3),
                       busy_fraction=round(busy / capacity, 4) if capacity > 0 else None,
                       engine_tokens_per_second=round(tokens / busy, 1) if busy > 0 else None,
                       prefix_cache_hit_rate=round(cached / prompt, 4) if prompt else None)


def merged_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The ``(start, end)`` spans merged where they overlap or touch, in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the ``(start, end)`` spans."""
    return sum(end - start for start, end in merged_spans(spans))


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_line(batch_id: str, records: Sequence[PartitionRecord], total_requests: int, started: float, wave: str,
                  now: Optional[float] = None) -> str:
    """``progress <batch>: wave 2/6 | requests 120/500 (24.0%) | tokens in .., out .. | .. tok/s | elapsed | eta``."""
    now = time.time() if now is None else now
    recs = latest_records(records)
    done = sum(r.rows for r in recs)
    p_tok = sum(r.prompt_tokens for r in recs)
    c_tok = sum(r.completion_tokens for r in recs)
    elapsed = max(now - started, 1e-9)
    pct = 100.0 * done / total_requests if total_requests else 100.0
    eta = _fmt_duration(elapsed / done * (total_requests - done)) if done else "?"
    return (f"progress {batch_id}: wave {wave} | requests {done}/{total_requests} ({pct:.1f}%) | tokens in {p_tok}, "
            f"out {c_tok} | {(p_tok + c_tok) / elapsed:.0f} tok/s | elapsed {_fmt_duration(elapsed)} | eta {eta}")


class ProgressReporter:
    """Logs a progress line every ``interval`` seconds (and once at the end) from a daemon thread on the driver."""

    def __init__(self, line: Callable[[], str], interval: float = 30.0):
        self._line, self._interval = line, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spark_llm-progress", daemon=True)

    def __enter__(self) -> "ProgressReporter":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        log.info("%s", self._line())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                log.info("%s", self._line())
            except Exception:  # never let reporting break the job
                log.debug("progress line failed", exc_info=True)
