"""GPU-only logic and engine plumbing that needs no GPU: device selection from task resources, pinning, the vLLM
arguments, and per-request failure isolation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import eventually
from spark_llm.config import BatchConfig, ConfigError
from spark_llm.engine_host import EngineSpec, ProcessSettings, TaskPlace
from spark_llm.engine_host.isolation import EngineFault, generate_isolating, probe_indices
from spark_llm.engine_host.placement import LocalMaster, check_gpu_settings, inference_profile, select_gpus
from spark_llm.engine_host.protocol import SlotRecord
from spark_llm.engine_host.spec import whole_prefills
from spark_llm.errors import EngineStartError


def gpus(*addresses):
    return {"gpu": SimpleNamespace(name="gpu", addresses=list(addresses))}


def test_select_gpus_uses_exactly_the_task_addresses():
    assert select_gpus(gpus("3"), 1) == ["3"]
    assert select_gpus(gpus("0", "1"), 2) == ["0", "1"]
    assert select_gpus(None, 1) is None and select_gpus({}, 2) is None and select_gpus(gpus(), 1) is None


def test_select_gpus_rejects_a_mismatch_with_tensor_parallel_size():
    with pytest.raises(EngineStartError, match="spark.task.resource.gpu.amount=2"):
        select_gpus(gpus("0"), 2)


def test_gpu_slots_are_named_by_their_devices_and_fed_by_up_to_their_feeds(tmp_path, monkeypatch):
    import threading

    from spark_llm.engine_host import ENGINE_DIR_ENV, Slot

    from spark_llm.engine_host.client import hold_feed

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    assert Slot.for_gpus(["1", "0"]) == Slot("gpu-0,1", ("0", "1")) and Slot.for_gpus(["10", "9"]).devices == ("9", "10")
    with hold_feed(TaskPlace(gpus=("3",), feeds=2)) as a, hold_feed(TaskPlace(gpus=("3",), feeds=2)) as b:  # two tasks share GPU 3's engine
        assert a.slot == b.slot == Slot("gpu-3", ("3",)) and {a.index, b.index} == {0, 1}
        third = threading.Thread(target=lambda: hold_feed(TaskPlace(gpus=("3",), feeds=2)).__enter__(), daemon=True)
        third.start()
        third.join(0.5)
        assert third.is_alive()  # a third task waits for a feed
    third.join(5)
    assert not third.is_alive()


def test_without_gpus_tasks_take_every_engine_s_first_feed_before_a_second_one(tmp_path, monkeypatch):
    from spark_llm.engine_host import ENGINE_DIR_ENV
    from spark_llm.engine_host.client import hold_feed

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    with hold_feed(TaskPlace(local_engines=2, feeds=2)) as a, hold_feed(TaskPlace(local_engines=2, feeds=2)) as b, \
            hold_feed(TaskPlace(local_engines=2, feeds=2)) as c:
        assert [(f.slot.name[-2:], f.index) for f in (a, b, c)] == [("-0", 0), ("-1", 0), ("-0", 1)]
    with hold_feed(TaskPlace()) as a, hold_feed(TaskPlace()) as b:  # unbounded: an engine per running task
        assert a.slot.name.endswith("-0") and b.slot.name.endswith("-1") and a.index == b.index == 0


def test_a_task_alone_on_its_engine_waits_for_the_other_feeder_and_keeps_new_ones_out(tmp_path, monkeypatch):
    """The alone phase lasts until the test ends it, so what is asserted inside it does not depend on timing; the
    waits for what must not happen are short sleeps that a correct product passes however long they are."""
    import threading
    import time

    from spark_llm.engine_host import ENGINE_DIR_ENV

    from spark_llm.engine_host.client import hold_feed

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    events, done_alone = [], threading.Event()
    with hold_feed(TaskPlace(local_engines=1, feeds=2)) as isolating:
        other = hold_feed(TaskPlace(local_engines=1, feeds=2))
        other.__enter__()

        def go_alone() -> None:
            with isolating.alone():
                events.append("alone")
                done_alone.wait(30)
            events.append("shared again")
        t = threading.Thread(target=go_alone)
        t.start()
        time.sleep(0.3)
        assert events == []  # the other feeder's partition is still in the engine
        other.__exit__(None, None, None)
        eventually(lambda: events == ["alone"], "the task is alone on its engine once the other feeder left")
        late = threading.Thread(target=lambda: events.append(hold_feed(TaskPlace(local_engines=1, feeds=2)).__enter__().index))
        late.start()
        time.sleep(0.3)
        assert events == ["alone"]  # no new feeder while a task is alone on the engine
        done_alone.set()
        t.join()
        late.join(30)
        assert events[:2] == ["alone", "shared again"] and events[2] in (0, 1)


def test_a_local_driver_starts_its_executor_s_engines_with_the_environment_its_python_workers_would_have(
        tmp_path, monkeypatch):
    from spark_llm import host
    from spark_llm.engine_host import client as engine_client
    from spark_llm.engine_host import ENGINE_DIR_ENV, Executor, ProcessSettings, Slot, prestart
    from spark_llm.session import local_worker_env

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # the driver's own; PySpark gives its workers spark.task.cpus
    env = local_worker_env({"spark.executorEnv.HF_HOME": "/models", "spark.task.cpus": "2"})
    assert env["HF_HOME"] == "/models" and env["OMP_NUM_THREADS"] == "2"
    assert local_worker_env({})["OMP_NUM_THREADS"] == "1"
    assert local_worker_env({"spark.executorEnv.OMP_NUM_THREADS": "4", "spark.task.cpus": "2"})["OMP_NUM_THREADS"] == "4"

    spawned = []

    class Popen:  # the engine server's process, not started
        def __init__(self, cmd, env, **kwargs):
            spawned.append((cmd, env))
            self.pid = 4242

    monkeypatch.setattr(engine_client.subprocess, "Popen", Popen)
    monkeypatch.setattr(host, "process_alive", lambda pid: pid == 4242)
    spec = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64))
    slot = Slot.cpu(0, executor=31337)
    assert slot.name == "cpu-31337-0"
    process = ProcessSettings(engine_idle_timeout_seconds=0, engine_log_level="WARNING")
    assert prestart(spec, process, slot, Executor(31337, env))
    [(cmd, server_env)] = spawned
    assert cmd[cmd.index("--watch-pid") + 1] == "31337"  # it ends with the executor's JVM, not with this process
    assert server_env["OMP_NUM_THREADS"] == "2" and server_env["HF_HOME"] == "/models"
    assert json.loads(slot.path(".starting").read_text())["key"] == spec.key
    # the slot's engine is starting: the tasks (and a second warm-up) wait for it instead of starting another
    assert not prestart(spec, process, slot, Executor(31337, env)) and len(spawned) == 1


def test_an_engine_process_calls_nothing_outside_unless_its_executor_says_so():
    """vLLM's usage report and the hub's telemetry are off in an engine's environment, the hub offline; a value the
    executor sets wins (a user who opts in), and the GPUs it is given are the ones it sees."""
    from spark_llm.engine_host.spec import engine_environment

    env = engine_environment({"PATH": "/bin"}, (), "WARNING", {})
    assert {k: env[k] for k in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_OFFLINE")} \
        == dict.fromkeys(("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_OFFLINE"), "1")
    assert env["PATH"] == "/bin" and "CUDA_VISIBLE_DEVICES" not in env and env["VLLM_LOGGING_LEVEL"] == "WARNING"
    opted_in = engine_environment({"VLLM_NO_USAGE_STATS": "0", "HF_HUB_OFFLINE": "0"}, ("3", "1"), "INFO",
                                  {"TRITON_HOME": "/e/cache/triton"})
    assert opted_in["VLLM_NO_USAGE_STATS"] == "0" and opted_in["HF_HUB_OFFLINE"] == "0"
    assert opted_in["CUDA_VISIBLE_DEVICES"] == "3,1" and opted_in["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert opted_in["TRITON_HOME"] == "/e/cache/triton"


def test_what_reaches_past_loopback_is_egress_and_only_that():
    import socket

    from spark_llm.engine_host.egress import Egress, outside

    tcp, udp = socket.socket(socket.AF_INET, socket.SOCK_STREAM), socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    unix = socket.socket(socket.AF_UNIX)
    names = frozenset({"localhost", "gpu-node-7"})
    try:
        assert outside("socket.connect", (tcp, ("10.1.2.3", 443)), names) == Egress("connect", "10.1.2.3:443", "tcp")
        assert outside("socket.connect", (tcp, ("stats.vllm.ai", 443)), names).address == "stats.vllm.ai:443"
        assert outside("socket.sendto", (udp, ("2001:db8::1", 53, 0, 0)), names) == \
            Egress("sendto", "2001:db8::1:53", "udp")
        assert outside("socket.getaddrinfo", ("huggingface.co", 443, 0, 0, 0), names) == \
            Egress("lookup", "huggingface.co:443", "dns")
        inside = [("socket.connect", (tcp, ("127.0.0.1", 8080))), ("socket.connect", (tcp, ("localhost", 1))),
                  ("socket.sendto", (udp, ("::1", 53, 0, 0))), ("socket.connect", (unix, "/tmp/slot.sock")),
                  ("socket.getaddrinfo", ("gpu-node-7", None, 0, 0, 0)), ("socket.getaddrinfo", (None, 0, 0, 0, 0)),
                  ("socket.getaddrinfo", ("10.1.2.3", 443, 0, 0, 0)),  # an address asks no resolver; its connect counts
                  ("socket.bind", (tcp, ("0.0.0.0", 0))), ("open", ("/etc/hosts", "r", 0))]
        assert [outside(event, args, names) for event, args in inside] == [None] * len(inside)
    finally:
        tcp.close(), udp.close(), unix.close()


def test_an_engine_process_records_each_call_outside_once_through_python_s_own_audit_hooks(tmp_path):
    """egress.watch in a process of its own (audit hooks stay for a process's life), on the socket module's real
    calls; a second hook of the test's refuses the outside ones, so that nothing leaves this machine."""
    import subprocess
    import sys

    from conftest import ROOT

    script = """
import json, socket, sys
from spark_llm.engine_host import egress
got = []
egress.watch(got.append)
def refuse(event, args):
    if event in egress.SOCKET_EVENTS and egress.outside(event, args) is not None:
        raise PermissionError("refused by the test")
sys.addaudithook(refuse)
server = socket.create_server(("127.0.0.1", 0))
socket.create_connection(("localhost", server.getsockname()[1])).close()
for call in [lambda: socket.create_connection(("192.0.2.1", 443), timeout=1),
             lambda: socket.create_connection(("192.0.2.1", 443), timeout=1),
             lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("192.0.2.7", 53)),
             lambda: socket.getaddrinfo("stats.vllm.ai", 443)]:
    try:
        call()
    except PermissionError:
        pass
print(json.dumps([found._asdict() for found in got]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"call": "connect", "address": "192.0.2.1:443", "protocol": "tcp"},
                                       {"call": "sendto", "address": "192.0.2.7:53", "protocol": "udp"},
                                       {"call": "lookup", "address": "stats.vllm.ai:443", "protocol": "dns"}]
    assert proc.stderr.count("engine process calls out") == 3


def test_cpu_slots_started_together_share_one_process_that_forks_their_engines_gpu_slots_get_one_each(
        tmp_path, monkeypatch):
    from spark_llm import host
    from spark_llm.engine_host import client as engine_client
    from spark_llm.engine_host import ENGINE_DIR_ENV, Executor, ProcessSettings, Slot, prestart_slots

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    spawned = []

    class Popen:  # the engine server's process, not started
        def __init__(self, cmd, env, **kwargs):
            spawned.append(cmd)
            self.pid = 4242 + len(spawned)

    monkeypatch.setattr(engine_client.subprocess, "Popen", Popen)
    monkeypatch.setattr(host, "process_alive", lambda pid: pid in (4243, 4244))
    spec = EngineSpec.from_config(BatchConfig(model="/m", max_model_len=64))
    process = ProcessSettings(engine_idle_timeout_seconds=0, engine_log_level="WARNING")
    cpu = [Slot.cpu(n, executor=31337) for n in range(2)]
    assert prestart_slots(spec, process, cpu, Executor(31337, {})) == cpu
    [cmd] = spawned
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--slot"] == [s.name for s in cpu]
    assert all(json.loads(s.path(".starting").read_text())["pid"] == 4243 for s in cpu)  # until it forks theirs
    assert prestart_slots(spec, process, cpu, Executor(31337, {})) == [] and len(spawned) == 1  # starting already
    gpu = [Slot.for_gpus(["0"]), Slot.for_gpus(["1"])]
    assert prestart_slots(spec, process, gpu, Executor(31337, {})) == gpu
    assert [c[c.index("--slot") + 1] for c in spawned[1:]] == ["gpu-0", "gpu-1"]  # a process (and a CUDA) each


def test_a_task_awaiting_a_slot_s_engine_follows_the_process_forked_for_the_slot(tmp_path, monkeypatch):
    """A process started for several slots forks each slot's engine and records it as the slot's (``launcher``
    naming itself): a task awaiting the process it saw starting gets the forked engine's info when it is ready, and
    that engine's reason, at once, when it could not start, while the other slots' engines still load."""
    import subprocess
    import sys

    from spark_llm.engine_host import ENGINE_DIR_ENV, Slot

    from spark_llm.engine_host.client import await_server

    from spark_llm.host import write_private

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failed = subprocess.Popen([sys.executable, "-c", "pass"])
    failed.wait()
    try:
        ready, broken = Slot("cpu-test-0"), Slot("cpu-test-1")
        write_private(ready.path(".json"), {"pid": 99999999, "launcher": launcher.pid, "key": "k", "authkey": "x"})
        assert await_server(ready, launcher.pid).pid == 99999999
        write_private(broken.path(".starting"), {"pid": failed.pid, "launcher": launcher.pid, "key": "k"})
        broken.path(".error").write_text("model /m not found")
        with pytest.raises(EngineStartError, match="model /m not found"):
            await_server(broken, launcher.pid)  # not once the launcher has gone
        assert launcher.poll() is None
    finally:
        launcher.kill()
        launcher.wait()


def test_engine_spec_maps_config_to_vllm_arguments():
    cfg = BatchConfig(model="/m", max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=1 << 28,
                      enforce_eager=True, engine_kwargs={"swap_space": 1})
    kw = EngineSpec.from_config(cfg).llm_kwargs()
    assert kw["model"] == "/m" and kw["tokenizer"] == "/m" and kw["max_num_seqs"] == 8
    assert kw["max_model_len"] == 512 and kw["kv_cache_memory_bytes"] == 1 << 28 and kw["enforce_eager"]
    assert kw["distributed_executor_backend"] == "uni" and kw["swap_space"] == 1
    tp = EngineSpec.from_config(BatchConfig(model="/m", tensor_parallel_size=4)).llm_kwargs()
    assert tp["tensor_parallel_size"] == 4 and tp["distributed_executor_backend"] == "mp"
    # nested vLLM arguments, settings the engine process keeps for itself, LoRA only with adapters
    assert kw["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert "tool_call_parser" not in kw and "lora_modules" not in kw and "enable_lora" not in kw
    assert "max_loras" not in kw and "max_lora_rank" not in kw
    lora = EngineSpec.from_config(BatchConfig(model="/m", tool_call_parser="hermes", lora_modules={"a": "/a"},
                                              max_lora_rank=32)).llm_kwargs()
    assert lora["enable_lora"] and lora["max_lora_rank"] == 32 and lora["max_loras"] == 4
    assert "tool_call_parser" not in lora and "lora_modules" not in lora


def test_the_runner_is_read_from_the_model_directory(tmp_path):
    from spark_llm.models import model_runner

    def model(name, architectures, *files):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": architectures}))
        for f in files:
            (d / f).write_text("[]")
        return str(d)

    assert model_runner(model("llama", ["LlamaForCausalLM"])) == "generate"
    assert model_runner(model("vlm", ["Qwen2VLForConditionalGeneration"])) == "generate"
    assert model_runner(model("bert", ["BertModel"])) == "pooling"
    assert model_runner(model("st", ["Qwen3ForCausalLM"], "modules.json")) == "pooling"  # sentence-transformers
    assert model_runner(str(tmp_path / "missing")) == "generate"


def test_generate_isolating_finds_the_failing_request():
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts))
        if "bad" in prompts:
            raise ValueError("rejected")
        return [p.upper() for p in prompts]

    prompts = ["a", "b", "bad", "c", "d"]
    out = generate_isolating(generate, prompts, [None] * 5)
    assert out[:2] == ["A", "B"] and out[3:] == ["C", "D"]
    assert isinstance(out[2], ValueError)
    assert calls[0] == 5


def test_generate_isolating_reraises_fatal_errors():
    class Dead(Exception):
        pass

    def generate(prompts, params):
        raise Dead()

    with pytest.raises(Dead):
        generate_isolating(generate, ["a", "b"], [None, None], is_fatal=lambda e: isinstance(e, Dead))


def test_a_failed_call_s_probes_are_spread_over_it_and_a_small_call_has_none():
    assert probe_indices(10) == [0, 3, 6, 9]
    assert probe_indices(4) == [0, 1, 2, 3]
    assert probe_indices(3) == [] and probe_indices(1) == []


def test_a_failure_every_probe_meets_alone_is_the_engine_s_found_in_a_few_calls():
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts))
        raise RuntimeError("CPU Generator does not use offset")

    with pytest.raises(EngineFault) as caught:
        generate_isolating(generate, [f"p{i}" for i in range(128)], [None] * 128)
    assert calls == [128, 1, 1, 1, 1]  # not 255 calls bisecting down to each request
    assert caught.value.signature == "RuntimeError: CPU Generator does not use offset"
    assert "enable_chunked_prefill" in str(caught.value)  # what to change


def test_probes_that_pass_keep_their_answers_and_the_rest_is_bisected_to_the_request_at_fault():
    calls = []

    def generate(prompts, params):
        calls.append(list(prompts))
        if "bad" in prompts:
            raise ValueError("rejected")
        return [p.upper() for p in prompts]

    prompts = [f"p{i}" for i in range(10)]
    prompts[0] = "bad"  # a probe itself is at fault: the others pass, so the request is to blame, not the engine
    out = generate_isolating(generate, prompts, [None] * 10)
    assert isinstance(out[0], ValueError)
    assert out[1:] == [p.upper() for p in prompts[1:]]
    assert sum(p.count("p3") for p in calls) == 2  # a probe that passed ran once more only in the first call
    assert all("bad" not in c for c in calls[5:])  # the bisection ran over the rest, without the probes


def test_two_requests_that_fail_alike_are_each_their_own_error_not_the_engine_s():
    def generate(prompts, params):
        raise ValueError("rejected")

    out = generate_isolating(generate, ["a", "b"], [None, None])
    assert all(isinstance(o, ValueError) for o in out)


def test_on_a_cpu_every_prompt_is_prefilled_whole_unless_engine_kwargs_chose_chunking():
    kwargs = {"model": "m", "max_model_len": 2048, "max_num_batched_tokens": 512}
    assert whole_prefills(kwargs, on_cpu=True) == {**kwargs, "enable_chunked_prefill": False,
                                                   "max_num_batched_tokens": 2048}
    assert whole_prefills({"model": "m", "max_model_len": 2048}, on_cpu=True)["enable_chunked_prefill"] is False
    assert whole_prefills(kwargs, on_cpu=False) == kwargs  # a GPU rewinds a seeded stream as vLLM means it to
    chosen = {**kwargs, "enable_chunked_prefill": True}
    assert whole_prefills(chosen, on_cpu=True) == chosen
    pooling = {**kwargs, "runner": "pooling"}
    assert whole_prefills(pooling, on_cpu=True) == pooling
    spec = EngineSpec.from_config(BatchConfig(model="m", runner="pooling", max_model_len=64))
    assert spec.llm_kwargs()["runner"] == "pooling"  # the key whole_prefills reads


def test_gpu_settings_must_give_each_task_one_engines_gpus_or_a_share_of_one_gpu():
    check_gpu_settings({}, 1)
    check_gpu_settings({"spark.task.resource.gpu.amount": "2"}, 2)
    check_gpu_settings({"spark.executor.resource.gpu.amount": "8"}, 2)
    check_gpu_settings({"spark.task.resource.gpu.amount": "0.5"}, 1)  # two tasks feeding one GPU's engine
    with pytest.raises(ConfigError, match="1/N of it"):
        check_gpu_settings({"spark.task.resource.gpu.amount": "0.3"}, 1)
    with pytest.raises(ConfigError, match="tensor_parallel_size is 2"):
        check_gpu_settings({"spark.task.resource.gpu.amount": "0.5"}, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size is 4"):
        check_gpu_settings({"spark.task.resource.gpu.amount": "1"}, 4)
    with pytest.raises(ConfigError, match="executors have 2 GPU.*one engine's GPUs must be on one executor"):
        check_gpu_settings({"spark.executor.resource.gpu.amount": "2"}, 4)
    with pytest.raises(ConfigError, match="RLIMIT_AS"):
        check_gpu_settings({"spark.executor.resource.gpu.amount": "1", "spark.executor.pyspark.memory": "4g"}, 1)


def test_only_the_inference_stage_asks_for_gpus_a_share_of_one_when_tasks_feed_one_engine():
    assert inference_profile({}, 1) is None
    assert inference_profile({"spark.executor.resource.gpu.amount": "4", "spark.task.resource.gpu.amount": "1"},
                             1) is None  # every stage asks already
    profile = inference_profile({"spark.executor.resource.gpu.amount": "4", "spark.task.cpus": "2"}, 2)
    tasks = profile.taskResources
    assert tasks["gpu"].amount == 2 and tasks["cpus"].amount == 2
    assert inference_profile({"spark.executor.resource.gpu.amount": "4"}, 1, feeds=2).taskResources["gpu"].amount == 0.5
    assert inference_profile({"spark.executor.resource.gpu.amount": "4"}, 2, feeds=2).taskResources["gpu"].amount == 2


def layout(conf, engines=None, tasks_per_engine=2, tp=1, parallelism=2, threads=None):
    from spark_llm.engine_host.placement import engine_layout

    return engine_layout(conf, engines=engines, tasks_per_engine=tasks_per_engine, tensor_parallel_size=tp,
                         parallelism=lambda: parallelism,
                         local=LocalMaster(threads) if threads else None)


def test_the_engine_layout_counts_engines_and_the_tasks_that_feed_each():
    from spark_llm.engine_host.placement import EngineLayout

    gpu = {"spark.executor.resource.gpu.amount": "8", "spark.executor.instances": "4", "spark.executor.cores": "16"}
    assert layout(gpu) == EngineLayout(32, 2, executor_engines=8)  # 4 executors x 8 GPUs, two tasks per GPU
    # cores not known here (a standalone executor takes its worker's): one task per GPU, which any count runs
    assert layout({**gpu, "spark.executor.cores": ""}) == EngineLayout(32, 1, executor_engines=8)
    # 8 engines x 2 tasks x 2 cpus do not fit 16 cores: Spark would pack the tasks two to a GPU and idle the rest
    assert layout({**gpu, "spark.executor.cores": "16", "spark.task.cpus": "2"}) == \
        EngineLayout(32, 1, executor_engines=8)
    assert layout(gpu, tp=2) == EngineLayout(16, 1, executor_engines=4)  # a tensor-parallel group is fed by one task
    # the user's share
    assert layout({**gpu, "spark.task.resource.gpu.amount": "0.25"}) == EngineLayout(32, 4, executor_engines=8)
    assert layout({**gpu, "spark.task.resource.gpu.amount": "1"}) == EngineLayout(32, 1, executor_engines=8)
    assert layout(gpu, tasks_per_engine=1).tasks == 32
    # a local master: the engines share its cores, each fed by as many of its task threads as there are
    assert layout({"spark.master": "local[4,8]"}, threads=4) == EngineLayout(2, 2, local_engines=2)
    assert layout({"spark.master": "local[2,8]"}, threads=2) == EngineLayout(2, 1, local_engines=2)
    assert layout({"spark.master": "local[4,8]"}, engines=1, tasks_per_engine=4, threads=4) == \
        EngineLayout(1, 4, local_engines=1)
    assert layout({"spark.master": "yarn"}, parallelism=6) == EngineLayout(6, 1)  # no GPUs: an engine per task


def test_local_task_threads_are_read_from_the_master():
    from spark_llm.session_info import local_task_threads

    assert local_task_threads({"spark.master": "local[4,8]"}) == 4
    assert local_task_threads({"spark.master": "local"}) == 1
    assert local_task_threads({"spark.master": "local[*]"}) >= 1
    assert local_task_threads({"spark.master": "spark://host:7077"}) is None


# ---- the streamed engine call, against a stand-in for vLLM's LLM (the real protocol and server loop) ---------

class FakeLLM:
    """What the engine server uses of ``vllm.LLM``: ``enqueue`` and the ``llm_engine`` step loop (one request
    finishes per step, last added first), plus ``generate`` for the isolating fallback. Prompts of ``refused``
    token ids are rejected when added; ``step_fails`` makes the ``n``-th step raise ``failure``."""

    def __init__(self, refused=(), step_fails=None, failure=None, step_seconds=0.0, endless=()):
        self.refused, self.step_fails, self.steps, self.counter = set(refused), step_fails, 0, 0
        self.endless = set(endless)  # first token ids of requests that never finish (a very long answer)
        self.failure = failure or RuntimeError("a kernel choked")
        self.step_seconds = step_seconds
        self.running: dict[str, list[int]] = {}
        self.added: list[int] = []  # first token of each request, in the order it was added
        self.mixed = False  # the engine held requests of two streams (first tokens < 50 and >= 50) at once
        self.max_running = 0
        self.aborted: list[str] = []
        self.llm_engine = self
        self.stuck = False  # steps make no tokens (vLLM's engine core hands over none): a hung engine
        self.engine_core = SimpleNamespace(get_output=lambda: SimpleNamespace(
            outputs=[] if self.stuck else list(self.running)))

    @property
    def output_processor(self):  # vLLM's record of the requests in the engine, by their internal ids
        return SimpleNamespace(request_states={f"{rid}-abcd1234": ids for rid, ids in self.running.items()})

    def enqueue(self, prompts, params, lora_request=None, use_tqdm=False):
        if any(p["prompt_token_ids"][0] in self.refused for p in prompts):
            raise ValueError("max_logprobs exceeded")
        ids = []
        for p in prompts:
            self.counter += 1
            ids.append(f"{self.counter}-abcd1234")  # vLLM's own id: the one added with, a random suffix
            self.running[str(self.counter)] = p["prompt_token_ids"]
            self.added.append(p["prompt_token_ids"][0])
        return ids

    def step(self):
        import time

        self.steps += 1
        self.engine_core.get_output()  # as vLLM's step does: the tokens each request made
        self.max_running = max(self.max_running, len(self.running))
        self.mixed |= len({ids[0] >= 50 for ids in self.running.values()}) == 2
        time.sleep(self.step_seconds)
        if self.step_fails == self.steps:
            raise self.failure
        finishing = [rid for rid in self.running if self.running[rid][0] not in self.endless]
        if not finishing:
            return []
        rid = sorted(finishing, key=int)[-1]
        return [_output(rid, self.running.pop(rid))]

    def abort_request(self, ids, internal=False):
        self.aborted.extend(ids)
        for i in ids:
            self.running.pop(i.split("-")[0], None)

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        return [_output("x", p["prompt_token_ids"]) for p in prompts]


def _output(rid, ids):
    choice = SimpleNamespace(index=0, text=f"t{ids[0]}", token_ids=[7], finish_reason="length", logprobs=None)
    return SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=ids, outputs=[choice], num_cached_tokens=0)


class Serving:
    """An engine server holding ``fake``, its engine loop running, and clients over real connection pairs."""

    def __init__(self, fake, start_loop=True):
        import threading

        from spark_llm.engine_host.server import EngineServer
        from spark_llm.engine_host import Slot

        self.server = EngineServer(Slot("cpu-test-0"), "key", 0, 0)
        self.server.engine, self.server.parsers = fake, SimpleNamespace(parse=lambda choice, parse: None)
        self.server.count_progress()  # as the server does once its engine is built
        self.stopped: list[tuple[str, int]] = []

        def stop(reason, code=0, shutdown=True):  # the real one ends the process: this one never returns either
            self.stopped.append((reason, code))
            threading.Event().wait()
        self.server.stop = stop
        self.loop = threading.Thread(target=self.server.run, daemon=True)
        if start_loop:
            self.loop.start()

    def client(self, call_timeout=None):
        import threading
        from multiprocessing import Pipe

        from spark_llm.engine_host import EngineClient, Slot

        from spark_llm.engine_host.client import Feed

        ours, theirs = Pipe()
        threading.Thread(target=self.server.handle, args=(theirs,), daemon=True).start()
        process = None if call_timeout is None else ProcessSettings(0, "INFO", engine_call_timeout_seconds=call_timeout)
        return EngineClient(Feed(Slot("cpu-test-0"), 0, 1), SlotRecord(0), False, _conn=ours, _process=process)


def stream_through(fake, requests):
    """Stream ``requests`` through an engine server holding ``fake``, over a real connection pair."""
    got: list = []
    Serving(fake).client().stream(requests, lambda i, result: got.append((i, result)))
    return got


def request(first_token):
    from spark_llm.engine_host import EngineRequest

    return EngineRequest([first_token, 1, 2], {"max_tokens": 1})


def test_a_streamed_call_answers_every_request_once_as_it_finishes(monkeypatch):
    monkeypatch.setattr("spark_llm.engine_host.client.STREAM_CHUNK", 3)  # several chunks
    got = stream_through(FakeLLM(), [request(t) for t in range(10, 20)])
    assert sorted(i for i, _ in got) == list(range(10))
    assert {i: r.outputs[0].text for i, r in got} == {i: f"t{10 + i}" for i in range(10)}
    assert [i for i, _ in got] != list(range(10))  # in the order they finished, not the order they were sent


def test_a_request_the_engine_refuses_is_that_requests_failure_only():
    from spark_llm.engine_host import RequestFailure

    got = dict(stream_through(FakeLLM(refused={12}), [request(t) for t in range(10, 15)]))
    assert isinstance(got[2], RequestFailure) and got[2].kind == "engine" and "max_logprobs" in got[2].message
    assert all(got[i].outputs[0].text == f"t{10 + i}" for i in (0, 1, 3, 4))


def test_when_a_step_fails_the_requests_in_flight_are_answered_by_the_isolating_path():
    fake = FakeLLM(step_fails=2)
    got = dict(stream_through(fake, [request(t) for t in range(10, 16)]))
    assert sorted(got) == list(range(6)) and all(got[i].outputs[0].text == f"t{10 + i}" for i in got)
    assert fake.aborted and not fake.running  # nothing of the call is left in the engine


def test_a_failed_call_leaves_none_of_its_requests_in_the_engine():
    class Failing(FakeLLM):
        def generate(self, prompts, params, lora_request=None, use_tqdm=False):
            self.enqueue(prompts, params)  # vLLM's generate adds them, then a step raises
            raise RuntimeError("a kernel choked")
    fake = Failing(step_fails=1)
    got = dict(stream_through(fake, [request(t) for t in range(10, 13)]))
    assert all(got[i].kind == "engine" and "choked" in got[i].message for i in range(3))
    assert not fake.running  # each failed call's requests were ended, not left to pile up


def test_an_engine_that_fails_every_request_alike_tells_each_feeder_and_stops():
    from spark_llm.engine_host.protocol import EngineFaulted

    class FailingAll(FakeLLM):
        def generate(self, prompts, params, lora_request=None, use_tqdm=False):
            raise RuntimeError("CPU Generator does not use offset")
    serving = Serving(FailingAll(step_fails=1, failure=RuntimeError("CPU Generator does not use offset")),
                      start_loop=False)
    threads, results, errors = streams_at_once(serving, [[request(t) for t in range(10, 14)],
                                                         [request(t) for t in range(50, 54)]])
    wait_for_inbox(serving.server, 2)
    serving.loop.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(e, EngineFaulted) and "does not use offset" in str(e) for e in errors), errors
    until(lambda: serving.stopped)
    assert serving.stopped[0][1] == 1 and results == [[], []]


def test_a_stepping_engine_that_makes_no_tokens_sends_no_word_and_its_task_takes_it_for_hung(monkeypatch):
    from spark_llm.engine_host.client import EngineHung

    monkeypatch.setattr("spark_llm.engine_host.server.HEARTBEAT_SECONDS", 0.05)
    fake = FakeLLM(step_seconds=0.01, endless={10})
    fake.stuck = True
    serving = Serving(fake)
    with pytest.raises(EngineHung):
        serving.client(call_timeout=1.0).stream([request(10)], lambda i, r: None)
    assert fake.steps > 10 and serving.server.progress == 0  # it stepped all along, and made nothing


def test_an_engine_that_makes_tokens_for_longer_than_the_call_timeout_is_not_hung(monkeypatch):
    monkeypatch.setattr("spark_llm.engine_host.server.HEARTBEAT_SECONDS", 0.05)

    class Slow(FakeLLM):  # the request finishes after 2 s of steps that each make a token
        def step(self):
            if self.steps * self.step_seconds >= 2.0:
                self.endless.clear()
            return super().step()
    fake = Slow(step_seconds=0.01, endless={10})
    serving = Serving(fake)
    got = []
    serving.client(call_timeout=0.5).stream([request(10)], lambda i, r: got.append(r))
    assert [r.outputs[0].text for r in got] == ["t10"] and serving.server.progress >= 100


def test_an_engine_stuck_in_a_call_ends_itself_once_its_executor_is_gone(monkeypatch):
    """The executor that started the engine is gone while the engine loop is stuck in a blocking call (which never
    reads the loop's stop): the watch thread ends the process itself, without asking the stuck engine to shut
    down first."""
    import threading

    monkeypatch.setattr("spark_llm.engine_host.server.STOP_TIMEOUT_SECONDS", 2.0)
    stuck = threading.Event()

    class Stuck(FakeLLM):
        def generate(self, prompts, params, lora_request=None, use_tqdm=False):
            stuck.set()
            threading.Event().wait()  # a step loop that never ends
    serving = Serving(Stuck(step_fails=1))
    stopped = []

    def stop(reason, code=0, shutdown=True):
        stopped.append((reason, shutdown))
        threading.Event().wait()
    serving.server.stop = stop
    task_errors: list = []

    def task() -> None:  # the task's call: it hears nothing from the stuck engine, and takes it for hung
        try:
            serving.client(call_timeout=5.0).stream([request(10)], lambda i, r: None)
        except Exception as exc:
            task_errors.append(exc)
    call = threading.Thread(target=task, daemon=True)
    call.start()
    until(stuck.is_set)
    serving.server.watch_pid = -1  # no such process: the executor is gone
    threading.Thread(target=serving.server.watch, daemon=True).start()
    until(lambda: stopped)
    assert stopped == [("executor gone while the engine was stuck in a call", False)]
    call.join(60)
    from spark_llm.engine_host.client import EngineHung

    assert [type(e) for e in task_errors] == [EngineHung]


def streams_at_once(serving, calls):
    """Each list of requests in ``calls`` streamed by a client of its own, at the same time; each one's results."""
    import threading

    results = [[] for _ in calls]
    errors: list = [None] * len(calls)

    def run(n: int) -> None:
        try:
            serving.client().stream(calls[n], lambda i, r: results[n].append((i, r)))
        except Exception as exc:
            errors[n] = exc
    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(calls))]
    for t in threads:
        t.start()
    return threads, results, errors


