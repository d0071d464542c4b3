"""The bytes of the service's files under its storage root (a local directory, or any filesystem pyarrow opens:
``s3://``, ``gs://``, ``abfss://``, ``hdfs://``), and the upload of a batch input file: a multipart body parsed as
it arrives and written straight to storage, checked on the way (size, not binary, not empty), never held in memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Optional

from ..filesystems import S3_PREFIXES, S3Access, bucket_and_key, python_filesystem
from ..media import AUDIO, IMAGE
from .protocol import APIError

#: Bytes a download reads from storage at a time.
CHUNK_BYTES = 1 << 20
#: A filename a client may give: no path parts, no control characters, at most 255 characters.
#: Age after which an upload's temporary file is taken for one cut off by a dead server (a server's own uploads
#: finish well within it).
PARTIAL_MAX_AGE_SECONDS = 3600.0
_BAD_FILENAME = re.compile(r"[\x00-\x1f\x7f/\\]")
#: Bytes of each part of a file written to S3 but the last (S3's least is 5 MiB): what a write holds in memory.
S3_PART_BYTES = 8 << 20
#: S3's bounds of a part of a multipart upload: the least (but the last part), and the most one copy may take.
S3_MIN_PART_BYTES, S3_MAX_COPY_BYTES = 5 << 20, 5 << 30


class S3Upload:
    """A file written to S3 as one multipart upload to its own key: each part sent as it fills, the object made by
    :meth:`complete` and by nothing else. S3 shows no object of an upload never completed, so a write cut off (an
    error: :meth:`abort`; a server killed) leaves nothing to download, and no copy is ever made (a rename on S3 is
    a copy: 8 GB twice, and pyarrow's copies stop at 5 GB)."""

    def __init__(self, access: S3Access, bucket: str, key: str, part_bytes: int = S3_PART_BYTES):
        self.client, self.bucket, self.key, self.part_bytes = access.client(), bucket, key, part_bytes
        self.upload_id = self.client.create_multipart_upload(Bucket=bucket, Key=key,
                                                             **access.write_arguments())["UploadId"]
        self.parts: list[dict] = []
        self.buffer = bytearray()

    def write(self, data: bytes) -> int:
        self.buffer += data
        while len(self.buffer) >= self.part_bytes:
            self._send(bytes(self.buffer[:self.part_bytes]))
            del self.buffer[:self.part_bytes]
        return len(data)

    def _send(self, body: bytes) -> None:
        number = len(self.parts) + 1
        reply = self.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                        PartNumber=number, Body=body)
        self.parts.append({"PartNumber": number, "ETag": reply["ETag"]})

    def complete(self) -> None:
        if self.buffer or not self.parts:  # the last part may be short, or empty when it is the only one
            self._send(bytes(self.buffer))
            self.buffer.clear()
        self.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                              MultipartUpload={"Parts": self.parts})

    def abort(self) -> None:
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)

    def copy_part(self, source: str) -> None:
        """The object ``source`` (an S3 URI) as the next part, copied by S3 itself (``UploadPartCopy``): none of its
        bytes pass through this process."""
        bucket, key = bucket_and_key(source)
        number = len(self.parts) + 1
        reply = self.client.upload_part_copy(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                             PartNumber=number, CopySource={"Bucket": bucket, "Key": key})
        self.parts.append({"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]})


class FileStorage:
    """Files under ``root``: input files as ``files/<id>``, each batch's results under ``batches/<id>/``. On S3,
    ``hadoop`` (Hadoop's ``fs.s3a.*`` settings, as the server's Spark gets them) says how to reach the bucket and
    how to encrypt what is written there, as the S3A connector does for the job's writes."""

    def __init__(self, root: str, hadoop: Optional[Mapping[str, str]] = None):
        self.root = root.rstrip("/") if "://" in root or root.startswith("file:") else os.path.abspath(root)
        self.s3 = S3Access.from_hadoop(hadoop or {}, bucket_and_key(self.root)[0]) \
            if self.root.startswith(S3_PREFIXES) else None
        if self.s3 is not None:
            self.s3.write_arguments()  # a setting its writes cannot follow stops the server here, not an upload
        filesystem, path = python_filesystem(self.root, self.s3)
        filesystem.create_dir(path, recursive=True)
        if filesystem.type_name == "local":  # every key's inputs and results: this user's alone
            os.chmod(path, 0o700)

    def location(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _make_dirs(self, filesystem: Any, directory: str) -> None:
        """``directory`` and the folders above it up to the root; on a local disk each made 0700, as the root is
        (a umask would leave ``files/`` and ``batches/<id>/`` readable by others)."""
        if filesystem.type_name != "local":
            filesystem.create_dir(directory, recursive=True)
            return
        made = []
        folder = directory
        while folder.startswith(self.root + "/") and not os.path.isdir(folder):
            made.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(made):
            with contextlib.suppress(FileExistsError):  # another request made it first
                os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)

    @contextlib.contextmanager
    def writing(self, location: str) -> Iterator[Any]:
        """A stream that becomes ``location`` when the block ends without an error, and nothing otherwise: a reader
        never sees half a file. On S3 one multipart upload to the file's own key (:class:`S3Upload`); elsewhere
        written under a temporary name first, renamed into place."""
        if location.startswith(S3_PREFIXES):
            upload = S3Upload(self.s3, *bucket_and_key(location))
            try:
                yield upload
                upload.complete()
            except BaseException:
                with contextlib.suppress(Exception):
                    upload.abort()
                raise
            return
        filesystem, path = python_filesystem(location, self.s3)
        self._make_dirs(filesystem, path.rsplit("/", 1)[0])
        temporary = f"{path}.{uuid.uuid4().hex[:8]}.partial"
        try:
            with filesystem.open_output_stream(temporary) as out:
                yield out
            if filesystem.type_name == "local":
                os.chmod(temporary, 0o600)
            filesystem.move(temporary, path)
        except BaseException:
            with contextlib.suppress(Exception):
                filesystem.delete_file(temporary)
            raise

    def join(self, sources: list[tuple[str, int]], location: str) -> bool:
        """The files ``sources`` (location, bytes), one after the other, as the file ``location``, joined by S3 from
        the objects it holds (each a part of one multipart upload, copied server-side), as one write: the file
        appears whole, or not at all. False, and nothing written, where S3 cannot join them (storage that is not
        S3, a file but the last under S3's least part of 5 MiB, or one over its most of 5 GiB): the caller writes
        the file from their bytes instead."""
        if not location.startswith(S3_PREFIXES) or not sources or \
                any(size < S3_MIN_PART_BYTES for _, size in sources[:-1]) or \
                any(size > S3_MAX_COPY_BYTES for _, size in sources):
            return False
        upload = S3Upload(self.s3, *bucket_and_key(location))
        try:
            for source, _ in sources:
                upload.copy_part(source)
            upload.client.complete_multipart_upload(Bucket=upload.bucket, Key=upload.key, UploadId=upload.upload_id,
                                                    MultipartUpload={"Parts": upload.parts})
        except BaseException:
            with contextlib.suppress(Exception):
                upload.abort()
            raise
        return True

    def sweep_partials(self, older_than: float = PARTIAL_MAX_AGE_SECONDS) -> int:
        """Delete what uploads cut off by a dead server left under temporary names (``*.partial``), once older than
        ``older_than`` seconds (younger ones may be another server's uploads under way); how many went. On S3, the
        multipart uploads left incomplete under the root (no object, but their parts are stored and billed)."""
        from pyarrow import fs

        if self.root.startswith(S3_PREFIXES):
            return self._abort_stale_uploads(older_than)
        swept = 0
        for kind in ("files", "uploads"):
            filesystem, path = python_filesystem(self.location(kind), self.s3)
            selector = fs.FileSelector(path, recursive=True, allow_not_found=True)
            for info in filesystem.get_file_info(selector):
                if info.type == fs.FileType.File and info.base_name.endswith(".partial") and info.mtime is not None \
                        and time.time() - info.mtime.timestamp() > older_than:
                    with contextlib.suppress(OSError):
                        filesystem.delete_file(info.path)
                        swept += 1
        return swept

    def _abort_stale_uploads(self, older_than: float) -> int:
        client, (bucket, prefix) = self.s3.client(), bucket_and_key(self.root)
        swept = 0
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for upload in page.get("Uploads", []):
                if time.time() - upload["Initiated"].timestamp() > older_than:
                    with contextlib.suppress(Exception):
                        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        swept += 1
        return swept

    def chunks(self, location: str) -> Iterator[bytes]:
        """The file's bytes, chunk by chunk, from a stream opened here, before the first chunk is asked for: a file
        gone (deleted since its record was read) raises FileNotFoundError now, not after an answer has started."""
        filesystem, path = python_filesystem(location, self.s3)
        stream = filesystem.open_input_stream(path)

        def read() -> Iterator[bytes]:
            with stream:
                while chunk := stream.read(CHUNK_BYTES):
                    yield chunk
        return read()

    def size(self, location: str) -> Optional[int]:
        """Bytes of the file at ``location``; None when there is none."""
        from pyarrow import fs

        filesystem, path = python_filesystem(location, self.s3)
        info = filesystem.get_file_info(path)
        return info.size if info.type == fs.FileType.File else None

    def delete(self, location: str) -> None:
        if location.startswith(S3_PREFIXES):  # pyarrow would leave an empty "<dir>/" object for its parent
            bucket, key = bucket_and_key(location)
            self.s3.client().delete_object(Bucket=bucket, Key=key)
            return
        filesystem, path = python_filesystem(location, self.s3)
        with contextlib.suppress(FileNotFoundError):
            filesystem.delete_file(path)


def check_filename(name: Optional[str]) -> str:
    if not name or name in (".", "..") or len(name) > 255 or _BAD_FILENAME.search(name):
        raise APIError.invalid("The filename must be 1 to 255 characters without path separators or control "
                               f"characters; got {name!r}.", param="file", code="invalid_filename")
    return name


class TextCheck:
    """A batch input file's bytes as they arrive: at most ``limit`` of them, text (no NUL byte: what tells a binary
    file, an image or an archive, from text), and not blank. A line that is not valid UTF-8 is the job's to report
    (an ``invalid_encoding`` row), as any other bad line. Each failure is the :class:`APIError` the upload answers."""

    def __init__(self, limit: int):
        self.limit, self.bytes, self.blank = limit, 0, True

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.bytes > self.limit:
            raise APIError.invalid(f"The file is larger than this server's limit of {self.limit} bytes; split it "
                                   "into several batches.", param="file", code="file_too_large")
        if b"\x00" in data:
            raise APIError.invalid("The file is binary, not JSONL text (one JSON request per line).", param="file",
                                   code="invalid_file_format")
        if self.blank and data.strip():
            self.blank = False

    def close(self) -> None:
        if self.blank:
            raise APIError.invalid("The file is empty: a batch input file holds one JSON request per line.",
                                   param="file", code="empty_file")


class MediaCheck:
    """A media file's bytes as they arrive: at most ``limit`` of them, and of a format requests may send, told from
    its header (:meth:`problem`). Whether it decodes is the request's to find out, as any image's or audio file's."""

    HEAD = 1 << 16  #: bytes kept for the header (a JPEG's size is in its first kilobytes, past any EXIF)
    NOUN = "file"

    def __init__(self, limit: int):
        self.limit, self.bytes, self.head = limit, 0, b""

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.bytes > self.limit:
            raise APIError.invalid(f"The {self.NOUN} is larger than this server's limit of {self.limit} bytes.",
                                   param="file", code="file_too_large")
        if len(self.head) < self.HEAD:
            self.head += data[:self.HEAD - len(self.head)]

    def close(self) -> None:
        problem = self.problem(self.head)
        if problem is not None:
            raise APIError.invalid(problem, param="file", code="invalid_file_format")

    def problem(self, head: bytes) -> Optional[str]:
        """What is wrong with a file that starts with ``head``, or None."""
        raise NotImplementedError


class ImageCheck(MediaCheck):
    """Purpose ``vision``: a picture a batch's requests name by ``input_image.file_id``, of a format requests may
    send (:data:`~spark_llm.media.FORMATS`)."""

    NOUN = "image"

    def problem(self, head: bytes) -> Optional[str]:
        import io

        from PIL import Image

        from ..media import FORMATS

        try:
            with Image.open(io.BytesIO(head)) as img:
                fmt = img.format
        except Exception:  # noqa: BLE001 - whatever PIL raises for what is not a picture it knows
            fmt = None
        return None if fmt in FORMATS else (f"A file with purpose 'vision' is an image ({', '.join(FORMATS)}); this "
                                            f"one is {fmt or 'not an image'}.")


class AudioCheck(MediaCheck):
    """Purpose ``user_data``: an audio file a batch's transcription and translation lines name by ``file``, whose
    header reads as audio (:func:`~spark_llm.audio.measure`)."""

    NOUN = "audio file"

    def problem(self, head: bytes) -> Optional[str]:
        from ..audio import measure
        from ..errors import RequestError

        try:
            measure(head, "the file")
        except RequestError as exc:
            return f"A file with purpose 'user_data' is an audio file for transcriptions: {exc.message}"
        return None


#: The check of an upload of each medium (its purpose's: :data:`~spark_llm.media.BY_PURPOSE`).
MEDIA_CHECKS = {IMAGE: ImageCheck, AUDIO: AudioCheck}


@dataclass
class Upload:
    """A multipart upload as received: its form fields, and the file part's name and size (its bytes are at the
    location given to :func:`receive_upload`)."""

    fields: dict[str, str]
    filename: Optional[str] = None
    bytes: int = 0


class PartCheck(TextCheck):
    """One part of a chunked upload (:mod:`.uploads`): at most ``limit`` bytes and no NUL byte; whether the whole
    file is blank is decided when the parts are put together."""

    def feed(self, data: bytes) -> None:
        if self.bytes + len(data) > self.limit:
            raise APIError.invalid(f"The parts would hold more than the bytes the upload was created for ({self.limit} "
                                   "left for this part).", param="data", code="file_too_large")
        super().feed(data)

    def close(self) -> None:
        pass


#: Form fields an upload may hold besides its file (OpenAI's: purpose and expires_after's two).
MAX_FIELDS = 16


async def paced(body: AsyncIterator[bytes], idle_seconds: float) -> AsyncIterator[bytes]:
    """``body``'s chunks, as long as each comes within ``idle_seconds`` of the one before; else 408."""
    chunks = body.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), idle_seconds)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise APIError(408, f"The upload sent nothing for {idle_seconds:g} s; nothing of it is kept. Send it "
                                f"again.", code="upload_timeout") from None
        yield chunk


