"""The batch object (``batch.json``, shaped as OpenAI's ``Batch``) and what :func:`spark_llm.run_batch` returns."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, field_validator, model_serializer

from .config import ConfigError
from .errors import BatchStopped, EngineStartError, ErrorCode, describe_exception

if TYPE_CHECKING:
    from .context import RunContext, RunPaths
    from .metrics import EngineUsage


class Status(str, Enum):
    """OpenAI's ``Batch.status``: the values, once; which may follow which is spark_llm.service.lifecycle's."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


#: The statuses a batch ends in: a run's batch.json has one of them.
ENDED = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.EXPIRED})

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


class RunPlan(BaseModel):
    """``partition_plan`` of batch.json: how a run spread its requests over partitions and waves
    (spark_llm.partition, spark_llm.waves) and, once its partitions have their records, how busy the engines were
    (:func:`spark_llm.metrics.engine_usage`). A batch of several models has each model's plan under ``models``.
    Fields without a value are left out of the JSON: a rerun that had nothing left to infer has no partitions,
    only its earlier runs' engine usage."""

    model_config = ConfigDict(extra="forbid")

    num_partitions: Optional[int] = None
    task_slots: Optional[int] = None     #: inference tasks that ran at once
    engines: Optional[int] = None        #: engines those tasks fed
    total_estimated_tokens: Optional[int] = None
    target_tokens_per_partition: Optional[int] = None
    tokens_per_partition: Optional[list[int]] = None
    requests_per_partition: Optional[list[int]] = None
    balance_ratio: Optional[float] = None  #: max / mean estimated tokens over the partitions
    waves: Optional[int] = None
    models: Optional[dict[str, "RunPlan"]] = None
    runs: Optional[int] = None
    partitions_run: Optional[int] = None
    engine_seconds: Optional[float] = None
    inference_wall_seconds: Optional[float] = None
    busy_fraction: Optional[float] = None
    engine_tokens_per_second: Optional[float] = None
    prefix_cache_hit_rate: Optional[float] = None

    @model_serializer(mode="wrap")
    def _without_nones(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}

    def with_usage(self, usage: "EngineUsage") -> "RunPlan":
        """This plan with the engine usage of its partitions' records (metrics.engine_usage)."""
        return RunPlan.model_validate({**self.model_dump(), **dataclasses.asdict(usage)})

    @classmethod
    def joined(cls, plans: Sequence["RunPlan"]) -> "RunPlan":
        """Plans made one after the other in a run (its models', or the parts of an input prepared in parts) as
        one, their partitions in the order they ran."""
        tokens = [t for p in plans for t in p.tokens_per_partition]
        mean = sum(tokens) / len(tokens) if tokens else 0
        return cls(num_partitions=len(tokens), task_slots=max(p.task_slots for p in plans),
                   engines=max(p.engines for p in plans),
                   total_estimated_tokens=sum(p.total_estimated_tokens for p in plans),
                   target_tokens_per_partition=plans[0].target_tokens_per_partition, tokens_per_partition=tokens,
                   requests_per_partition=[r for p in plans for r in p.requests_per_partition],
                   balance_ratio=round(max(tokens) / mean, 4) if mean else 1.0, waves=sum(p.waves for p in plans))

    @classmethod
    def of_models(cls, plans: dict[str, "RunPlan"]) -> "RunPlan":
        """The plans of several models as one (partitions in the order they ran), each model's under ``models``."""
        return cls.joined(list(plans.values())).model_copy(update={"models": plans})


class Batch(BaseModel):
    """OpenAI's batch object, as openai-python's ``openai.types.Batch`` defines it: the one definition of a batch,
    from which the job's ``batch.json`` (:class:`BatchObject`), the batch service's API object and its stored
    record and table (:class:`spark_llm.service.store.BatchRecord`) follow."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True)  # status as its value: "completed"

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: Optional[str] = None
    errors: Optional[BatchErrors] = None
    input_file_id: str
    completion_window: str = "24h"
    status: Status
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
    status: Status  #: one of ENDED (_ended)
    output_file_id: str
    error_file_id: str
    usage: Usage
    metadata: dict[str, str]  # OpenAI's metadata is a map of strings: the table and report locations
    partition_plan: Optional[RunPlan] = None  # spark_llm's own: how requests were spread over partitions

    @field_validator("status")
    @classmethod
    def _ended(cls, v: Any) -> Any:
        if Status(v) not in ENDED:
            raise ValueError(f"a batch.json is written when its batch has ended, not while it is {Status(v).value}")
        return v

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
                  plan: Optional[RunPlan], in_progress_at: int) -> "BatchObject":
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
        plan = self.batch.partition_plan
        busy = plan.busy_fraction if plan is not None else None
        engines = (f"  engines busy {busy:.1%} of their time ({plan.engine_seconds:.1f} s engine time over "
                   f"{plan.inference_wall_seconds:.1f} s of inference, {plan.runs} run(s))\n"
                   if busy is not None else "")
        return (f"batch {self.batch_id}: {self.status}; {self.total} requests, {self.completed} completed, "
                f"{self.failed} failed{resumed}; tokens in {self.input_tokens}, out {self.output_tokens}\n{engines}"
                f"  outputs table: {self.outputs_table}\n  errors table:  {self.errors_table}\n"
                f"  output file:   {self.output_file}\n  error file:    {self.error_file}\n"
                f"  batch object:  {self.batch_file}")