def until(condition, seconds=60.0):
    """Wait for ``condition`` (:func:`conftest.eventually`): the bound is for a hung test, not for the timing."""
    eventually(condition, "the state the test waits for", seconds, every=0.005)


def wait_for_inbox(server, items):
    until(lambda: server.inbox.qsize() >= items)


def test_two_tasks_feed_one_engine_at_once_and_each_gets_exactly_its_own_answers():
    fake = FakeLLM()
    serving = Serving(fake, start_loop=False)
    a, b = [request(t) for t in range(10, 15)], [request(t) for t in range(50, 55)]
    threads, results, errors = streams_at_once(serving, [a, b])
    wait_for_inbox(serving.server, 2)  # both tasks' requests arrived before the engine runs a step
    serving.loop.start()
    for t in threads:
        t.join(60)
    assert errors == [None, None]
    assert fake.max_running == 10  # the engine's batch held both tasks' requests
    assert {i: r.outputs[0].text for i, r in results[0]} == {i: f"t{10 + i}" for i in range(5)}
    assert {i: r.outputs[0].text for i, r in results[1]} == {i: f"t{50 + i}" for i in range(5)}
    assert not fake.running and not serving.server.streams


def test_the_engine_takes_the_older_task_s_requests_first_and_the_newer_one_s_fill_its_tail():
    fake = FakeLLM()
    serving = Serving(fake, start_loop=False)
    serving.server.backlog = 4  # requests kept in the engine (2 x max_num_seqs in a real one)
    older, newer = [request(t) for t in range(10, 16)], [request(t) for t in range(50, 56)]
    threads, results, errors = streams_at_once(serving, [older])
    wait_for_inbox(serving.server, 1)
    more, more_results, more_errors = streams_at_once(serving, [newer])
    wait_for_inbox(serving.server, 2)
    serving.loop.start()
    for t in threads + more:
        t.join(60)
    assert errors == more_errors == [None]
    assert fake.added == list(range(10, 16)) + list(range(50, 56))  # in order: the older task's, then the newer's
    assert fake.max_running == 4 and fake.mixed  # never more than the backlog; the newer filled the older's tail
    assert len(results[0]) == len(more_results[0]) == 6


