"""The engine host: one vLLM engine per GPU (or tensor-parallel group) of an executor, in a process of its own for
the executor's life, fed by the inference tasks over a Unix socket.

- :mod:`.spec`: an engine's recipe (:class:`EngineSpec`, keyed by its settings) and its build;
- :mod:`.placement`: where a run's engines go (the GPUs a task owns, the layout, the settings check);
- :mod:`.directory`: the host's engine directory, its slots and their files;
- :mod:`.protocol`: what crosses the socket;
- :mod:`.client`: the tasks' side (feeds, start, stop);
- :mod:`.server`: the engine process (``python -m spark_llm.engine_host.server``);
- :mod:`.isolation`: no single request takes the batch down.
"""

from .client import (EngineClient, Executor, engine_for, engines_here, prestart, prestart_slots, stop_engine,
                     stop_engines_here)
from .placement import TaskPlace
from .directory import ENGINE_DIR_ENV, LOCAL_EXECUTOR_ENV, Slot, engine_dir, read_events
from .protocol import EngineDied, EngineGone, EngineRequest, EngineTask, Output, Parse, RequestFailure
from .spec import VLLM_MIN_VERSION, EngineSpec, ProcessSettings, apply_worker_env

__all__ = ["ENGINE_DIR_ENV", "LOCAL_EXECUTOR_ENV", "VLLM_MIN_VERSION", "EngineClient", "EngineDied", "EngineGone",
           "EngineRequest", "EngineSpec", "EngineTask", "Executor", "Output", "Parse", "ProcessSettings",
           "RequestFailure", "Slot", "TaskPlace",
           "apply_worker_env", "engine_dir", "engine_for", "engines_here", "prestart", "prestart_slots",
           "read_events", "stop_engine", "stop_engines_here"]
