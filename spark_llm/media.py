"""Images (and audio files) in requests: where one may come from, what it costs in prompt tokens, and how it reaches
the engine. An audio file is read the same way, under the same policy (a :class:`Medium` names its codes and
limit); :mod:`~spark_llm.audio` measures and decodes it.

An image part's URL is checked where its line is validated (:func:`check_url`: the scheme, the domain or storage it
names, a ``data:`` URL's size), read and measured where the prompt tokens are counted (:func:`read_media`,
:func:`measure`: its bytes, format and pixel size, without decoding it; the model's processor says how many tokens
it becomes), read again by the inference task, and decoded once, in the engine process (:func:`decode`), whose
vLLM resizes it as the model wants. Every problem is a :class:`~spark_llm.errors.RequestError` with the code of
:data:`IMAGE_CODES` that names it: the line's error row.

Where an image may come from: a ``data:`` URL (base64), always; a path or storage URI (``/Volumes/...``,
``s3a://``, ``file:``) under one of ``allowed_media_paths`` (default: the directory of the batch's input), read
with the Python filesystems the job uses (:mod:`~spark_llm.filesystems`); ``http(s)://`` only from hosts in
``allowed_media_domains`` (vLLM's setting of that name; empty by default), because a batch job must not fetch
whatever URLs a file names from inside a cluster.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional
from urllib.parse import urlsplit

from .errors import ErrorCode, RequestError

#: Image formats a request may send (OpenAI's: PNG, JPEG, WEBP and GIF; BMP too, which vLLM reads).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: Storage schemes an image path may use (read with pyarrow's filesystems, as the job's other files).
STORAGE_SCHEMES = ("s3a", "s3", "s3n", "gs", "gcs", "abfss", "abfs", "hdfs", "viewfs", "dbfs", "file")
#: The codes of a bad image's error row.
IMAGE_CODES = (ErrorCode.INVALID_IMAGE_URL, ErrorCode.INVALID_IMAGE_FORMAT, ErrorCode.IMAGE_PARSE_ERROR,
               ErrorCode.IMAGE_TOO_LARGE, ErrorCode.IMAGE_NOT_SUPPORTED)
_DATA_URL = re.compile(r"data:((?:image|audio)/[\w.+-]+)?(;[\w=.+-]+)*?;base64,", re.IGNORECASE)
#: A data: URL inside a request's JSON text (for :func:`without_data_urls`).
_DATA_URL_IN_JSON = re.compile(r'"(data:[^",;]*(?:;[^",;]*)*;base64,)([A-Za-z0-9+/=\s\\n]*)"')


class Medium(NamedTuple):
    """What a request's file is, for the words and codes of its problems: an image or an audio file."""

    noun: str                  #: how messages name one
    mime: str                  #: the media type's top level (a data: URL's ``data:<mime>/<format>``)
    url_code: ErrorCode        #: its URL or path refused, missing or unreadable
    too_large_code: ErrorCode  #: over its policy's byte limit
    limit_setting: str         #: the setting of :class:`MediaPolicy` that limits its bytes
    purpose: str               #: the purpose of an upload that holds one (the batch service's Files API)


IMAGE = Medium("image", "image", ErrorCode.INVALID_IMAGE_URL, ErrorCode.IMAGE_TOO_LARGE, "max_image_bytes", "vision")
AUDIO = Medium("audio file", "audio", ErrorCode.INVALID_AUDIO_URL, ErrorCode.AUDIO_TOO_LARGE, "max_audio_bytes",
               "user_data")
#: Each medium by the purpose of the uploads that hold one (the batch service's Files API).
BY_PURPOSE = {m.purpose: m for m in (IMAGE, AUDIO)}


