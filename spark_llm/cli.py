"""``spark-llm`` command line: ``spark-llm run ...`` (also what ``jobs/run_batch.py`` calls under spark-submit)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from typing import Any, Optional, Sequence

from .config import BatchConfig, ConfigError, new_batch_id, spark_conf_from_yaml
from .flags import add_run_arguments, configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spark-llm", description="Offline LLM batch inference on Spark with vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one batch: OpenAI batch JSONL in, Delta tables + OpenAI JSONL out",
                         description="Run one batch. Settings: defaults < --config YAML < environment "
                                     "(MODEL_PATH, ...) < flags.")
    add_run_arguments(run)
    plan = sub.add_parser("plan", help="dry run: read, validate and count tokens; no engine, nothing written",
                          description="Plan one batch: requests, error rows by code, prompt and maximum output "
                                      "tokens, partitions and waves, and an engine-time estimate. Loads no engine and "
                                      "writes nothing. Takes the same settings as run.")
    add_run_arguments(plan)
    plan.add_argument("--tokens-per-second", type=float, default=None,
                      help="prompt + generated tokens per second of one engine, for the time estimate (default: "
                           "measured by earlier runs in the output's metrics table, if any)")
    from .service.server import add_serve_arguments

    serve = sub.add_parser("serve", help="serve OpenAI's Files and Batches API: batches uploaded with the OpenAI SDK "
                           "run as spark-llm run runs them",
                           description="The batch service: OpenAI's Files and Batches API (point the OpenAI SDK's "
                                       "base_url at it). Every batch runs on this server's Spark session and engines "
                                       "with the model, engine and Spark settings given here.")
    add_serve_arguments(serve)
    engines = sub.add_parser("engines", help="this host's engine processes: list them, or stop them to free the GPUs",
                             description="The engines of this host's engine directory (SPARK_LLM_ENGINE_DIR). An "
                                         "engine stays for engine_idle_timeout_seconds after its last request; stop "
                                         "frees its GPUs now. In a notebook: spark_llm.stop_engines(spark).")
    engines.add_argument("action", choices=["list", "stop"])
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """``spark-llm run`` and ``spark-llm plan``: exit 0 done, 2 bad settings, 3 the engine could not start or the
    batch failed at run time (a Spark job failed for good)."""
    from .session import get_session

    configure_logging(args.log_level)
    planning = getattr(args, "command", "run") == "plan"
    try:
        config, spark_conf = _settings(args, planning)
        if planning and _plans_locally(args, config):
            from .plan import plan_local

            print(plan_local(config, args.master, args.tokens_per_second, spark_conf).summary())
            return 0
    except ConfigError as exc:
        print(f"spark-llm: error: {exc}", file=sys.stderr)
        return 2
    if not planning:
        _before_session(args, config, spark_conf)
    spark = get_session(master=args.master, conf=spark_conf, remote=args.remote)
    try:
        if planning:
            from .plan import plan_batch

            print(plan_batch(spark, config, args.tokens_per_second).summary())
            return 0
        from .pipeline import run_batch

        result = run_batch(spark, config)
    except (Exception, KeyboardInterrupt) as exc:
        return _stopped(exc, spark, config)
    print(result.summary())
    return 0


def _settings(args: argparse.Namespace, planning: bool) -> tuple[BatchConfig, dict[str, str]]:
    """The batch's settings (the file's, under the command line's) and the Spark settings of the file."""
    overrides = {field: getattr(args, field) for field in BatchConfig.model_fields}
    config = BatchConfig.load(args.config, **overrides)
    if not planning:
        config.require_ready()
    return config, spark_conf_from_yaml(args.config)


def _before_session(args: argparse.Namespace, config: BatchConfig, spark_conf: dict[str, str]) -> None:
    """Name the batch (so that an interrupted run can say what to resume) and, for a ``local[N]`` session, start
    its engines loading and the tokenizers of an input prepared here while the session starts."""
    from .prepare import preload_tokenizers
    from .session import local_session_conf
    from .session_info import local_task_threads
    from .warmup import start_before_session

    if not config.batch_id:
        config.batch_id = new_batch_id()
    if start_before_session(config, spark_conf, args.master, args.remote):
        preload_tokenizers(config, local_task_threads(local_session_conf(args.master, spark_conf)) or 1)


def _stopped(exc: BaseException, spark: Any, config: BatchConfig) -> int:
    """What the command prints and exits with for the error that stopped the run."""
    from .errors import EngineStartError, describe_exception

    if isinstance(exc, ConfigError):
        print(f"spark-llm: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, EngineStartError):  # it could not start, or it failed every request also once rebuilt
        print(f"spark-llm: the inference engine cannot serve this batch: {exc}", file=sys.stderr)
        return 3
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (see main): batch.json says cancelled
        _quiet_cancel(spark)
        print(f"spark-llm: batch {config.batch_id} cancelled; what it answered so far is committed. Finish it with "
              f"--resume --batch-id {config.batch_id}, or close it with --finish-unanswered batch_cancelled as well",
              file=sys.stderr)
        return 130
    # Spark gave up on a job (or its JVM died): batch.json says failed; resume continues
    print(f"spark-llm: the batch failed: {describe_exception(exc, 600)}; rerun with --resume to continue",
          file=sys.stderr)
    return 3


def _quiet_cancel(spark: Any) -> None:
    """Stop the interrupted run's Spark jobs without the JVM's warnings about every task it kills (the process
    ends next; the session is this command's own)."""
    from .session_info import is_connect

    if is_connect(spark):
        return
    with contextlib.suppress(Exception):
        spark.sparkContext.setLogLevel("OFF")
        spark.sparkContext.cancelAllJobs()


def _plans_locally(args: argparse.Namespace, config: BatchConfig) -> bool:
    """``spark-llm plan`` of a small local JSONL input on a local master: planned in this process, without
    starting Spark (see :func:`~spark_llm.plan.plan_local`)."""
    import os

    from .plan import LOCAL_PLAN_BYTES
    from .read import local_input_bytes

    if args.remote or "PYSPARK_GATEWAY_PORT" in os.environ or not (args.master or "local").startswith("local"):
        return False
    size = local_input_bytes(config)
    return size is not None and size <= LOCAL_PLAN_BYTES


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM: silence the JVM's log first (the run cancels its Spark jobs next, and Spark would log each
    aborted write with a stack trace), then end the run as cancelled. From a thread of its own: the main thread may
    be inside a call into the JVM on its connection."""
    silencing = threading.Thread(target=_silence_spark, daemon=True)
    silencing.start()
    silencing.join(5)
    raise KeyboardInterrupt


def _silence_spark() -> None:
    with contextlib.suppress(Exception):
        from pyspark import SparkContext

        if SparkContext._active_spark_context is not None:
            SparkContext._active_spark_context.setLogLevel("OFF")


def engines_from_args(args: argparse.Namespace) -> int:
    """``spark-llm engines list|stop``: one line per engine of this host."""
    from .engine_host.client import engines_here, stop_engine

    for slot, info in engines_here():
        state = "ready" if info.listening else "starting"
        if args.action == "stop":
            stop_engine(slot, info)
            state = "stopped"
        print(f"{slot.name}\tpid {info.pid}\t{state}\tdevices {','.join(slot.devices) or '-'}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "engines":
        return engines_from_args(args)
    if args.command == "serve":
        from .service.server import serve_from_args

        return serve_from_args(args)
    # a batch stopped by its scheduler (SIGTERM) ends as cancelled, as on Ctrl-C
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupt)
    return run_from_args(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
