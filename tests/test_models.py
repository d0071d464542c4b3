"""Models where users keep them: a local directory, a filesystem URI copied once per host under a lock, a Hugging Face
repo id (the hub is not reachable here: its one clear error)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from spark_llm import models
from spark_llm.models import ModelSourceError, local_copy, source_kind, with_local_paths


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "model-cache"
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(path))
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model-shaped directory: config, tokenizer files, a sub-directory, and weights."""
    root = tmp_path / "store" / "my-model"
    (root / "1_Pooling").mkdir(parents=True)
    (root / "config.json").write_text('{"max_position_embeddings": 128}')
    (root / "tokenizer.json").write_text("{}")
    (root / "1_Pooling" / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(os.urandom(1 << 20))
    return root


def test_where_a_model_comes_from():
    assert source_kind("/models/llama") == "local" and source_kind("tests") == "local"
    assert source_kind("s3a://bucket/models/llama") == "uri" and source_kind("file:/models/llama") == "uri"
    assert source_kind("dbfs:/models/llama") == "uri" and source_kind("abfss://c@acct.dfs.core.windows.net/m") == "uri"
    assert source_kind("meta-llama/Llama-3.1-8B-Instruct") == "hub" and source_kind("Qwen/Qwen3-0.6B") == "hub"


def test_a_local_directory_is_used_where_it_is(model_dir, cache):
    assert local_copy(str(model_dir)) == str(model_dir) and not cache.exists()


def _copy_in_a_process(uri: str, queue) -> None:
    queue.put(local_copy(uri))


def test_a_uri_is_copied_once_per_host_by_concurrent_tasks(model_dir, cache, tmp_path, monkeypatch):
    """Four processes ask for the same model at once: one copies (slowly), the others wait for it and use it."""
    copies = tmp_path / "copies.log"
    real_copy = models._copy_uri

    def slow_counted_copy(uri, dest, weights):
        with open(copies, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # the others arrive while this copy is under way
        real_copy(uri, dest, weights)

    monkeypatch.setattr(models, "_copy_uri", slow_counted_copy)
    ctx = multiprocessing.get_context("fork")  # the children inherit the patched copy
    queue = ctx.Queue()
    procs = [ctx.Process(target=_copy_in_a_process, args=(f"file://{model_dir}", queue)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    paths = {queue.get(timeout=5) for _ in procs}
    assert all(p.exitcode == 0 for p in procs)
    assert len(copies.read_text().splitlines()) == 1
    [copy] = paths
    assert Path(copy).parent == cache and (Path(copy) / "1_Pooling" / "config.json").exists()
    assert (Path(copy) / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert not list(cache.glob("*.partial-*"))


def test_the_driver_and_the_tokenizer_copy_only_the_small_files(model_dir, cache):
    meta = Path(local_copy(f"file:{model_dir}", weights=False))
    assert (meta / "config.json").exists() and (meta / "tokenizer.json").exists()
    assert not (meta / "model.safetensors").exists()
    full = local_copy(f"file:{model_dir}")  # the engine's copy has the weights; later small-file asks use it
    assert (Path(full) / "model.safetensors").exists() and local_copy(f"file:{model_dir}", weights=False) == full


def test_a_half_copied_model_is_never_used(model_dir, cache):
    uri = f"file://{model_dir}"
    full = Path(local_copy(uri))
    name = full.name
    import shutil

    shutil.rmtree(full)
    stale = cache / f"{name}.partial-dead0000"  # a copier that died half way
    stale.mkdir()
    (stale / "config.json").write_text("{")
    again = Path(local_copy(uri))
    assert again == full and (again / "model.safetensors").exists() and not stale.exists()


def test_a_failed_copy_leaves_nothing_behind(tmp_path, cache):
    with pytest.raises(ModelSourceError, match="cannot list the model at .*missing.*--model"):
        local_copy(f"file://{tmp_path}/missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="no model files"):
        local_copy(f"file://{tmp_path}/empty")
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_an_unreachable_hub_is_one_clear_error(cache):
    with pytest.raises(ModelSourceError) as info:
        local_copy("some-org/some-model-that-is-not-here", weights=False)
    message = str(info.value)
    assert "Hugging Face hub" in message and "huggingface-cli download some-org/some-model-that-is-not-here" in message
    assert "--model" in message and "Traceback" not in message


def test_the_engine_gets_local_paths(model_dir, cache):
    kwargs = with_local_paths({"model": f"file://{model_dir}", "tokenizer": f"file://{model_dir}", "dtype": "auto"})
    assert (Path(kwargs["model"]) / "model.safetensors").exists() and kwargs["dtype"] == "auto"
    assert kwargs["tokenizer"] == kwargs["model"]  # the full copy serves the tokenizer too


def test_a_lora_adapter_given_as_a_uri_is_copied_to_the_host_and_its_rank_checked(tmp_path, cache):
    """An adapter on a filesystem URI went to vLLM as the URI (every request for it an error row) and its rank was
    not checked; now the driver reads its config from this host's copy, the engine loads the copy."""
    from spark_llm.config import ConfigError

    adapter = tmp_path / "store" / "sql-adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 16, "peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(1024))
    uri = f"file://{adapter}"
    with pytest.raises(ConfigError, match="rank 16, over max_lora_rank 8"):
        models.check_adapters({"sql": uri}, max_lora_rank=8)
    models.check_adapters({"sql": uri}, max_lora_rank=16)
    local = models.local_adapters({"sql": uri, "here": str(adapter)})
    assert local["here"] == str(adapter) and Path(local["sql"]).parent == cache
    assert (Path(local["sql"]) / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="LoRA adapter 'gone': cannot list the model at file://.*--lora-modules"):
        models.check_adapters({"gone": f"file://{tmp_path}/missing"}, max_lora_rank=16)


def test_a_dry_run_reads_a_model_given_as_a_uri(spark, tiny_model, tmp_path, cache):
    """The driver reads the model's settings and the tasks its tokenizer from the URI, without its weights."""
    from conftest import chat_line, engine_settings, write_jsonl
    from spark_llm import BatchConfig, plan_batch

    write_jsonl(tmp_path / "in.jsonl", [chat_line("a"), chat_line("b", "Two words")])
    base = {**engine_settings(tiny_model), "max_model_len": None}
    by_path = plan_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "o1"),
                                            **base), tokens_per_second=100.0)
    by_uri = plan_batch(spark, BatchConfig(input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "o2"),
                                           **{**base, "model": f"file://{tiny_model}"}), tokens_per_second=100.0)
    assert (by_uri.requests, by_uri.prompt_tokens) == (by_path.requests, by_path.prompt_tokens) == (2, by_path.prompt_tokens)
    assert by_path.prompt_tokens > 0
    [meta] = [p for p in cache.iterdir() if p.is_dir()]
    assert meta.name.endswith("-meta") and not list(meta.glob("*.safetensors"))


def test_a_copy_the_disk_cannot_hold_is_refused_before_a_byte_is_written(model_dir, cache, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 0, models.SPARE_BYTES + (1 << 19)))
    with pytest.raises(ModelSourceError, match=rf"GB to copy, 1.1 GB free at .*; set {models.MODEL_CACHE_ENV}"):
        local_copy(f"file://{model_dir}")  # 1 MiB of weights does not fit in the half MiB beyond the spare
    assert not [p for p in cache.iterdir() if p.is_dir()]  # nothing of it written, not even a partial copy
    assert Path(local_copy(f"file://{model_dir}", weights=False), "config.json").exists()  # without weights it fits


