"""Config model: defaults, YAML, the design's environment names, flag precedence, clear errors; CLI without vLLM."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from spark_llm.flags import add_run_arguments, flag
from spark_llm.config import BatchConfig, ConfigError, config_view, spark_conf_from_yaml
from spark_llm.engine_host import EngineSpec


def test_defaults_and_served_name_from_model_dir():
    cfg = BatchConfig(model="/models/Llama-3-8B-Instruct/")
    assert cfg.served_model_name == "Llama-3-8B-Instruct"
    assert cfg.tensor_parallel_size == 1 and cfg.max_num_seqs is None and cfg.overwrite is False
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
    def key(**settings):
        return EngineSpec.from_config(BatchConfig(**settings)).key

    assert key(model="/m", input="a", output_dir="o1") == key(model="/m", input="b", output_dir="o2")
    assert key(model="/m") != key(model="/m", max_num_seqs=3)


def test_every_setting_has_a_flag_in_its_group():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    by_dest = {a.dest: a for a in parser._actions}
    assert set(BatchConfig.model_fields) <= set(by_dest)
    for name, info in BatchConfig.model_fields.items():
        assert flag(name) in by_dest[name].option_strings and by_dest[name].help == info.description
    titles = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert all(name in titles[BatchConfig.group_of(name)] for name in BatchConfig.model_fields)
    args = parser.parse_args(["--engine-kwargs", '{"swap_space": 2}', "--no-enforce-eager", "--batch-size", "7",
                              "--context-overflow", "truncate", "--default-top-p", "0.5"])
    assert (args.engine_kwargs, args.enforce_eager, args.max_num_seqs) == ({"swap_space": 2}, False, 7)
    assert (args.context_overflow, args.default_top_p, args.model) == ("truncate", 0.5, None)


def test_stage_contexts_and_the_engine_spec_are_views_of_the_config():
    from spark_llm.tokens import TokenContext
    from spark_llm.validate import ValidationContext

    cfg = BatchConfig(model="/m", max_model_len=64, max_n=3, default_top_p=0.5).resolved(max_model_len=999)
    assert cfg.max_model_len == 64 and cfg.tokenizer == "/m" and cfg.batch_id.startswith("batch_")
    assert config_view(TokenContext, cfg) == TokenContext(tokenizer="/m", max_model_len=64, context_overflow="error",
                                                          model="/m")
    v = config_view(ValidationContext, cfg)
    assert (v.max_n, v.default_top_p, v.served_model_name) == (3, 0.5, "m")
    spec = EngineSpec.from_config(cfg)
    assert set(type(spec.settings).model_fields) == set(BatchConfig.fields_of("engine"))
    assert spec.llm_kwargs()["max_model_len"] == 64


def test_schemas_match_the_rows_the_stages_build():
    from conftest import validation_context
    from spark_llm.schemas import (ERRORS_COLUMNS, OUTPUTS_COLUMNS, RESULT_FIELDS, TOKENIZED_SCHEMA,
                                   VALIDATED_SCHEMA)
    from spark_llm.validate import validate_line

    row = validate_line(b'{"custom_id": "a"}', "f", 1, validation_context())
    assert tuple(row) == tuple(VALIDATED_SCHEMA.fieldNames())
    assert TOKENIZED_SCHEMA.fieldNames()[:len(row)] == list(row)
    # every table column comes from a result column of the same name, or is one of the few derived ones
    assert set(OUTPUTS_COLUMNS) - set(RESULT_FIELDS) == {"batch_id", "created_at"}
    assert set(ERRORS_COLUMNS) - set(RESULT_FIELDS) == {"batch_id", "code", "message", "raw_line", "created_at"}


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


def test_the_console_drops_py4j_s_report_of_a_call_the_command_interrupted_and_nothing_else():
    """Ctrl-C or SIGTERM landing inside a call into the JVM: py4j's own handler logs it as an ERROR with a
    traceback, and another when the JVM's end of that call has closed before py4j's cleanup writes to it; the
    command cancels that way on purpose (and says so once), so its console leaves those records out. Through the
    connection class PySpark uses (py4j's ClientServer)."""
    code = ("import logging, os, signal, socket, threading\n"
            "from py4j.clientserver import JavaClient, JavaParameters, PythonParameters\n"
            "from py4j.java_gateway import GatewayProperty\n"
            "from spark_llm.flags import configure_logging\n"
            "configure_logging('INFO')\n"
            "jvm = socket.create_server(('127.0.0.1', 0))  # takes the call, never answers: it waits in py4j\n"
            "client = JavaClient(JavaParameters(port=jvm.getsockname()[1]), PythonParameters(),\n"
            "                    gateway_property=GatewayProperty(False, None))\n"
            "ends = []\n"
            "def take_the_call():\n"
            "    end, _ = jvm.accept()\n"
            "    ends.append(end)\n"
            "    end.recv(64)  # the command was sent: the main thread is inside py4j's call\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "def interrupt(signum, frame):\n"
            "    ends[0].close()  # the JVM's end closes as the interrupt lands\n"
            "    raise KeyboardInterrupt\n"
            "signal.signal(signal.SIGUSR1, interrupt)\n"
            "threading.Thread(target=take_the_call, daemon=True).start()\n"
            "try:\n"
            "    client.send_command('c\\n')\n"
            "except BaseException as exc:\n"
            "    print(type(exc).__name__)\n"
            "logging.getLogger('py4j').error('a real py4j error')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "KeyboardInterrupt", proc.stderr  # py4j's handler and its cleanup ran
    assert "KeyboardInterrupt while sending command" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "ERROR py4j: a real py4j error" in proc.stderr


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


def test_more_models_come_from_yaml_or_extra_model_flags_and_inherit_the_batch_settings(tmp_path):
    conf = tmp_path / "models.yaml"
    conf.write_text("model: /m/llama\nmax_model_len: 512\nkv_cache_memory_bytes: 1000000\ntool_call_parser: hermes\n"
                    "lora_modules: {fin: /m/fin-lora}\n"
                    "models:\n  - {name: e5, path: /m/e5, kind: embed, max_model_len: 128}\n")
    first, e5 = BatchConfig.load(conf, env={}).per_model()
    assert (first.model, first.served_model_name, first.models, first.lora_modules) == \
        ("/m/llama", "llama", [], {"fin": "/m/fin-lora"})
    assert (e5.model, e5.served_model_name, e5.runner, e5.max_model_len) == ("/m/e5", "e5", "pooling", 128)
    assert e5.kv_cache_memory_bytes == 1000000                         # inherited from the top level
    assert (e5.lora_modules, e5.tool_call_parser, e5.tokenizer) == ({}, None, None)  # the main model's own

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--model", "/m/llama", "--extra-model", "bge=/m/bge", "--extra-model",
                              '{"name": "qwen", "path": "/m/qwen", "kind": "generate", "dtype": "float16"}'])
    cfg = BatchConfig.load(None, env={}, **{k: getattr(args, k) for k in BatchConfig.model_fields})
    assert [(c.served_model_name, c.runner, c.dtype) for c in cfg.per_model()] == \
        [("llama", "auto", "auto"), ("bge", "auto", "auto"), ("qwen", "generate", "float16")]


@pytest.mark.parametrize("models, message", [
    ([{"name": "llama", "path": "/m/other"}], "'llama' are given to more than one"),
    ([{"name": "a", "path": "/a", "lora_modules": {"fin": "/x"}}, {"name": "fin", "path": "/b"}], "'fin'"),
    ([{"name": "a", "path": "/a", "max_num_seqs": 8, "output_dir": "/o"}], "output_dir, which are not engine"),
    ([{"name": "a", "path": "/a", "max_model_len": "long"}], "max_model_len"),
    ([{"name": "", "path": "/a"}], "must not be empty"),
])
def test_a_model_list_that_cannot_route_every_name_is_refused(models, message):
    with pytest.raises(ConfigError, match=message):
        BatchConfig.load(None, env={}, model="/m/llama", models=models).per_model()
