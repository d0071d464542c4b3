"""Fault injection for tests and drills, read from ``SPARK_LLM_FAULT_INJECTION`` (unset in normal runs).

The value is one or more faults separated by ``;``:

- ``kill_worker_once:<marker path>[:<custom_id>]`` (executors): the Python worker that finishes an engine call
  exits hard (as if OOM-killed) before yielding its results; with a custom_id only a partition holding that request
  does. The marker file (created atomically) makes it happen once.
- ``crash_on_custom_id:<custom_id>`` (executors): the Python worker dies hard (as if OOM-killed) whenever an
  engine call holding that request starts: a poison request that takes its task down on every attempt.
- ``kill_engine_on_custom_id:<custom_id>`` (executors): the task kills its engine process (``SIGKILL``) whenever an
  engine call holding that request starts (the engine up, the call's requests about to go over, so the engine never
  answers any of them): a poison request that crashes the engine under a live worker (and under the engine's other
  feeder).
- ``kill_executor_once:<marker path>:<custom_id>`` (executors): the task kills its executor's JVM (``SIGKILL``)
  once, as an engine call holding that request starts: an executor lost mid-wave.
- ``kill_node_once:<marker path>:<custom_id>`` (executors of a standalone cluster): as ``kill_executor_once``, and
  the executor's parent, its worker daemon, first: a node lost mid-wave.
- ``fail_engine_start_on_gpu:<address>`` (engine processes): an engine whose devices hold that GPU cannot start, as
  on a GPU with an ECC error or memory held by a leftover process.
- ``exit_after_wave:<N>`` (driver): the driver exits hard right after committing wave N.
- ``hold_inference_until:<release path>:<custom_id>`` (executors): an engine call holding that request waits, before
  it starts, until the file ``<release path>`` exists (10 minutes at most), after creating ``<release path>.held``: a
  wave in flight, for as long as a test needs one.
- ``hold_commit_until:<release path>:<custom_id>`` (driver): the commit of a wave holding that request waits likewise,
  its inference ended: while the batch's last wave commits, none of its waves is in flight.
- ``hold_read_until:<release path>`` (driver): the reading of JSONL input files waits, once they are listed and
  before a line is read, until the file ``<release path>`` exists (after creating ``<release path>.held``): a file
  can be deleted or replaced between the two, as by another job while the batch runs.
- ``meet_before_table_write:<directory>:<N>:<rounds>`` (driver): a process's k-th write of a result table (its
  creation, an append, a delete), for k up to ``rounds``, waits until N processes' k-th writes have arrived (in
  ``<directory>/<k>``; 10 minutes at most): the writes of N servers sharing tables, at the same moments.
- ``meet_before_engine_call:<directory>:<custom_id prefix>:<N>`` (executors): an engine call holding a request
  whose custom_id starts with the prefix waits, before it starts, until N such calls have arrived (each leaves a
  file in the directory; 10 minutes at most): N partitions on N engines at once.

A test waits for ``.held`` (a state it made), never for a time that should be long enough.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from typing import Any, Collection, Iterator, Optional

log = logging.getLogger(__name__)

FAULT_ENV = "SPARK_LLM_FAULT_INJECTION"
#: how long a hold waits for its release at the most, so that a test that never releases does not hang its run
HOLD_SECONDS = 600.0


def _faults(kind: str) -> Iterator[list[str]]:
    """The arguments of every configured fault of ``kind``."""
    for spec in os.environ.get(FAULT_ENV, "").split(";"):
        name, _, args = spec.strip().partition(":")
        if name == kind:
            yield args.split(":", 1)


def _first_time(marker: str) -> bool:
    """Create ``marker`` atomically: True for the one caller that did."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _parent(pid: int) -> Optional[int]:
    """The parent of process ``pid`` (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def maybe_kill_worker(custom_ids: Collection[str]) -> None:
    """``kill_worker_once``: called by an inference task after its engine call."""
    for args in _faults("kill_worker_once"):
        marker, target = args[0], (args[1] if len(args) > 1 else None)
        if (target is not None and target not in custom_ids) or not _first_time(marker):
            continue
        log.error("fault injection: killing Python worker %d mid-partition", os.getpid())
        os._exit(137)


def before_engine_call(custom_ids: Collection[str]) -> None:
    """``crash_on_custom_id`` / ``kill_executor_once`` / ``hold_inference_until``: called by an inference task as an
    engine call starts (after its in-flight marker is written)."""
    for args in _faults("hold_inference_until"):
        if len(args) > 1 and args[1] in custom_ids:
            _hold(args[0], f"the engine call holding {args[1]!r}")
    for args in _faults("meet_before_engine_call"):
        prefix, _, count = args[1].rpartition(":") if len(args) > 1 else ("", "", "")
        if prefix and any(c.startswith(prefix) for c in custom_ids):
            _meet(args[0], int(count), f"the engine call holding {prefix}* requests")
    for args in _faults("crash_on_custom_id"):
        if args[0] in custom_ids:
            log.error("fault injection: Python worker %d dies with %r in flight", os.getpid(), args[0])
            os._exit(137)
    for args in _faults("kill_node_once"):
        if len(args) > 1 and args[1] in custom_ids and _first_time(args[0]):
            from .engine_host.directory import executor_pid

            executor = executor_pid()
            worker = _parent(executor)
            log.error("fault injection: killing worker %s and executor JVM %d with %r in flight", worker, executor,
                      args[1])
            if worker:
                os.kill(worker, signal.SIGKILL)
            os.kill(executor, signal.SIGKILL)
            os._exit(137)
    for args in _faults("kill_executor_once"):
        if len(args) > 1 and args[1] in custom_ids and _first_time(args[0]):
            from .engine_host.directory import executor_pid

            log.error("fault injection: killing executor JVM %d with %r in flight", executor_pid(), args[1])
            os.kill(executor_pid(), signal.SIGKILL)
            os._exit(137)


def engine_call_starting(custom_ids: Collection[str], engine_pid: Optional[int]) -> None:
    """``kill_engine_on_custom_id``: called by an inference task as an engine call starts, the engine up and the
    call's requests about to go over. Killed any later, an engine fast enough (a 2-token request) could answer the
    call before the signal lands, and the drill would pass a request that, for real, never gets an answer."""
    for args in _faults("kill_engine_on_custom_id"):
        if args[0] in custom_ids and engine_pid:
            log.error("fault injection: killing engine process %d with %r in flight", engine_pid, args[0])
            os.kill(engine_pid, signal.SIGKILL)


def maybe_exit_after_wave(number: int) -> None:
    """``exit_after_wave``: called by the driver after each wave's commit."""
    for args in _faults("exit_after_wave"):
        if int(args[0]) == number:
            log.error("fault injection: driver exits after wave %d", number)
            logging.shutdown()
            os._exit(137)


