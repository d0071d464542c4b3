"""Where the model comes from: a local directory, a Hadoop-filesystem URI, or a Hugging Face repo id.

``--model`` (and ``--tokenizer``) may name

- a **local directory** every executor can read (a shared mount, ``/Volumes/...``, ``/dbfs/...``): used as it is;
- a **URI** (``s3a://``, ``s3://``, ``abfss://``, ``gs://``, ``hdfs://``, ``dbfs:/``, ``file:/``): copied once per host
  to local disk, opened with pyarrow's filesystems (:func:`~spark_llm.storage.python_filesystem`; S3 and GCS take
  their credentials from the environment or the instance profile, not from Hadoop's settings);
- a **Hugging Face repo id** (``org/name``): downloaded once per host, when the hub is reachable; when it is not, one
  clear error says what to set instead.

:func:`local_copy` makes the copy in the host's model cache (``SPARK_LLM_MODEL_CACHE``, default
``<tmp>/spark_llm-models-<uid>``) under a file lock, so that the tasks and engine processes of one host copy once,
into a temporary directory renamed into place when complete: a half-copied model is never used. The driver and the
token-counting tasks need only the small files (config, tokenizer, chat template), so they ask for a copy without the
weights; the engine process asks for the whole model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from .config import ConfigError

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
    with _locked(cache_dir() / f"{target.name}.lock"):
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


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _copy_uri(uri: str, dest: Path, weights: bool) -> None:
    from pyarrow import fs

    from .storage import python_filesystem

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
    for info in files:
        if not weights and info.path.endswith(WEIGHT_SUFFIXES):
            continue
        out = dest / info.path[len(root.rstrip("/")) + 1:]
        out.parent.mkdir(parents=True, exist_ok=True)
        with filesystem.open_input_stream(info.path) as src, open(out, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)


_HUB_SCRIPT = """
import sys
from huggingface_hub import snapshot_download
repo, dest, weights = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
ignore = None if weights else ["*" + s for s in sys.argv[4].split(",")]
snapshot_download(repo, local_dir=dest, ignore_patterns=ignore)
"""


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
