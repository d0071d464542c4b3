"""Storage URIs as a Python process on the cluster opens them (pyarrow's filesystems): for work that does not go
through Spark's JVM (a Spark Connect session's file operations, model copies, quarantine journals, the batch
service's files)."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, NamedTuple, Optional

from .config import ConfigError
from .session_info import is_connect

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
    #: server-side encryption of what is written (``fs.s3a.encryption.algorithm``: SSE-S3, SSE-KMS, DSSE-KMS), and
    #: its KMS key (``fs.s3a.encryption.key``; none: the bucket's or the account's default key)
    encryption: Optional[str] = None
    encryption_key: Optional[str] = None

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
        # the encryption settings' names before Hadoop 3.3.2 are still read by S3A
        algorithm = (get("encryption.algorithm") or get("server-side-encryption-algorithm") or "").upper() or None
        return cls(endpoint=endpoint.rstrip("/") if endpoint else None, scheme=scheme.lower(),
                   region=get("endpoint.region"), path_style=(get("path.style.access") or "").lower() == "true",
                   access_key=get("access.key"), secret_key=get("secret.key"), session_token=get("session.token"),
                   encryption=algorithm, encryption_key=get("encryption.key") or get("server-side-encryption.key"))

    def write_arguments(self) -> dict[str, str]:
        """boto3's arguments of a write (``put_object``, ``create_multipart_upload``) that encrypt the object as
        the S3A connector would: the JVM's and Python's writes alike."""
        if self.encryption is None:
            return {}
        if self.encryption not in SSE_ARGUMENTS:
            raise ConfigError(f"fs.s3a.encryption.algorithm {self.encryption}: spark_llm's own writes to S3 take "
                              f"{', '.join(SSE_ARGUMENTS)} (SSE-C needs its key on every read, which they do not "
                              f"send); use one of those, or the bucket's default encryption")
        arguments = {"ServerSideEncryption": SSE_ARGUMENTS[self.encryption]}
        if self.encryption_key and self.encryption != "SSE-S3":
            arguments["SSEKMSKeyId"] = self.encryption_key
        return arguments

    @property
    def reaches(self) -> bool:
        """Whether the settings say where or how to reach the store (an endpoint, a region, keys, path-style
        addressing); if not, pyarrow's and boto3's own chain (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, the
        profile, the instance role) is all there is."""
        return bool(self.endpoint or self.region or self.path_style or self.access_key)

    def filesystem(self) -> Any:
        """pyarrow's S3 filesystem for this access (one per access and process)."""
        return _pyarrow_filesystem(self)

    def client(self) -> Any:
        """boto3's S3 client for this access: what the settings give, the standard chain (``AWS_*`` variables,
        the profile, the instance role) for the rest (one per access and process)."""
        return _boto3_client(self)


@functools.lru_cache(maxsize=None)
def _pyarrow_filesystem(access: S3Access) -> Any:
    """One pyarrow S3 filesystem per access and process."""
    from pyarrow import fs

    options: dict[str, Any] = {"scheme": access.scheme}
    if access.endpoint:
        options["endpoint_override"] = access.endpoint
    if access.region:
        options["region"] = access.region
    if access.access_key and access.secret_key:
        options.update(access_key=access.access_key, secret_key=access.secret_key)
        if access.session_token:
            options["session_token"] = access.session_token
    if access.endpoint and not access.path_style:
        options["force_virtual_addressing"] = True
    return fs.S3FileSystem(**options)


#: S3A's server-side encryption algorithms that a Python write can ask for, as S3's ``x-amz-server-side-encryption``.
SSE_ARGUMENTS = {"SSE-S3": "AES256", "SSE-KMS": "aws:kms", "DSSE-KMS": "aws:kms:dsse"}


@functools.lru_cache(maxsize=None)
def _boto3_client(access: S3Access) -> Any:
    """One boto3 S3 client per access and process (a client is thread-safe, and costly to make)."""
    import boto3

    options: dict[str, Any] = {}
    if access.endpoint:
        options["endpoint_url"] = f"{access.scheme}://{access.endpoint}"
    if access.region:
        options["region_name"] = access.region
    if access.access_key and access.secret_key:
        options.update(aws_access_key_id=access.access_key, aws_secret_access_key=access.secret_key,
                       aws_session_token=access.session_token)
    if access.path_style:
        from botocore.config import Config

        options["config"] = Config(s3={"addressing_style": "path"})
    return boto3.client("s3", **options)


def hadoop_settings(spark_conf: Mapping[str, str]) -> dict[str, str]:
    """The Hadoop settings in Spark settings (``spark.hadoop.<key>`` -> ``<key>``), as Spark hands them to Hadoop."""
    return {k[len("spark.hadoop."):]: str(v) for k, v in spark_conf.items() if k.startswith("spark.hadoop.")}


