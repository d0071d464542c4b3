"""The audit log: one JSON line per API call and per batch transition (who, what, which batch or file, counts,
why), on the logger ``spark_llm.audit``, which ``spark-llm serve`` writes to ``<storage>/audit.jsonl`` (or
``--audit-log``) and nowhere else."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..host import private_file

logger = logging.getLogger("spark_llm.audit")


def audit(action: str, **fields: Any) -> None:
    """Record ``action`` (``api``, ``batch.completed`` ...) with ``fields`` (None values left out)."""
    if logger.isEnabledFor(logging.INFO):
        record = {"time": round(time.time(), 3), "action": action, **{k: v for k, v in fields.items() if v is not None}}
        logger.info(json.dumps(record, default=str, separators=(",", ":")))


def write_to(path: str) -> logging.Handler:
    """Send the audit lines to the file ``path`` (appended; made readable by this user only), not to the server's
    console."""
    private_file(path)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler
