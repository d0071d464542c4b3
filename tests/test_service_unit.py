"""The batch service's parts that need no Spark: the status machine, the store's compare-and-set and paging, the
settings' checks, the upload checks, and the shapes against openai-python's own types."""

from __future__ import annotations

import pytest

from conftest import eventually

from spark_llm.config import ConfigError
from spark_llm.service.files import TextCheck, check_filename
from spark_llm.service.lifecycle import CANCELLABLE, FINAL, TIMESTAMP, TRANSITIONS, Status, sources
from spark_llm.batch import ENDED, Batch, BatchErrors, RequestCounts
from spark_llm.service.protocol import APIError, BatchCreate, FileObject
from spark_llm.service.settings import ServiceSettings
from spark_llm.service.store import BatchChange, BatchRecord, FileRecord, Store


def test_every_status_but_validating_is_reached_and_stamped_in_a_batch_field():
    reached = {s for after in TRANSITIONS.values() for s in after}
    assert reached == set(Status) - {Status.VALIDATING}
    assert set(TIMESTAMP) == reached and set(TIMESTAMP.values()) <= set(Batch.model_fields)
    assert FINAL == {Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.EXPIRED}
    assert FINAL == ENDED  # a run's batch.json is written in a final status, and only then
    assert sources(Status.CANCELLED) == {Status.CANCELLING} and not CANCELLABLE & FINAL


def _batch(id: str, owner: str = "o", status: Status = Status.VALIDATING) -> BatchRecord:
    return BatchRecord(id=id, owner=owner, status=status, endpoint="/v1/chat/completions",
                       input_file_id=f"file-{owner}", completion_window="24h", created_at=1)


def _add(store: Store, batch: BatchRecord) -> None:
    """``batch`` into ``store``, over an input file of its owner's (a batch is added only over one)."""
    if store.file(batch.input_file_id) is None:
        store.add_file(FileRecord(id=batch.input_file_id, owner=batch.owner, filename="in.jsonl", purpose="batch",
                                  bytes=3, created_at=1, location="/x"))
    assert store.add_batch(batch)


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'service.db'}")
    yield s
    s.close()


def test_a_status_moves_only_where_the_lifecycle_allows_and_stamps_its_time(store):
    _add(store, _batch("b1"))
    assert store.move("b1", Status.COMPLETED) is None  # validating -> completed skips in_progress, finalizing
    moved = store.move("b1", Status.IN_PROGRESS, BatchChange(counts=RequestCounts(total=3, completed=0, failed=0)),
                       now=100)
    assert (moved.status, moved.in_progress_at, moved.request_counts.total) == (Status.IN_PROGRESS, 100, 3)
    assert store.move("b1", Status.CANCELLING, now=101).cancelling_at == 101
    assert store.move("b1", Status.FINALIZING) is None  # a cancel won the race
    store.add_counts("b1", completed=2, failed=1)
    done = store.move("b1", Status.CANCELLED, BatchChange(errors=BatchErrors(data=[])))
    counts = done.request_counts
    assert (counts.completed, counts.failed, done.errors) == (2, 1, BatchErrors(data=[]))
    assert [b.id for b in store.unfinished()] == []


def test_pages_are_newest_first_and_owners_see_only_their_own(store):
    for n in range(5):
        _add(store, _batch(f"b{n}", owner="a" if n % 2 == 0 else "b"))
    page, more = store.batches("a", 2, None)
    assert [b.id for b in page] == ["b4", "b2"] and more
    page, more = store.batches("a", 2, "b2")
    assert [b.id for b in page] == ["b0"] and not more
    assert store.batch("b1", owner="a") is None and store.batch("b1", owner="b").id == "b1"
    assert [b.id for b in store.unfinished()] == ["b0", "b1", "b2", "b3", "b4"]  # the queue: oldest first
    store.add_file(FileRecord(id="f1", owner="a", filename="x.jsonl", purpose="batch", bytes=3, created_at=1,
                              location="/x"))
    assert store.file("f1", owner="b") is None and store.file("f1", owner="a").bytes == 3


