"""Token-balanced repartitioning on skewed input: partitions carry about equal estimated tokens."""

from __future__ import annotations

import random

from pyspark import StorageLevel
from pyspark.sql import functions as F

from spark_llm.partition import (PART_COL, PlanTarget, assign, balance, materialize, num_partitions, plan_partitions,
                                 prefix_key, slot_keys, spark_hash_long)
from spark_llm.tokens import estimated_tokens


def test_num_partitions_rounds_to_task_slots():
    assert num_partitions(0, 100, 4) == 4
    assert num_partitions(1000, 100, 4) == 12
    assert num_partitions(1200, 100, 4) == 12
    assert num_partitions(1201, 100, 4) == 16
    assert num_partitions(50, 100, 1) == 1


def test_a_batch_the_engines_run_all_at_once_gets_one_partition_per_engine_not_per_feed():
    # four tasks feed two engines that run 8 requests each at once
    assert num_partitions(500, 10_000, 4, requests=16, engines=2, engine_batch=8) == 2
    assert num_partitions(500, 10_000, 4, requests=17, engines=2, engine_batch=8) == 4  # one must wait: a feed each
    assert num_partitions(500, 100, 4, requests=16, engines=2, engine_batch=8) == 6  # the target asks for more
    assert num_partitions(500, 10_000, 4, requests=16) == 4  # engines or their batch unknown: a partition per task
    assert num_partitions(500, 10_000, 1, requests=3, engines=1, engine_batch=8) == 1


def test_both_planners_give_a_small_batch_one_partition_per_engine(spark):
    import pyarrow as pa

    from spark_llm.partition import plan_in_process

    rows = [(i, 10 + i) for i in range(12)]
    how = dict(target_tokens=10_000, slots=4, engines=2)
    table = pa.table({"id": [r[0] for r in rows], "est_tokens": [r[1] for r in rows]})
    df = spark.createDataFrame(rows, "id long, est_tokens long")
    for engine_batch, parts in ((8, 2), (4, 4)):  # 12 requests: all at once in two engines of 8, not of 4
        here = plan_in_process(table, PlanTarget(engine_batch=engine_batch, **how), prefix_aware=False)
        by_spark = plan_partitions(df, PlanTarget(engine_batch=engine_batch, **how), prefix_aware=False)
        assert here.num_partitions == by_spark.num_partitions == parts
        assert sum(here.requests_per_partition) == sum(by_spark.requests_per_partition) == 12


def skewed_requests(spark, n=3000, seed=7):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        # log-normal prompt lengths, a few very long; max_tokens varied; the long ones clustered in one place
        plen = min(int(rng.lognormvariate(4.5, 1.0)), 4000) + 1
        if i < 100:
            plen = 3000
        mt = rng.choice([16, 64, 256])
        rows.append((f"r{i}", [[rng.randrange(50) for _ in range(3)]], plen, mt,
                     estimated_tokens(plen, 1, {"n": 2} if i % 50 == 0 else {}, mt)))
    df = spark.createDataFrame(rows, "custom_id string, prompt_token_ids array<array<int>>, prompt_tokens long, "
                                     "max_tokens long, est_tokens long")
    return df.repartition(3).persist(StorageLevel.MEMORY_AND_DISK)


