"""Shared fixtures: one local Spark session with Delta, one tiny model built once per test run."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# vLLM inside Spark's forked Python workers: single process, no hub, small KV cache. Set before Spark starts so the
# workers inherit it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

MODEL_NAME = "tiny-llm"


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from spark_llm.session import get_session

    warehouse = tmp_path_factory.mktemp("warehouse")
    # local[2, 2]: two task slots, and a failed task is retried once (as on a cluster), for the fault tests
    session = get_session(master="local[2,2]", conf={
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.warehouse.dir": str(warehouse),
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={warehouse}",
    }, app_name="spark_llm-tests")
    yield session
    session.stop()


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Llama built by scripts/make_tiny_model.py, once per test run."""
    out = tmp_path_factory.mktemp("models") / MODEL_NAME
    _load_script("make_tiny_model").build_model(out, seed=0)
    return str(out)


def write_jsonl(path: Path, lines: list) -> Path:
    """Write lines (dicts become JSON, str/bytes are written as they are) one per line."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line, ensure_ascii=False)
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return path


def chat_line(custom_id: str, content: str = "Hello there", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **body}}


def completion_line(custom_id: str, prompt="Once upon a time", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL_NAME, "prompt": prompt, **body}}


def engine_settings(model: str) -> dict:
    """Engine settings every engine test shares, so each Spark Python worker builds one engine for the whole run."""
    return dict(model=model, served_model_name=MODEL_NAME, max_model_len=512, max_num_seqs=32, dtype="bfloat16",
                enforce_eager=True, kv_cache_memory_bytes=64 << 20, default_max_tokens=8,
                target_tokens_per_partition=20_000, num_task_slots=2,
                # a vLLM limit below what validation allows, so a request can make the real engine fail
                engine_kwargs={"max_logprobs": 3})


@contextlib.contextmanager
def capture_logs(name: str = "spark_llm"):
    """Collect the INFO+ messages of a logger (as strings) while the block runs."""
    messages: list[str] = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
