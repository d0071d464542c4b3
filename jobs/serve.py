"""spark-submit entry point of the batch service: OpenAI's Files, Batches and Uploads API on a cluster's session
(its master, resources and settings from spark-submit; `spark-llm serve --master ...` starts the same service
from a shell).

    spark-submit --master yarn --deploy-mode client --packages io.delta:delta-spark_4.2_2.13:4.4.0 \
        --conf spark.executor.resource.gpu.amount=1 --conf spark.dynamicAllocation.enabled=false \
        jobs/serve.py --config conf/gpu-cluster.yaml --model /models/llama --host 0.0.0.0 --api-keys keys.txt \
        --storage s3a://bucket/service --database-url postgresql://user:password@db/spark_llm

The driver answers the API, so the deploy mode is client (or the driver's host reachable by the clients).
"""

import argparse
import sys

from spark_llm.service.server import add_serve_arguments, serve_from_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="serve.py", description="Serve OpenAI's Batch API on this Spark session "
                                     "(spark-submit).")
    add_serve_arguments(parser)
    sys.exit(serve_from_args(parser.parse_args()))
