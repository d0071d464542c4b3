"""What a first run on a real GPU cluster would hit, each shown on this CPU machine: the settings check (dynamic
allocation, too few executor cores), the vLLM version floor, a local master on a host with several GPUs, a sticky
device error, a hung engine, an engine that outlives its executor while loading, the idle clock, one bad GPU, stale
records and reused pids, the engine directory's trust and socket length, shared memory for tensor parallelism, and
vLLM's own batch defaults."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_engine_unit import FakeLLM, Serving, request, until

from spark_llm.config import BatchConfig, ConfigError
from spark_llm.engine_host import (ENGINE_DIR_ENV, VLLM_MIN_VERSION, EngineDied, EngineSpec, ProcessSettings, Slot,
                                   TaskPlace)
from spark_llm.engine_host.placement import check_gpu_settings, config_layout, engine_layout
from spark_llm.engine_host.protocol import SlotRecord
from spark_llm.errors import EngineStartError

GPUS_2 = {"spark.executor.resource.gpu.amount": "2"}


DYNAMIC = {"spark.master": "yarn", "spark.executor.cores": "4", "spark.dynamicAllocation.enabled": "true",
           "spark.dynamicAllocation.maxExecutors": "3"}


def test_dynamic_allocation_with_gpus_on_every_executor_stops_at_the_settings_check_with_what_to_set():
    """Every executor with GPUs: the reading executors hold them (and keep them, the requests cached there) while
    the inference stage waits for executors of its own."""
    with pytest.raises(ConfigError, match="Set gpus_per_executor.*spark.task.resource.gpu.amount=1/N"):
        check_gpu_settings({**GPUS_2, **DYNAMIC}, 1)
    # the ways that work with it on: the inference stage asks for GPU executors, or every stage for its GPU share
    check_gpu_settings(DYNAMIC, 1, gpus_per_executor=2)
    check_gpu_settings({**GPUS_2, **DYNAMIC, "spark.task.resource.gpu.amount": "0.5"}, 1)


@pytest.mark.parametrize("conf, settings, message", [
    ({**DYNAMIC, "spark.dynamicAllocation.enabled": "false"}, {}, "dynamic allocation is off.*set "
     "spark.executor.resource.gpu.amount instead"),
    ({**DYNAMIC, "spark.master": "local[4]"}, {}, "dynamic allocation is off"),
    ({**DYNAMIC, **GPUS_2}, {}, "spark.executor.resource.gpu.amount is set too"),
    ({**DYNAMIC, "spark.task.resource.gpu.amount": "1"}, {}, "spark.task.resource.gpu.amount is set too"),
    ({k: v for k, v in DYNAMIC.items() if k != "spark.dynamicAllocation.maxExecutors"}, {},
     "set spark.dynamicAllocation.maxExecutors"),
    ({**DYNAMIC, "spark.dynamicAllocation.maxExecutors": str(2**31 - 1)}, {}, "set spark.dynamicAllocation.max"),
    (DYNAMIC, {"tensor_parallel_size": 4}, "tensor_parallel_size is 4 but gpus_per_executor is 2"),
    ({**DYNAMIC, "spark.executor.cores": "1"}, {}, "room for 2 engine.*run 1 task"),
])
def test_gpus_per_executor_outside_what_it_is_for_stops_at_the_settings_check(conf, settings, message):
    with pytest.raises(ConfigError, match=message):
        check_gpu_settings(conf, settings.get("tensor_parallel_size", 1), gpus_per_executor=2)


def test_with_dynamic_allocation_the_plan_counts_the_engines_of_the_most_executors_spark_may_add():
    cfg = BatchConfig(model="m", gpus_per_executor=2)
    conf = {**DYNAMIC, "spark.executor.instances": "1"}  # only where dynamic allocation starts
    layout = config_layout(cfg, conf, parallelism=lambda: 2, local_threads=None)
    assert (layout.engines, layout.feeds) == (6, 2)  # 3 executors x 2 GPUs, 4 cores: two tasks per GPU
    assert config_layout(cfg.model_copy(update={"num_task_slots": 2}), conf, lambda: 2, None).engines == 2
    # without gpus_per_executor the executors have no GPUs: an engine per task slot
    assert config_layout(BatchConfig(model="m"), DYNAMIC, lambda: 5, None).engines == 5


def test_the_inference_stage_asks_for_executors_with_gpus_only_under_dynamic_allocation():
    from spark_llm.engine_host.placement import added_executors, inference_profile

    added = added_executors(DYNAMIC, 2, "/opt/gpus.sh")
    profile = inference_profile(DYNAMIC, 1, feeds=2, added=added)
    gpu = profile.executorResources["gpu"]
    assert (gpu.amount, gpu.discoveryScript, gpu.vendor) == (2, "/opt/gpus.sh", "")
    assert profile.taskResources["gpu"].amount == 0.5
    assert "cores" not in profile.executorResources  # the default executor's cores and memory
    on_k8s = added_executors({**DYNAMIC, "spark.master": "k8s://https://api:6443"}, 1)
    assert on_k8s is not None and on_k8s.vendor == "nvidia.com"
    assert added_executors({**DYNAMIC, "spark.dynamicAllocation.enabled": "false"}, 2) is None
    assert added_executors(DYNAMIC, None) is None


def test_executors_with_fewer_cores_than_gpus_stop_at_the_settings_check():
    with pytest.raises(ConfigError, match="spark.executor.cores unset.*at least 2"):
        check_gpu_settings({**GPUS_2, "spark.master": "yarn"}, 1)  # YARN's and Kubernetes' default: one core
    check_gpu_settings({**GPUS_2, "spark.master": "yarn", "spark.executor.cores": "2"}, 1)


def test_with_cores_for_one_task_per_gpu_each_task_gets_a_whole_gpu_so_every_gpu_gets_an_engine():
    """local-cluster[1,2,...] with two GPUs: two half-GPU tasks would both land on GPU 0 (Spark fills the first GPU's
    shares first); one task per GPU uses both."""
    def layout(conf):
        return engine_layout(conf, engines=None, tasks_per_engine=2, tensor_parallel_size=1, parallelism=lambda: 2)
    assert layout({**GPUS_2, "spark.master": "local-cluster[1,2,2048]"}).feeds == 1
    assert layout({**GPUS_2, "spark.master": "local-cluster[1,4,2048]"}).feeds == 2
    assert layout({**GPUS_2, "spark.executor.cores": "2"}).feeds == 1


def test_an_older_vllm_is_refused_at_the_engine_start_naming_the_version_needed(tmp_path, monkeypatch):
    """A vLLM without ``LLM.enqueue`` (before 0.17): the engine process refuses to start with one message; the batch
    stops there instead of turning every request into an engine_error row."""
    from spark_llm.engine_host import engine_for

    stub = tmp_path / "old-vllm" / "vllm"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("class LLM:\n    def generate(self, *a, **k):\n        return []\n")
    monkeypatch.setenv("PYTHONPATH", f"{stub.parent}{os.pathsep}{ROOT}")
    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "engines"))
    spec = EngineSpec.from_config(BatchConfig(model=str(tmp_path / "model"), max_model_len=64))
    with pytest.raises(EngineStartError, match=rf"older than spark_llm needs: install vllm>={VLLM_MIN_VERSION}"):
        with engine_for(spec, ProcessSettings(0, "WARNING"), TaskPlace(local_engines=1)):
            pass


def test_the_version_floor_is_the_one_pyproject_and_the_examples_install():
    """The vllm extra asks for the floor the engine checks, under a ceiling (the newest vLLM tested), and the
    examples install the same."""
    [extra] = re.findall(r'^vllm = \["([^"]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert re.fullmatch(rf"vllm>={re.escape(VLLM_MIN_VERSION)},<[0-9.]+", extra)
    named = re.findall(r"vllm>=[0-9.]+(?:,<[0-9.]+)?",
                       "".join(p.read_text() for p in (ROOT / "examples").iterdir() if p.is_file()))
    assert named and set(named) == {extra}


def test_a_local_master_on_a_host_with_gpus_runs_one_engine_per_gpu_each_pinned(tmp_path, monkeypatch):
    from spark_llm import host
    from spark_llm.engine_host import Executor, prestart_slots
    from spark_llm.engine_host import client as engine_client

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    conf = {"spark.master": "local[4]"}
    layout = config_layout(BatchConfig(model="/m", max_model_len=64), conf, lambda: 4, 4)
    assert (layout.engines, layout.feeds, layout.local_devices) == (2, 2, (("0",), ("1",)))
    slots = layout.place.local_slots()
    assert [(s.name, s.devices) for s in slots] == [("gpu-0", ("0",)), ("gpu-1", ("1",))]
    tp2 = config_layout(BatchConfig(model="/m", max_model_len=64, tensor_parallel_size=2), conf, lambda: 4, 4)
    assert tp2.local_devices == (("0", "1"),)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # what the host lets this process see wins
    assert config_layout(BatchConfig(model="/m", max_model_len=64), conf, lambda: 4, 4).local_devices == \
        (("2",), ("3",))

    spawned = []

    class Popen:  # the engine processes, not started
        def __init__(self, cmd, env, **kwargs):
            spawned.append(env)
            self.pid = 4242 + len(spawned)

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "engines"))
    monkeypatch.setattr(engine_client.subprocess, "Popen", Popen)
    monkeypatch.setattr(host, "process_alive", lambda pid: False)
    spec = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64))
    assert prestart_slots(spec, ProcessSettings(0, "WARNING"), slots, Executor(os.getpid(), {})) == slots
    assert [env["CUDA_VISIBLE_DEVICES"] for env in spawned] == ["0", "1"]  # each engine on its own GPU


def test_a_long_blocking_engine_call_keeps_the_heartbeat_and_is_not_taken_for_a_hung_engine(monkeypatch):
    """A step fails and its requests are run again by blocking calls (as a pooling engine's whole calls are) that
    take longer than the client waits for a word (engine_call_timeout_seconds): the engine sends its heartbeat
    while they make tokens, and every request is answered instead of the engine being killed as hung."""
    import time as clock

    from spark_llm.engine_host import server as engine_server
    from spark_llm.engine_host.spec import ProcessSettings

    class SlowIsolation(FakeLLM):
        def generate(self, prompts, params, lora_request=None, use_tqdm=False):
            ids = self.enqueue(prompts, params)  # as vLLM's generate adds its requests, then steps them to the end
            for _ in range(60):  # 3 s of steps, each making a token of every request
                clock.sleep(0.05)
                self.engine_core.get_output()
            self.abort_request(ids)
            return super().generate(prompts, params)

    monkeypatch.setattr(engine_server, "HEARTBEAT_SECONDS", 0.1)
    client = Serving(SlowIsolation(step_fails=2)).client()
    client.stream([request(5)], lambda i, r: None)  # step 1: warm (the first call imports what requests need)
    client._process = ProcessSettings(0, "WARNING", engine_call_timeout_seconds=1.0)
    got = []
    client.stream([request(t) for t in range(10, 13)], lambda i, r: got.append(i))  # step 2 fails: 3 s calls
    assert sorted(got) == [0, 1, 2]


def test_a_cluster_task_on_a_gpu_host_without_gpu_scheduling_is_refused_with_what_to_set(tmp_path, monkeypatch):
    """A non-local master, no spark.executor.resource.gpu.amount, and a host whose nvidia-smi lists GPUs: the task
    does not start an engine that all the host's tasks would put on GPU 0; it says what to set. A local master
    (its engines pinned), a task with Spark's GPUs, or a host without GPUs goes on."""
    from spark_llm.engine_host.client import hold_feed
    from spark_llm.engine_host.placement import TaskPlace, unscheduled_gpus

    cluster_task = TaskPlace()  # what a cluster's inference task gets without GPU scheduling
    assert "spark.executor.resource.gpu.amount" in unscheduled_gpus(cluster_task, ("0", "1"))
    assert unscheduled_gpus(cluster_task, ()) is None
    assert unscheduled_gpus(TaskPlace(gpus=("1",)), ("0", "1")) is None
    assert unscheduled_gpus(TaskPlace(local_engines=2, local_devices=(("0",), ("1",))), ("0", "1")) is None

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "engines"))
    with pytest.raises(EngineStartError, match="Spark assigned this task none"):
        with hold_feed(cluster_task):
            pass


