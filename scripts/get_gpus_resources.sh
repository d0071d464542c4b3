#!/usr/bin/env bash
# Spark GPU discovery script (spark.executor.resource.gpu.discoveryScript / spark.driver.resource.gpu.discoveryScript).
# Prints the GPUs of this node in the JSON form Spark expects: {"name": "gpu", "addresses": ["0","1",...]}.
# Ship it to every node (e.g. spark-submit --files scripts/get_gpus_resources.sh) and make it executable.
set -euo pipefail
addrs=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, - | sed 's/,/","/g')
if [[ -z "$addrs" ]]; then
  echo '{"name": "gpu", "addresses": []}'
else
  echo "{\"name\": \"gpu\", \"addresses\": [\"$addrs\"]}"
fi
