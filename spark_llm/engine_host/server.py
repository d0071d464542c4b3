"""The engine process of one slot: one vLLM engine, fed by every task that holds a feed of the slot, at once.

``python -m spark_llm.engine_host.server`` is started by :mod:`~spark_llm.engine_host.client` (the tasks' side:
slots, feeds, start and stop); what crosses the socket is :mod:`~spark_llm.engine_host.protocol`. It builds the
engine, listens on the slot's Unix socket and reads each connection (a task) in a thread of its own. One **engine
loop** thread owns the engine: it keeps a backlog of requests in vLLM (:data:`BACKLOG_PER_SEQ` x ``max_num_seqs``,
enough to refill every sequence that finishes), topping it up before each step from the **most urgent, then oldest**
stream that has requests left (a stream's priority is its batch's), steps the engine, and sends every finished
request back to the task it came from (pickled between steps; a sender thread per stream only writes the bytes). So
a partition runs mostly on its own, and while it drains (its longest answers decoding at an ever smaller batch), or
while its task starts, reads its rows or writes its results, the next task's requests fill the batch: the engine
does not wait for tasks, sockets or waves. (Fed as they arrive, two tasks' requests would interleave in vLLM's
first-come queue: both partitions would progress at one rate and end together, and the engine would wait for the
next two tasks.)

A request the engine refuses when it is added is that request's failure. A step that raises (not fatally) sends
every request in flight through the isolating path (:func:`~spark_llm.engine_host.isolation.generate_isolating`),
whose bisection finds the request at fault; each of its calls ends its requests in the engine when it fails, so none
is left behind to be stepped for ever. A dead engine (``EngineDeadError``) answers every stream ``dead`` and the
process ends: its tasks rebuild it and set the request that killed it aside (:mod:`~spark_llm.engine_host.isolation`,
which runs a partition with deaths on record alone on the engine). An engine that fails every request the same way
answers ``fault`` and ends: no request is suspected. Streams hear from the engine every :data:`HEARTBEAT_SECONDS`
only while it makes progress (a step that made tokens), so a task takes an engine that steps without end, or
not at all, for a hung one.
A pooling engine (vLLM's pooling runner: embeddings) takes whole calls, one at a time, each request's task done by
its ``vllm.LLM`` method (:data:`~spark_llm.engine_host.protocol.POOLING_CALLS`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from .. import faults
from ..errors import EngineStartError, RequestError
from ..media import decode
from ..host import process_alive, try_lock, write_private
from . import egress
from .directory import (STOP_TIMEOUT_SECONDS, Slot, SlotFile, device_lock, end_leftovers, engine_dir, event,
                        lock_holder, process_record, record_holder, start_failed_marker)
from .isolation import EngineFault, failure_signature, generate_isolating, is_fatal
from .protocol import (POOLING_CALLS, Ask, EngineRequest, EngineTask, Output, Reply, RequestFailure, SlotRecord,
                       SlotStats)
from .spec import EngineSpec, build_engine, seeded_for, shutdown_engine

log = logging.getLogger(__name__)


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


class _Stream:
    """One task's streamed call: ``total`` requests, whose results go back on its connection as they finish, then
    ``(Reply.DONE, None)`` (or ``(Reply.DEAD | Reply.ERROR, why)``)."""

    def __init__(self, conn: Any, total: int, priority: int = 1):
        self.sender = _Sender(conn)
        self.priority = priority  #: 0 most urgent: its requests go into the engine before other streams
        self.left = total
        self.unadded = total  #: requests not yet added to the engine (arrived or on their way)
        self.in_line = False  #: in the engine loop's line of streams to add requests from
        self.ended = threading.Event()
        self.pending: deque = deque()  #: (index, request) arrived and not yet added to the engine, in order

    @property
    def gone(self) -> bool:
        """The task hung up (its worker died): nobody wants the rest."""
        return self.sender.gone

    def answer(self, results: list) -> None:
        """Send ``[(index, result), ...]``; the stream is done when every request has its result."""
        if results:
            self.sender.put((Reply.RESULTS, results))
            self.left -= len(results)
        if self.left <= 0:
            self.end(Reply.DONE, None)

    def end(self, status: str, value: Any) -> None:
        if not self.ended.is_set():
            self.sender.put((status, value))
            self.ended.set()


#: Seconds between the word of life a stepping engine sends the streams it works for (see ``EngineServer._beat``).
HEARTBEAT_SECONDS = 5.0
#: The engine's backlog, in sequences per ``max_num_seqs``: requests in vLLM (running or waiting) the engine loop
#: keeps it topped up to. Above one, a finished sequence is replaced at once; the rest of a stream waits in the loop,
#: in order, so a later stream's requests go in only when the earlier streams have none left to add.
BACKLOG_PER_SEQ = 2


@dataclass
class _InFlight:
    """A request in the engine: its stream, its index in the stream's call, the request, vLLM's internal id."""

    stream: _Stream
    index: int
    request: EngineRequest
    internal: str


class EngineServer:
    """The engine of one slot and the streams that feed it (see the module docs).

    Long, and one class: its three kinds of thread (a connection's, the engine loop, the watch) share the engine
    loop's state (the inbox, the queued streams, the requests in flight, the heartbeat's progress), each in a
    section of its own below; apart, each part would reach into the others' fields."""

    def __init__(self, slot: Slot, key: str, watch_pid: int, idle_timeout: float):
        self.slot, self.key, self.watch_pid, self.idle_timeout = slot, key, watch_pid, idle_timeout
        self.engine: Any = None
        self.parsers: Any = None
        #: a request's prompt and settings for the engine: vLLM's (:func:`engine_inputs`) or the stand-in's
        self.inputs: Any = engine_inputs
        self.runner = "generate"  #: vLLM's runner: generate, or pooling (whole calls; EngineTask.runner)
        self.adapters: dict[Optional[str], Any] = {}  #: adapter name -> vLLM LoRARequest (None: the base model)
        #: what the connection and watch threads hand the engine loop: ("take", stream, chunk), ("call", stream,
        #: requests) for pooling engines, ("stop", reason, code, when) with when "now", "when idle" or "if idle"
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.backlog = 512  #: requests kept in vLLM (BACKLOG_PER_SEQ x max_num_seqs, set with the engine)
        self.queued: list[_Stream] = []  #: streams with requests not yet added to the engine, in order of arrival
        self.streams: set[_Stream] = set()
        self.streams_lock = threading.Lock()
        self.stopping: Optional[tuple[str, int]] = None  #: a stop asked for, once the streams under way end
        self.last_used = time.monotonic()
        #: the idle clock runs: from the first call, or from ready for an engine a task started (:meth:`ready`)
        self.clock_running = False
        self.beaten = time.monotonic()  #: when the streams in the engine last heard from it
        self.busy_seconds = 0.0  #: time spent in engine steps and whole calls
        self.recorded_busy = 0.0  #: what <slot>.stats says
        self.progress = 0  #: engine steps that made tokens (:meth:`count_progress`): what a heartbeat reports
        self.beaten_progress = 0  #: :attr:`progress` at the last heartbeat

    def ready(self, ahead: bool) -> None:
        """The engine is loaded and listening. One started ahead of a batch (``ahead``) waits for its first call
        however long the driver prepares the batch; one a task started is called at once, unless Spark killed
        that task while the engine loaded (its job failed or was cancelled): from now on it counts as idle."""
        self.last_used = time.monotonic()
        self.clock_running = self.clock_running or not ahead

    # ---- the connection threads ----------------------------------------------------------------------------

    def serve_connection(self, conn: Any) -> None:
        try:
            self.handle(conn)
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def handle(self, conn: Any) -> None:
        """A task's connection: its streamed calls, one after another, or a request to stop."""
        while True:
            try:
                op, *args = conn.recv()
            except (EOFError, OSError):
                return
            self.last_used = time.monotonic()
            if op == Ask.PING:  # a task about to call: is this engine still here for it?
                conn.send((Reply.GONE, self.stopping[0]) if self.stopping is not None else (Reply.OK, None))
                continue
            if op == Ask.SHUTDOWN:  # another engine needs the slot's devices: stop once the streams under way end
                with contextlib.suppress(Exception):
                    conn.send((Reply.OK, None))
                self.inbox.put(("stop", "asked to stop", 0, "when idle"))
                return
            if op != Ask.STREAM:
                conn.send((Reply.ERROR, f"unknown op {op!r}"))
                continue
            if not self._receive_stream(conn, int(args[0]), int(args[1]) if len(args) > 1 else 1):
                return

    def _receive_stream(self, conn: Any, total: int, priority: int = 1) -> bool:
        """Hand a stream's chunks to the engine loop as they arrive, then wait until it has ended; False when the
        connection broke."""
        stream = _Stream(conn, total, priority)
        self.clock_running = True
        with self.streams_lock:
            refused = self.stopping is not None
            if not refused:
                self.streams.add(stream)
        try:
            if refused:  # none of its requests reach the engine: the task starts or finds another one
                stream.end(Reply.GONE, f"the engine of slot {self.slot.name} is stopping ({self.stopping[0]})")
                _receive(conn, total)
                return True
            if self.runner == "pooling":  # vLLM's pooling runner takes whole calls only
                self.inbox.put(("call", stream, _receive(conn, total)))
            else:
                received = 0
                while received < total:
                    _, chunk = conn.recv()
                    received += len(chunk)
                    self.inbox.put(("take", stream, chunk))
                if not total:
                    self.inbox.put(("take", stream, []))
            while not stream.ended.wait(0.2):
                if conn.poll(0):  # the task sends nothing while its answers come: it hung up (its worker died)
                    conn.recv()
            return True
        except (EOFError, OSError):
            stream.sender.gone = True  # the loop drops what it has of the stream
            return False
        finally:
            stream.sender.close()
            self.last_used = time.monotonic()

    # ---- the engine loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop (the only thread that touches the engine): take what arrived, step, answer."""
        flight: dict[str, _InFlight] = {}  # vLLM's request id -> the request in flight
        while True:
            try:
                self._take(block=not flight and not any(s.pending for s in self.queued))
                self._drop_gone(flight)
                self._feed(flight)
                if not flight:
                    self.record_busy()
                    continue
                t0 = time.monotonic()
                try:
                    outs = self.engine.llm_engine.step()
                except Exception as exc:
                    self._step_failed(exc, flight)
                    continue
                finally:
                    self.busy_seconds += time.monotonic() - t0
                self._beat(flight)
                finished: dict[_Stream, list] = {}
                for out in outs:
                    if out.finished and (entry := flight.pop(out.request_id, None)) is not None:
                        finished.setdefault(entry.stream, []).append(
                            (entry.index, self._result(out, entry.request)))
                for stream, results in finished.items():
                    self._answer(stream, results)
            except Exception as exc:
                if is_fatal(exc):  # from a pooling engine's whole call, say (or a failure every request met)
                    self._die(exc)
                # a bug of ours, not of one request: end the streams, keep the engine
                streams = self._live_streams()
                log.exception("engine loop failed; ending the %d stream(s) under way", len(streams))
                self._abort(list(flight.values()))
                flight.clear()
                for stream in streams:
                    stream.end(Reply.ERROR, f"{type(exc).__name__}: {exc}")
                    self._forget(stream)

    def count_progress(self) -> None:
        """Count the engine's steps that made tokens, whoever steps it (this loop, or vLLM's own loop in a blocking
        call): vLLM's engine core hands each step's new tokens to ``get_output`` (a step's outputs show finished
        requests only), which is wrapped once the engine is built; an engine without one (the stand-in) counts the
        steps that returned output."""
        engine = self.engine.llm_engine
        owner, name = (engine.engine_core, "get_output") if hasattr(engine, "engine_core") else (engine, "step")
        produce = getattr(owner, name)

        def counted() -> Any:
            outs = produce()
            if getattr(outs, "outputs", outs):
                self.progress += 1
            return outs
        setattr(owner, name, counted)

    def _progressed(self) -> bool:
        """Whether the engine made progress since the last heartbeat (and a heartbeat is due)."""
        now = time.monotonic()
        if now - self.beaten < HEARTBEAT_SECONDS or self.progress == self.beaten_progress:
            return False
        self.beaten, self.beaten_progress = now, self.progress
        return True

    def _beat(self, flight: dict[str, "_InFlight"]) -> None:
        """Every :data:`HEARTBEAT_SECONDS` while the engine makes progress, an empty result to each stream with
        requests in it: a task hears from a working engine however long its answers take, so silence means a hung
        one (:attr:`~spark_llm.engine_host.spec.ProcessSettings.engine_call_timeout_seconds`), also one whose steps
        return without end and without output."""
        if not self._progressed():
            return
        for stream in {entry.stream for entry in flight.values()}:
            stream.sender.put((Reply.RESULTS, []))
        self.record_busy()

    @contextlib.contextmanager
    def _beating(self, streams: set[_Stream]) -> Iterator[None]:
        """While a blocking engine call runs (a pooling engine's whole call, the isolation after a failed step), the
        word a stepping engine sends while it makes progress (:meth:`_beat`), from a thread of its own, to the
        ``streams`` it works for: a long call is not taken for a hung engine, a call that makes no progress is. The
        thread is gone before the call's results are sent, so no word follows a stream's end."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_SECONDS):
                if self._progressed():
                    for stream in streams:
                        stream.sender.put((Reply.RESULTS, []))
        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def record_busy(self) -> None:
        """The engine's busy seconds so far into ``<slot>.stats`` (read by the service's metrics: a counter whose
        rate is the engine's busy fraction)."""
        if self.busy_seconds == self.recorded_busy:
            return
        self.recorded_busy = self.busy_seconds
        with contextlib.suppress(OSError):
            write_private(self.slot.path(SlotFile.STATS), asdict(SlotStats(os.getpid(), round(self.busy_seconds, 3))))

    def _take(self, block: bool) -> None:
        """Queue what the connection threads handed over (waiting for something when the engine has nothing to do)
        and act on stop requests."""
        items = []
        if block:
            try:
                items.append(self.inbox.get(timeout=1.0))
            except queue.Empty:
                pass
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self.inbox.get_nowait())
        for op, *args in items:
            if op == "take":
                stream, chunk = args
                if not chunk:  # a call of no requests
                    self._answer(stream, [])
                    continue
                if not stream.in_line:  # its first chunk: its place in line
                    stream.in_line = True
                    self.queued.append(stream)
                stream.pending.extend(chunk)
            elif op == "call":
                stream, chunk = args
                t0 = time.monotonic()
                try:
                    with self._beating({stream}):
                        results = self.generate([r for _, r in chunk])
                    self._answer(stream, list(zip([i for i, _ in chunk], results)))
                finally:
                    self.busy_seconds += time.monotonic() - t0
            elif op == "stop":
                reason, code, when = args
                with self.streams_lock:
                    busy = bool(self.streams)
                    if when == "when idle" and busy:
                        self.stopping = (reason, code)
                if when == "now" or not busy:
                    self.stop(reason, code)
        if self.stopping is not None and not self.streams:
            self.stop(*self.stopping)

    def _feed(self, flight: dict[str, _InFlight]) -> None:
        """Top the engine's backlog up from the most urgent, then oldest, streams' requests (see the module docs). A
        stream keeps its place until all its requests are in; while its next chunk is still on its way, the later
        streams wait for it as long as the engine has half its backlog to work on."""
        for stream in sorted(self.queued, key=lambda s: s.priority):  # stable: the oldest first within a priority
            room = self.backlog - len(flight)
            if room <= 0:
                return
            if stream.pending:
                chunk = [stream.pending.popleft() for _ in range(min(room, len(stream.pending)))]
                stream.unadded -= len(chunk)
                self._answer(stream, self._enqueue(stream, chunk, flight))
            if not stream.unadded:
                self.queued.remove(stream)
            elif len(flight) >= self.backlog // 2:
                return

    def _answer(self, stream: _Stream, results: list) -> None:
        stream.answer(results)
        if stream.ended.is_set():
            self._forget(stream)

    def _live_streams(self) -> list[_Stream]:
        """The streams under way (the connection threads add to them)."""
        with self.streams_lock:
            return list(self.streams)

    def _forget(self, stream: _Stream) -> None:
        with self.streams_lock:
            self.streams.discard(stream)
        self.last_used = time.monotonic()

    def _drop_gone(self, flight: dict[str, _InFlight]) -> None:
        """The requests of streams whose task hung up leave the engine."""
        gone = {s for s in self._live_streams() if s.gone}
        if not gone:
            return
        self.queued = [s for s in self.queued if s not in gone]
        dropped = [rid for rid, entry in flight.items() if entry.stream in gone]
        self._abort([flight.pop(rid) for rid in dropped])
        for stream in gone:
            stream.ended.set()
            self._forget(stream)

    def _abort(self, entries: list[_InFlight]) -> None:
        if entries:
            with contextlib.suppress(Exception):
                self.engine.llm_engine.abort_request([e.internal for e in entries], internal=True)

    def _abort_unfinished(self) -> None:
        """End every request still in the engine: after a blocking call raised, those are its own (the loop has
        nothing in flight then), which vLLM leaves there; stepped with the next call's, they pile up until the
        engine steps for ever."""
        with contextlib.suppress(Exception):
            engine = self.engine.llm_engine
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def _step_failed(self, exc: Exception, flight: dict[str, _InFlight]) -> None:
        """A step raised. Dead engine: every stream ends ``dead`` and the process goes. Otherwise which request the
        engine choked on is not known: every request in flight runs again through the isolating path."""
        if is_fatal(exc):
            self._die(exc)
        log.warning("engine step failed (%s: %s); isolating the %d request(s) in flight", type(exc).__name__, exc,
                    len(flight))
        with contextlib.suppress(OSError):
            event(event="step_failed", slot=self.slot.name, pid=os.getpid(), key=self.key,
                  error=failure_signature(exc), requests=len(flight))
        entries = list(flight.values())
        self._abort(entries)
        flight.clear()
        try:
            with self._beating({e.stream for e in entries}):
                results = self.generate([e.request for e in entries])
        except Exception as fatal:  # generate re-raises only what killed the engine
            self._die(fatal)
        by_stream: dict[_Stream, list] = {}
        for entry, result in zip(entries, results):
            by_stream.setdefault(entry.stream, []).append((entry.index, result))
        for stream, answered in by_stream.items():
            self._answer(stream, answered)

    def _die(self, exc: BaseException) -> None:
        """The engine is dead: no new stream is taken (they are told ``gone``), every stream under way is told
        ``dead`` (``fault`` when every request failed alike: :class:`~.isolation.EngineFault`; its sender flushed),
        then the process ends."""
        fault = isinstance(exc, EngineFault)
        message = f"{exc}" if fault else f"{type(exc).__name__}: {exc} (the engine is dead)"
        with self.streams_lock:
            self.stopping = (f"engine dead: {exc}", 1)
        for stream in self._live_streams():
            stream.end(Reply.FAULT if fault else Reply.DEAD, message)
            stream.sender.close()
        self.stop(f"engine dead: {exc}", code=1)

    def generate(self, requests: list[EngineRequest]) -> list:
        """Results of ``requests`` from blocking engine calls, one per task among them; a request the engine rejects
        is found by bisection (:func:`~spark_llm.engine_host.isolation.generate_isolating`) and becomes its failure.
        For pooling engines and for the requests in flight when a step raised."""
        results: list = [None] * len(requests)
        by_task: dict[EngineTask, list[int]] = {}
        for i, request in enumerate(requests):
            by_task.setdefault(request.task, []).append(i)
        for task, index in by_task.items():
            for i, result in zip(index, self._call(task, [requests[i] for i in index])):
                results[i] = result
        return results

    def _call(self, task: EngineTask, requests: list[EngineRequest]) -> list:
        """:meth:`generate` for requests of one task."""
        results: list = [None] * len(requests)
        prompts, paired, index = [], [], []
        for i, request in enumerate(requests):
            prepared = self._inputs(request)
            if isinstance(prepared, RequestFailure):
                results[i] = prepared
                continue
            prompt, params = prepared
            prompts.append(prompt)
            # the adapter of each request rides with its settings, so that bisection keeps them paired
            paired.append((params, self.adapters.get(request.adapter)))
            index.append(i)
        call = self.engine.generate if task.generates else getattr(self.engine, POOLING_CALLS[task])

        def run(p: list, s: list) -> list:
            lora = [a for _, a in s] if any(a is not None for _, a in s) else None
            params = [x for x, _ in s]
            try:
                if task.generates:
                    return call(p, params, lora_request=lora, use_tqdm=False)
                return call(p, pooling_params=params, lora_request=lora, use_tqdm=False)
            except Exception:
                self._abort_unfinished()
                raise
        outs = generate_isolating(run, prompts, paired)
        for i, out in zip(index, outs):
            if isinstance(out, BaseException):
                if is_fatal(out):
                    raise out
                results[i] = RequestFailure("engine", f"{type(out).__name__}: {out}")
                continue
            results[i] = self._result(out, requests[i])
        return results

    def _inputs(self, request: EngineRequest) -> "tuple[dict, Any] | RequestFailure":
        """vLLM's prompt and settings of a request (:func:`engine_inputs`), or why it has none; a task this engine's
        runner does not do is refused (validation sends each endpoint's lines to a model that does it)."""
        if request.task.runner != self.runner:
            return RequestFailure("invalid", f"this engine runs vLLM's {self.runner} runner, which does not do "
                                             f"{request.task.value}")
        return self.inputs(request)

    def _result(self, out: Any, request: EngineRequest) -> "Output | RequestFailure":
        """A finished vLLM output as what crosses the socket, its answers parsed as the request asks."""
        result = Output.of(out, request.task)
        try:
            if request.parse.echo:
                result.prompt_text = self.parsers.tokenizer.decode(result.prompt_token_ids, skip_special_tokens=True)
            for choice in result.outputs:
                self.parsers.parse(choice, request.parse)
        except Exception as exc:  # a parser bug on one odd answer is that request's error, not the batch's
            return RequestFailure("engine", f"parsing the answer failed: {type(exc).__name__}: {exc}")
        return result

    def _enqueue(self, stream: _Stream, chunk: list, flight: dict[str, _InFlight]) -> list:
        """Add a chunk of a stream's requests to the engine (``flight`` gets them); returns the failures of those it
        refused, each found by adding the chunk's requests one by one when the chunk as a whole was refused."""
        failed, ready = [], []
        for index, request in chunk:
            prepared = self._inputs(request)
            if isinstance(prepared, RequestFailure):
                failed.append((index, prepared))
            else:
                prompt, params = prepared
                ready.append((index, request, params, prompt))

        def add(items: list) -> None:
            loras = [self.adapters.get(request.adapter) for _, request, _, _ in items]
            ids = self.engine.enqueue([prompt for *_, prompt in items], [p for _, _, p, _ in items],
                                      lora_request=loras if any(a is not None for a in loras) else None,
                                      use_tqdm=False)
            for internal, (index, request, _, _) in zip(ids, items):
                # outputs carry the id the request was added with; vLLM's own id has a random suffix after it
                flight[internal.split("-", 1)[0]] = _InFlight(stream, index, request, internal)
        try:
            if ready:
                add(ready)
        except Exception as exc:
            if is_fatal(exc):
                self._die(exc)
            for item in ready:
                try:
                    add([item])
                except Exception as one:
                    if is_fatal(one):
                        self._die(one)
                    failed.append((item[0], RequestFailure("engine", f"{type(one).__name__}: {one}")))
        return failed

    # ---- life --------------------------------------------------------------------------------------------

    def stop(self, reason: str, code: int = 0, shutdown: bool = True) -> None:
        """Leave: remove our files, record why, release the devices (the process ends). From here on a task is told
        the engine is ``gone`` (while the engine shuts down, unless ``shutdown`` is off: an engine stuck in a call
        would not), never that its requests died."""
        with self.streams_lock:
            self.stopping = self.stopping or (reason, code)
        with contextlib.suppress(Exception):
            ready = self.slot.ready()
            if ready is not None and ready.pid == os.getpid():
                self.slot.path(SlotFile.READY).unlink()
                os.unlink(self.slot.socket())
        event(event="stop", slot=self.slot.name, devices=list(self.slot.devices), pid=os.getpid(), key=self.key,
               reason=reason)
        if self.engine is not None and shutdown:
            shutdown_engine(self.engine)
        os._exit(code)

    def watch(self) -> None:
        """From the process's start: stop when the executor is gone (while the engine still loads, at once: the
        GPUs are not held for a batch that ended), and ask the engine loop to stop when idle longer than the idle
        timeout (its clock: :meth:`ready`)."""
        gone_at = None
        while True:
            time.sleep(1.0)
            if not process_alive(self.watch_pid):
                if self.engine is None:
                    self.stop("executor gone while the engine loaded")
                self.inbox.put(("stop", "executor gone", 0, "now"))
                gone_at = gone_at or time.monotonic()
                if time.monotonic() - gone_at > STOP_TIMEOUT_SECONDS / 2:  # the loop is stuck in a call: end it here
                    self.stop("executor gone while the engine was stuck in a call", shutdown=False)
            idle = time.monotonic() - self.last_used
            if self.idle_timeout and self.clock_running and not self.streams and idle > self.idle_timeout:
                self.inbox.put(("stop", f"idle for {idle:.0f}s", 0, "if idle"))