def _engine_group(tmp_path):
    """A stand-in GPU engine server: a process leading its own group (as the engine servers are started) with a
    child in it (a tensor-parallel worker); its record, and the child's pid once the child runs."""
    import sys

    from spark_llm.engine_host.directory import process_record

    child_pid = tmp_path / "child.pid"
    child_pid.unlink(missing_ok=True)
    leader = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, time; c = subprocess.Popen(['sleep', '300']); "
         f"open({str(child_pid)!r} + '.tmp', 'w').write(str(c.pid)); "
         f"os.replace({str(child_pid)!r} + '.tmp', {str(child_pid)!r}); time.sleep(300)"], start_new_session=True)
    until(child_pid.exists)  # whole: written aside, then renamed
    return leader, process_record(leader.pid, devices=("0",)), int(child_pid.read_text())


def test_a_kill_ends_a_gpu_engine_s_whole_process_group_and_the_next_engine_ends_what_is_left(tmp_path):
    """A kill of a GPU engine reaches its tensor-parallel workers (its process group), not the server alone; and an
    engine server that died by itself and left a worker holding the device is cleared by the next engine on it,
    which finds the last holder in the device's lock (the lock is free once the server is gone; the device is not)."""
    from spark_llm.engine_host.client import signal_engine
    from spark_llm.engine_host.directory import end_leftovers, lock_holder, record_holder
    from spark_llm.host import group_members, process_alive, try_lock

    leader, record, child = _engine_group(tmp_path)
    assert sorted(group_members(leader.pid, record.pid_started)) == sorted([leader.pid, child])
    assert signal_engine(record, signal.SIGKILL)
    leader.wait(10)
    until(lambda: not process_alive(child))  # the worker went with the server

    leader, record, child = _engine_group(tmp_path)
    fd = try_lock(tmp_path / "device-0.lock")
    record_holder(fd, record)
    assert lock_holder(fd) == record
    os.kill(leader.pid, signal.SIGKILL)  # the server dies by itself; its worker stays, holding the GPU
    leader.wait(10)
    assert process_alive(child) and group_members(record.pid, record.pid_started) == [child]
    assert end_leftovers(lock_holder(fd)) == [child]
    assert not process_alive(child) and group_members(record.pid, record.pid_started) == []
    os.close(fd)


