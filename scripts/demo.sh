#!/usr/bin/env bash
# Set up (idempotent), build the tiny local model, and run the batch job on the bundled demo input
# (scripts/demo/requests.jsonl: ~60 requests, some in Chinese, some deliberately malformed, chat on the tiny model and
# on its LoRA adapter, embeddings on the tiny embedding model, moderations and classifications on the tiny
# classifier, scores and a rerank on the tiny cross-encoder, pictures (scripts/demo/images/ and a data: URL) on the
# tiny vision-language model, a transcription and a translation of scripts/demo/audio/ on the tiny Whisper) on local
# Spark + vLLM CPU.
# Results land in demo_output/ (replaced on every run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL_DIR=.cache/tiny-llm
.venv/bin/python scripts/make_tiny_model.py --if-stale --out "$MODEL_DIR"
[ -f .cache/tiny-lora/adapter_config.json ] || \
  .venv/bin/python scripts/make_tiny_model.py --kind lora --base "$MODEL_DIR" --out .cache/tiny-lora
.venv/bin/python scripts/make_tiny_model.py --kind embedding --base "$MODEL_DIR" --out .cache/tiny-embed
.venv/bin/python scripts/make_tiny_model.py --kind classifier --if-stale --base "$MODEL_DIR" --out .cache/tiny-moderation
.venv/bin/python scripts/make_tiny_model.py --kind cross-encoder --if-stale --base "$MODEL_DIR" --out .cache/tiny-reranker
.venv/bin/python scripts/make_tiny_model.py --kind vision --if-stale --out .cache/tiny-vlm
.venv/bin/python scripts/make_tiny_model.py --kind whisper --if-stale --out .cache/tiny-whisper
.venv/bin/spark-llm run --config conf/local.yaml --model "$MODEL_DIR" \
  --lora-modules tiny-lora=.cache/tiny-lora --max-lora-rank 8 --extra-model tiny-embed=.cache/tiny-embed \
  --extra-model tiny-moderation=.cache/tiny-moderation --extra-model tiny-reranker=.cache/tiny-reranker \
  --extra-model tiny-vlm=.cache/tiny-vlm --extra-model tiny-whisper=.cache/tiny-whisper \
  --input scripts/demo/requests.jsonl --output-dir demo_output --batch-id demo --overwrite "$@"
echo
echo "First output line:"; head -n 1 demo_output/output.jsonl | cut -c1-400
echo "First error line:";  head -n 1 demo_output/errors.jsonl
echo "A picture's answer:"; grep '"image-path"' demo_output/output.jsonl | cut -c1-400
echo "A moderation:";      grep '"moderate-001"' demo_output/output.jsonl | cut -c1-400
echo "A transcription:";   grep '"transcribe-001"' demo_output/output.jsonl | cut -c1-400
echo "Query the tables:   .venv/bin/python scripts/show_results.py demo_output"
