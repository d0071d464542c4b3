"""The batch service on object storage (issue 42): ``spark-llm serve --storage s3a://svc/service`` with its records in
PostgreSQL, against the S3 API server of the test run (moto's, on 127.0.0.1), driven by openai-python. Uploaded
files and the Uploads API's parts go to the bucket as they arrive, each as one multipart upload to its own key
(nothing under a temporary name, no copy); results and the shared Delta tables go there through Spark's S3A."""

from __future__ import annotations

import time

import pytest
import yaml

from conftest import chat_line, write_jsonl
from test_service import KEY_A, Server, lines_of, slow_upload, wait_for

pytestmark = pytest.mark.engine

BUCKET = "svc"


def keys_under(client, prefix: str) -> list[str]:
    return [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]


@pytest.fixture(scope="module")
def s3_service(s3_server, postgres, tiny_model, tmp_path_factory):
    client = s3_server.client()
    client.create_bucket(Bucket=BUCKET)
    server = Server(tmp_path_factory.mktemp("service-s3"), tiny_model, storage=f"s3a://{BUCKET}/service",
                    extra=("--database-url", postgres.new_database("service_s3")))
    config = yaml.safe_load(server.config.read_text())
    config["spark"].update({f"spark.hadoop.{k}": v for k, v in s3_server.hadoop_settings().items()})
    server.config.write_text(yaml.safe_dump(config))
    server.start()
    yield server, client
    server.stop()


def test_files_batches_and_uploads_live_in_the_bucket(s3_server, s3_service, tmp_path):
    server, s3 = s3_service
    api = server.client()
    lines = [chat_line(f"s-{i}", f"question {i}", max_tokens=3) for i in range(3)]
    source = api.files.create(file=("s3.jsonl", write_jsonl(tmp_path / "s3.jsonl", lines).read_bytes()),
                              purpose="batch")
    assert f"service/files/{source.id}" in keys_under(s3, "service/files/")
    batch = wait_for(api, api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)
    assert batch.status == "completed", batch
    assert sorted(r["custom_id"] for r in lines_of(api, batch.output_file_id)) == ["s-0", "s-1", "s-2"]
    results = keys_under(s3, f"service/batches/{batch.id}/")
    assert f"service/batches/{batch.id}/output.jsonl" in results
    assert any("/_delta_log/" in k for k in keys_under(s3, "service/tables/"))

    # the Uploads API: two parts, then the file they make; the parts' objects go once it is made
    body = write_jsonl(tmp_path / "parts.jsonl", [chat_line(f"u-{i}", "hello", max_tokens=2) for i in range(40)])
    data = body.read_bytes()
    upload = api.uploads.create(bytes=len(data), filename="parts.jsonl", mime_type="application/jsonl",
                                purpose="batch")
    half = data.index(b"\n", len(data) // 2) + 1
    parts = [api.uploads.parts.create(upload.id, data=chunk).id for chunk in (data[:half], data[half:])]
    done = api.uploads.complete(upload.id, part_ids=parts)
    assert api.files.content(done.file.id).content == data
    assert f"service/files/{done.file.id}" in keys_under(s3, "service/files/")
    assert not keys_under(s3, "service/uploads/")

    # each file written once to its own key: no temporary name, no copy; a deleted file's object goes
    log = open(s3_server.log.name, errors="replace").read()
    assert ".partial" not in log and f"PUT /{BUCKET}/service/files/{source.id} " not in log  # a copy is a PUT
    api.files.delete(source.id)
    assert f"service/files/{source.id}" not in keys_under(s3, "service/files/")

    # the secret key the server's Spark signs with (its config's spark: section): in no object it wrote, no line it
    # logged, no page of its metrics
    secret = s3_server.hadoop_settings()["fs.s3a.secret.key"]
    written = keys_under(s3, "service/")
    assert written and not [k for k in written
                            if secret.encode() in s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()]
    assert not [p.name for p in server.root.glob("server-*.log") if secret in p.read_text(errors="replace")]
    import httpx

    metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
    assert metrics.status_code == 200 and "spark_llm" in metrics.text and secret not in metrics.text


def test_a_server_killed_during_an_upload_to_the_bucket_leaves_nothing_to_download(s3_service):
    server, s3 = s3_service
    before = {f.id for f in server.client().files.list()}
    stored = set(keys_under(s3, "service/files/"))
    def uploads_under_way() -> list:
        return s3.list_multipart_uploads(Bucket=BUCKET, Prefix="service/files/").get("Uploads", [])
    sender = slow_upload(server)
    deadline = time.time() + 60
    while not uploads_under_way() and time.time() < deadline:
        time.sleep(0.05)
    assert uploads_under_way(), "the upload never reached the bucket"
    server.kill9()
    sender.join(60)
    server.start()
    assert {f.id for f in server.client().files.list()} == before
    assert set(keys_under(s3, "service/files/")) == stored  # no object of the cut-off upload
    from spark_llm.service.files import FileStorage

    # its parts, aborted: by the server's start already here (moto dates every upload in 2010, so the start's
    # sweep finds it stale), or by a sweep
    FileStorage(str(server.storage)).sweep_partials(older_than=0)
    assert not uploads_under_way()