def test_an_engine_s_caches_go_to_directories_of_our_own_when_home_is_not_writable(tmp_path, monkeypatch):
    """YARN's nobody or a container's uid 185 has a HOME it cannot write: vLLM's, Triton's and FlashInfer's caches
    then go under the engine directory (a variable the executor sets stays); a writable HOME keeps them."""
    from spark_llm.engine_host import Executor, prestart_slots
    from spark_llm.engine_host import client as engine_client
    from spark_llm.engine_host.directory import Slot
    from spark_llm.engine_host.spec import CACHE_ENV, cache_env, home_writable

    assert cache_env({}, True, "/e/cache") == {}
    assert cache_env({"TRITON_HOME": "/mine"}, False, "/e/cache") == {
        name: f"/e/cache/{sub}" for name, sub in CACHE_ENV.items() if name != "TRITON_HOME"}
    home = tmp_path / "home"
    home.mkdir()
    assert home_writable({"HOME": str(home)}) and not home_writable({"HOME": str(tmp_path / "missing")})
    if os.getuid() != 0:  # root writes anywhere: a read-only HOME is only one for others
        home.chmod(0o500)
        assert not home_writable({"HOME": str(home)})

    spawned = []

    class Popen:  # the engine process, not started
        def __init__(self, cmd, env, **kwargs):
            spawned.append(env)
            self.pid = 4343

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "engines"))
    monkeypatch.setattr(engine_client.subprocess, "Popen", Popen)
    monkeypatch.setattr(engine_client, "home_writable", lambda env: env.get("HOME") != "/nonexistent")
    spec = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64))
    # a slot each: the first's record names the fake pid, which a live process may hold (then it is "starting")
    for n, home_dir in enumerate(("/nonexistent", str(home))):
        environ = {"HOME": home_dir, "PATH": os.environ["PATH"]}
        prestart_slots(spec, ProcessSettings(0, "WARNING"), [Slot(f"cpu-1-{n}", ())], Executor(os.getpid(), environ))
    unwritable, writable = spawned
    cache = tmp_path / "engines" / "cache"
    assert unwritable["XDG_CACHE_HOME"] == str(cache / "xdg-cache") and (cache / "triton").is_dir()
    assert not any(name in writable for name in CACHE_ENV)