def test_a_failed_step_isolates_both_tasks_requests_and_answers_each_its_own():
    fake = FakeLLM(step_fails=1)
    serving = Serving(fake, start_loop=False)
    threads, results, errors = streams_at_once(serving, [[request(t) for t in range(10, 13)],
                                                         [request(t) for t in range(50, 53)]])
    wait_for_inbox(serving.server, 2)
    serving.loop.start()
    for t in threads:
        t.join(60)
    assert errors == [None, None] and len(fake.aborted) == 6
    assert sorted(r.outputs[0].text for _, r in results[0]) == ["t10", "t11", "t12"]
    assert sorted(r.outputs[0].text for _, r in results[1]) == ["t50", "t51", "t52"]


def test_a_dead_engine_tells_every_feeder_and_the_server_stops(monkeypatch):
    from spark_llm.engine_host import EngineDied

    class Dead(Exception):
        pass
    monkeypatch.setattr("spark_llm.engine_host.server.is_fatal", lambda exc: isinstance(exc, Dead))
    serving = Serving(FakeLLM(step_fails=1, failure=Dead("CUDA error: an illegal memory access")), start_loop=False)
    threads, results, errors = streams_at_once(serving, [[request(10)], [request(50)]])
    wait_for_inbox(serving.server, 2)
    serving.loop.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(e, EngineDied) and "illegal memory access" in str(e) for e in errors), errors
    until(lambda: serving.stopped)  # the loop goes on to stop the server once the feeders are told
    assert serving.stopped and serving.stopped[0][1] == 1 and results == [[], []]


