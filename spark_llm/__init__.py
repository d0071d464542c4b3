"""spark_llm: offline LLM batch inference on Spark with vLLM.

OpenAI Batch API JSONL files in; every line validated into a request or an error row; prompts counted with the
model's tokenizer and spread over token-balanced partitions; one vLLM engine per Python worker; Delta tables plus
OpenAI-format output/error files and a batch object out.

    from spark_llm import BatchConfig, run_batch
    result = run_batch(spark, BatchConfig(model="/models/llama", input="/data/batch.jsonl", output_dir="/out/b1"))

Importing this package does not import vLLM or torch.
"""

from .config import BatchConfig, ConfigError
from .errors import EngineStartError, ErrorCode

__all__ = ["BatchConfig", "BatchPlan", "BatchResult", "ConfigError", "EngineStartError", "ErrorCode", "plan_batch",
           "run_batch", "stop_engines"]
__version__ = "0.1.0"


def run_batch(spark, config):  # noqa: D103 - documented in pipeline.run_batch
    from .pipeline import run_batch as _run

    return _run(spark, config)


run_batch.__doc__ = "Run one batch end to end; see spark_llm.pipeline.run_batch."


def plan_batch(spark, config, tokens_per_second=None):  # noqa: D103 - documented in plan.plan_batch
    from .plan import plan_batch as _plan

    return _plan(spark, config, tokens_per_second)


plan_batch.__doc__ = "Dry run of one batch (no engine, nothing written); see spark_llm.plan.plan_batch."


def stop_engines(spark=None) -> list:
    """Stop the engines that hold this host's GPUs (they otherwise stay for ``engine_idle_timeout_seconds`` after
    their last request) and, given a classic session on a cluster, those of the executors its tasks reach (one task
    per core of the cluster: best effort, an executor that runs none keeps its engines). The slots stopped."""
    from .engine_host.client import stop_engines_here

    stopped = stop_engines_here()
    if spark is not None and type(spark).__module__.startswith("pyspark.sql.session") and \
            not spark.sparkContext.master.startswith("local"):
        sc = spark.sparkContext
        tasks = sc.defaultParallelism
        stopped += sc.parallelize(range(tasks), tasks).mapPartitions(lambda _: stop_engines_here()).collect()
    return stopped


def __getattr__(name):
    if name == "BatchResult":
        from .batch import BatchResult

        return BatchResult
    if name == "BatchPlan":
        from .plan import BatchPlan

        return BatchPlan
    raise AttributeError(name)
