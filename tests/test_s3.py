"""The job on object storage (issue 42): input files under an ``s3a://`` prefix, every result in a bucket, spoken to
over HTTP by Hadoop's S3A connector (resolved with Delta's jars) and read back with boto3, against a real S3 API
server on 127.0.0.1 (moto's). Each test's bucket is its own."""

from __future__ import annotations

import json

import pytest

from conftest import ADAPTER, capture_logs, chat_line, engine_settings, write_jsonl



def lines_of(client, bucket: str, key: str) -> list[dict]:
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode("utf-8")
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def test_s3_access_reads_hadoop_s_s3a_settings_a_bucket_s_own_first():
    from spark_llm.filesystems import S3Access

    conf = {"fs.s3a.endpoint": "http://127.0.0.1:9000/", "fs.s3a.path.style.access": "true",
            "fs.s3a.access.key": "AK", "fs.s3a.secret.key": "SK", "fs.s3a.endpoint.region": "eu-west-1",
            "fs.s3a.bucket.other.endpoint": "s3.eu-central-1.amazonaws.com",
            "fs.s3a.bucket.other.path.style.access": "false", "fs.s3a.bucket.other.secret.key": "SK2"}
    lake = S3Access.from_hadoop(conf, "lake")
    assert (lake.endpoint, lake.scheme, lake.path_style, lake.region) == ("127.0.0.1:9000", "http", True, "eu-west-1")
    assert (lake.access_key, lake.secret_key) == ("AK", "SK") and "SK" not in repr(lake)
    other = S3Access.from_hadoop(conf, "other")
    assert (other.endpoint, other.scheme, other.path_style, other.secret_key) == (
        "s3.eu-central-1.amazonaws.com", "https", False, "SK2")
    assert S3Access.from_hadoop({"fs.s3a.endpoint": "minio:9000", "fs.s3a.connection.ssl.enabled": "false"}).scheme \
        == "http"
    assert S3Access.from_hadoop({}) == S3Access()  # pyarrow's own chain: AWS_* variables, the instance role
    assert lake.reaches and not S3Access().reaches and not S3Access(encryption="SSE-S3").reaches
    # server-side encryption as S3A writes it, for Python's writes (boto3's arguments); the older setting names too
    kms = S3Access.from_hadoop({"fs.s3a.encryption.algorithm": "SSE-S3",
                                "fs.s3a.bucket.lake.encryption.algorithm": "sse-kms",
                                "fs.s3a.bucket.lake.encryption.key": "arn:k"}, "lake")
    assert kms.write_arguments() == {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "arn:k"}
    assert S3Access.from_hadoop({"fs.s3a.encryption.algorithm": "SSE-S3"}, "other").write_arguments() == {
        "ServerSideEncryption": "AES256"}
    assert S3Access.from_hadoop({"fs.s3a.server-side-encryption-algorithm": "DSSE-KMS"}).write_arguments() == {
        "ServerSideEncryption": "aws:kms:dsse"}
    assert S3Access.from_hadoop(conf, "lake").write_arguments() == {}


def test_a_quarantine_journal_on_s3_is_reached_with_the_session_s_s3a_settings(spark, s3, monkeypatch):
    """The inference tasks' Python opens the run's staging area with pyarrow: without the session's S3A endpoint and
    keys it cannot (it would look for the bucket at AWS), and the journal fell back to the host's disk."""
    from spark_llm.engine_host.isolation import Journal
    from spark_llm.filesystems import s3_access

    client = s3.client()
    client.create_bucket(Bucket="journals")
    base = "s3a://journals/run/_staging/quarantine/r1"
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the session's settings only, as on a cluster whose Hadoop has them
    assert not Journal.open(base, 4).root.startswith("journals/")  # pyarrow alone: the host's disk
    journal = Journal.open(base, 3, s3_access(spark, base))
    marker = journal.mark(["req-1", "req-2"])
    listed = [o["Key"] for o in client.list_objects_v2(Bucket="journals", Prefix="run/")["Contents"]]
    assert f"run/_staging/quarantine/r1/p3/{marker.rsplit('/', 1)[1]}" in listed
    assert Journal.open(base, 3, s3_access(spark, base)).deaths() == [frozenset({"req-1", "req-2"})]
    journal.clear(marker)
    assert Journal.open(base, 3, s3_access(spark, base)).deaths() == []


