"""The batch service's own settings (``spark-llm serve --help`` is generated from their descriptions); the model,
engine and Spark settings are ``spark-llm run``'s, shared by every batch the server runs."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from ..config import PRIORITIES, ConfigError

log = logging.getLogger(__name__)

#: Environment variable holding API keys (comma-separated) when no --api-keys file is given.
API_KEYS_ENV = "SPARK_LLM_API_KEYS"
#: The owner of every file and batch of a server without keys.
NO_KEY_OWNER = "local"
_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


#: The last good read of each keys file (with the defaults its policies were made with): its stamp and policies.
_KEYS_READ: dict[tuple, tuple[tuple, dict[str, "KeyPolicy"]]] = {}


@dataclass(frozen=True)
class KeyPolicy:
    """What a key may do (options after the key on its line of the keys file: ``priority=low weight=2
    max_queued_batches=10 max_enqueued_tokens=5000000``; else the server's defaults)."""

    owner: str
    priority: str = "normal"
    max_queued_batches: Optional[int] = None
    max_enqueued_tokens: Optional[int] = None
    #: the key's turns in each round of the queue over the keys at one priority (:func:`.queue.queue_order`)
    weight: int = 1


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on. Without API keys only a loopback address is "
                      "allowed.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port, printed at start).")
    api_keys: Optional[str] = Field(
        None, description=f"File with the API keys clients may use, one a line (or the environment variable "
        f"{API_KEYS_ENV}, comma-separated). Every request then needs 'Authorization: Bearer <key>', and each key "
        "sees only its own files and batches. A key's line may add its default priority, its weight in the "
        "queue (turns per round among the keys of one priority) and limits: "
        "'sk-... priority=low weight=2 max_queued_batches=10 max_enqueued_tokens=5000000'.")
    storage: str = Field(
        "spark_llm_service", description="Storage root: uploaded files, each batch's output and error files and "
        "report, and the shared Delta tables (<storage>/tables/outputs, errors, metrics, embeddings, partitioned "
        "by batch_id). A local directory or a URI the job reads and writes (s3a://, abfss://, ...).")
    database_url: Optional[str] = Field(
        None, description="SQLAlchemy URL of the database holding file and batch records; default a SQLite file "
        "<storage>/service.db. postgresql://user:password@host/db for a database several servers share (they also "
        "share --storage).")
    max_running_batches: int = Field(
        1, ge=1, description="Batches run at once; the others wait their turn in order of creation. Batches run "
        "at once share the engines.")
    max_yield_seconds: float = Field(
        600.0, ge=0, description="Longest the running batches pause for a high-priority one: when it starts, their "
        "inference waves in flight are cancelled and submitted again when it ends or after this long, whichever "
        "comes first (their commits go on; the cancelled tasks' work is lost). A batch that yielded runs at least "
        "one more wave before it yields again. 0: high-priority batches only share the task slots as they free.")
    max_file_bytes: int = Field(200 * 1000 * 1000, ge=1, description="Largest batch input file accepted (OpenAI: "
                                "200 MB).")
    upload_idle_seconds: float = Field(60.0, gt=0, description="An upload (a file, or a part of a chunked upload) "
                                       "that sends nothing for this long is refused with 408 and nothing of it is "
                                       "kept, so a stalled client does not hold a connection and a temporary file.")
    completion_windows: str = Field(
        "24h", description="completion_window values a batch may give, comma-separated durations (30s, 10m, 24h, "
        "2d; OpenAI accepts only 24h). A batch not done by then ends as expired: its answers in the output file, "
        "the rest as batch_expired lines in the error file.")
    audit_log: Optional[str] = Field(
        None, description="File the audit log is appended to: a JSON line per API call and per batch transition "
        "(key id, action, batch, counts, reason). Default <storage>/audit.jsonl for a local storage root; 'off' to "
        "keep none.")
    server_id: Optional[str] = Field(
        None, description="This server's name among the servers that share the database (default: host name and "
        "process id). Each batch is run by one server at a time, which holds a lease on it.")
    lease_seconds: float = Field(
        30.0, ge=2, description="How long a server's hold on a batch lasts without renewal (renewed every "
        "lease_seconds/6 while it runs the batch): a server that dies loses its batches after this long, and another "
        "server resumes them. A server that cannot renew for this long stops running them.")
    max_queued_batches: Optional[int] = Field(
        None, ge=1, description="Unfinished batches a key may have at once (default: no limit); over it "
        "batches.create answers 429. A key's own line in the keys file may say otherwise.")
    max_enqueued_tokens: Optional[int] = Field(
        None, ge=1, description="Input tokens a key's unfinished batches may hold at once, estimated as a file's "
        "bytes / 4 (OpenAI's enqueued token limit; default: no limit): a batch over it fails with "
        "token_limit_exceeded, as OpenAI's does. A key's own line in the keys file may say otherwise.")
    max_partition_tokens: int = Field(
        200_000, ge=1, description="Estimated tokens a partition of the service's batches holds at most (the job's "
        "target_tokens_per_partition, capped): a partition keeps its task slot until it is done, so smaller ones let "
        "a high-priority batch in sooner.")
    webhook_hosts: Optional[str] = Field(
        None, description="Hosts a key's webhook endpoints may point to, comma-separated (a name or address, with "
        "':port' to allow that port only); default none, so no endpoint can be registered. A URL must be https "
        "unless its host is a loopback address. Redirects are not followed.")
    webhook_retry_seconds: float = Field(
        5.0, gt=0, description="Wait before a failed webhook delivery is tried again, doubled at each failure (at "
        "most an hour); the same event id each time, so receivers drop repeats.")
    webhook_retry_for_seconds: float = Field(
        72 * 3600.0, gt=0, description="How long a webhook delivery is tried before it is given up (audited as "
        "webhook.given_up); OpenAI retries for 72 hours.")
    max_runs: int = Field(2, ge=1, description="Runs of a batch before a failing one is given up as failed (each "
                          "later run resumes the one before; bad settings and an engine that cannot start fail at "
                          "once).")

    def windows(self) -> dict[str, int]:
        """Accepted completion windows -> seconds."""
        out = {}
        for text in (w.strip() for w in self.completion_windows.split(",")):
            match = _DURATION.match(text)
            if not match:
                raise ConfigError(f"completion_windows: {text!r} is not a duration like 24h, 30m or 90s")
            out[text] = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        return out

    def database(self) -> str:
        if self.database_url:  # postgresql://... means psycopg 3, the driver the serve extra installs
            return re.sub(r"^postgres(ql)?://", "postgresql+psycopg://", self.database_url)
        local = self.local_storage()
        if local is None:
            raise ConfigError("a storage root that is not a local directory needs --database-url (the SQLite "
                              "default lives under the storage root)")
        return f"sqlite:///{local / 'service.db'}"

    def audit_path(self) -> Optional[str]:
        """Where the audit log goes, or None."""
        if self.audit_log == "off":
            return None
        if self.audit_log:
            return self.audit_log
        local = self.local_storage()
        return str(local / "audit.jsonl") if local is not None else None

    def local_storage(self) -> Optional[Path]:
        """The storage root as a local directory, or None when it is a URI of another filesystem."""
        if "://" in self.storage and not self.storage.startswith("file:"):
            return None
        return Path(self.storage.removeprefix("file:")).absolute()

    def server(self) -> str:
        """This server's name in the leases it holds."""
        return self.server_id or f"{socket.gethostname()}-{os.getpid()}"

    def keys(self) -> dict[str, str]:
        """API key -> owner id (a hash of the key: the database never holds a key). Empty: no keys."""
        return {key: policy.owner for key, policy in self.policies().items()}

    def policy(self, owner: str) -> KeyPolicy:
        """The policy of the key whose owner id is ``owner`` (the server's defaults for a server without keys)."""
        for policy in self.policies().values():
            if policy.owner == owner:
                return policy
        return KeyPolicy(owner, max_queued_batches=self.max_queued_batches,
                         max_enqueued_tokens=self.max_enqueued_tokens)

    def policies(self) -> dict[str, KeyPolicy]:
        """API key -> its :class:`KeyPolicy`. Empty: no keys. The keys file is read again when it changes (its
        modification time, size or inode), so a key added works at its next call, a key removed is refused at its
        next, and edited limits apply, without a restart; the keys and their policies always come from one read.
        An edit that does not parse leaves the last good read in force (logged)."""
        if not self.api_keys:
            return dict(self._policy(k.strip()) for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip())
        cache = (self.api_keys, self.max_queued_batches, self.max_enqueued_tokens)
        last = _KEYS_READ.get(cache)
        try:
            stat = os.stat(self.api_keys)
            stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if last is not None and last[0] == stamp:
                return last[1]
            lines = Path(self.api_keys).read_text(encoding="utf-8").splitlines()
            keys = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
            if not keys:
                raise ConfigError(f"the API keys file {self.api_keys} holds no key")
            policies = dict(self._policy(line) for line in keys)
        except (OSError, ConfigError) as exc:
            why = (f"cannot read the API keys file {self.api_keys}: {exc.strerror}" if isinstance(exc, OSError)
                   else str(exc))
            if last is None:
                raise ConfigError(why) from None
            log.warning("keys file: %s; the keys read before stay in force", why)
            return last[1]
        _KEYS_READ[cache] = (stamp, policies)
        return policies

    def _policy(self, line: str) -> tuple[str, KeyPolicy]:
        key, *options = line.split()
        given: dict[str, str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name not in ("priority", "weight", "max_queued_batches", "max_enqueued_tokens"):
                raise ConfigError(f"keys file: {option!r} after a key is not priority=, weight=, "
                                  "max_queued_batches= or max_enqueued_tokens=")
            given[name] = value
        if given.get("priority", "normal") not in PRIORITIES:
            raise ConfigError(f"keys file: priority must be one of {', '.join(PRIORITIES)}, not {given['priority']!r}")
        try:
            limits = {name: int(given[name]) if name in given else getattr(self, name)
                      for name in ("max_queued_batches", "max_enqueued_tokens")}
            weight = int(given.get("weight", 1))
        except ValueError:
            raise ConfigError("keys file: weight, max_queued_batches and max_enqueued_tokens are whole "
                              "numbers") from None
        if weight < 1:
            raise ConfigError(f"keys file: weight is 1 or more (a key's turns in each round), not {weight}")
        owner = "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return key, KeyPolicy(owner, given.get("priority", "normal"), weight=weight, **limits)

    def check(self) -> None:
        """Refuse settings a server must not start with."""
        self.windows()
        self.database()
        if not self.keys() and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(f"--host {self.host} without API keys would open the service to anyone who reaches "
                              f"this machine; give --api-keys FILE (or {API_KEYS_ENV}) or listen on 127.0.0.1")
