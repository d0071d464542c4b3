"""``spark-llm serve``: the batch service's process. The settings are ``spark-llm run``'s model, engine and Spark
settings (every batch shares them) plus :class:`~.settings.ServiceSettings`; the store, the file storage and the
scheduler are made here, the scheduler's Spark session and engines start while the API already answers."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from typing import Any, AsyncIterator, Callable, Optional

from ..config import BatchConfig, ConfigError, spark_conf_from_yaml
from ..flags import add_run_arguments, argument_kwargs, configure_logging
from .settings import ServiceSettings

log = logging.getLogger(__name__)

#: ``spark-llm run`` settings that are each batch's, set by the service: not flags of ``serve``.
PER_BATCH = ("input", "output_dir", "batch_id", "overwrite", "resume", "retry_errors", "finish_unanswered",
             "tables_dir", "outputs_table_path", "errors_table_path", "output_table_prefix", "input_table",
             "id_column", "body_column", "prompt_column", "messages_column", "system_prompt", "system_prompt_column",
             "max_tokens_column", "temperature_column", "table_endpoint")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service")
    for name, info in ServiceSettings.model_fields.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=info.description,
                           **argument_kwargs(info.annotation))
    add_run_arguments(parser, exclude=PER_BATCH)


def serve_from_args(args: argparse.Namespace) -> int:
    """Exit 0 after a clean shutdown (Ctrl-C, SIGTERM), 2 for bad settings."""
    configure_logging(args.log_level)
    try:
        base = BatchConfig.load(args.config, **{f: getattr(args, f, None) for f in BatchConfig.model_fields})
        base.require("model")
        spark_conf = spark_conf_from_yaml(args.config)
        settings = ServiceSettings(**{f: getattr(args, f) for f in ServiceSettings.model_fields
                                      if getattr(args, f, None) is not None})
        settings.check()
    except (ConfigError, ValueError) as exc:
        print(f"spark-llm serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(base, settings, spark_conf, master=args.master, remote=args.remote)


def serve(base: BatchConfig, settings: ServiceSettings, spark_conf: Optional[dict[str, str]] = None,
          master: Optional[str] = None, remote: Optional[str] = None) -> int:
    """Run the service until the process is told to stop."""
    import uvicorn

    from .door import uvicorn_config
    from ..filesystems import hadoop_settings
    from .files import FileStorage

    # first: the default database and audit log live under it; on S3 reached and encrypted as the server's Spark
    try:
        files = FileStorage(settings.storage, hadoop_settings(spark_conf or {}))
    except ConfigError as exc:
        print(f"spark-llm serve: error: {exc}", file=sys.stderr)
        return 2
    app = _app(base, settings, files, session=lambda: _session(base, spark_conf or {}, master, remote))
    sock = _listening(settings)
    if sock is None:
        return 2
    keys = settings.keys()
    access = (f"{len(keys)} API key(s)" if keys else
              "no API keys: listening on this machine only; give --api-keys FILE to serve others")
    print(f"spark-llm serve: http://{settings.host}:{sock.getsockname()[1]}/v1 ({access}); storage {files.root}",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0


def _app(base: BatchConfig, settings: ServiceSettings, files: Any, session: Callable[[], Any]) -> Any:
    """The service's ASGI app over its store and files, whose life starts and stops the batch scheduler (it runs
    the batches on the ``session`` it makes when it first needs one) and the webhooks' sender."""
    from . import audit
    from .access import Service
    from .api import create_app
    from .delivery import Sender
    from .scheduler import Scheduler
    from .store import Store

    if settings.audit_path():
        audit.write_to(settings.audit_path())
    if swept := files.sweep_partials():
        log.info("removed %d temporary file(s) of uploads cut off by a server that stopped", swept)
    store = Store(settings.database())
    scheduler = Scheduler(base, settings, store, files, session=session)
    sender = Sender(store, settings)
    app = create_app(Service(settings=settings, store=store, files=files, scheduler=scheduler))

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        scheduler.start()
        sender.start()
        try:
            yield
        finally:
            log.info("stopping: running batches resume when the server starts again")
            scheduler.stop()
            sender.stop()
            store.close()

    app.router.lifespan_context = lifespan
    return app


def _listening(settings: ServiceSettings) -> Optional[socket.socket]:
    """A socket bound to the service's address, or None (and why, printed) when it cannot be."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        print(f"spark-llm serve: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror}",
              file=sys.stderr)
        sock.close()
        return None
    return sock


def _session(base: BatchConfig, spark_conf: dict[str, str], master: Optional[str], remote: Optional[str]) -> Any:
    """The server's Spark session, kept for its life (with it, its engines); a local session's CPU engines start
    loading first, as ``spark-llm run``'s do."""
    from ..session import get_session

    from ..warmup import start_before_session

    start_before_session(base, spark_conf, master, remote)
    return get_session(master=master, conf=spark_conf, remote=remote, app_name="spark_llm-serve")