def test_a_file_written_in_place_on_s3_appears_whole_or_not_at_all(spark, s3):
    """On an object store the files are written in place, without a temp object and its copying rename; a write that
    fails is aborted, and nothing appears (closing the stream would publish the bytes so far)."""
    from spark_llm import storage

    client = s3.client()
    client.create_bucket(Bucket="inplace")
    storage.write_text_atomic(spark, "s3a://inplace/run/batch.json", '{"status": "completed"}')
    assert client.get_object(Bucket="inplace", Key="run/batch.json")["Body"].read() == b'{"status": "completed"}'
    with pytest.raises(RuntimeError, match="mid-write"):
        with storage._writer(spark, "s3a://inplace/run/output.jsonl") as (fs, hpath):
            with storage._created(fs, hpath, in_place=True) as out:
                out.write(bytearray(b'{"custom_id": "a"}\n'))
                raise RuntimeError("mid-write")
    listed = [o["Key"] for o in client.list_objects_v2(Bucket="inplace").get("Contents", [])]
    assert listed == ["run/batch.json"]
    assert storage.appears_whole_on_close("s3a://b/k") and not storage.appears_whole_on_close("/tmp/k")


#: Server-side encryption of bucket "lake" with a KMS key: Hadoop's own settings, for one bucket (``fs.s3a.*`` for
#: all), which its S3A connector applies to every object it writes.
LAKE_KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/0b5e7a3c-spark-llm-test"
LAKE_ENCRYPTION = {"fs.s3a.bucket.lake.encryption.algorithm": "SSE-KMS",
                   "fs.s3a.bucket.lake.encryption.key": LAKE_KMS_KEY}


@pytest.fixture(scope="module")
def s3_run(spark, s3, tiny_model):
    from spark_llm import BatchConfig
    from spark_llm.pipeline import run_batch

    client = s3.client()
    client.create_bucket(Bucket="lake")
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in LAKE_ENCRYPTION.items():  # this bucket's objects encrypted, as its connector is first made
        hadoop.set(key, value)
    first = [chat_line(f"a-{i}", f"question {i}", max_tokens=4) for i in range(3)]
    second = [chat_line(f"b-{i}", f"question {i}", max_tokens=4) for i in range(2)]
    client.put_object(Bucket="lake", Key="batches/part-1.jsonl",
                      Body="".join(json.dumps(r) + "\n" for r in first).encode())
    client.put_object(Bucket="lake", Key="batches/part-2.jsonl",
                      Body=("".join(json.dumps(r) + "\n" for r in second) + "\nnot json\n").encode())
    cfg = BatchConfig(input="s3a://lake/batches/", output_dir="s3a://lake/results/run1", batch_id="b-s3",
                      **engine_settings(tiny_model))
    with capture_logs() as logs:
        result = run_batch(spark, cfg)
    return result, client, logs


@pytest.mark.engine
def test_a_prefix_of_files_in_a_bucket_runs_and_every_result_lands_in_the_bucket(spark, s3_run):
    from pyspark.sql import functions as F

    result, client, _ = s3_run
    assert result.paths.output_file == "s3a://lake/results/run1/output.jsonl"
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="lake", Prefix="results/run1/")["Contents"]}
    for name in ("output.jsonl", "errors.jsonl", "batch.json", "settings.json", "report.html"):
        assert f"results/run1/{name}" in keys
    assert any(k.startswith("results/run1/delta/outputs/_delta_log/") for k in keys)
    # every line once: five answers, one error row (the bad line of the second file), in the files and the tables
    out = lines_of(client, "lake", "results/run1/output.jsonl")
    err = lines_of(client, "lake", "results/run1/errors.jsonl")
    assert sorted(r["custom_id"] for r in out) == ["a-0", "a-1", "a-2", "b-0", "b-1"]
    assert len(err) == 1 and err[0]["error"]["code"] == "invalid_json"
    outputs = spark.read.format("delta").load("s3a://lake/results/run1/delta/outputs")
    errors = spark.read.format("delta").load("s3a://lake/results/run1/delta/errors")
    rows = outputs.select("file", "line_number").unionByName(errors.select("file", "line_number"))
    assert rows.count() == rows.distinct().count() == 6
    assert {r["file"] for r in rows.select("file").distinct().collect()} == {
        "s3a://lake/batches/part-1.jsonl", "s3a://lake/batches/part-2.jsonl"}
    assert errors.where(F.col("code") == "invalid_json").first()["line_number"] == 4  # the blank line counted
    batch = json.loads(client.get_object(Bucket="lake", Key="results/run1/batch.json")["Body"].read())
    assert batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}


