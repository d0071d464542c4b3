"""The batch service's API without Spark: a real uvicorn server on 127.0.0.1 in this process (its scheduler not
started: nothing runs), driven by the real openai-python client. Chunked uploads (OpenAI's Uploads API), the
health, readiness and audit records, the front door's refusals, webhooks to a real receiver."""

from __future__ import annotations

import contextlib
import hashlib
import os
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import eventually, wav

openai = pytest.importorskip("openai")

KEY = "sk-api-test"
LIMITED = "sk-api-limited"  #: a key with limits of its own (its line in the keys file)
IDLE_SECONDS = 3.0  #: the server's upload_idle_seconds (60 by default)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    import uvicorn

    from spark_llm.config import BatchConfig
    from spark_llm.service import audit
    from spark_llm.service.access import Service
    from spark_llm.service.api import create_app
    from spark_llm.service.delivery import Sender
    from spark_llm.service.door import uvicorn_config
    from spark_llm.service.files import FileStorage
    from spark_llm.service.scheduler import Scheduler
    from spark_llm.service.settings import ServiceSettings
    from spark_llm.service.store import Store

    root = tmp_path_factory.mktemp("api")
    keys = root / "keys.txt"
    keys.write_text(f"{KEY}\n{LIMITED} priority=low max_queued_batches=2 max_enqueued_tokens=1000\n")
    settings = ServiceSettings(storage=str(root / "storage"), api_keys=str(keys), upload_idle_seconds=IDLE_SECONDS,
                               webhook_hosts="127.0.0.1", webhook_retry_seconds=0.5)
    files = FileStorage(settings.storage)
    handler = audit.write_to(settings.audit_path())
    store = Store(settings.database())
    scheduler = Scheduler(BatchConfig(model="/m"), settings, store, files, session=lambda: None)
    app = create_app(Service(settings=settings, store=store, files=files, scheduler=scheduler))
    sender = Sender(store, settings)  # the webhooks go out; the scheduler is not started
    sender.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning"))  # serve's
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield {"port": port, "root": root, "store": store, "scheduler": scheduler,
           "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)}
    server.should_exit = True
    thread.join(10)
    sender.stop()
    store.close()
    audit.logger.removeHandler(handler)
    handler.close()


def jsonl(path: Path, lines: int) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "m", "messages": [{"role": "user", "content": "x" * 50}]}})
                            + "\n" for i in range(lines)))
    return path