async def receive_upload(body: AsyncIterator[bytes], content_type: str, storage: FileStorage, location: str,
                         check: Any, field: str = "file") -> Upload:
    """Parse a ``multipart/form-data`` body as it arrives (:func:`paced` bounds its pauses): the part named ``field``
    is checked (``check``: a :class:`TextCheck`, a :class:`PartCheck` for a chunked upload's part, or a function of
    the form fields before the file part that gives the check, :class:`ImageCheck` for a ``vision`` file) and
    written to ``location``, the other parts are form fields (at most :data:`MAX_FIELDS`, 64 KiB each). One file
    part, after the fields that choose its check, and a body that ends with its closing boundary, or nothing is
    stored. A refused upload leaves nothing stored; the body is still read to its end, so that the client reads the
    answer and not a reset."""
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import MultipartParser, parse_options_header

    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise APIError.invalid("Expected a multipart/form-data body with the file and its purpose.")
    with contextlib.ExitStack() as stack:
        form = _FormReader(field, check, lambda: stack.enter_context(storage.writing(location)))
        parser = MultipartParser(options[b"boundary"], form.callbacks())
        broken = None
        async for data in body:  # read to the end even when the body is refused: the client then reads the answer
            if broken is None:
                try:  # in a thread: writing a part to S3 waits for the store, and the loop serves other calls
                    await asyncio.to_thread(parser.write, data)
                except MultipartParseError as exc:
                    broken = exc
        if broken is None:
            try:
                parser.finalize()
            except MultipartParseError as exc:
                broken = exc
        form.verdict(broken)  # raises, and the writer removes what it wrote
    form.upload.bytes = form.file_check.bytes
    return form.upload


