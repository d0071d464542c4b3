"""Where the model comes from: a local directory, a Hadoop-filesystem URI, or a Hugging Face repo id.

``--model`` (and ``--tokenizer``) may name

- a **local directory** every executor can read (a shared mount, ``/Volumes/...``, ``/dbfs/...``): used as it is;
- a **URI** (``s3a://``, ``s3://``, ``abfss://``, ``gs://``, ``hdfs://``, ``dbfs:/``, ``file:/``): copied once per host
  to local disk, opened with pyarrow's filesystems (:func:`~spark_llm.filesystems.python_filesystem`; S3 and GCS take
  their credentials from the environment or the instance profile, not from Hadoop's settings);
- a **Hugging Face repo id** (``org/name``): downloaded once per host, when the hub is reachable; when it is not, one
  clear error says what to set instead.

:func:`local_copy` makes the copy in the host's model cache (``SPARK_LLM_MODEL_CACHE``, default
``<tmp>/spark_llm-models-<uid>``) under a file lock, so that the tasks and engine processes of one host copy once,
into a temporary directory renamed into place when complete: a half-copied model is never used. The driver and the
token-counting tasks need only the small files (config, tokenizer, chat template), so they ask for a copy without the
weights; the engine process asks for the whole model.

What the model directory says (its context length, whether it generates or embeds, its adapters' ranks) fills in
the settings a run does not give (:func:`resolve`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from .config import BatchConfig, ConfigError
from .engine_host.protocol import EngineTask
from .host import locked

log = logging.getLogger(__name__)

MODEL_CACHE_ENV = "SPARK_LLM_MODEL_CACHE"
URI_PREFIXES = ("s3a://", "s3://", "s3n://", "abfss://", "abfs://", "gs://", "gcs://", "hdfs://", "viewfs://",
                "dbfs:/", "file:")
#: Files that hold weights; a copy "without the weights" leaves these out.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx", ".pdparams")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelSourceError(ConfigError):
    """The model cannot be fetched from where ``--model`` says it is."""


def source_kind(model: str) -> str:
    """``local``, ``uri`` or ``hub``."""
    if model.startswith(URI_PREFIXES):
        return "uri"
    if not os.path.exists(model) and _REPO_ID.fullmatch(model):
        return "hub"
    return "local"


def cache_dir() -> Path:
    path = Path(os.environ.get(MODEL_CACHE_ENV) or Path(tempfile.gettempdir()) / f"spark_llm-models-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def local_copy(model: str, weights: bool = True) -> str:
    """A local directory holding ``model`` (all of it, or without the weight files): the directory itself when it
    is local, else this host's cached copy, made now if needed (once per host, under a lock)."""
    kind = source_kind(model)
    if kind == "local":
        return model
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/"))[-80:] + "-" + hashlib.sha1(model.encode()).hexdigest()[:10]
    full = cache_dir() / name
    if full.is_dir():
        return str(full)
    target = full if weights else cache_dir() / f"{name}-meta"
    if target.is_dir():
        return str(target)
    with locked(cache_dir() / f"{target.name}.lock"):
        if target.is_dir():  # another task of this host made it while we waited
            return str(target)
        for stale in cache_dir().glob(f"{target.name}.partial-*"):  # a copier that died half way
            shutil.rmtree(stale, ignore_errors=True)
        partial = cache_dir() / f"{target.name}.partial-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        try:
            (_copy_uri if kind == "uri" else _download_hub)(model, partial, weights)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.replace(partial, target)
        log.info("model %s copied to %s%s", model, target, "" if weights else " (without weights)")
    return str(target)


def _copy_uri(uri: str, dest: Path, weights: bool) -> None:
    from pyarrow import fs

    from .filesystems import python_filesystem

    try:
        filesystem, root = python_filesystem(uri)
        files = [i for i in filesystem.get_file_info(fs.FileSelector(root, recursive=True))
                 if i.type == fs.FileType.File]
    except Exception as exc:
        raise ModelSourceError(f"cannot list the model at {uri} from this host ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0]}); give --model a directory every executor can read, or "
                               f"a URI with credentials in the environment") from None
    if not files:
        raise ModelSourceError(f"no model files at {uri}: set --model to the model's directory")
    files = [i for i in files if weights or not i.path.endswith(WEIGHT_SUFFIXES)]
    check_free_space(sum(i.size or 0 for i in files), dest, uri)
    for info in files:
        out = dest / info.path[len(root.rstrip("/")) + 1:]
        out.parent.mkdir(parents=True, exist_ok=True)
        with filesystem.open_input_stream(info.path) as src, open(out, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)


