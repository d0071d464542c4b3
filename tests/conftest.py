"""Shared fixtures: one local Spark session with Delta, one tiny model built once per test run, and one shared
end-to-end run (ordinary, hostile and fault-injected lines together) that most job-level tests assert on."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from drills import DrillContext, Lane, drill

ROOT = Path(__file__).resolve().parents[1]

MODEL_NAME = "tiny-llm"
ADAPTER = "tiny-lora"  #: the LoRA adapter's name (and directory name, beside the tiny model)
EMBEDDING_MODEL = "tiny-embed"  #: the embedding model's directory name, beside the tiny model
VISION_MODEL = "tiny-vlm"  #: the vision-language model's directory and served name
CLASSIFIER_MODEL = "tiny-moderation"  #: the moderation classifier's directory and served name
RERANKER_MODEL = "tiny-reranker"  #: the cross-encoder's directory and served name
WHISPER_MODEL = "tiny-whisper"  #: the speech-to-text model's directory and served name
#: The shared run holds a request with this custom_id: the Python worker whose partition holds it dies hard once,
#: right after its engine call (spark_llm.faults), and Spark retries the partition.
KILL_CUSTOM_ID = "kill-my-worker"
#: Poison requests of the shared run (spark_llm.faults): the Python worker dies whenever the first is in an engine
#: call, the engine process whenever the second is; each must end as one engine_error row, the rest answered.
POISON_WORKER_ID = "poison-kills-worker"
POISON_ENGINE_ID = "poison-kills-engine"
#: Engine calls holding requests whose custom_id starts with this wait until two have arrived (spark_llm.faults): a
#: batch of two partitions of them runs on the two engines at once (tests/test_sampling_seeds.py)
MEETING_PREFIX = "meet-"
#: The engine stand-in of the cluster drills: an L4's rates at 32 sequences, with a load of a few seconds, so that
#: engine calls last as the tiny model's do here (an isolating retry's 16 calls included)
STANDIN_L4 = "l4-8b,max_num_seqs=32,start_seconds=5"


def pytest_collection_modifyitems(config, items):
    """The tests that assert on a drill (tests/drills.py) run last, in their order: the lane runs the drills of
    the tests selected while the others run."""
    drilled = [item for item in items if item.get_closest_marker("drill")]
    config.drills = list(dict.fromkeys(m.args[0] for item in drilled for m in item.iter_markers("drill")))
    items[:] = [item for item in items if not item.get_closest_marker("drill")] + drilled
    config.first_drilled = drilled[0].nodeid if drilled else None


def pytest_runtest_setup(item):
    lane = getattr(item.config, "lane", None)
    if lane is not None and item.nodeid == item.config.first_drilled:
        lane.others_ended()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """How long each drill ran on the lane, and when the other tests ended: whichever ends last is the run's wall."""
    lane = getattr(config, "lane", None)
    if lane is not None:
        terminalreporter.write_line(lane.summary())


@pytest.fixture(scope="session", autouse=True)
def lane(request, tmp_path_factory):
    """The drills of the tests selected (tests/drills.py), started with the test run; None when there are none."""
    from spark_llm.engine_host import ENGINE_DIR_ENV
    from spark_llm.faults import FAULT_ENV
    from spark_llm.models import MODEL_CACHE_ENV

    names = getattr(request.config, "drills", [])
    if not names:
        yield None
        return
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, ENGINE_DIR_ENV, MODEL_CACHE_ENV)}
    drills = Lane(DrillContext(request.getfixturevalue("tiny_model"), tmp_path_factory.mktemp("drills"), env), names)
    request.config.lane = drills
    yield drills
    drills.close()


