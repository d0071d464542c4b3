#!/usr/bin/env bash
# Spark GPU discovery script (spark.executor.resource.gpu.discoveryScript / spark.worker.resource.gpu.discoveryScript).
# Prints the GPUs of this node in the JSON form Spark expects: {"name": "gpu", "addresses": ["0","1",...]}, numbered in
# PCI bus order (the order CUDA_VISIBLE_DEVICES uses with CUDA_DEVICE_ORDER=PCI_BUS_ID). A node without nvidia-smi
# reports no GPUs instead of failing. Ship it to every node (spark-submit --files) and make it executable.
set -uo pipefail
export CUDA_DEVICE_ORDER=PCI_BUS_ID
addrs=""
if command -v nvidia-smi >/dev/null 2>&1; then
  addrs=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, - | sed 's/,/","/g')
fi
if [[ -z "$addrs" ]]; then
  echo '{"name": "gpu", "addresses": []}'
else
  echo "{\"name\": \"gpu\", \"addresses\": [\"$addrs\"]}"
fi
