"""spark-submit entry point: parses the arguments and runs one batch.

    spark-submit --packages io.delta:delta-spark_4.2_2.13:4.4.0 jobs/run_batch.py \
        --input s3a://bucket/batch.jsonl --output-dir s3a://bucket/out/b1 --model /models/llama --config conf/gpu-cluster.yaml
"""

import sys

from spark_llm.cli import add_run_arguments, run_from_args

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="run_batch.py", description="Run one spark_llm batch (spark-submit).")
    add_run_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))
