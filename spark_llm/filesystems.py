"""Storage URIs as a Python process on the cluster opens them (pyarrow's filesystems): for work that does not go
through Spark's JVM (a Spark Connect session's file operations, model copies, quarantine journals, the batch
service's files)."""

from __future__ import annotations

import os
from typing import Any


def python_filesystem(uri: str) -> tuple[Any, str]:
    """A pyarrow filesystem and path for a Hadoop-style URI, as a Python process on the cluster can open it: local
    and ``file:`` paths, Databricks' ``dbfs:/`` (its ``/dbfs`` mount) and ``/Volumes``, ``s3a://`` as ``s3://``, and
    what pyarrow understands (``gs://``, ``abfss://``, ``hdfs://``)."""
    from pyarrow import fs

    if uri.startswith("dbfs:/"):
        uri = "/dbfs/" + uri[len("dbfs:/"):].lstrip("/")
    elif uri.startswith(("s3a://", "s3n://")):
        uri = "s3://" + uri.split("://", 1)[1]
    if uri.startswith("file:"):
        return fs.LocalFileSystem(), "/" + uri[len("file:"):].lstrip("/")
    if "://" not in uri:
        return fs.LocalFileSystem(), os.path.abspath(uri)
    return fs.FileSystem.from_uri(uri)
