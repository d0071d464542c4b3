"""The batch object (``batch.json``, shaped as OpenAI's ``Batch``) and what :func:`spark_llm.run_batch` returns."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from .config import ConfigError
from .errors import BatchStopped, EngineStartError, ErrorCode, describe_exception

if TYPE_CHECKING:
    from .context import RunContext, RunPaths

#: errors.data codes of a batch that stopped (row-level problems never stop a batch).
BATCH_FAILURE_CODES = {EngineStartError: "engine_start_failed", ConfigError: "invalid_config"}
#: A batch the service refused before it ran: its key's unfinished batches hold more input tokens than its limit
#: (OpenAI's code for the same).
TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"


#: finish_unanswered (the code its unanswered requests get) -> the status of the batch it ends.
ENDED_AS = {ErrorCode.BATCH_CANCELLED.value: "cancelled", ErrorCode.BATCH_EXPIRED.value: "expired"}


def _ended_at(status: str, now: int) -> dict[str, int]:
    """The timestamps a batch ending with ``status`` gets (a cancel also sets when it began cancelling)."""
    return {"completed": {"completed_at": now}, "failed": {"failed_at": now}, "expired": {"expired_at": now},
            "cancelled": {"cancelling_at": now, "cancelled_at": now}}[status]


def failure_reason(exc: BaseException) -> "BatchError":
    """The ``errors.data`` entry of a batch that ``exc`` stopped."""
    code = next((c for t, c in BATCH_FAILURE_CODES.items() if isinstance(exc, t)), "batch_failed")
    return BatchError(code=code, message=describe_exception(exc))


def stopped_status(exc: BaseException) -> Optional[str]:
    """The status of a batch whose run ``exc`` stopped on purpose: ``cancelled`` (Ctrl-C, SIGTERM, a cancel) or
    ``expired``; None for a failure."""
    if isinstance(exc, BatchStopped):
        return exc.status
    return "cancelled" if isinstance(exc, KeyboardInterrupt) else None


@dataclass(frozen=True)
class Tally:
    """Request and token counts of a batch, from its tables."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = {"cached_tokens": 0}
    output_tokens: int
    output_tokens_details: dict[str, int] = {"reasoning_tokens": 0}
    total_tokens: int


class BatchError(BaseModel):
    """One ``errors.data`` entry: a line without a usable custom_id, or why the batch failed."""

    code: str
    message: str
    param: Optional[str] = None
    line: Optional[int] = None
    file: Optional[str] = None  # spark_llm's own: the input file of ``line``


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = []
    total: int = 0  # spark_llm's own: how many there are in all (data is bounded)


