"""Several ``spark-llm serve`` processes sharing one real PostgreSQL database and one storage root: each batch is
run by exactly one of them (its lease), either server answers for every batch, and a server that dies mid-batch
loses its lease, which the other takes over, resuming the batch exactly once."""

from __future__ import annotations

import re
import time

import pytest

from conftest import chat_line, eventually, write_jsonl
from test_service import FINAL, Server, long_input, one_row_each, upload, wait_for

pytestmark = pytest.mark.engine

LEASE_SECONDS = 6


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory, postgres):
    storage = tmp_path_factory.mktemp("shared-storage")
    pair = {name: Server(tmp_path_factory.mktemp(f"server-{name}"), tiny_model, storage=storage, extra=(
        "--database-url", postgres.url, "--server-id", name, "--lease-seconds", str(LEASE_SECONDS)))
        for name in ("a", "b")}
    try:
        for server in pair.values():
            server.start()
        yield pair
    finally:
        for server in pair.values():
            server.stop()


def test_servers_starting_together_on_a_new_database_all_start(postgres):
    """Each server makes the tables it needs when it starts; several at once on a new database each start (their
    CREATE TABLEs collided in PostgreSQL's catalog, and a server died)."""
    from concurrent.futures import ThreadPoolExecutor

    from spark_llm.service.store import Store

    url = postgres.new_database("fresh")
    with ThreadPoolExecutor(6) as pool:
        stores = list(pool.map(lambda _: Store(url), range(6)))
    for store in stores:
        store.ping()
        store.close()


#: The other server's side of the race below: its own Spark application creating the same tables at the times it
#: is given (a line "ready" once its session is up; then one line per table: ok, or the error).
OTHER_CREATOR = """
import sys, time
from spark_llm import storage
from spark_llm.schemas import OUTPUTS_COLUMNS, OUTPUTS_STATS
from spark_llm.session import get_session
spark = get_session("local[1]", {"spark.ui.enabled": "false"})
print("ready", flush=True)
root, start, n, gap = sys.stdin.readline().split()
for i in range(int(n)):
    time.sleep(max(0.0, float(start) + i * float(gap) - time.time()))
    try:
        storage.ensure_table(spark, f"{root}/t{i}", OUTPUTS_COLUMNS, OUTPUTS_STATS)
        print("ok", flush=True)
    except Exception as exc:
        print(str(exc).splitlines()[0][:200], flush=True)
"""