def s3_access(spark: Any, uri: Optional[str]) -> Optional[S3Access]:
    """The :class:`S3Access` of ``uri``'s bucket that a classic session's Hadoop settings describe; None for a path
    that is not on S3 or a Spark Connect session (whose Hadoop settings are the server's)."""
    if not uri or not uri.startswith(S3_PREFIXES) or is_connect(spark):
        return None
    props = spark.sparkContext._jsc.hadoopConfiguration().getPropsWithPrefix("fs.s3a.")
    conf = {f"fs.s3a.{k}": v for k, v in props.items()}
    return S3Access.from_hadoop(conf, bucket_and_key(uri)[0])


def bucket_and_key(uri: str) -> tuple[str, str]:
    """The bucket and the object key of an object store's URI (``s3a://bucket/a/b`` -> ``bucket``, ``a/b``)."""
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    return bucket, key


class Refusal(str, Enum):
    """Why a store refused the job, each with what the user can change."""

    NO_BUCKET = "the bucket does not exist at the endpoint the job reaches (check the path, or the endpoint: " \
                "fs.s3a.endpoint, fs.s3a.bucket.<bucket>.endpoint or AWS_ENDPOINT_URL)"
    CREDENTIALS = "the store refused the credentials (check the access and secret key: fs.s3a.access.key and " \
                  "fs.s3a.secret.key, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, the credentials file, or the " \
                  "instance role; a session token that expired is refused the same way)"
    DENIED = "the store refused access (403): the credentials are wrong (a refused HEAD request does not say " \
             "which), or not allowed to do this (the key or role needs s3:ListBucket on the bucket, s3:GetObject to " \
             "read, s3:PutObject and s3:DeleteObject to write under the path)"
    GONE = "a file was deleted or replaced while the batch read it (restore it, or take it out of the input, and " \
           "run again: --resume keeps what was answered)"
    UNREACHABLE = "the store's endpoint cannot be reached (check the endpoint and the network between the cluster " \
                  "and it: fs.s3a.endpoint or AWS_ENDPOINT_URL)"
    ENCRYPTION = "the S3A connector knows no such encryption (set fs.s3a.encryption.algorithm, or " \
                 "fs.s3a.bucket.<bucket>.encryption.algorithm, to SSE-S3, SSE-KMS, DSSE-KMS, SSE-C or CSE-KMS, or " \
                 "leave it unset)"


class StoreFailure(NamedTuple):
    """A store's refusal read from a failure's text (:func:`store_failure`): the reason and the store's own words."""

    reason: Refusal
    detail: str

    def message(self, path: str, setting: str) -> str:
        return f"{setting} {path!r}: {self.reason.value}. The store said: {self.detail}"


#: The failures :func:`store_failure` knows, in the order it tries them, by what their text holds: the S3 error code
#: (AWS SDK, any client) or the Java exception that Hadoop's connectors (S3A, ABFS, GCS) and Spark raise.
_REFUSALS = (
    (Refusal.NO_BUCKET, re.compile(r"NoSuchBucket|UnknownStoreException|The specified bucket does not exist"
                                   r"|ContainerNotFound|FileSystem .* doesn't exist")),
    (Refusal.CREDENTIALS, re.compile(r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken"
                                     r"|NoAuthWithAWSException|No AWS Credentials|InvalidAuthenticationInfo")),
    (Refusal.DENIED, re.compile(r"AccessDenied|AuthorizationPermissionMismatch|403 Forbidden|Status Code: 403")),
    (Refusal.GONE, re.compile(r"FAILED_READ_FILE\.FILE_NOT_EXIST|java\.io\.FileNotFoundException")),
    (Refusal.ENCRYPTION, re.compile(r"Unknown encryption algorithm|Unknown Server Side Encryption method")),
    (Refusal.UNREACHABLE, re.compile(r"java\.net\.UnknownHostException|java\.net\.ConnectException"
                                     r"|Connection refused|Unable to execute HTTP request")),
)
#: The store's words kept in a message: the first line that names the refusal, at most this long.
_DETAIL_CHARS = 300


def store_failure(text: str) -> Optional[StoreFailure]:
    """The store's refusal that a failure's text (a Java stack as PySpark shows it, or a Python client's message)
    tells of; None for any other failure. Pure: the texts are all it reads."""
    for reason, pattern in _REFUSALS:
        if (found := pattern.search(text)) is not None:
            line = next(ln for ln in text.splitlines() if found.group(0) in ln).strip(" :\t")
            return StoreFailure(reason, line if len(line) <= _DETAIL_CHARS else line[:_DETAIL_CHARS] + "...")
    return None


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
    (through ``s3``, the S3A settings of the session, when they say where or how: :attr:`S3Access.reaches`; else
    pyarrow's own chain, ``AWS_ENDPOINT_URL`` among it), and what pyarrow understands (``gs://``,
    ``abfss://``, ``hdfs://``)."""
    from pyarrow import fs

    if s3 is not None and s3.reaches and uri.startswith(S3_PREFIXES):
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