@pytest.mark.engine
def test_every_object_the_job_wrote_is_encrypted_with_the_bucket_s_kms_key(s3, s3_run):
    """The Delta tables' data files and logs, the OpenAI files, the report, the settings: each object's metadata as
    the S3 server keeps it. Only S3A's directory markers (empty objects named ``<dir>/``) are left as they are:
    they hold no byte."""
    _, client, _ = s3_run
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="lake", Prefix="results/")
            for o in page.get("Contents", [])]
    assert any(k.endswith(".parquet") for k in keys) and any("/_delta_log/" in k for k in keys)
    plain = {}
    for key in keys:
        head = client.head_object(Bucket="lake", Key=key)
        if (head.get("ServerSideEncryption"), head.get("SSEKMSKeyId")) != ("aws:kms", LAKE_KMS_KEY):
            plain[key] = head["ContentLength"]
    assert plain == {"results/": 0, "results/run1/": 0}


@pytest.mark.engine
def test_the_openai_files_are_written_once_not_copied_from_a_temp_object(s3, s3_run):
    """The server's request log: no temp object of the run's files was ever written (a rename on S3 copies)."""
    from pathlib import Path

    requests = Path(s3.log.name).read_text(errors="replace")
    assert "PUT /lake/results/run1/output.jsonl " in requests or "/lake/results/run1/output.jsonl?uploads" in requests
    for name in ("output.jsonl", "errors.jsonl", "batch.json", "settings.json", "report.html"):
        assert f"/lake/results/run1/{name}.tmp" not in requests, name


@pytest.mark.engine
def test_the_secret_key_is_in_no_object_and_no_log_line(s3, s3_run):
    _, client, logs = s3_run
    secret = _secret()
    assert secret in s3.hadoop_settings()["fs.s3a.secret.key"]  # the key the connector signed with
    for o in client.list_objects_v2(Bucket="lake", Prefix="results/")["Contents"]:
        body = client.get_object(Bucket="lake", Key=o["Key"])["Body"].read()
        assert secret.encode() not in body, o["Key"]
    assert not [m for m in logs if secret in m]


def _secret() -> str:
    from conftest import _load_script

    return _load_script("s3_server").SECRET_KEY


@pytest.mark.engine
def test_a_model_and_its_lora_adapter_on_s3_are_copied_once_per_host_and_used(spark, s3, tiny_model, tmp_path,
                                                                              model_cache):
    """``--model s3a://...`` and an adapter on ``s3a://`` (which went to vLLM as the URI: every adapter row an error):
    each copied to the host's model cache once, credentials and endpoint from the environment (AWS_*)."""
    from pathlib import Path

    from spark_llm import BatchConfig
    from spark_llm.pipeline import run_batch

    client = s3.client()
    client.create_bucket(Bucket="models")
    for local, prefix in ((Path(tiny_model), "tiny-llm"), (Path(tiny_model).parent / ADAPTER, ADAPTER)):
        for f in local.rglob("*"):
            if f.is_file():
                client.upload_file(str(f), "models", f"{prefix}/{f.relative_to(local)}")
    lines = [chat_line("base", "hello", max_tokens=4), chat_line("tuned", "hello", max_tokens=4, model=ADAPTER)]
    settings = {**engine_settings(tiny_model), "model": "s3a://models/tiny-llm",
                "lora_modules": {ADAPTER: f"s3a://models/{ADAPTER}"}}
    result = run_batch(spark, BatchConfig(input=str(write_jsonl(tmp_path / "in.jsonl", lines)),
                                          output_dir=str(tmp_path / "out"), batch_id="b-s3-model", **settings))
    assert (result.completed, result.failed) == (2, 0)
    answers = {json.loads(line)["custom_id"]: json.loads(line)["response"]["body"]
               for line in Path(result.paths.output_file).read_text().splitlines()}
    assert answers["tuned"]["model"] == ADAPTER and answers["base"]["model"] == "tiny-llm"
    copies = sorted(p.name for p in model_cache.iterdir() if p.is_dir() and "s3a" in p.name)
    assert any(ADAPTER in c for c in copies) and any("tiny-llm" in c and not c.endswith("-meta") for c in copies)
    assert not [p for p in model_cache.iterdir() if ".partial-" in p.name]


