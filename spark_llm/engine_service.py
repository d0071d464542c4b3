"""One vLLM engine per device slot of a host, in a process of its own, for the life of the executor.

Spark hands a Python worker different GPUs from task to task, recycles idle workers, and a CUDA context cannot move
to another device once made; an engine that lives in the worker would be rebuilt on most tasks and could end up
twice on one GPU. So the engine lives beside the workers:

- A **slot** is what a task owns while it runs: the GPU addresses Spark assigned it (``gpu-0``, ``gpu-2,3`` for a
  tensor-parallel group), or, without GPU scheduling, the first free ``cpu-N`` of the host. The task holds the slot's
  file lock for as long as it uses the engine, so one task at a time talks to a slot's engine.
- An **engine server** (``python -m spark_llm.engine_service``) serves one slot: started by the first task that needs
  it, in a new session (it outlives Python worker recycling) and a clean process (CUDA and vLLM's tensor-parallel
  workers start from nothing; ``spawn`` for vLLM's own processes), with ``CUDA_VISIBLE_DEVICES`` set to the slot's
  devices. It holds a file lock on each of its devices for its whole life, so two engines are never on one device:
  a server for other settings or another grouping of those devices is asked to stop, and waited for, first.
- Tasks send token ids and sampling settings over a Unix socket and get plain outputs back; a request the engine
  rejects is isolated there (:func:`~spark_llm.infer.generate_isolating`) and comes back as that request's error.
- An engine that cannot start is remembered for the rest of the run (per executor and settings), so the task's
  retries fail at once instead of loading the model again for each attempt; the next run tries again.
- A server stops when the executor that started it is gone, after ``engine_idle_timeout_seconds`` without requests,
  when asked, or when its engine dies. It writes what it does to ``events.jsonl`` in the engine directory (one JSON
  line per start, ready and stop), which the tests read as the engine's own records.

The engine directory is per host: ``SPARK_LLM_ENGINE_DIR``, default ``<tmp>/spark_llm-engines-<uid>``. Where GPU
addresses are container-relative (YARN, Kubernetes), each container has its own tmp or should set its own directory.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from .errors import EngineStartError

log = logging.getLogger(__name__)

ENGINE_DIR_ENV = "SPARK_LLM_ENGINE_DIR"
_START_TIMEOUT_S = 1800.0   # an 8B model with CUDA graphs takes minutes; a 70B one longer
#: Requests per message of a streamed call: the engine starts on the first chunk while the rest are on their way.
STREAM_CHUNK = 256
#: Version of what crosses the socket, part of every engine's key: a task never talks to an engine server of an
#: older spark_llm that may still be running on the host.
PROTOCOL = 2
_STOP_TIMEOUT_S = 120.0


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
        """CPU slot ``n`` of this executor, or of the executor JVM ``executor`` (executors sharing a host never
        share a CPU engine)."""
        return cls(f"cpu-{executor or executor_pid()}-{n}")

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


@contextlib.contextmanager
def hold_slot(gpus: Optional[Sequence[str]], cpu_slots: Optional[int] = None) -> Iterator[Slot]:
    """The slot of this task, held (file lock) until the block ends: its GPUs' slot, else a free ``cpu-N``, of the
    first ``cpu_slots`` when given (the task waits for one to be free)."""
    if gpus:
        slot = Slot.for_gpus(gpus)
        fd = _try_lock(slot.path(".slot.lock"))
        if fd is None:
            raise EngineStartError(
                f"GPU(s) {','.join(slot.devices)} of this host are in use by another Spark task; two executors on one "
                f"host must not be given the same GPU addresses (check the discovery script and "
                f"spark.worker.resource.gpu.* / the resource manager's GPU isolation)")
    else:
        n = 0
        while (fd := _try_lock(Slot.cpu(n).path(".slot.lock"))) is None:
            n += 1
            if cpu_slots and n >= cpu_slots:  # all taken: try again from the first
                n = 0
                time.sleep(0.05)
        slot = Slot.cpu(n)
    try:
        yield slot
    finally:
        os.close(fd)


# ---- the client: a task's view of its slot's engine ----------------------------------------------------------

@dataclass
class EngineClient:
    slot: Slot
    info: dict              #: the server's info: pid, key, devices, load_seconds
    started_here: bool      #: this task started the server
    #: seconds this task waited for the slot's engine to load (its own start, or one already under way)
    waited_seconds: float = 0.0
    _conn: Any = field(repr=False, default=None)
    _spec: Any = field(repr=False, default=None)
    _process: Any = field(repr=False, default=None)
    rebuilds: int = 0       #: engines this task started again after one died under it
    rebuild_seconds: float = 0.0  #: seconds this task spent rebuilding dead engines

    @property
    def load_seconds(self) -> float:
        """Seconds this task waited for engines to load: 0 when its slot's engine was ready."""
        return self.waited_seconds + self.rebuild_seconds

    def rebuild(self) -> None:
        """Start the slot's engine again after it died (:class:`EngineDied`), in place: the task keeps its slot."""
        self.close()
        stop_engines_on(self.slot)  # a server whose engine is dead but whose process lingers
        self.info = _start_server(self.slot, self._spec, self._process)
        self.rebuild_seconds += float(self.info.get("load_seconds", 0.0))
        self._conn = _connect(self.slot, self.info)
        self.rebuilds += 1

    def generate(self, requests: list[tuple[list[int], dict, dict]]) -> list[Output | RequestFailure]:
        """One result per (prompt token ids, SamplingParams keyword arguments, what to parse out of the answer:
        ``{"reasoning": bool, "tools": [...]}``), in order."""
        results: list = [None] * len(requests)
        self.stream(requests, results.__setitem__)
        return results

    def stream(self, requests: list[tuple[list[int], dict, dict]],
               on_result: Callable[[int, "Output | RequestFailure"], None]) -> None:
        """:meth:`generate`, streamed: ``on_result(index, result)`` as each request finishes (in the order they
        finish), while the engine goes on with the rest; the requests go over in chunks, the first of which the
        engine starts on while the others are on their way."""
        try:
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
        if status != "done":
            raise RuntimeError(f"engine of slot {self.slot.name}: {value}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()


def _read_info(slot: Slot) -> Optional[dict]:
    try:
        info = json.loads(slot.path(".json").read_text())
    except (OSError, ValueError):
        return None
    return info if process_alive(info.get("pid")) else None


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


@contextlib.contextmanager
def engine_for(spec: Any, gpus: Optional[Sequence[str]], process: ProcessSettings,
               run_id: str = "", cpu_slots: Optional[int] = None) -> Iterator[EngineClient]:
    """The engine of this task's slot for ``spec`` (an :class:`~spark_llm.engine.EngineSpec`): the running one,
    the one already starting (:func:`prestart`), or one started now (stopping whatever else holds the slot's
    devices first); the slot is held until the block ends. Without GPUs, ``cpu_slots`` bounds the engines of the
    executor (see :func:`hold_slot`). An engine that could not start for these settings on this executor during run
    ``run_id`` is not tried again in that run."""
    failed = engine_dir() / f"start-failed-{executor_pid()}-{spec.key}-{run_id}.txt"
    if failed.exists():  # a retried task of the run: the same settings failed here already, do not load again
        raise EngineStartError(failed.read_text())
    with hold_slot(gpus, cpu_slots) as slot:
        t0 = time.monotonic()
        info = _read_info(slot)
        conn = None
        if info is not None and info.get("key") == spec.key:
            try:
                conn = _connect(slot, info)
            except Exception:  # on its way out (its executor just ended): start a fresh one
                conn = None
        started, waited = False, 0.0
        if conn is None:
            starting = _starting(slot)
            try:
                if starting is not None and starting.get("key") == spec.key:
                    info = _await_server(slot, int(starting["pid"]))
                else:
                    stop_engines_on(slot)
                    info = _start_server(slot, spec, process)
                    started = True
            except EngineStartError as exc:
                failed.write_text(str(exc))
                raise
            conn = _connect(slot, info)
            waited = time.monotonic() - t0
        client = EngineClient(slot, info, started, waited, conn, spec, process)
        try:
            yield client
        finally:
            client.close()


@dataclass(frozen=True)
class Executor:
    """The executor an engine serves, for a process that is not one of its Python workers (a local session's
    driver): its JVM's pid (the engine ends with it) and the environment its Python workers get."""

    pid: int
    environ: Mapping[str, str]


def prestart(spec: Any, process: ProcessSettings, slot: Slot, executor: Optional[Executor] = None) -> bool:
    """Start ``slot``'s engine for ``spec`` loading and return at once (the warm-up of local masters: engines load
    while the driver prepares the batch); the first task that needs it waits for it in :func:`engine_for`. Nothing
    is started when the engine runs or is starting already, or when a task holds the slot. Returns whether one was
    started. ``executor``: the executor's, when this process is not one of its Python workers."""
    fd = _try_lock(slot.path(".slot.lock"))
    if fd is None:
        return False
    try:
        info = _read_info(slot)
        starting = _starting(slot)
        if any(x is not None and x.get("key") == spec.key for x in (info, starting)):
            return False
        stop_engines_on(slot)
        _spawn_server(slot, spec, process, executor)
        return True
    finally:
        os.close(fd)


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
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        while process_alive(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if process_alive(info["pid"]):
            os.kill(info["pid"], signal.SIGKILL)


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


def _start_server(slot: Slot, spec: Any, process: ProcessSettings) -> dict:
    """Start the slot's engine server and wait until it is ready; its info."""
    proc = _spawn_server(slot, spec, process)
    return _await_server(slot, proc.pid, proc)


def _spawn_server(slot: Slot, spec: Any, process: ProcessSettings,
                  executor: Optional[Executor] = None) -> subprocess.Popen:
    """Start the slot's engine server, recorded as starting (``<slot>.starting``: its pid, key and devices) until
    it is ready (``<slot>.json``); it serves this process's executor, or ``executor``."""
    from .engine import apply_worker_env

    for suffix in (".json", ".error", ".sock", ".starting"):
        with contextlib.suppress(FileNotFoundError):
            slot.path(suffix).unlink()
    spec_file = slot.path(".spec")
    spec_file.write_text(json.dumps(spec.settings, default=str))
    env = dict(executor.environ if executor is not None else os.environ)
    apply_worker_env(env)
    env.update(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_LOGGING_LEVEL=process.engine_log_level)
    if slot.devices:  # Spark's addresses are nvidia-smi's indices: PCI bus order, not CUDA's default order
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.devices)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    cmd = [sys.executable, "-m", "spark_llm.engine_service", "--slot", slot.name, "--devices", ",".join(slot.devices),
           "--spec-file", str(spec_file), "--key", spec.key,
           "--watch-pid", str(executor.pid if executor is not None else executor_pid()),
           "--idle-timeout", str(process.engine_idle_timeout_seconds or 0)]
    with open(slot.path(".log"), "ab") as logf:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    _write_private(slot.path(".starting"), {"pid": proc.pid, "key": spec.key, "devices": list(slot.devices),
                                            "started_at": time.time()})
    return proc


def _starting(slot: Slot) -> Optional[dict]:
    """The slot's server that is starting (pid, key, devices), if its process is alive."""
    try:
        record = json.loads(slot.path(".starting").read_text())
    except (OSError, ValueError):
        return None
    return record if process_alive(record.get("pid")) else None


def _await_server(slot: Slot, pid: int, proc: Optional[subprocess.Popen] = None) -> dict:
    """Wait until the slot's server ``pid`` is ready and return its info; its reason when it could not start."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _read_info(slot)
        if info is not None and info.get("pid") == pid:
            return info
        if (proc.poll() is not None) if proc is not None else not process_alive(pid):
            try:
                reason = slot.path(".error").read_text().strip()
            except OSError:
                code = f" with code {proc.returncode}" if proc is not None else ""
                reason = f"the engine process exited{code}; see {slot.path('.log')}"
            raise EngineStartError(reason)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    raise EngineStartError(f"the engine of slot {slot.name} did not start within {_START_TIMEOUT_S:.0f}s; see "
                           f"{slot.path('.log')}")


def _write_private(path: Path, record: dict) -> None:
    """Write a small JSON record readable by this user only, complete or not at all (temp file and rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


# ---- the server ----------------------------------------------------------------------------------------------

def _event(**record: Any) -> None:
    line = json.dumps({"time": time.time(), **record}) + "\n"
    with open(engine_dir() / "events.jsonl", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)


class _Server:
    def __init__(self, slot: Slot, key: str, watch_pid: int, idle_timeout: float):
        self.slot, self.key, self.watch_pid, self.idle_timeout = slot, key, watch_pid, idle_timeout
        self.engine: Any = None
        self.parsers: Any = None
        self.pooling = False  #: an embedding engine (vLLM's pooling runner)
        self.adapters: dict[Optional[str], Any] = {}  #: adapter name -> vLLM LoRARequest (None: the base model)
        self.busy = False
        self.last_used = time.monotonic()
        self.lock = threading.Lock()

    def stop(self, reason: str, code: int = 0) -> None:
        """Leave: remove our files, record why, release the devices (the process ends)."""
        with contextlib.suppress(Exception):
            info = json.loads(self.slot.path(".json").read_text())
            if info.get("pid") == os.getpid():
                self.slot.path(".json").unlink()
                self.slot.path(".sock").unlink()
        _event(event="stop", slot=self.slot.name, devices=list(self.slot.devices), pid=os.getpid(), key=self.key,
               reason=reason)
        if self.engine is not None:
            from .engine import shutdown_engine

            shutdown_engine(self.engine)
        os._exit(code)

    def watch(self) -> None:
        while True:
            time.sleep(1.0)
            if not process_alive(self.watch_pid):
                with self.lock:
                    self.stop("executor gone")
            idle = time.monotonic() - self.last_used
            if self.idle_timeout and not self.busy and idle > self.idle_timeout:
                with self.lock:
                    self.stop(f"idle for {idle:.0f}s")

    def generate(self, requests: list[tuple[list[int], dict, dict]]) -> list:
        """Results of ``requests`` from one blocking engine call; a request the engine rejects is found by bisection
        (:func:`~spark_llm.infer.generate_isolating`) and becomes its failure. For pooling engines and for what is
        left of a stream after the engine raised (:meth:`stream`)."""
        from .endpoints.engine_side import sampling_params
        from .infer import generate_isolating, is_fatal

        results: list = [None] * len(requests)
        prompts, params, adapters, index = [], [], [], []
        for i, (ids, sampling, options) in enumerate(requests):
            try:
                params.append(sampling_params(sampling, self.pooling))
            except Exception as exc:
                results[i] = RequestFailure("invalid", f"{type(exc).__name__}: {exc}")
                continue
            prompts.append({"prompt_token_ids": ids})
            adapters.append(self.adapters.get(options.get("adapter")))
            index.append(i)
        # the adapter of each request rides with its sampling settings, so that bisection keeps them paired
        paired = list(zip(params, adapters))

        def run(p: list, s: list) -> list:
            lora = [a for _, a in s] if any(a is not None for _, a in s) else None
            if self.pooling:
                return self.engine.embed(p, pooling_params=[x for x, _ in s], lora_request=lora, use_tqdm=False)
            return self.engine.generate(p, [x for x, _ in s], lora_request=lora, use_tqdm=False)
        outs = generate_isolating(run, prompts, paired)
        for i, out in zip(index, outs):
            if isinstance(out, BaseException):
                if is_fatal(out):
                    raise out
                results[i] = RequestFailure("engine", f"{type(out).__name__}: {out}")
                continue
            results[i] = self._result(out, requests[i][2])
        return results

    def _result(self, out: Any, parse: dict) -> "Output | RequestFailure":
        """A finished vLLM output as what crosses the socket, its answers parsed as ``parse`` asks."""
        result = _plain(out)
        try:
            for choice in result.outputs:
                self.parsers.parse(choice, parse)
        except Exception as exc:  # a parser bug on one odd answer is that request's error, not the batch's
            return RequestFailure("engine", f"parsing the answer failed: {type(exc).__name__}: {exc}")
        return result

    def stream(self, conn: Any, total: int) -> None:
        """One engine call, streamed. The requests arrive in chunks (``("add", [(index, request), ...])``,
        ``total`` requests in all) and join the running engine as they come; each result goes back as soon as its
        request finishes (``("results", [(index, result), ...])``), from a thread of its own, so the engine never
        waits for the socket or the task; then ``("done", None)``."""
        sender = _Sender(conn)
        try:
            if self.pooling:  # vLLM's pooling runner takes whole calls only
                chunk = _receive(conn, total)
                sender.put(("results", list(zip([i for i, _ in chunk], self.generate([r for _, r in chunk])))))
            else:
                self._stream(conn, total, sender)
            sender.put(("done", None))
        finally:
            sender.close()

    def _stream(self, conn: Any, total: int, sender: "_Sender") -> None:
        from .infer import is_fatal

        engine = self.engine.llm_engine
        flight: dict[str, tuple[int, tuple, str]] = {}  # vLLM's request id -> (index, request, internal id)
        received = 0
        try:
            while received < total or flight:
                if sender.gone:  # the task is gone (its worker died): nobody wants the rest
                    return
                while received < total and (not flight or conn.poll(0)):  # take what has arrived
                    op, chunk = conn.recv()
                    received += len(chunk)
                    failed = self._enqueue(chunk, flight)
                    if failed:
                        sender.put(("results", failed))
                if not flight:
                    continue
                try:
                    outs = engine.step()
                except Exception as exc:
                    if is_fatal(exc):
                        raise
                    # which request the engine choked on is not known: the rest of the call runs isolating
                    log.warning("engine step failed (%s: %s); isolating the %d request(s) in flight",
                                type(exc).__name__, exc, len(flight))
                    rest = [(i, r) for i, r, _ in flight.values()] + _receive(conn, total - received)
                    engine.abort_request([internal for _, _, internal in flight.values()], internal=True)
                    flight.clear()
                    sender.put(("results", list(zip([i for i, _ in rest], self.generate([r for _, r in rest])))))
                    return
                done = [(entry[0], self._result(out, entry[1][2])) for out in outs if out.finished
                        for entry in [flight.pop(out.request_id, None)] if entry is not None]
                if done:
                    sender.put(("results", done))
        finally:
            if flight:  # a call cut short: its requests must not linger in the engine
                with contextlib.suppress(Exception):
                    engine.abort_request([internal for _, _, internal in flight.values()], internal=True)

    def _enqueue(self, chunk: list, flight: dict) -> list:
        """Add a chunk of requests to the engine (``flight`` gets their vLLM ids); returns the failures of those
        it refused, each found by adding the chunk's requests one by one when the chunk as a whole was refused."""
        from .endpoints.engine_side import sampling_params
        from .infer import is_fatal

        failed, ready = [], []
        for index, request in chunk:
            try:
                ready.append((index, request, sampling_params(request[1])))
            except Exception as exc:
                failed.append((index, RequestFailure("invalid", f"{type(exc).__name__}: {exc}")))

        def add(items: list) -> None:
            loras = [self.adapters.get(r[2].get("adapter")) for _, r, _ in items]
            ids = self.engine.enqueue([{"prompt_token_ids": r[0]} for _, r, _ in items], [p for _, _, p in items],
                                      lora_request=loras if any(a is not None for a in loras) else None,
                                      use_tqdm=False)
            for internal, (index, request, _) in zip(ids, items):
                # outputs carry the id the request was added with; vLLM's own id has a random suffix after it
                flight[internal.split("-", 1)[0]] = (index, request, internal)
        try:
            if ready:
                add(ready)
        except Exception as exc:
            if is_fatal(exc):
                raise
            for item in ready:
                try:
                    add([item])
                except Exception as one:
                    if is_fatal(one):
                        raise
                    failed.append((item[0], RequestFailure("engine", f"{type(one).__name__}: {one}")))
        return failed

    def serve_connection(self, conn: Any) -> None:
        try:
            self.handle(conn)
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def handle(self, conn: Any) -> None:
        from .infer import is_fatal

        while True:
            try:
                op, *args = conn.recv()
            except (EOFError, OSError):
                return
            if op == "shutdown":
                with contextlib.suppress(Exception):
                    conn.send(("ok", None))
                with self.lock:
                    self.stop("asked to stop")
            with self.lock:
                self.busy = True
                try:
                    if op == "stream":
                        self.stream(conn, *args)
                    else:
                        conn.send(("error", f"unknown op {op!r}"))
                except Exception as exc:
                    fatal = is_fatal(exc)
                    message = f"{type(exc).__name__}: {exc}" + (" (the engine is dead)" if fatal else "")
                    with contextlib.suppress(Exception):
                        conn.send(("dead" if fatal else "error", message))
                    if fatal:
                        self.stop(f"engine dead: {exc}", code=1)
                finally:
                    self.busy = False
                    self.last_used = time.monotonic()


class _Sender:
    """Sends a stream's messages from a thread of its own, in order, so the engine never waits for the socket or the
    task; notes when the client has gone. Messages are pickled by the caller (the engine loop, between steps): the
    thread only writes bytes, which releases the GIL, so it does not slow the engine down."""

    def __init__(self, conn: Any):
        self.conn, self.gone = conn, False
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="results", daemon=True)
        self.thread.start()

    def put(self, message: Any) -> None:
        self.queue.put(bytes(ForkingPickler.dumps(message)))  # what Connection.recv reads

    def _run(self) -> None:
        while (payload := self.queue.get()) is not None:
            if self.gone:
                continue
            try:
                self.conn.send_bytes(payload)
            except (OSError, EOFError, ValueError):
                self.gone = True

    def close(self) -> None:
        """Send what is queued, then stop."""
        self.queue.put(None)
        self.thread.join()


def _receive(conn: Any, count: int) -> list:
    """The next ``count`` requests of a stream (``("add", chunk)`` messages)."""
    got: list = []
    while len(got) < count:
        op, chunk = conn.recv()
        got.extend(chunk)
    return got


def serve(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spark_llm.engine_service")
    p.add_argument("--slot", required=True)
    p.add_argument("--devices", default="")
    p.add_argument("--spec-file", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--watch-pid", type=int, required=True)
    p.add_argument("--idle-timeout", type=float, default=0.0)
    args = p.parse_args(argv)
    slot = Slot(args.slot, tuple(d for d in args.devices.split(",") if d))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d]: %(message)s")
    server = _Server(slot, args.key, args.watch_pid, args.idle_timeout)
    device_locks = []
    for device in slot.devices:  # held until the process ends: never two engines on one device
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        while (fd := _try_lock(engine_dir() / f"device-{device}.lock")) is None:
            if time.monotonic() > deadline:
                slot.path(".error").write_text(f"GPU {device} is still held by another engine process after "
                                               f"{_STOP_TIMEOUT_S:.0f}s; see {engine_dir()}")
                server.stop("device busy", code=1)
            time.sleep(0.2)
        device_locks.append(fd)
    _event(event="start", slot=slot.name, devices=list(slot.devices), pid=os.getpid(), key=args.key)
    threading.Thread(target=server.watch, name="watch", daemon=True).start()

    from .endpoints.engine_side import Parsers
    from .engine import EngineSpec, build_engine

    spec = EngineSpec(settings=json.loads(Path(args.spec_file).read_text()))
    t0 = time.monotonic()
    try:
        server.engine = build_engine(spec)
        server.pooling = spec.settings.get("runner") == "pooling"
        server.adapters = lora_requests(spec.settings.get("lora_modules") or {})
        server.parsers = Parsers(server.engine.get_tokenizer(), spec.settings.get("tool_call_parser"),
                                 spec.settings.get("reasoning_parser"))
    except EngineStartError as exc:
        slot.path(".error").write_text(str(exc))
        server.stop("engine could not start", code=1)
    load_s = time.monotonic() - t0

    from multiprocessing.connection import Listener

    authkey = os.urandom(16).hex()
    with contextlib.suppress(FileNotFoundError):
        slot.path(".sock").unlink()
    listener = Listener(str(slot.path(".sock")), family="AF_UNIX", authkey=authkey.encode())
    info = {"pid": os.getpid(), "slot": slot.name, "devices": list(slot.devices), "key": args.key,
            "load_seconds": round(load_s, 3), "authkey": authkey, "started_at": time.time()}
    _write_private(slot.path(".json"), info)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(slot.path(".starting").read_text()).get("pid") == os.getpid():
            slot.path(".starting").unlink()
    _event(event="ready", slot=slot.name, devices=list(slot.devices), pid=os.getpid(), key=args.key,
           load_seconds=round(load_s, 3))
    log.info("engine for slot %s ready in %.1fs", slot.name, load_s)
    while True:
        try:
            conn = listener.accept()
        except Exception:  # a client that failed authentication or vanished
            continue
        server.last_used = time.monotonic()
        # a thread per connection, so that a stop request is heard while a task is connected; engine calls are
        # serialised by the server's lock
        threading.Thread(target=server.serve_connection, args=(conn,), daemon=True).start()


def lora_requests(lora_modules: dict[str, str]) -> dict[Optional[str], Any]:
    """vLLM ``LoRARequest`` per adapter name, with stable integer ids (1, 2, ... in name order)."""
    if not lora_modules:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, n, os.path.abspath(path) if "://" not in path else path)
            for n, (name, path) in enumerate(sorted(lora_modules.items()), 1)}


def read_events(directory: Optional[Path] = None) -> list[dict]:
    """The servers' records (``events.jsonl``) of an engine directory."""
    path = (directory or engine_dir()) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    # run from the imported module, not from __main__: what crosses the socket must pickle as spark_llm's classes
    from spark_llm import engine_service

    sys.exit(engine_service.serve())