class Batch(BaseModel):
    """OpenAI's batch object, as openai-python's ``openai.types.Batch`` defines it: the one definition of a batch,
    from which the job's ``batch.json`` (:class:`BatchObject`), the batch service's API object and its stored
    record and table (:class:`spark_llm.service.store.BatchRecord`) follow."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: Optional[str] = None
    errors: Optional[BatchErrors] = None
    input_file_id: str
    completion_window: str = "24h"
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    created_at: int
    in_progress_at: Optional[int] = None
    expires_at: Optional[int] = None
    finalizing_at: Optional[int] = None
    completed_at: Optional[int] = None
    failed_at: Optional[int] = None
    expired_at: Optional[int] = None
    cancelling_at: Optional[int] = None
    cancelled_at: Optional[int] = None
    request_counts: RequestCounts
    usage: Optional[Usage] = None
    metadata: Optional[dict[str, str]] = None


class BatchObject(Batch):
    """The job's ``batch.json``: a :class:`Batch` that has ended, with every field a finished run knows filled in,
    plus spark_llm's ``partition_plan``. Made by :meth:`completed` or :meth:`failed`."""

    model: str
    errors: BatchErrors
    status: Literal["completed", "failed", "cancelled", "expired"]
    output_file_id: str
    error_file_id: str
    usage: Usage
    metadata: dict[str, str]  # OpenAI's metadata is a map of strings: the table and report locations
    partition_plan: Optional[dict[str, Any]] = None  # spark_llm's own: how requests were spread over partitions

    @staticmethod
    def _common(run: "RunContext") -> dict[str, Any]:
        cfg, paths = run.cfg, run.paths
        models = run.models or (cfg,)
        return dict(id=run.batch_id, model=",".join(m.served_model_name or "" for m in models),
                    input_file_id=cfg.input or cfg.input_table or "",
                    output_file_id=paths.output_file, error_file_id=paths.error_file, created_at=run.created_at,
                    metadata={"outputs_table": paths.outputs_table, "errors_table": paths.errors_table,
                              "metrics_table": paths.metrics_table, "report_file": paths.report_file,
                              **({"embeddings_table": paths.embeddings_table} if run.has_embeddings else {})})

    @classmethod
    def completed(cls, run: "RunContext", tally: Tally, errors: BatchErrors, endpoint: str,
                  plan: Optional[dict], in_progress_at: int) -> "BatchObject":
        """Every request has its row: ``completed``, or ``cancelled`` / ``expired`` when the run ended the batch
        early (``finish_unanswered``)."""
        now = int(time.time())
        status = ENDED_AS.get(run.cfg.finish_unanswered or "", "completed")
        return cls(**cls._common(run), status=status, endpoint=endpoint, errors=errors,
                   in_progress_at=in_progress_at, finalizing_at=now, **_ended_at(status, now),
                   request_counts=RequestCounts(total=tally.completed + tally.failed, completed=tally.completed,
                                                failed=tally.failed),
                   usage=Usage(input_tokens=tally.input_tokens, output_tokens=tally.output_tokens,
                               total_tokens=tally.input_tokens + tally.output_tokens),
                   partition_plan=plan)

    @classmethod
    def failed(cls, run: "RunContext", exc: BaseException) -> "BatchObject":
        """A batch that stopped (rerun with --resume to continue): ``failed`` with the reason in ``errors.data``,
        or ``cancelled`` / ``expired`` when it was stopped on purpose (Ctrl-C, SIGTERM, :class:`BatchStopped`)."""
        now = int(time.time())
        status = stopped_status(exc)
        if status is None:
            status, errors = "failed", BatchErrors(data=[failure_reason(exc)], total=1)
        else:
            errors = BatchErrors()
        return cls(**cls._common(run), status=status, endpoint="", **_ended_at(status, now), errors=errors,
                   request_counts=RequestCounts(total=0, completed=0, failed=0),
                   usage=Usage(input_tokens=0, output_tokens=0, total_tokens=0))

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


@dataclass(frozen=True)
class BatchResult:
    """What :func:`spark_llm.run_batch` returns: the batch object, where everything is, and how many requests an
    earlier run had already answered (``--resume``)."""

    batch: BatchObject
    paths: "RunPaths"
    skipped: int = 0

    batch_id = property(lambda self: self.batch.id)
    status = property(lambda self: self.batch.status)
    total = property(lambda self: self.batch.request_counts.total)
    completed = property(lambda self: self.batch.request_counts.completed)
    failed = property(lambda self: self.batch.request_counts.failed)
    input_tokens = property(lambda self: self.batch.usage.input_tokens)
    output_tokens = property(lambda self: self.batch.usage.output_tokens)
    total_tokens = property(lambda self: self.batch.usage.total_tokens)
    output_dir = property(lambda self: self.paths.output_dir)
    outputs_table = property(lambda self: self.paths.outputs_table)
    errors_table = property(lambda self: self.paths.errors_table)
    output_file = property(lambda self: self.paths.output_file)
    error_file = property(lambda self: self.paths.error_file)
    batch_file = property(lambda self: self.paths.batch_file)

    def summary(self) -> str:
        resumed = f" ({self.skipped} already answered before this run)" if self.skipped else ""
        plan = self.batch.partition_plan or {}
        busy = plan.get("busy_fraction")
        engines = (f"  engines busy {busy:.1%} of their time ({plan['engine_seconds']:.1f} s engine time over "
                   f"{plan['inference_wall_seconds']:.1f} s of inference, {plan['runs']} run(s))\n"
                   if busy is not None else "")
        return (f"batch {self.batch_id}: {self.status}; {self.total} requests, {self.completed} completed, "
                f"{self.failed} failed{resumed}; tokens in {self.input_tokens}, out {self.output_tokens}\n{engines}"
                f"  outputs table: {self.outputs_table}\n  errors table:  {self.errors_table}\n"
                f"  output file:   {self.output_file}\n  error file:    {self.error_file}\n"
                f"  batch object:  {self.batch_file}")
