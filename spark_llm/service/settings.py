"""The batch service's own settings (``spark-llm serve --help`` is generated from their descriptions); the model,
engine and Spark settings are ``spark-llm run``'s, shared by every batch the server runs."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from ..config import ConfigError

#: Environment variable holding API keys (comma-separated) when no --api-keys file is given.
API_KEYS_ENV = "SPARK_LLM_API_KEYS"
#: The owner of every file and batch of a server without keys.
NO_KEY_OWNER = "local"
_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on. Without API keys only a loopback address is "
                      "allowed.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port, printed at start).")
    api_keys: Optional[str] = Field(
        None, description=f"File with the API keys clients may use, one a line (or the environment variable "
        f"{API_KEYS_ENV}, comma-separated). Every request then needs 'Authorization: Bearer <key>', and each key "
        "sees only its own files and batches.")
    storage: str = Field(
        "spark_llm_service", description="Storage root: uploaded files, each batch's output and error files and "
        "report, and the shared Delta tables (<storage>/tables/outputs, errors, metrics, embeddings, partitioned "
        "by batch_id). A local directory or a URI the job reads and writes (s3a://, abfss://, ...).")
    database_url: Optional[str] = Field(
        None, description="SQLAlchemy URL of the database holding file and batch records; default a SQLite file "
        "<storage>/service.db. postgresql+psycopg://... for a database several servers share.")
    max_running_batches: int = Field(
        1, ge=1, description="Batches run at once; the others wait their turn in order of creation. Batches run "
        "at once share the engines.")
    max_file_bytes: int = Field(200 * 1000 * 1000, ge=1, description="Largest batch input file accepted (OpenAI: "
                                "200 MB).")
    completion_windows: str = Field(
        "24h", description="completion_window values a batch may give, comma-separated durations (30s, 10m, 24h, "
        "2d; OpenAI accepts only 24h). A batch not done by then ends as expired: its answers in the output file, "
        "the rest as batch_expired lines in the error file.")
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
        if self.database_url:
            return self.database_url
        if "://" in self.storage and not self.storage.startswith("file:"):
            raise ConfigError("a storage root that is not a local directory needs --database-url (the SQLite "
                              "default lives under the storage root)")
        return f"sqlite:///{Path(self.storage.removeprefix('file:')).absolute() / 'service.db'}"

    def keys(self) -> dict[str, str]:
        """API key -> owner id (a hash of the key: the database never holds a key). Empty: no keys."""
        if self.api_keys:
            try:
                lines = Path(self.api_keys).read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise ConfigError(f"cannot read the API keys file {self.api_keys}: {exc.strerror}") from None
            keys = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
            if not keys:
                raise ConfigError(f"the API keys file {self.api_keys} holds no key")
        else:
            keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        return {key: "key-" + hashlib.sha256(key.encode()).hexdigest()[:16] for key in keys}

    def check(self) -> None:
        """Refuse settings a server must not start with."""
        self.windows()
        self.database()
        if not self.keys() and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(f"--host {self.host} without API keys would open the service to anyone who reaches "
                              f"this machine; give --api-keys FILE (or {API_KEYS_ENV}) or listen on 127.0.0.1")
