"""The engine stand-in (spark_llm.engine_host.standin): its rate model on a virtual clock, its answers, and the real
engine server and client driving it (no vLLM, no Spark): a request it fails is one failure, a request that kills
it is an engine death."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import eventually
from spark_llm.config import BatchConfig
from spark_llm.engine_host import EngineRequest, EngineSpec, ProcessSettings, TaskPlace, engine_for
from spark_llm.engine_host.client import stop_engines_here
from spark_llm.engine_host.protocol import EngineDied, EngineTask, Output, RequestFailure
from spark_llm.engine_host.standin import (DIE_MARKER, FAIL_MARKER, PROFILES, Rates, Scheduler, Seq, StandInLLM,
                                           answer_lengths, answer_tokens, parse_rates)

RATES = Rates(prefill_tokens_per_second=1_000, decode_tokens_per_second=400, max_num_seqs=4)  # a step: 10 ms


def run_out(scheduler: Scheduler) -> tuple[float, list[tuple[float, str]]]:
    """The virtual seconds the scheduler takes to finish all it holds, and when each sequence finished."""
    clock, finished = 0.0, []
    while scheduler.busy:
        seconds, _, done = scheduler.step()
        clock += seconds
        finished += [(clock, s.request_id) for s in done]
    return clock, finished


def test_a_full_batch_decodes_at_the_engine_rate_and_prompts_cost_the_prefill_rate():
    s = Scheduler(RATES)
    for k in range(8):  # two full batches of 4 sequences, 51 tokens each, 100 prompt tokens each
        s.add(Seq(str(k), prompt_tokens=100, output_tokens=51))
    total, finished = run_out(s)
    # each batch: its 4 prompts (0.4 s), then 50 decode steps of 10 ms (the first token comes with the prefill)
    assert total == pytest.approx(2 * (0.4 + 50 * 0.01))
    assert [t for t, _ in finished[:4]] == pytest.approx([0.9] * 4)
    assert {r for _, r in finished[:4]} == {"0", "1", "2", "3"}
    # the decode stretch of a full batch: max_num_seqs tokens a step = decode_tokens_per_second
    assert 4 * 50 / (0.9 - 0.4) == pytest.approx(RATES.decode_tokens_per_second)


def test_a_sequence_that_finishes_frees_its_place_for_the_next_at_once():
    s = Scheduler(RATES)
    for k, length in enumerate([3, 41, 41, 41, 11]):  # the 5th waits for the 1st's place
        s.add(Seq(str(k), prompt_tokens=0, output_tokens=length))
    _, finished = run_out(s)
    when = {r: t for t, r in finished}
    assert when["0"] == pytest.approx(0.02)
    assert when["4"] == pytest.approx(0.02 + 0.10)  # admitted at 20 ms, 10 more decode steps
    assert when["1"] == pytest.approx(0.40)


def test_a_stretch_never_sleeps_past_the_step_limit_so_new_requests_join_soon():
    s = Scheduler(RATES, max_seconds=0.05)
    s.add(Seq("long", prompt_tokens=0, output_tokens=1_001))
    stretches = []
    while s.busy:
        stretches.append(s.step()[0])
    assert max(stretches) == pytest.approx(0.05)
    assert sum(stretches) == pytest.approx(10.0)


def test_the_free_profile_costs_nothing():
    s = Scheduler(PROFILES["free"])
    for k in range(3000):
        s.add(Seq(str(k), prompt_tokens=500, output_tokens=200))
    total, finished = run_out(s)
    assert total == 0.0 and len(finished) == 3000


def test_settings_name_a_profile_and_change_its_fields():
    assert parse_rates("h200-8b") == PROFILES["h200-8b"]
    changed = parse_rates("h200-8b, start_seconds=0, max_num_seqs=64")
    assert (changed.start_seconds, changed.max_num_seqs) == (0.0, 64)
    assert changed.decode_tokens_per_second == PROFILES["h200-8b"].decode_tokens_per_second
    for bad, says in [("a100", "unknown engine stand-in"), ("h200-8b,speed=2", "no field 'speed'"),
                      ("h200-8b,max_num_seqs=x", "must be a number"), ("h200-8b,decode_tokens_per_second=0",
                                                                       "must be positive")]:
        with pytest.raises(ValueError, match=says):
            parse_rates(bad)
    with pytest.raises(ValueError, match="engine_standin"):
        BatchConfig(model="/m", input="in.jsonl", output_dir="out", engine_standin="a100")


def test_answers_depend_on_the_request_only():
    a = answer_tokens([1, 2, 3], 7, 0, 12)
    assert a == answer_tokens([1, 2, 3], 7, 0, 12) and len(a) == 12
    assert a != answer_tokens([1, 2, 3], 8, 0, 12)  # another seed
    assert a != answer_tokens([1, 2, 3], 7, 1, 12)  # another choice
    assert a != answer_tokens([1, 2, 4], 7, 0, 12)  # another prompt


def test_answer_lengths_are_a_seeded_long_tail_mix_cut_at_max_tokens():
    from spark_llm.engine_host.rates import AnswerLengths

    mix = parse_rates("h200-8b,answers=40/0.05x10")
    assert mix.answers == AnswerLengths(40, 0.05, 10.0) and parse_rates("h200-8b").answers is None
    lengths = [answer_lengths(mix, [i, i + 1, 7], {"max_tokens": 1000})[0] for i in range(4000)]
    assert lengths == [answer_lengths(mix, [i, i + 1, 7], {"max_tokens": 1000})[0] for i in range(4000)]
    tail = [n for n in lengths if n == 400]
    assert 0.04 < len(tail) / len(lengths) < 0.06  # 5% of the answers ten times the median
    assert all(20 <= n <= 60 for n in lengths if n != 400) and 38 < sorted(lengths)[2000] < 42
    assert max(answer_lengths(mix, [1, 2], {"max_tokens": 30, "n": 50})) == 30  # max_tokens still cuts
    assert answer_lengths(parse_rates("h200-8b"), [1], {"max_tokens": 9, "n": 2}) == [9, 9]
    for bad in ("0", "40/2x10", "40/0.1x0.5", "forty"):
        with pytest.raises(ValueError, match="answers="):
            parse_rates(f"h200-8b,answers={bad}")


def test_a_shorter_answer_stops_and_its_decode_steps_are_its_own():
    """A request whose drawn answer is shorter than max_tokens ends as ``stop`` after as many decode steps as its
    answer has tokens; one cut at max_tokens is ``length``."""
    rates = parse_rates("h200-8b,start_seconds=0,max_num_seqs=4,answers=10")
    llm = StandInLLM(rates, sleep=lambda seconds: None)
    prompt, cut = [5] * 8, {"max_tokens": 3}
    free = {"max_tokens": 1000}
    want = answer_lengths(rates, prompt, free)[0]
    llm.enqueue([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt}], [free, cut])
    outs = []
    while len(outs) < 2:
        outs += llm.llm_engine.step()
    by_id = {o.request_id: o.outputs[0] for o in outs}
    assert (len(by_id["1"].token_ids), by_id["1"].finish_reason) == (want, "stop") and 5 <= want <= 15
    assert (len(by_id["2"].token_ids), by_id["2"].finish_reason) == (3, "length")
    assert llm.scheduler.steps == want - 1  # the prefill made the first token; the longer answer's steps


def test_the_stand_in_answers_as_vllm_outputs_read_and_sleeps_its_time():
    slept: list[float] = []
    llm = StandInLLM(RATES, sleep=slept.append)
    ids = llm.enqueue([{"prompt_token_ids": [5] * 100}], [{"max_tokens": 3, "n": 2, "logprobs": 1, "seed": 1}])
    outs = []
    while not outs:
        outs = llm.llm_engine.step()
    assert ids[0].split("-", 1)[0] == outs[0].request_id
    out = Output.of(outs[0], EngineTask.GENERATE)
    assert [len(c.token_ids) for c in out.outputs] == [3, 3] and out.outputs[0].text != out.outputs[1].text
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].rank == 1
    assert sum(slept) == pytest.approx(0.1 + 2 * 0.01, abs=0.005)  # 100 prompt tokens, 2 decode steps
    [embedding] = llm.embed([{"prompt_token_ids": [1, 2]}], [{"dimensions": 16}])
    assert len(Output.of(embedding, EngineTask.EMBED).embedding) == 16
    assert math.isclose(sum(x * x for x in embedding.outputs.embedding), 1.0)


def test_a_stand_in_engine_process_fails_one_request_and_dies_on_another(tmp_path, monkeypatch):
    """The real engine server and client around the stand-in: a marked request is one failure among answers (the
    server's isolation finds it), a request marked to kill it ends the call as an engine death; vLLM never
    imported by the engine process."""
    from spark_llm.engine_host import ENGINE_DIR_ENV, read_events

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    spec = EngineSpec.from_config(BatchConfig(model=str(model), engine_standin="h200-8b,start_seconds=0,"
                                              "max_num_seqs=4"))
    process = ProcessSettings(engine_idle_timeout_seconds=0, engine_log_level="WARNING")
    plain = [EngineRequest([1, 2, k], {"max_tokens": 5}) for k in range(10)]
    failing = EngineRequest([9, 9], {"max_tokens": 5, "stop": [FAIL_MARKER]})
    with engine_for(spec, process, TaskPlace(local_engines=1, feeds=1)) as engine:
        outs = engine.generate(plain[:5] + [failing] + plain[5:])
        assert [type(o).__name__ for o in outs] == ["Output"] * 5 + ["RequestFailure"] + ["Output"] * 5, outs
        assert FAIL_MARKER in outs[5].message and isinstance(outs[5], RequestFailure)
        assert all(len(o.outputs[0].token_ids) == 5 for o in outs if isinstance(o, Output))
        maps = open(f"/proc/{engine.info.pid}/maps").read()
        assert "libtorch" not in maps and "/vllm/" not in maps  # neither torch nor vLLM was loaded
        with pytest.raises(EngineDied):
            engine.generate(plain + [EngineRequest([8], {"max_tokens": 5, "stop": [DIE_MARKER]})])
    # the engine process records why it stopped as it goes (after telling its streams)
    eventually(lambda: any("Executor failed." in e["reason"] for e in read_events(tmp_path) if e["event"] == "stop"),
               "the engine's stop, recorded with its cause")


def test_an_engine_started_ahead_of_a_batch_waits_for_its_first_call_and_a_task_s_does_not(tmp_path, monkeypatch):
    """Two stand-in engine processes, neither ever called, with an idle timeout of 1 s: the one started ahead (the
    warm-up's, the service's hold) is still serving when the one a task started (whose task Spark killed while it
    loaded) has stopped for being idle, though the first has waited longer."""
    from spark_llm.engine_host import ENGINE_DIR_ENV, read_events
    from spark_llm.engine_host.directory import alive

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    spec = EngineSpec.from_config(BatchConfig(model=str(model), engine_standin="free"))
    process = ProcessSettings(engine_idle_timeout_seconds=1, engine_log_level="WARNING")
    records = {}
    for name, ahead in (("ahead", True), ("task", False)):
        monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / name))
        with engine_for(spec, process, TaskPlace(local_engines=1, feeds=1), ahead=ahead) as engine:
            records[name] = engine.info
    eventually(lambda: [e["reason"] for e in read_events(tmp_path / "task") if e["event"] == "stop"] != [],
               "the task's engine stopped")
    assert [e["reason"] for e in read_events(tmp_path / "task") if e["event"] == "stop"][0].startswith("idle for")
    assert alive(records["ahead"]) is not None and not [e for e in read_events(tmp_path / "ahead")
                                                        if e["event"] == "stop"]
    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path / "ahead"))
    stop_engines_here()


def test_vllm_s_engine_dead_error_is_fatal_where_vllm_was_imported_and_nothing_imports_it(monkeypatch):
    """is_fatal looks vLLM's EngineDeadError up among the imported modules: a stand-in engine's failure path imports
    no vLLM (7 s of imports here), and a vLLM engine's dead engine is still fatal."""
    import types

    from spark_llm.engine_host.isolation import is_fatal

    module = types.ModuleType("vllm.v1.engine.exceptions")
    module.EngineDeadError = type("EngineDeadError", (Exception,), {})
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", module)
    assert is_fatal(module.EngineDeadError("engine core died")) and not is_fatal(ValueError("bad request"))
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.exceptions")
    assert not is_fatal(ValueError("bad request")) and "vllm.v1.engine.exceptions" not in sys.modules


def test_nothing_of_the_stand_in_is_reached_without_its_setting():
    """The stand-in is never the default: a config without the setting selects vLLM, and neither the engine server
    nor the job imports the stand-in's module (the server does only for settings that name it)."""
    import subprocess

    assert BatchConfig(model="/m").engine_standin is None
    assert EngineSpec.from_config(BatchConfig(model="/m")).standin is None
    code = ("import sys, spark_llm.engine_host.server, spark_llm.infer, spark_llm.cli; "
            "print('spark_llm.engine_host.standin' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