def test_balance_evens_out_estimated_tokens(spark):
    df = skewed_requests(spark)
    try:
        total = df.agg(F.sum("est_tokens")).first()[0]
        out, plan = balance(df, target_tokens=total // 7, slots=4, order_col="custom_id")
        assert plan.num_partitions == 8 and out.rdd.getNumPartitions() == 8
        assert out.where(F.spark_partition_id() != F.col(PART_COL)).count() == 0  # planned k is Spark's k
        wave = materialize(df, plan, 2, 3)  # a wave's three: planned 2, 3, 4 as Spark's 0, 1, 2
        assert wave.rdd.getNumPartitions() == 3
        assert wave.where(F.spark_partition_id() + 2 != F.col(PART_COL)).count() == 0
        assert wave.count() == sum(plan.requests_per_partition[2:5])
        assert plan.total_estimated_tokens == total
        per_task = (out.groupBy(F.spark_partition_id().alias("p")).agg(F.sum("est_tokens").alias("t"),
                                                                       F.count(F.lit(1)).alias("c"))
                    .orderBy("p").collect())
        tokens = [r["t"] for r in per_task]
        assert len(tokens) == 8 and sum(tokens) == total
        assert max(tokens) / (total / 8) < 1.05, tokens
        assert sorted(tokens) == sorted(plan.tokens_per_partition)
        assert plan.balance_ratio < 1.05
        assert out.count() == 3000 and out.select("custom_id").distinct().count() == 3000
        # plain row-count repartitioning of the same data is visibly worse
        plain = (df.repartition(8).groupBy(F.spark_partition_id()).agg(F.sum("est_tokens").alias("t")).collect())
        assert max(r["t"] for r in plain) / (total / 8) > max(tokens) / (total / 8)
    finally:
        df.unpersist()


def test_prefix_keys_order_requests_by_adapter_then_by_ever_longer_shared_prefixes():
    system = list(range(100, 400))  # a 300-token system prompt
    few_shot = system + list(range(900, 1000))
    keys = {name: prefix_key(ids, adapter) for name, ids, adapter in [
        ("q1", few_shot + [1, 2, 3], None), ("q2", few_shot + [4, 5], None), ("q3", system + [7] * 50, None),
        ("other", list(range(5000, 5300)), None), ("lora", few_shot + [1, 2, 3], "sql-lora")]}
    assert prefix_key(few_shot + [1, 2, 3]) == keys["q1"]  # the same on every worker and in every run
    assert keys["lora"] != keys["q1"]
    assert all(-(1 << 63) <= k < 1 << 63 for k in keys.values())
    level = lambda k, n: (k % (1 << 64)) >> (12 * (4 - n))  # noqa: E731  (adapter and the first n levels)
    # q1 and q2 share 400 tokens: every level up to 256 tokens; q3 shares 300 with them: also up to 256
    assert level(keys["q1"], 3) == level(keys["q2"], 3) == level(keys["q3"], 3)
    assert level(keys["q1"], 1) != level(keys["other"], 1)
    assert level(keys["lora"], 0) != level(keys["q1"], 0) and level(keys["q1"], 0) == 0
    # a prompt shorter than a level: the hash of what there is, repeated
    assert level(prefix_key([1, 2, 3]), 4) & 0xFFF == level(prefix_key([1, 2, 3]), 1) & 0xFFF


def with_prefix_keys(rows):
    """Rows of (custom_id, prompt_token_ids, ...) with the token stage's prefix key appended."""
    return [(*r, prefix_key(r[1][0])) for r in rows]


def test_rows_sharing_a_prefix_are_adjacent(spark):
    # three 32-token prefixes (two of vLLM's 16-token cache blocks), interleaved in the input
    rows = with_prefix_keys([(f"r{i}", [[100 * (i % 3) + k for k in range(32)] + [i]], 33, 10, 43)
                             for i in range(30)])
    df = spark.createDataFrame(rows, "custom_id string, prompt_token_ids array<array<int>>, prompt_tokens long, "
                                     "max_tokens long, est_tokens long, prefix_key long")
    df = df.persist()
    try:
        out, plan = balance(df, target_tokens=10_000, slots=1, order_col="custom_id")
        groups = [r["prompt_token_ids"][0][0] // 100 for r in out.collect()]
        assert sorted(groups) == [g for g in range(3) for _ in range(10)]
        assert sum(a != b for a, b in zip(groups, groups[1:])) == 2, groups  # each prefix's 10 rows in one run
        assert PART_COL in out.columns
    finally:
        df.unpersist()


def test_requests_sharing_a_prefix_share_a_partition_and_stay_balanced(spark):
    rng = random.Random(3)
    prefixes = [[1000 + 40 * g + k for k in range(40)] for g in range(8)]  # 8 system prompts of 40 tokens
    rows = []
    for i in range(800):
        g = rng.randrange(8)
        extra = rng.randint(1, 20)
        rows.append((f"r{i}", [prefixes[g] + [rng.randrange(50) for _ in range(extra)]], g, 40 + extra, 16,
                     40 + extra + 16))
    df = spark.createDataFrame(with_prefix_keys(rows), "custom_id string, prompt_token_ids array<array<int>>, "
                               "g int, prompt_tokens long, max_tokens long, est_tokens long, prefix_key long")
    df = df.persist()
    try:
        spread, total = {}, df.agg(F.sum("est_tokens")).first()[0]
        for aware in (True, False):
            plan = plan_partitions(df, PlanTarget(-(-total // 8), 4), order_col="custom_id", prefix_aware=aware)
            assigned = assign(df, plan)
            parts_of = {r["g"]: r["n"] for r in assigned.groupBy("g").agg(F.countDistinct(PART_COL).alias("n"))
                        .collect()}
            spread[aware] = sum(parts_of.values()) / len(parts_of)
            assert plan.num_partitions == 8 and plan.balance_ratio < 1.05
            assert assigned.count() == 800
        # a prompt's requests sit in one partition, or two where it straddles a boundary; plain planning scatters
        # them over (nearly) every partition
        assert spread[True] <= 2.0 and spread[False] >= 6.0, spread
    finally:
        df.unpersist()


def test_a_plan_made_in_process_is_the_plan_spark_makes(spark):
    """A small input prepared in the driver is planned there (partition.plan_in_process, no Spark job): the same
    partitions, tokens, requests and boundary keys as the planning jobs make, prefix-aware or not (rows without a
    prefix key included)."""
    from spark_llm.partition import plan_in_process

    rng = random.Random(11)
    prefixes = [[2000 + 30 * g + k for k in range(30)] for g in range(6)]
    rows = []
    for i in range(700):
        ids = prefixes[rng.randrange(6)] + [rng.randrange(50)] * rng.randint(1, 40)
        rows.append((f"r{i}", [ids], len(ids), 16, rng.randint(20, 900), None if i % 9 == 0 else prefix_key(ids)))
    df = spark.createDataFrame(rows, "custom_id string, prompt_token_ids array<array<int>>, prompt_tokens long, "
                                     "max_tokens long, est_tokens long, prefix_key long").repartition(3).persist()
    try:
        table = df.select("custom_id", "prefix_key", "est_tokens").toArrow()
        total = sum(r[4] for r in rows)
        for aware, parts in ((True, 8), (False, 8), (True, 3), (False, 1)):
            target, how = PlanTarget(-(-total // parts), 2), dict(order_col="custom_id", prefix_aware=aware)
            on_spark, here = plan_partitions(df, target, **how), plan_in_process(table, target, **how)
            assert here.num_partitions == on_spark.num_partitions >= parts
            assert here.order == on_spark.order == (("prefix_key", "custom_id") if aware else ("custom_id",))
            assert here.starts == on_spark.starts and None not in here.starts
            assert here.tokens_per_partition == on_spark.tokens_per_partition
            assert here.requests_per_partition == on_spark.requests_per_partition
            assert sum(here.requests_per_partition) == 700 and here.total_estimated_tokens == total
    finally:
        df.unpersist()


def test_slot_keys_made_here_are_where_sparks_hash_partitioner_sends_them(spark):
    """materialize sends each planned partition to its own Spark partition by a key chosen in Python: the key must
    hash as Spark hashes it (negative, 32-bit edge and 64-bit values included), and land in its slot."""
    values = [*range(-300, 300), 2**31 - 1, 2**31, -2**31, 2**32 + 7, 2**63 - 1, -2**63, 123456789012345]
    hashed = spark.createDataFrame([(v,) for v in values], "v long").select("v", F.hash("v").alias("h")).collect()
    assert [spark_hash_long(r["v"]) for r in hashed] == [r["h"] for r in hashed]
    for parts in (1, 3, 8, 50):
        keys = slot_keys(parts)
        assert len(set(keys)) == parts
        landed = (spark.createDataFrame([(slot, key) for slot, key in enumerate(keys)], "slot int, key long")
                  .repartition(parts, "key").select("slot", F.spark_partition_id().alias("pid")).collect())
        assert sorted((r["slot"], r["pid"]) for r in landed) == [(s, s) for s in range(parts)]