def test_settings_refuse_an_open_server_without_keys_and_bad_windows(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARK_LLM_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="api-keys"):
        ServiceSettings(host="0.0.0.0").check()
    with pytest.raises(ConfigError, match="duration"):
        ServiceSettings(completion_windows="24h,soon").check()
    assert ServiceSettings(completion_windows="24h, 90s,2d").windows() == {"24h": 86400, "90s": 90, "2d": 172800}
    keys = tmp_path / "keys"
    keys.write_text("# ops\nsk-one\n\nsk-two\n")
    owners = ServiceSettings(api_keys=str(keys), host="0.0.0.0").keys()
    assert set(owners) == {"sk-one", "sk-two"} and len(set(owners.values())) == 2
    assert all(key not in owner for key, owner in owners.items())  # the database never holds a key
    monkeypatch.setenv("SPARK_LLM_API_KEYS", "k1,k2")
    assert set(ServiceSettings().keys()) == {"k1", "k2"}
    with pytest.raises(ConfigError, match="database-url"):
        ServiceSettings(storage="s3a://bucket/service").database()


def test_uploads_are_checked_as_they_arrive():
    check = TextCheck(limit=10)
    check.feed(b'{"a":1}\n')
    with pytest.raises(APIError, match="larger"):
        check.feed(b"123")
    with pytest.raises(APIError, match="binary"):
        TextCheck(limit=100).feed(b"\x89PNG\x00")
    blank = TextCheck(limit=100)
    blank.feed(b" \n\r\n")
    with pytest.raises(APIError, match="empty"):
        blank.close()
    TextCheck(limit=100).feed(b'{"bad": "\xff"}\n')  # not UTF-8: the job's invalid_encoding row, not the door's
    for bad in ("", "..", "a/b.jsonl", "a\\b", "x\x00", "x\x1b[31m", "n" * 256):
        with pytest.raises(APIError):
            check_filename(bad)
    assert check_filename("夜間 batch (1).jsonl") == "夜間 batch (1).jsonl"