#: Free space a model's copy leaves on the disk it goes to, beyond its own bytes (the engine's own caches share it).
SPARE_BYTES = 1 << 30


def check_free_space(need: int, dest: Path, source: str) -> None:
    """Refuse a copy of ``need`` bytes from ``source`` into ``dest`` that the disk cannot hold (with
    :data:`SPARE_BYTES` to spare) before a byte is written: a disk filled half way fails later and worse."""
    free = shutil.disk_usage(dest).free
    if need + SPARE_BYTES > free:
        raise ModelSourceError(
            f"not enough free space for the model at {source}: {need / 1e9:.1f} GB to copy, {free / 1e9:.1f} GB "
            f"free at {dest.parent}; set {MODEL_CACHE_ENV} to a directory on a larger disk")


_HUB_SCRIPT = """
import sys
from huggingface_hub import snapshot_download
repo, dest, weights = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
ignore = None if weights else ["*" + s for s in sys.argv[4].split(",")]
snapshot_download(repo, local_dir=dest, ignore_patterns=ignore)
"""


def local_adapters(lora_modules: dict[str, str]) -> dict[str, str]:
    """LoRA adapters (name -> directory) on local disk, as vLLM loads them: one given as a URI is this host's copy
    (:func:`local_copy`, all of it: an adapter is small), a local directory stays where it is."""
    return {name: local_copy(path) for name, path in lora_modules.items()}


def with_local_paths(llm_kwargs: dict) -> dict:
    """``vllm.LLM`` arguments with the model (all of it) and the tokenizer (its small files) on local disk."""
    out = dict(llm_kwargs)
    out["model"] = local_copy(out["model"])
    if out.get("tokenizer"):
        out["tokenizer"] = local_copy(out["tokenizer"], weights=False)
    return out


def _download_hub(repo: str, dest: Path, weights: bool) -> None:
    """``snapshot_download`` in a process of its own: the engine processes run with ``HF_HUB_OFFLINE=1`` (vLLM
    never reaches for the hub behind our back), and this process's settings stay as they are."""
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-c", _HUB_SCRIPT, repo, str(dest), "1" if weights else "0",
                           ",".join(WEIGHT_SUFFIXES)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        reason = next((x for x in reversed(lines) if re.match(r"[\w.]*(Error|Exception)\b", x)), lines[-1])[:300]
        raise ModelSourceError(
            f"model {repo!r} is neither a local directory nor downloadable from the Hugging Face hub on this host "
            f"({reason}). Download it once (huggingface-cli download {repo} --local-dir DIR) to storage every "
            f"executor reads and give --model that directory or its URI (s3a://, abfss://, gs://, dbfs:/, /Volumes)")


# ---- what a model directory says ----------------------------------------------------------------------------

def resolve(config: BatchConfig) -> BatchConfig:
    """``config`` with what the model directory says filled in (its context length and runner), for a run."""
    # the model's small files (config, tokenizer) on this host: the model itself where it is local, else a copy
    model = local_copy(config.model, weights=False) if config.model else ""
    return config.resolved(max_model_len=config.max_model_len or model_context_length(model),
                           runner=model_runner(model))


def resolve_models(cfg: BatchConfig) -> tuple[BatchConfig, ...]:
    """Every model of the resolved ``cfg`` as a resolved config of its own (the main model, ``cfg`` itself, first),
    sharing its batch_id."""
    resolved = [cfg]
    for extra in cfg.per_model()[1:]:
        try:
            resolved.append(resolve(extra))
        except ConfigError as exc:  # say which model, and where its settings go
            reason = str(exc).replace("--max-model-len / MAX_MODEL_LEN", "its max_model_len")
            raise ConfigError(f"models: {extra.served_model_name!r}: {reason}") from None
    return tuple(resolved)


