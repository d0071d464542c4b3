"""Request isolation: no single request can take the batch down.

A request the engine **refuses** (an error raised for one call, not fatal to the engine) is found by bisecting the
call (:func:`generate_isolating`) and becomes that request's error. A request that **kills** the engine is found
across deaths, as follows.

A request that kills the engine (a kernel segfault, an out-of-memory kill, a CUDA error) would kill it again on every
retry of its task, and after ``spark.task.maxFailures`` the batch would fail; ``--resume`` would meet it again. So
every engine call of a partition is recorded before it starts, in a small **journal** every attempt of the
partition can read (a marker file per call, under the run's staging area), and removed when the call returns. A
marker still there is a **death**: the engine (or the Python worker, or the executor) died while those requests
were in flight.

Where deaths are on record, :func:`isolation_plan` narrows them down: the requests of the smallest death run first,
in :data:`FANOUT` smaller calls, and the requests never in flight at a death run together afterwards. A request in
flight during two deaths, the last of them with no other request in the call, is **quarantined**: it becomes an
``engine_error`` row and the rest of the partition completes. Deaths of the engine process in a live worker are
handled within the task (the engine is rebuilt in place, :data:`MAX_ENGINE_REBUILDS` times at most); deaths of the
worker or executor through the task's retries, which is why the retry budget (``spark.task.maxFailures``, or
``local[N,F]``) must cover the isolation: ``1 + ceil(log_FANOUT(partition rows)) + 1`` attempts for one poison
request, 5 for a 4,000-row partition.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..filesystems import S3Access, python_filesystem
from .directory import engine_dir

log = logging.getLogger(__name__)

#: After a death, its requests run again in this many smaller calls (so a poison request in a partition of ``n``
#: rows is alone in a call after about ``log_FANOUT(n)`` deaths).
FANOUT = 16
#: Task attempts a cluster should allow (``spark.task.maxFailures``): a poison request in a partition of up to
#: FANOUT**4 (65,536) rows set aside, plus two failures of other causes.
RECOMMENDED_TASK_ATTEMPTS = 8
#: Engine deaths a task survives by rebuilding the engine in place; after that the task fails and its next attempt
#: continues from the journal.
MAX_ENGINE_REBUILDS = 6


#: What a device error that poisons the process's CUDA context says (CUDA's "sticky" errors: every later kernel on
#: the device fails too, so the engine must be rebuilt in a new process). vLLM's in-process engine raises them as
#: they are; only its multiprocess client turns them into ``EngineDeadError``. An out-of-memory error is not sticky.
STICKY_DEVICE_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                        "misaligned address", "illegal instruction", "uncorrectable ECC error", "NCCL error",
                        "CUDA error: an illegal", "cudaErrorIllegalAddress", "CUBLAS_STATUS_EXECUTION_FAILED",
                        "CUDNN_STATUS_EXECUTION_FAILED", "hardware exception")
#: What vLLM's multiprocess executor raises on every call once a tensor-parallel worker died (its ``is_failed``:
#: vllm/v1/executor/multiproc_executor.py, and EngineCore on ``EXECUTOR_FAILED``): the engine never answers again.
DEAD_EXECUTOR_ERRORS = ("Executor failed.",)


def is_fatal(exc: BaseException) -> bool:
    """The engine is dead: vLLM's ``EngineDeadError``, a device error that leaves the CUDA context unusable
    (:data:`STICKY_DEVICE_ERRORS`), a tensor-parallel worker gone (:data:`DEAD_EXECUTOR_ERRORS`), or a failure every
    request meets (:class:`EngineFault`). No request can be answered by it any more."""
    text = str(exc)
    if any(marker in text for marker in STICKY_DEVICE_ERRORS):
        return True
    if (isinstance(exc, RuntimeError) and text.strip() in DEAD_EXECUTOR_ERRORS) or isinstance(exc, EngineFault):
        return True
    # an EngineDeadError exists only where its module was imported: no import of vLLM here (the engine stand-in)
    exceptions = sys.modules.get("vllm.v1.engine.exceptions")
    return exceptions is not None and isinstance(exc, getattr(exceptions, "EngineDeadError", ()))


#: Requests of a failed call (spread across it) that run alone before the bisection: when every one of them fails
#: alone as the whole call did, the failure is the engine's (:class:`EngineFault`), not theirs.
PROBES = 4


class EngineFault(RuntimeError):
    """Every request an engine was given fails the same way, alone as together: the engine is at fault (a setting it
    cannot run with, a state it cannot leave), not a request. ``signature`` is the failure every call met."""

    def __init__(self, signature: str, hint: Optional[str] = None):
        super().__init__(f"every request fails with {signature}" + (f" ({hint})" if hint else ""))
        self.signature = signature


#: What to change for failures that every request meets, by what the failure says.
ENGINE_FAULT_HINTS = {
    "CPU Generator does not use offset": "vLLM on a CPU cannot sample seeded requests whose prompts are prefilled "
                                         "in parts: leave enable_chunked_prefill out of engine_kwargs",
}


def failure_signature(exc: BaseException) -> str:
    """A failure as calls compare it: its type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def probe_indices(n: int, probes: int = PROBES) -> list[int]:
    """The requests of a failed call of ``n`` that run alone first: ``probes`` of them, spread evenly (the first
    and the last included), or none when the call has fewer (its bisection tries each alone anyway)."""
    if n < probes or probes < 2:
        return []
    return sorted({round(k * (n - 1) / (probes - 1)) for k in range(probes)})