@pytest.fixture(scope="session")
def kill_marker(tmp_path_factory) -> Path:
    """Created by the worker the fault injection killed."""
    return tmp_path_factory.mktemp("faults") / "killed.marker"


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for this test run (scripts/postgres_server.py): its ``url`` has a database of its
    own."""
    server = _load_script("postgres_server").Postgres().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API for this test run (scripts/s3_server.py: moto's server on 127.0.0.1), started before Spark:
    its endpoint and keys are in this process's environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...), the
    standard place pyarrow reads them from, which the local session's workers and engines inherit."""
    script = _load_script("s3_server")
    server = script.S3Server().start()
    saved = {k: os.environ.get(k) for k in script.environment(server)}
    os.environ.update(script.environment(server))
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def s3(spark, s3_server):
    """:func:`s3_server`, with the shared session's S3A connector pointed at it (Hadoop settings of the running
    session: each bucket's filesystem is made at its first use, after these). Its ``client()`` is boto3's."""
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in s3_server.hadoop_settings().items():
        hadoop.set(key, value)
    return s3_server


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    """This test run's engine directory (spark_llm.engine_host): its engines and their records."""
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """This test run's model cache (spark_llm.models): the copies of models given as URIs."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def spark(tmp_path_factory, kill_marker, engine_dir, model_cache, s3_server):
    from spark_llm.engine_host import ENGINE_DIR_ENV
    from spark_llm.faults import FAULT_ENV
    from spark_llm.models import MODEL_CACHE_ENV
    from spark_llm.session import get_session

    # set before Spark starts: local workers inherit the driver's environment
    os.environ[FAULT_ENV] = shared_faults(kill_marker, tmp_path_factory.mktemp("meeting"))
    os.environ[ENGINE_DIR_ENV] = str(engine_dir)
    os.environ[MODEL_CACHE_ENV] = str(model_cache)
    warehouse = tmp_path_factory.mktemp("warehouse")
    # local[4]: four task threads, so that each of the two engines (num_task_slots=2) is fed by two tasks at once;
    # get_session gives a local master the task retries the quarantine needs
    session = get_session(master="local[4]", conf={
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.warehouse.dir": str(warehouse),
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={warehouse}",
    }, app_name="spark_llm-tests")
    yield session
    session.stop()


def shared_faults(kill_marker: Path, meeting: Path) -> str:
    """The faults injected into the shared run (spark_llm.faults; see KILL_CUSTOM_ID and the poison requests)."""
    return (f"kill_worker_once:{kill_marker}:{KILL_CUSTOM_ID};crash_on_custom_id:{POISON_WORKER_ID};"
            f"kill_engine_on_custom_id:{POISON_ENGINE_ID};meet_before_engine_call:{meeting}:{MEETING_PREFIX}:2")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Llama built by scripts/make_tiny_model.py, once per test run, with its LoRA adapter beside it
    (:data:`ADAPTER`, served by every engine of the run: see engine_settings)."""
    out = tmp_path_factory.mktemp("models") / MODEL_NAME
    script = _load_script("make_tiny_model")
    script.build_model(out, seed=0)
    script.build_lora(out, out.parent / ADAPTER)
    return str(out)


@pytest.fixture(scope="session")
def embedding_model(tiny_model) -> str:
    """The tiny Llama as a sentence-transformers embedding model (make_tiny_model.py --kind embedding): mean
    pooling, normalised, 256 floats; its weight file linked to the tiny Llama's."""
    out = Path(tiny_model).parent / EMBEDDING_MODEL
    return str(_load_script("make_tiny_model").build_embedding(Path(tiny_model), out))


@pytest.fixture(scope="session")
def classifier_model(tiny_model) -> str:
    """The tiny Llama as a multi-label sequence classifier over OpenAI's moderation categories
    (make_tiny_model.py --kind classifier)."""
    out = Path(tiny_model).parent / CLASSIFIER_MODEL
    return str(_load_script("make_tiny_model").build_classifier(Path(tiny_model), out))