def engine_inputs(request: EngineRequest) -> "tuple[dict, Any] | RequestFailure":
    """vLLM's prompt (:func:`engine_prompt`) and settings (SamplingParams, or PoolingParams for a pooling task) of a
    request, or why it has none: a bad image (its code), or settings vLLM refuses (``invalid``)."""
    from ..endpoints.engine_side import engine_params

    try:
        return engine_prompt(request), engine_params(request)
    except RequestError as exc:
        return RequestFailure("media", exc.message, exc.code.value)
    except Exception as exc:
        return RequestFailure("invalid", f"{type(exc).__name__}: {exc}")


def engine_prompt(request: EngineRequest) -> dict:
    """vLLM's prompt for a request: its token ids, and its images decoded, here and only here
    (:func:`~spark_llm.media.decode`; vLLM's processor resizes them and expands each image's placeholder token).
    A request with audio is an encoder-decoder prompt, as vLLM's Whisper takes it: the audio decoded at its model's
    rate (:func:`~spark_llm.audio.decode_clip`) for the encoder, the token ids for the decoder."""
    if request.audio is not None:
        from ..audio import decode_clip

        return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": decode_clip(request.audio)}},
                "decoder_prompt": {"prompt_token_ids": request.token_ids}}
    prompt: dict[str, Any] = {"prompt_token_ids": request.token_ids}
    if request.images:
        count = len(request.images)
        prompt["multi_modal_data"] = {"image": [decode(data, f"image {k + 1} of {count}")
                                                for k, data in enumerate(request.images)]}
    return prompt