class _FormReader:
    """The callbacks of python-multipart's parser for one upload: the headers of the part being read, the form
    fields so far, the file part checked and written as it comes, and the first problem found (after which the
    rest of the body is read and dropped)."""

    def __init__(self, field: str, check: Any, open_file: Callable[[], Any]):
        self.field, self.check, self.open_file = field, check, open_file
        self.upload = Upload(fields={})
        self.failure: Optional[APIError] = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_field = self.header_value = b""
        self.part: Optional[str] = None   #: the name of the part being read
        self.file_check: Any = None       #: the file part's check, chosen when it starts
        self.file: Any = None             #: where the file part is written
        self.ended = False                #: the closing boundary was read

    def callbacks(self) -> dict[str, Callable]:
        return {"on_header_field": self.on_header_field, "on_header_value": self.on_header_value,
                "on_header_end": self.on_header_end, "on_headers_finished": self.on_headers_finished,
                "on_part_data": self.on_part_data, "on_part_end": self.on_part_end, "on_end": self.on_end}

    def fail(self, exc: APIError) -> None:
        self.failure = self.failure or exc

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.headers.append((self.header_field.lower(), self.header_value))
        self.header_field = self.header_value = b""

    def on_headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, params = parse_options_header(dict(self.headers).get(b"content-disposition", b""))
        self.part, self.headers = params.get(b"name", b"").decode("utf-8", "replace"), []
        if self.failure:
            return
        fields = self.upload.fields
        if self.part == self.field:
            if self.upload.filename is not None:  # a second file part: which one would the record describe?
                self.fail(APIError.invalid(f"The body holds more than one '{self.field}' part; send one.",
                                           param=self.field))
                return
            self.upload.filename = params.get(b"filename", b"").decode("utf-8", "replace")
            self.file_check = self.check(fields) if callable(self.check) else self.check
            self.file = self.open_file()
        elif len(fields) >= MAX_FIELDS:
            self.fail(APIError.invalid(f"The body holds more than {MAX_FIELDS} form fields."))
        else:
            fields[self.part] = ""

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.failure:
            return
        chunk = data[start:end]
        try:
            if self.part == self.field:
                self.file_check.feed(chunk)
                self.file.write(chunk)
            else:
                value = self.upload.fields[self.part] + chunk.decode("utf-8", "replace")
                if len(value) > 65536:
                    raise APIError.invalid(f"The form field {self.part!r} is too long.")
                self.upload.fields[self.part] = value
        except APIError as exc:
            self.fail(exc)

    def on_part_end(self) -> None:
        if self.part == self.field and not self.failure:
            try:
                self.file_check.close()
            except APIError as exc:
                self.fail(exc)

    def on_end(self) -> None:
        self.ended = True

    def verdict(self, broken: Optional[Exception]) -> None:
        """Raise the reason the upload is refused, if it is: ``broken``, the parser's own error, first."""
        field = self.field
        if broken is None and not self.ended:
            raise APIError.invalid("The multipart body ends before its closing boundary: it was cut short, and "
                                   "nothing of it is stored.", param=field)
        if broken is not None:
            raise APIError.invalid(f"The multipart body could not be read ({broken}); a part's headers, its "
                                   "filename among them, are limited in size.", param=field)
        if self.failure:
            raise self.failure
        if self.upload.filename is None:
            raise APIError.invalid(f"The body has no part named '{field}'.", param=field)
        if callable(self.check) and type(self.check(self.upload.fields)) is not type(self.file_check):
            raise APIError.invalid(f"The form fields that say what the file is (purpose) must come before the "
                                   f"'{field}' part, as OpenAI's clients send them.", param="purpose")
