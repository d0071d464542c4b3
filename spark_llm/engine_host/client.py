"""One vLLM engine per device slot of a host, in a process of its own, for the life of the executor; the tasks'
side of it (the engine process itself is :mod:`~spark_llm.engine_host.server`, what crosses the socket
:mod:`~spark_llm.engine_host.protocol`, the slots' files :mod:`~spark_llm.engine_host.directory`).

Spark hands a Python worker different GPUs from task to task, recycles idle workers, and a CUDA context cannot move
to another device once made; an engine that lives in the worker would be rebuilt on most tasks and could end up
twice on one GPU. So the engine lives beside the workers:

- A **slot** is an engine's place (:class:`~spark_llm.engine_host.directory.Slot`): the GPU addresses Spark
  assigned the task (``gpu-0``, ``gpu-2,3`` for a tensor-parallel group), a local master's GPU, or, without GPUs,
  ``cpu-<executor>-N``.
- A **feed** is what a task holds while it uses its slot's engine: one of the slot's ``feeds`` file locks, so that
  at most that many tasks feed one engine at once (``tasks_per_engine``: Spark gives that many tasks one GPU, see
  :func:`~spark_llm.engine_host.placement.engine_layout`; on a local master the task takes the first free feed of
  the host's slots (:class:`~spark_llm.engine_host.placement.TaskPlace`), every slot's first feed before any second
  one, and waits when all are taken). While one task's partition drains, the next task's requests already keep the
  engine busy. A partition with engine deaths on record takes every feed of its slot (:meth:`Feed.alone`), so that
  a death during its calls is its own.
- An **engine server** (``python -m spark_llm.engine_host.server``) serves one slot: started by the first task that
  needs it (under the slot's start lock, so two feeders never start two), in a new session (it outlives Python worker
  recycling) and a clean process (CUDA and vLLM's tensor-parallel workers start from nothing; ``spawn`` for vLLM's
  own processes), with ``CUDA_VISIBLE_DEVICES`` set to the slot's devices. It holds a file lock on each of its
  devices for its whole life, so two engines are never on one device: a server for other settings or another
  grouping of those devices is asked to stop, and waited for, first.
- Tasks send token ids and sampling settings over a Unix socket and get plain outputs back, each as it finishes; a
  request the engine rejects comes back as that request's error. An engine silent for
  ``engine_call_timeout_seconds`` during a call (a stepping one sends word every few seconds) is stopped as hung.
- An engine that cannot start is remembered for the rest of the run (per slot and settings), so the task's
  retries fail at once instead of loading the model again for each attempt; the next run tries again. A task whose
  own GPUs cannot start the engine (an ECC error, a leftover process holding the memory) feeds the ready engine of
  another GPU of the host instead (:func:`lender`), so the batch goes on on the GPUs that work: Spark gives a failed
  task's retry the same free GPU share first, and would spend ``spark.task.maxFailures`` on the bad GPU.
- A server stops when the executor that started it is gone (while it loads too), after
  ``engine_idle_timeout_seconds`` without requests (counted from its first), when asked, or when its engine dies.
  It writes what it does to the engine directory's ``events.jsonl``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from ..errors import EngineStartError
from ..host import is_process, lock, process_alive, try_lock, write_private
from .directory import (STOP_TIMEOUT_SECONDS, SlotFile, Slot, alive, copy_seconds, engine_dir, executor_pid,
                        process_record, start_failed_marker)
from .placement import TaskPlace, local_gpus, unscheduled_gpus
from .protocol import (STREAM_CHUNK, Ask, EngineDied, EngineFaulted, EngineGone, EngineRequest, Output, Reply,
                       RequestFailure, SlotRecord)
from .spec import EngineSpec, ProcessSettings, cache_env, engine_environment, home_writable

log = logging.getLogger(__name__)

#: Seconds a call waits for word from its engine where the settings do not say (engine_call_timeout_seconds).
CALL_TIMEOUT_SECONDS = 600.0


class EngineHung(EngineDied):
    """The engine sent nothing for the call timeout (it gets a heartbeat from a stepping engine every few seconds):
    it was stopped, and the requests in flight are suspects as after a death."""


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
                self._fds[j] = lock(self.slot.feed_lock(j))
            yield
        finally:
            for j in [j for j in self._fds if j != self.index]:
                os.close(self._fds.pop(j))
            if self.index not in self._fds:  # cut short while taking them
                self._fds[self.index] = lock(self.slot.feed_lock(self.index))

    def release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextlib.contextmanager
def hold_feed(place: TaskPlace) -> Iterator[Feed]:
    """A feed of this task's slot, held until the block ends (see :class:`TaskPlace`): every slot's first feed
    before any second one, waiting while every feed is taken (a task of the slot running alone, or more tasks than
    Spark should give these GPUs)."""
    if place.gpus or place.local_engines:
        slots = [Slot.for_gpus(place.gpus)] if place.gpus else place.local_slots()
        feeds = max(1, place.feeds)
        places = [(slot, index) for index in range(feeds) for slot in slots]
        while (taken := _take_first_free(places)) is None:
            time.sleep(0.05)
    else:
        if (why := unscheduled_gpus(place, local_gpus())) is not None:
            raise EngineStartError(why)
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
        fd = try_lock(slot.feed_lock(index))
        if fd is not None:
            return slot, index, fd
    return None


# ---- the client: a task's view of its slot's engine ----------------------------------------------------------

@dataclass
class EngineClient:
    feed: Feed              #: the task's feed of its slot
    info: SlotRecord        #: the ready server's record
    started_here: bool      #: this task started the server
    #: seconds this task waited for the slot's engine to load (its own start, or one already under way)
    waited_seconds: float = 0.0
    _conn: Any = field(repr=False, default=None)
    _spec: Optional[EngineSpec] = field(repr=False, default=None)
    _process: Optional[ProcessSettings] = field(repr=False, default=None)
    rebuilds: int = 0       #: engines this task started again after one died under it
    priority: int = 1       #: the calls' turn in the engine (0 most urgent: config.PRIORITIES' index)
    rebuild_seconds: float = 0.0  #: seconds this task spent waiting for dead engines to be rebuilt
    #: where the run remembers that the slot's engine cannot serve these settings (:func:`start_failed_marker`)
    failed_marker: Any = field(repr=False, default=None)

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
        self.info, _, awaited = _serving(self.slot, self._spec, self._process, dead=self.info.pid)
        self._conn = connect_or_gone(self.slot, self.info)
        if awaited:
            self.rebuild_seconds += time.monotonic() - t0
        self.rebuilds += died

    def failed_for_run(self, why: str) -> EngineStartError:
        """The engine cannot serve this run (it failed every request again after it was rebuilt): remembered for the
        run's later tasks on the slot, which then fail at once instead of building it again; the error that stops
        the batch."""
        if self.failed_marker is not None:
            with contextlib.suppress(OSError):
                self.failed_marker.write_text(why)
        return EngineStartError(why)

    def generate(self, requests: list[EngineRequest]) -> list[Output | RequestFailure]:
        """One result per request, in order."""
        results: list = [None] * len(requests)
        self.stream(requests, results.__setitem__)
        return results

    def stream(self, requests: list[EngineRequest],
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
            self._conn.send((Ask.PING,))
            status, value = self._receive()
        except EngineHung as exc:  # nothing of the call was sent: find or start the slot's next engine
            raise EngineGone(str(exc)) from None
        except (EOFError, OSError):
            status, value = Reply.GONE, f"the engine process (pid {self.info.pid}) has ended"
        if status == Reply.GONE:
            raise EngineGone(f"engine of slot {self.slot.name}: {value}")
        try:
            if starting is not None:
                starting()
            self._conn.send((Ask.STREAM, len(requests), self.priority))
            for start in range(0, len(requests), STREAM_CHUNK):
                self._conn.send((Ask.ADD, [(i, requests[i]) for i in range(start, min(start + STREAM_CHUNK,
                                                                                       len(requests)))]))
            while True:
                status, value = self._receive()
                if status != Reply.RESULTS:
                    break
                for index, result in value:
                    on_result(index, result)
        except (EOFError, OSError) as exc:
            raise EngineDied(f"the engine process of slot {self.slot.name} (pid {self.info.pid}) died "
                             f"during a call ({type(exc).__name__}); see {self.slot.path(SlotFile.LOG)}") from None
        if status == Reply.DEAD:
            raise EngineDied(f"engine of slot {self.slot.name}: {value}")
        if status == Reply.FAULT:
            raise EngineFaulted(f"the engine of slot {self.slot.name}: {value}")
        if status == Reply.GONE:
            raise EngineGone(f"engine of slot {self.slot.name}: {value}")
        if status != Reply.DONE:
            raise RuntimeError(f"engine of slot {self.slot.name}: {value}")

    def _receive(self) -> tuple[str, Any]:
        """The engine's next message, waited for :attr:`~spark_llm.engine_host.spec.ProcessSettings.
        engine_call_timeout_seconds` at most; an engine silent that long is hung: it is stopped (the process
        recorded, no other) and :class:`EngineHung` raised."""
        timeout = getattr(self._process, "engine_call_timeout_seconds", None) or CALL_TIMEOUT_SECONDS
        if not self._conn.poll(timeout):
            signal_engine(self.info, signal.SIGKILL)
            raise EngineHung(f"the engine of slot {self.slot.name} (pid {self.info.pid}) sent nothing for "
                             f"{timeout:.0f}s and was stopped as hung (engine_call_timeout_seconds); see "
                             f"{self.slot.path(SlotFile.LOG)}")
        return self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()


def _connect(slot: Slot, info: SlotRecord) -> Any:
    from multiprocessing.connection import Client

    return Client(slot.socket(), family="AF_UNIX", authkey=(info.authkey or "").encode())


def connect_or_gone(slot: Slot, info: SlotRecord) -> Any:
    """A connection to the server that was ready, or None when it has ended since (the slot's other feeder's first
    request may have killed it): the task's first call finds it gone (:class:`EngineGone`) and starts the next."""
    try:
        return _connect(slot, info)
    except (OSError, EOFError):
        return None


@contextlib.contextmanager
def engine_for(spec: EngineSpec, process: ProcessSettings, place: TaskPlace,
               run_id: str = "", ahead: bool = False) -> Iterator[EngineClient]:
    """The engine of this task's slot (see :class:`TaskPlace`) for ``spec``: the running one, the one already
    starting (:func:`prestart`, or another feeder's start), or one started now (stopping whatever else holds the
    slot's devices first); a feed of the slot is held until the block ends. An engine that could not start for these
    settings on this slot during run ``run_id`` is not tried again in that run (its GPUs may be bad); where the
    executor has other GPUs, the task feeds one of their engines instead (:func:`borrowed_feed`). ``ahead``: the
    task only starts the engine for a batch still being prepared (the warm-up, the service's hold), so one it
    starts waits for its first call however long that takes (:meth:`~.server.EngineServer.ready`)."""
    with hold_feed(place) as feed, contextlib.ExitStack() as borrowed:
        failed = start_failed_marker(feed.slot, spec.key, run_id)
        t0 = time.monotonic()
        try:
            if failed.exists():  # a later task of the run: the same settings failed here already, do not load again
                raise EngineStartError(failed.read_text())
            try:
                info, started, awaited = _serving(feed.slot, spec, process, ahead=ahead)
            except EngineStartError as exc:
                failed.write_text(str(exc))
                raise
        except EngineStartError as exc:
            if not place.gpus or place.executor_engines < 2:
                raise
            feed = borrowed.enter_context(borrowed_feed(feed.slot, spec.key, str(exc),
                                                        process.engine_start_timeout_seconds))
            info, started, awaited = feed.slot.serving(), False, True
            if info is None:  # gone since it was chosen: the call finds or starts the next one (EngineGone)
                info = SlotRecord(0)
        conn = connect_or_gone(feed.slot, info)
        client = EngineClient(feed, info, started, time.monotonic() - t0 if awaited else 0.0, conn, spec, process,
                              failed_marker=start_failed_marker(feed.slot, spec.key, run_id))
        try:
            yield client
        finally:
            client.close()


#: Feed locks of a slot that tasks of other GPUs take when they feed its engine (:func:`borrowed_feed`): apart from
#: the slot's own feeds, so a borrower never holds up the tasks Spark gave the slot's GPUs.
BORROWED_FEEDS = range(1000, 1064)
#: Seconds between looks for an engine to borrow while none is ready.
BORROW_POLL_SECONDS = 0.5


def lender(own: Slot, key: str, here: Sequence[tuple[Slot, SlotRecord]]) -> Optional[Slot]:
    """The engine a task whose own GPUs could not start one feeds instead (:func:`engine_for`): a ready engine of
    ``here`` for the same settings ``key`` on other GPUs than ``own``'s, or None while there is none. Tasks of one
    bad slot go to one lender, those of different bad slots spread over the ready engines (by the slot's name)."""
    ready = sorted((slot for slot, info in here if info.listening and info.key == key and slot.devices
                    and not set(slot.devices) & set(own.devices)), key=lambda slot: slot.name)
    if not ready:
        return None
    return ready[int.from_bytes(own.name.encode(), "big") % len(ready)]


@contextlib.contextmanager
def borrowed_feed(own: Slot, key: str, why: str, timeout: float) -> Iterator[Feed]:
    """A feed of another GPU's engine for settings ``key`` (:func:`lender`), waited for while none is ready (the
    other GPUs' engines may still load), held until the block ends. :class:`EngineStartError` with ``why`` when none
    is ready within ``timeout``."""
    deadline = time.monotonic() + timeout
    while (other := lender(own, key, engines_here())) is None:
        if time.monotonic() > deadline:
            raise EngineStartError(f"{why}; no engine of another GPU of this host became ready within {timeout:.0f}s "
                                   f"to take the work of GPU(s) {','.join(own.devices)}")
        time.sleep(BORROW_POLL_SECONDS)
    while (taken := _take_first_free([(other, index) for index in BORROWED_FEEDS])) is None:
        time.sleep(BORROW_POLL_SECONDS)
    _, index, fd = taken
    log.warning("the engine of GPU(s) %s could not start (%s); this task feeds the engine of GPU(s) %s instead",
                ",".join(own.devices), why.splitlines()[0][:300], ",".join(other.devices))
    feed = Feed(other, index, 1, {index: fd})
    try:
        yield feed
    finally:
        feed.release()


def _serving(slot: Slot, spec: Any, process: ProcessSettings, dead: Optional[int] = None,
             ahead: bool = False) -> tuple[SlotRecord, bool, bool]:
    """The record of ``slot``'s engine server for ``spec``, ready: the running one, the one starting, else one started
    now; whether this call started it, and whether it waited for it to load. ``dead``: the pid of a server whose
    engine died (or went) under the caller, which is never the answer (a lingering one is stopped). Decided under
    the slot's start lock, so the feeders of a slot start one engine between them; the wait for it to load is
    outside the lock."""
    fd = lock(slot.path(SlotFile.START_LOCK))
    try:
        info = slot.serving()
        if info is not None and info.key == spec.key and info.pid != dead:
            try:
                _connect(slot, info).close()
                return info, False, False
            except Exception:  # on its way out (its executor just ended): start a fresh one
                pass
        starting = slot.starting()
        if starting is not None and starting.key == spec.key and starting.pid != dead:
            pid, proc = starting.pid, None
        else:
            stop_engines_on(slot)
            proc = _spawn_server([slot], spec, process, ahead=ahead)
            pid = proc.pid
    finally:
        os.close(fd)
    return await_server(slot, pid, proc, process.engine_start_timeout_seconds), proc is not None, True


@dataclass(frozen=True)
class Executor:
    """The executor an engine serves, for a process that is not one of its Python workers (a local session's
    driver): its JVM's pid (the engine ends with it) and the environment its Python workers get."""

    pid: int
    environ: Mapping[str, str]


def prestart(spec: Any, process: ProcessSettings, slot: Slot, executor: Optional[Executor] = None,
             run_id: str = "") -> bool:
    """Start ``slot``'s engine for ``spec`` loading and return at once (the warm-up of local masters: engines load
    while the driver prepares the batch); the first task that needs it waits for it in :func:`engine_for`. Nothing
    is started when the engine runs or is starting already, or while a task is starting one. Returns whether one
    was started. ``executor``: the executor's, when this process is not one of its Python workers. ``run_id``: the
    run it starts for, whose tasks then do not start it again if it cannot start (:func:`start_failed_marker`)."""
    return bool(prestart_slots(spec, process, [slot], executor, run_id))


def prestart_slots(spec: Any, process: ProcessSettings, slots: Sequence[Slot],
                   executor: Optional[Executor] = None, run_id: str = "") -> list[Slot]:
    """:func:`prestart` for several slots of one executor at once; returns the slots whose engines it started. CPU
    slots started together share one process, which imports vLLM once and forks an engine process per slot
    (``engine_host.server --slot A --slot B``): most of an engine's start on a CPU is its imports, which would
    otherwise run once per slot on the cores all of them load on. GPU slots each get a process of their own."""
    locks, started = [], []
    try:
        for slot in slots:
            fd = try_lock(slot.path(SlotFile.START_LOCK))
            if fd is None:
                continue
            locks.append(fd)
            if any(x is not None and x.key == spec.key for x in (slot.serving(), slot.starting())):
                continue
            stop_engines_on(slot)
            started.append(slot)
        cpu = [s for s in started if not s.devices]
        for group in ([cpu] if cpu else []) + [[s] for s in started if s.devices]:
            _spawn_server(group, spec, process, executor, run_id, ahead=True)
    finally:
        for fd in locks:
            os.close(fd)
    return started


def stop_engines_on(slot: Slot) -> None:
    """Stop every live server of this slot or of any slot sharing one of its devices, ready or still starting, and
    wait until they are gone (they release their device locks when their process ends)."""
    for other, info in engines_here():
        if other.name == slot.name or set(other.devices) & set(slot.devices):
            log.info("stopping engine %s (pid %d) to free slot %s", other.name, info.pid, slot.name)
            stop_engine(other, info)


def engines_here() -> list[tuple[Slot, SlotRecord]]:
    """This host's engine servers, ready or starting, whose process still runs (each slot once: its ready server,
    else the one starting)."""
    found: dict[str, tuple[Slot, SlotRecord]] = {}
    for suffix in (SlotFile.READY, SlotFile.STARTING):
        for path in sorted(engine_dir().glob(f"*{suffix}")):
            name = path.name[:-len(suffix)]
            slot = Slot(name)
            info = slot.serving() if suffix == SlotFile.READY else slot.starting()
            if info is not None and name not in found:
                found[name] = (Slot(name, info.devices), info)
    return list(found.values())


def stop_engines_here() -> list[str]:
    """Stop every engine of this host's engine directory (``spark-llm engines stop``; the GPUs of an interactive
    cluster back now rather than after the idle timeout); the slots stopped."""
    found = engines_here()
    for slot, info in found:
        stop_engine(slot, info)
    return [slot.name for slot, _ in found]


def stop_engine(slot: Slot, info: SlotRecord, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
    """Stop the engine server ``info`` (a ready one asked over its socket, one still starting by SIGTERM) and wait
    for its process to end, killing it after ``timeout``. A signal only ever goes to the process recorded, never to
    another that got its pid since (:func:`~spark_llm.engine_host.directory.alive`)."""
    pid, started = info.pid, info.pid_started
    asked = False
    if info.listening:
        with contextlib.suppress(Exception):
            _connect(slot, info).send((Ask.SHUTDOWN,))
            asked = True
    if not asked:
        signal_engine(info, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_process(pid, started) and time.monotonic() < deadline:
        time.sleep(0.2)
    signal_engine(info, signal.SIGKILL)


def signal_engine(info: SlotRecord, signum: int) -> bool:
    """Send ``signum`` to the engine process ``info`` names, if that process still runs and is the one recorded; a
    GPU engine's whole process group with it (it leads its own: its tensor-parallel workers are in it, and a kill of
    the server alone leaves them holding GPU memory). CPU slots started together share their launcher's group, so
    theirs are signalled one by one."""
    if alive(info) is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        if info.devices and os.getpgid(info.pid) == info.pid:
            os.killpg(info.pid, signum)
        else:
            os.kill(info.pid, signum)
        return True
    return False


def _spawn_server(slots: Sequence[Slot], spec: Any, process: ProcessSettings,
                  executor: Optional[Executor] = None, run_id: str = "", ahead: bool = False) -> subprocess.Popen:
    """Start the engine server of ``slots`` (one slot, or several CPU slots whose servers the process forks once it
    has imported vLLM), each recorded as starting (``<slot>.starting``: the process's pid, key and devices) until it
    is ready (``<slot>.json``); they serve this process's executor, or ``executor``. A server started ahead of a
    run's tasks (``run_id``) that cannot start records so for that run itself, for no task may be waiting on it.
    ``ahead``: started before any task calls it (:func:`prestart_slots`, ``engine_for(ahead=True)``), so its idle
    clock waits for a first call."""
    first = slots[0]
    if len(slots) > 1 and any(s.devices for s in slots):
        raise ValueError("only CPU slots share an engine server's start")
    for slot in slots:
        for suffix in (SlotFile.READY, SlotFile.ERROR, SlotFile.STARTING):
            with contextlib.suppress(FileNotFoundError):
                slot.path(suffix).unlink()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.socket())
    spec_file = first.path(SlotFile.SPEC)
    spec_file.write_text(spec.settings_json())
    environ = dict(executor.environ if executor is not None else os.environ)
    if caches := cache_env(environ, home_writable(environ), str(engine_dir() / "cache")):
        log.info("HOME (%s) is not writable: the engine's caches go under %s", environ.get("HOME"),
                 engine_dir() / "cache")
        for directory in caches.values():
            os.makedirs(directory, mode=0o700, exist_ok=True)
    env = engine_environment(environ, first.devices, process.engine_log_level, caches)
    cmd = [sys.executable, "-m", "spark_llm.engine_host.server", *[a for s in slots for a in ("--slot", s.name)],
           "--devices", ",".join(first.devices), "--spec-file", str(spec_file), "--key", spec.key,
           "--watch-pid", str(executor.pid if executor is not None else executor_pid()),
           "--idle-timeout", str(process.engine_idle_timeout_seconds or 0), "--run-id", run_id,
           *(["--ahead"] if ahead else [])]
    with open(first.path(SlotFile.LOG), "ab") as logf:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    for slot in slots:
        write_private(slot.path(SlotFile.STARTING), process_record(proc.pid, key=spec.key, devices=slot.devices,
                                                                   started_at=time.time()).as_json())
    return proc


def await_server(slot: Slot, pid: int, proc: Optional[subprocess.Popen] = None,
                 timeout: float = ProcessSettings.engine_start_timeout_seconds) -> SlotRecord:
    """Wait until the slot's server ``pid`` (or the one it forked for the slot) is ready and return its record; its
    reason when it could not start, or when it has not started after ``timeout`` seconds not counting the copy of
    its model to this host (:func:`~spark_llm.engine_host.directory.copy_seconds`). A server that became ready
    counts as started even when it has ended since (a request of the slot's other feeder can kill it between two
    looks): the caller's first call finds it gone."""
    t0 = time.monotonic()
    while time.monotonic() - t0 - copy_seconds(slot, pid, time.time()) < timeout:
        if (info := _ready_from(slot, pid)) is not None:
            return info
        if not _still_starting(slot, pid, proc):
            if (info := _ready_from(slot, pid)) is not None:  # it wrote its info and its record went since
                return info
            try:
                reason = slot.path(SlotFile.ERROR).read_text().strip()
            except OSError:
                code = f" with code {proc.returncode}" if proc is not None and proc.returncode else ""
                reason = f"the engine process exited{code}; see {slot.path(SlotFile.LOG)}"
            raise EngineStartError(reason)
        time.sleep(0.1)
    if proc is not None:
        proc.kill()
    elif (record := slot.starting()) is not None and record.pid == pid:
        signal_engine(record, signal.SIGKILL)
    raise EngineStartError(f"the engine of slot {slot.name} did not start within {timeout:.0f}s "
                           f"(engine_start_timeout_seconds; a copy of the model not counted); see "
                           f"{slot.path(SlotFile.LOG)}")


def _ready_from(slot: Slot, pid: int) -> Optional[SlotRecord]:
    """The slot's ready record when server ``pid`` (or the engine process it forked for the slot) wrote it."""
    info = slot.ready()
    return info if info is not None and pid in (info.pid, info.launcher) else None


def _still_starting(slot: Slot, pid: int, proc: Optional[subprocess.Popen]) -> bool:
    """Whether the server ``pid`` started for ``slot`` may still become ready: the process forked for the slot when
    ``pid`` forked one (the slot's record names it), else ``pid`` itself. Looked at in that order, since a launcher
    rewrites the record before it exits."""
    running = proc.poll() is None if proc is not None else process_alive(pid)
    record = slot.starting_record()
    if record is not None and record.launcher == pid:
        return alive(record) is not None
    return running
