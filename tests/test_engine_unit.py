"""GPU-only logic and engine plumbing that needs no GPU: device selection from task resources, pinning, the vLLM
arguments, and per-request failure isolation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from spark_llm.config import BatchConfig
from spark_llm.config import ConfigError
from spark_llm.engine import EngineSpec, check_gpu_settings, inference_profile, select_gpus
from spark_llm.errors import EngineStartError
from spark_llm.infer import generate_isolating


def gpus(*addresses):
    return {"gpu": SimpleNamespace(name="gpu", addresses=list(addresses))}


def test_select_gpus_uses_exactly_the_task_addresses():
    assert select_gpus(gpus("3"), 1) == ["3"]
    assert select_gpus(gpus("0", "1"), 2) == ["0", "1"]
    assert select_gpus(None, 1) is None and select_gpus({}, 2) is None and select_gpus(gpus(), 1) is None


def test_select_gpus_rejects_a_mismatch_with_tensor_parallel_size():
    with pytest.raises(EngineStartError, match="spark.task.resource.gpu.amount=2"):
        select_gpus(gpus("0"), 2)


def test_gpu_slots_are_named_by_their_devices(tmp_path, monkeypatch):
    from spark_llm.engine_service import ENGINE_DIR_ENV, Slot, hold_slot

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    assert Slot.for_gpus(["1", "0"]) == Slot("gpu-0,1", ("0", "1")) and Slot.for_gpus(["10", "9"]).devices == ("9", "10")
    with hold_slot(["3"]) as slot:
        assert slot == Slot("gpu-3", ("3",))
        with pytest.raises(EngineStartError, match="in use by another Spark task"):
            with hold_slot(["3"]):
                pass
    with hold_slot(None) as a, hold_slot(None) as b:  # without GPUs: the free CPU slots of this executor
        assert a.name.startswith("cpu-") and a.name.endswith("-0") and b.name.endswith("-1")


def test_a_local_driver_starts_its_executor_s_engines_with_the_environment_its_python_workers_would_have(
        tmp_path, monkeypatch):
    from spark_llm import engine_service
    from spark_llm.engine_service import ENGINE_DIR_ENV, Executor, ProcessSettings, Slot, prestart
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

    monkeypatch.setattr(engine_service.subprocess, "Popen", Popen)
    monkeypatch.setattr(engine_service, "process_alive", lambda pid: pid == 4242)
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
    from spark_llm.engine import model_runner

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


def test_gpu_settings_must_give_each_task_one_engines_gpus():
    check_gpu_settings({}, 1)
    check_gpu_settings({"spark.task.resource.gpu.amount": "2"}, 2)
    check_gpu_settings({"spark.executor.resource.gpu.amount": "8"}, 2)
    with pytest.raises(ConfigError, match="two engines on one GPU"):
        check_gpu_settings({"spark.task.resource.gpu.amount": "0.5"}, 1)
    with pytest.raises(ConfigError, match="tensor_parallel_size is 4"):
        check_gpu_settings({"spark.task.resource.gpu.amount": "1"}, 4)
    with pytest.raises(ConfigError, match="executors have 2 GPU.*one engine's GPUs must be on one executor"):
        check_gpu_settings({"spark.executor.resource.gpu.amount": "2"}, 4)
    with pytest.raises(ConfigError, match="RLIMIT_AS"):
        check_gpu_settings({"spark.executor.resource.gpu.amount": "1", "spark.executor.pyspark.memory": "4g"}, 1)


def test_only_the_inference_stage_asks_for_gpus():
    assert inference_profile({}, 1) is None
    assert inference_profile({"spark.executor.resource.gpu.amount": "4", "spark.task.resource.gpu.amount": "1"},
                             1) is None  # every stage asks already
    profile = inference_profile({"spark.executor.resource.gpu.amount": "4", "spark.task.cpus": "2"}, 2)
    tasks = profile.taskResources
    assert tasks["gpu"].amount == 2 and tasks["cpus"].amount == 2


# ---- the streamed engine call, against a stand-in for vLLM's LLM (the real protocol and server loop) ---------

class FakeLLM:
    """What the engine server uses of ``vllm.LLM``: ``enqueue`` and the ``llm_engine`` step loop (one request
    finishes per step, last added first), plus ``generate`` for the isolating fallback. Prompts of ``refused``
    token ids are rejected when added; ``step_fails`` makes the ``n``-th step raise."""

    def __init__(self, refused=(), step_fails=None):
        self.refused, self.step_fails, self.steps, self.counter = set(refused), step_fails, 0, 0
        self.running: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.llm_engine = self

    def enqueue(self, prompts, params, lora_request=None, use_tqdm=False):
        if any(p["prompt_token_ids"][0] in self.refused for p in prompts):
            raise ValueError("max_logprobs exceeded")
        ids = []
        for p in prompts:
            self.counter += 1
            ids.append(f"{self.counter}-abcd1234")  # vLLM's own id: the one added with, a random suffix
            self.running[str(self.counter)] = p["prompt_token_ids"]
        return ids

    def step(self):
        self.steps += 1
        if self.step_fails == self.steps:
            raise RuntimeError("a kernel choked")
        if not self.running:
            return []
        rid = sorted(self.running, key=int)[-1]
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


def stream_through(fake, requests):
    """Stream ``requests`` through an engine server holding ``fake``, over a real connection pair."""
    import threading
    from multiprocessing import Pipe

    from spark_llm.engine_service import EngineClient, Slot, _Server

    server = _Server(Slot("cpu-test-0"), "key", 0, 0)
    server.engine, server.parsers = fake, SimpleNamespace(parse=lambda choice, parse: None)
    ours, theirs = Pipe()
    threading.Thread(target=server.handle, args=(theirs,), daemon=True).start()
    client = EngineClient(Slot("cpu-test-0"), {"pid": 0}, False, _conn=ours)
    got: list = []
    client.stream(requests, lambda i, result: got.append((i, result)))
    return got


def request(first_token):
    return ([first_token, 1, 2], {"max_tokens": 1}, {"reasoning": False})


def test_a_streamed_call_answers_every_request_once_as_it_finishes(monkeypatch):
    monkeypatch.setattr("spark_llm.engine_service.STREAM_CHUNK", 3)  # several chunks
    got = stream_through(FakeLLM(), [request(t) for t in range(10, 20)])
    assert sorted(i for i, _ in got) == list(range(10))
    assert {i: r.outputs[0].text for i, r in got} == {i: f"t{10 + i}" for i in range(10)}
    assert [i for i, _ in got] != list(range(10))  # in the order they finished, not the order they were sent


def test_a_request_the_engine_refuses_is_that_requests_failure_only():
    from spark_llm.engine_service import RequestFailure

    got = dict(stream_through(FakeLLM(refused={12}), [request(t) for t in range(10, 15)]))
    assert isinstance(got[2], RequestFailure) and got[2].kind == "engine" and "max_logprobs" in got[2].message
    assert all(got[i].outputs[0].text == f"t{10 + i}" for i in (0, 1, 3, 4))


def test_when_a_step_fails_the_requests_in_flight_are_answered_by_the_isolating_path():
    fake = FakeLLM(step_fails=2)
    got = dict(stream_through(fake, [request(t) for t in range(10, 16)]))
    assert sorted(got) == list(range(6)) and all(got[i].outputs[0].text == f"t{10 + i}" for i in got)
    assert fake.aborted and not fake.running  # nothing of the call is left in the engine


def test_the_local_warm_up_starts_each_slot_s_engine_from_the_driver_or_leaves_it_to_the_warm_up_job(monkeypatch):
    from spark_llm import waves
    from spark_llm.engine_service import Executor, Slot

    run = SimpleNamespace(batch_id="b", spark=None)
    monkeypatch.setattr(waves, "_infer_context", lambda run, numbering: SimpleNamespace(
        cpu_slots=2, engine="the-spec", process="the-process"))
    started = []
    monkeypatch.setattr(waves, "prestart", lambda spec, process, slot, executor: started.append((slot, executor)))
    monkeypatch.setattr(waves, "jvm_pid", lambda spark: 31337)
    assert waves.prestart_here(run, {"spark.executorEnv.OMP_NUM_THREADS": "3"})
    assert [slot for slot, _ in started] == [Slot("cpu-31337-0"), Slot("cpu-31337-1")]
    assert all(isinstance(e, Executor) and e.pid == 31337 and e.environ["OMP_NUM_THREADS"] == "3" for _, e in started)

    def no_jvm(spark):  # a driver not allowed to call into its JVM (py4j security on a shared cluster, say)
        raise RuntimeError("py4j: class java.lang.ProcessHandle is not allowed")
    monkeypatch.setattr(waves, "jvm_pid", no_jvm)
    started.clear()
    assert not waves.prestart_here(run, {}) and not started  # the warm-up job starts them instead
