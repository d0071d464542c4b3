"""The batch service on object storage (issue 42): ``spark-llm serve --storage s3a://svc/service`` with its records in
PostgreSQL, against the S3 API server of the test run (moto's, on 127.0.0.1), driven by openai-python. Uploaded
files and the Uploads API's parts go to the bucket as they arrive, each as one multipart upload to its own key
(nothing under a temporary name, no copy); results and the shared Delta tables go there through Spark's S3A."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from conftest import chat_line, write_jsonl
from test_service import KEY_A, Server, lines_of, one_row_each, slow_upload, wait_for

pytestmark = pytest.mark.engine

BUCKET = "svc"
#: The bucket's objects encrypted with a KMS key: the S3A connector's setting, which the server's own writes (files,
#: upload parts, through boto3) follow as its Spark's do (results, tables)
SVC_KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/5c1e0d2a-spark-llm-service"
SVC_ENCRYPTION = {f"fs.s3a.bucket.{BUCKET}.encryption.algorithm": "SSE-KMS",
                  f"fs.s3a.bucket.{BUCKET}.encryption.key": SVC_KMS_KEY}


def keys_under(client, prefix: str) -> list[str]:
    return [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]


@pytest.fixture(scope="module")
def s3_service(s3_server, postgres, tiny_model, tmp_path_factory):
    client = s3_server.client()
    client.create_bucket(Bucket=BUCKET)
    root = tmp_path_factory.mktemp("service-s3")
    # the audit log: a local file (a storage root on S3 has none by default)
    server = Server(root, tiny_model, storage=f"s3a://{BUCKET}/service",
                    extra=("--database-url", postgres.new_database("service_s3"), "--audit-log",
                           str(root / "audit.jsonl")))
    config = yaml.safe_load(server.config.read_text())
    config["spark"].update({f"spark.hadoop.{k}": v for k, v in {**s3_server.hadoop_settings(),
                                                                  **SVC_ENCRYPTION}.items()})
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

    # parts of 5 MiB and more: joined by S3 itself; the server reads the first part's first bytes (is it text?),
    # nothing of the others
    line = (json.dumps(chat_line("big", "hello " * 40, max_tokens=2)) + "\n").encode()
    big = line * ((6 << 20) // len(line) + 1)
    upload = api.uploads.create(bytes=2 * len(big), filename="big.jsonl", mime_type="application/jsonl",
                                purpose="batch")
    parts = [api.uploads.parts.create(upload.id, data=big).id for _ in range(2)]
    done = api.uploads.complete(upload.id, part_ids=parts)
    assert api.files.content(done.file.id).content == big + big
    log = open(s3_server.log.name, errors="replace").read()
    reads = [f"GET /{BUCKET}/service/uploads/{upload.id}/{part}" in log for part in parts]
    assert reads == [True, False]

    # every object the server wrote is encrypted with the bucket's key: its files and the Uploads API's (boto3), the
    # batch's results and the tables (S3A); only S3A's empty directory markers are not objects of data
    plain = [k for k in keys_under(s3, "service/") if not k.endswith("/") and (
        s3.head_object(Bucket=BUCKET, Key=k).get("ServerSideEncryption"),
        s3.head_object(Bucket=BUCKET, Key=k).get("SSEKMSKeyId")) != ("aws:kms", SVC_KMS_KEY)]
    assert not plain, plain

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
    audited = (server.root / "audit.jsonl").read_text()
    assert f'"batch":"{batch.id}"' in audited and secret not in audited
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


def test_two_servers_on_one_bucket_commit_to_the_shared_tables_at_the_same_moments_and_lose_no_row(
        s3_server, s3_service, tiny_model, tmp_path_factory, tmp_path):
    """A second server on the same bucket and PostgreSQL: each runs one batch, and the servers' first dozen writes
    of the shared Delta tables meet (fault injection), so that their commits start at the same moments. On S3 two
    commits of one version at once would both pass Delta's check that the version is free (no put-if-absent) and
    one would replace the other; the servers' writes of a table take turns in PostgreSQL, and every line of both
    batches is in the tables once."""
    first, _ = s3_service
    meet = tmp_path / "meet"
    second = Server(tmp_path_factory.mktemp("service-s3-b"), tiny_model, storage=first.storage,
                    extra=(*first.extra[:2], "--server-id", "b"))  # its database; its own audit log
    second.config.write_text(first.config.read_text())
    first.stop()
    for server in (first, second):
        server.faults = f"meet_before_table_write:{meet}:2:12"
        server.start()
    try:
        apis = [first.client(), second.client()]
        created = []
        for n, api in enumerate(apis):
            # about 10,000 prompt tokens: 7 partitions of the servers' 1,500, one a wave, two writes each
            lines = [chat_line(f"pair{n}-{i}", f"question {i}: " + "model " * 400, max_tokens=2) for i in range(24)]
            source = api.files.create(file=(f"pair{n}.jsonl", write_jsonl(tmp_path / f"pair{n}.jsonl", lines)
                                            .read_bytes()), purpose="batch")
            created.append(api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                              completion_window="24h", metadata={"pair": str(n)}))
        done = [wait_for(apis[0], batch.id) for batch in created]
        assert [b.status for b in done] == ["completed", "completed"], (first.log(), second.log())
        for n, batch in enumerate(done):
            out, err = one_row_each(first, batch)
            assert sorted(line["custom_id"] for line in out) == sorted(f"pair{n}-{i}" for i in range(24)) and not err
        met = sorted(int(k.name) for k in meet.iterdir() if len(list(k.iterdir())) == 2)
        assert met == list(range(1, 13))  # both servers' first 12 writes met: each batch ran on its own server
    finally:  # the module's last test: the fixture's server is left stopped (another start costs a JVM and engines)
        second.stop()
        first.stop()
        first.faults = ""