# ---- bad input: one clear message, nothing lost ------------------------------------------------------------------

def test_a_store_s_refusals_are_told_apart_by_their_text():
    from spark_llm.filesystems import Refusal, store_failure

    bucket = ("org.apache.hadoop.fs.s3a.UnknownStoreException: `s3a://nope/in.jsonl': getFileStatus on "
              "s3a://nope/in.jsonl: software.amazon.awssdk.services.s3.model.NoSuchBucketException: The specified "
              "bucket does not exist (Service: S3, Status Code: 404)")
    head = ("java.nio.file.AccessDeniedException: s3a://lake/out: getFileStatus on s3a://lake/out: "
            "software.amazon.awssdk.services.s3.model.S3Exception: FORBIDDEN (Service: S3, Status Code: 403)")
    key = "botocore.exceptions.ClientError: An error occurred (InvalidAccessKeyId) when calling the GetObject operation"
    gone = ("org.apache.spark.SparkException: [FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error while reading file "
            "s3a://lake/in/b.jsonl. File does not exist.")
    down = "Caused by: java.net.ConnectException: Connection refused"
    sealed = "java.io.IOException: Unknown encryption algorithm AES-9"
    assert [store_failure(f"An error occurred while calling o60.globStatus.\n: {t}\n\tat org.apache.x(X.java:1)").reason
            for t in (bucket, head, key, gone, down, sealed)] == [
        Refusal.NO_BUCKET, Refusal.DENIED, Refusal.CREDENTIALS, Refusal.GONE, Refusal.UNREACHABLE, Refusal.ENCRYPTION]
    assert store_failure(bucket).detail == bucket  # the store's own line, kept
    assert store_failure("[DELTA_CONCURRENT_APPEND] Files were added") is None  # not the store's: raised as it is
    assert len(store_failure(f"{gone} {'x' * 1000}").detail) < 400


def test_an_input_directory_without_jsonl_files_is_named_as_such():
    from spark_llm.read import files_problem

    assert "holds no file to read" in files_problem("s3a://lake/done/", [])
    assert "holds no JSONL file, only csv, parquet" in files_problem(
        "s3a://lake/export/", ["s3a://lake/export/a.csv", "s3a://lake/export/part-0.snappy.parquet"])
    assert files_problem("s3a://lake/in/", ["s3a://lake/in/part-00000", "s3a://lake/in/a.csv"]) is None
    assert files_problem("s3a://lake/in/", ["s3a://lake/in/batch.jsonl.gz"]) is None


@pytest.fixture(scope="module")
def bad_input(spark, s3, tiny_model):
    """A bucket "uneasy" with two small batch files under ``in/``, a finished Spark job's marker only under ``done/``
    and a CSV export under ``csv/``; and a run of a batch with its config's overrides, that must fail."""
    from spark_llm import BatchConfig
    from spark_llm.config import ConfigError
    from spark_llm.pipeline import run_batch

    client = s3.client()
    client.create_bucket(Bucket="uneasy")
    for name in ("a", "b"):
        client.put_object(Bucket="uneasy", Key=f"in/{name}.jsonl",
                          Body=(json.dumps(chat_line(f"{name}-0", "question", max_tokens=2)) + "\n").encode())
    client.put_object(Bucket="uneasy", Key="done/_SUCCESS", Body=b"")
    client.put_object(Bucket="uneasy", Key="csv/a.csv", Body=b"a,b\n1,2\n")

    runs = iter(range(100))

    def refused(**overrides) -> str:  # each run's output dir its own: a failed batch leaves its batch.json there
        cfg = BatchConfig(**{"input": "s3a://uneasy/in/", "output_dir": f"s3a://uneasy/out{next(runs)}",
                             "batch_id": "b-uneasy", **engine_settings(tiny_model), **overrides})
        with pytest.raises(ConfigError) as refusal:
            run_batch(spark, cfg)
        return str(refusal.value)
    return client, refused