def test_an_embedding_engine_that_dies_in_a_whole_call_tells_its_feeder_and_the_server_stops(monkeypatch):
    from spark_llm.engine_host import EngineDied, EngineRequest, EngineTask

    class Dead(Exception):
        pass

    class DyingEmbedder(FakeLLM):
        def embed(self, prompts, pooling_params=None, lora_request=None, use_tqdm=False):
            raise Dead("CUDA error: device-side assert triggered")
    monkeypatch.setattr("spark_llm.engine_host.server.is_fatal", lambda exc: isinstance(exc, Dead))
    serving = Serving(DyingEmbedder())
    serving.server.runner = "pooling"  # vLLM's pooling runner: whole calls, one at a time
    with pytest.raises(EngineDied, match="device-side assert"):
        serving.client().stream([EngineRequest([5, 6], {}, EngineTask.EMBED)], lambda i, r: None)
    until(lambda: serving.stopped)
    assert serving.stopped[0][1] == 1


def test_a_pooling_engine_does_each_request_s_task_with_its_own_call_and_refuses_a_task_of_another_runner():
    """The engine server dispatches on the request's task (protocol.POOLING_CALLS): embeddings through
    ``LLM.embed`` with PoolingParams, and its output says it is an embedding; a generation sent to a pooling engine is
    that request's failure, not a call vLLM would refuse for all."""
    from spark_llm.engine_host import EngineRequest, EngineTask, Output, RequestFailure

    class Embedder(FakeLLM):
        def embed(self, prompts, pooling_params=None, lora_request=None, use_tqdm=False):
            self.embedded = [(p["prompt_token_ids"], type(s).__name__, s.dimensions)
                             for p, s in zip(prompts, pooling_params)]
            return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], num_cached_tokens=0,
                                    outputs=SimpleNamespace(embedding=[0.5, float(len(p["prompt_token_ids"]))]))
                    for p in prompts]
    fake = Embedder()
    serving = Serving(fake)
    serving.server.runner = "pooling"
    got = {}
    serving.client().stream([EngineRequest([5, 6], {"max_tokens": 0, "dimensions": 2}, EngineTask.EMBED),
                             EngineRequest([7], {"max_tokens": 1}),  # a generation
                             EngineRequest([8, 9, 10], {"max_tokens": 0}, EngineTask.EMBED)], got.__setitem__)
    assert fake.embedded == [([5, 6], "PoolingParams", 2), ([8, 9, 10], "PoolingParams", None)]
    assert isinstance(got[0], Output) and got[0].task is EngineTask.EMBED and got[0].embedding == [0.5, 2.0]
    assert got[2].embedding == [0.5, 3.0] and got[2].outputs == []
    assert isinstance(got[1], RequestFailure) and got[1].kind == "invalid" and "pooling runner" in got[1].message


