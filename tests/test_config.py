"""Config model: defaults, YAML, the design's environment names, flag precedence, clear errors; CLI without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spark_llm.config import BatchConfig, ConfigError, spark_conf_from_yaml


def test_defaults_and_served_name_from_model_dir():
    cfg = BatchConfig(model="/models/Llama-3-8B-Instruct/")
    assert cfg.served_model_name == "Llama-3-8B-Instruct"
    assert cfg.tensor_parallel_size == 1 and cfg.max_num_seqs == 256 and cfg.overwrite is False
    assert all(f.description for f in BatchConfig.model_fields.values())


def test_yaml_env_and_overrides_precedence(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("MODEL_PATH: /from/yaml\nmax_num_seqs: 8\nBATCH_SIZE: 16\ndtype: float16\n"
                    "spark:\n  spark.sql.shuffle.partitions: 7\n  spark.python.worker.reuse: true\n")
    env = {"TENSOR_PARALLEL_SIZE": "2", "MAX_MODEL_LEN": "4096", "STORAGE_INPUT_PATH": "s3a://b/in.jsonl",
           "STORAGE_OUTPUT_PATH": "s3a://b/out", "MODEL_PATH": "/from/env"}
    cfg = BatchConfig.load(conf, env=env, dtype="bfloat16", input=None)
    assert cfg.model == "/from/env"                       # env beats YAML
    assert cfg.max_num_seqs == 16                         # BATCH_SIZE maps to max_num_seqs
    assert cfg.tensor_parallel_size == 2 and cfg.max_model_len == 4096
    assert cfg.input == "s3a://b/in.jsonl" and cfg.output_dir == "s3a://b/out"
    assert cfg.dtype == "bfloat16"                        # explicit override beats YAML; None overrides ignored
    assert spark_conf_from_yaml(conf) == {"spark.sql.shuffle.partitions": "7", "spark.python.worker.reuse": "true"}


def test_bad_settings_are_reported_clearly(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        BatchConfig.load(None, env={}, tensor_parallel_size=0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: /x\n")
    with pytest.raises(ConfigError, match="unknown setting 'modle'"):
        BatchConfig.load(bad, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        BatchConfig.load(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="--model.*MODEL_PATH"):
        BatchConfig.load(None, env={}).require("model")


def test_engine_key_changes_with_engine_settings_only():
    a = BatchConfig(model="/m", input="a", output_dir="o1")
    assert a.engine_key() == BatchConfig(model="/m", input="b", output_dir="o2").engine_key()
    assert a.engine_key() != BatchConfig(model="/m", max_num_seqs=3).engine_key()


def test_import_and_cli_help_do_not_load_vllm_or_torch():
    code = ("import sys, spark_llm, spark_llm.cli, spark_llm.pipeline\n"
            "from spark_llm.cli import main\n"
            "try:\n    main(['run', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "heavy = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--tensor-parallel-size" in proc.stdout and "--batch-size" in proc.stdout


def test_cli_reports_missing_settings_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "spark_llm.cli", "run", "--input", "x.jsonl"],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "missing required setting(s) output_dir, model" in proc.stderr or "missing required" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_redacted_settings_mask_secrets_only():
    cfg = BatchConfig(model="/m", tokenizer="/t", engine_kwargs={"hf_token": "hf_abc", "api-key": "k",
                                                                 "swap_space": 4})
    red = cfg.redacted()
    assert red["engine_kwargs"] == {"hf_token": "***", "api-key": "***", "swap_space": 4}
    assert red["tokenizer"] == "/t" and red["default_max_tokens"] == 256
    assert red["target_tokens_per_partition"] == 2_000_000


def test_require_ready_names_what_is_missing():
    with pytest.raises(ConfigError, match="no input: set --input"):
        BatchConfig(model="/m", output_dir="/out").require_ready()
    with pytest.raises(ConfigError, match="missing required setting.*output_dir"):
        BatchConfig(model="/m", input_table="db.requests").require_ready()
    BatchConfig(model="/m", output_dir="/out", input_table="db.requests").require_ready()
