"""The batch service as a user meets it: a real ``spark-llm serve`` process on 127.0.0.1 (its own Spark session and
engines, the tiny model) driven by the real openai-python client, through files.create -> batches.create ->
batches.retrieve -> files.content, with two API keys, cancels, an expired window and a ``kill -9``."""

from __future__ import annotations

import collections
import contextlib
import re
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import MODEL_NAME, chat_line, engine_settings, eventually, write_jsonl

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.engine

KEY_A, KEY_B = "sk-test-a", "sk-test-b"
MAX_FILE_BYTES = 300_000
#: Settings of the server's batches besides the tests' engine settings: small partitions, a Delta commit each, so
#: that a batch of a few hundred lines runs in several waves (a cancel or a kill lands between two of them).
SERVER_SETTINGS = dict(num_task_slots=1, target_tokens_per_partition=1500, wave_partitions=1)
FINAL = ("completed", "failed", "expired", "cancelled")
#: Requests the server holds (spark_llm.faults) until the test lets them go: before their engine call (a wave in
#: flight), and before the commit of their wave (no wave in flight)
HELD_IN_FLIGHT, HELD_AT_COMMIT = "held-in-flight", "held-at-commit"


class Server:
    """``spark-llm serve`` in a process group of its own (its JVM and engines with it), restartable on the same
    storage; every group it ever had is killed at the end."""

    def __init__(self, root: Path, model: str, storage: Path | None = None, extra: tuple[str, ...] = ()):
        self.root, self.storage, self.extra = root, storage or root / "storage", extra
        self.config = root / "serve.yaml"
        self.config.write_text(yaml.safe_dump({**engine_settings(model), **SERVER_SETTINGS, "spark": {
            "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"}}))
        self.keys = root / "keys.txt"
        self.keys.write_text(f"# the test's keys\n{KEY_A}\n{KEY_B}\n")
        self.groups: list[int] = []
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.faults = ""  #: SPARK_LLM_FAULT_INJECTION of the server (and so of its executors)
        #: custom_id -> (the file that says the server holds it, the file that lets it go): see :meth:`hold`
        self.holds: dict[str, tuple[Path, Path]] = {}

    def hold(self, custom_id: str, where: str) -> None:
        """Hold the request ``custom_id`` at ``where`` (``inference`` or ``commit``) from the next start on."""
        release = self.root / f"release-{custom_id}"
        self.faults = ";".join(filter(None, [self.faults, f"hold_{where}_until:{release}:{custom_id}"]))
        self.holds[custom_id] = (release.with_name(release.name + ".held"), release)

    def start(self) -> None:
        """Start the server on a port it picks itself (``--port 0``, read from the line it prints: a port chosen
        here could be taken before the server binds it), and wait until it answers."""
        from spark_llm.engine_host import ENGINE_DIR_ENV
        from spark_llm.faults import FAULT_ENV

        env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        env[ENGINE_DIR_ENV] = str(self.root / "engines")
        if self.faults:
            env[FAULT_ENV] = self.faults
        path = self.root / f"server-{len(self.groups)}.log"
        with open(path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spark_llm.cli", "serve", "--config", str(self.config), "--master",
                 "local[2]", "--storage", str(self.storage), "--port", "0", "--api-keys", str(self.keys),
                 "--completion-windows", "24h,4s", "--max-file-bytes", str(MAX_FILE_BYTES),
                 "--webhook-hosts", "127.0.0.1", *self.extra],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root, start_new_session=True)
        self.groups.append(self.proc.pid)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log()
            listening = re.search(r"spark-llm serve: http://127\.0\.0\.1:(\d+)/v1", path.read_text(errors="replace"))
            if listening:
                self.port = int(listening.group(1))
                try:
                    self.client(KEY_A).batches.list(limit=1)
                    return
                except openai.APIConnectionError:
                    pass
            time.sleep(0.3)
        raise AssertionError("the server did not answer within 120 s\n" + self.log())

    def client(self, key: str | None = KEY_A) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key or "none", max_retries=0,
                             timeout=60)

    def kill9(self) -> None:
        """SIGKILL to the server process alone, as ``kill -9 <pid>``."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.root.glob("server-*.log")))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("service"), tiny_model)
    s.hold(HELD_IN_FLIGHT, "inference")
    s.hold(HELD_AT_COMMIT, "commit")
    s.start()
    yield s
    s.stop()


def wait_for(client, batch_id: str, until=lambda b: b.status in FINAL, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s: {batch}")


def lines_of(client, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def upload(client, path: Path, name: str | None = None):
    return client.files.create(file=(name or path.name, path.read_bytes()), purpose="batch")


def raw_upload(server: Server, filename: bytes, content: bytes):
    """An upload whose multipart body is written by hand (openai-python escapes control characters in names)."""
    import httpx

    body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + filename + b"\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + content + b"\r\n--b0undary--\r\n")
    response = httpx.post(f"http://127.0.0.1:{server.port}/v1/files", content=body, headers={
        "Authorization": f"Bearer {KEY_A}", "Content-Type": "multipart/form-data; boundary=b0undary"})
    if response.status_code == 400:
        raise openai.BadRequestError(response.json()["error"]["message"], response=response,
                                     body=response.json()["error"])
    return response


def long_input(path: Path, n: int = 240) -> Path:
    """A batch of several waves on the servers' settings (SERVER_SETTINGS: six of 1,500 estimated tokens at 240
    lines), so a test can act between its first commit and its last."""
    return write_jsonl(path, [chat_line(f"long-{i}", f"Count to {i} slowly.", temperature=0, max_tokens=12)
                              for i in range(n)])


def one_row_each(server: Server, batch) -> tuple[list[dict], list[dict]]:
    """The batch's output and error lines, after checking that every input line is in exactly one of them."""
    client = server.client()
    out, err = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    ids = collections.Counter(line["id"] for line in out + err)  # one per input line
    assert all(n == 1 for n in ids.values()), [i for i, n in ids.items() if n > 1]
    assert len(out) + len(err) == batch.request_counts.total
    assert (len(out), len(err)) == (batch.request_counts.completed, batch.request_counts.failed)
    return out, err


