"""One vLLM engine per device slot of a host, in a process of its own, for the life of the executor; the tasks'
side of it (the engine process itself is :mod:`~spark_llm.engine_server`).

Spark hands a Python worker different GPUs from task to task, recycles idle workers, and a CUDA context cannot move
to another device once made; an engine that lives in the worker would be rebuilt on most tasks and could end up
twice on one GPU. So the engine lives beside the workers:

- A **slot** is an engine's place: the GPU addresses Spark assigned the task (``gpu-0``, ``gpu-2,3`` for a
  tensor-parallel group), or, without GPU scheduling, ``cpu-<executor>-N``.
- A **feed** is what a task holds while it uses its slot's engine: one of the slot's ``feeds`` file locks, so that
  at most that many tasks feed one engine at once (``tasks_per_engine``: Spark gives that many tasks one GPU, see
  :func:`~spark_llm.engine.engine_layout`; without GPUs the task takes the first free feed of the first
  ``cpu_slots`` slots, every slot's first feed before any second one, and waits when all are taken). While one
  task's partition drains, the next task's requests already keep the engine busy. A partition with engine deaths
  on record takes every feed of its slot (:meth:`Feed.alone`), so that a death during its calls is its own.
- An **engine server** (``python -m spark_llm.engine_server``) serves one slot: started by the first task that needs
  it (under the slot's start lock, so two feeders never start two), in a new session (it outlives Python worker
  recycling) and a clean process (CUDA and vLLM's tensor-parallel workers start from nothing; ``spawn`` for vLLM's
  own processes), with ``CUDA_VISIBLE_DEVICES`` set to the slot's devices. It holds a file lock on each of its
  devices for its whole life, so two engines are never on one device: a server for other settings or another
  grouping of those devices is asked to stop, and waited for, first.
- Tasks send token ids and sampling settings over a Unix socket and get plain outputs back, each as it finishes; a
  request the engine rejects comes back as that request's error.
- An engine that cannot start is remembered for the rest of the run (per executor and settings), so the task's
  retries fail at once instead of loading the model again for each attempt; the next run tries again.
- A server stops when the executor that started it is gone, after ``engine_idle_timeout_seconds`` without requests,
  when asked, or when its engine dies. It writes what it does to ``events.jsonl`` in the engine directory (one JSON
  line per start, ready and stop), which the tests read as the engine's own records.

The engine directory is per host: ``SPARK_LLM_ENGINE_DIR``, default ``<tmp>/spark_llm-engines-<uid>``. Where GPU
addresses are container-relative (YARN, Kubernetes), each container has its own tmp or should set its own directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from .errors import EngineStartError

log = logging.getLogger(__name__)

ENGINE_DIR_ENV = "SPARK_LLM_ENGINE_DIR"
#: Given by a local session spark_llm starts itself (a ``local[N]`` master: its driver's JVM is the only executor) to
#: its JVM, and so to its Python workers: the driver's pid, by which the executor's CPU engines are named rather than
#: by the JVM's pid, so that ``spark-llm run`` can start them loading before the JVM exists.
LOCAL_EXECUTOR_ENV = "SPARK_LLM_LOCAL_EXECUTOR"
_START_TIMEOUT_S = 1800.0   # an 8B model with CUDA graphs takes minutes; a 70B one longer
#: Requests per message of a streamed call: the engine starts on the first chunk while the rest are on their way.
STREAM_CHUNK = 256
#: Version of what crosses the socket, part of every engine's key: a task never talks to an engine server of an
#: older spark_llm that may still be running on the host.
PROTOCOL = 3
#: The engine directory's record of engine starts, readies and stops (one JSON object a line).
EVENTS_FILE = "events.jsonl"
#: Seconds to wait for an engine process to stop and release its devices (here and in the engine server).
STOP_TIMEOUT_SECONDS = 120.0


def engine_dir() -> Path:
    path = Path(os.environ.get(ENGINE_DIR_ENV) or Path(tempfile.gettempdir()) / f"spark_llm-engines-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


# ---- what crosses the socket: plain, picklable, no vLLM needed to read it ------------------------------------

@dataclass
class TokenLogprob:
    logprob: float
    rank: Optional[int]
    decoded_token: Optional[str]


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[dict[int, TokenLogprob]]] = None
    #: set by the engine's parsers (:class:`~spark_llm.endpoints.engine_side.Parsers`) when ``parsed``
    parsed: bool = False
    content: Optional[str] = None           #: the answer: text without the reasoning and the tool-call markup
    reasoning: Optional[str] = None
    reasoning_tokens: int = 0
    tool_calls: Optional[list[dict]] = None  #: [{"name", "arguments"}] found by the tool-call parser


@dataclass
class Output:
    """One request's answer, shaped like vLLM's ``RequestOutput`` as far as the response bodies read it."""

    prompt_token_ids: list[int]
    outputs: list[Choice]
    num_cached_tokens: int = 0  #: prompt tokens served from vLLM's prefix cache
    embedding: Optional[list[float]] = None  #: a pooling engine's answer


class EngineDied(RuntimeError):
    """The engine process died (or its engine is dead) during a call: the requests in flight got no answer."""


class EngineGone(RuntimeError):
    """The engine was gone, or on its way out, before a call's requests reached it (its slot's other feeder's
    request killed it, say): the task starts or finds another engine and makes the call again; no request of the
    call was in flight, so none of them is suspected."""


@dataclass
class RequestFailure:
    """Why one request got no output: ``invalid`` sampling settings, or an ``engine`` error on this request."""

    kind: str
    message: str


def _plain(out: Any) -> Output:
    def logprobs(c: Any) -> Optional[list[dict[int, TokenLogprob]]]:
        if c.logprobs is None:
            return None
        return [{int(t): TokenLogprob(float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in pos.items()}
                for pos in c.logprobs]

    if hasattr(out.outputs, "embedding"):  # EmbeddingRequestOutput: one vector, no choices
        return Output(prompt_token_ids=list(out.prompt_token_ids or []), outputs=[],
                      num_cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0),
                      embedding=[float(x) for x in out.outputs.embedding])
    return Output(prompt_token_ids=list(out.prompt_token_ids or []),
                  outputs=[Choice(c.index, c.text, list(c.token_ids), c.finish_reason, logprobs(c))
                           for c in out.outputs],
                  num_cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0))


# ---- settings of the engine processes (not of vLLM's engine: they do not make a new engine) -------------------

@dataclass(frozen=True)
class ProcessSettings:
    """The config's settings of the same names (:func:`~spark_llm.config.config_view`)."""

    engine_idle_timeout_seconds: float
    engine_log_level: str


