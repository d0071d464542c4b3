"""Poison-request quarantine without an engine: the isolation plan over deaths, the journal on a filesystem, and the
guarded engine loop with a fake engine that dies on chosen requests (the real drill is in the shared run)."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pandas as pd
import pytest

from spark_llm.engine_host import EngineDied, EngineRequest
from spark_llm.infer import generate_guarded
from spark_llm.engine_host.isolation import (FANOUT, MAX_ENGINE_REBUILDS, Journal, isolation_plan,
                                             retry_budget_warning, task_attempts_needed)
from spark_llm.session import with_task_retries


def ids(n):
    return [f"r{i}" for i in range(n)]


def attempts_until_done(requests, poison):
    """Run the plan attempt after attempt, each dying at the first call holding a poison request (as a task whose
    worker is killed); returns (attempts, final plan, requests run in the final attempt)."""
    deaths = []
    for attempt in range(1, 50):
        plan = isolation_plan(requests, deaths)
        ran = []
        for call in plan.calls:
            if poison & set(call):
                deaths.append(frozenset(call))
                break
            ran.extend(call)
        else:
            return attempt, plan, ran
    raise AssertionError("never finished")


def test_without_deaths_the_partition_is_one_engine_call():
    plan = isolation_plan(ids(5), [])
    assert plan.calls == [ids(5)] and plan.quarantined == [] and not plan.isolating


@pytest.mark.parametrize("n", [1, 2, 17, 300, 4000])
def test_one_poison_request_is_set_aside_and_every_other_request_runs_once(n):
    requests = ids(n)
    poison = {requests[n // 3]}
    attempts, plan, ran = attempts_until_done(requests, poison)
    assert plan.quarantined == sorted(poison)
    assert sorted(ran) == sorted(set(requests) - poison) and len(ran) == len(set(ran))
    # the retry budget docs/reliability.md states: the first death, one per narrowing to a lone request, the finishing attempt
    assert attempts == task_attempts_needed(n) == 2 + max(1, math.ceil(math.log(n, FANOUT)))


def test_two_poison_requests_in_one_partition_are_both_set_aside():
    requests = ids(1000)
    poison = {"r10", "r777"}
    _, plan, ran = attempts_until_done(requests, poison)
    assert set(plan.quarantined) == poison and sorted(ran) == sorted(set(requests) - poison)


def test_a_death_with_no_poison_quarantines_nothing():
    """A preempted executor leaves its marker too: the retry runs everything again, in smaller calls."""
    plan = isolation_plan(ids(64), [frozenset(ids(64))])
    assert plan.quarantined == [] and len(plan.calls) == FANOUT
    assert sorted(r for c in plan.calls for r in c) == sorted(ids(64))


def test_suspects_run_first_and_requests_never_in_flight_at_a_death_last():
    plan = isolation_plan(ids(10), [frozenset({"r3", "r4"})])
    assert plan.calls == [["r3"], ["r4"], ["r0", "r1", "r2", "r5", "r6", "r7", "r8", "r9"]]


def test_deaths_of_other_requests_are_ignored():
    """A journal left by an earlier plan of the partition names requests this attempt does not hold."""
    plan = isolation_plan(ids(3), [frozenset({"x"}), frozenset({"x"})])
    assert plan.calls == [ids(3)] and plan.quarantined == []


@pytest.mark.parametrize("uri", ["plain", "file"])
def test_the_journal_keeps_the_calls_that_never_returned(tmp_path, uri):
    base = str(tmp_path / "staging") if uri == "plain" else f"file://{tmp_path}/staging"
    journal = Journal.open(base, 7)
    done = journal.mark(["a", "b"])
    journal.mark(["c"])  # its call never returned
    journal.clear(done)
    again = Journal.open(base, 7)  # the next attempt
    assert again.deaths() == [frozenset({"c"})]
    assert Journal.open(base, 8).deaths() == []  # another partition's journal
    assert (tmp_path / "staging" / "p7").is_dir()


class FakeEngine:
    """An engine client whose engine dies whenever a poison prompt is in a call: at once, or (``streams``) after
    answering the requests before the poison, as a streamed call does. Records each call's requests and whether the
    task was alone on the engine for it."""

    def __init__(self, poison, streams=False):
        self.poison, self.streams, self.rebuilds, self.info, self.calls = poison, streams, 0, SimpleNamespace(pid=None), []
        self.alone_now, self.alone_calls = False, []

    @contextlib.contextmanager
    def alone(self):
        self.alone_now = True
        try:
            yield
        finally:
            self.alone_now = False

    def stream(self, requests, on_result, starting=None):
        names = [f"p{r.token_ids[0]}" for r in requests]
        self.calls.append(names)
        self.alone_calls.append(self.alone_now)
        if not self.streams and any(name in self.poison for name in names):
            raise EngineDied("the engine process died during a call (EOFError)")
        for k, name in enumerate(names):
            if name in self.poison:
                raise EngineDied("the engine process died during a call (EOFError)")
            on_result(k, f"out-{name}")

    def rebuild(self):
        self.rebuilds += 1


class Answers(dict):
    """The rows ``generate_guarded`` answered, each with its outputs; a row answered twice fails the test."""

    def __call__(self, i, outputs):
        assert i not in self, f"row {i} answered twice"
        self[i] = outputs


def partition(n):
    pdf = pd.DataFrame({"id": ids(n), "custom_id": [f"c{i}" for i in range(n)]})
    return pdf, [EngineRequest([i], {}) for i in range(n)], list(range(n))


def test_an_engine_dying_under_a_live_worker_is_rebuilt_and_the_poison_request_set_aside(tmp_path):
    pdf, requests, owner = partition(40)
    engine = FakeEngine({"p13"})
    journal = Journal.open(str(tmp_path), 0)
    answers = Answers()
    got = generate_guarded(engine, requests, owner, pdf, journal, answers)
    assert got.quarantined == {13} and got.results[13] is None
    assert [r for i, r in enumerate(got.results) if i != 13] == [f"out-p{i}" for i in range(40) if i != 13]
    assert answers == {i: [f"out-p{i}"] for i in range(40) if i != 13}
    assert engine.rebuilds == got.deaths == 3
    # the markers of the three deaths stay: all 40 in flight, then a call of ceil(40/16) = 3, then r13 alone
    assert sorted(journal.deaths(), key=len) == [{"r13"}, {"r12", "r13", "r14"}, set(ids(40))]
    # the first call shared the engine with the slot's other feeder; once a death was on record, every call ran
    # with the task alone on the engine, so a later death could only be its own request's doing
    assert engine.alone_calls[0] is False and all(engine.alone_calls[1:])


def test_the_next_attempt_continues_from_the_journal(tmp_path):
    """The first attempt's worker died in its one call: the retry starts narrowing at once."""
    pdf, requests, owner = partition(40)
    journal = Journal.open(str(tmp_path), 0)
    journal.mark(ids(40))
    engine = FakeEngine({"p13"})
    got = generate_guarded(engine, requests, owner, pdf, journal, Answers())
    assert got.quarantined == {13} and engine.rebuilds == 2 and got.deaths == 3
    assert engine.calls[0] == ["p0", "p1", "p2"]  # no call of all 40 again: chunks of ceil(40/16) from the start
    assert all(engine.alone_calls)  # deaths on record from the start: alone on the engine from the start