# ---- refused at the door ---------------------------------------------------------------------------------------------

def test_bad_uploads_and_batches_are_refused_with_openai_errors_and_nothing_stored(server, tmp_path):
    client = server.client(KEY_A)
    before = {f.id for f in client.files.list()}
    good = write_jsonl(tmp_path / "good.jsonl", [chat_line("x")])
    refused = {
        "purpose": lambda: client.files.create(file=good.open("rb"), purpose="fine-tune"),
        "too large": lambda: client.files.create(file=("big.jsonl", b'{"a": 1}\n' * (MAX_FILE_BYTES // 9 + 1)),
                                                 purpose="batch"),
        "empty": lambda: client.files.create(file=("empty.jsonl", b"\n \n"), purpose="batch"),
        "binary": lambda: client.files.create(file=("x.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"), purpose="batch"),
        "path in name": lambda: upload(client, good, "../../etc/passwd"),
        "control char in name": lambda: raw_upload(server, b"a\x01b.jsonl", good.read_bytes()),
    }
    for what, call in refused.items():
        with pytest.raises(openai.BadRequestError, match=".") as caught:
            call()
            pytest.fail(f"{what}: accepted")
        assert caught.value.body["message"], what
    assert {f.id for f in client.files.list()} == before
    assert not list((server.storage / "files").glob("*.partial"))
    assert len(list((server.storage / "files").iterdir())) == len(before)

    source = upload(client, good)
    create = dict(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    for what, change in {"endpoint": {"endpoint": "/v1/images/generations"},
                         "window": {"completion_window": "1h"},
                         "17 metadata pairs": {"metadata": {f"k{i}": "v" for i in range(17)}},
                         "long metadata key": {"metadata": {"k" * 65: "v"}},
                         "long metadata value": {"metadata": {"k": "v" * 513}}}.items():
        with pytest.raises(openai.BadRequestError):
            client.batches.create(**{**create, **change})
    with pytest.raises(openai.NotFoundError):
        client.batches.create(**{**create, "input_file_id": "file-doesnotexist"})
    assert not [b for b in client.batches.list() if b.input_file_id == source.id]
    client.files.delete(source.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)


def test_keys_see_only_their_own_files_and_batches(server, tmp_path):
    a, b = server.client(KEY_A), server.client(KEY_B)
    with pytest.raises(openai.AuthenticationError):
        server.client(None).files.list()
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong").batches.list()
    source = upload(a, write_jsonl(tmp_path / "a.jsonl", [chat_line("only-a", temperature=0, max_tokens=2)]))
    batch = a.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(source.id), lambda: b.files.content(source.id),
                 lambda: b.files.delete(source.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert source.id not in {f.id for f in b.files.list()}
    assert batch.id not in {x.id for x in b.batches.list()}
    done = wait_for(a, batch.id)
    assert done.status == "completed"
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    assert lines_of(a, done.output_file_id)[0]["custom_id"] == "only-a"


# ---- a batch's life ---------------------------------------------------------------------------------------------------

def test_the_sdk_flow_gives_the_files_spark_llm_run_writes(server, shared_run, tmp_path, spark):
    """files.create -> batches.create -> batches.retrieve -> files.content over one of the shared run's input files:
    the same requests answered and the same error lines as the job wrote for it (ids, timestamps and the sampled
    text aside: the engines batch the requests differently)."""
    from batch_lines import build_e2e_input

    build_e2e_input(tmp_path)
    client = server.client()
    source = upload(client, tmp_path / "a.jsonl")
    assert (source.purpose, source.filename, source.bytes) == ("batch", "a.jsonl", (tmp_path / "a.jsonl").stat().st_size)
    assert client.files.content(source.id).content == (tmp_path / "a.jsonl").read_bytes()
    created = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"team": "nightly"})
    assert (created.status, created.request_counts.total) == ("validating", 0)
    assert created.expires_at == created.created_at + 24 * 3600
    seen = set()
    batch = wait_for(client, created.id, until=lambda b: seen.add(b.status) or b.status in FINAL)
    assert batch.status == "completed", batch
    assert seen <= {"validating", "in_progress", "finalizing", "completed"}
    assert created.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.metadata == {"team": "nightly"} and batch.model == MODEL_NAME
    assert [e.file for e in batch.errors.data] == [source.id] * len(batch.errors.data)
    out, err = one_row_each(server, batch)
    assert batch.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    for file_id, purpose in ((batch.output_file_id, "batch_output"), (batch.error_file_id, "batch_output")):
        assert client.files.retrieve(file_id).purpose == purpose

    tables = shared_run.result.paths
    job_out = (spark.read.format("delta").load(tables.outputs_table).where("file LIKE '%/a.jsonl'")
               .select("custom_id", "response_body").collect())
    job_err = (spark.read.format("delta").load(tables.errors_table).where("file LIKE '%/a.jsonl'")
               .select("custom_id", "code", "message").collect())

    def shape(body: dict) -> tuple:
        return (body["object"], body["model"], body["usage"]["prompt_tokens"], len(body["choices"]),
                sorted(body["choices"][0]))

    assert sorted((o["custom_id"], shape(o["response"]["body"])) for o in out) == \
        sorted((r["custom_id"], shape(json.loads(r["response_body"]))) for r in job_out)
    assert sorted((e["custom_id"] or "", e["error"]["code"], e["error"]["message"]) for e in err) == \
        sorted((r["custom_id"] or "", r["code"], r["message"]) for r in job_err)
    # the shared Delta tables hold the batch's rows under its OpenAI id
    rows = spark.read.format("delta").load(str(server.storage / "tables" / "outputs")).where(
        f"batch_id = '{batch.id}'").count()
    assert rows == batch.request_counts.completed


def test_batches_list_pages_newest_first_and_each_end_goes_to_the_key_s_webhook(server, tmp_path, receiver):
    client = server.client(KEY_B)
    hook = client.webhooks.create(name="ci", url=receiver["url"], event_types=["batch.completed"])
    source = upload(client, write_jsonl(tmp_path / "p.jsonl", [chat_line("p", max_tokens=1)]))
    made = [client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
            for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == [made[2].id, made[1].id] and first.has_more
    second = client.batches.list(limit=2, after=made[1].id)
    assert [b.id for b in second.data] == [made[0].id] and not second.has_more
    # the SDK's auto-pagination follows after=<last id> to the end
    assert [b.id for b in client.batches.list(limit=1)] == [m.id for m in reversed(made)]
    assert [f.id for f in client.files.list(order="asc", limit=1)] == [source.id]
    for batch in made:
        wait_for(client, batch.id)
    # the server's sender posts each batch's end, signed with the endpoint's secret
    eventually(lambda: len(receiver["got"]) >= len(made), "a webhook for each batch", seconds=60)
    events = [client.webhooks.unwrap(body, head, secret=hook.signing_secret) for head, body in receiver["got"]]
    assert sorted((e.type, e.data.id) for e in events) == sorted(("batch.completed", b.id) for b in made)
    client.webhooks.delete(hook.id)


def test_cancel_delivers_the_answers_and_lists_the_rest_as_batch_cancelled(server, tmp_path):
    client = server.client()
    source = upload(client, long_input(tmp_path / "long.jsonl"))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(client, batch.id, until=lambda b: b.request_counts.completed > 0 or b.status in FINAL)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_for(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    out, err = one_row_each(server, done)
    assert done.request_counts.total == 240 and out
    assert err and {e["error"]["code"] for e in err} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_completion_window_expires(server, tmp_path):
    client = server.client()
    source = upload(client, long_input(tmp_path / "long.jsonl"))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="4s")
    assert batch.expires_at == batch.created_at + 4
    done = wait_for(client, batch.id)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    out, err = one_row_each(server, done)
    assert done.request_counts.total == 240
    assert err and {e["error"]["code"] for e in err} == {"batch_expired"}


def test_a_server_killed_mid_batch_resumes_it_exactly_once(server, tmp_path, spark):
    client = server.client()
    source = upload(client, long_input(tmp_path / "long.jsonl"))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    midway = wait_for(client, batch.id, until=lambda b: b.request_counts.completed > 0 or b.status in FINAL)
    assert midway.status == "in_progress"
    server.kill9()
    server.start()
    client = server.client()
    done = wait_for(client, batch.id)
    assert done.status == "completed", server.log()
    out, err = one_row_each(server, done)
    assert (len(out), len(err)) == (240, 0)
    ids = (spark.read.format("delta").load(str(server.storage / "tables" / "outputs"))
           .where(f"batch_id = '{batch.id}'").groupBy("custom_id").count())
    assert ids.count() == 240 and ids.where("count > 1").count() == 0


def _yield_to_urgent(server, tmp_path, held_id: str):
    """A large batch held at ``held_id`` (the server's hold) while a high-priority batch comes and completes; then
    let go. The large batch's id, the urgent one's, and the large batch completed."""
    client = server.client()
    held, release = server.holds[held_id]
    lines = [chat_line(held_id, max_tokens=4)] + [chat_line(f"{held_id}-{i}", f"Count to {i}.", max_tokens=4)
                                                  for i in range(5)]
    large = client.batches.create(input_file_id=upload(client, write_jsonl(tmp_path / "large.jsonl", lines)).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    eventually(held.exists, f"the server holds {held_id}")
    small = write_jsonl(tmp_path / "urgent.jsonl", [chat_line(f"u{i}", "Say hi.", max_tokens=4) for i in range(3)])
    urgent = client.batches.create(input_file_id=upload(client, small).id, endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={"priority": "high"})
    done = wait_for(client, urgent.id)
    assert done.status == "completed" and done.request_counts.completed == 3, server.log()
    assert client.batches.retrieve(large.id).status == "in_progress"  # still held: the urgent batch did not wait
    release.touch()
    large_done = wait_for(client, large.id)
    assert large_done.status == "completed", server.log()
    out, err = one_row_each(server, large_done)
    assert (len(out), len(err)) == (len(lines), 0)
    log = "".join(p.read_text(errors="replace") for p in server.root.glob("server-*.log"))
    assert f"batch {large.id}: yields its task slots to the high-priority batch {urgent.id}" in log
    return log, large.id


def test_a_high_priority_batch_takes_the_slots_of_a_wave_in_flight_which_runs_again_after_it(server, tmp_path):
    """The large batch's wave is in flight when the urgent batch comes (held before its engine call): it is
    cancelled, the urgent batch completes, and the wave is submitted again, every line answered once."""
    log, large = _yield_to_urgent(server, tmp_path, HELD_IN_FLIGHT)
    assert f"batch {large}: wave 1/1 yielded its task slots to a more urgent batch; it runs again" in log


def test_a_high_priority_batch_that_comes_while_no_wave_is_in_flight_cancels_nothing(server, tmp_path):
    """The large batch's only wave is committing when the urgent batch comes (held before its commit): the batch
    yields, nothing of it is in flight to cancel, and it completes once."""
    log, large = _yield_to_urgent(server, tmp_path, HELD_AT_COMMIT)
    assert f"batch {large}: wave 1/1 committed" in log  # one wave: none was in flight
    assert f"batch {large}: wave 1/1 yielded" not in log


# ---- watching it -------------------------------------------------------------------------------------------------------

def test_health_ready_metrics_and_the_audit_log(server, tmp_path):
    import httpx

    base = f"http://127.0.0.1:{server.port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/metrics").status_code == 401  # behind the keys, as the API
    client = server.client()
    batch = client.batches.create(input_file_id=upload(client, write_jsonl(tmp_path / "m.jsonl", [
        chat_line("m-0", max_tokens=2)])).id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_for(client, batch.id).status == "completed"
    ready = httpx.get(f"{base}/ready")  # a batch ran: the session is up (run alone, it is still starting at first)
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['spark_llm_batches{status="completed"}'] >= 1 and values["spark_llm_spark_ready"] == 1
    assert values['spark_llm_requests_total{outcome="completed"}'] >= 1
    assert 'spark_llm_engines{slot=' in text  # the server's CPU engines, ready
    # a local master: its driver runs the tasks, without GPUs (the standalone drill counts real ones:
    # cluster_capacity)
    assert (values["spark_llm_executors"], values["spark_llm_executor_gpus"]) == (1, 0)
    assert sum(v for k, v in values.items() if k.startswith("spark_llm_engine_busy_seconds_total")) > 0
    # every metric the alert rules name is one the server exposes
    rules = (Path(__file__).resolve().parents[1] / "conf" / "prometheus-alerts.yaml").read_text()
    named = set(re.findall(r"\b(spark_llm_[a-z_]+)", rules)) - {"spark_llm_gpu_utilization_ratio"}  # GPUs only
    exposed = {name.split("{")[0] for name in values}
    assert named <= exposed, named - exposed
    audit = [json.loads(line) for line in (server.storage / "audit.jsonl").read_text().splitlines()]
    mine = [a for a in audit if a.get("batch") == batch.id]
    assert [a["action"] for a in mine][:1] == ["batch.created"]
    assert {"batch.in_progress", "batch.finalizing", "batch.completed"} <= {a["action"] for a in mine}
    done = next(a for a in mine if a["action"] == "batch.completed")
    assert (done["total"], done["completed"], done["failed"]) == (1, 1, 0) and done["owner"].startswith("key-")
    calls = [a for a in audit if a["action"] == "api" and a["path"] == f"/v1/batches/{batch.id}"]
    assert calls and all(a["status"] == 200 and a["owner"].startswith("key-") for a in calls)
    assert KEY_A not in (server.storage / "audit.jsonl").read_text()  # key ids, never keys


def test_the_dashboard_in_a_real_browser(server, tmp_path):
    """Headless Chromium (Debian's) driven by Playwright: the key given on the page, the batches listed with their
    status and progress, a batch's errors by code and report, and a running batch cancelled with the page's button;
    a screenshot of each page is kept with the test's files."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium: scripts/setup.sh installs Debian's chromium package")
    client = server.client()
    mixed = upload(client, write_jsonl(tmp_path / "mixed.jsonl", [chat_line("ok-1", max_tokens=2), "{not json",
                                                                   chat_line("ok-2", max_tokens=2)]))
    done = client.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_for(client, done.id).status == "completed"
    running = client.batches.create(input_file_id=upload(client, long_input(tmp_path / "long.jsonl")).id,
                                    endpoint="/v1/chat/completions", completion_window="24h")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"http://127.0.0.1:{server.port}/ui")
        page.fill("#key", KEY_A)
        page.click("#key-form button")
        row = page.locator(f'tr[data-batch="{done.id}"]')
        row.locator("td.status", has_text="completed").wait_for(timeout=30_000)
        assert row.get_by_role("progressbar").get_attribute("aria-valuenow") == "100"
        assert page.locator(f'tr[data-batch="{running.id}"]').count() == 1
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        row.get_by_role("link").click()
        page.locator("#codes td", has_text="invalid_json").wait_for(timeout=30_000)
        assert page.locator("#codes tr").count() == 1
        report = page.frame_locator("#report")
        report.locator("svg").first.wait_for(timeout=30_000)  # the report's plots
        page.screenshot(path=str(tmp_path / "batch.png"), full_page=True)
        page.goto(f"http://127.0.0.1:{server.port}/ui#{running.id}")
        page.locator("#cancel").click()
        page.locator("#detail-status", has_text="cancel").wait_for(timeout=30_000)
        browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert wait_for(client, running.id).status == "cancelled"


def slow_upload(server: Server) -> "threading.Thread":
    """A thread sending an upload of a batch file slowly (about 40 s), for the server to be killed during it; it
    ends when the upload does, answered or cut off."""
    import threading

    import httpx

    line = json.dumps(chat_line("k", max_tokens=2)).encode() + b"\n"

    def body():
        yield (b"--k\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--k\r\nContent-Disposition: "
               b"form-data; name=\"file\"; filename=\"killed.jsonl\"\r\n\r\n")
        for _ in range(2000):
            yield line * 50
            time.sleep(0.02)
        yield b"\r\n--k--\r\n"

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{server.port}/v1/files", content=body(), timeout=120, headers={
                "Authorization": f"Bearer {KEY_A}", "Content-Type": "multipart/form-data; boundary=k"})
    sender = threading.Thread(target=send)
    sender.start()
    return sender


def test_a_server_killed_during_an_upload_leaves_no_file_a_client_can_download(server, tmp_path):
    files = server.storage / "files"
    before = {f.id for f in server.client().files.list()}
    stored = {p.name for p in files.iterdir() if not p.name.endswith(".partial")} if files.exists() else set()
    sender = slow_upload(server)
    deadline = time.time() + 60
    while not list(files.glob("*.partial")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(files.glob("*.partial")), "the upload never reached the server"
    server.kill9()
    sender.join(60)
    server.start()
    client = server.client()
    assert {f.id for f in client.files.list()} == before
    assert {p.name for p in files.iterdir() if not p.name.endswith(".partial")} == stored  # none under a final name
    from spark_llm.service.files import FileStorage

    assert FileStorage(str(server.storage)).sweep_partials(older_than=0) >= 1  # what a later start cleans up
    assert not list(files.glob("*.partial"))