def test_the_requests_of_a_task_that_hung_up_leave_the_engine_and_the_other_task_goes_on():
    fake = FakeLLM(step_seconds=0.01, endless={10, 11, 12})
    serving = Serving(fake)
    gone = serving.client()
    gone._conn.send(("stream", 3))
    gone._conn.send(("add", [(i, request(10 + i)) for i in range(3)]))
    until(lambda: len(fake.running) == 3)
    gone._conn.close()  # its worker died
    threads, results, errors = streams_at_once(serving, [[request(t) for t in range(50, 54)]])
    threads[0].join(60)
    assert errors == [None] and sorted(r.outputs[0].text for _, r in results[0]) == ["t50", "t51", "t52", "t53"]
    until(lambda: not serving.server.streams)
    assert not serving.server.streams and not fake.running
    assert sorted(fake.aborted) == ["1-abcd1234", "2-abcd1234", "3-abcd1234"]  # the hung-up task's, never finishing


def test_a_call_to_an_engine_that_has_ended_or_is_stopping_is_gone_not_a_death():
    from multiprocessing import Pipe

    from spark_llm.engine_host import EngineClient, EngineGone, Slot

    from spark_llm.engine_host.client import Feed

    ours, theirs = Pipe()
    theirs.close()  # the engine process ended (its slot's other feeder's request killed it) since the last call
    client = EngineClient(Feed(Slot("cpu-test-0"), 0, 1), SlotRecord(4242), False, _conn=ours)
    with pytest.raises(EngineGone, match="has ended"):
        client.stream([request(10)], lambda i, r: None)

    serving = Serving(FakeLLM())
    serving.server.stopping = ("engine dead: CUDA error", 1)  # dying: it tells callers, it takes nothing new
    with pytest.raises(EngineGone, match="CUDA error"):
        serving.client().stream([request(10)], lambda i, r: None)
    client = serving.client()
    client._conn.send(("stream", 2))  # a stream that got past the question is refused whole, its chunks drained
    client._conn.send(("add", [(0, request(10)), (1, request(11))]))
    assert client._conn.recv()[0] == "gone" and not serving.server.inbox.qsize()