def test_a_sticky_device_error_in_a_step_is_an_engine_death_not_every_request_s_error():
    from spark_llm.engine_host.isolation import is_fatal

    assert is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_fatal(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")) and not is_fatal(ValueError())
    serving = Serving(FakeLLM(step_fails=1, failure=RuntimeError(
        "CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA")))
    with pytest.raises(EngineDied, match="illegal memory access"):
        serving.client().stream([request(t) for t in range(10, 14)], lambda i, r: None)
    until(lambda: serving.stopped)
    assert serving.stopped[0][1] == 1  # the process goes: its tasks rebuild the engine


def test_a_dead_tensor_parallel_worker_is_an_engine_death_not_every_later_request_s_error():
    """vLLM's multiprocess executor raises RuntimeError("Executor failed.") on every call once one of its workers
    died: the engine is given up and rebuilt, not kept to turn each later request into an engine_error row."""
    from spark_llm.engine_host.isolation import is_fatal

    assert is_fatal(RuntimeError("Executor failed.")) and not is_fatal(ValueError("Executor failed."))
    serving = Serving(FakeLLM(step_fails=1, failure=RuntimeError("Executor failed.")))
    with pytest.raises(EngineDied, match="Executor failed"):
        serving.client().stream([request(t) for t in range(10, 14)], lambda i, r: None)
    until(lambda: serving.stopped)
    assert serving.stopped[0][1] == 1


class Hung(FakeLLM):
    def step(self):
        threading.Event().wait()  # a kernel that never returns


def test_a_hung_engine_ends_the_call_after_the_call_timeout_and_a_slow_one_does_not(monkeypatch):
    from spark_llm.engine_host.client import EngineHung

    client = Serving(Hung()).client()
    client._process = ProcessSettings(0, "WARNING", engine_call_timeout_seconds=1.0)
    t0 = time.monotonic()
    with pytest.raises(EngineHung, match="sent nothing for 1s"):
        client.stream([request(10)], lambda i, r: None)
    assert time.monotonic() - t0 < 10
    # a working engine whose answer takes longer than the timeout is heard from between its steps
    monkeypatch.setattr("spark_llm.engine_host.server.HEARTBEAT_SECONDS", 0.2)
    slow = Serving(FakeLLM(step_seconds=0.5)).client()
    slow._process = ProcessSettings(0, "WARNING", engine_call_timeout_seconds=1.0)
    got = []
    slow.stream([request(t) for t in range(10, 14)], lambda i, r: got.append(i))  # about 2 s of steps
    assert sorted(got) == [0, 1, 2, 3]


def test_the_idle_clock_starts_with_the_first_call(monkeypatch):
    """An engine loaded ahead of a batch waits for it however long the driver prepares it; once used, it stops
    after the idle timeout."""
    serving = Serving(FakeLLM())
    serving.server.watch_pid, serving.server.idle_timeout = os.getpid(), 1.0
    serving.server.ready(ahead=True)
    threading.Thread(target=serving.server.watch, daemon=True).start()
    time.sleep(3.5)
    assert serving.stopped == []
    serving.client().stream([request(10)], lambda i, r: None)
    until(lambda: serving.stopped)
    assert serving.stopped and serving.stopped[0][0].startswith("idle for")


def test_an_engine_whose_task_was_killed_while_it_loaded_stops_after_the_idle_timeout():
    """A task starts its slot's engine (a rebuild, or the first task of a run without warm-up) and Spark kills the
    task while the engine loads, because the job failed elsewhere: nobody will call this engine, which then stops
    after the idle timeout instead of holding its GPUs for the executor's life."""
    serving = Serving(FakeLLM())
    serving.server.watch_pid, serving.server.idle_timeout = os.getpid(), 1.0
    serving.server.ready(ahead=False)
    threading.Thread(target=serving.server.watch, daemon=True).start()
    until(lambda: serving.stopped)
    assert serving.stopped[0][0].startswith("idle for")


def test_a_gpu_whose_engine_cannot_start_fails_its_own_tasks_at_once_not_the_other_gpus(tmp_path, monkeypatch):
    from spark_llm.engine_host import client as engine_client
    from spark_llm.engine_host import engine_for

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    tried = []

    def serving(slot, spec, process, dead=None, ahead=False):
        tried.append(slot.name)
        if slot.name == "gpu-0":
            raise EngineStartError("CUDA error: uncorrectable ECC error on GPU 0")
        return SlotRecord(0, key=spec.key), True, False
    monkeypatch.setattr(engine_client, "_serving", serving)
    monkeypatch.setattr(engine_client, "connect_or_gone", lambda slot, info: None)
    spec, process = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64)), ProcessSettings(0, "WARNING")
    for _ in range(2):  # the retry fails at once, without loading the model again
        with pytest.raises(EngineStartError, match="ECC"):
            with engine_for(spec, process, TaskPlace(gpus=("0",)), "run-1"):
                pass
    with engine_for(spec, process, TaskPlace(gpus=("1",)), "run-1") as engine:
        assert engine.slot.name == "gpu-1"
    assert tried == ["gpu-0", "gpu-1"]


