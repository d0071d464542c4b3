"""Drills: the tests' long runs in processes of their own (a Spark cluster of several workers, a ``spark-submit``,
a clean venv), started at the beginning of the test run and run one after another on a thread of their own (the
lane) while the other tests run; the tests that assert on a drill's result run last and wait for it.

A drill spends most of its time waiting (for executors to register or to be removed, for an engine stand-in's
load, for a killed node to be noticed, for downloads), which the rest of the suite fills with its own work: the
same drills one after another before the tests took the whole run's quarter.

A drill is a function of a :class:`DrillContext`, registered under a name with :func:`drill` in the test module
that asserts on it; a test that needs it is marked ``@pytest.mark.drill(name)`` and reads its result with
``lane.result(name)`` (a failure of the drill, its AssertionError included, is raised there). Only the drills of
the tests selected run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

#: name -> the drill (see :func:`drill`).
DRILLS: dict[str, Callable[["DrillContext"], Any]] = {}


def drill(name: str) -> Callable:
    """Register a drill under ``name``."""
    def register(fn: Callable[["DrillContext"], Any]) -> Callable[["DrillContext"], Any]:
        DRILLS[name] = fn
        return fn
    return register


@dataclass
class DrillContext:
    """What a drill gets: the tiny model, a directory of its own, and :meth:`run` for its processes (stopped with
    the test run if it ends first)."""

    tiny_model: str
    root: Path
    env: dict[str, str]  #: this test run's environment as it started, without the shared session's faults
    _procs: list[subprocess.Popen] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def out(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def run(self, argv: Sequence[Any], timeout: float, cwd: Optional[Path] = None,
            env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
        """``argv`` to its end (a process group of its own), its output captured, as ``subprocess.run``; ``env``:
        variables set beside the test run's."""
        if self.stopped.is_set():
            raise RuntimeError("the test run ended before this drill started")
        proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**self.env, **(env or {})}, cwd=cwd, start_new_session=True)
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{argv[:3]} still ran after {timeout:.0f} s: {err[-3000:]}") from None
        finally:
            self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self) -> None:
        self.stopped.set()
        for proc in list(self._procs):
            self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Lane:
    """The drills ``names``, in that order, on a thread of their own from now on."""

    def __init__(self, ctx: DrillContext, names: Sequence[str]):
        unknown = [n for n in names if n not in DRILLS]
        if unknown:
            raise KeyError(f"no drill registered as {unknown} (tests/drills.py: drill)")
        self.ctx, self.names = ctx, list(names)
        self._done = {name: threading.Event() for name in self.names}
        self._results: dict[str, Any] = {}
        self._errors: dict[str, BaseException] = {}
        self.started = time.monotonic()
        #: name -> (seconds after the lane started that the drill began, its seconds): the terminal summary's
        self.times: dict[str, tuple[float, float]] = {}
        self.others_seconds: Optional[float] = None  #: when the tests that wait for no drill had run
        self._thread = threading.Thread(target=self._run, name="drill-lane", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for name in self.names:
            t0 = time.monotonic()
            try:
                self._results[name] = DRILLS[name](self.ctx)
            except BaseException as exc:  # raised in the test that reads it
                self._errors[name] = exc
            finally:
                self.times[name] = (t0 - self.started, time.monotonic() - t0)
                self._done[name].set()

    def others_ended(self) -> None:
        """The tests that wait for no drill have run (the first test that reads a drill starts)."""
        self.others_seconds = time.monotonic() - self.started

    def summary(self) -> str:
        """One line: each drill's start (from the lane's) and seconds, and when the other tests had run: whichever
        ends last is the run's wall."""
        others = "" if self.others_seconds is None else f"; the other tests had run at {self.others_seconds:.0f} s"
        return "drill lane: " + ", ".join(f"{name} at {start:.0f} s for {took:.0f} s"
                                          for name, (start, took) in self.times.items()) + others

    def result(self, name: str, timeout: float = 3600.0) -> Any:
        """The drill's result once it has run; what it raised, if it failed."""
        if name not in self._done:
            raise KeyError(f"drill {name!r} was not started: mark the test @pytest.mark.drill({name!r})")
        if not self._done[name].wait(timeout):
            raise AssertionError(f"drill {name!r} did not end within {timeout:.0f} s")
        if name in self._errors:
            raise self._errors[name]
        return self._results[name]

    def close(self) -> None:
        self.ctx.stop()
        self._thread.join(timeout=60)