@pytest.mark.engine
def test_a_bucket_that_does_not_exist_is_one_clear_message(bad_input):
    _, refused = bad_input
    message = refused(input="s3a://no-such-bucket/in/a.jsonl")
    assert message.startswith("--input 's3a://no-such-bucket/in/a.jsonl': the bucket does not exist")
    assert "Status Code: 404" in message  # the store's own words
    assert refused(output_dir="s3a://no-such-bucket/run").startswith(
        "--output-dir 's3a://no-such-bucket/run': the bucket")


@pytest.mark.engine
def test_an_encryption_the_s3a_connector_does_not_know_is_one_message_naming_the_setting(spark, bad_input):
    """S3A's own refusal of the bucket's filesystem (a Java IOException as it is made): a bad setting, so one
    message that names it, and no word of --resume."""
    client, refused = bad_input
    client.create_bucket(Bucket="sealed")
    spark.sparkContext._jsc.hadoopConfiguration().set("fs.s3a.bucket.sealed.encryption.algorithm", "AES-9")
    message = refused(output_dir="s3a://sealed/run")
    assert message.startswith("--output-dir 's3a://sealed/run': the S3A connector knows no such encryption")
    assert "fs.s3a.encryption.algorithm" in message and "AES-9" in message and "resume" not in message


@pytest.mark.engine
def test_a_prefix_with_no_jsonl_is_one_clear_message(bad_input):
    _, refused = bad_input
    assert "holds no file to read" in refused(input="s3a://uneasy/done/")
    assert "holds no JSONL file, only csv" in refused(input="s3a://uneasy/csv/")
    assert "does not exist or matches no file" in refused(input="s3a://uneasy/nothing-here/")


@pytest.mark.engine
def test_wrong_keys_are_one_clear_message_without_the_secret(s3, bad_input):
    _, refused = bad_input
    with s3.checking_keys():  # the server refuses the keys the session signs with
        message = refused()
    assert message.startswith("--output-dir 's3a://uneasy/out") and "the store refused access (403)" in message
    assert "fs.s3a" not in message.split("The store said:")[1] and _secret() not in message


@pytest.mark.engine
def test_an_input_file_deleted_mid_read_is_one_clear_message_and_resume_loses_nothing(bad_input, tmp_path,
                                                                                       monkeypatch, spark,
                                                                                       tiny_model):
    """The file is listed, then deleted before its lines are read (the driver held there by a fault): the batch
    stops with a message naming the file, and once it is back ``--resume`` answers every line once."""
    import threading
    import time

    from spark_llm import BatchConfig
    from spark_llm.faults import FAULT_ENV
    from spark_llm.pipeline import run_batch

    client, refused = bad_input
    release = tmp_path / "release"
    monkeypatch.setenv(FAULT_ENV, f"hold_read_until:{release}")
    body = client.get_object(Bucket="uneasy", Key="in/b.jsonl")["Body"].read()

    def delete_while_held():
        while not (tmp_path / "release.held").exists():  # the driver has listed the files and waits
            time.sleep(0.05)
        client.delete_object(Bucket="uneasy", Key="in/b.jsonl")
        release.touch()
    deleter = threading.Thread(target=delete_while_held, daemon=True)
    deleter.start()
    message = refused(output_dir="s3a://uneasy/gone")
    deleter.join()
    assert message.startswith("--input 's3a://uneasy/in/': a file was deleted or replaced while the batch read it")
    assert "s3a://uneasy/in/b.jsonl" in message

    monkeypatch.delenv(FAULT_ENV)
    client.put_object(Bucket="uneasy", Key="in/b.jsonl", Body=body)
    run_batch(spark, BatchConfig(input="s3a://uneasy/in/", output_dir="s3a://uneasy/gone", batch_id="b-uneasy",
                                 resume=True, **engine_settings(tiny_model)))
    assert sorted(r["custom_id"] for r in lines_of(client, "uneasy", "gone/output.jsonl")) == ["a-0", "b-0"]


