"""The batch service (``spark-llm serve``): OpenAI's Files and Batches API in front of the job, so that an OpenAI SDK
client pointed at its ``base_url`` uploads a JSONL file, creates a batch, polls it and downloads its output and error
files, and every batch runs as ``spark-llm run`` runs it.

- :mod:`.protocol`: OpenAI's shapes and error body;  :mod:`.lifecycle`: the batch statuses and their order;
- :mod:`.store`: file, upload and batch records, the leases of several servers (SQLAlchemy: SQLite, PostgreSQL);
- :mod:`.files`: the files' bytes and the streamed multipart upload;
- :mod:`.scheduler`: the Spark side: runs, stops, ends and resumes batches, by priority, under a lease;
- :mod:`.access`: who calls (keys, owners);  :mod:`.api`: the Files and Batches routes;  :mod:`.uploads`: the
  Uploads routes;  :mod:`.monitor`: health, readiness, Prometheus metrics;  :mod:`.audit`: the audit log;
  :mod:`.ui`: the dashboard;
- :mod:`.server`: the process.

Importing this package imports neither FastAPI nor Spark.
"""

from .lifecycle import Status
from .settings import ServiceSettings

__all__ = ["ServiceSettings", "Status", "serve"]


def serve(*args, **kwargs):  # noqa: D103 - documented in server.serve
    from .server import serve as _serve

    return _serve(*args, **kwargs)


serve.__doc__ = "Run the batch service until the process is told to stop; see spark_llm.service.server.serve."
