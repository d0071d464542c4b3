"""The engine host: one vLLM engine per GPU (or tensor-parallel group) of an executor, in a process of its own for
the executor's life, fed by the inference tasks over a Unix socket.

- :mod:`.spec`: an engine's recipe (:class:`EngineSpec`, keyed by its settings) and its build;
- :mod:`.placement`: where a run's engines go (the GPUs a task owns, the layout, the settings check);
- :mod:`.directory`: the host's engine directory, its slots and their files;
- :mod:`.protocol`: what crosses the socket;
- :mod:`.client`: the tasks' side (feeds, start, stop);
- :mod:`.server`: the engine process (``python -m spark_llm.engine_host.server``);
- :mod:`.isolation`: no single request takes the batch down.

The names below are imported from their modules when first asked for, so that importing one module of the package
(the protocol, say) imports no other: the package's own code imports each name from its module.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The package's public names, each with the module that defines it.
PUBLIC = {
    "EngineClient": "client", "Executor": "client", "engine_for": "client", "engines_here": "client",
    "prestart": "client", "prestart_slots": "client", "stop_engine": "client", "stop_engines_here": "client",
    "TaskPlace": "placement",
    "ENGINE_DIR_ENV": "directory", "LOCAL_EXECUTOR_ENV": "directory", "Slot": "directory", "engine_dir": "directory",
    "read_events": "directory",
    "EngineDied": "protocol", "EngineGone": "protocol", "EngineRequest": "protocol", "EngineTask": "protocol",
    "Output": "protocol", "Parse": "protocol", "RequestFailure": "protocol",
    "VLLM_MIN_VERSION": "spec", "EngineSpec": "spec", "ProcessSettings": "spec", "apply_worker_env": "spec",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
