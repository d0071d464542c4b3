# Databricks notebook source
# MAGIC %md
# MAGIC # Offline batch inference with spark_llm
# MAGIC
# MAGIC An OpenAI Batch API file (or a table) in, one vLLM engine per GPU of the cluster, Delta tables and OpenAI-format
# MAGIC files out. Needs a GPU cluster (ML runtime) with `spark.task.resource.gpu.amount` **unset** in the cluster's
# MAGIC Spark config (spark_llm asks for GPUs on the inference stage only; see `conf/databricks.yaml`), and the model in
# MAGIC a Unity Catalog Volume every node can read. The notebook's `spark` may be a classic session (dedicated access
# MAGIC mode) or a Spark Connect one (standard access mode, serverless, Databricks Connect): `run_batch` takes either.

# COMMAND ----------

# MAGIC %pip install "spark-llm-batch[vllm]"
# MAGIC # or a wheel built with `python -m build`, put in a Volume:
# MAGIC # %pip install /Volumes/main/default/wheels/spark_llm_batch-0.1.0-py3-none-any.whl "vllm>=0.17,<0.33"

# COMMAND ----------

dbutils.library.restartPython()  # noqa: F821 - Databricks notebook globals

# COMMAND ----------

from spark_llm import BatchConfig, run_batch

cfg = BatchConfig.load(
    "/Workspace/Repos/me/spark_llm/conf/databricks.yaml",     # model, context length, batch size, ...
    input="/Volumes/main/default/batches/2026-11-30.jsonl",   # OpenAI batch lines: custom_id, method, url, body
    output_dir="/Volumes/main/default/results/2026-11-30",     # output.jsonl, errors.jsonl, batch.json, report.html
    output_table_prefix="main.llm.batch_",                    # managed tables main.llm.batch_{outputs,errors,metrics}
    batch_id="nightly-2026-11-30",
)
result = run_batch(spark, cfg)  # noqa: F821 - the notebook's SparkSession
print(result.summary())

# COMMAND ----------

# MAGIC %md Every input line is exactly one row in `outputs` or `errors`; the batch object is `batch.json`.

# COMMAND ----------

display(spark.sql("""
  SELECT code, count(*) AS n FROM main.llm.batch_errors
  WHERE batch_id = 'nightly-2026-11-30' GROUP BY code ORDER BY n DESC
"""))

# COMMAND ----------

display(spark.sql("""
  SELECT custom_id, finish_reason, prompt_tokens, completion_tokens, left(text, 80) AS answer
  FROM main.llm.batch_outputs WHERE batch_id = 'nightly-2026-11-30' ORDER BY line_number LIMIT 20
"""))

# COMMAND ----------

# MAGIC %md Where the GPU time went: one row per inference partition, with the GPU its task held and the engine
# MAGIC process that answered (one per GPU for the cluster's life).

# COMMAND ----------

display(spark.sql("""
  SELECT gpus, count(*) AS partitions, sum(rows) AS requests, round(sum(engine_seconds), 1) AS engine_seconds,
         round(sum(prompt_tokens + completion_tokens) / sum(engine_seconds)) AS tokens_per_second
  FROM main.llm.batch_metrics WHERE batch_id = 'nightly-2026-11-30' GROUP BY gpus ORDER BY gpus
"""))

# COMMAND ----------

displayHTML(open(result.batch.metadata["report_file"]).read())  # noqa: F821 - the run report with its plots