def generate_isolating(generate: Callable[[list, list], list], prompts: Sequence, params: Sequence,
                       is_fatal: Callable[[BaseException], bool] = is_fatal, probes: int = PROBES) -> list:
    """Run ``generate`` on all requests at once; if it raises a non-fatal error, find the request(s) responsible.
    Returns, per request, either its output or the exception it caused.

    The algorithm: a failed call's :func:`probe_indices` run alone first. If each of them fails alone with the
    call's own failure (:func:`failure_signature`), no request is to blame and :class:`EngineFault` is raised: the
    engine is rebuilt, and a batch whose engines fail so again stops with the failure, instead of each request
    running alone to the same error (a call of ``n`` would take ``2n - 1`` calls). Otherwise the probes keep their
    results and the rest is bisected: halves of a failed call run apart until the request at fault is alone. Each
    call is bounded by ``generate``, which ends its requests in the engine when it raises."""
    if not prompts:
        return []
    try:
        return _checked(generate, prompts, params)
    except Exception as exc:
        if is_fatal(exc):
            raise
        first = exc
    log.warning("engine call over %d requests failed (%s); isolating the failing request(s)", len(prompts),
                failure_signature(first))
    alone = probe_indices(len(prompts), probes)
    results: dict[int, Any] = {i: _bisect(generate, [prompts[i]], [params[i]], is_fatal)[0] for i in alone}
    signature = failure_signature(first)
    if alone and all(isinstance(r, Exception) and failure_signature(r) == signature for r in results.values()):
        hint = next((h for marker, h in ENGINE_FAULT_HINTS.items() if marker in signature), None)
        raise EngineFault(signature, hint) from first
    rest = [i for i in range(len(prompts)) if i not in results]
    if rest:
        for i, out in zip(rest, _bisect(generate, [prompts[i] for i in rest], [params[i] for i in rest], is_fatal)):
            results[i] = out
    return [results[i] for i in range(len(prompts))]


def _checked(generate: Callable[[list, list], list], prompts: Sequence, params: Sequence) -> list:
    outs = list(generate(list(prompts), list(params)))
    if len(outs) != len(prompts):
        raise RuntimeError(f"engine returned {len(outs)} outputs for {len(prompts)} requests")
    return outs


def _bisect(generate: Callable[[list, list], list], prompts: Sequence, params: Sequence,
            is_fatal: Callable[[BaseException], bool]) -> list:
    """:func:`generate_isolating`'s bisection: the call, then its halves apart when it failed."""
    try:
        return _checked(generate, prompts, params)
    except Exception as exc:
        if is_fatal(exc):
            raise
        if len(prompts) == 1:
            return [exc]
    mid = len(prompts) // 2
    return (_bisect(generate, prompts[:mid], params[:mid], is_fatal)
            + _bisect(generate, prompts[mid:], params[mid:], is_fatal))


@dataclass(frozen=True)
class IsolationPlan:
    quarantined: list[str]      #: request ids that become engine_error rows
    calls: list[list[str]]      #: request ids of each engine call, in order

    @property
    def isolating(self) -> bool:
        return len(self.calls) > 1 or bool(self.quarantined)