def test_a_file_sent_in_parts_with_the_sdk_becomes_one_file_with_its_bytes_in_order(api, tmp_path):
    client = api["client"]
    source = jsonl(tmp_path / "big.jsonl", 400)
    data = source.read_bytes()
    upload = client.uploads.upload_file_chunked(file=source, mime_type="application/jsonl", purpose="batch",
                                                part_size=len(data) // 5 + 1, md5=hashlib.md5(data).hexdigest())
    assert upload.status == "completed" and upload.file.bytes == len(data) and upload.file.filename == "big.jsonl"
    assert client.files.content(upload.file.id).read() == data
    assert client.files.retrieve(upload.file.id).purpose == "batch"
    assert not list((api["root"] / "storage" / "uploads" / upload.id).glob("part_*"))  # the parts are gone


def test_parts_are_put_together_in_the_order_completed_and_every_mistake_is_an_openai_error(api, tmp_path):
    client = api["client"]
    first, second = b'{"custom_id": "a"}\n', b'{"custom_id": "b"}\n'
    upload = client.uploads.create(bytes=len(first + second), filename="two.jsonl", mime_type="application/jsonl",
                                   purpose="batch")
    assert upload.status == "pending"
    a = client.uploads.parts.create(upload.id, data=first)
    b = client.uploads.parts.create(upload.id, data=second)
    with pytest.raises(openai.BadRequestError, match="MD5"):
        client.uploads.complete(upload.id, part_ids=[a.id, b.id], md5="0" * 32)
    with pytest.raises(openai.BadRequestError, match="each once"):
        client.uploads.complete(upload.id, part_ids=[a.id, a.id])
    with pytest.raises(openai.BadRequestError, match="hold 19 bytes"):
        client.uploads.complete(upload.id, part_ids=[a.id])
    done = client.uploads.complete(upload.id, part_ids=[b.id, a.id])  # the order given, not the order sent
    assert client.files.content(done.file.id).read() == second + first
    with pytest.raises(openai.BadRequestError, match="is completed"):
        client.uploads.complete(upload.id, part_ids=[b.id, a.id])
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.uploads.create(bytes=10, filename="x.jsonl", mime_type="text/plain", purpose="assistants")
    with pytest.raises(openai.BadRequestError, match="at most 8000000000 bytes"):
        client.uploads.create(bytes=9 * 1000 ** 3, filename="x.jsonl", mime_type="text/plain", purpose="batch")
    small = client.uploads.create(bytes=5, filename="s.jsonl", mime_type="text/plain", purpose="batch")
    with pytest.raises(openai.BadRequestError, match="more than the bytes the upload was created for"):
        client.uploads.parts.create(small.id, data=b"0123456789")  # past the size announced
    with pytest.raises(openai.BadRequestError, match="binary"):
        client.uploads.parts.create(small.id, data=b"\x00\x01")
    with pytest.raises(openai.NotFoundError):
        client.uploads.parts.create("upload_nope", data=b"x")


def test_a_cancelled_upload_keeps_nothing(api):
    client = api["client"]
    upload = client.uploads.create(bytes=4, filename="c.jsonl", mime_type="text/plain", purpose="batch")
    client.uploads.parts.create(upload.id, data=b"{}\n")
    assert client.uploads.cancel(upload.id).status == "cancelled"
    assert not list((api["root"] / "storage" / "uploads" / upload.id).glob("part_*"))
    with pytest.raises(openai.BadRequestError, match="is cancelled"):
        client.uploads.parts.create(upload.id, data=b"{}\n")


def test_health_ready_and_the_audit_log(api):
    import httpx

    base = f"http://127.0.0.1:{api['port']}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{base}/ready")  # the scheduler never started: no Spark session
    assert ready.status_code == 503 and ready.json()["problems"] == ["spark: the session is starting"]
    assert httpx.get(f"{base}/v1/batches").status_code == 401
    lines = [json.loads(x) for x in (api["root"] / "storage" / "audit.jsonl").read_text().splitlines()]
    assert {"upload.created", "upload.completed", "upload.cancelled", "api"} <= {a["action"] for a in lines}
    assert any(a["action"] == "api" and a["status"] == 401 and a["owner"] == "unknown" for a in lines)
    assert KEY not in (api["root"] / "storage" / "audit.jsonl").read_text()