def test_a_record_whose_pid_now_names_another_process_is_never_signalled(tmp_path, monkeypatch):
    from spark_llm.engine_host.client import engines_here, stop_engines_on
    from spark_llm.engine_host.directory import process_record
    from spark_llm.host import write_private

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    other = subprocess.Popen(["sleep", "60"])
    try:
        slot = Slot("cpu-1-0")
        record = process_record(other.pid, key="k")
        write_private(slot.path(".json"), {**record.as_json(), "pid_started": record.pid_started - 1})  # older
        assert engines_here() == []  # so stop_engines_on has nothing to stop, nor to wait for
        stop_engines_on(slot)
        assert other.poll() is None
        # recorded as it is, it is the engine: spark-llm engines stop stops it (it is starting: no socket yet)
        write_private(slot.path(".starting"), record.as_json())
        from spark_llm.cli import main

        assert main(["engines", "stop"]) == 0
        assert other.wait(10) is not None
    finally:
        other.kill()


def test_an_engine_directory_that_is_a_link_or_another_user_s_is_refused(tmp_path, monkeypatch):
    from spark_llm.engine_host import engine_dir

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "link"))
    with pytest.raises(EngineStartError, match="symbolic link"):
        engine_dir()
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        monkeypatch.setenv(ENGINE_DIR_ENV, str(theirs))
        with pytest.raises(EngineStartError, match="belongs to user id 65534"):
            engine_dir()


