"""Job, engine and sampling configuration: one model shared by spark-submit, the CLI and notebooks.

Precedence, lowest first: field defaults < YAML file < environment variables (the original design's names,
``MODEL_PATH`` ...) < explicit overrides (CLI flags or keyword arguments).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: Names from the original design documents -> config fields. Accepted as environment variables and as YAML keys.
DESIGN_NAMES: dict[str, str] = {
    "MODEL_PATH": "model",
    "TENSOR_PARALLEL_SIZE": "tensor_parallel_size",
    "MAX_MODEL_LEN": "max_model_len",
    "BATCH_SIZE": "max_num_seqs",
    "STORAGE_INPUT_PATH": "input",
    "STORAGE_OUTPUT_PATH": "output_dir",
}

SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class ConfigError(ValueError):
    """Bad configuration: the job stops before doing any work, with this message."""


class BatchConfig(BaseModel):
    """Everything one batch run needs. Every field has a default; ``model``, ``input`` and ``output_dir`` must be set
    before :func:`spark_llm.run_batch` is called."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    # ---- input / output ---------------------------------------------------------------------------------------
    input: Optional[str] = Field(
        None, description="OpenAI batch JSONL input: a file, a directory or a glob on any Hadoop-compatible "
        "filesystem (file:/, hdfs://, s3a://, abfss://, dbfs:/ ...). Env: STORAGE_INPUT_PATH.")
    output_dir: Optional[str] = Field(
        None, description="Directory for the Delta tables, output.jsonl, errors.jsonl and batch.json. "
        "Must be empty or absent unless overwrite is set. Env: STORAGE_OUTPUT_PATH.")
    batch_id: Optional[str] = Field(
        None, description="Id stamped on every result row and on batch.json; generated (batch_<hex>) when unset. "
        "Reuse it to find a run's rows in shared tables.")
    overwrite: bool = Field(
        False, description="Replace the contents of a non-empty output_dir. Off by default so that finished "
        "results are never destroyed by a mistyped path.")
    outputs_table_path: Optional[str] = Field(
        None, description="Delta path of the outputs table; default <output_dir>/delta/outputs.")
    errors_table_path: Optional[str] = Field(
        None, description="Delta path of the errors table; default <output_dir>/delta/errors.")

    output_table_prefix: Optional[str] = Field(
        None, description="Write results as managed catalog tables <prefix>outputs and <prefix>errors (e.g. "
        "main.llm.batch_) instead of Delta paths under output_dir; many batches share them, keyed by batch_id.")
    resume: bool = Field(
        False, description="Continue batch_id where an earlier run stopped: requests already in the outputs or "
        "errors table are skipped, nothing is written twice. Needs batch_id.")
    retry_errors: bool = Field(
        False, description="With resume: run again the requests whose earlier error was transient (engine_error).")
    wave_partitions: Optional[int] = Field(
        None, ge=1, description="Inference partitions per Delta commit. A crash loses at most the wave in flight; "
        "smaller waves commit more often but leave GPUs idle at each wave's tail. Default: 2 x task slots.")

    progress_interval_seconds: float = Field(
        30.0, gt=0, description="Seconds between progress lines on the driver log during inference.")

    # ---- table input ------------------------------------------------------------------------------------------
    input_table: Optional[str] = Field(
        None, description="Catalog table to read requests from (Delta, Parquet or anything Spark reads) instead of "
        "input. A Delta table path can also be given as input.")
    id_column: Optional[str] = Field(
        None, description="Table input: column holding the request id (cast to string). Default custom_id; when "
        "the table has neither, the id is row-<sha256 of the row's JSON>[:16] (identical rows share an id).")
    body_column: str = Field("body", description="Table input, OpenAI shape: column with the request body (a JSON "
                             "string or a struct).")
    prompt_column: Optional[str] = Field(None, description="Table input, plain shape: column with the prompt text "
                                         "(sent as the user message, or as the completion prompt).")
    messages_column: Optional[str] = Field(None, description="Table input, plain shape: column with chat messages "
                                           "(a JSON string or an array of {role, content} structs).")
    system_prompt: Optional[str] = Field(None, description="Table input, plain shape: system message put before "
                                         "each prompt.")
    system_prompt_column: Optional[str] = Field(None, description="Table input, plain shape: column with a "
                                                "per-row system message (wins over system_prompt).")
    max_tokens_column: Optional[str] = Field(None, description="Table input, plain shape: per-row max_tokens.")
    temperature_column: Optional[str] = Field(None, description="Table input, plain shape: per-row temperature.")
    table_endpoint: Literal["/v1/chat/completions", "/v1/completions"] = Field(
        "/v1/chat/completions", description="Table input, plain shape: endpoint the rows are sent to.")

    # ---- model / engine ---------------------------------------------------------------------------------------
    model: Optional[str] = Field(
        None, description="Model directory (Hugging Face layout) readable at the same path on every executor, "
        "e.g. a shared volume or /dbfs path. Env: MODEL_PATH.")
    served_model_name: Optional[str] = Field(
        None, description="Name requests must give in body.model and the name written in responses; default is "
        "the model directory's base name.")
    tokenizer: Optional[str] = Field(None, description="Tokenizer directory; default is the model directory.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine spans. Set spark.task.resource.gpu.amount to the same number so one "
        "Spark task owns exactly the GPUs of one engine. Env: TENSOR_PARALLEL_SIZE.")
    max_model_len: Optional[int] = Field(
        None, ge=16, description="Context length (prompt + generated tokens) the engine reserves KV cache for. "
        "Lower it to fit more concurrent sequences in memory; requests that do not fit become "
        "context_length_exceeded errors. Default: the model's max_position_embeddings. Env: MAX_MODEL_LEN.")
    max_num_seqs: int = Field(
        256, ge=1, description="Engine batch size: sequences vLLM decodes concurrently. Higher saturates the GPU "
        "better but needs KV-cache memory for each; vLLM's continuous batching refills slots as sequences finish. "
        "Env: BATCH_SIZE.")
    dtype: str = Field("auto", description="Weight/activation dtype passed to vLLM (auto, bfloat16, float16, "
                       "float32). auto uses the model's own dtype.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of each GPU's memory vLLM may take for weights + KV cache. Lower it "
        "when other processes share the GPU.")
    kv_cache_memory_bytes: Optional[int] = Field(
        None, ge=1, description="Fixed KV-cache size in bytes (overrides gpu_memory_utilization's sizing); handy "
        "on CPU and for tests.")
    enforce_eager: bool = Field(
        False, description="Skip CUDA-graph capture / torch.compile. Faster engine start, slower decoding: use for "
        "tiny models, tests and CPU runs.")
    enable_prefix_caching: Optional[bool] = Field(
        None, description="vLLM automatic prefix caching (requests sharing a system prompt reuse its KV cache). "
        "None keeps vLLM's default (on).")
    seed: int = Field(0, description="Engine seed; with temperature 0 outputs are reproducible.")
    distributed_executor_backend: Optional[str] = Field(
        None, description="vLLM executor backend. None picks 'uni' (in-process, required inside Spark's forked "
        "Python workers) for one GPU and 'mp' for tensor parallel.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed verbatim to vllm.LLM (e.g. "
        "quantization, swap_space). Takes precedence over the fields above.")

    # ---- sampling defaults ------------------------------------------------------------------------------------
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens for requests that give none. It also sizes each request's estimated "
        "cost when balancing partitions, so keep it close to what you expect.")
    default_temperature: float = Field(1.0, ge=0, le=2, description="temperature for requests that give none "
                                       "(OpenAI's default is 1.0; 0 means greedy).")
    default_top_p: float = Field(1.0, gt=0, le=1, description="top_p for requests that give none.")

    # ---- validation limits ------------------------------------------------------------------------------------
    max_line_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Input lines longer than this become line_too_large errors without "
        "being parsed; bounds one worker's memory per line.")
    max_raw_line_chars: int = Field(
        2048, ge=0, description="Characters of the raw input line kept in an error row (the rest is cut and "
        "marked with …). Keeps the errors table small when huge lines fail.")
    max_requests: Optional[int] = Field(
        None, ge=1, description="Most non-blank input lines one batch may hold; a larger input stops the job before "
        "any inference. None: no limit.")
    max_stop_sequences: int = Field(4, ge=1, description="Most stop strings a request may give (OpenAI allows 4).")
    max_n: int = Field(16, ge=1, description="Largest n (choices per request) accepted.")

    # ---- partitioning -----------------------------------------------------------------------------------------
    target_tokens_per_partition: int = Field(
        2_000_000, ge=1, description="Estimated tokens (prompt + max tokens) per inference partition. Smaller: "
        "finer retries and better balance, more engine calls; larger: fewer, longer tasks.")
    num_task_slots: Optional[int] = Field(
        None, ge=1, description="Inference tasks that run at once (GPU engines in the cluster). Default: derived "
        "from Spark (executors x GPUs per executor / GPUs per task, or the default parallelism on CPU).")
    context_overflow: Literal["error", "truncate"] = Field(
        "error", description="Prompt + max_tokens over max_model_len: 'error' rejects the request "
        "(context_length_exceeded); 'truncate' lowers its max_tokens to fit when the prompt alone fits.")

    @field_validator("served_model_name", "model", "input", "output_dir", "batch_id")
    @classmethod
    def _not_blank(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> "BatchConfig":
        if self.resume and not self.batch_id:
            raise ValueError("resume needs the batch_id of the run to continue (--batch-id)")
        if self.retry_errors and not self.resume:
            raise ValueError("retry_errors only applies with resume")
        if self.prompt_column and self.messages_column:
            raise ValueError("give prompt_column or messages_column, not both")
        return self

    @model_validator(mode="after")
    def _fill_names(self) -> "BatchConfig":
        if self.model and not self.served_model_name:
            object.__setattr__(self, "served_model_name", Path(self.model.rstrip("/")).name)
        return self

    # ---- derived values ---------------------------------------------------------------------------------------
    def resolved_batch_id(self) -> str:
        if not self.batch_id:
            object.__setattr__(self, "batch_id", "batch_" + uuid.uuid4().hex)
        return self.batch_id  # type: ignore[return-value]

    def table_paths(self) -> tuple[str, str]:
        """Where the outputs and errors tables live: catalog names (with output_table_prefix) or Delta paths."""
        if self.output_table_prefix:
            return f"{self.output_table_prefix}outputs", f"{self.output_table_prefix}errors"
        base = (self.output_dir or "").rstrip("/")
        return (self.outputs_table_path or f"{base}/delta/outputs", self.errors_table_path or f"{base}/delta/errors")

    def metrics_table(self) -> str:
        if self.output_table_prefix:
            return f"{self.output_table_prefix}metrics"
        return f"{(self.output_dir or '').rstrip('/')}/delta/metrics"

    def engine_key(self) -> str:
        """Id of the engine settings, made on the driver: workers reuse a cached engine while it matches."""
        fields = ("model", "tokenizer", "tensor_parallel_size", "max_model_len", "max_num_seqs", "dtype",
                  "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager", "enable_prefix_caching",
                  "seed", "distributed_executor_backend", "engine_kwargs")
        blob = json.dumps({f: getattr(self, f) for f in fields}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict safe to log: values under secret-looking keys are masked."""
        return _redact(self.model_dump())

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) in (None, "")]
        if missing:
            flags = ", ".join("--" + n.replace("_", "-") for n in missing)
            raise ConfigError(f"missing required setting(s) {', '.join(missing)}: pass {flags} or set them in "
                              f"the YAML config / environment ({_env_hint(missing)})")

    def require_ready(self) -> None:
        """What every run needs: a model, an output directory and an input (JSONL/Delta path or a table)."""
        self.require("model", "output_dir")
        if not (self.input or self.input_table):
            raise ConfigError("no input: set --input (JSONL files or a Delta table path) or --input-table")

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
             **overrides: Any) -> "BatchConfig":
        """Build a config from an optional YAML file, the design-name environment variables and overrides
        (``None`` overrides are ignored, so argparse namespaces can be passed through)."""
        data: dict[str, Any] = {}
        if path:
            data.update(_normalise_keys(_read_yaml(path), source=str(path)))
        env = os.environ if env is None else env
        data.update({field: env[name] for name, field in DESIGN_NAMES.items() if env.get(name)})
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None


_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials", "auth"}


def _redact(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, key) for v in value]
    if value is not None and _SECRET_WORDS & set(key.lower().replace("-", "_").split("_")):
        return "***"
    return value


def _env_hint(fields: list[str]) -> str:
    names = [n for n, f in DESIGN_NAMES.items() if f in fields]
    return ", ".join(names) if names else "see conf/local.yaml"


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def _normalise_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Accept the design's upper-case names and a nested ``spark:`` section (ignored here, read by the session)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("spark", "spark_conf"):
            continue
        field = DESIGN_NAMES.get(key, key)
        if field not in BatchConfig.model_fields:
            raise ConfigError(f"unknown setting {key!r} in {source}; known settings: "
                              f"{', '.join(sorted(BatchConfig.model_fields))}")
        out[field] = value
    return out


def spark_conf_from_yaml(path: str | os.PathLike | None) -> dict[str, str]:
    """The ``spark:`` section of a YAML config as Spark settings (used when spark_llm starts the session)."""
    if not path:
        return {}
    section = _read_yaml(path).get("spark") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"'spark' in {path} must be a mapping of Spark settings")
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in section.items()}


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(parts)
