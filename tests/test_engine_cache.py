"""One engine per slot (here: the two CPU slots of the test session, each fed by two of its four task threads), in
its own process, reused across tasks, jobs and Python workers; greedy decoding gives the same token ids every time.
Asserted from the engines' own records."""

from __future__ import annotations

import re
import time

import pandas as pd
import pytest

from conftest import engine_settings
from spark_llm.config import BatchConfig
from spark_llm.engine_host import EngineSpec, read_events

pytestmark = pytest.mark.engine


def probe(spec: EngineSpec, prompt_ids: list[int]):
    def run(batches):
        import os

        from spark_llm.engine_host import EngineRequest, ProcessSettings, TaskPlace, engine_for

        for pdf in batches:
            with engine_for(spec, ProcessSettings(engine_idle_timeout_seconds=0, engine_log_level="WARNING"),
                            TaskPlace(local_engines=2, feeds=2)) as engine:
                [out] = engine.generate([EngineRequest(prompt_ids, {"max_tokens": 6, "temperature": 0})])
            yield pd.DataFrame({"worker": [os.getpid()], "slot": [engine.slot.name], "engine": [engine.info.pid],
                                "tokens": [",".join(map(str, out.outputs[0].token_ids))], "rows": [len(pdf)]})
    return run


def test_one_engine_per_slot_reused_across_tasks_jobs_and_workers(spark, tiny_model, engine_dir):
    # resolved as a run resolves it, so that the slots' engines from the earlier tests serve it (if any ran)
    spec = EngineSpec.from_config(BatchConfig(**engine_settings(tiny_model)).resolved(max_model_len=1024))
    schema = "worker long, slot string, engine long, tokens string, rows long"
    df = spark.range(0, 8, 1, numPartitions=8)
    started = time.time()
    rows = df.mapInPandas(probe(spec, [5, 6, 7, 8, 9]), schema).collect()
    rows += df.mapInPandas(probe(spec, [5, 6, 7, 8, 9]), schema).collect()
    assert len(rows) == 16
    ready = [e for e in read_events(engine_dir) if e["key"] == spec.key and e["event"] == "ready"]
    # at most one engine per slot was built for these two jobs of 8 tasks (none where an earlier test left one
    # running), and every task of a slot was answered by that one engine process, whichever Python worker ran it
    built = [e for e in ready if e["time"] >= started]
    assert len({e["slot"] for e in built}) == len(built) <= 2
    by_slot: dict[str, set] = {}
    for r in rows:
        by_slot.setdefault(r["slot"], set()).add(r["engine"])
    assert all(len(pids) == 1 for pids in by_slot.values()), by_slot
    assert {pid for pids in by_slot.values() for pid in pids} <= {e["pid"] for e in ready}
    # greedy decoding: the same token ids in every task, slot and job
    assert len({r["tokens"] for r in rows}) == 1 and len(rows[0]["tokens"].split(",")) == 6


def test_engine_logs_stay_in_the_engine_directory_at_the_configured_level(shared_run, engine_dir):
    logs = {p.name: p.read_text(errors="replace") for p in engine_dir.glob("*.log")}
    assert any("ready in" in text for text in logs.values())  # the engines' own lines are there
    vllm_info = re.compile(r"\) INFO \d\d-\d\d ")  # vLLM's INFO lines: "(MainProcess pid=1) INFO 11-30 21:57:45"
    assert not [name for name, text in logs.items() if vllm_info.search(text)]  # default engine_log_level WARNING


