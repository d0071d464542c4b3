"""Token-balanced repartitioning: every inference task gets about the same estimated work.

Estimated cost of a request (``est_tokens``, from the token stage: :func:`~spark_llm.tokens.estimated_tokens`) =
prompt tokens + prompts x n x max_tokens. Requests are laid on one line of cumulative cost in a fixed order (by
:func:`prefix_key` when planning is prefix-aware, so that requests sharing a prompt prefix are consecutive; by id
otherwise) and the line is cut into ``P`` equal ranges, so each partition holds total/P tokens give or take one
request. The plan is the order key of each planned partition's first request: the planning jobs shuffle only three
narrow columns, and a wave selects its requests by key range (:func:`assign`). Only per-partition sums and the P
boundary keys reach the driver, never requests. Inside a partition, requests sharing a prefix run back to back and
vLLM's prefix cache reuses them.
"""

from __future__ import annotations

import functools
import logging
import math
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .schemas import PREFIX_COL

log = logging.getLogger(__name__)

PART_COL = "_part"
#: Leading prompt tokens whose hashes make up a prefix key, shortest first. vLLM's prefix cache reuses blocks of 16
#: tokens; a system prompt or few-shot block runs from tens to thousands of tokens.
PREFIX_LEVELS = (16, 64, 256, 1024)
_LEVEL_BITS = 12
_ADAPTER_BITS = 64 - _LEVEL_BITS * len(PREFIX_LEVELS)


def prefix_key(token_ids: Sequence[int], adapter: Optional[str] = None) -> int:
    """A request's place in the prefix order as one signed 64-bit number, cheap for Spark to sort on: its LoRA
    adapter (16 bits; 0 for the base model), then 12 bits of a hash of each of its first 16, 64, 256 and 1024 prompt
    tokens. Sorted by this key, an adapter's requests are consecutive, and within them the requests sharing their
    first 16 tokens, within those the ones sharing 64, and so on. Unrelated requests can only interleave by a hash
    collision at every level up to where they differ."""
    key = 1 + zlib.crc32(adapter.encode("utf-8")) % ((1 << _ADAPTER_BITS) - 1) if adapter else 0
    crc, done = 0, 0
    for level in PREFIX_LEVELS:
        if done < len(token_ids):
            crc = zlib.crc32(array("q", token_ids[done:level]).tobytes(), crc)
            done = level
        key = (key << _LEVEL_BITS) | (crc & ((1 << _LEVEL_BITS) - 1))
    return key - (1 << 64) if key >= 1 << 63 else key


@dataclass
class PartitionPlan:
    """What the partitioner decided; recorded in batch.json (except the boundary keys)."""

    num_partitions: int
    task_slots: int                #: inference tasks that run at once
    total_estimated_tokens: int
    target_tokens_per_partition: int
    tokens_per_partition: list[int] = field(default_factory=list)
    requests_per_partition: list[int] = field(default_factory=list)
    #: the columns of the cost line's order (unique together) and, per planned partition, the values of its first
    #: request (None: an empty partition)
    order: tuple[str, ...] = ("id",)
    starts: list[Optional[tuple]] = field(default_factory=list, repr=False)
    engines: int = 0               #: engines those tasks feed (0: one per task)

    @property
    def balance_ratio(self) -> float:
        """max / mean estimated tokens over the partitions (1.0 is perfect)."""
        if not self.tokens_per_partition or not sum(self.tokens_per_partition):
            return 1.0
        mean = sum(self.tokens_per_partition) / len(self.tokens_per_partition)
        return max(self.tokens_per_partition) / mean

    def as_dict(self) -> dict[str, Any]:
        return {"num_partitions": self.num_partitions, "task_slots": self.task_slots,
                "engines": self.engines or self.task_slots,
                "total_estimated_tokens": self.total_estimated_tokens,
                "target_tokens_per_partition": self.target_tokens_per_partition,
                "tokens_per_partition": self.tokens_per_partition,
                "requests_per_partition": self.requests_per_partition,
                "balance_ratio": round(self.balance_ratio, 4)}


#: The engine batch the planner assumes where ``max_num_seqs`` is left to vLLM: its smallest default on GPUs of
#: 40 GB and more and on CPUs (H100/H200 get 1024), so "every request runs at once" is never claimed wrongly.
DEFAULT_ENGINE_BATCH = 256