@pytest.fixture(scope="session")
def reranker_model(tiny_model) -> str:
    """The tiny Llama as a one-label cross-encoder (make_tiny_model.py --kind cross-encoder)."""
    out = Path(tiny_model).parent / RERANKER_MODEL
    return str(_load_script("make_tiny_model").build_classifier(Path(tiny_model), out, cross_encoder=True))


@pytest.fixture(scope="session")
def vision_model(tiny_model) -> str:
    """The tiny LLaVA-shaped vision-language model (make_tiny_model.py --kind vision): 16 tokens an image."""
    return str(_load_script("make_tiny_model").build_vision(Path(tiny_model).parent / VISION_MODEL))


@pytest.fixture(scope="session")
def whisper_model(tiny_model) -> str:
    """The tiny Whisper-shaped speech-to-text model (make_tiny_model.py --kind whisper)."""
    return str(_load_script("make_tiny_model").build_whisper(Path(tiny_model).parent / WHISPER_MODEL))


def wav(seconds: float, rate: int = 16_000, hz: float = 440.0, channels: int = 1, width: int = 2,
        noise_seed: Any = None) -> bytes:
    """A PCM WAV file of a sine tone at ``hz`` (or, with ``noise_seed``, white noise), 0.3 of full scale."""
    import io
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.random.default_rng(noise_seed).uniform(-1, 1, len(t)) if noise_seed is not None
         else 0.3 * np.sin(2 * np.pi * hz * t))
    full = float(1 << (8 * width - 1))
    ints = np.round(x * (full - 1)).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
    else:
        raw = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    frames = b"".join(raw[i:i + width] * channels for i in range(0, len(raw), width)) if channels > 1 else raw
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def write_jsonl(path: Path, lines: list) -> Path:
    """Write lines (dicts become JSON, str/bytes are written as they are) one per line."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line, ensure_ascii=False)
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return path


def eventually(condition, what: str, seconds: float = 120.0, every: float = 0.05) -> None:
    """Poll ``condition`` until it holds; an AssertionError naming ``what`` if it has not within ``seconds`` (a
    bound on a state the test waits for, never a guess that it has happened by then)."""
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:.0f} s: {what}")
        time.sleep(every)


def chat_line(custom_id: str, content: str = "Hello there", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **body}}


def completion_line(custom_id: str, prompt="Once upon a time", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL_NAME, "prompt": prompt, **body}}


def validation_context(**settings):
    """The validation stage's context for a config with these settings."""
    from spark_llm.config import BatchConfig, config_view
    from spark_llm.validate import ValidationContext

    return config_view(ValidationContext, BatchConfig(served_model_name=MODEL_NAME, **settings).resolved(2048))


def engine_settings(model: str) -> dict:
    """Engine settings every engine test shares, so each Spark Python worker builds one engine for the whole run.
    Engines of 8 sequences: the shared run's requests outnumber what its two engines run at once, so each engine is
    fed by two tasks (a batch the engines take whole gets a partition per engine, see partition.num_partitions)."""
    return dict(model=model, served_model_name=MODEL_NAME, max_model_len=1024, max_num_seqs=8, dtype="bfloat16",
                enforce_eager=True, kv_cache_memory_bytes=64 << 20, default_max_tokens=8,
                target_tokens_per_partition=20_000, num_task_slots=2, tool_call_parser="hermes",
                lora_modules={ADAPTER: str(Path(model).parent / ADAPTER)}, max_lora_rank=8,
                # a vLLM limit below what validation allows, so a request can make the real engine fail
                engine_kwargs={"max_logprobs": 3})


@contextlib.contextmanager
def capture_logs(name: str = "spark_llm"):
    """Collect the INFO+ messages of a logger (as strings) while the block runs."""
    messages: list[str] = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@dataclass(frozen=True)