def test_a_feeder_awaiting_an_engine_that_was_ready_and_ended_at_once_finds_it_gone_not_failed_to_start(
        tmp_path, monkeypatch):
    """The slot's other feeder's first request can kill the engine between two looks of a feeder waiting for it
    (the shared run's poison request did, in CI): that engine started, the waiting task must rebuild it, not fail
    the run with 'could not start'."""
    import subprocess
    import sys

    from spark_llm.engine_host import ENGINE_DIR_ENV, EngineClient, EngineGone, Slot
    from spark_llm.engine_host.client import Feed, await_server, connect_or_gone
    from spark_llm.host import write_private

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    slot = Slot("cpu-test-0")
    ready = subprocess.Popen([sys.executable, "-c", "pass"])
    ready.wait()  # became ready (wrote its info), then ended
    write_private(slot.path(".json"), {"pid": ready.pid, "key": "k", "authkey": "x", "devices": []})
    info = await_server(slot, ready.pid)
    assert info.pid == ready.pid and info.listening and info.key == "k"
    client = EngineClient(Feed(slot, 1, 2), info, False, _conn=connect_or_gone(slot, info))
    with pytest.raises(EngineGone, match="has ended"):
        client.stream([request(10)], lambda i, r: None)

    never = subprocess.Popen([sys.executable, "-c", "pass"])
    never.wait()  # ended before it was ready: that one could not start
    with pytest.raises(EngineStartError, match="exited"):
        await_server(slot, never.pid)


