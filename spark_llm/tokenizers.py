"""Tokenizers, loaded once per process: the served model's tokenizer for the token stage, and which class
transformers' AutoTokenizer picks for a model directory, decided once per host.

Free of Spark: the engine process (:mod:`~spark_llm.engine_host.server`) decides the tokenizer class while it imports
torch, and must not import pyspark to do so; the token stage (:mod:`~spark_llm.tokens`) loads its tokenizers here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from .host import locked

log = logging.getLogger(__name__)

_TOKENIZERS: dict[str, Any] = {}
_LOCK = threading.Lock()


def get_tokenizer(path: str) -> Any:
    """The tokenizer for ``path``, loaded once per Python worker."""
    with _LOCK:
        tok = _TOKENIZERS.get(path)
        if tok is None:
            from .models import local_copy

            tok = load_tokenizer(local_copy(path, weights=False))  # a URI's copy on this host
            tok.model_max_length = sys.maxsize  # the context guard here decides; silence transformers' warning
            _TOKENIZERS[path] = tok
            log.info("loaded tokenizer %s", path)
            _keep_for_life()
        return tok


def _keep_for_life() -> None:
    """In a Spark Python worker: the objects loaded so far (the tokenizer and its modules, kept for the worker's
    life) leave the cyclic collector's walks (``gc.freeze``), which pyspark runs after every task of a reused worker:
    0.05 s a task with a tokenizer loaded, against 0.02 s without. Not in the driver (a user's process)."""
    import gc

    from pyspark import TaskContext

    if TaskContext.get() is not None:
        gc.collect()  # what is garbage now is not kept
        gc.freeze()


#: Files whose contents decide which tokenizer class transformers' AutoTokenizer picks for a model directory.
_CLASS_INPUTS = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json")
#: Seconds a process counting tokens waits for the one deciding its tokenizer's class on this host (an engine
#: importing torch, or another worker's child) before it decides it without waiting.
DECISION_WAIT_SECONDS = 60.0
#: Run in a child process by :func:`_decide_class`: :func:`autotokenizer_choice` printed.
_DECIDE_CLASS = ("import sys; from spark_llm.tokenizers import autotokenizer_choice; "
                 "print(autotokenizer_choice(sys.argv[1]))")


def load_tokenizer(model_dir: str) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir)``, without importing torch in this process. AutoTokenizer decides
    which class to load by way of transformers' model configuration classes, which import torch: seconds of CPU at
    a Python worker's first task, and every later task's ``gc.collect()`` (pyspark's, between tasks) walking torch's
    objects too (0.2 s a task against 0.05 s without). So the class is decided once per host and recorded (per
    tokenizer files and transformers version, in the model cache), by a process that imports torch anyway (an
    engine starting on this host, :func:`deciding_tokenizer_class`) or else by a child process of the first worker
    that needs it, which the workers starting beside it wait for (a lock beside the record); this process, and every
    later one, loads that class directly. A class from outside transformers (remote code) is not recorded:
    AutoTokenizer loads it here, as before."""
    record = _class_record(model_dir)
    cls = _recorded_class(record)
    if cls is None:
        with locked(decision_lock(record), wait=DECISION_WAIT_SECONDS):
            cls = _recorded_class(record) or _decide_class(model_dir, record, in_child=True)
    if cls is not None:
        with contextlib.suppress(Exception):  # else AutoTokenizer, and its error
            return cls.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)  # its own error for a directory that holds no tokenizer


@contextlib.contextmanager
def deciding_tokenizer_class(model_dir: str) -> Iterator[None]:
    """For a process about to import torch anyway (an engine starting): the decision on ``model_dir``'s tokenizer
    class held while the block runs (those imports), then taken here and recorded, unless it is recorded already or
    another process holds it (this one then does not wait). The processes counting tokens on this host meanwhile
    wait for the record (:data:`DECISION_WAIT_SECONDS` at most) instead of importing torch to decide it themselves,
    on the cores the engine loads on. A head start only: a directory AutoTokenizer cannot read records nothing (the
    counting says why)."""
    record = _class_record(model_dir)
    if _recorded_class(record) is not None:
        yield
        return
    with locked(decision_lock(record), wait=0.0) as held:
        yield
        if held and _recorded_class(record) is None:
            with contextlib.suppress(Exception):
                _decide_class(model_dir, record, in_child=False)


def _class_record(model_dir: str) -> Any:
    """Where the tokenizer class of ``model_dir`` is recorded on this host (keyed by its tokenizer files and
    transformers' version)."""
    import transformers

    from .models import cache_dir

    stamp = [transformers.__version__, os.path.abspath(model_dir)]
    for name in _CLASS_INPUTS:
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(model_dir, name))
            stamp.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return cache_dir() / f"tokenizer-class-{hashlib.sha256(repr(stamp).encode()).hexdigest()[:20]}.txt"


def _recorded_class(record: Any) -> Any:
    """The tokenizer class ``record`` names, or None (no record yet, or a class that no longer imports)."""
    with contextlib.suppress(OSError, ValueError, ImportError, AttributeError):
        module, _, name = record.read_text().strip().partition(":")
        return getattr(importlib.import_module(module), name)
    return None


def _decide_class(model_dir: str, record: Any, in_child: bool) -> Any:
    """AutoTokenizer's class for ``model_dir``, decided in a child process (``in_child``) or this one, and
    recorded; None when the child could not decide (the caller's AutoTokenizer then says why) or the class is from
    outside transformers."""
    if in_child:
        import subprocess

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.run([sys.executable, "-c", _DECIDE_CLASS, model_dir], env=env, capture_output=True,
                                  text=True, timeout=600, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("could not decide the tokenizer class of %s in a child process: %s", model_dir, exc)
            return None
        if proc.returncode != 0:
            return None
        decided = (proc.stdout.strip().splitlines() or [""])[-1]
    else:
        decided = autotokenizer_choice(model_dir)
    module, _, name = decided.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name) if module.startswith("transformers.") else None
    except (ImportError, AttributeError, ValueError):
        cls = None
    if cls is None:  # remote code, or a class that does not import by its name
        return None
    with contextlib.suppress(OSError):  # only a shortcut: without it, the next process decides again
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{decided}\n")
        os.replace(tmp, record)
    return cls


def autotokenizer_choice(model_dir: str) -> str:
    """The class AutoTokenizer loads for ``model_dir``, as ``module:name`` (imports torch)."""
    from transformers import AutoTokenizer

    cls = type(AutoTokenizer.from_pretrained(model_dir))
    return f"{cls.__module__}:{cls.__name__}"


def decision_lock(record: Path) -> Path:
    """The lock beside a tokenizer-class record, held by the process deciding it (the host's other processes wait
    for it, or leave the decision to it)."""
    return record.with_name(record.name + ".lock")
