"""Storage URIs as a Python process on the cluster opens them (pyarrow's filesystems): for work that does not go
through Spark's JVM (a Spark Connect session's file operations, model copies, quarantine journals, the batch
service's files)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

#: URI prefixes of S3 buckets (Hadoop's connectors' spellings; pyarrow's is ``s3://``).
S3_PREFIXES = ("s3a://", "s3n://", "s3://")


@dataclass(frozen=True)
class S3Access:
    """How a Python process reaches a bucket the way the JVM's S3A connector does: the endpoint, region and keys of
    Hadoop's ``fs.s3a.*`` settings (a bucket's ``fs.s3a.bucket.<name>.*`` first), for pyarrow's S3 filesystem.
    What the settings leave unset, pyarrow finds itself (``AWS_*`` variables, the profile, the instance role)."""

    endpoint: Optional[str] = None  #: host[:port], without the scheme
    scheme: str = "https"
    region: Optional[str] = None
    path_style: bool = False
    access_key: Optional[str] = None
    secret_key: Optional[str] = field(default=None, repr=False)
    session_token: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_hadoop(cls, conf: Mapping[str, str], bucket: str = "") -> "S3Access":
        """The access to ``bucket`` that Hadoop settings ``conf`` (``fs.s3a.*`` keys) describe."""
        def get(key: str) -> Optional[str]:  # a bucket's own setting first; an empty one is unset
            value = conf.get(f"fs.s3a.bucket.{bucket}.{key}") if bucket else None
            if value is None:
                value = conf.get(f"fs.s3a.{key}")
            return (value or "").strip() or None

        endpoint, scheme = get("endpoint"), "https"
        if endpoint and "://" in endpoint:
            scheme, endpoint = endpoint.split("://", 1)
        if (get("connection.ssl.enabled") or "true").lower() == "false":
            scheme = "http"
        return cls(endpoint=endpoint.rstrip("/") if endpoint else None, scheme=scheme.lower(),
                   region=get("endpoint.region"), path_style=(get("path.style.access") or "").lower() == "true",
                   access_key=get("access.key"), secret_key=get("secret.key"), session_token=get("session.token"))

    def filesystem(self) -> Any:
        """pyarrow's S3 filesystem for this access."""
        from pyarrow import fs

        options: dict[str, Any] = {"scheme": self.scheme}
        if self.endpoint:
            options["endpoint_override"] = self.endpoint
        if self.region:
            options["region"] = self.region
        if self.access_key and self.secret_key:
            options.update(access_key=self.access_key, secret_key=self.secret_key)
            if self.session_token:
                options["session_token"] = self.session_token
        if self.endpoint and not self.path_style:
            options["force_virtual_addressing"] = True
        return fs.S3FileSystem(**options)


def s3_access(spark: Any, uri: Optional[str]) -> Optional[S3Access]:
    """The :class:`S3Access` of ``uri``'s bucket that a classic session's Hadoop settings describe; None for a path
    that is not on S3 or a Spark Connect session (whose Hadoop settings are the server's)."""
    from .session import is_connect

    if not uri or not uri.startswith(S3_PREFIXES) or is_connect(spark):
        return None
    props = spark.sparkContext._jsc.hadoopConfiguration().getPropsWithPrefix("fs.s3a.")
    conf = {f"fs.s3a.{k}": v for k, v in props.items()}
    return S3Access.from_hadoop(conf, uri.split("://", 1)[1].split("/", 1)[0])


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


def python_filesystem(uri: str, s3: Optional[S3Access] = None) -> tuple[Any, str]:
    """A pyarrow filesystem and path for a Hadoop-style URI, as a Python process on the cluster can open it: local
    and ``file:`` paths, Databricks' ``dbfs:/`` (its ``/dbfs`` mount) and ``/Volumes``, ``s3a://`` as ``s3://``
    (through ``s3``, the S3A settings of the session, when given), and what pyarrow understands (``gs://``,
    ``abfss://``, ``hdfs://``)."""
    from pyarrow import fs

    if s3 is not None and uri.startswith(S3_PREFIXES):
        return s3.filesystem(), uri.split("://", 1)[1]

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