def isolation_plan(ids: Sequence[str], deaths: Sequence[frozenset[str]], fanout: int = FANOUT) -> IsolationPlan:
    """How to run the requests ``ids`` given the in-flight sets of the deaths on record (earlier attempts' and this
    one's): quarantined requests, then the engine calls, suspects first (smallest death first, each in ``fanout``
    chunks), the requests never in flight at a death last, in one call. Without deaths: one call over all."""
    present = set(ids)
    deaths = [d & present for d in deaths]
    deaths = [d for d in deaths if d]
    count = Counter(r for d in deaths for r in d)
    smallest: dict[str, frozenset[str]] = {}
    for d in sorted(deaths, key=lambda d: (-len(d), sorted(d))):  # later (smaller) sets win
        for r in d:
            smallest[r] = d
    quarantined = sorted(r for r in present if count[r] >= 2 and len(smallest[r]) == 1)
    groups: dict[frozenset[str], list[str]] = {}
    for r in ids:
        if r in smallest and r not in quarantined:
            groups.setdefault(smallest[r], []).append(r)
    calls: list[list[str]] = []
    for death in sorted(groups, key=lambda d: (len(d), sorted(d))):
        members = groups[death]
        size = max(1, math.ceil(len(death) / fanout))
        calls.extend(members[i:i + size] for i in range(0, len(members), size))
    clean = [r for r in ids if r not in smallest]
    if clean:
        calls.append(clean)
    return IsolationPlan(quarantined, calls)


def task_attempts_needed(rows: int, fanout: int = FANOUT) -> int:
    """Attempts of a task whose worker dies on one poison request among ``rows``: the first death, one death per
    narrowing down to the request alone, and the attempt that completes."""
    narrowings, size = 0, rows
    while size > 1:
        size, narrowings = math.ceil(size / fanout), narrowings + 1
    return 2 + max(1, narrowings)


def retry_budget_warning(conf: dict) -> Optional[str]:
    """What to change when the session's task attempts are fewer than :data:`RECOMMENDED_TASK_ATTEMPTS`."""
    master = conf.get("spark.master", "")
    match = re.fullmatch(r"local(?:\[[^,\]]+(?:,(\d+))?\])?", master)
    if match:
        attempts = int(match.group(1) or 1)
        fix = f"use local[N,F] with F >= {RECOMMENDED_TASK_ATTEMPTS}"
    else:
        attempts = int(conf.get("spark.task.maxFailures", 4))
        fix = f"set spark.task.maxFailures >= {RECOMMENDED_TASK_ATTEMPTS}"
    if attempts >= RECOMMENDED_TASK_ATTEMPTS:
        return None
    return (f"tasks get {attempts} attempt(s): a request that kills its Python worker or executor every time could "
            f"fail the batch before it is set aside ({fix}; see docs/reliability.md, 'Poison requests')")


def quarantine_message(deaths: int) -> str:
    return (f"the engine process died twice while running this request (and {deaths} time(s) in all while its "
            f"partition was isolated), so it was set aside and the rest of the batch went on; run it alone to "
            f"reproduce (e.g. with a smaller max_tokens, or without its logprobs / structured-output settings)")


# ---- the journal ---------------------------------------------------------------------------------------------

@dataclass
class Journal:
    """The in-flight markers of one partition's engine calls (see the module docs)."""

    fs: Any
    root: str

    @classmethod
    def open(cls, base: Optional[str], partition: int, s3: Optional[S3Access] = None) -> Optional["Journal"]:
        """The journal of ``partition`` under ``base`` (the run's staging area; on S3 through ``s3``, the session's
        S3A settings), or None without one. A base this worker cannot open falls back to the engine directory of
        the host (retries on another host then start afresh), with a warning."""
        if not base:
            return None
        try:
            filesystem, root = python_filesystem(f"{base.rstrip('/')}/p{partition}", s3)
            filesystem.create_dir(root, recursive=True)
        except Exception as exc:
            root = str(engine_dir() / "journal" / base.strip("/").replace("/", "_").replace(":", "") / f"p{partition}")
            log.warning("quarantine journal: cannot use %s from this worker (%s); using %s on this host", base,
                        str(exc).splitlines()[0], root)
            from pyarrow import fs

            filesystem = fs.LocalFileSystem()
            filesystem.create_dir(root, recursive=True)
        return cls(filesystem, root)

    def deaths(self) -> list[frozenset[str]]:
        """The in-flight sets of the calls that never returned (earlier attempts)."""
        from pyarrow import fs

        found = []
        for info in self.fs.get_file_info(fs.FileSelector(self.root, allow_not_found=True)):
            if info.type == fs.FileType.File and info.base_name.endswith(".json"):
                with self.fs.open_input_stream(info.path) as f:
                    try:
                        found.append(frozenset(json.loads(f.read().decode())))
                    except ValueError:  # a marker cut short by the death itself: its call is unknown
                        continue
        return found

    def mark(self, ids: Sequence[str]) -> str:
        """Record a call's requests before it starts; returns the marker to :meth:`clear` when it returns."""
        path = f"{self.root}/{uuid.uuid4().hex}.json"
        with self.fs.open_output_stream(path) as f:
            f.write(json.dumps(list(ids)).encode())
        return path

    def clear(self, marker: str) -> None:
        self.fs.delete_file(marker)
