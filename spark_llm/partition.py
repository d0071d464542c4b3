"""Token-balanced repartitioning: every inference task gets about the same estimated work.

Estimated cost of a request (``est_tokens``, from the token stage: :func:`~spark_llm.tokens.estimated_tokens`) =
prompt tokens + prompts x n x max_tokens. Rows are laid on one line of cumulative cost (hashed
into fixed partitions by id and sorted, so the order is the same every time) and cut into ``P`` equal ranges, so
each partition holds total/P tokens give or take one request. Only per-partition sums reach the driver (one row per
partition), never requests. Inside a partition, rows are sorted by their leading prompt tokens so that shared
prefixes (system prompts) run back to back and vLLM's prefix cache can reuse them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .session import default_parallelism, spark_conf

log = logging.getLogger(__name__)

PART_COL = "_part"
#: Leading prompt tokens compared to order requests: requests sharing a prefix are adjacent (vLLM's prefix cache).
_PREFIX_TOKENS = 256


@dataclass
class PartitionPlan:
    """What the partitioner decided; recorded in batch.json."""

    num_partitions: int
    task_slots: int
    total_estimated_tokens: int
    target_tokens_per_partition: int
    tokens_per_partition: list[int] = field(default_factory=list)
    requests_per_partition: list[int] = field(default_factory=list)
    persisted: list = field(default_factory=list, repr=False)  # frames to unpersist when the plan is done

    def release(self) -> None:
        for df in reversed(self.persisted):
            df.unpersist()
        self.persisted = []

    @property
    def balance_ratio(self) -> float:
        """max / mean estimated tokens over the partitions (1.0 is perfect)."""
        if not self.tokens_per_partition or not sum(self.tokens_per_partition):
            return 1.0
        mean = sum(self.tokens_per_partition) / len(self.tokens_per_partition)
        return max(self.tokens_per_partition) / mean

    def as_dict(self) -> dict[str, Any]:
        return {"num_partitions": self.num_partitions, "task_slots": self.task_slots,
                "total_estimated_tokens": self.total_estimated_tokens,
                "target_tokens_per_partition": self.target_tokens_per_partition,
                "tokens_per_partition": self.tokens_per_partition,
                "requests_per_partition": self.requests_per_partition,
                "balance_ratio": round(self.balance_ratio, 4)}


def num_partitions(total_tokens: int, target: int, slots: int) -> int:
    """Partitions for ``total_tokens``: ceil(total / target), at least ``slots``, rounded up to a multiple of it."""
    slots = max(1, slots)
    wanted = max(1, math.ceil(total_tokens / max(1, target)))
    return max(slots, math.ceil(wanted / slots) * slots)


def task_slots(spark: SparkSession, configured: Optional[int] = None, tensor_parallel_size: int = 1) -> int:
    """Inference tasks that can run at once: GPU engines when Spark schedules GPUs (the inference stage asks for
    ``tensor_parallel_size`` GPUs per task), else the default parallelism."""
    if configured:
        return configured
    conf = spark_conf(spark)
    task_gpus = float(conf.get("spark.task.resource.gpu.amount", "0") or 0) or tensor_parallel_size
    exec_gpus = float(conf.get("spark.executor.resource.gpu.amount", "0") or 0)
    executors = int(conf.get("spark.executor.instances", "0") or 0) or int(
        conf.get("spark.dynamicAllocation.maxExecutors", "0") or 0)
    if task_gpus > 0 and exec_gpus > 0 and executors > 0:
        return max(1, executors * int(exec_gpus // task_gpus))
    return max(1, default_parallelism(spark))


def _partition_sums(df: DataFrame) -> dict[int, int]:
    rows = (df.groupBy(F.spark_partition_id().alias("pid")).agg(F.sum("est_tokens").alias("t")).collect())
    return {int(r["pid"]): int(r["t"] or 0) for r in rows}


def _assign(batches: Iterator, offsets: dict[int, int], per_part: float, parts: int) -> Iterator:
    from pyspark import TaskContext

    pid = TaskContext.get().partitionId()
    start = offsets.get(pid, 0)
    for pdf in batches:
        cost = pdf["est_tokens"].astype("int64")
        before = start + cost.cumsum() - cost
        mid = before + cost / 2.0
        pdf[PART_COL] = (mid // per_part).clip(upper=parts - 1).astype("int32")
        start += int(cost.sum())
        yield pdf


#: parts -> for each slot 0..parts-1, a key that Spark's hash partitioner sends there. Spark's hash function is fixed,
#: so this holds for every session of the process: computed once per wave size, not once per wave.
_SLOT_KEYS: dict[int, list[int]] = {}


def _slot_keys(spark: SparkSession, parts: int) -> list[int]:
    if parts not in _SLOT_KEYS:
        search = parts * 64
        while True:
            keys = (spark.range(search).select(F.col("id").alias("_key"),
                                               F.expr(f"pmod(hash(id), {parts})").cast("int").alias("_slot"))
                    .groupBy("_slot").agg(F.min("_key").alias("_key")))
            found = {int(r["_slot"]): int(r["_key"]) for r in keys.collect()}  # `parts` rows of metadata
            if len(found) == parts:
                _SLOT_KEYS[parts] = [found[slot] for slot in range(parts)]
                break
            search *= 4
    return _SLOT_KEYS[parts]


def _hash_keys(spark: SparkSession, parts: int, first: int = 0) -> DataFrame:
    """For planned partitions ``first .. first+parts-1``: a key that Spark's hash partitioner (over ``parts``
    partitions) sends to exactly slot ``_part - first``."""
    return spark.createDataFrame([(first + slot, key) for slot, key in enumerate(_slot_keys(spark, parts))],
                                 T.StructType([T.StructField(PART_COL, T.IntegerType()),
                                               T.StructField("_key", T.LongType())]))


def plan_partitions(df: DataFrame, *, target_tokens: int, slots: int, order_col: str = "id",
                    prefix_aware: bool = True) -> tuple[DataFrame, PartitionPlan]:
    """Assign each valid request (with ``est_tokens``) a planned partition ``_part`` so that estimated tokens are
    balanced: consecutive ranges of the cumulative estimated cost. With ``prefix_aware``, requests are ordered by
    their LoRA adapter, then their first :data:`_PREFIX_TOKENS` prompt tokens, so an adapter's requests and requests
    sharing a prefix are consecutive and land in one partition (two when they straddle a boundary, more when they
    outweigh one) instead of in every one. ``order_col`` must identify rows uniquely; which rows form a partition of
    ``df`` must not change between computations (true of persisted frames and of shuffles by key). The returned
    frame is persisted: call ``plan.release()`` when done."""
    # The assignment must come out the same each time it is computed: rows go to a fixed number of partitions (so
    # AQE cannot regroup them) and are sorted inside each, ties broken by the unique id; the result is persisted.
    # Prefix-aware: range-partitioned by (adapter, prefix, id), a global order in which one dominant prefix still spreads
    # over many tasks; plain: hashed by the id.
    if order_col in df.columns:
        shuffle_parts = int(df.sparkSession.conf.get("spark.sql.shuffle.partitions") or 200)
        if prefix_aware and "prompt_token_ids" in df.columns:
            keys = [F.slice(F.col("prompt_token_ids")[0], 1, _PREFIX_TOKENS), F.col(order_col)]
            if "options_json" in df.columns:  # a LoRA adapter's requests together, then by prefix
                keys.insert(0, F.coalesce(F.get_json_object("options_json", "$.adapter"), F.lit("")))
            df = df.repartitionByRange(shuffle_parts, *keys).sortWithinPartitions(*keys)
        else:
            df = df.repartition(shuffle_parts, order_col).sortWithinPartitions(order_col)
    ordered = df.persist(StorageLevel.MEMORY_AND_DISK)
    sums = _partition_sums(ordered)
    total = sum(sums.values())
    parts = num_partitions(total, target_tokens, slots)
    offsets, running = {}, 0
    for pid in sorted(sums):
        offsets[pid] = running
        running += sums[pid]
    per_part = max(total / parts, 1.0)
    schema = T.StructType(df.schema.fields + [T.StructField(PART_COL, T.IntegerType())])
    assigned = ordered.mapInPandas(lambda it: _assign(it, offsets, per_part, parts), schema) \
        .persist(StorageLevel.MEMORY_AND_DISK)
    plan = PartitionPlan(num_partitions=parts, task_slots=slots, total_estimated_tokens=total,
                         target_tokens_per_partition=target_tokens, persisted=[ordered, assigned])
    stats = {int(r[PART_COL]): (int(r["t"]), int(r["c"])) for r in
             assigned.groupBy(PART_COL).agg(F.sum("est_tokens").alias("t"), F.count(F.lit(1)).alias("c")).collect()}
    plan.tokens_per_partition = [stats.get(i, (0, 0))[0] for i in range(parts)]
    plan.requests_per_partition = [stats.get(i, (0, 0))[1] for i in range(parts)]
    log.info("partition plan: %d partitions for %d estimated tokens (%d task slots), balance max/mean %.3f",
             parts, total, slots, plan.balance_ratio)
    return assigned, plan


def materialize(assigned: DataFrame, first: int, count: int) -> DataFrame:
    """Planned partitions ``first .. first+count-1`` as exactly ``count`` Spark partitions, one planned partition
    each, rows sharing a prompt prefix adjacent (vLLM prefix caching), longer prompts first."""
    spark = assigned.sparkSession
    wave = assigned.where(F.col(PART_COL).between(first, first + count - 1))
    keyed = wave.join(F.broadcast(_hash_keys(spark, count, first)), PART_COL)
    return (keyed.repartition(count, "_key")
            .sortWithinPartitions(F.slice(F.col("prompt_token_ids")[0], 1, _PREFIX_TOKENS),
                                  F.col("prompt_tokens").desc())
            .drop("_key"))


def balance(df: DataFrame, *, target_tokens: int, slots: int,
            order_col: str = "id") -> tuple[DataFrame, PartitionPlan]:
    """All planned partitions at once: :func:`plan_partitions` then :func:`materialize`."""
    assigned, plan = plan_partitions(df, target_tokens=target_tokens, slots=slots, order_col=order_col)
    return materialize(assigned, 0, plan.num_partitions), plan
