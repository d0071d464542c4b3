"""Job, engine and sampling configuration: one model shared by spark-submit, the CLI and notebooks.

Precedence, lowest first: field defaults < YAML file < environment variables (the original design's names,
``MODEL_PATH`` ...) < explicit overrides (CLI flags or keyword arguments).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engine_host.rates import parse_rates

#: Names from the original design documents -> config fields. Accepted as environment variables and as YAML keys.
DESIGN_NAMES: dict[str, str] = {
    "MODEL_PATH": "model",
    "TENSOR_PARALLEL_SIZE": "tensor_parallel_size",
    "MAX_MODEL_LEN": "max_model_len",
    "BATCH_SIZE": "max_num_seqs",
    "STORAGE_INPUT_PATH": "input",
    "STORAGE_OUTPUT_PATH": "output_dir",
}

#: Setting groups, in the order ``spark-llm run --help`` shows them. Every field names its group once, below.
GROUPS = ("input", "table input", "output", "model and engine", "sampling defaults", "moderations", "limits",
          "images and audio", "partitioning and waves", "cluster")


#: Batch priorities, most urgent first (``priority``; the batch service's ``metadata.priority``).
PRIORITIES = ("high", "normal", "low")


def group(name: str) -> dict[str, Any]:
    """Field metadata: the setting's help group."""
    assert name in GROUPS, name
    return {"group": name}


def engine(name: str, vllm: Optional[str] = "") -> dict[str, Any]:
    """Field metadata of an engine setting: changing it means building a new engine. It is passed to ``vllm.LLM``
    under its own name, or under ``vllm`` (``a.b``: key ``b`` of the dict argument ``a``); ``vllm=None``: the engine
    process uses it itself (see :class:`~spark_llm.engine_host.EngineSpec`)."""
    return {**group(name), "engine": True, "vllm": vllm}


_T = TypeVar("_T")


class ConfigError(ValueError):
    """Bad configuration: the job stops before doing any work, with this message."""


#: OpenAI's moderation categories, in the order of its ``Moderation`` type: what ``moderation_labels`` maps a
#: classifier's labels to.
MODERATION_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
                         "illicit/violent", "self-harm", "self-harm/instructions", "self-harm/intent", "sexual",
                         "sexual/minors", "violence", "violence/graphic")
#: Settings that belong to one model rather than to the batch: an extra model (:class:`ModelEntry`) starts from
#: their defaults instead of inheriting the top level's (adapters, parsers and context length are the main model's).
MODEL_OWN_SETTINGS = ("tokenizer", "max_model_len", "runner", "lora_modules", "reasoning_parser", "tool_call_parser")

#: ModelEntry.kind -> the runner it means.
KIND_RUNNER = {"auto": "auto", "generate": "generate", "embed": "pooling", "classify": "pooling"}