def test_an_engine_s_start_limit_leaves_the_copy_of_its_model_out(tmp_path, monkeypatch):
    """A server that copies its model for 3 s and is ready 0.5 s later, under a 2 s start limit: it started in
    time, for the copy is not counted (it would have been refused at 2 s, before it was ready)."""
    import subprocess
    import sys
    import threading

    from spark_llm.engine_host import client as engine_client
    from spark_llm.engine_host.directory import ENGINE_DIR_ENV, Slot, SlotFile, process_record
    from spark_llm.host import write_private

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "engines"))
    slot = Slot("gpu-0", ("0",))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        slot.path(SlotFile.LOG).parent.mkdir(parents=True, exist_ok=True)
        write_private(slot.path(SlotFile.STARTING), process_record(proc.pid, devices=("0",)).as_json())
        began = time.time()

        def server() -> None:  # what the engine server writes: the copy under way, its end, then ready
            write_private(slot.path(SlotFile.COPY), {"pid": proc.pid, "began_at": began, "seconds": None})
            time.sleep(3.0)
            write_private(slot.path(SlotFile.COPY), {"pid": proc.pid, "began_at": began, "seconds": 3.0})
            time.sleep(0.5)
            write_private(slot.path(SlotFile.READY), process_record(proc.pid, devices=("0",), authkey="k").as_json())
        writer = threading.Thread(target=server)
        writer.start()
        info = engine_client.await_server(slot, proc.pid, proc, timeout=2.0)
        writer.join()
        assert info.pid == proc.pid and time.time() - began >= 3.5
    finally:
        proc.kill()
        proc.wait()