def test_a_service_file_on_s3_is_one_multipart_upload_and_a_failed_write_leaves_nothing(s3_server):
    """The batch service's files on S3, reached and encrypted as the server's Spark settings say (its S3A
    connector's ``fs.s3a.*``: the endpoint, the keys, the bucket's SSE-KMS key)."""
    from spark_llm.config import ConfigError
    from spark_llm.service import files

    client = s3_server.client()
    client.create_bucket(Bucket="service-files")
    encrypted = {"fs.s3a.bucket.service-files.encryption.algorithm": "SSE-KMS",
                 "fs.s3a.bucket.service-files.encryption.key": LAKE_KMS_KEY}
    storage = files.FileStorage("s3a://service-files/root", {**s3_server.hadoop_settings(), **encrypted})
    whole = storage.location("files", "file-whole")
    with storage.writing(whole) as out:
        for i in range(12):
            out.write(bytes([65 + i]) * (1 << 20))
    assert b"".join(storage.chunks(whole)) == b"".join(bytes([65 + i]) * (1 << 20) for i in range(12))
    assert files.S3_PART_BYTES == 8 << 20  # so two parts: 8 MiB sent as it filled, then the last 4
    head = client.head_object(Bucket="service-files", Key="root/files/file-whole")
    assert head["ETag"].endswith('-2"')
    assert (head.get("ServerSideEncryption"), head.get("SSEKMSKeyId")) == ("aws:kms", LAKE_KMS_KEY)
    with pytest.raises(ConfigError, match="SSE-C needs its key on every read"):
        files.FileStorage("s3a://service-files/root", {"fs.s3a.encryption.algorithm": "SSE-C"})

    cut = storage.location("files", "file-cut")
    with pytest.raises(RuntimeError):
        with storage.writing(cut) as out:
            out.write(b"x" * (9 << 20))  # a part already sent
            raise RuntimeError("the client went away")
    assert storage.size(cut) is None
    assert not client.list_multipart_uploads(Bucket="service-files").get("Uploads")  # aborted, not left behind
    storage.delete(whole)
    # no "files/" object left either: only the root's own marker, made when the storage opened (its first check)
    assert [o["Key"] for o in client.list_objects_v2(Bucket="service-files")["Contents"]] == ["root/"]


def test_an_uploads_parts_on_s3_are_joined_there_without_passing_through_the_server(s3_server):
    """The Uploads API's completion on S3: the parts' objects become the file's parts by S3's own copy
    (UploadPartCopy), none of their bytes read by the server; where S3 cannot join them (a part but the last under
    5 MiB), nothing is written and the server writes the file itself."""
    from spark_llm.service import files

    client = s3_server.client()
    client.create_bucket(Bucket="joined")
    storage = files.FileStorage("s3a://joined/root", s3_server.hadoop_settings())
    sizes = [6 << 20, 5 << 20, 1000]
    parts = []
    for n, size in enumerate(sizes):
        location = storage.location("uploads", "upload-x", f"part-{n}")
        with storage.writing(location) as out:
            out.write(bytes([97 + n]) * size)
        parts.append((location, size))
    calls: list[str] = []
    s3 = storage.s3.client()
    record = lambda model, **_: calls.append(model.name)  # noqa: E731 - every call the server's client makes
    s3.meta.events.register("before-call.s3", record)
    try:
        assert storage.join(parts, storage.location("files", "file-joined"))
        assert not storage.join([parts[2], parts[0]], storage.location("files", "file-not"))  # 1000 bytes first
    finally:
        s3.meta.events.unregister("before-call.s3", record)
    assert calls == ["CreateMultipartUpload", "UploadPartCopy", "UploadPartCopy", "UploadPartCopy",
                     "CompleteMultipartUpload"]
    assert b"".join(storage.chunks(storage.location("files", "file-joined"))) == b"".join(
        bytes([97 + n]) * size for n, size in enumerate(sizes))
    assert storage.size(storage.location("files", "file-not")) is None