# ---- slots ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
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


def _try_lock(path: Path) -> Optional[int]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _lock(path: Path) -> int:
    """An exclusive file lock, waited for."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _feed_lock(slot: Slot, index: int) -> Path:
    return slot.path(f".feed-{index}.lock")


@dataclass
class Feed:
    """A task's place at its slot's engine: feed ``index`` of the slot's ``count`` (see the module docs)."""

    slot: Slot
    index: int
    count: int
    _fds: dict[int, int] = field(default_factory=dict, repr=False)  #: feed index -> its lock, held

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Hold every feed of the slot for the block: no other task feeds the engine meanwhile (those under way
        finish first). Our own feed is let go and all are taken in order, so two tasks going alone at once never
        hold each other up for good."""
        if self.count < 2:
            yield
            return
        if (own := self._fds.pop(self.index, None)) is not None:
            os.close(own)
        try:
            for j in range(self.count):
                self._fds[j] = _lock(_feed_lock(self.slot, j))
            yield
        finally:
            for j in [j for j in self._fds if j != self.index]:
                os.close(self._fds.pop(j))
            if self.index not in self._fds:  # cut short while taking them
                self._fds[self.index] = _lock(_feed_lock(self.slot, self.index))

    def release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextlib.contextmanager
def hold_feed(gpus: Optional[Sequence[str]], cpu_slots: Optional[int] = None, feeds: int = 1) -> Iterator[Feed]:
    """A feed of this task's slot, held until the block ends: of its GPUs' slot, else of the first ``cpu_slots``
    CPU slots of the executor (every slot's first feed before any second one), waiting while every feed is taken (a
    task of the slot running alone, or more tasks than Spark should give these GPUs). Without either, an engine of
    its own: the first CPU slot nobody feeds."""
    if gpus or cpu_slots:
        slots = [Slot.for_gpus(gpus)] if gpus else [Slot.cpu(n) for n in range(cpu_slots or 1)]
        feeds = max(1, feeds)
        places = [(slot, index) for index in range(feeds) for slot in slots]
        while (taken := _take_first_free(places)) is None:
            time.sleep(0.05)
    else:
        feeds, n = 1, 0
        while (taken := _take_first_free([(Slot.cpu(n), 0)])) is None:
            n += 1
    slot, index, fd = taken
    feed = Feed(slot, index, feeds, {index: fd})
    try:
        yield feed
    finally:
        feed.release()


def _take_first_free(places: Sequence[tuple[Slot, int]]) -> Optional[tuple[Slot, int, int]]:
    """The first (slot, feed index) whose lock is free, taken: with the lock's file descriptor."""
    for slot, index in places:
        fd = _try_lock(_feed_lock(slot, index))
        if fd is not None:
            return slot, index, fd
    return None