def before_commit(staged: Any) -> None:
    """``hold_commit_until``: called by the driver before it commits a wave, with the wave's staged results (a
    DataFrame); looked into only when such a fault is set."""
    holds = {args[1]: args[0] for args in _faults("hold_commit_until") if len(args) > 1}
    if not holds:
        return
    from pyspark.sql import functions as F

    for row in staged.where(F.col("custom_id").isin(list(holds))).select("custom_id").distinct().collect():
        _hold(holds[row["custom_id"]], f"the commit of the wave holding {row['custom_id']!r}")


def before_reading_input() -> None:
    """``hold_read_until``: called by the driver once the input files are listed, before their lines are read."""
    for args in _faults("hold_read_until"):
        _hold(args[0], "the reading of the input files")


_table_writes = itertools.count(1)  #: this process's writes of result tables, numbered (meet_before_table_write)


def before_table_write() -> None:
    """``meet_before_table_write``: called by the driver before each write of a result table."""
    for args in _faults("meet_before_table_write"):
        directory, count, rounds = args[0], *args[1].split(":")
        k = next(_table_writes)
        if k <= int(rounds):
            _meet(os.path.join(directory, str(k)), int(count), f"table write {k}")


def _hold(release: str, what: str) -> None:
    """Wait until the file ``release`` exists (:data:`HOLD_SECONDS` at most), after creating ``release.held``."""
    with open(f"{release}.held", "a"):
        pass
    log.warning("fault injection: %s waits until %s exists", what, release)
    deadline = time.monotonic() + HOLD_SECONDS
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)


def _meet(directory: str, count: int, what: str) -> None:
    """Arrive in ``directory`` and wait until ``count`` callers have (:data:`HOLD_SECONDS` at most)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    log.warning("fault injection: %s waits for %d calls to meet in %s", what, count, directory)
    deadline = time.monotonic() + HOLD_SECONDS
    while len(os.listdir(directory)) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def engine_start_failure(devices: Collection[str]) -> Optional[str]:
    """``fail_engine_start_on_gpu``: why an engine on ``devices`` cannot start (as CUDA would say it), or None."""
    for args in _faults("fail_engine_start_on_gpu"):
        if args[0] in devices:
            return (f"CUDA error: uncorrectable ECC error encountered on GPU {args[0]} (fault injection: "
                    f"fail_engine_start_on_gpu)")
    return None