def test_the_local_warm_up_starts_each_slot_s_engine_from_the_driver_or_leaves_it_to_the_warm_up_job(monkeypatch):
    from spark_llm import warmup
    from spark_llm.engine_host import Executor, Slot

    run = SimpleNamespace(batch_id="b", spark=None)
    monkeypatch.setattr(warmup, "InferContext", SimpleNamespace(of_run=lambda run: SimpleNamespace(
        place=TaskPlace(local_engines=2), engine="the-spec", process="the-process", run_id="the-run")))
    started = []

    def prestart_slots(spec, process, slots, executor, run_id):
        assert run_id == "the-run"  # a start that fails is the run's: its tasks do not start it again
        started.extend((s, executor) for s in slots)
    monkeypatch.setattr(warmup, "prestart_slots", prestart_slots)
    monkeypatch.setattr(warmup, "local_executor", lambda spark: 31337)
    assert warmup.prestart_here(run, {"spark.executorEnv.OMP_NUM_THREADS": "3"})
    assert [slot for slot, _ in started] == [Slot("cpu-31337-0"), Slot("cpu-31337-1")]
    assert all(isinstance(e, Executor) and e.pid == 31337 and e.environ["OMP_NUM_THREADS"] == "3" for _, e in started)

    def no_jvm(spark):  # a driver not allowed to call into its JVM (py4j security on a shared cluster, say)
        raise RuntimeError("py4j: class java.lang.ProcessHandle is not allowed")
    monkeypatch.setattr(warmup, "local_executor", no_jvm)
    started.clear()
    assert not warmup.prestart_here(run, {}) and not started  # the warm-up job starts them instead