def test_shapes_parse_with_openai_python_and_metadata_keeps_its_limits():
    openai = pytest.importorskip("openai")
    batch = Batch(id="batch_1", endpoint="/v1/chat/completions", input_file_id="file-1", completion_window="24h",
                  status="in_progress", created_at=1, request_counts={"total": 3, "completed": 1, "failed": 0},
                  usage={"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}, metadata={"k": "v"})
    parsed = openai.types.Batch.model_validate(batch.model_dump())
    assert parsed.request_counts.completed == 1 and parsed.usage.total_tokens == 7
    file = FileObject(id="file-1", bytes=3, created_at=1, filename="x.jsonl", purpose="batch")
    assert openai.types.FileObject.model_validate(file.model_dump()).purpose == "batch"
    assert APIError.not_found("batch", "b").body()["error"]["message"] == "No batch found with id 'b'."
    BatchCreate(input_file_id="f", endpoint="e", completion_window="24h", metadata={f"k{i}": "v" for i in range(16)})
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(ValueError):
            BatchCreate(input_file_id="f", endpoint="e", completion_window="24h", metadata=metadata)


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_store(request, tmp_path):
    """A store as several servers share it: SQLite on one host, a real PostgreSQL across hosts."""
    url = f"sqlite:///{tmp_path / 'service.db'}" if request.param == "sqlite" else \
        ServiceSettings(database_url=request.getfixturevalue("postgres").url).database()
    s = Store(url)
    if request.param == "postgresql":  # one database for the test run: start from an empty table
        from spark_llm.service.store import batches_table, files_table

        with s.engine.begin() as db:
            db.execute(batches_table.delete())
            db.execute(files_table.delete())
    yield s
    s.close()


def test_each_batch_is_claimed_by_one_server_of_many_claiming_at_once(shared_store):
    import threading

    ids = [f"b{n}" for n in range(40)]
    for id in ids:
        _add(shared_store, _batch(id))
    won: dict[str, list[str]] = {"s1": [], "s2": [], "s3": []}
    start = threading.Barrier(len(won))

    def claim_all(server: str) -> None:
        start.wait()
        won[server] = [id for id in ids if shared_store.claim(id, server, 30)]
    threads = [threading.Thread(target=claim_all, args=(s,)) for s in won]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(id for claimed in won.values() for id in claimed) == sorted(ids)  # each once, none twice
    holder = {id: s for s, claimed in won.items() for id in claimed}
    assert all(shared_store.batch(id).lease_holder == holder[id] for id in ids)


def test_a_batch_created_as_its_file_is_deleted_either_keeps_the_file_or_is_refused(shared_store):
    """40 files, each deleted by one thread while another creates a batch over it at the same moment: whichever
    wins, a batch never reads a file that is gone, and a file read by a batch is never deleted."""
    import threading

    batches = [_batch(f"b{n}", owner=f"o{n}") for n in range(40)]
    for batch in batches:
        _add(shared_store, batch)  # its file
        assert shared_store.move(batch.id, Status.IN_PROGRESS) and shared_store.move(batch.id, Status.FINALIZING)
        assert shared_store.move(batch.id, Status.COMPLETED)  # the file is read by no unfinished batch
    created: dict[str, bool] = {}
    refused: dict[str, object] = {}
    start = threading.Barrier(2)

    def create() -> None:
        start.wait()
        for batch in batches:
            created[batch.id] = shared_store.add_batch(batch.model_copy(update=dict(id=batch.id + "-again")))

    def delete() -> None:
        start.wait()
        for batch in batches:
            refused[batch.id] = shared_store.delete_file(batch.input_file_id)
    threads = [threading.Thread(target=create), threading.Thread(target=delete)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for batch in batches:
        again = shared_store.batch(batch.id + "-again")
        file = shared_store.file(batch.input_file_id)
        assert (again is not None) == created[batch.id]
        if again is not None:  # created first: the delete saw it and left the file
            assert file is not None and refused[batch.id].id == again.id
        else:  # deleted first: the batch was refused
            assert file is None and refused[batch.id] is None


def test_a_lease_runs_out_unless_renewed_and_then_another_server_takes_the_batch(shared_store):
    """b2's lease is short and never renewed, b1's long and renewed: s2 gets b2 once its lease has run out (waited
    for), never b1. The leases' lengths differ by minutes, so no pause of this process decides the outcome."""
    _add(shared_store, _batch("b1"))
    _add(shared_store, _batch("b2"))
    assert shared_store.claim("b1", "s1", 300) and shared_store.claim("b2", "s1", 0.2)
    assert not shared_store.claim("b1", "s2", 30)
    assert shared_store.renew(["b1"], "s1", 300) == {"b1"}  # b2 is not renewed
    eventually(lambda: shared_store.claim("b2", "s2", 30), "b2's lease ran out and s2 took it", seconds=30)
    assert not shared_store.claim("b1", "s2", 30)  # s1 died for b2 only
    assert shared_store.renew(["b1", "b2"], "s1", 30) == {"b1"}  # s1 learns it lost b2
    shared_store.release("b1", "s1")
    assert shared_store.claim("b1", "s2", 30)


def test_a_postgresql_whose_port_was_taken_before_it_started_starts_on_another(monkeypatch):
    """A free port picked for PostgreSQL (it takes no port 0) can be taken before the server binds it."""
    import socket

    from conftest import _load_script

    postgres_server = _load_script("postgres_server")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        pick = postgres_server._free_port
        monkeypatch.setattr(postgres_server, "_free_port", lambda: next(picks, None) or pick())
        server = postgres_server.Postgres().start()
        try:
            assert server.port != taken
            from spark_llm.service.store import Store

            Store(server.url).close()  # it answers on the port it reports
        finally:
            server.stop()


def test_an_older_database_is_upgraded_in_place_to_the_schema_a_new_one_gets(tmp_path):
    """A database as the first release made it (today's tables less what the migrations add since, no record of
    migrations, no webhook tables) with a batch in it: opened, it gets every migration once, in order, and then has
    the very schema of a new database; its batch reads as before, with the new fields' defaults."""
    import sqlalchemy as sa

    from spark_llm.service import migrations
    from spark_llm.service.store import metadata

    added = {"lease_holder", "lease_until", "priority"}  # what MIGRATIONS add to batches
    old_tables = sa.MetaData()
    for name in ("files", "batches", "uploads", "upload_parts"):
        table = metadata.tables[name]
        sa.Table(name, old_tables, *[sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
                                     for c in table.columns if c.name not in added])
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = sa.create_engine(url)
    with old.begin() as db:
        old_tables.create_all(db)
        db.execute(old_tables.tables["batches"].insert().values(
            id="batch_old", owner="o", status="completed", endpoint="/v1/chat/completions", input_file_id="f",
            completion_window="24h", created_at=1, total=2, completed=2, failed=0, runs=1))
    old.dispose()

    def schema(engine: sa.Engine) -> dict[str, set[str]]:
        inspector = sa.inspect(engine)
        return {t: {c["name"] for c in inspector.get_columns(t)} for t in inspector.get_table_names()}
    with sa.create_engine(url).begin() as db:
        assert migrations.upgrade(db, metadata) == [m.name for m in migrations.MIGRATIONS]  # each, in order
    store = Store(url)  # opened again: nothing left to apply
    with store.engine.begin() as db:
        assert migrations.upgrade(db, metadata) == []
    fresh = Store(f"sqlite:///{tmp_path / 'new.db'}")
    assert schema(store.engine) == schema(fresh.engine)
    with fresh.engine.connect() as db:  # a new database has them all recorded, none applied
        assert {r.name for r in db.execute(sa.text("SELECT name FROM schema_migrations"))} == \
            {m.name for m in migrations.MIGRATIONS}
    batch = store.batch("batch_old")
    assert (batch.status, batch.request_counts.completed, batch.runs, batch.priority) == (Status.COMPLETED, 2, 1, None)
    store.close()
    fresh.close()


def test_a_key_s_line_gives_its_priority_and_limits(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# keys\nsk-a priority=low max_queued_batches=2\nsk-b\n")
    settings = ServiceSettings(api_keys=str(keys), max_enqueued_tokens=1000)
    a, b = settings.policies()["sk-a"], settings.policies()["sk-b"]
    assert (a.priority, a.max_queued_batches, a.max_enqueued_tokens) == ("low", 2, 1000)
    assert (b.priority, b.max_queued_batches) == ("normal", None)
    assert settings.keys() == {"sk-a": a.owner, "sk-b": b.owner} and settings.policy(a.owner) == a
    keys.write_text("sk-c priority=urgent\n")
    with pytest.raises(ConfigError, match="priority must be one of high, normal, low"):
        ServiceSettings(api_keys=str(keys)).keys()


# ---- the scheduler's decisions, without Spark ---------------------------------------------------------------------

def _run(batch_id: str, priority: str = "normal", **state):
    from spark_llm.service.runs import Run

    return Run(batch_id, priority=priority, **state)


def test_a_batch_starts_while_there_is_room_and_one_urgent_batch_more():
    from spark_llm.service.queue import has_room

    assert has_room([], "normal", 1)
    assert not has_room([_run("a")], "normal", 1)
    assert has_room([_run("a")], "high", 1)  # one urgent batch beside the running ones
    assert not has_room([_run("a"), _run("u", "high")], "high", 1)  # not two
    assert not has_room([_run("a"), _run("b")], "high", 1)  # already over the limit
    assert has_room([_run("a", ending=True)], "normal", 1)  # a run ending its batch early takes no room
    assert has_room([_run("a")], "normal", 2)


def test_the_queue_goes_by_priority_then_in_rounds_over_the_keys():
    from spark_llm.service.queue import queue_order

    def queued(id: str, owner: str, priority: str = "normal", status: Status = Status.VALIDATING) -> BatchRecord:
        return _batch(id, owner, status).model_copy(update=dict(priority=priority))

    # oldest first as the store lists them: key a queued four batches before b and c queued one each
    batches = [queued("a1", "a"), queued("a2", "a"), queued("a3", "a"), queued("b1", "b"), queued("a4", "a"),
               queued("c1", "c"), queued("c-low", "c", "low"), queued("b-high", "b", "high")]
    order = [b.id for b in queue_order(batches)]
    assert order == ["b-high", "a1", "b1", "c1", "a2", "a3", "a4", "c-low"]
    # one key alone keeps its own order; a key's running batch is its first turn, wherever it is in the list
    assert [b.id for b in queue_order(batches[:3])] == ["a1", "a2", "a3"]
    running = [queued("a1", "a"), queued("b1", "b"), queued("a2", "a", status=Status.IN_PROGRESS)]
    assert [b.id for b in queue_order(running)] == ["b1", "a2", "a1"]
    assert queue_order([]) == []
    # a key of weight 2 takes two turns a round: a1 a2, then b1, then a3 a4 (its second round), then b2
    mixed = [queued("a1", "a"), queued("a2", "a"), queued("a3", "a"), queued("a4", "a"), queued("b1", "b"),
             queued("b2", "b")]
    assert [b.id for b in queue_order(mixed, {"a": 2})] == ["a1", "a2", "b1", "a3", "a4", "b2"]
    assert [b.id for b in queue_order(mixed)] == ["a1", "b1", "a2", "b2", "a3", "a4"]


def test_a_key_s_weight_comes_from_its_line():
    from spark_llm.service.settings import KeyPolicy

    assert KeyPolicy("o").weight == 1
    settings = ServiceSettings()
    assert settings._policy("sk-a weight=3")[1].weight == 3
    for bad in ("sk-a weight=0", "sk-a weight=two"):
        with pytest.raises(ConfigError, match="weight"):
            settings._policy(bad)


def test_a_batch_ends_early_when_cancelled_or_out_of_time_and_a_key_s_tokens_are_bounded():
    from spark_llm.service.queue import ends_early, over_token_limit

    batch = _batch("b", "a", Status.IN_PROGRESS).model_copy(update=dict(expires_at=100))
    assert ends_early(batch, 50) is None
    assert ends_early(batch.model_copy(update=dict(status=Status.CANCELLING)), batch.created_at) is Status.CANCELLED
    assert ends_early(batch, batch.expires_at + 1) is Status.EXPIRED
    assert ends_early(batch.model_copy(update=dict(status=Status.FINALIZING)), batch.expires_at + 1) is None  # it is answered
    assert over_token_limit({"b": 600, "c": 500}, "b", None) is None
    assert over_token_limit({"b": 600, "c": 400}, "b", 1000) is None
    message = over_token_limit({"b": 600, "c": 500}, "b", 1000)
    assert "about 1,100 input tokens with this one (600); its limit is 1,000" in message


def test_the_runs_that_yield_to_an_urgent_batch():
    import threading

    from spark_llm.service.queue import to_pause

    paused = threading.Event()  # cleared: the run yields already
    runs = [_run("plain"), _run("urgent", "high"), _run("ending", ending=True),
            _run("yielded-not-committed-since", committed_since_yield=False), _run("paused", may_infer=paused),
            _run("low", "low")]
    assert [r.batch_id for r in to_pause(runs)] == ["plain", "low"]


# ---- webhooks ---------------------------------------------------------------------------------------------------

def test_a_webhook_retry_waits_twice_as_long_each_time_until_its_window_ends():
    from spark_llm.service.delivery import MAX_RETRY_SECONDS, next_attempt_at

    assert next_attempt_at(0, attempts=1, now=10, first_wait=5, retry_for=1000) == 15
    assert next_attempt_at(0, attempts=3, now=10, first_wait=5, retry_for=1000) == 30
    assert next_attempt_at(0, attempts=30, now=10, first_wait=5, retry_for=1e9) == 10 + MAX_RETRY_SECONDS
    assert next_attempt_at(0, attempts=1, now=996, first_wait=5, retry_for=1000) is None  # given up


def test_a_webhook_url_names_an_allowed_host_over_https_or_a_loopback_one():
    from spark_llm.service.delivery import url_refused

    allowed = "hooks.example.com, ci.example.com:8443, 127.0.0.1"
    for url in ("https://hooks.example.com/x", "https://HOOKS.example.com:443/x", "https://ci.example.com:8443/x",
                "http://127.0.0.1:9000/x"):
        assert url_refused(url, allowed) is None, url
    for url, why in [("https://ci.example.com/x", "not one of them"), ("https://hooks.example.com.evil.io/x",
                     "not one of them"), ("http://hooks.example.com/x", "must be https"),
                     ("https://u:p@hooks.example.com/x", "credentials"), ("file:///etc/passwd", "not an http"),
                     ("https://hooks.example.com:99999/x", "not a URL"), ("https://localhost/x", "not one of them")]:
        assert why in url_refused(url, allowed), url
    assert "not one of them" in url_refused("https://hooks.example.com/x", None)  # none allowed by default


def test_a_batch_s_end_is_an_event_in_the_same_transaction_and_a_delivery_to_each_endpoint_that_takes_it(store):
    from spark_llm.service.store import DeliveryState, WebhookEndpointRecord

    def endpoint(id: str, owner: str, *types: str) -> WebhookEndpointRecord:
        return WebhookEndpointRecord(id=id, owner=owner, name=id, url="https://h/x", event_types=types,
                                     secret="whsec_x", created_at=1, updated_at=1)
    store.add_endpoint(endpoint("we_done", "o", "batch.completed"))
    store.add_endpoint(endpoint("we_all", "o", "batch.completed", "batch.failed"))
    store.add_endpoint(endpoint("we_other", "someone-else", "batch.failed"))
    _add(store, _batch("b1"))
    _add(store, _batch("b2"))
    assert store.move("b1", Status.IN_PROGRESS) and store.deliveries("b1") == []  # not final: no event
    assert store.move("b1", Status.FAILED, now=50)
    assert store.deliveries("b1") == [DeliveryState("we_all", "pending", 0, None)]
    assert store.move("b1", Status.FAILED) is None and len(store.deliveries("b1")) == 1  # one end, one event
    for step in (Status.IN_PROGRESS, Status.FINALIZING, Status.COMPLETED):
        store.move("b2", step, now=60)
    assert [d.endpoint_id for d in store.deliveries("b2")] == ["we_done", "we_all"]
    due = store.due_deliveries(now=55, limit=10)
    assert [(d.batch_id, d.type, d.endpoint.id) for d in due] == [("b1", "batch.failed", "we_all")]
    assert store.claim_delivery(due[0], until=100) and not store.claim_delivery(due[0], until=100)  # one server
    assert store.due_deliveries(now=55, limit=10) == []  # held while it is sent
    assert store.delete_endpoint("we_done", "o") and not store.delete_endpoint("we_other", "o")
    assert [d.endpoint_id for d in store.deliveries("b2")] == ["we_all"]  # what it had pending went with it


def test_servers_turns_at_one_table_follow_each_other_and_other_tables_do_not_wait(postgres, tmp_path):
    """Two stores on one PostgreSQL database (two servers): while one holds a table's turn, the other's turn at that
    table waits for it (PostgreSQL shows its advisory lock not granted), and its turn at another table does not."""
    import threading

    import sqlalchemy as sa

    url = postgres.new_database("turns")
    one, two = Store(url), Store(url)
    entered = threading.Event()

    def waiting() -> int:
        with one.engine.connect() as db:
            return db.execute(sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                              ).scalar()

    def second_server() -> None:
        with two.turn("delta-table:s3a://b/tables/outputs"):
            entered.set()
    try:
        with one.turn("delta-table:s3a://b/tables/outputs"):
            other = threading.Thread(target=second_server)
            other.start()
            eventually(lambda: waiting() == 1, "the second server's turn at the table waiting")
            assert not entered.is_set()
            with two.turn("delta-table:s3a://b/tables/metrics"):  # another table: no wait
                pass
        other.join(30)
        assert entered.is_set() and waiting() == 0
    finally:
        one.close()
        two.close()
    alone = Store(f"sqlite:///{tmp_path / 'one.db'}")  # one server's records: nothing to wait for
    assert not alone.shared
    with alone.turn("t"), alone.turn("t"):
        pass
    alone.close()


def test_engines_held_for_a_backlog_are_one_per_partition_it_would_make_at_most_the_cluster_s():
    from spark_llm.service.capacity import engines_to_hold

    assert engines_to_hold(0, 20_000, 8) == 0            # nothing waits: nothing held
    assert engines_to_hold(1, 20_000, 8) == 1            # any backlog: one engine
    assert engines_to_hold(50_001, 20_000, 8) == 3       # three partitions' worth
    assert engines_to_hold(10**9, 20_000, 8) == 8        # no more than the cluster may give
    assert engines_to_hold(10**9, 20_000, 0) == 0


def test_a_server_is_told_when_its_reading_executors_would_keep_their_cores_for_ever():
    from spark_llm.service.capacity import RELEASE_SETTINGS, never_released

    cached, shuffles = RELEASE_SETTINGS
    assert never_released({}) == [cached, shuffles]  # Spark's defaults: unbounded, shuffles tracked
    assert never_released({cached: "120s", shuffles: "120s"}) == []
    assert never_released({cached: "120s", shuffles: "infinity"}) == [shuffles]
    # shuffles not tracked (an external shuffle service keeps the files): only the cached blocks hold executors
    assert never_released({"spark.shuffle.service.enabled": "true"}) == [cached]
    assert never_released({"spark.dynamicAllocation.shuffleTracking.enabled": "false", cached: "60s"}) == []


class _Hold:
    """What the scheduler asks of its hold on GPU executors (capacity.GpuHold), recorded."""

    engines = 4

    def __init__(self):
        self.held, self.calls = 0, []

    def hold(self, engines: int) -> None:
        self.held = engines
        self.calls.append(engines)

    def release(self) -> None:
        self.held = 0
        self.calls.append(0)


def test_the_scheduler_holds_gpus_for_the_waiting_batches_until_a_first_wave_and_again_after(store, tmp_path):
    """On an elastic cluster: the waiting batches' estimated tokens decide the engines held; a batch's first wave
    lets them go at once, nothing is held while its waves run, and once its last one has ended the rest of the
    backlog is held for again."""
    import time

    from spark_llm.config import BatchConfig
    from spark_llm.service.files import FileStorage
    from spark_llm.service.runs import Progress, Run
    from spark_llm.service.scheduler import BYTES_PER_TOKEN, Scheduler

    settings = ServiceSettings(storage=str(tmp_path / "storage"), max_partition_tokens=1_000)
    scheduler = Scheduler(BatchConfig(target_tokens_per_partition=1_000), settings, store,
                          FileStorage(settings.storage), session=lambda: None)
    scheduler.hold = hold = _Hold()
    for owner, tokens in (("a", 1_500), ("b", 700)):
        store.add_file(FileRecord(id=f"file-{owner}", owner=owner, filename="in.jsonl", purpose="batch",
                                  bytes=tokens * BYTES_PER_TOKEN, created_at=1, location="/x"))
        assert store.add_batch(_batch(f"batch-{owner}", owner=owner))
    scheduler._hold_for_backlog(store.unfinished(), time.time())
    assert hold.held == 3  # 2,200 tokens: three partitions of 1,000

    running = scheduler._running["batch-a"] = Run("batch-a", on_infer=scheduler._let_go)
    scheduler._hold_for_backlog(store.unfinished(), time.time())
    assert hold.held == 3  # still preparing: its engines load meanwhile
    running.begin_inference()
    assert running.inferring and hold.held == 0  # the first wave takes the GPUs
    scheduler._hold_for_backlog(store.unfinished(), time.time())
    assert hold.held == 0  # nothing held while it infers
    Progress(store, running).inference_ended()  # its last wave has ended
    scheduler._hold_for_backlog(store.unfinished(), time.time())
    assert hold.held == 1  # the other batch's 700 tokens
    store.move("batch-b", Status.FAILED)
    store.move("batch-a", Status.FAILED)
    scheduler._hold_for_backlog(store.unfinished(), time.time())
    assert hold.held == 0 and hold.calls == [3, 3, 0, 0, 1, 0]