def test_engines_started_together_are_forked_from_one_process_each_failing_on_its_own(tmp_path, monkeypatch):
    """Two CPU slots prestarted at once: one process imports vLLM and forks an engine process per slot, which
    logs to its slot's log and records its own start; an engine that cannot start (no such model) fails its slot
    with its reason, for a task awaiting the process it saw starting."""
    import os

    from spark_llm.engine_host import ENGINE_DIR_ENV, Executor, ProcessSettings, Slot, prestart_slots
    from spark_llm.engine_host.client import await_server
    from spark_llm.errors import EngineStartError

    monkeypatch.setenv(ENGINE_DIR_ENV, str(tmp_path))
    spec = EngineSpec.from_config(BatchConfig(model=str(tmp_path / "no-such-model"), max_model_len=64))
    slots = [Slot.cpu(n, executor=os.getpid()) for n in range(2)]
    process = ProcessSettings(engine_idle_timeout_seconds=0, engine_log_level="WARNING")
    assert prestart_slots(spec, process, slots, Executor(os.getpid(), dict(os.environ))) == slots
    [launcher] = {s.starting_record().pid for s in slots}
    for slot in slots:
        with pytest.raises(EngineStartError, match="no-such-model"):
            await_server(slot, launcher)
    starts = [e for e in read_events(tmp_path) if e["event"] == "start"]
    assert sorted(e["slot"] for e in starts) == [s.name for s in slots]
    assert len({e["pid"] for e in starts} | {launcher}) == 3  # an engine process per slot, neither the launcher
    for slot, start in zip(slots, sorted(starts, key=lambda e: e["slot"])):
        assert f"engine[{start['pid']}]" in slot.path(".log").read_text()  # each in its own slot's log


def test_a_running_engine_has_vllm_s_usage_report_and_the_hub_off(spark, tiny_model, engine_dir):
    """Read from the environment of the engine process that answered a task (while it runs), judged by vLLM's and
    huggingface_hub's own code in a process started with that environment."""
    import json
    import subprocess
    import sys

    spec = EngineSpec.from_config(BatchConfig(**engine_settings(tiny_model)).resolved(max_model_len=1024))

    run = probe(spec, [5, 6, 7])  # the closure travels by value; this module is not on the workers' path

    def engine_environ(batches):
        for out in run(batches):
            pid = int(out["engine"][0])
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
            yield pd.DataFrame({"environ": [json.dumps({k.decode(): v.decode(errors="replace") for k, v in pairs})]})

    [row] = spark.range(0, 1, 1, numPartitions=1).mapInPandas(engine_environ, "environ string").collect()
    environ = json.loads(row["environ"])
    judged = subprocess.run(
        [sys.executable, "-c", "from vllm.usage.usage_lib import is_usage_stats_enabled as on; "
                               "from huggingface_hub import constants as c; "
                               "print(on(), c.HF_HUB_OFFLINE, c.HF_HUB_DISABLE_TELEMETRY)"],
        env=environ, capture_output=True, text=True, check=True)
    assert judged.stdout.split() == ["False", "True", "True"]


def test_no_engine_of_the_run_called_outside_and_the_one_answering_holds_no_connection_out(spark, tiny_model,
                                                                                           engine_dir):
    """Every engine this test run started so far (its jobs', its service's, these probes') recorded no call past
    loopback (egress.watch: Python's audit hooks in each engine process), and the engine answering this task holds
    no socket to another host at that moment."""
    import json

    spec = EngineSpec.from_config(BatchConfig(**engine_settings(tiny_model)).resolved(max_model_len=1024))

    def peers_outside(pid: int) -> list[str]:
        """The remote ends past loopback of the sockets process ``pid`` holds, from the kernel's own tables
        (``/proc/<pid>/net``): native code's sockets too, which no audit hook sees."""
        import ipaddress
        import os

        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = []
        for table in ("tcp", "tcp6", "udp", "udp6"):
            for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
                fields = line.split()
                remote, inode = fields[2], fields[9]
                host, port = remote.split(":")
                if inode not in inodes or int(port, 16) == 0:  # not this process's, or not connected
                    continue
                # the address as the kernel prints it: 32-bit words, each little-endian
                raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
                address = ipaddress.ip_address(raw)
                mapped = getattr(address, "ipv4_mapped", None)
                if not (mapped or address).is_loopback:
                    found.append(f"{address}:{int(port, 16)}")
        return found

    run = probe(spec, [5, 6, 7])

    def engine_peers(batches):
        for out in run(batches):
            pid = int(out["engine"][0])
            yield pd.DataFrame({"engine": [pid], "peers": [json.dumps(peers_outside(pid))]})

    [row] = spark.range(0, 1, 1, numPartitions=1).mapInPandas(engine_peers, "engine long, peers string").collect()
    assert json.loads(row["peers"]) == []
    events = read_events(engine_dir)
    assert row["engine"] in {e["pid"] for e in events if e["event"] == "ready"}
    assert [e for e in events if e["event"] == "egress"] == []
