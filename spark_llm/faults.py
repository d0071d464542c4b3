"""Fault injection for tests and drills, read from ``SPARK_LLM_FAULT_INJECTION`` (unset in normal runs).

The value is one or more faults separated by ``;``:

- ``kill_worker_once:<marker path>[:<custom_id>]`` (executors): the Python worker that finishes an engine call
  exits hard (as if OOM-killed) before yielding its results; with a custom_id only a partition holding that request
  does. The marker file (created atomically) makes it happen once.
- ``exit_after_wave:<N>`` (driver): the driver exits hard right after committing wave N.
"""

from __future__ import annotations

import logging
import os
from typing import Collection, Iterator

log = logging.getLogger(__name__)

FAULT_ENV = "SPARK_LLM_FAULT_INJECTION"


def _faults(kind: str) -> Iterator[list[str]]:
    """The arguments of every configured fault of ``kind``."""
    for spec in os.environ.get(FAULT_ENV, "").split(";"):
        name, _, args = spec.strip().partition(":")
        if name == kind:
            yield args.split(":", 1)


def maybe_kill_worker(custom_ids: Collection[str]) -> None:
    """``kill_worker_once``: called by an inference task after its engine call."""
    for args in _faults("kill_worker_once"):
        marker, target = args[0], (args[1] if len(args) > 1 else None)
        if target is not None and target not in custom_ids:
            continue
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        log.error("fault injection: killing Python worker %d mid-partition", os.getpid())
        os._exit(137)


def maybe_exit_after_wave(number: int) -> None:
    """``exit_after_wave``: called by the driver after each wave's commit."""
    for args in _faults("exit_after_wave"):
        if int(args[0]) == number:
            log.error("fault injection: driver exits after wave %d", number)
            logging.shutdown()
            os._exit(137)
