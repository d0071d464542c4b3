"""What the processes of one host share: file locks, small private records and process checks.

Engine servers and the tasks that feed them, the model cache and the tokenizer-class record all coordinate through
files under a directory of this user's: an ``flock`` is released by the kernel when its process dies, so a crashed
holder never leaves a lock behind, and a record written through a temp file and a rename is never read half
written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional


def try_lock(path: Path) -> Optional[int]:
    """An exclusive lock on ``path`` (created if missing) if free now: its file descriptor, held until closed."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def lock(path: Path) -> int:
    """An exclusive lock on ``path``, waited for: its file descriptor, held until closed."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@contextlib.contextmanager
def locked(path: Path, wait: Optional[float] = None) -> Iterator[bool]:
    """Hold the lock on ``path`` for the block: waited for without end (``wait`` None), or ``wait`` seconds at most;
    yields whether it is held."""
    if wait is None:
        fd: Optional[int] = lock(path)
    else:
        deadline = time.monotonic() + wait
        while (fd := try_lock(path)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def private_file(path: "str | Path") -> None:
    """Make ``path`` a file only this user can read or write: created empty if it is not there, else its mode set
    (a file an earlier version left readable by others)."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600))
    os.chmod(path, 0o600)


def write_private(path: Path, record: dict) -> None:
    """Write a small JSON record readable by this user only, complete or not at all (temp file and rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_record(path: Path) -> Optional[dict]:
    """A JSON record written by :func:`write_private`, or None when there is none (or it is not JSON)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def process_alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host runs (an exited one not yet reaped does not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def process_start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None where unknown.
    A pid and its start time name one process for the host's uptime: a pid the kernel gives again to a later
    process has a later start."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def group_members(pgid: int, not_before: Optional[int]) -> list[int]:
    """The live processes of process group ``pgid`` that started no earlier than ``not_before`` (the leader's
    recorded start: a group id the kernel gave a later group again names processes that started later still, but
    this group's members all started after its leader). Linux (``/proc``); elsewhere none."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid and (not_before is None or int(fields[19]) >= not_before):
            members.append(int(stat.parent.name))
    return members


def is_process(pid: Any, started: Optional[int]) -> bool:
    """Whether ``pid`` is alive and still the process that was recorded with start time ``started`` (see
    :func:`process_start_time`; a record without one is taken at its pid's word)."""
    if not process_alive(pid):
        return False
    return started is None or process_start_time(pid) in (None, started)