def test_a_slot_s_socket_fits_the_unix_limit_whatever_the_engine_directory_s_length(tmp_path, monkeypatch):
    from multiprocessing.connection import Client, Listener

    deep = tmp_path / ("engines-" + "d" * 150)
    monkeypatch.setenv(ENGINE_DIR_ENV, str(deep))
    slot = Slot.for_gpus(["0", "1", "2", "3"])
    path = slot.socket()
    assert len(path) <= 107 and path == slot.socket()
    with Listener(path, family="AF_UNIX", authkey=b"k") as listener:
        threading.Thread(target=lambda: listener.accept().send("ok"), daemon=True).start()
        assert Client(path, family="AF_UNIX", authkey=b"k").recv() == "ok"


def test_too_little_shared_memory_for_tensor_parallelism_is_one_clear_engine_start_error(monkeypatch):
    from spark_llm.engine_host import spec

    monkeypatch.setattr(spec.shutil, "disk_usage", lambda path: type("U", (), {"total": 64 << 20})())
    spec.check_shared_memory(1)  # one GPU per engine: no tensors exchanged
    with pytest.raises(EngineStartError, match=r"/dev/shm is 64 MiB.*--shm-size"):
        spec.check_shared_memory(2)


def test_the_engine_batch_is_vllm_s_default_for_the_gpu_unless_set():
    kwargs = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64)).llm_kwargs()
    assert "max_num_seqs" not in kwargs and "max_num_batched_tokens" not in kwargs
    kwargs = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64, max_num_seqs=512,
                                                max_num_batched_tokens=8192)).llm_kwargs()
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (512, 8192)