# ---- the client: a task's view of its slot's engine ----------------------------------------------------------

@dataclass
class EngineClient:
    feed: Feed              #: the task's feed of its slot
    info: dict              #: the server's info: pid, key, devices, load_seconds
    started_here: bool      #: this task started the server
    #: seconds this task waited for the slot's engine to load (its own start, or one already under way)
    waited_seconds: float = 0.0
    _conn: Any = field(repr=False, default=None)
    _spec: Any = field(repr=False, default=None)
    _process: Any = field(repr=False, default=None)
    rebuilds: int = 0       #: engines this task started again after one died under it
    rebuild_seconds: float = 0.0  #: seconds this task spent waiting for dead engines to be rebuilt

    @property
    def slot(self) -> Slot:
        return self.feed.slot

    @property
    def load_seconds(self) -> float:
        """Seconds this task waited for engines to load: 0 when its slot's engine was ready."""
        return self.waited_seconds + self.rebuild_seconds

    def alone(self) -> Any:
        """A block during which this task is the engine's only feeder (:meth:`Feed.alone`)."""
        return self.feed.alone()

    def rebuild(self, died: bool = True) -> None:
        """The slot's engine again after it died under this task (:class:`EngineDied`; ``died``), or was gone
        before a call (:class:`EngineGone`), in place: the task keeps its feed. Whichever feeder of the slot comes
        first starts it; the others wait for that one."""
        t0 = time.monotonic()
        self.close()
        self.info, _, awaited = _serving(self.slot, self._spec, self._process, dead=self.info.get("pid"))
        self._conn = _connect_or_gone(self.slot, self.info)
        if awaited:
            self.rebuild_seconds += time.monotonic() - t0
        self.rebuilds += died

    def generate(self, requests: list[tuple[list[int], dict, dict]]) -> list[Output | RequestFailure]:
        """One result per (prompt token ids, SamplingParams keyword arguments, what to parse out of the answer:
        ``{"reasoning": bool, "tools": [...]}``), in order."""
        results: list = [None] * len(requests)
        self.stream(requests, results.__setitem__)
        return results

    def stream(self, requests: list[tuple[list[int], dict, dict]],
               on_result: Callable[[int, "Output | RequestFailure"], None],
               starting: Optional[Callable[[], None]] = None) -> None:
        """:meth:`generate`, streamed: ``on_result(index, result)`` as each request finishes (in the order they
        finish), while the engine goes on with the rest; the requests go over in chunks, the first of which the
        engine starts on while the others are on their way. :class:`EngineGone` when the engine was gone (or
        stopping) before the call: it is asked first, since the slot's other feeder may have lost it since this
        task's last call; :class:`EngineDied` when it died during the call. ``starting()`` once the engine has answered
        the call's ping, before its requests go over (fault drills kill the engine there: it then dies with the whole
        call in flight and cannot have answered any of it, as under a real poison request)."""
        try:
            if self._conn is None:
                raise EOFError
            self._conn.send(("ping",))
            status, value = self._conn.recv()
        except (EOFError, OSError):
            status, value = "gone", f"the engine process (pid {self.info.get('pid')}) has ended"
        if status == "gone":
            raise EngineGone(f"engine of slot {self.slot.name}: {value}")
        try:
            if starting is not None:
                starting()
            self._conn.send(("stream", len(requests)))
            for start in range(0, len(requests), STREAM_CHUNK):
                self._conn.send(("add", [(i, requests[i]) for i in range(start, min(start + STREAM_CHUNK,
                                                                                       len(requests)))]))
            while True:
                status, value = self._conn.recv()
                if status != "results":
                    break
                for index, result in value:
                    on_result(index, result)
        except (EOFError, OSError) as exc:
            raise EngineDied(f"the engine process of slot {self.slot.name} (pid {self.info.get('pid')}) died "
                             f"during a call ({type(exc).__name__}); see {self.slot.path('.log')}") from None
        if status == "dead":
            raise EngineDied(f"engine of slot {self.slot.name}: {value}")
        if status == "gone":
            raise EngineGone(f"engine of slot {self.slot.name}: {value}")
        if status != "done":
            raise RuntimeError(f"engine of slot {self.slot.name}: {value}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()


def _read_info(slot: Slot) -> Optional[dict]:
    """The slot's ready server's info, if its process is alive."""
    info = _read_ready(slot)
    return info if info is not None and process_alive(info.get("pid")) else None


def _read_ready(slot: Slot) -> Optional[dict]:
    """The info the slot's last server wrote when it became ready (``<slot>.json``), alive or not."""
    try:
        return json.loads(slot.path(".json").read_text())
    except (OSError, ValueError):
        return None


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


def _connect(slot: Slot, info: dict) -> Any:
    from multiprocessing.connection import Client

    return Client(str(slot.path(".sock")), family="AF_UNIX", authkey=info["authkey"].encode())


def _connect_or_gone(slot: Slot, info: dict) -> Any:
    """A connection to the server that was ready, or None when it has ended since (the slot's other feeder's first
    request may have killed it): the task's first call finds it gone (:class:`EngineGone`) and starts the next."""
    try:
        return _connect(slot, info)
    except (OSError, EOFError):
        return None


@contextlib.contextmanager
def engine_for(spec: Any, gpus: Optional[Sequence[str]], process: ProcessSettings, run_id: str = "",
               cpu_slots: Optional[int] = None, feeds: int = 1) -> Iterator[EngineClient]:
    """The engine of this task's slot for ``spec`` (an :class:`~spark_llm.engine.EngineSpec`): the running one,
    the one already starting (:func:`prestart`, or another feeder's start), or one started now (stopping whatever
    else holds the slot's devices first); a feed of the slot is held until the block ends (see :func:`hold_feed`
    for ``cpu_slots`` and ``feeds``). An engine that could not start for these settings on this executor during run
    ``run_id`` is not tried again in that run."""
    failed = engine_dir() / f"start-failed-{executor_id()}-{spec.key}-{run_id}.txt"
    if failed.exists():  # a retried task of the run: the same settings failed here already, do not load again
        raise EngineStartError(failed.read_text())
    with hold_feed(gpus, cpu_slots, feeds) as feed:
        t0 = time.monotonic()
        try:
            info, started, awaited = _serving(feed.slot, spec, process)
        except EngineStartError as exc:
            failed.write_text(str(exc))
            raise
        conn = _connect_or_gone(feed.slot, info)
        client = EngineClient(feed, info, started, time.monotonic() - t0 if awaited else 0.0, conn, spec, process)
        try:
            yield client
        finally:
            client.close()


def _serving(slot: Slot, spec: Any, process: ProcessSettings,
             dead: Optional[int] = None) -> tuple[dict, bool, bool]:
    """The info of ``slot``'s engine server for ``spec``, ready: the running one, the one starting, else one started
    now; whether this call started it, and whether it waited for it to load. ``dead``: the pid of a server whose
    engine died (or went) under the caller, which is never the answer (a lingering one is stopped). Decided under
    the slot's start lock, so the feeders of a slot start one engine between them; the wait for it to load is
    outside the lock."""
    fd = _lock(slot.path(".start.lock"))
    try:
        info = _read_info(slot)
        if info is not None and info.get("key") == spec.key and info.get("pid") != dead:
            try:
                _connect(slot, info).close()
                return info, False, False
            except Exception:  # on its way out (its executor just ended): start a fresh one
                pass
        starting = _starting(slot)
        if starting is not None and starting.get("key") == spec.key and starting.get("pid") != dead:
            pid, proc = int(starting["pid"]), None
        else:
            stop_engines_on(slot)
            proc = _spawn_server([slot], spec, process)
            pid = proc.pid
    finally:
        os.close(fd)
    return _await_server(slot, pid, proc), proc is not None, True


@dataclass(frozen=True)
class Executor:
    """The executor an engine serves, for a process that is not one of its Python workers (a local session's
    driver): its JVM's pid (the engine ends with it) and the environment its Python workers get."""

    pid: int
    environ: Mapping[str, str]


def prestart(spec: Any, process: ProcessSettings, slot: Slot, executor: Optional[Executor] = None) -> bool:
    """Start ``slot``'s engine for ``spec`` loading and return at once (the warm-up of local masters: engines load
    while the driver prepares the batch); the first task that needs it waits for it in :func:`engine_for`. Nothing
    is started when the engine runs or is starting already, or while a task is starting one. Returns whether one
    was started. ``executor``: the executor's, when this process is not one of its Python workers."""
    return bool(prestart_slots(spec, process, [slot], executor))


def prestart_slots(spec: Any, process: ProcessSettings, slots: Sequence[Slot],
                   executor: Optional[Executor] = None) -> list[Slot]:
    """:func:`prestart` for several slots of one executor at once; returns the slots whose engines it started. CPU
    slots started together share one process, which imports vLLM once and forks an engine process per slot
    (``engine_server --slot A --slot B``): most of an engine's start on a CPU is its imports, which would
    otherwise run once per slot on the cores all of them load on. GPU slots each get a process of their own."""
    locks, started = [], []
    try:
        for slot in slots:
            fd = _try_lock(slot.path(".start.lock"))
            if fd is None:
                continue
            locks.append(fd)
            if any(x is not None and x.get("key") == spec.key for x in (_read_info(slot), _starting(slot))):
                continue
            stop_engines_on(slot)
            started.append(slot)
        cpu = [s for s in started if not s.devices]
        for group in ([cpu] if cpu else []) + [[s] for s in started if s.devices]:
            _spawn_server(group, spec, process, executor)
    finally:
        for fd in locks:
            os.close(fd)
    return started


def stop_engines_on(slot: Slot) -> None:
    """Stop every live server of this slot or of any slot sharing one of its devices, ready or still starting, and
    wait until they are gone (they release their device locks when their process ends)."""
    for record in sorted(engine_dir().glob("*.json")) + sorted(engine_dir().glob("*.starting")):
        name = record.name.rsplit(".", 1)[0]
        info = _read_info(Slot(name)) if record.suffix == ".json" else _starting(Slot(name))
        other = Slot(name, tuple((info or {}).get("devices") or ()))
        if info is None or not (other.name == slot.name or set(other.devices) & set(slot.devices)):
            continue
        log.info("stopping engine %s (pid %d) to free slot %s", other.name, info["pid"], slot.name)
        if record.suffix == ".json":
            with contextlib.suppress(Exception):
                conn = _connect(other, info)
                conn.send(("shutdown",))
        else:  # not listening yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(info["pid"], signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while process_alive(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if process_alive(info["pid"]):
            os.kill(info["pid"], signal.SIGKILL)


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


def _spawn_server(slots: Sequence[Slot], spec: Any, process: ProcessSettings,
                  executor: Optional[Executor] = None) -> subprocess.Popen:
    """Start the engine server of ``slots`` (one slot, or several CPU slots whose servers the process forks once it
    has imported vLLM), each recorded as starting (``<slot>.starting``: the process's pid, key and devices) until it
    is ready (``<slot>.json``); they serve this process's executor, or ``executor``."""
    from .engine import apply_worker_env

    first = slots[0]
    if len(slots) > 1 and any(s.devices for s in slots):
        raise ValueError("only CPU slots share an engine server's start")
    for slot in slots:
        for suffix in (".json", ".error", ".sock", ".starting"):
            with contextlib.suppress(FileNotFoundError):
                slot.path(suffix).unlink()
    spec_file = first.path(".spec")
    spec_file.write_text(json.dumps(spec.settings, default=str))
    env = dict(executor.environ if executor is not None else os.environ)
    apply_worker_env(env)
    env.update(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_LOGGING_LEVEL=process.engine_log_level)
    if first.devices:  # Spark's addresses are nvidia-smi's indices: PCI bus order, not CUDA's default order
        env["CUDA_VISIBLE_DEVICES"] = ",".join(first.devices)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    cmd = [sys.executable, "-m", "spark_llm.engine_server", *[a for s in slots for a in ("--slot", s.name)],
           "--devices", ",".join(first.devices), "--spec-file", str(spec_file), "--key", spec.key,
           "--watch-pid", str(executor.pid if executor is not None else executor_pid()),
           "--idle-timeout", str(process.engine_idle_timeout_seconds or 0)]
    with open(first.path(".log"), "ab") as logf:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    for slot in slots:
        _write_private(slot.path(".starting"), {"pid": proc.pid, "key": spec.key, "devices": list(slot.devices),
                                                "started_at": time.time()})
    return proc


def _starting(slot: Slot) -> Optional[dict]:
    """The slot's server that is starting (pid, key, devices), if its process is alive."""
    record = _starting_record(slot)
    return record if record is not None and process_alive(record.get("pid")) else None


def _starting_record(slot: Slot) -> Optional[dict]:
    """The slot's record of a server starting, alive or not: the process started for it, or the engine process
    forked for it by that one (then with ``launcher``, the pid of the process that forked it)."""
    try:
        return json.loads(slot.path(".starting").read_text())
    except (OSError, ValueError):
        return None


def _await_server(slot: Slot, pid: int, proc: Optional[subprocess.Popen] = None) -> dict:
    """Wait until the slot's server ``pid`` (or the one it forked for the slot) is ready and return its info; its
    reason when it could not start. A server that became ready counts as started even when it has ended since (a
    request of the slot's other feeder can kill it between two looks): the caller's first call finds it gone."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (info := _ready_from(slot, pid)) is not None:
            return info
        if not _still_starting(slot, pid, proc):
            if (info := _ready_from(slot, pid)) is not None:  # it wrote its info and its record went since
                return info
            try:
                reason = slot.path(".error").read_text().strip()
            except OSError:
                code = f" with code {proc.returncode}" if proc is not None and proc.returncode else ""
                reason = f"the engine process exited{code}; see {slot.path('.log')}"
            raise EngineStartError(reason)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    raise EngineStartError(f"the engine of slot {slot.name} did not start within {_START_TIMEOUT_S:.0f}s; see "
                           f"{slot.path('.log')}")


def _ready_from(slot: Slot, pid: int) -> Optional[dict]:
    """The slot's ready info when server ``pid`` (or the engine process it forked for the slot) wrote it."""
    info = _read_ready(slot)
    return info if info is not None and pid in (info.get("pid"), info.get("launcher")) else None


def _still_starting(slot: Slot, pid: int, proc: Optional[subprocess.Popen]) -> bool:
    """Whether the server ``pid`` started for ``slot`` may still become ready: the process forked for the slot when
    ``pid`` forked one (the slot's record names it), else ``pid`` itself. Looked at in that order, since a launcher
    rewrites the record before it exits."""
    alive = proc.poll() is None if proc is not None else process_alive(pid)
    record = _starting_record(slot)
    if record is not None and record.get("launcher") == pid:
        return process_alive(record.get("pid"))
    return alive


def _write_private(path: Path, record: dict) -> None:
    """Write a small JSON record readable by this user only, complete or not at all (temp file and rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_events(directory: Optional[Path] = None) -> list[dict]:
    """The servers' records (``events.jsonl``) of an engine directory."""
    path = (directory or engine_dir()) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