def _receive(conn: Any, count: int) -> list:
    """The next ``count`` requests of a stream (:attr:`~spark_llm.engine_host.protocol.Ask.ADD` messages)."""
    got: list = []
    while len(got) < count:
        _, chunk = conn.recv()
        got.extend(chunk)
    return got


def lora_requests(lora_modules: dict[str, str]) -> dict[Optional[str], Any]:
    """vLLM ``LoRARequest`` per adapter name, with stable integer ids (1, 2, ... in name order)."""
    if not lora_modules:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, n, os.path.abspath(path) if "://" not in path else path)
            for n, (name, path) in enumerate(sorted(lora_modules.items()), 1)}


#: What ``vllm.LLM`` is imported from: most of an engine's start on a CPU (torch, transformers and vLLM itself).
VLLM_ENTRY_MODULE = "vllm.entrypoints.llm"


@contextlib.contextmanager
def imports_kept() -> Iterator[None]:
    """Import what the block imports with Python's cyclic garbage collector paused, then move every object made so
    far out of its reach (``gc.freeze``): modules, classes and functions live as long as the process, so the
    collections the import would trigger (each a walk over the growing heap) find nothing, and so do the ones vLLM
    runs while it builds the engine: an engine's start on a CPU costs 9-10 CPU-seconds so, 12-15 without, at the
    same peak memory. vLLM freezes the heap again once the engine is up (``freeze_gc_heap``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


#: Modules an engine imports while it is built (its engine core, executor, CPU worker and model loader), imported
#: with :data:`VLLM_ENTRY_MODULE` by a process that forks the engines of several slots (:func:`fork_per_slot`), so
#: that each engine process finds them imported. Any that this vLLM lacks are left to the engine.
ENGINE_MODULES = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
                  "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.model_loader")
#: Seconds a process started for several slots waits for the records its starter writes when it has started it.
RECORD_WAIT_SECONDS = 30.0


def import_engine(modules: Sequence[str] = ()) -> None:
    """What building the engine needs imported (:data:`VLLM_ENTRY_MODULE`, then ``modules``), kept out of the
    cyclic collector's reach (:func:`imports_kept`); vLLM missing is left to
    :func:`~spark_llm.engine_host.spec.build_engine` to report."""
    with imports_kept():
        from ..endpoints import engine_side  # noqa: F401

        for module in (VLLM_ENTRY_MODULE, *modules):
            with contextlib.suppress(ImportError):
                importlib.import_module(module)


def fork_per_slot(slots: Sequence[Slot]) -> tuple[Slot, int]:
    """In a process started for several CPU slots (see :func:`~spark_llm.engine_host.client.prestart_slots`), once vLLM
    is imported: fork an engine process per slot and return, in each, its slot and this process's pid; this process
    records each as its slot's starting server and exits. A slot whose record no longer names this process (its
    start was called off: another engine took the slot) gets none. An engine start on a CPU is mostly imports
    (about half of its 9-10 CPU-seconds); forked, the engines share them, and their pages."""
    me = os.getpid()
    for slot in slots:
        record = _record_of(slot, me)
        if record is None:
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a stop waits for the record
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            log_fd = os.open(slot.path(SlotFile.LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            return slot, me
        forked = process_record(pid, key=record.key, devices=record.devices, started_at=record.started_at, launcher=me)
        write_private(slot.path(SlotFile.STARTING), forked.as_json())
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os._exit(0)


def tokenizer_class_decided(spec: EngineSpec) -> Any:
    """A block (the engine's imports) after which this process decides the class of the engine's tokenizer for the
    processes counting tokens on this host, which wait for it meanwhile
    (:func:`~spark_llm.tokenizers.deciding_tokenizer_class`): this process imports transformers' configuration classes,
    and torch, anyway, where each of them would import them for that alone. A local model directory only (a URI's
    copies differ between the engine and the counting)."""
    from ..tokenizers import deciding_tokenizer_class

    path = spec.tokenizer
    return deciding_tokenizer_class(path) if isinstance(path, str) and os.path.isdir(path) else contextlib.nullcontext()


def _record_of(slot: Slot, pid: int) -> Optional[SlotRecord]:
    """The slot's starting record, once its starter has written it, if it names process ``pid``."""
    deadline = time.monotonic() + RECORD_WAIT_SECONDS
    while (record := slot.starting_record()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return record if record is not None and record.pid == pid else None


def could_not_start(slot: Slot, args: argparse.Namespace, why: str) -> None:
    """Say why the slot's engine could not start: to whoever waits for it (``<slot>.error``), and, for a server
    started ahead of a run, to that run's tasks (:func:`~.directory.start_failed_marker`), which may come after it
    has gone and would otherwise start it again."""
    slot.path(SlotFile.ERROR).write_text(why)
    if args.run_id:
        start_failed_marker(slot, args.key, args.run_id).write_text(why)


def _arguments(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spark_llm.engine_host.server")
    p.add_argument("--slot", action="append", required=True,
                   help="the slot to serve; given more than once (CPU slots only), a forked process serves each")
    p.add_argument("--devices", default="")
    p.add_argument("--spec-file", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--watch-pid", type=int, required=True)
    p.add_argument("--idle-timeout", type=float, default=0.0)
    p.add_argument("--ahead", action="store_true", help="started ahead of a batch (prestart, the warm-up, the "
                                                       "service's hold): the idle clock waits for the first call")
    p.add_argument("--run-id", default="", help="the run this server was started ahead of (its start failure is the "
                                                "run's: start_failed_marker)")
    args = p.parse_args(argv)
    if len(args.slot) > 1 and args.devices:
        p.error("several slots share a process only without devices")
    return args


def lock_devices(server: EngineServer, args: argparse.Namespace) -> list[int]:
    """A lock on each of the slot's devices, held until the process ends (never two engines on one device), once
    whatever an engine before left holding them is ended; the start fails when one stays held too long."""
    slot, locks = server.slot, []
    for device in slot.devices:
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while (fd := try_lock(device_lock(device))) is None:
            if time.monotonic() > deadline:
                could_not_start(slot, args, f"GPU {device} is still held by another engine process after "
                                            f"{STOP_TIMEOUT_SECONDS:.0f}s; see {engine_dir()}")
                server.stop("device busy", code=1)
            time.sleep(0.2)
        if (left := end_leftovers(lock_holder(fd) or SlotRecord(0))):  # the device is free of them, now
            log.warning("GPU %s: ended %d process(es) that the engine before left holding it: %s", device, len(left),
                        left)
        record_holder(fd, process_record(os.getpid(), devices=slot.devices))
        locks.append(fd)
    return locks


def build_into(server: EngineServer, spec: EngineSpec, args: argparse.Namespace) -> None:
    """The slot's engine (vLLM's, or the stand-in) and what the server needs of it; the process ends with the
    reason written for whoever waits when it cannot start."""
    slot, began = server.slot, time.time()
    if (injected := faults.engine_start_failure(slot.devices)) is not None:
        could_not_start(slot, args, injected)
        server.stop("engine could not start", code=1)

    def copying(seconds: Optional[float]) -> None:  # for the start's time limit, which leaves the copy out
        write_private(slot.path(SlotFile.COPY), {"pid": os.getpid(), "began_at": began, "seconds": seconds})
    try:
        if spec.standin:
            from . import standin as stand_in

            server.engine, server.inputs, server.parsers = stand_in.build_standin(spec), \
                stand_in.engine_inputs, stand_in.Parsers()
        else:
            from ..endpoints.engine_side import Parsers

            server.engine = build_engine(spec, copying)
            from ..models import local_adapters

            server.adapters = lora_requests(local_adapters(spec.settings.lora_modules or {}))  # URIs copied
            server.parsers = Parsers(server.engine.get_tokenizer(), spec.settings.tool_call_parser,
                                     spec.settings.reasoning_parser)
        server.backlog = BACKLOG_PER_SEQ * server.engine.llm_engine.vllm_config.scheduler_config.max_num_seqs
        server.count_progress()
        server.runner = "pooling" if spec.settings.runner == "pooling" else "generate"
    except EngineStartError as exc:
        log.error("engine for slot %s could not start: %s", slot.name, exc)
        could_not_start(slot, args, str(exc))
        server.stop("engine could not start", code=1)


def listen(server: EngineServer, args: argparse.Namespace, launcher: Optional[int], load_s: float) -> None:
    """Say the engine is ready (its record, with the socket's key) and serve each task's connection in a thread of
    its own, for the process's life."""
    from multiprocessing.connection import Listener

    slot = server.slot
    authkey = os.urandom(16).hex()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(slot.socket())
    listener = Listener(slot.socket(), family="AF_UNIX", authkey=authkey.encode())
    ready = process_record(os.getpid(), key=args.key, devices=slot.devices, launcher=launcher,
                           started_at=time.time(), authkey=authkey, load_seconds=round(load_s, 3))
    write_private(slot.path(SlotFile.READY), ready.as_json())
    with contextlib.suppress(OSError):
        if (starting := slot.starting_record()) is not None and starting.pid == os.getpid():
            slot.path(SlotFile.STARTING).unlink()
    event(event="ready", slot=slot.name, devices=list(slot.devices), pid=os.getpid(), key=args.key,
          load_seconds=round(load_s, 3))
    server.ready(args.ahead)
    log.info("engine for slot %s ready in %.1fs", slot.name, load_s)
    while True:
        try:
            conn = listener.accept()
        except Exception:  # a client that failed authentication or vanished
            continue
        server.last_used = time.monotonic()
        threading.Thread(target=server.serve_connection, args=(conn,), daemon=True).start()


def serve(argv: Optional[Sequence[str]] = None) -> int:
    """The engine process: its slot (or, started for several CPU slots, a forked process for each once vLLM is
    imported), the devices locked, the engine built, then the tasks served."""
    args = _arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d]: %(message)s")
    egress.watch(lambda found: event(event="egress", pid=os.getpid(), **found._asdict()))  # before vLLM's import
    launcher, t0 = None, time.monotonic()
    spec = EngineSpec.from_json(Path(args.spec_file).read_text())
    standin = bool(spec.standin)  # no vLLM, torch or tokenizer to import (standin.py)
    if len(args.slot) > 1:
        if not standin:
            log.info("importing vLLM for the engines of slots %s", ", ".join(args.slot))
            with tokenizer_class_decided(spec):  # its modules, imported here, serve the engines' tokenizers too
                import_engine(ENGINE_MODULES)
        slot, launcher = fork_per_slot([Slot(name) for name in args.slot])
    else:
        slot = Slot(args.slot[0], tuple(d for d in args.devices.split(",") if d))
    server = EngineServer(slot, args.key, args.watch_pid, args.idle_timeout)
    threading.Thread(target=server.watch, name="watch", daemon=True).start()
    lock_devices(server, args)  # held as long as the process: their descriptors are never closed
    event(event="start", slot=slot.name, devices=list(slot.devices), pid=os.getpid(), key=args.key)
    if launcher is None:
        t0 = time.monotonic()
        if not standin:
            with tokenizer_class_decided(spec):
                import_engine()
    build_into(server, seeded_for(spec, slot.name), args)
    load_s = time.monotonic() - t0
    threading.Thread(target=server.run, name="engine", daemon=True).start()
    listen(server, args, launcher, load_s)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
