"""A batch ended early: SIGTERM (or Ctrl-C) on ``spark-llm run`` ends it as cancelled with one line, what its waves
committed kept; ``finish_unanswered`` closes it with every other request as a batch_cancelled row (OpenAI's cancelled
batch); a later ``--resume`` runs those after all, every request still in exactly one row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import chat_line, engine_settings, write_jsonl

pytestmark = pytest.mark.engine

LINES = 120


def test_sigterm_cancels_the_run_and_resume_finishes_the_batch(spark, tiny_model, tmp_path):
    from spark_llm import BatchConfig, run_batch
    from spark_llm.faults import FAULT_ENV

    write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}", f"Count to {i}.", temperature=0, max_tokens=12)
                                        for i in range(LINES)])
    settings = dict(engine_settings(tiny_model), input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"),
                    batch_id="b-cancel", num_task_slots=1, target_tokens_per_partition=750, wave_partitions=1)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**settings, "spark": {"spark.ui.enabled": "false"}}))
    stderr = tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "spark_llm.cli", "run", "--config", str(config)],
                                stderr=err, stdout=subprocess.DEVNULL, env=env, cwd=tmp_path)
        deadline = time.time() + 300
        while "wave 1/" not in stderr.read_text(errors="replace") or "committed" not in stderr.read_text():
            assert proc.poll() is None and time.time() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.2)
        signalled = len(stderr.read_bytes())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    after = stderr.read_bytes()[signalled:].decode(errors="replace")
    said = [line for line in after.splitlines() if line.startswith("spark-llm:")]
    assert len(said) == 1 and "cancelled" in said[0] and "--resume" in said[0], after
    assert "Traceback" not in after and "\tat " not in after, after
    batch = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert batch["status"] == "cancelled" and batch["cancelled_at"]

    closed = run_batch(spark, BatchConfig(**settings, resume=True, finish_unanswered="batch_cancelled"))
    assert closed.status == "cancelled" and closed.batch.cancelled_at
    out, err = _lines(closed.output_file), _lines(closed.error_file)
    assert 0 < len(out) < LINES and len(out) + len(err) == LINES == closed.total
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert {line["custom_id"] for line in out + err} == {f"c{i}" for i in range(LINES)}

    finished = run_batch(spark, BatchConfig(**settings, resume=True))
    assert finished.status == "completed" and (finished.completed, finished.failed) == (LINES, 0)
    rows = spark.read.format("delta").load(finished.outputs_table).where("batch_id = 'b-cancel'")
    assert rows.count() == rows.select("custom_id").distinct().count() == LINES
    errors = spark.read.format("delta").load(finished.errors_table).where("batch_id = 'b-cancel'")
    assert errors.count() == 0


def _lines(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]