@dataclass(frozen=True)
class PlanTarget:
    """What a partition plan aims at: ``target_tokens`` estimated tokens a partition, for ``slots`` inference tasks
    at once that feed ``engines`` engines of up to ``engine_batch`` requests each at once (:func:`num_partitions`)."""

    target_tokens: int
    slots: int
    engines: int = 0
    engine_batch: int = 0

    def partitions(self, total_tokens: int, requests: int = 0) -> int:
        return num_partitions(total_tokens, self.target_tokens, self.slots, requests=requests, engines=self.engines,
                              engine_batch=self.engine_batch)


def plan_settings(cfg: Any, layout: Any) -> PlanTarget:
    """What the planners take from a model's settings (a :class:`~spark_llm.config.BatchConfig`) and its
    :class:`~spark_llm.engine_host.placement.EngineLayout`, for the run's waves and ``spark-llm plan`` alike."""
    return PlanTarget(target_tokens=cfg.target_tokens_per_partition, slots=layout.tasks, engines=layout.engines,
                      engine_batch=cfg.max_num_seqs or DEFAULT_ENGINE_BATCH)


def num_partitions(total_tokens: int, target_tokens: int, slots: int, *, requests: int = 0, engines: int = 0,
                   engine_batch: int = 0) -> int:
    """Partitions for ``total_tokens``: ceil(total / target), at least ``slots``, rounded up to a multiple of it.

    ``slots`` tasks feed ``engines`` engines, several to an engine so that the next partition's requests fill the
    engine while one partition drains (its last answers decoding at an ever smaller batch). When the engines run all
    ``requests`` at once (at most ``engine_batch``, vLLM's ``max_num_seqs``, per engine), nothing drains before the
    batch's own end: one partition per engine then, unless the target asks for more, and the tasks the other feeds
    would take (a Python worker each, on the engines' cores) are not started: a 15-line run on one engine takes
    0.92 of the time with one partition as with two."""
    slots = max(1, slots)
    if engines and engine_batch and 0 < requests <= engines * engine_batch:
        slots = min(slots, engines)
    wanted = max(1, math.ceil(total_tokens / max(1, target_tokens)))
    return max(slots, math.ceil(wanted / slots) * slots)


def _partition_sums(df: DataFrame) -> tuple[dict[int, int], int]:
    """Estimated tokens per Spark partition of ``df``, and its rows."""
    rows = (df.groupBy(F.spark_partition_id().alias("pid"))
            .agg(F.sum("est_tokens").alias("t"), F.count(F.lit(1)).alias("n")).collect())
    return {int(r["pid"]): int(r["t"] or 0) for r in rows}, sum(int(r["n"]) for r in rows)


def _task_segments(batches: Iterator, order: tuple[str, ...], offsets: dict[int, int], per_part: float,
                   parts: int) -> Iterator:
    """mapInArrow body over the ordered cost line, one piece of it per task: :func:`_segments` from where the
    task's piece starts (``offsets``: the cost before each shuffle partition)."""
    from pyspark import TaskContext

    pid = TaskContext.get().partitionId()
    return _segments(batches, order, offsets.get(pid, 0), per_part, parts, pid)