class SharedRun:
    result: Any                                 #: spark_llm.batch.BatchResult
    expected: dict[tuple[str, int], str]       #: (file name, line number) -> "ok" or the error code
    root: Path
    logs: list[str]                             #: spark_llm's INFO+ log messages during the run
    kill_marker: Path                           #: made by the worker the kill_worker_once fault killed
    engine_dir: Path                            #: where its engines kept their records


@pytest.fixture(scope="session")
def shared_run(spark, tiny_model, tmp_path_factory, kill_marker, engine_dir) -> SharedRun:
    """The one end-to-end run most job-level tests assert on: ordinary, hostile, fault-injected and every request
    shape's lines in four files (tests/batch_lines.py), on real Spark, Delta and vLLM."""
    from batch_lines import build_e2e_input, build_hostile_input, build_shapes_input
    from spark_llm import BatchConfig, run_batch

    root = tmp_path_factory.mktemp("shared")
    expected = {**build_e2e_input(root / "input"), **build_hostile_input(root / "input"),
                **build_shapes_input(root / "input")}
    cfg = BatchConfig(input=str(root / "input"), output_dir=str(root / "out"), batch_id="b-e2e",
                      **engine_settings(tiny_model))
    with capture_logs() as messages:
        result = run_batch(spark, cfg)
    return SharedRun(result, expected, root, messages, kill_marker, engine_dir)


@drill("connect")
def connect_drill(ctx: DrillContext) -> SharedRun:
    """The shared run's input and settings again, over Spark Connect: ``spark-llm run --remote local[4]`` starts a
    local Connect server with Delta in a process of its own (a Connect client cannot share this test process with
    the classic session), so no SparkContext, JVM or accumulator is on the driver's side; with the shared run's
    faults, its engines in a directory of their own."""
    import sys

    import yaml

    from batch_lines import build_e2e_input, build_hostile_input, build_shapes_input
    from spark_llm.batch import BatchObject, BatchResult
    from spark_llm.config import BatchConfig
    from spark_llm.context import RunPaths
    from spark_llm.engine_host import ENGINE_DIR_ENV
    from spark_llm.faults import FAULT_ENV

    root, tiny_model = ctx.out("connect"), ctx.tiny_model
    expected = {**build_e2e_input(root / "input"), **build_hostile_input(root / "input"),
                **build_shapes_input(root / "input")}
    settings = dict(input=str(root / "input"), output_dir=str(root / "out"), batch_id="b-e2e",
                    **engine_settings(tiny_model))
    config = root / "connect.yaml"
    config.write_text(yaml.safe_dump({**settings, "spark": {"spark.ui.enabled": "false",
                                                             "spark.sql.shuffle.partitions": "2"}}))
    marker, engines = root / "killed.marker", ctx.out("connect-engines")
    proc = ctx.run([sys.executable, "-m", "spark_llm.cli", "run", "--remote", "local[4]", "--config", config],
                   timeout=1800, cwd=root, env={FAULT_ENV: shared_faults(marker, ctx.out("connect-meeting")),
                                                ENGINE_DIR_ENV: str(engines)})
    assert proc.returncode == 0, proc.stderr[-6000:]
    paths = RunPaths.from_config(BatchConfig(**settings))
    batch = BatchObject.model_validate_json(Path(paths.batch_file).read_text())
    logs = [line.split(": ", 1)[1] for line in proc.stderr.splitlines() if " spark_llm." in line and ": " in line]
    return SharedRun(BatchResult(batch, paths), expected, root, logs, marker, engines)


@pytest.fixture(scope="session")
def connect_run(lane) -> SharedRun:
    return lane.result("connect")


@pytest.fixture
def receiver():
    """A webhook receiver on 127.0.0.1: records each request (headers, body) and answers with the statuses queued
    in ``answers`` (200 once they run out)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got: list[tuple[dict, bytes]] = []
    answers: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            got.append((dict(self.headers.items()), body))
            self.send_response(answers.pop(0) if answers else 200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}/hooks", "got": got, "answers": answers}
    server.shutdown()
    server.server_close()