@dataclass(frozen=True)
class MediaPolicy:
    """Where a run's images and audio files may come from and how large they may be (the config's settings of these
    names)."""

    allowed_media_domains: tuple[str, ...] = ()
    allowed_media_paths: tuple[str, ...] = ()
    max_image_bytes: int = 20_000_000
    max_image_pixels: int = 40_000_000
    media_fetch_timeout_seconds: float = 20.0
    #: uploaded images (and audio files) by file id: (file id, where it is stored), read wherever they are
    media_files: tuple[tuple[str, str], ...] = ()
    max_audio_bytes: int = 25_000_000  #: OpenAI's limit of an audio file, and vLLM's default

    def limit(self, medium: Medium) -> int:
        """The most bytes a file of ``medium`` may have."""
        return int(getattr(self, medium.limit_setting))

    @classmethod
    def of(cls, cfg: Any) -> "MediaPolicy":
        """The policy of a resolved config: the allowed paths default to the directory of its input."""
        paths = _split(cfg.allowed_media_paths)
        if not paths and cfg.input:
            paths = tuple(_parent(p) for p in str(cfg.input).split(",") if p.strip())
        return cls(_split(cfg.allowed_media_domains), paths, cfg.max_image_bytes, cfg.max_image_pixels,
                   cfg.media_fetch_timeout_seconds, tuple(sorted(cfg.media_files.items())), cfg.max_audio_bytes)

    def stored_file(self, file_id: Any, where: str, medium: Medium = IMAGE) -> str:
        """Where the uploaded file ``file_id`` is stored; an id that is not one of :attr:`media_files` is the
        request's ``invalid_image_url`` (``invalid_audio_url``)."""
        location = dict(self.media_files).get(file_id) if isinstance(file_id, str) else None
        if location is None:
            raise RequestError(medium.url_code,
                               f"{where}: {str(file_id)[:80]!r} is not a file of this batch's owner; upload the "
                               f"{medium.noun} with purpose {medium.purpose!r} and give its id")
        return location


def _split(value: Optional[str]) -> tuple[str, ...]:
    return tuple(x.strip() for x in (value or "").split(",") if x.strip())


def _parent(path: str) -> str:
    path = path.strip().rstrip("/")
    return path.rsplit("/", 1)[0] + "/" if "/" in path else "./"


def check_url(url: Any, policy: MediaPolicy, where: str, medium: Medium = IMAGE) -> str:
    """``url`` if a request may name it (validation, without reading it); else the error that says why."""
    if not isinstance(url, str) or not url:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"{where} must be a non-empty string (a data: URL, a path "
                                                      f"or a URI)")
    if url[:5].lower() == "data:":
        header = _DATA_URL.match(url)
        if header is None:
            raise RequestError(medium.url_code, f"{where} is a data: URL that is not base64 "
                                                f"(data:{medium.mime}/<format>;base64,<bytes>)")
        size = (len(url) - header.end()) * 3 // 4
        if size > policy.limit(medium):
            raise _too_large(where, size, policy, medium)
        return url
    scheme = urlsplit(url).scheme.lower() if "://" in url or url.startswith(("file:", "dbfs:")) else ""
    if scheme in ("http", "https"):
        host = (urlsplit(url).hostname or "").lower()
        if not any(host == d.lower() or host.endswith("." + d.lower()) for d in policy.allowed_media_domains):
            allowed = ", ".join(policy.allowed_media_domains) or "none"
            raise RequestError(medium.url_code,
                               f"{where}: fetching {host or url[:60]!r} is refused (allowed media domains: "
                               f"{allowed}); send the {medium.noun} as a data: URL or a path, or add its host to "
                               f"--allowed-media-domains")
        return url
    if scheme and scheme not in STORAGE_SCHEMES:
        raise RequestError(medium.url_code, f"{where}: {scheme}:// is not a scheme files are read from (data:, "
                                            f"http(s):, a path or a storage URI)")
    if not any(_under(url, prefix) for prefix in policy.allowed_media_paths):
        allowed = ", ".join(policy.allowed_media_paths) or "none"
        raise RequestError(medium.url_code,
                           f"{where}: {url[:200]!r} is outside the storage media files are read from ({allowed}); "
                           f"set --allowed-media-paths to the directories that hold them")
    return url


