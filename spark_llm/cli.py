"""``spark-llm`` command line: ``spark-llm run ...`` (also what ``jobs/run_batch.py`` calls under spark-submit)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from .config import BatchConfig, ConfigError, spark_conf_from_yaml

log = logging.getLogger("spark_llm")

# flag -> (config field, type, help); help text is the config field's description.
_FLAGS: list[tuple[str, str, type]] = [
    ("--input", "input", str),
    ("--output-dir", "output_dir", str),
    ("--model", "model", str),
    ("--served-model-name", "served_model_name", str),
    ("--batch-id", "batch_id", str),
    ("--tokenizer", "tokenizer", str),
    ("--tensor-parallel-size", "tensor_parallel_size", int),
    ("--max-model-len", "max_model_len", int),
    ("--max-num-seqs", "max_num_seqs", int),
    ("--dtype", "dtype", str),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float),
    ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", int),
    ("--seed", "seed", int),
    ("--default-max-tokens", "default_max_tokens", int),
    ("--default-temperature", "default_temperature", float),
    ("--target-tokens-per-partition", "target_tokens_per_partition", int),
    ("--num-task-slots", "num_task_slots", int),
    ("--context-overflow", "context_overflow", str),
    ("--max-line-bytes", "max_line_bytes", int),
    ("--max-requests", "max_requests", int),
    ("--wave-partitions", "wave_partitions", int),
    ("--output-table-prefix", "output_table_prefix", str),
    ("--input-table", "input_table", str),
    ("--id-column", "id_column", str),
    ("--body-column", "body_column", str),
    ("--prompt-column", "prompt_column", str),
    ("--messages-column", "messages_column", str),
    ("--system-prompt", "system_prompt", str),
    ("--system-prompt-column", "system_prompt_column", str),
    ("--max-tokens-column", "max_tokens_column", str),
    ("--temperature-column", "temperature_column", str),
    ("--table-endpoint", "table_endpoint", str),
]
_SWITCHES = ("overwrite", "enforce_eager", "resume", "retry_errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spark-llm", description="Offline LLM batch inference on Spark with vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one batch: OpenAI batch JSONL in, Delta tables + OpenAI JSONL out",
                         description="Run one batch. Settings: defaults < --config YAML < environment "
                                     "(MODEL_PATH, ...) < flags.")
    add_run_arguments(run)
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    fields = BatchConfig.model_fields
    parser.add_argument("--config", help="YAML file with settings (see conf/); flags override it")
    for flag, field, typ in _FLAGS:
        parser.add_argument(flag, dest=field, type=typ, default=None, help=fields[field].description)
    parser.add_argument("--batch-size", dest="max_num_seqs", type=int, default=None,
                        help="alias of --max-num-seqs (the design's BATCH_SIZE)")
    for field in _SWITCHES:
        parser.add_argument("--" + field.replace("_", "-"), dest=field, action="store_true", default=None,
                            help=fields[field].description)
    parser.add_argument("--master", default=None,
                        help="Spark master when spark-llm starts its own session (default local[2]); ignored "
                             "under spark-submit or in a notebook, where the active session is used")
    parser.add_argument("--log-level", default="INFO", help="log level of spark_llm's own loggers")


def run_from_args(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {field: getattr(args, field) for _, field, _ in _FLAGS}
    overrides.update({field: getattr(args, field) for field in _SWITCHES})
    try:
        config = BatchConfig.load(args.config, **overrides)
        config.require_ready()
        spark_conf = spark_conf_from_yaml(args.config)
    except ConfigError as exc:
        print(f"spark-llm: error: {exc}", file=sys.stderr)
        return 2

    from .errors import EngineStartError
    from .pipeline import run_batch
    from .session import get_session

    spark = get_session(master=args.master, conf=spark_conf)
    try:
        result = run_batch(spark, config)
    except ConfigError as exc:
        print(f"spark-llm: error: {exc}", file=sys.stderr)
        return 2
    except EngineStartError as exc:
        print(f"spark-llm: the inference engine could not start: {exc}", file=sys.stderr)
        return 3
    print(result.summary())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return run_from_args(args)
    return 2  # pragma: no cover - argparse enforces the sub-command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