class ModelEntry(BaseModel):
    """One more model of a batch (``models:`` in YAML, ``--extra-model NAME=PATH`` on the command line): requests
    whose ``body.model`` is ``name`` run on it. Any other key is an engine setting of this model that differs from
    the top level (e.g. ``max_model_len``, ``tensor_parallel_size``, ``kv_cache_memory_bytes``, ``lora_modules``)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    name: str = Field(description="The model's name in body.model and in its responses.")
    path: str = Field(description="Model directory, filesystem URI or Hugging Face repo id, as --model.")
    kind: Literal["auto", "generate", "embed", "classify"] = Field(
        "auto", description="generate (chat, completions, responses; a Whisper model: transcriptions, "
        "translations), embed (embeddings) or classify (moderations, classify: a sequence classifier), the last two "
        "on vLLM's pooling runner; auto: read from the model directory, as runner auto.")

    @field_validator("name", "path")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


class BatchConfig(BaseModel):
    """Everything one batch run needs. Every field has a default; ``model``, ``input`` and ``output_dir`` must be set
    before :func:`spark_llm.run_batch` is called.

    Long, and flat on purpose: each field is at once a flag (``--max-model-len``, its help this description), a YAML
    key and a keyword of the notebook call, so the settings are grouped by concern in sections (and in ``--help``,
    by each field's ``group``), not nested in models of their own."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    # ---- input / output ---------------------------------------------------------------------------------------
    input: Optional[str] = Field(
        None, description="OpenAI batch JSONL input: a file, a directory or a glob on any Hadoop-compatible "
        "filesystem (file:/, hdfs://, s3a://, abfss://, dbfs:/ ...). Env: STORAGE_INPUT_PATH.",
        json_schema_extra=group("input"))
    output_dir: Optional[str] = Field(
        None, description="Directory for the Delta tables, output.jsonl, errors.jsonl and batch.json. "
        "Must be empty or absent unless overwrite is set. Env: STORAGE_OUTPUT_PATH.",
        json_schema_extra=group("output"))
    batch_id: Optional[str] = Field(
        None, description="Id stamped on every result row and on batch.json; generated (batch_<hex>) when unset. "
        "Reuse it to find a run's rows in shared tables.",
        json_schema_extra=group("output"))
    overwrite: bool = Field(
        False, description="Replace the contents of a non-empty output_dir. Off by default so that finished "
        "results are never destroyed by a mistyped path.",
        json_schema_extra=group("output"))
    tables_dir: Optional[str] = Field(
        None, description="Directory of the Delta tables (outputs, errors, metrics, embeddings), partitioned by "
        "batch_id so that many batches can share them; default <output_dir>/delta. outputs_table_path and "
        "errors_table_path win over it.",
        json_schema_extra=group("output"))
    outputs_table_path: Optional[str] = Field(
        None, description="Delta path of the outputs table; default <output_dir>/delta/outputs.",
        json_schema_extra=group("output"))
    errors_table_path: Optional[str] = Field(
        None, description="Delta path of the errors table; default <output_dir>/delta/errors.",
        json_schema_extra=group("output"))

    output_table_prefix: Optional[str] = Field(
        None, description="Write results as managed catalog tables <prefix>outputs and <prefix>errors (e.g. "
        "main.llm.batch_) instead of Delta paths under output_dir; many batches share them, keyed by batch_id.",
        json_schema_extra=group("output"))
    resume: bool = Field(
        False, description="Continue batch_id where an earlier run stopped: requests already in the outputs or "
        "errors table are skipped, nothing is written twice. Needs batch_id.",
        json_schema_extra=group("output"))
    finish_unanswered: Optional[Literal["batch_cancelled", "batch_expired"]] = Field(
        None, description="With resume: end the batch without running what is left. Every request not answered yet "
        "becomes an error row with this code and the batch is cancelled (or expired), as OpenAI lists the requests "
        "of a batch it ended early; a later --resume without it runs them after all.",
        json_schema_extra=group("output"))
    priority: Literal["high", "normal", "low"] = Field(
        "normal", description="The batch's turn on engines it shares with other batches of one application (the "
        "batch service runs several on one session): a high-priority batch's inference tasks take the next free "
        "task slot, and its requests the next free places in each engine's batch.",
        json_schema_extra=group("partitioning and waves"))
    retry_errors: bool = Field(
        False, description="With resume: run again the requests whose earlier error was transient (engine_error).",
        json_schema_extra=group("output"))
    wave_partitions: Optional[int] = Field(
        None, ge=1, description="Inference partitions per Delta commit. A crash loses at most the waves not yet "
        "committed; smaller waves commit more often, at a Delta commit each (the engines do not wait for them: waves "
        "overlap). Default: 2 x the inference tasks that run at once (engines x tasks_per_engine).",
        json_schema_extra=group("partitioning and waves"))

    progress_interval_seconds: float = Field(
        30.0, gt=0, description="Seconds between progress lines on the driver log during inference.",
        json_schema_extra=group("output"))

    # ---- table input ------------------------------------------------------------------------------------------
    input_table: Optional[str] = Field(
        None, description="Catalog table to read requests from (Delta, Parquet or anything Spark reads) instead of "
        "input. A Delta table path can also be given as input.",
        json_schema_extra=group("table input"))
    id_column: Optional[str] = Field(
        None, description="Table input: column holding the request id (cast to string). Default custom_id; when "
        "the table has neither, the id is row-<sha256 of the row's JSON>[:16] (identical rows share an id).",
        json_schema_extra=group("table input"))
    body_column: str = Field("body", description="Table input, OpenAI shape: column with the request body (a JSON "
                             "string or a struct).",
        json_schema_extra=group("table input"))
    prompt_column: Optional[str] = Field(None, description="Table input, plain shape: column with the prompt text "
                                         "(sent as the user message, or as the completion prompt).",
        json_schema_extra=group("table input"))
    messages_column: Optional[str] = Field(None, description="Table input, plain shape: column with chat messages "
                                           "(a JSON string or an array of {role, content} structs).",
        json_schema_extra=group("table input"))
    system_prompt: Optional[str] = Field(None, description="Table input, plain shape: system message put before "
                                         "each prompt.",
        json_schema_extra=group("table input"))
    system_prompt_column: Optional[str] = Field(None, description="Table input, plain shape: column with a "
                                                "per-row system message (wins over system_prompt).",
        json_schema_extra=group("table input"))
    max_tokens_column: Optional[str] = Field(None, description="Table input, plain shape: per-row max_tokens.",
        json_schema_extra=group("table input"))
    temperature_column: Optional[str] = Field(None, description="Table input, plain shape: per-row temperature.",
        json_schema_extra=group("table input"))
    table_endpoint: Literal["/v1/chat/completions", "/v1/completions"] = Field(
        "/v1/chat/completions", description="Table input, plain shape: endpoint the rows are sent to.",
        json_schema_extra=group("table input"))

    # ---- model / engine ---------------------------------------------------------------------------------------
    model: Optional[str] = Field(
        None, description="Model directory (Hugging Face layout) readable at the same path on every executor, "
        "e.g. a shared volume or /dbfs path. Env: MODEL_PATH.",
        json_schema_extra=engine("model and engine"))
    served_model_name: Optional[str] = Field(
        None, description="Name requests must give in body.model and the name written in responses; default is "
        "the model directory's base name.",
        json_schema_extra=group("model and engine"))
    tokenizer: Optional[str] = Field(None, description="Tokenizer directory; default is the model directory.",
        json_schema_extra=engine("model and engine"))
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine spans. Set spark.task.resource.gpu.amount to the same number so one "
        "Spark task owns exactly the GPUs of one engine. Env: TENSOR_PARALLEL_SIZE.",
        json_schema_extra=engine("model and engine"))
    max_model_len: Optional[int] = Field(
        None, ge=16, description="Context length (prompt + generated tokens) the engine reserves KV cache for. "
        "Lower it to fit more concurrent sequences in memory; requests that do not fit become "
        "context_length_exceeded errors. Default: the model's max_position_embeddings. Env: MAX_MODEL_LEN.",
        json_schema_extra=engine("model and engine"))
    max_num_seqs: Optional[int] = Field(
        None, ge=1, description="Engine batch size: sequences vLLM decodes concurrently. Higher saturates the GPU "
        "better but needs KV-cache memory for each; vLLM's continuous batching refills slots as sequences finish. "
        "Default: vLLM's offline default for the GPU (1024 on H100/H200 and larger, 256 on others). Env: BATCH_SIZE.",
        json_schema_extra=engine("model and engine"))
    max_num_batched_tokens: Optional[int] = Field(
        None, ge=1, description="Tokens the engine processes in one step (prefill chunks and decodes together). "
        "Default: vLLM's offline default for the GPU (16384 on H100/H200 and larger, 8192 on others).",
        json_schema_extra=engine("model and engine"))
    dtype: str = Field("auto", description="Weight/activation dtype passed to vLLM (auto, bfloat16, float16, "
                       "float32). auto uses the model's own dtype.",
        json_schema_extra=engine("model and engine"))
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of each GPU's memory vLLM may take for weights + KV cache. Lower it "
        "when other processes share the GPU.",
        json_schema_extra=engine("model and engine"))
    kv_cache_memory_bytes: Optional[int] = Field(
        None, ge=1, description="Fixed KV-cache size in bytes (overrides gpu_memory_utilization's sizing); handy "
        "on CPU and for tests.",
        json_schema_extra=engine("model and engine"))
    enforce_eager: bool = Field(
        False, description="Skip CUDA-graph capture / torch.compile. Faster engine start, slower decoding: use for "
        "tiny models, tests and CPU runs.",
        json_schema_extra=engine("model and engine"))
    enable_prefix_caching: Optional[bool] = Field(
        None, description="vLLM automatic prefix caching (requests sharing a system prompt reuse its KV cache). "
        "None keeps vLLM's default (on).",
        json_schema_extra=engine("model and engine"))
    seed: int = Field(0, description="The batch's seed: with sampling_seeds 'request', a sampled request without "
        "a seed of its own draws from a seed made of this one and its custom_id; also vLLM's engine seed.",
        json_schema_extra=engine("model and engine"))
    sampling_seeds: Literal["request", "engine"] = Field(
        "request", description="Where a sampled request without a seed of its own gets its random numbers. "
        "'request': a seed of its own made of the batch's seed and its custom_id, so its answer is the same however "
        "the batch is partitioned, on however many GPUs, and after --resume. 'engine': the stream of its engine, "
        "seeded apart for each engine (answers independent, but not reproducible); on vLLM's V1 model runner it "
        "skips a per-request step of the sampler (see docs/request-shapes.md).",
        json_schema_extra=engine("model and engine", vllm=None))
    distributed_executor_backend: Optional[str] = Field(
        None, description="vLLM executor backend. None picks 'uni' (in-process, required inside Spark's forked "
        "Python workers) for one GPU and 'mp' for tensor parallel.",
        json_schema_extra=engine("model and engine"))
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served beside the base model, name -> directory (CLI: "
        "--lora-modules NAME=PATH, repeatable, as vllm serve). A request whose body.model is an adapter's name runs "
        "the base model with that adapter, and its response names the adapter. Requests of one adapter are planned "
        "together, so an engine switches adapters seldom. A missing adapter directory, or one whose rank is over "
        "max_lora_rank, stops the batch before any work.",
        json_schema_extra=engine("model and engine", vllm=None))
    max_loras: int = Field(
        4, ge=1, description="Adapters an engine keeps loaded at once (vLLM's max_loras); more cost GPU memory.",
        json_schema_extra=engine("model and engine"))
    max_lora_rank: int = Field(
        16, ge=1, description="Largest adapter rank the engine reserves room for (vLLM's max_lora_rank).",
        json_schema_extra=engine("model and engine"))
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto", description="What the model does: generate (chat, completions, responses) or pooling (embeddings; "
        "vLLM's pooling runner, which also turns a generative architecture into an embedding model). auto: pooling "
        "for sentence-transformers directories and encoder architectures (e.g. BertModel), else generate. Lines for "
        "endpoints the model does not serve become unsupported_endpoint rows.",
        json_schema_extra=engine("model and engine"))
    reasoning_parser: Optional[str] = Field(
        None, description="vLLM reasoning parser of the model (e.g. deepseek_r1, qwen3, granite): chat messages get "
        "the thinking as `reasoning` (Responses: a reasoning item), `text` and structured outputs are the answer "
        "after it, and usage counts reasoning_tokens. None: the answer is the whole generated text.",
        json_schema_extra=engine("model and engine"))
    tool_call_parser: Optional[str] = Field(
        None, description="vLLM tool-call parser of the model (e.g. hermes, llama3_json, mistral), needed for "
        "tool_choice auto (the default when a request gives tools): it finds the calls in the generated text. "
        "tool_choice required or a named function needs none: the output is constrained to the tools' schemas.",
        json_schema_extra=engine("model and engine", vllm=None))
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"] = Field(
        "xgrammar", description="vLLM structured-output backend for response_format / text.format / forced tool "
        "calls. Schemas it cannot compile are invalid_request error rows found before any engine time (checked "
        "for xgrammar). auto lets vLLM fall back per request.",
        json_schema_extra=engine("model and engine", vllm="structured_outputs_config.backend"))
    compact_json: bool = Field(
        True, description="Structured outputs without whitespace between JSON tokens (vLLM's "
        "disable_any_whitespace): the same answer in fewer tokens, so it fits max_tokens and costs less. Needs "
        "structured_outputs_backend xgrammar or guidance. Off: the model may indent its JSON.",
        json_schema_extra=engine("model and engine", vllm="structured_outputs_config.disable_any_whitespace"))
    engine_idle_timeout_seconds: float = Field(
        600.0, ge=0, description="An engine process (one per GPU or tensor-parallel group of an executor, kept "
        "between tasks and batches) stops after this long without requests, freeing its GPUs; the next batch loads "
        "it again. 0 keeps it for the executor's whole life.",
        json_schema_extra=group("model and engine"))
    engine_call_timeout_seconds: float = Field(
        600.0, gt=0, description="Seconds a task waits for any word from its engine during a call (a stepping engine "
        "sends one every few seconds; an embedding engine answers whole calls): after that the engine counts as "
        "hung, is stopped and rebuilt, and the requests it held are retried as after an engine death.",
        json_schema_extra=group("model and engine"))
    engine_start_timeout_seconds: float = Field(
        1800.0, gt=0, description="Seconds an engine may take to load (vLLM's start: weights onto the GPU, compile, "
        "KV cache) before its start counts as failed. The copy of a model from a URI to the host's disk is not "
        "counted: a 70B model's copy alone takes 15-25 minutes at 100-150 MB/s.",
        json_schema_extra=group("model and engine"))
    engine_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="vLLM's log level in the engine processes (VLLM_LOGGING_LEVEL), whose logs go to "
        "<engine dir>/<slot>.log, not to the executor logs. INFO shows vLLM's configuration dumps and kernel "
        "choices.",
        json_schema_extra=group("model and engine"))
    engine_standin: Optional[str] = Field(
        None, description="Answer every request with the engine stand-in instead of vLLM, for measuring the job's "
        "own costs at GPU speed: deterministic answers of max_tokens tokens after the time a rate model gives, "
        "marked as simulated in the outputs' notes and the report. A profile (h200-8b, h100-8b, l4-8b, free), "
        "optionally with changed rates: 'h200-8b,start_seconds=0,max_num_seqs=256' (fields "
        "prefill_tokens_per_second, decode_tokens_per_second, max_num_seqs, start_seconds), and answer lengths "
        "drawn per request below max_tokens: 'answers=64' (0.5 to 1.5 times 64) or 'answers=64/0.05x10' (a "
        "twentieth of them ten times as long). See spark_llm/engine_host/standin.py.",
        json_schema_extra=engine("model and engine", vllm=None))
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed verbatim to vllm.LLM (e.g. "
        "quantization, swap_space). Takes precedence over the fields above.",
        json_schema_extra=engine("model and engine"))
    models: list[ModelEntry] = Field(
        default_factory=list, description="More models in the same batch, each served under its name: requests "
        "are routed by body.model. CLI: --extra-model NAME=PATH (repeatable) or a JSON object {name, path, kind, "
        "<engine settings>}. Inference runs model by model (every partition of one, then the next), so each engine "
        "slot switches models once per model; a switch costs one engine load. Settings not given for a model are "
        "the top level's, except its own tokenizer, max_model_len, runner, lora_modules and parsers.",
        json_schema_extra={**group("model and engine"), "flag": "--extra-model"})

    # ---- sampling defaults ------------------------------------------------------------------------------------
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens for requests that give none. It also sizes each request's estimated "
        "cost when balancing partitions, so keep it close to what you expect.",
        json_schema_extra=group("sampling defaults"))
    default_temperature: float = Field(1.0, ge=0, le=2, description="temperature for requests that give none "
                                       "(OpenAI's default is 1.0; 0 means greedy).",
        json_schema_extra=group("sampling defaults"))
    default_top_p: float = Field(1.0, gt=0, le=1, description="top_p for requests that give none.",
        json_schema_extra=group("sampling defaults"))

    # ---- moderations ------------------------------------------------------------------------------------------
    moderation_labels: dict[str, str] = Field(
        default_factory=dict, description="How the classifier's labels (its config's id2label) map to OpenAI's "
        "moderation categories (harassment, hate/threatening, self-harm, violence/graphic ...): label -> category, "
        "or label -> \"\" to leave a label out. A label not given maps to the category of its own name (case, "
        "'_' for '/' and '-' aside: HATE_THREATENING is hate/threatening); several labels of one category count "
        "by the highest score. A /v1/moderations line on a model none of whose labels maps is an "
        "unsupported_endpoint row.",
        json_schema_extra=group("moderations"))
    moderation_threshold: float = Field(
        0.5, ge=0, le=1, description="A category is flagged (categories.X true, the result flagged) when its score "
        "is at least this.",
        json_schema_extra=group("moderations"))

    # ---- validation limits ------------------------------------------------------------------------------------
    max_line_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Input lines longer than this become line_too_large errors without "
        "being parsed; bounds one worker's memory per line.",
        json_schema_extra=group("limits"))
    max_raw_line_chars: int = Field(
        2048, ge=0, description="Characters of the raw input line kept in an error row (the rest is cut and "
        "marked with …). Keeps the errors table small when huge lines fail.",
        json_schema_extra=group("limits"))
    allowed_media_paths: Optional[str] = Field(
        None, description="Comma-separated directories or storage URIs (s3a://bucket/images/, /Volumes/...) that "
        "image paths in requests may point into; others are invalid_image_url rows. Default: the directory of "
        "the input file.", json_schema_extra=group("images and audio"))
    allowed_media_domains: Optional[str] = Field(
        None, description="Comma-separated hosts (and their subdomains) that http(s) image URLs may be fetched "
        "from, as vLLM's setting of that name. Default none: a batch job does not fetch the URLs a file names "
        "from inside the cluster unless told to.", json_schema_extra=group("images and audio"))
    media_files: dict[str, str] = Field(
        default_factory=dict, description="Uploaded files that requests may name by id (images by Responses' "
        "input_image.file_id, audio by a transcription's file): file id -> where it is stored (the batch service "
        "gives a batch its key's files of purpose vision and user_data).",
        json_schema_extra=group("images and audio"))
    max_image_bytes: int = Field(
        20_000_000, ge=1, description="Largest image a request may send, in bytes (encoded); larger ones are "
        "image_too_large rows.", json_schema_extra=group("images and audio"))
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="Largest image in pixels (width x height); larger ones are image_too_large "
        "rows (a decompression bomb is refused before it is decoded).", json_schema_extra=group("images and audio"))
    media_fetch_timeout_seconds: float = Field(
        20.0, gt=0, description="Seconds an http(s) image or audio fetch may take (allowed domains only).",
        json_schema_extra=group("images and audio"))
    max_audio_bytes: int = Field(
        25_000_000, ge=1, description="Largest audio file a transcription or translation may send, in bytes (OpenAI's "
        "limit); larger ones are audio_too_large rows, as are files longer than the model hears at once (Whisper: "
        "30 s). Audio files come from where images may (allowed_media_paths, allowed_media_domains, data: URLs).",
        json_schema_extra=group("images and audio"))
    max_requests: Optional[int] = Field(
        None, ge=1, description="Most non-blank input lines one batch may hold; a larger input stops the job before "
        "any inference. None: no limit.",
        json_schema_extra=group("limits"))
    max_stop_sequences: int = Field(4, ge=1, description="Most stop strings a request may give (OpenAI allows 4).",
        json_schema_extra=group("limits"))
    max_n: int = Field(16, ge=1, description="Largest n (choices per request) accepted.",
        json_schema_extra=group("limits"))

    # ---- partitioning -----------------------------------------------------------------------------------------
    target_tokens_per_partition: int = Field(
        2_000_000, ge=1, description="Estimated tokens (prompt + max tokens) per inference partition. Smaller: "
        "finer retries and better balance, more engine calls; larger: fewer, longer tasks.",
        json_schema_extra=group("partitioning and waves"))
    num_task_slots: Optional[int] = Field(
        None, ge=1, description="Engines that run at once (GPU engines in the cluster; on a local master, the engines "
        "that share its cores: 1 gives one engine all of them). Default: derived from Spark (executors x GPUs per "
        "executor / tensor_parallel_size, or the default parallelism on CPU).",
        json_schema_extra=group("partitioning and waves"))
    tasks_per_engine: int = Field(
        2, ge=1, le=8, description="Inference tasks that feed one engine at once. With 2, the next partition's "
        "requests are already in the engine while the last answers of the one before decode at a shrinking batch, "
        "and while a task starts, reads its rows or writes its results, so the engine never waits between "
        "partitions; each task holds its partition's rows in its Python worker. On GPUs that many tasks share "
        "one GPU (the inference stage asks for 1/N of a GPU per task, as far as the executor's cores allow; a "
        "tensor-parallel group is fed by one task); on a local master, as many as its task threads allow "
        "(local[4] with 2 engines: 2 each). 1: one task per engine, the engine idle between its tasks.",
        json_schema_extra=group("partitioning and waves"))
    gpus_per_executor: Optional[int] = Field(
        None, ge=1, description="With dynamic allocation (spark.dynamicAllocation.enabled=true): the GPUs of each "
        "executor the inference stage asks Spark for (a stage-level resource profile with executor resources), so "
        "that Spark adds GPU executors as inference starts and removes them when idle, while reading and "
        "validation run on executors without GPUs; leave spark.executor.resource.gpu.amount unset. The batch's "
        "engines: spark.dynamicAllocation.maxExecutors x this / tensor_parallel_size.",
        json_schema_extra=group("cluster"))
    gpu_discovery_script: Optional[str] = Field(
        None, description="With gpus_per_executor: the script that lists an added executor's GPUs "
        "(spark.executor.resource.gpu.discoveryScript's role; YARN and Kubernetes need one, a standalone worker "
        "hands its own GPUs out). Kubernetes executors ask for nvidia.com GPUs.",
        json_schema_extra=group("cluster"))
    prefix_aware_partitions: bool = Field(
        True, description="Keep requests that share a leading prefix (system prompt, few-shot block, one document "
        "asked several questions) in one partition, adjacent, so the engine's prefix cache computes the prefix once; "
        "partitions stay token-balanced. Off: requests are spread by estimated tokens only.",
        json_schema_extra=group("partitioning and waves"))
    context_overflow: Literal["error", "truncate"] = Field(
        "error", description="Prompt + max_tokens over max_model_len: 'error' rejects the request "
        "(context_length_exceeded); 'truncate' lowers its max_tokens to fit when the prompt alone fits.",
        json_schema_extra=group("limits"))

    @field_validator("served_model_name", "model", "input", "output_dir", "batch_id")
    @classmethod
    def _not_blank(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("moderation_labels")
    @classmethod
    def _categories(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted({c for c in v.values() if c and c not in MODERATION_CATEGORIES})
        if unknown:
            raise ValueError(f"{', '.join(unknown)} is no OpenAI moderation category; the categories are "
                             f"{', '.join(MODERATION_CATEGORIES)} (\"\" leaves a label out)")
        return v

    @field_validator("engine_standin")
    @classmethod
    def _standin(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_rates(v)
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> "BatchConfig":
        if self.resume and not self.batch_id:
            raise ValueError("resume needs the batch_id of the run to continue (--batch-id)")
        if self.retry_errors and not self.resume:
            raise ValueError("retry_errors only applies with resume")
        if self.finish_unanswered and not self.resume:
            raise ValueError("finish_unanswered ends a batch an earlier run started: it needs resume (--resume)")
        if self.prompt_column and self.messages_column:
            raise ValueError("give prompt_column or messages_column, not both")
        if self.gpu_discovery_script and not self.gpus_per_executor:
            raise ValueError("gpu_discovery_script lists the GPUs of the executors gpus_per_executor asks for: set "
                             "gpus_per_executor too")
        self._check_models()
        if self.compact_json and self.structured_outputs_backend not in ("xgrammar", "guidance"):
            raise ValueError("compact_json needs structured_outputs_backend xgrammar or guidance (vLLM's other "
                             "backends cannot drop the whitespace); set --no-compact-json or pick one of them")
        return self

    def _check_models(self) -> None:
        engine_settings = set(self.fields_of("engine")) - {"model"}
        for entry in self.models:
            unknown = sorted(set(entry.model_extra or {}) - engine_settings)
            if unknown:
                raise ValueError(f"models: {entry.name!r} sets {', '.join(unknown)}, which are not engine settings; "
                                 f"a model may set {', '.join(sorted(engine_settings))}")
        names = [self.served_model_name or Path((self.model or "").rstrip("/")).name, *self.lora_modules]
        for entry in self.models:
            names += [entry.name, *(entry.model_extra or {}).get("lora_modules", {})]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if self.models and repeated:
            raise ValueError(f"models: the name(s) {', '.join(map(repr, repeated))} are given to more than one model "
                             f"or adapter; body.model must name exactly one")

    @model_validator(mode="after")
    def _fill_names(self) -> "BatchConfig":
        if self.model and not self.served_model_name:
            object.__setattr__(self, "served_model_name", Path(self.model.rstrip("/")).name)
        return self

    # ---- derived values ---------------------------------------------------------------------------------------
    @classmethod
    def fields_of(cls, key: str) -> tuple[str, ...]:
        """Names of the fields whose metadata has ``key`` set (e.g. ``engine``)."""
        return tuple(n for n, f in cls.model_fields.items() if (f.json_schema_extra or {}).get(key))

    @classmethod
    def vllm_argument(cls, name: str) -> Optional[str]:
        """Where an engine setting goes in ``vllm.LLM``'s arguments (see :func:`engine`); None: not passed."""
        target = cls.model_fields[name].json_schema_extra["vllm"]  # type: ignore[index]
        return name if target == "" else target

    @classmethod
    def group_of(cls, name: str) -> str:
        return cls.model_fields[name].json_schema_extra["group"]  # type: ignore[index]

    def resolved(self, max_model_len: int, runner: str = "generate") -> "BatchConfig":
        """A copy with everything a run derives filled in: a generated batch_id when none was given, the model's
        context length and runner (when auto), the tokenizer (default: the model directory), and local relative
        model, tokenizer and adapter paths made absolute (executors run in other directories). See engine.resolve."""
        model, tokenizer = _absolute(self.model), _absolute(self.tokenizer or self.model)
        return self.model_copy(update={"batch_id": self.batch_id or new_batch_id(),
                                       "max_model_len": self.max_model_len or max_model_len,
                                       "runner": runner if self.runner == "auto" else self.runner,
                                       "model": model, "tokenizer": tokenizer,
                                       "lora_modules": {k: _absolute(v) for k, v in self.lora_modules.items()}})

    def per_model(self) -> list["BatchConfig"]:
        """One config per model of the batch, the main model first: an extra model's config is this one with its
        name, path, kind and settings (see :data:`MODEL_OWN_SETTINGS`), and no ``models`` of its own."""
        own = {name: BatchConfig.model_fields[name].get_default(call_default_factory=True)
               for name in MODEL_OWN_SETTINGS}
        base = self.model_dump(exclude={"models"})
        configs = [self.model_copy(update={"models": []})]
        for entry in self.models:
            try:
                configs.append(BatchConfig(**{**base, **own, "model": entry.path, "served_model_name": entry.name,
                                              "runner": KIND_RUNNER[entry.kind], **(entry.model_extra or {})}))
            except ValidationError as exc:
                raise ConfigError(f"models: {entry.name!r}: {_describe(exc)}") from None
        return configs

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


def new_batch_id() -> str:
    """A batch id for a batch that was given none (``batch_<32 hex digits>``)."""
    return "batch_" + uuid.uuid4().hex


def _absolute(path: Optional[str]) -> Optional[str]:
    """A relative path that exists here, made absolute; anything else (URIs, absolute paths) as it is."""
    if path and not os.path.isabs(path) and "://" not in path and os.path.exists(path):
        return os.path.abspath(path)
    return path


def config_view(cls: type[_T], cfg: BatchConfig) -> _T:
    """The dataclass ``cls`` (a stage's small, picklable context) filled from the config fields of the same names
    (its fields marked ``derived`` in their metadata keep their defaults)."""
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                  if not f.metadata.get("derived")})


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
