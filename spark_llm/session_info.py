"""What a Spark session is, read from it or from its settings without starting one: Connect or classic, its
settings, its master's task threads. Below :mod:`~spark_llm.session` (which starts sessions), so that the modules
the session's start needs can ask too."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def is_connect(spark: SparkSession) -> bool:
    """A Spark Connect session (Databricks serverless, shared clusters, Databricks Connect, ``--remote``): no
    SparkContext, JVM or accumulators in this process."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def spark_conf(spark: SparkSession) -> dict[str, str]:
    """The session's settings, the cluster's (``spark.master``, executor resources ...) included."""
    if is_connect(spark):
        return dict(spark.conf.getAll)
    return dict(spark.sparkContext.getConf().getAll())


def is_local_master(spark_conf: Mapping[str, str]) -> bool:
    """The session runs in one process (``local``, ``local[N]``, ``local[N,F]``): its executor is on this host."""
    return re.fullmatch(r"local(\[[^\]]*\])?", spark_conf.get("spark.master", "").strip()) is not None


def local_task_threads(spark_conf: Mapping[str, str]) -> Optional[int]:
    """The task threads of a local master (``local[N]``, ``local[N,F]``, ``local[*]``: the host's cores;
    ``local``: 1), else None."""
    match = re.fullmatch(r"local(?:\[([^,\]]*)(?:,[^\]]*)?\])?", spark_conf.get("spark.master", "").strip())
    if match is None:
        return None
    threads = (match.group(1) or "1").strip()
    return os.cpu_count() or 1 if threads == "*" else int(threads) if threads.isdigit() else None


def local_parallelism(spark_conf: Mapping[str, str]) -> int:
    """The default parallelism of a local session with these settings (``SparkContext.defaultParallelism``)."""
    return int(spark_conf.get("spark.default.parallelism") or local_task_threads(spark_conf) or 1)