@pytest.mark.engine
def test_an_engine_stops_while_loading_when_its_executor_is_gone(tiny_model, tmp_path, monkeypatch):
    from spark_llm.engine_host import Executor, prestart, read_events
    from spark_llm.host import process_alive

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    executor = subprocess.Popen(["sleep", "60"])
    spec = EngineSpec.from_config(BatchConfig(model=tiny_model, max_model_len=256, dtype="float32",
                                              enforce_eager=True))
    slot = Slot.cpu(0, executor=executor.pid)
    assert prestart(spec, ProcessSettings(0, "WARNING"), slot, Executor(executor.pid, dict(os.environ)))
    engine_pid = slot.starting().pid
    until(lambda: any(e["event"] == "start" for e in read_events(tmp_path)), seconds=30)
    executor.kill()
    executor.wait()
    until(lambda: not process_alive(engine_pid), seconds=30)
    assert not process_alive(engine_pid)
    events = [e["event"] for e in read_events(tmp_path)]
    assert "ready" not in events and events[-1] == "stop", events
    assert "while the engine loaded" in Path(tmp_path / "events.jsonl").read_text()


def test_a_notebook_frees_the_gpus_of_its_host_s_engines_now(tmp_path, monkeypatch):
    import spark_llm
    from spark_llm.engine_host.directory import process_record
    from spark_llm.host import write_private

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    engine = subprocess.Popen(["sleep", "60"])  # stands in for an engine process still loading
    try:
        write_private(Slot("gpu-0", ("0",)).path(".starting"), process_record(engine.pid, key="k",
                                                                              devices=("0",)).as_json())
        assert spark_llm.stop_engines() == ["gpu-0"]
        assert engine.wait(10) is not None
    finally:
        engine.kill()


def test_a_driver_older_than_torch_s_cuda_is_one_message_with_the_driver_it_needs(monkeypatch, tmp_path):
    """torch (inside vLLM's start) says the driver is too old in its own words; the engine start says it in one
    message with the driver that torch's CUDA needs."""
    import types

    from spark_llm.config import BatchConfig
    from spark_llm.engine_host.spec import EngineSpec, build_engine, driver_too_old
    from spark_llm.errors import EngineStartError

    torch_says = ("The NVIDIA driver on your system is too old (found version 12020). Please update your GPU driver "
                  "by downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx")
    assert "580.65.06 or newer" in driver_too_old(torch_says, "13.0")
    assert "525.60.13 or newer" in driver_too_old("CUDA driver version is insufficient for CUDA runtime version", "12.9")
    assert "a newer NVIDIA driver" in driver_too_old(torch_says, None)
    assert driver_too_old("CUDA out of memory", "12.9") is None

    class LLM:
        enqueue = None

        def __init__(self, **kwargs):
            raise RuntimeError(torch_says)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.9")))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineStartError) as raised:
        build_engine(EngineSpec.from_config(BatchConfig(model=str(tmp_path))))
    message = str(raised.value)
    assert message.startswith("the NVIDIA driver on this host is older than the CUDA 12.9")
    assert "525.60.13 or newer" in message and "found version 12020" in message


def test_waves_asking_for_the_inference_profile_at_once_share_one(monkeypatch):
    """Two waves are in flight at once, each asking its run for the inference stage's ResourceProfile from a thread
    of its own: they get one profile (Spark tells profiles apart by id: two would be two sets of GPU executors, the
    first wave's idle and removed while the second waits for its own, as the elastic drill once showed)."""
    import threading

    import spark_llm.context as context
    from spark_llm.config import BatchConfig

    built: list[int] = []

    def slow_profile(resources):  # long enough for the other wave's thread to ask meanwhile
        built.append(1)
        time.sleep(0.3)
        return object()

    class Session:  # what the run's profile is kept by (weakly)
        pass

    monkeypatch.setattr(context, "resource_profile", slow_profile)
    monkeypatch.setattr(context, "spark_conf", lambda spark: DYNAMIC)
    run = context.RunContext(spark=Session(), cfg=BatchConfig(model="/m", gpus_per_executor=1), paths=None,
                             created_at=0, started=0.0, metrics=None, run_id="r")
    got: list = []
    waves = [threading.Thread(target=lambda: got.append(run.gpu_profile)) for _ in range(2)]
    for wave in waves:
        wave.start()
    for wave in waves:
        wave.join()
    assert len(built) == 1 and len(got) == 2 and got[0] is got[1]