def test_a_task_gives_up_after_its_rebuild_budget():
    pdf, requests, owner = partition(5000)
    engine = FakeEngine({f"p{i}" for i in range(0, 5000, 7)})  # poison everywhere: no narrowing helps
    with pytest.raises(EngineDied):
        generate_guarded(engine, requests, owner, pdf, None, Answers())
    assert engine.rebuilds == MAX_ENGINE_REBUILDS


def test_rows_answered_before_the_engine_died_are_kept_and_not_run_again(tmp_path):
    """A streamed call answers rows as they finish: those answered before a death keep their answers, and only the
    rows still in flight are narrowed down."""
    pdf, requests, owner = partition(40)
    engine = FakeEngine({"p13"}, streams=True)
    answers = Answers()
    got = generate_guarded(engine, requests, owner, pdf, Journal.open(str(tmp_path), 0), answers)
    assert got.quarantined == {13} and answers == {i: [f"out-p{i}"] for i in range(40) if i != 13}
    assert not {f"p{i}" for i in range(13)} & {p for call in engine.calls[1:] for p in call}


def test_an_engine_gone_before_a_call_is_replaced_and_the_call_made_again_without_suspecting_it(tmp_path):
    """The slot's other feeder lost the engine between this task's calls: its call never reached an engine, so it
    is made again on the next one, alone on nothing and with no death on record."""
    from spark_llm.engine_host import EngineGone

    class GoneOnce(FakeEngine):
        def stream(self, requests, on_result, starting=None):
            if not self.calls:
                self.calls.append(None)
                raise EngineGone("engine of slot cpu-1-0: the engine process (pid 7) has ended")
            super().stream(requests, on_result, starting)

        def rebuild(self, died=True):
            self.rebuilds += died
            self.reconnected = True

    pdf, requests, owner = partition(20)
    engine, journal, answers = GoneOnce(set()), Journal.open(str(tmp_path), 0), Answers()
    got = generate_guarded(engine, requests, owner, pdf, journal, answers)
    assert engine.reconnected and engine.rebuilds == 0 and got.deaths == 0 and not got.quarantined
    assert engine.calls[1:] == [[f"p{i}" for i in range(20)]] and engine.alone_calls == [False]
    assert answers == {i: [f"out-p{i}"] for i in range(20)} and journal.deaths() == []


def test_local_masters_get_the_task_retries_the_isolation_needs():
    assert with_task_retries("local[2]") == "local[2,8]" and with_task_retries("local") == "local[1,8]"
    assert with_task_retries("local[*]") == "local[*,8]" and with_task_retries("local[2,3]") == "local[2,3]"
    assert with_task_retries("spark://host:7077") == "spark://host:7077"


def test_a_retry_budget_too_small_for_the_isolation_is_warned_about():
    assert "spark.task.maxFailures" in retry_budget_warning({"spark.master": "yarn"})  # Spark's default, 4
    assert retry_budget_warning({"spark.master": "yarn", "spark.task.maxFailures": "8"}) is None
    assert "local[N,F]" in retry_budget_warning({"spark.master": "local[2]"})
    assert retry_budget_warning({"spark.master": "local[2,8]"}) is None