def _under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or inside it, after ``..`` is resolved (so ``/ok/../etc`` is not under /ok)."""
    p, base = _normal(path), _normal(prefix)
    return p == base or p.startswith(base.rstrip("/") + "/")


def _normal(path: str) -> str:
    import os
    import posixpath

    from .filesystems import file_uri_path

    local = file_uri_path(path)
    if local is not None:
        return local
    if "://" in path:  # a storage URI, or another host's file: URI (no local path is under it)
        scheme, rest = path.split("://", 1)
        scheme = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "abfs": "abfss"}.get(scheme.lower(), scheme.lower())
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    if path.startswith("dbfs:"):
        path = "/dbfs/" + path[5:].lstrip("/")
    return os.path.normpath(os.path.abspath(path))


def label(k: int, n: int, url: str) -> str:
    """How an error message names the ``k``-th (from 0) of a request's ``n`` images: its place and its URL (a
    ``data:`` URL by its media type)."""
    shown = url[:url.index(",") + 1] + "…" if url[:5].lower() == "data:" and "," in url else \
        (url if len(url) <= 120 else url[:119] + "…")
    return f"image {k + 1} of {n} ({shown})"


def read_media(url: str, policy: MediaPolicy, where: str = "image", medium: Medium = IMAGE) -> bytes:
    """The bytes of the image (or other ``medium``) ``url`` names (checked by :func:`check_url` first, unless it is
    where an uploaded file is stored): decoded from a ``data:`` URL, read from storage, or fetched from an allowed
    host; at most the policy's limit for the medium."""
    if not any(url == location for _, location in policy.media_files):
        check_url(url, policy, where, medium)
    if url[:5].lower() == "data:":
        payload = url[_DATA_URL.match(url).end():]  # type: ignore[union-attr]
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as exc:
            raise RequestError(medium.url_code, f"{where}: the data: URL's base64 does not decode ({exc})") from None
    limit = policy.limit(medium)
    if url.lower().startswith(("http://", "https://")):
        return _fetch(url, policy, where, medium)
    from .filesystems import python_filesystem

    try:
        fs, path = python_filesystem(url)
        with fs.open_input_stream(path) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise RequestError(medium.url_code, f"{where}: {url[:200]!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise RequestError(medium.url_code, f"{where}: {url[:200]!r} cannot be read "
                                            f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if len(data) > limit:
        raise _too_large(where, len(data), policy, medium, at_least=True)
    return data


def _fetch(url: str, policy: MediaPolicy, where: str, medium: Medium) -> bytes:
    import urllib.error
    import urllib.request

    limit = policy.limit(medium)
    try:
        with urllib.request.urlopen(url, timeout=policy.media_fetch_timeout_seconds) as response:  # noqa: S310
            data = response.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RequestError(medium.url_code, f"{where}: fetching {url[:200]!r} failed "
                                            f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if len(data) > limit:
        raise _too_large(where, len(data), policy, medium, at_least=True)
    return data


def _too_large(where: str, size: int, policy: MediaPolicy, medium: Medium, at_least: bool = False) -> RequestError:
    more = "more than " if at_least else ""
    return RequestError(medium.too_large_code, f"{where} is {more}{size:,} bytes, over {medium.limit_setting} "
                                               f"{policy.limit(medium):,}; send a smaller {medium.noun}")


def measure(data: bytes, policy: MediaPolicy, where: str = "image") -> tuple[int, int]:
    """(height, width) of the image ``data`` from its header, without decoding its pixels; an unknown or
    unsupported format, a header that does not parse or a picture over ``max_image_pixels`` is the request's
    error. A PNG's chunks are checked too (``verify``), so a truncated PNG is found here; a truncated JPEG only
    when the engine decodes it (:func:`decode`)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt, (width, height) = img.format, img.size
            if fmt == "PNG":
                img.verify()
    except UnidentifiedImageError:
        raise RequestError(ErrorCode.INVALID_IMAGE_FORMAT, f"{where} is not an image (its {len(data):,} bytes "
                                                           f"start {data[:8]!r}); send PNG, JPEG, WEBP or GIF")
    except Exception as exc:  # noqa: BLE001 - what a broken header raises varies by format
        raise RequestError(ErrorCode.IMAGE_PARSE_ERROR, f"{where} is a broken image: {type(exc).__name__}: "
                                                        f"{str(exc)[:200]}") from None
    if fmt not in FORMATS:
        raise RequestError(ErrorCode.INVALID_IMAGE_FORMAT, f"{where} is {fmt}, not a supported format "
                                                           f"({', '.join(FORMATS)})")
    if width * height > policy.max_image_pixels:
        raise RequestError(ErrorCode.IMAGE_TOO_LARGE, f"{where} is {width}x{height} pixels, over max_image_pixels "
                                                      f"{policy.max_image_pixels:,}; send a smaller image")
    return height, width


def decode(data: bytes, where: str = "image") -> Any:
    """The picture ``data`` holds, decoded (RGB): what vLLM is given. Engine side; a truncated or corrupt file
    is the request's ``image_parse_error``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise RequestError(ErrorCode.IMAGE_PARSE_ERROR, f"{where} could not be decoded: {type(exc).__name__}: "
                                                        f"{str(exc)[:200]}") from None


def without_data_urls(request: str) -> str:
    """A request's JSON text with every base64 ``data:`` URL's bytes replaced by their size and hash, for the
    ``request`` column of the tables (a table of image requests does not hold every image twice); unchanged when
    it holds none."""
    if "base64," not in request:
        return request

    def placeholder(m: re.Match) -> str:
        payload = m.group(2).replace("\\n", "").replace("\\/", "/")
        digest = hashlib.sha256(payload.encode()).hexdigest()[:16]
        size = len(payload) * 3 // 4 - payload[-2:].count("=")
        return f'"{m.group(1)}<{size:,} bytes, sha256 {digest}>"'
    return _DATA_URL_IN_JSON.sub(placeholder, request)


class ImageTokens:
    """How many prompt tokens an image becomes for a model, as its own processor (``AutoProcessor``) decides:
    its ``_get_num_multimodal_tokens`` for the image's size (what vLLM asks it too), else the count of image tokens
    in what the processor makes of a blank picture of that size. One per model and process (:func:`image_tokens`);
    sizes are remembered."""

    def __init__(self, model_dir: str):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        tokenizer = self.processor.tokenizer
        token = getattr(self.processor, "image_token", None)
        self.token_id: Optional[int] = getattr(self.processor, "image_token_id", None) or (
            tokenizer.convert_tokens_to_ids(token) if token else None)
        self._by_size: dict[tuple[int, int], int] = {}

    def count(self, size: tuple[int, int]) -> int:
        """Tokens of one image of ``size`` (height, width)."""
        if size not in self._by_size:
            try:
                n = int(self.processor._get_num_multimodal_tokens(image_sizes=[list(size)]).num_image_tokens[0])
            except (AttributeError, NotImplementedError, TypeError, KeyError, IndexError):
                from PIL import Image

                blank = Image.new("RGB", (size[1], size[0]))
                ids = self.processor(text=self.processor.image_token, images=[blank])["input_ids"][0]
                n = sum(1 for t in ids if t == self.token_id)
            self._by_size[size] = n
        return self._by_size[size]


_COUNTERS: dict[str, ImageTokens] = {}


def image_tokens(model: str) -> ImageTokens:
    """The :class:`ImageTokens` of ``model`` (a local copy of its small files), once per process."""
    counter = _COUNTERS.get(model)
    if counter is None:
        from .models import local_copy

        counter = _COUNTERS[model] = ImageTokens(local_copy(model, weights=False))
    return counter
