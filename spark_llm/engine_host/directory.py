"""The engine directory of a host: where its engines' slots keep their locks, records, sockets and logs.

``SPARK_LLM_ENGINE_DIR``, default ``<tmp>/spark_llm-engines-<uid>``; one per host (where GPU addresses are
container-relative, YARN and Kubernetes, each container has its own tmp or should set its own directory). The
directory is trusted with the engines' socket keys and with which process to signal, so one that another user owns
or that is reached through a symbolic link is refused.

Per slot ``<name>``: ``.starting`` (the process starting its engine: pid, key, devices) until ``.json`` (the ready
server: pid, key, devices, socket key, load time), each a :class:`~spark_llm.engine_host.protocol.SlotRecord`;
``.error`` (why its engine could not start); ``.sock``; ``.log`` (the engine process's output); ``.spec`` (the
engine's settings); ``.stats`` (its busy seconds so far); ``.start.lock`` (held while a task decides to start one);
``.feed-<i>.lock`` (see :class:`~spark_llm.engine_host.client.Feed`). Per device: ``device-<d>.lock``, held by the
engine process using it for its whole life. ``events.jsonl``: one JSON line per engine start, ready and stop, which
the tests read as the engines' own records.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import EngineStartError
from ..host import group_members, is_process, process_start_time, read_record
from .protocol import SlotRecord

ENGINE_DIR_ENV = "SPARK_LLM_ENGINE_DIR"
#: Given by a local session spark_llm starts itself (a ``local[N]`` master: its driver's JVM is the only executor) to
#: its JVM, and so to its Python workers: the driver's pid, by which the executor's CPU engines are named rather than
#: by the JVM's pid, so that ``spark-llm run`` can start them loading before the JVM exists.
LOCAL_EXECUTOR_ENV = "SPARK_LLM_LOCAL_EXECUTOR"
#: The engine directory's record of engine starts, readies and stops (one JSON object a line).
EVENTS_FILE = "events.jsonl"
#: Seconds to wait for an engine process to stop and release its devices.
STOP_TIMEOUT_SECONDS = 120.0
#: The longest path of a Unix socket (``sun_path`` is 108 bytes with its terminating zero).
MAX_SOCKET_PATH = 107


class SlotFile:
    """A slot's files, by suffix (see the module docs)."""

    READY = ".json"
    STARTING = ".starting"
    ERROR = ".error"
    SOCKET = ".sock"
    LOG = ".log"
    SPEC = ".spec"
    START_LOCK = ".start.lock"
    STATS = ".stats"  #: the running server's busy seconds (see EngineServer.record_busy)
    COPY = ".copy"  #: the server's copy of its model to this host: when it began, and its seconds once done


_checked: set[str] = set()


def engine_dir() -> Path:
    """This host's engine directory, made (mode 0700) if missing; refused when it is a symbolic link or another
    user's."""
    path = Path(os.environ.get(ENGINE_DIR_ENV) or Path(tempfile.gettempdir()) / f"spark_llm-engines-{os.getuid()}")
    if str(path) not in _checked:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_dir(path)
        _checked.add(str(path))
    return path


def check_private_dir(path: Path) -> None:
    """Refuse a directory that is a symbolic link or that another user owns: whoever controls it could read the
    engines' socket keys or plant records naming processes for us to signal."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise EngineStartError(f"the engine directory {path} is a symbolic link; set {ENGINE_DIR_ENV} to a "
                               f"directory of this user's own (not a link)")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise EngineStartError(f"the engine directory {path} belongs to user id {st.st_uid}, not to this process's "
                               f"({os.getuid()}); set {ENGINE_DIR_ENV} to a directory of this user's own")


@dataclass(frozen=True)
class Slot:
    """An engine's place on a host: the GPU addresses Spark assigned the task (``gpu-0``, ``gpu-2,3`` for a
    tensor-parallel group), or, without GPU scheduling, ``cpu-<executor>-N``."""

    name: str
    devices: tuple[str, ...] = ()

    @classmethod
    def for_gpus(cls, addresses: Sequence[str]) -> "Slot":
        devices = tuple(sorted(addresses, key=lambda a: (len(a), a)))
        return cls("gpu-" + ",".join(devices), devices)

    @classmethod
    def cpu(cls, n: int, executor: Optional[int] = None) -> "Slot":
        """CPU slot ``n`` of this executor, or of executor ``executor`` (:func:`executor_id`; executors sharing a
        host never share a CPU engine)."""
        return cls(f"cpu-{executor or executor_id()}-{n}")

    def path(self, suffix: str) -> Path:
        return engine_dir() / f"{self.name}{suffix}"

    def feed_lock(self, index: int) -> Path:
        return self.path(f".feed-{index}.lock")

    def socket(self) -> str:
        """The slot's socket: in the engine directory, or, where that path would pass the 108-byte limit of a Unix
        socket's name, in a short private directory named for the engine directory."""
        path = str(self.path(SlotFile.SOCKET))
        if len(path) <= MAX_SOCKET_PATH:
            return path
        short = Path(tempfile.gettempdir()) / f"sllm-{os.getuid()}" / hashlib.sha256(
            str(engine_dir()).encode()).hexdigest()[:12]
        short.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_dir(short.parent)
        check_private_dir(short)
        name = f"{hashlib.sha256(self.name.encode()).hexdigest()[:16]}.sock"
        return str(short / name)

    def ready(self) -> Optional[SlotRecord]:
        """The record the slot's last server wrote when it became ready, alive or not."""
        return SlotRecord.of(read_record(self.path(SlotFile.READY)))

    def starting_record(self) -> Optional[SlotRecord]:
        """The slot's record of a server starting, alive or not: the process started for it, or the engine process
        forked for it by that one (then with ``launcher``, the pid of the process that forked it)."""
        return SlotRecord.of(read_record(self.path(SlotFile.STARTING)))

    def serving(self) -> Optional[SlotRecord]:
        """The slot's ready server's record, if that process still runs."""
        return alive(self.ready())

    def starting(self) -> Optional[SlotRecord]:
        """The slot's server that is starting, if that process still runs."""
        return alive(self.starting_record())