def test_a_file_past_its_expires_after_is_deleted_and_gone_from_the_api(api, tmp_path):
    from spark_llm.service.store import files_table

    client = api["client"]
    kept = client.files.create(file=jsonl(tmp_path / "kept.jsonl", 2).open("rb"), purpose="batch")
    doomed = client.files.create(file=jsonl(tmp_path / "doomed.jsonl", 2).open("rb"), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert doomed.expires_at == doomed.created_at + 3600
    scheduler = api["scheduler"]
    assert scheduler.expire_files() == []  # not yet
    with api["store"].engine.begin() as db:  # an hour later
        db.execute(files_table.update().where(files_table.c.id == doomed.id).values(expires_at=doomed.created_at))
    assert scheduler.expire_files() == [doomed.id]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(doomed.id)
    assert doomed.id not in {f.id for f in client.files.list()} and kept.id in {f.id for f in client.files.list()}
    assert not (api["root"] / "storage" / "files" / doomed.id).exists()
    assert any(a.get("file") == doomed.id and a["action"] == "file.expired" for a in
               map(json.loads, (api["root"] / "storage" / "audit.jsonl").read_text().splitlines()))


def test_priority_from_metadata_or_the_key_and_the_key_s_limits(api, tmp_path):
    client, store, scheduler = api["client"], api["store"], api["scheduler"]
    source = client.files.create(file=jsonl(tmp_path / "p.jsonl", 2).open("rb"), purpose="batch")
    urgent = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                                   metadata={"priority": "high"})
    plain = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (store.batch(urgent.id).priority, store.batch(plain.id).priority) == ("high", "normal")
    with pytest.raises(openai.BadRequestError, match="metadata.priority must be one of high, normal, low"):
        client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"priority": "urgent"})
    limited = openai.OpenAI(base_url=f"http://127.0.0.1:{api['port']}/v1", api_key=LIMITED, max_retries=0)
    small = limited.files.create(file=jsonl(tmp_path / "small.jsonl", 2).open("rb"), purpose="batch")  # ~300 tokens
    first = limited.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert store.batch(first.id).priority == "low"  # the key's default
    second = limited.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError, match="2 unfinished batches, its limit"):
        limited.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert not scheduler.refused_for_tokens(store.batch(first.id))
    big = limited.files.create(file=jsonl(tmp_path / "big.jsonl", 40).open("rb"), purpose="batch")
    limited.batches.cancel(second.id)
    from spark_llm.service.lifecycle import Status

    store.move(second.id, Status.CANCELLED)  # as the scheduler ends a cancelled batch
    third = limited.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert scheduler.refused_for_tokens(store.batch(third.id))  # with the first, over 1,000 tokens
    failed = limited.batches.retrieve(third.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "token_limit_exceeded"
    assert "limit is 1,000 enqueued tokens" in failed.errors.data[0].message


def test_hostile_uploads_leave_nothing_a_client_can_download(api, tmp_path):
    """A 10 KB name and a multipart body cut off mid-file (the client's connection dropped) are refused or dropped;
    no record, and no file under its final name, is left."""
    client, storage = api["client"], api["root"] / "storage" / "files"
    before, stored = {f.id for f in client.files.list()}, {p.name for p in storage.iterdir()}
    with pytest.raises(openai.BadRequestError, match="headers, its filename among them, are limited"):
        client.files.create(file=("x" * 10_000 + ".jsonl", b'{"a": 1}\n'), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="1 to 255 characters"):
        client.files.create(file=("x" * 300 + ".jsonl", b'{"a": 1}\n'), purpose="batch")
    body = (b"--cut\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--cut\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cut.jsonl\"\r\n\r\n"
            + b'{"custom_id": "c", "method": "POST"}\n' * 200)
    with socket.create_connection(("127.0.0.1", api["port"])) as s:
        s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: multipart/form-data; boundary=cut\r\nContent-Length: 1000000\r\n\r\n" + body)
        time.sleep(0.5)  # the server is writing the file part when the client goes away
    deadline = time.time() + 10
    while list(storage.glob("*.partial")) and time.time() < deadline:
        time.sleep(0.1)
    assert {f.id for f in client.files.list()} == before
    assert not list(storage.glob("*.partial"))
    assert {p.name for p in storage.iterdir()} == stored  # nothing new under any name


def test_metrics_report_the_queue_and_this_host_s_gpus(api, tmp_path, monkeypatch):
    import httpx

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # what nvidia-smi --query-gpu=index,memory.used,memory.total,... prints
    smi.write_text("#!/bin/sh\nprintf '0, 1024, 81920, 37\\n1, [N/A], 81920, 0\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    base = f"http://127.0.0.1:{api['port']}"
    assert httpx.get(f"{base}/metrics").status_code == 401
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['spark_llm_gpu_memory_used_bytes{gpu="0"}'] == 1024 * (1 << 20)
    assert values['spark_llm_gpu_utilization_ratio{gpu="0"}'] == 0.37
    assert 'spark_llm_gpu_memory_used_bytes{gpu="1"}' not in values  # a board that does not say
    assert values["spark_llm_spark_ready"] == 0  # this server's scheduler never started
    assert values['spark_llm_batches{status="validating"}'] >= 1  # the batches the other tests created


def test_images_and_audio_uploaded_for_requests_are_the_owner_s_for_its_batches(api, tmp_path):
    """A picture uploaded with purpose vision (openai-python's files.create) is what a batch's Responses lines name by
    input_image.file_id, an audio file with purpose user_data what its transcriptions name by file: the scheduler
    gives each batch its own key's files and no other key's."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), "blue").save(buf, "PNG")
    client = api["client"]
    image = client.files.create(file=("cat.png", buf.getvalue()), purpose="vision")
    assert (image.purpose, image.bytes, image.filename) == ("vision", len(buf.getvalue()), "cat.png")
    assert client.files.content(image.id).content == buf.getvalue()
    with pytest.raises(openai.BadRequestError, match="purpose 'vision' is an image") as refused:
        client.files.create(file=("notes.png", b"not a picture at all"), purpose="vision")
    assert refused.value.code == "invalid_file_format"
    other = openai.OpenAI(base_url=client.base_url, api_key=LIMITED, max_retries=0)
    theirs = other.files.create(file=("dog.png", buf.getvalue()), purpose="vision")
    store, scheduler = api["store"], api["scheduler"]
    owner = store.file(image.id).owner
    clip = client.files.create(file=("call.wav", wav(0.5)), purpose="user_data")
    assert clip.purpose == "user_data"
    with pytest.raises(openai.BadRequestError, match="purpose 'user_data' is an audio file") as refused:
        client.files.create(file=("notes.wav", b"not audio at all"), purpose="user_data")
    assert refused.value.code == "invalid_file_format"
    media = scheduler.runner.media_of(owner)
    assert set(media) >= {image.id, clip.id} and theirs.id not in media
    assert Path(media[image.id]).read_bytes() == buf.getvalue() and Path(media[clip.id]).read_bytes() == wav(0.5)


def test_every_endpoint_a_batch_line_may_name_is_a_batch_endpoint(api, tmp_path):
    from spark_llm.endpoints import ENDPOINTS

    client = api["client"]
    source = client.files.create(file=jsonl(tmp_path / "e.jsonl", 1).open("rb"), purpose="batch")
    for url in ("/v1/moderations", "/v1/classify", "/v1/embeddings", "/v1/audio/transcriptions",
                "/v1/audio/translations"):
        assert url in ENDPOINTS
        assert client.batches.create(input_file_id=source.id, endpoint=url, completion_window="24h").endpoint == url
    with pytest.raises(openai.BadRequestError, match="Unsupported endpoint '/v1/images/generations'"):
        client.batches.create(input_file_id=source.id, endpoint="/v1/images/generations", completion_window="24h")


def test_another_key_s_id_is_no_cursor(api, tmp_path):
    client = api["client"]
    other = openai.OpenAI(base_url=f"http://127.0.0.1:{api['port']}/v1", api_key=LIMITED, max_retries=0)
    older = other.files.create(file=jsonl(tmp_path / "older.jsonl", 1).open("rb"), purpose="batch")
    their_batch = other.batches.create(input_file_id=older.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
    mine = client.files.create(file=jsonl(tmp_path / "mine.jsonl", 1).open("rb"), purpose="batch")
    my_batch = client.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    # the other key's ids say as much as ids that do not exist (were they cursors, the older items would follow)
    assert [f.id for f in other.files.list(after=mine.id)] == [f.id for f in other.files.list(after="file-nope")]
    assert [b.id for b in other.batches.list(after=my_batch.id)] == \
        [b.id for b in other.batches.list(after="batch_nope")]
    # the owner's own ids page as before
    assert older.id in [f.id for f in other.files.list()]
    assert their_batch.id in [b.id for b in other.batches.list()]
    assert my_batch.id not in [b.id for b in client.batches.list(after=my_batch.id)]


def test_the_storage_is_the_server_s_alone(api, tmp_path):
    """Storage root and every folder in it 0700, the database and every stored file 0600: another user of the host
    reads nothing."""
    import stat

    root = api["root"] / "storage"
    uploaded = api["client"].files.create(file=jsonl(tmp_path / "private.jsonl", 1).open("rb"), purpose="batch")
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(root) == 0o700
    assert mode(root / "service.db") == mode(root / "audit.jsonl") == 0o600
    stored = [p for p in (root / "files").rglob("*") if p.is_file()]
    assert any(uploaded.id in p.name for p in stored)
    assert {p.name: mode(p) for p in stored} == {p.name: 0o600 for p in stored}
    folders = [root / "files", *(p for p in root.rglob("*") if p.is_dir())]
    assert {str(p): mode(p) for p in folders} == {str(p): 0o700 for p in folders}


def test_the_dashboard_shows_what_a_batch_holds_as_text(api):
    """Whatever the API answers is shown as text, never run as HTML: a batch whose fields hold markup (answers faked
    by the browser's routing) adds no element to the page, and the report is framed without scripts."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium: scripts/setup.sh installs Debian's chromium package")
    evil = '<img src=x onerror="window.pwned=1">'
    batch = {"id": f"batch_{evil}", "object": "batch", "endpoint": "/v1/chat/completions", "status": f"done{evil}",
             "input_file_id": "file-1", "completion_window": "24h", "created_at": 1,
             "in_progress_at": None, "request_counts": {"total": 2, "completed": 1, "failed": 1},
             "usage": {"input_tokens": f"1{evil}", "output_tokens": 2}}
    pages = {"/v1/batches?limit=100": {"object": "list", "data": [batch], "has_more": False},
             "/v1/batches/b1": batch,
             "/ui/api/batches/b1/errors": {"errors_by_code": {f"code{evil}": 1}, "final": True}}

    def answer(route):
        path = route.request.url.split(str(api["port"]), 1)[1]
        if path == "/ui/api/batches/b1/report":
            return route.fulfill(status=200, content_type="text/html",
                                 body=f"<p>report</p><script>parent.window.pwned=2</script>{evil}")
        route.fulfill(status=200, content_type="application/json", body=json.dumps(pages[path]))

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.route("**/v1/batches**", answer)
        page.route("**/ui/api/**", answer)
        page.goto(f"http://127.0.0.1:{api['port']}/ui")
        page.fill("#key", KEY)
        page.click("#key-form button")
        page.locator("#rows td.status", has_text="done<img").wait_for(timeout=30_000)
        assert page.locator("#rows img").count() == 0 and page.locator("#rows td", has_text="1<img").count() == 1
        page.goto(f"http://127.0.0.1:{api['port']}/ui#b1")
        page.locator("#codes td", has_text="code<img").wait_for(timeout=30_000)
        page.frame_locator("#report").locator("p", has_text="report").wait_for(timeout=30_000)
        assert page.locator("#codes img, #summary img").count() == 0
        assert page.evaluate("window.pwned") is None  # neither the onerror nor the report's script ran
        browser.close()


def test_the_front_door_refuses_before_it_reads(api):
    """No key: 401 whatever the body (a body not even JSON, a large one), OpenAI's error shape; with a key, a JSON
    body over the bound (declared, or chunked without a length) is refused with 413 unread beyond it."""
    import httpx

    from spark_llm.service.door import MAX_JSON_BYTES

    url = f"http://127.0.0.1:{api['port']}/v1"
    big = b'{"input_file_id": "' + b"x" * (MAX_JSON_BYTES + 10) + b'"}'
    with httpx.Client(timeout=30) as http:
        for path, body in (("/batches", b"{not json"), ("/batches", big), ("/uploads", b"[]"),
                           ("/uploads/upload_x/complete", b"{}")):
            answer = http.post(url + path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 401, (path, answer.text)
            assert answer.json()["error"]["code"] == "invalid_api_key"
        keyed = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        answer = http.post(url + "/batches", content=big, headers=keyed)
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"

        def chunks():
            for _ in range(MAX_JSON_BYTES // 65536 + 2):
                yield b" " * 65536
        answer = http.post(url + "/batches", content=chunks(), headers=keyed)  # no content-length: chunked
        assert answer.status_code == 413 and answer.json()["error"]["type"] == "invalid_request_error"
        # a body within the bound goes on to the route, as before
        answer = http.post(url + "/batches", content=b"{not json", headers=keyed)
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_an_upload_is_one_file_part_after_its_purpose_in_a_whole_body_or_nothing(api):
    """Two file parts, a body without its closing boundary, purpose sent after the file part, too many fields:
    each a 400 in OpenAI's shape, and no file record or stored file left."""
    import httpx

    from spark_llm.service.files import MAX_FIELDS

    client, storage = api["client"], api["root"] / "storage" / "files"
    names = lambda: {p.name for p in storage.iterdir()} if storage.exists() else set()  # noqa: E731
    before, stored = {f.id for f in client.files.list()}, names()
    line = b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'

    def part(name: str, value: bytes, filename: str = "") -> bytes:
        named = f'name="{name}"' + (f'; filename="{filename}"' if filename else "")
        return f"--b\r\nContent-Disposition: form-data; {named}\r\n\r\n".encode() + value + b"\r\n"
    bodies = {
        "more than one 'file' part": part("purpose", b"batch") + part("file", line, "a.jsonl")
        + part("file", line * 3, "b.jsonl") + b"--b--\r\n",
        "ends before its closing boundary": part("purpose", b"batch") + part("file", line, "a.jsonl"),
        # text that is no image, stored as a vision file were its purpose read after it
        "must come before": part("file", line, "no-image.png") + part("purpose", b"vision") + b"--b--\r\n",
        f"more than {MAX_FIELDS} form fields": b"".join(part(f"f{i}", b"x") for i in range(MAX_FIELDS + 1))
        + part("purpose", b"batch") + part("file", line, "a.jsonl") + b"--b--\r\n",
    }
    headers = {"authorization": f"Bearer {KEY}", "content-type": "multipart/form-data; boundary=b"}
    with httpx.Client(timeout=30) as http:
        for why, body in bodies.items():
            answer = http.post(f"http://127.0.0.1:{api['port']}/v1/files", content=body, headers=headers)
            assert answer.status_code == 400 and why in answer.json()["error"]["message"], (why, answer.text)
        # the same parts in the right shape are stored
        good = part("purpose", b"batch") + part("file", line, "a.jsonl") + b"--b--\r\n"
        answer = http.post(f"http://127.0.0.1:{api['port']}/v1/files", content=good, headers=headers)
        assert answer.status_code == 200 and answer.json()["bytes"] == len(line)
    assert {f.id for f in client.files.list()} == before | {answer.json()["id"]}
    assert len(names() - stored) == 1 and not [n for n in names() if n.endswith(".partial")]


def test_headers_over_the_bound_are_refused_unread(api):
    """A request whose headers are over 64 KiB, whether they come at once or in pieces, gets 431 in OpenAI's error
    shape (no key needed to be refused); a request that is not HTTP gets 400 the same way; ordinary ones go on."""
    from spark_llm.service.door import MAX_HEADER_BYTES

    def ask(raw: bytes, pieces: int = 1) -> tuple[int, dict]:
        with socket.create_connection(("127.0.0.1", api["port"]), timeout=30) as s:
            step = -(-len(raw) // pieces)
            with contextlib.suppress(ConnectionError):  # the server may close as soon as it has refused
                for i in range(0, len(raw), step):
                    s.sendall(raw[i:i + step])
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                data = s.recv(65536)
                if not data:
                    break
                answer += data
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)

    big = b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 * MAX_HEADER_BYTES) + b"\r\n\r\n"
    for pieces in (1, 64):
        status, body = ask(big, pieces)
        assert status == 431 and body["error"]["code"] == "invalid_http_request", (pieces, body)
    status, body = ask(b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    fine = f"GET /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nX-Ok: {'a' * 4000}\r\n\r\n"
    status, body = ask(fine.encode())
    assert status == 200 and body["object"] == "list"


def test_keys_file_edits_apply_without_a_restart(api, tmp_path):
    """A key added to the keys file works at its next call, a removed key is refused at its next, an edited limit
    applies; a line that does not parse leaves the last good keys in force."""
    keys = api["root"] / "keys.txt"
    original = keys.read_text()
    url = f"http://127.0.0.1:{api['port']}/v1"
    new_key = "sk-added-later"
    added = openai.OpenAI(base_url=url, api_key=new_key, max_retries=0)
    limited = openai.OpenAI(base_url=url, api_key=LIMITED, max_retries=0)

    def rewrite(text: str) -> None:  # as an editor saves: a new file renamed over the old
        tmp = keys.with_name("keys.tmp")
        tmp.write_text(text)
        tmp.replace(keys)
    try:
        with pytest.raises(openai.AuthenticationError):
            added.files.list()
        rewrite(original + f"{new_key} max_queued_batches=1\n")
        assert added.files.list().data == []  # the new key works, no restart
        source = added.files.create(file=jsonl(tmp_path / "a.jsonl", 1).open("rb"), purpose="batch")
        added.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.RateLimitError, match="1 unfinished batches, its limit"):
            added.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        rewrite(original + f"{new_key} max_queued_batches=5\n")  # the edited limit applies
        added.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        rewrite(original + f"{new_key} max_queued_batches=lots\n")  # does not parse: the last good read stays
        assert added.files.list().data[0].id == source.id
        rewrite(f"{KEY}\n{new_key}\n")  # the limited key removed
        with pytest.raises(openai.AuthenticationError):
            limited.files.list()
        assert added.files.list().data[0].id == source.id
    finally:
        rewrite(original)
    assert limited.files.list() is not None


def test_a_download_of_a_file_deleted_under_it_is_a_404_not_an_empty_200(api, tmp_path):
    """The download finds the file's record, then its bytes are gone (a delete between the two): 404, as the delete
    says, not a 200 whose body is cut short."""
    client = api["client"]
    uploaded = client.files.create(file=jsonl(tmp_path / "gone.jsonl", 3).open("rb"), purpose="batch")
    assert client.files.content(uploaded.id).read() == (tmp_path / "gone.jsonl").read_bytes()
    # the record stays and the bytes go, as a delete racing the download leaves them
    [stored] = [p for p in (api["root"] / "storage" / "files").iterdir() if uploaded.id in p.name]
    stored.unlink()
    with pytest.raises(openai.NotFoundError, match=f"No file found with id '{uploaded.id}'"):
        client.files.content(uploaded.id)


def test_a_stalled_upload_is_refused_and_leaves_nothing(api):
    """A client that stops sending in the middle of its file part gets 408 once upload_idle_seconds have passed
    without a byte (the test waits for that answer), and neither a record nor a file of it is kept."""
    client, storage = api["client"], api["root"] / "storage" / "files"
    before = {f.id for f in client.files.list()}
    head = (b"--s\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"slow.jsonl\"\r\n\r\n"
            + b'{"custom_id": "c", "method": "POST"}\n' * 50)
    with socket.create_connection(("127.0.0.1", api["port"]), timeout=60) as s:
        started = time.monotonic()
        s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: multipart/form-data; boundary=s\r\nContent-Length: 1000000\r\n\r\n" + head)
        answer = s.recv(65536)  # blocks until the server answers: the client sends nothing more
        waited = time.monotonic() - started
        while not answer.endswith(b"}") and (more := s.recv(65536)):  # the rest of the answer
            answer += more
    head_line, _, body = answer.partition(b"\r\n\r\n")
    assert head_line.split()[1] == b"408" and json.loads(body)["error"]["code"] == "upload_timeout"
    assert waited >= IDLE_SECONDS  # it was the silence that ended it
    assert {f.id for f in client.files.list()} == before
    assert not list(storage.glob("*.partial"))


def test_a_batch_created_as_its_file_is_deleted_is_a_404_not_a_batch_that_fails_later(api, tmp_path, monkeypatch):
    """The delete lands between batches.create's look at the file and the batch's insert: the create answers 404
    for the file, as it would a moment later, and no batch is left to fail with a misleading invalid_config."""
    client, store = api["client"], api["store"]
    uploaded = client.files.create(file=jsonl(tmp_path / "deleted.jsonl", 3).open("rb"), purpose="batch")
    looked_up = store.file

    def file_then_deleted(id: str, owner=None):
        record = looked_up(id, owner)
        if id == uploaded.id and record is not None:
            assert store.delete_file(id) is None  # what DELETE /v1/files/{id} does in the meantime
        return record
    monkeypatch.setattr(store, "file", file_then_deleted)
    before = {b.id for b in client.batches.list(limit=100)}
    with pytest.raises(openai.NotFoundError, match=f"No file found with id '{uploaded.id}'"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert {b.id for b in client.batches.list(limit=100)} == before


def test_a_batch_s_end_goes_to_its_key_s_webhook_signed_and_again_until_received(api, tmp_path, receiver):
    """A key registers an endpoint with openai-python's client.webhooks; its batch fails (the runner's own failure
    path); the receiver answers 503 to the first delivery and 200 to the second, and both carry the same event id
    and a signature that client.webhooks.unwrap verifies with the secret the key was given."""
    from spark_llm.config import ConfigError
    from spark_llm.service.store import DeliveryState

    client, store = api["client"], api["store"]
    endpoint = client.webhooks.create(name="ci", url=receiver["url"], event_types=["batch.failed", "batch.completed"])
    assert endpoint.signing_secret.startswith("whsec_") and endpoint.signing_secret_hint.endswith(
        endpoint.signing_secret[-4:])
    receiver["answers"].append(503)
    uploaded = client.files.create(file=jsonl(tmp_path / "hooked.jsonl", 3).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    api["scheduler"].runner.fail(store.batch(batch.id), ConfigError("no such model"))
    eventually(lambda: store.deliveries(batch.id) == [DeliveryState(endpoint.id, "delivered", 2, 200)],
               "the event delivered at its second attempt", seconds=30)
    assert len(receiver["got"]) == 2
    (first, body), (again, same) = receiver["got"]
    assert first["webhook-id"] == again["webhook-id"] and body == same  # one event, sent twice
    event = client.webhooks.unwrap(same, again, secret=endpoint.signing_secret)
    assert (type(event).__name__, event.type, event.data.id) == ("BatchFailedWebhookEvent", "batch.failed", batch.id)
    assert event.id == again["webhook-id"] and event.created_at == store.batch(batch.id).failed_at
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(same, again, secret="whsec_" + "A" * 44)
    audited = [json.loads(x) for x in (api["root"] / "storage" / "audit.jsonl").read_text().splitlines()]
    steps = [(a["action"], a.get("status")) for a in audited if a.get("event") == event.id]
    assert steps == [("webhook.failed", 503), ("webhook.delivered", 200)]
    assert endpoint.signing_secret not in (api["root"] / "storage" / "audit.jsonl").read_text()
    client.webhooks.delete(endpoint.id)


def test_webhook_endpoints_are_the_key_s_own_and_point_only_where_the_operator_allows(api, receiver):
    client = api["client"]
    other = openai.OpenAI(base_url=client.base_url, api_key=LIMITED, max_retries=0)
    created = client.webhooks.create(name="mine", url=receiver["url"], event_types=["batch.completed"])
    listed = client.webhooks.list()
    assert [e.id for e in listed.data] == [created.id] and "signing_secret" not in listed.data[0].to_dict()
    assert client.webhooks.retrieve(created.id).url == receiver["url"]
    with pytest.raises(openai.NotFoundError):
        other.webhooks.retrieve(created.id)
    assert other.webhooks.list().data == []
    assert client.webhooks.update(created.id, name="renamed").name == "renamed"
    for url, why in [("https://example.com/hooks", "not one of them"), ("http://10.1.2.3/hooks", "must be https"),
                     ("http://user:pw@127.0.0.1/hooks", "credentials"), ("ftp://127.0.0.1/x", "not an http")]:
        with pytest.raises(openai.BadRequestError, match=why):
            client.webhooks.create(name="x", url=url, event_types=["batch.completed"])
    with pytest.raises(openai.BadRequestError, match="'response.completed' is not sent by this server"):
        client.webhooks.update(created.id, event_types=["response.completed"])
    assert client.webhooks.event_types.list().data == ["batch.cancelled", "batch.completed", "batch.expired",
                                                       "batch.failed"]
    # a rotation that keeps the old secret: a test event verifies with either
    rotated = client.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret != created.signing_secret
    result = client.webhooks.test(created.id, event_type="batch.completed")
    assert (result.status_code, result.webhook_endpoint_id) == (200, created.id)
    head, body = receiver["got"][-1]
    for secret in (rotated.signing_secret, created.signing_secret):
        assert client.webhooks.unwrap(body, head, secret=secret).type == "batch.completed"
    client.webhooks.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.webhooks.retrieve(created.id)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/hooks"
    unreachable = client.webhooks.create(name="dead", url=dead, event_types=["batch.completed"])
    with pytest.raises(openai.BadRequestError, match="could not be reached"):
        client.webhooks.test(unreachable.id, event_type="batch.completed")
    client.webhooks.delete(unreachable.id)
