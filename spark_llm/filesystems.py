"""Storage URIs as a Python process on the cluster opens them (pyarrow's filesystems): for work that does not go
through Spark's JVM (a Spark Connect session's file operations, model copies, quarantine journals, the batch
service's files)."""

from __future__ import annotations

import os
from typing import Any, Optional


def file_uri_path(uri: str) -> Optional[str]:
    """The local path a ``file:`` URI names in any of RFC 8089's spellings (``file:/p``, ``file:///p``,
    ``file://localhost/p``), normalised; None for a ``file:`` URI of another host, or not a ``file:`` URI."""
    if uri[:5].lower() != "file:":
        return None
    rest = uri[5:]
    if rest.startswith("//"):
        host, _, rest = rest[2:].partition("/")
        if host.lower() not in ("", "localhost"):
            return None
    return os.path.normpath("/" + rest.lstrip("/"))


def python_filesystem(uri: str) -> tuple[Any, str]:
    """A pyarrow filesystem and path for a Hadoop-style URI, as a Python process on the cluster can open it: local
    and ``file:`` paths, Databricks' ``dbfs:/`` (its ``/dbfs`` mount) and ``/Volumes``, ``s3a://`` as ``s3://``, and
    what pyarrow understands (``gs://``, ``abfss://``, ``hdfs://``)."""
    from pyarrow import fs

    if uri.startswith("dbfs:/"):
        uri = "/dbfs/" + uri[len("dbfs:/"):].lstrip("/")
    elif uri.startswith(("s3a://", "s3n://")):
        uri = "s3://" + uri.split("://", 1)[1]
    local = file_uri_path(uri)
    if local is not None:
        return fs.LocalFileSystem(), local
    if "://" not in uri:
        return fs.LocalFileSystem(), os.path.abspath(uri)
    return fs.FileSystem.from_uri(uri)