def test_spark_llm_run_starts_a_local_session_s_engines_before_its_jvm_named_by_the_driver(monkeypatch, tiny_model):
    import os

    from spark_llm import warmup
    from spark_llm.engine_host import EngineSpec
    from spark_llm.models import resolve
    from spark_llm.engine_host import Executor, Slot

    started = []
    monkeypatch.setattr(warmup, "prestart_slots",
                        lambda spec, process, slots, executor: started.extend((spec, s, executor) for s in slots))
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    cfg = BatchConfig(model=tiny_model, served_model_name="tiny-llm", max_model_len=1024, input="x",
                      output_dir="y", batch_id="b")
    assert warmup.start_before_session(cfg, {"spark.executorEnv.OMP_NUM_THREADS": "3"}, "local[4]", None)
    pid = os.getpid()  # the executor the session will name its engines by (its driver)
    assert [slot for _, slot, _ in started] == [Slot(f"cpu-{pid}-0"), Slot(f"cpu-{pid}-1")]  # the default 2 engines
    assert all(isinstance(e, Executor) and e.pid == pid and e.environ["OMP_NUM_THREADS"] == "3" for _, _, e in started)
    assert {spec.key for spec, _, _ in started} == {EngineSpec.from_config(resolve(cfg)).key}  # the run's engine
    started.clear()
    for master in ("local-cluster[2,1,1024]", "yarn"):  # executors of their own: nothing to start from here
        assert not warmup.start_before_session(cfg, {}, master, None) and not started
    assert not warmup.start_before_session(cfg, {}, "local[2]", "sc://localhost") and not started  # Spark Connect's
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # spark-submit started the session's JVM already
    assert not warmup.start_before_session(cfg, {}, "local[2]", None) and not started
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT")
    # settings that do not resolve (no model directory to read the context length from): the run says why
    unresolved = cfg.model_copy(update={"model": "/no/such/model", "max_model_len": None})
    assert not warmup.start_before_session(unresolved, {}, "local[2]", None) and not started


def test_a_local_session_names_its_executor_by_its_driver_only_while_its_jvm_starts(monkeypatch):
    import os

    from pyspark import SparkContext

    from spark_llm.engine_host import LOCAL_EXECUTOR_ENV

    from spark_llm.engine_host.directory import executor_id
    from spark_llm.session import _naming_local_executor

    monkeypatch.setattr(SparkContext, "_gateway", None)  # no JVM launched by this process yet
    monkeypatch.delenv(LOCAL_EXECUTOR_ENV, raising=False)
    with _naming_local_executor("local[4]") as named:
        assert named == os.getpid() and os.environ[LOCAL_EXECUTOR_ENV] == str(os.getpid())
        assert executor_id() == os.getpid()  # what the JVM's Python workers will name its engines by
    assert LOCAL_EXECUTOR_ENV not in os.environ  # processes started later (spark-submit, a drill) do not inherit it
    with _naming_local_executor("local-cluster[2,1,1024]") as named:  # executors of their own
        assert named is None and LOCAL_EXECUTOR_ENV not in os.environ
    monkeypatch.setattr(SparkContext, "_gateway", object())  # a JVM this process launched before keeps its env
    with _naming_local_executor("local[2]") as named:
        assert named is None and LOCAL_EXECUTOR_ENV not in os.environ


def test_an_engine_s_imports_run_without_the_cyclic_collector_and_end_up_frozen():
    import gc

    from spark_llm.engine_host.server import imports_kept

    frozen_before = gc.get_freeze_count()
    try:
        with imports_kept():
            inside = gc.isenabled()
            made = [[] for _ in range(1000)]  # what an import leaves: objects the collector tracks
        assert not inside
        assert gc.isenabled()  # as it was before the block
        assert gc.get_freeze_count() >= frozen_before + len(made)
        gc.disable()
        try:
            with imports_kept():
                pass
            assert not gc.isenabled()  # a collector the caller had turned off stays off
        finally:
            gc.enable()
    finally:
        gc.unfreeze()


def test_an_urgent_stream_s_requests_go_into_the_engine_before_an_older_stream_s_rest():
    """The batch service's high-priority batch beside a large one: once the engine has room, the urgent call's
    requests go in before the rest of the older call's, whose requests then follow."""
    import threading

    fake = FakeLLM(step_seconds=0.05)  # one request finishes a step: the older call drains for a while
    serving = Serving(fake)
    serving.server.backlog = 4
    results: dict[str, list] = {"old": [], "urgent": []}

    def call(name: str, requests: list, priority: int) -> None:
        client = serving.client()
        client.priority = priority
        client.stream(requests, lambda i, r: results[name].append(i))
    old = threading.Thread(target=call, args=("old", [request(t) for t in range(10, 20)], 1))
    old.start()
    until(lambda: len(fake.added) >= 4)  # the older call fills the engine
    urgent = threading.Thread(target=call, args=("urgent", [request(t) for t in range(50, 53)], 0))
    urgent.start()
    for t in (old, urgent):
        t.join(60)
    assert len(results["old"]) == 10 and len(results["urgent"]) == 3
    first_urgent = fake.added.index(50)
    assert fake.added[first_urgent:first_urgent + 3] == [50, 51, 52]  # together, as places freed
    assert first_urgent <= 6 and fake.added[-1] == 19  # before most of the older call's rest


def test_a_slot_record_reads_back_as_written_and_a_file_that_names_no_process_is_no_record():
    record = SlotRecord(41, 7, key="k", devices=("0", "1"), launcher=40, authkey="s", load_seconds=1.5)
    assert SlotRecord.of(json.loads(json.dumps(record.as_json()))) == record and record.listening
    assert not SlotRecord(41).listening and "authkey" not in SlotRecord(41).as_json()
    assert SlotRecord.of({"pid": 41, "written_by": "a later spark_llm"}) == SlotRecord(41)
    assert [SlotRecord.of(x) for x in (None, [], {}, {"pid": "41"})] == [None] * 4


def test_a_task_whose_gpu_cannot_start_an_engine_borrows_a_ready_one_of_another_gpu_for_the_same_settings():
    from spark_llm.engine_host.client import lender
    from spark_llm.engine_host.directory import Slot
    from spark_llm.engine_host.protocol import SlotRecord

    def engine(name, devices, key="k", ready=True):
        return Slot(name, devices), SlotRecord(1, key=key, devices=devices, authkey="a" if ready else None)

    bad = Slot("gpu-1", ("1",))
    assert lender(bad, "k", []) is None
    assert lender(bad, "k", [engine("gpu-1", ("1",))]) is None  # its own slot (a leftover record) is no lender
    assert lender(bad, "k", [engine("gpu-0", ("0",), ready=False)]) is None  # still starting: wait for it
    assert lender(bad, "k", [engine("gpu-0", ("0",), key="other")]) is None  # other settings
    assert lender(bad, "k", [engine("cpu-7-0", ())]) is None  # not a GPU engine
    assert lender(Slot("gpu-1,2", ("1", "2")), "k", [engine("gpu-2,3", ("2", "3"))]) is None  # shares a GPU
    assert lender(bad, "k", [engine("gpu-0", ("0",)), engine("gpu-1", ("1",))]).name == "gpu-0"
    several = [engine(f"gpu-{n}", (str(n),)) for n in (0, 2, 3)]
    chosen = {lender(Slot(f"gpu-{n}", (str(n),)), "k", several).name for n in (1, 4, 5, 6, 7)}
    assert len(chosen) > 1  # the tasks of different bad GPUs spread over the ready engines
    assert lender(bad, "k", several) == lender(bad, "k", list(reversed(several)))  # whatever order they are listed