#: Architecture name endings of generative models; anything else (BertModel, XLMRobertaModel ...) is an encoder.
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def model_runner(model: str) -> str:
    """``pooling`` for a sentence-transformers directory or an encoder architecture, else ``generate``."""
    path = Path(model or "")
    if (path / "modules.json").exists() or (path / "config_sentence_transformers.json").exists():
        return "pooling"
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "generate"
    return "pooling" if archs and not any(a.endswith(_GENERATIVE) for a in archs) else "generate"


#: The speech-to-text architectures whose prompts spark_llm writes (Whisper's special tokens, its encoder's audio).
SPEECH_TO_TEXT = ("WhisperForConditionalGeneration",)


def model_tasks(model: str, runner: str) -> tuple[EngineTask, ...]:
    """What the model directory's engines do on ``runner`` (resolved: generate or pooling), as vLLM decides it from
    the architecture: generation, or transcription for a speech-to-text model (:data:`SPEECH_TO_TEXT`); on the
    pooling runner a sequence classifier (``*ForSequenceClassification``) classifies, any other model embeds."""
    archs = _config(model).get("architectures") or []
    if runner != "pooling":
        return (EngineTask.TRANSCRIBE,) if any(a in SPEECH_TO_TEXT for a in archs) else (EngineTask.GENERATE,)
    return (EngineTask.CLASSIFY,) if any(str(a).endswith("ForSequenceClassification") for a in archs) else (
        EngineTask.EMBED,)


def tasks_of(cfg: BatchConfig) -> tuple[EngineTask, ...]:
    """What the engines of a resolved config's model do (:func:`model_tasks`)."""
    return model_tasks(local_copy(cfg.model, weights=False) if cfg.model else "", cfg.runner)


def class_labels(model: str) -> tuple[str, ...]:
    """A classifier's labels by class index, from its config's ``id2label`` (as vLLM labels its classes); () when the
    directory says none."""
    try:
        return tuple(str(label) for _, label in sorted((int(k), v) for k, v in _config(model)["id2label"].items()))
    except (KeyError, AttributeError, TypeError, ValueError):
        return ()


def reads_token_types(model: str) -> bool:
    """Whether the model reads token type ids (BERT's segment embeddings: ``type_vocab_size`` over 1), which tell a
    cross-encoder's query from its document."""
    size = _config(model).get("type_vocab_size")
    return isinstance(size, int) and size > 1


def takes_images(model: str) -> bool:
    """Whether the model directory holds a vision-language model: its config has a vision encoder's settings
    (``vision_config``, as LLaVA, Qwen2-VL, Gemma 3, Idefics and the like write it)."""
    return isinstance(_config(model).get("vision_config"), dict)


def _config(model: str) -> dict:
    """The model directory's ``config.json``; {} when it has none that reads as an object."""
    try:
        config = json.loads((Path(model or "") / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def check_adapters(lora_modules: dict[str, str], max_lora_rank: int) -> None:
    """Every LoRA adapter directory exists and fits max_lora_rank; else the batch stops here, before any work, with
    one message. An adapter given as a URI is read from this host's copy of its small files."""
    for name, path in sorted(lora_modules.items()):
        try:
            config_file = Path(local_copy(path, weights=False)) / "adapter_config.json"
        except ModelSourceError as exc:
            raise ConfigError(f"LoRA adapter {name!r}: {str(exc).split('; give')[0]}; give --lora-modules "
                              f"{name}=<adapter directory or URI readable on every executor>") from None
        try:
            rank = int(json.loads(config_file.read_text()).get("r") or 0)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"LoRA adapter {name!r}: cannot read {config_file} ({type(exc).__name__}); give "
                              f"--lora-modules {name}=<adapter directory readable on every executor>") from None
        if rank > max_lora_rank:
            raise ConfigError(f"LoRA adapter {name!r} has rank {rank}, over max_lora_rank {max_lora_rank}; raise "
                              f"--max-lora-rank to at least {rank}")


def model_context_length(model: str) -> int:
    """The model's context length, read from its ``config.json`` (max_position_embeddings or the like; an
    encoder-decoder's is its decoder's, Whisper's ``max_target_positions``)."""
    config_file = Path(model or "") / "config.json"
    try:
        model_conf = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_file} to find the model's context length ({exc}); set "
                          f"--max-model-len / MAX_MODEL_LEN") from None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_target_positions"):
        value = model_conf.get(key) or (model_conf.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"{config_file} does not state a context length; set --max-model-len / MAX_MODEL_LEN")