def device_lock(device: str) -> Path:
    """The lock the engine process on GPU ``device`` holds for its whole life: never two engines on one device."""
    return engine_dir() / f"device-{device}.lock"


def end_leftovers(record: SlotRecord, timeout: float = STOP_TIMEOUT_SECONDS) -> list[int]:
    """Kill what is left of the engine process group ``record`` names (a GPU engine server that died and left its
    tensor-parallel workers holding the device) and wait until it is gone; the pids found. The next engine on the
    device calls it, holding the device's lock, before it loads."""
    if not record.devices or record.pid == os.getpgrp():  # ours: a group id is not given again while it is in use
        return []
    left = group_members(record.pid, record.pid_started)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while left and group_members(record.pid, record.pid_started) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def copy_seconds(slot: Slot, pid: int, now: float) -> float:
    """Seconds server ``pid`` of ``slot`` has spent copying its model to this host so far (its :data:`SlotFile.COPY`
    record; a copy under way counts up to ``now``, wall clock), which its start's time limit does not count."""
    record = read_record(slot.path(SlotFile.COPY)) or {}
    if record.get("pid") != pid or not isinstance(record.get("began_at"), (int, float)):
        return 0.0
    seconds = record.get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) else max(0.0, now - record["began_at"])


def lock_holder(fd: int) -> Optional[SlotRecord]:
    """The engine process that last held the device lock ``fd`` (a locked file: :func:`record_holder`), if any."""
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        return SlotRecord.of(json.loads(os.read(fd, 4096) or b"null"))
    except ValueError:
        return None


def record_holder(fd: int, record: SlotRecord) -> None:
    """Write the engine process holding the device lock ``fd`` into it, for the next holder's
    :func:`end_leftovers`."""
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(record.as_json()).encode())


def start_failed_marker(slot: Slot, key: str, run_id: str) -> Path:
    """Where a run records that the engine for settings ``key`` could not start on ``slot`` (its GPUs: one bad GPU
    does not fail the executor's other GPUs' tasks), so that the task's retries fail at once instead of loading the
    model again."""
    return engine_dir() / f"start-failed-{slot.name}-{key}-{run_id}.txt"


def process_record(pid: int, **fields: Any) -> SlotRecord:
    """A record naming process ``pid`` with its start time, so that a later reader never takes another process that
    got the pid again for it (:func:`alive`)."""
    return SlotRecord(pid, process_start_time(pid), **fields)


def alive(record: Optional[SlotRecord]) -> Optional[SlotRecord]:
    """``record`` while the process it names still runs and is the one recorded (:func:`process_record`)."""
    if record is None or not is_process(record.pid, record.pid_started):
        return None
    return record


def executor_id() -> int:
    """The executor this process serves, as its engines are named: a local session's driver
    (:data:`LOCAL_EXECUTOR_ENV`), else the executor's JVM (:func:`executor_pid`)."""
    named = os.environ.get(LOCAL_EXECUTOR_ENV, "")
    return int(named) if named.isdigit() else executor_pid()


def executor_pid() -> int:
    """The JVM this Python worker serves (Linux: the nearest ``java`` ancestor); else the parent process."""
    pid = os.getpid()
    with contextlib.suppress(OSError, ValueError, IndexError):
        for _ in range(16):
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if pid <= 1:
                break
            if Path(f"/proc/{pid}/comm").read_text().strip() == "java":
                return pid
    return os.getppid()


def event(**record: Any) -> None:
    """One line of the engine directory's record of engine starts, readies and stops."""
    line = json.dumps({"time": time.time(), **record}) + "\n"
    with open(engine_dir() / EVENTS_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)


def read_events(directory: Optional[Path] = None) -> list[dict]:
    """The servers' records (``events.jsonl``) of an engine directory."""
    path = (directory or engine_dir()) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