def test_servers_creating_the_shared_tables_at_the_same_moment_both_go_on(spark, tmp_path):
    """Two servers' first batches create the shared result tables at once (two Spark applications): one of the
    two creations of version 0 loses (Delta: the protocol changed, or the location is not empty) and its run
    failed and ran again; the loser now finds the table the other made."""
    import subprocess
    import sys

    from conftest import ROOT
    from spark_llm import storage
    from spark_llm.schemas import OUTPUTS_COLUMNS, OUTPUTS_STATS

    tables, gap = 6, 2.0
    other = subprocess.Popen([sys.executable, "-c", OTHER_CREATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        assert other.stdout.readline().strip() == "ready"
        start = time.time() + 1.0
        other.stdin.write(f"{tmp_path} {start} {tables} {gap}\n")
        other.stdin.flush()
        ours = []
        for i in range(tables):
            time.sleep(max(0.0, start + i * gap - time.time()))
            try:
                storage.ensure_table(spark, str(tmp_path / f"t{i}"), OUTPUTS_COLUMNS, OUTPUTS_STATS)
                ours.append("ok")
            except Exception as exc:
                ours.append(str(exc).splitlines()[0][:200])
        theirs = other.communicate(timeout=120)[0].splitlines()
    finally:
        other.kill()
    assert ours == ["ok"] * tables and theirs == ["ok"] * tables, (ours, theirs)
    assert all(storage.read_table(spark, str(tmp_path / f"t{i}")).columns == list(OUTPUTS_COLUMNS)
               for i in range(tables))


def runs_by_server(servers: dict) -> dict[str, list[tuple[str, str]]]:
    """Each server's runs, as its logs record them: (batch id, run number)."""
    return {name: [run for log in sorted(s.root.glob("server-*.log"))
                   for run in re.findall(r"batch (batch_\w+): run (\d+) starts", log.read_text(errors="replace"))]
            for name, s in servers.items()}


def test_each_batch_runs_once_on_one_server_and_either_server_answers_for_it(servers, tmp_path):
    a, b = servers["a"].client(), servers["b"].client()
    created = []
    for n in range(6):
        client = (a, b)[n % 2]
        source = upload(client, write_jsonl(tmp_path / f"small-{n}.jsonl",
                                            [chat_line(f"s{n}-{i}", f"Say {i}.", max_tokens=4) for i in range(12)]))
        created.append(client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                             completion_window="24h"))
    for batch in created:
        done = wait_for(b, batch.id)  # asked of the other server for half of them
        assert done.status == "completed", (servers["a"].log(), servers["b"].log())
        out, err = one_row_each(servers["a"], done)
        assert len(out) == 12 and not err
    runs = runs_by_server(servers)
    ran = [batch for per_server in runs.values() for batch, _ in per_server]
    assert sorted(ran) == sorted(b.id for b in created)  # every batch, each by one server, in one run
    assert all(n == "1" for per_server in runs.values() for _, n in per_server)
    assert all(runs.values()), runs  # both servers took batches from the shared queue


CLIENTS, BATCHES = 10, 20  # two creates a client at once, and a queue both servers claim from ten times each


def test_many_batches_from_concurrent_clients_against_both_servers_each_complete_once(servers, tmp_path):
    """20 batches created by 10 clients at once, half of them against each server: every create is answered
    with a batch, every batch completes, each in one run by one server, every line in exactly one file."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(servers)
    clients = [servers[names[n % 2]].client() for n in range(CLIENTS)]
    source = write_jsonl(tmp_path / "burst.jsonl", [chat_line(f"q{i}", f"Say {i}.", max_tokens=1) for i in range(2)])
    files = [c.files.create(file=source.open("rb"), purpose="batch").id for c in clients]

    def create(n: int) -> str:
        k = n % len(clients)
        return clients[k].batches.create(input_file_id=files[k], endpoint="/v1/chat/completions",
                                         completion_window="24h").id
    with ThreadPoolExecutor(CLIENTS) as pool:
        ids = list(pool.map(create, range(BATCHES)))
    finished: dict = {}
    deadline = time.time() + 1800
    while len(finished) < len(ids) and time.time() < deadline:  # a sweep of the list, not a poller per batch
        time.sleep(2)
        finished.update({b.id: b for b in clients[1].batches.list(limit=100) if b.id in ids and b.status in FINAL})
    done = [finished.get(i) or clients[0].batches.retrieve(i) for i in ids]
    assert len(set(ids)) == BATCHES
    assert [b.status for b in done] == ["completed"] * BATCHES
    assert all(b.request_counts.completed == 2 and b.request_counts.failed == 0 and b.output_file_id
               and not b.error_file_id for b in done)
    runs = [run for per_server in runs_by_server(servers).values() for run in per_server if run[0] in ids]
    assert sorted(b for b, _ in runs) == sorted(ids) and {n for _, n in runs} == {"1"}
    assert all(sum(1 for b, _ in per_server if b in ids) for per_server in runs_by_server(servers).values())


def test_a_dead_server_s_batch_is_taken_over_and_resumed_exactly_once(servers, tmp_path, postgres, spark):
    import sqlalchemy as sa

    from spark_llm.service.settings import ServiceSettings

    client = servers["a"].client()
    source = upload(client, long_input(tmp_path / "long.jsonl"))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(client, batch.id, until=lambda x: x.request_counts.completed > 0 or x.status != "validating")
    engine = sa.create_engine(ServiceSettings(database_url=postgres.url).database())
    with engine.connect() as db:
        holder = db.execute(sa.text("SELECT lease_holder FROM batches WHERE id = :id"), {"id": batch.id}).scalar()
    engine.dispose()
    assert holder in servers, holder
    survivor = servers["b" if holder == "a" else "a"]
    servers[holder].stop()  # the whole server: its process, JVM and engines, as a host that dies
    t0 = time.time()
    done = wait_for(survivor.client(), batch.id, timeout=600)
    assert done.status == "completed", survivor.log()
    out, err = one_row_each(survivor, done)
    assert (len(out), len(err)) == (240, 0)
    ids = (spark.read.format("delta").load(str(survivor.storage / "tables" / "outputs"))
           .where(f"batch_id = '{batch.id}'").groupBy("custom_id").count())
    assert ids.count() == 240 and ids.where("count > 1").count() == 0
    taken_over = [n for b, n in runs_by_server({"s": survivor})["s"] if b == batch.id]
    assert taken_over and int(taken_over[0]) >= 2, survivor.log()  # a resumed run, after the dead server's
    assert time.time() - t0 >= LEASE_SECONDS - 1  # not before the dead server's lease ran out


def test_the_database_down_for_a_while_loses_nothing(servers, tmp_path, postgres):
    """PostgreSQL stopped mid-batch: /ready says so, the servers stop their runs before their leases run out, and
    once it is back the batch is taken again and finishes with every line exactly once."""
    import httpx

    live = [s for s in servers.values() if s.proc is not None and s.proc.poll() is None]
    client = live[0].client()
    source = upload(client, long_input(tmp_path / "long.jsonl", n=120))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(client, batch.id, until=lambda x: x.request_counts.completed > 0 or x.status != "validating")
    postgres.pause()
    down = time.monotonic()
    try:
        ready = lambda: httpx.get(f"http://127.0.0.1:{live[0].port}/ready", timeout=30)  # noqa: E731
        eventually(lambda: ready().status_code == 503, "/ready says the database is down", seconds=30, every=0.5)
        assert "database" in ready().json()["problems"][0]
        time.sleep(max(0.0, down + 30 - time.monotonic()))  # the database down for 30 s in all
    finally:
        postgres.resume()
    done = wait_for(client, batch.id, timeout=600)
    assert done.status == "completed", [s.log() for s in live]
    out, err = one_row_each(live[0], done)
    assert (len(out), len(err)) == (120, 0)