def _segments(batches: Iterator, order: tuple[str, ...], start: int, per_part: float, parts: int,
              pid: int) -> Iterator:
    """Over a piece of the ordered cost line starting at cost ``start``: each request's planned partition from the
    middle of its range, and per (Arrow batch, planned partition) one row: the first request's order values, tokens
    and requests (``_pid``: the piece)."""
    import numpy as np
    import pyarrow as pa

    for seq, batch in enumerate(batches):
        if not batch.num_rows:
            continue
        cost = batch.column("est_tokens").fill_null(0).to_numpy().astype("int64")
        mid = start + np.cumsum(cost) - cost / 2.0
        part = np.minimum(mid // per_part, parts - 1).astype("int32")  # non-decreasing along the line
        start += int(cost.sum())
        firsts = np.flatnonzero(np.r_[True, part[1:] != part[:-1]])
        ends = np.r_[firsts[1:], len(part)]
        yield pa.RecordBatch.from_arrays(
            [pa.array(part[firsts], pa.int32()), pa.array(np.full(len(firsts), pid), pa.int32()),
             pa.array(np.full(len(firsts), seq), pa.int64()),
             *[batch.column(c).take(pa.array(firsts)) for c in order],
             pa.array(np.add.reduceat(cost, firsts), pa.int64()), pa.array(ends - firsts, pa.int64())],
            names=[PART_COL, "_pid", "_seq", *order, "_tokens", "_requests"])


def spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of a bigint (Murmur3 x86 32-bit, seed 42, over the value's low then high 32 bits): what
    its hash partitioner computes for a one-column long key, as a signed 32-bit int."""
    def mix_k1(k: int) -> int:
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        return (k * 0x1B873593) & 0xFFFFFFFF

    def mix_h1(h: int, k: int) -> int:
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        return (h * 5 + 0xE6546B64) & 0xFFFFFFFF

    h = mix_h1(mix_h1(seed & 0xFFFFFFFF, mix_k1(value & 0xFFFFFFFF)), mix_k1((value >> 32) & 0xFFFFFFFF))
    h ^= 8  # the input's length in bytes
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h - (1 << 32) if h & 0x80000000 else h


@functools.lru_cache(maxsize=None)
def slot_keys(parts: int) -> tuple[int, ...]:
    """For each slot 0..parts-1, the smallest key that Spark's hash partitioner over ``parts`` partitions sends
    there (``pmod(hash(key), parts)``), computed here: no Spark job, once per wave size."""
    keys: dict[int, int] = {}
    key = 0
    while len(keys) < parts:
        keys.setdefault(spark_hash_long(key) % parts, key)  # Python's % of a positive modulus is pmod
        key += 1
    return tuple(keys[slot] for slot in range(parts))


def plan_partitions(df: DataFrame, target: PlanTarget, *, order_col: str = "id",
                    prefix_aware: bool = True) -> PartitionPlan:
    """Plan partitions of the valid requests ``df`` (with ``est_tokens``) for ``target`` so that estimated tokens
    are balanced:
    consecutive ranges of the cumulative estimated cost, in the order of ``order_col`` (unique, never null). With
    ``prefix_aware`` (and a :data:`PREFIX_COL` column) the order is by :func:`prefix_key` first, so an adapter's
    requests and requests sharing a prefix are consecutive and land in one partition (two when they straddle a
    boundary, more when they outweigh one) instead of in every one.

    The plan holds the order values where each partition starts, so :func:`assign` selects the same requests every
    time ``df`` is computed, whichever way Spark splits it. ``df`` is read again by every wave: pass a persisted
    frame."""
    order = _plan_order(df.columns, order_col, prefix_aware)
    shuffle_parts = int(df.sparkSession.conf.get("spark.sql.shuffle.partitions") or 200)
    # a range shuffle of three narrow columns (one dominant prefix still spreads over many tasks, split by id);
    # persisted so that the sums and the segments see the same split
    line = df.select(*_order_columns(order), F.col("est_tokens").cast("long").alias("est_tokens"))
    line = line.repartitionByRange(shuffle_parts, *order).sortWithinPartitions(*order) \
        .persist(StorageLevel.MEMORY_AND_DISK)
    try:
        sums, requests = _partition_sums(line)
        total = sum(sums.values())
        parts = target.partitions(total, requests)
        offsets, running = {}, 0
        for pid in sorted(sums):
            offsets[pid] = running
            running += sums[pid]
        per_part = max(total / parts, 1.0)
        schema = T.StructType([T.StructField(PART_COL, T.IntegerType()), T.StructField("_pid", T.IntegerType()),
                               T.StructField("_seq", T.LongType()),
                               *[line.schema[c] for c in order],
                               T.StructField("_tokens", T.LongType()), T.StructField("_requests", T.LongType())])
        segments = line.mapInArrow(lambda it: _task_segments(it, order, offsets, per_part, parts), schema) \
            .collect()  # a row per shuffle partition and planned partition: metadata
    finally:
        line.unpersist()
    return _plan(segments, order, parts, total, target)


def plan_in_process(table: Any, target: PlanTarget, *, order_col: str = "id",
                    prefix_aware: bool = True) -> PartitionPlan:
    """:func:`plan_partitions` of requests whose plan columns this process holds (an Arrow table with
    ``est_tokens``, the order columns and, if prefix-aware, :data:`PREFIX_COL`: a small input prepared in the
    driver, whose lines passed through it anyway): the same cost line, cut the same way, without a Spark job."""
    import pyarrow as pa
    import pyarrow.compute as pc

    order = _plan_order(table.column_names, order_col, prefix_aware)
    line = pa.table({**{c: table[c].fill_null(0) if c == PREFIX_COL else table[c] for c in order},
                     "est_tokens": table["est_tokens"].cast(pa.int64())})
    line = line.sort_by([(c, "ascending") for c in order])
    total = int(pc.sum(line["est_tokens"]).as_py() or 0)
    parts = target.partitions(total, line.num_rows)
    segments = [row for batch in _segments(line.to_batches(), order, 0, max(total / parts, 1.0), parts, 0)
                for row in batch.to_pylist()]
    return _plan(segments, order, parts, total, target)


def _plan_order(columns: Sequence[str], order_col: str, prefix_aware: bool) -> tuple[str, ...]:
    """The columns of the cost line's order."""
    if order_col not in columns:
        raise ValueError(f"plan_partitions orders requests by {order_col!r}, a column the frame does not have")
    return (PREFIX_COL, order_col) if prefix_aware and PREFIX_COL in columns else (order_col,)


def _plan(segments: Sequence[Any], order: tuple[str, ...], parts: int, total: int,
          target: PlanTarget) -> PartitionPlan:
    """The plan from the cost line's segments (rows of :func:`_segments`)."""
    slots = target.slots
    plan = PartitionPlan(num_partitions=parts, task_slots=slots, engines=target.engines, total_estimated_tokens=total,
                         target_tokens_per_partition=target.target_tokens, order=order,
                         tokens_per_partition=[0] * parts, requests_per_partition=[0] * parts,
                         starts=[None] * parts)
    first: dict[int, tuple] = {}
    for seg in segments:
        k = seg[PART_COL]
        plan.tokens_per_partition[k] += int(seg["_tokens"])
        plan.requests_per_partition[k] += int(seg["_requests"])
        if k not in first or (seg["_pid"], seg["_seq"]) < first[k]:
            first[k] = (seg["_pid"], seg["_seq"])
            plan.starts[k] = tuple(seg[c] for c in order)
    log.info("partition plan: %d partitions for %d estimated tokens (%d task slots), balance max/mean %.3f",
             parts, total, slots, plan.balance_ratio)
    return plan


def _order_columns(order: tuple[str, ...]) -> list:
    """The order columns as the plan compares them (a row without a prefix key sorts as key 0)."""
    return [F.coalesce(F.col(c), F.lit(0).cast("long")).alias(c) if c == PREFIX_COL else F.col(c) for c in order]


def _at_or_after(order: tuple[str, ...], values: tuple) -> Any:
    """``(order columns) >= values``, lexicographically."""
    cols = _order_columns(order)
    cond = cols[-1] >= F.lit(values[-1])
    for col, value in zip(reversed(cols[:-1]), reversed(values[:-1])):
        cond = (col > F.lit(value)) | ((col == F.lit(value)) & cond)
    return cond


def assign(df: DataFrame, plan: PartitionPlan, first: int = 0, count: Optional[int] = None) -> DataFrame:
    """The requests of ``df`` in planned partitions ``first .. first+count-1`` (all by default), each with its
    planned partition in ``_part``: a range of the order keys per partition."""
    count = plan.num_partitions - first if count is None else count
    starts = [(k, plan.starts[k]) for k in range(first, first + count) if plan.starts[k] is not None]
    if not starts:
        return df.where(F.lit(False)).withColumn(PART_COL, F.lit(None).cast("int"))
    after = next((s for s in plan.starts[first + count:] if s is not None), None)
    inside = _at_or_after(plan.order, starts[0][1])
    if after is not None:
        inside = inside & ~_at_or_after(plan.order, after)
    part = F.lit(starts[0][0])
    for k, values in starts[1:]:
        part = F.when(_at_or_after(plan.order, values), F.lit(k)).otherwise(part)
    return df.where(inside).withColumn(PART_COL, part.cast("int"))


def materialize(df: DataFrame, plan: PartitionPlan, first: int, count: int) -> DataFrame:
    """Planned partitions ``first .. first+count-1`` of ``df`` as exactly ``count`` Spark partitions, one planned
    partition each, rows sharing a prompt prefix adjacent (vLLM prefix caching), longer prompts first."""
    # each planned partition's key for Spark's hash partitioner, a literal map: no join, no broadcast job
    keys = F.create_map(*[F.lit(v) for slot, key in enumerate(slot_keys(count)) for v in (first + slot, key)])
    keyed = assign(df, plan, first, count).withColumn("_key", keys[F.col(PART_COL)].cast("long"))
    order = [F.col("prompt_tokens").desc()]
    if PREFIX_COL in df.columns:
        order.insert(0, F.col(PREFIX_COL))
    return keyed.repartition(count, "_key").sortWithinPartitions(*order).drop("_key")


def balance(df: DataFrame, *, target_tokens: int, slots: int,
            order_col: str = "id") -> tuple[DataFrame, PartitionPlan]:
    """All planned partitions at once: :func:`plan_partitions` then :func:`materialize`."""
    plan = plan_partitions(df, PlanTarget(target_tokens, slots), order_col=order_col)
    return materialize(df, plan, 0, plan.num_partitions), plan
