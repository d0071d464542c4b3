"""Inference over whole partitions with the engine of the task's GPUs.

One ``mapInPandas`` task hands its entire partition to its slot's engine (:mod:`~spark_llm.engine_host`) in one
streamed call, beside the slot's other feeder (``tasks_per_engine``), so vLLM's continuous batching keeps the device
busy; each row's endpoint module (:mod:`~spark_llm.endpoints`)
turns its outputs into the OpenAI response body. A request the engine rejects becomes that request's
``engine_error`` row (the failing batch is bisected to find it). A request that kills the engine is found and set
aside by :mod:`~spark_llm.engine_host.isolation` (the engine is rebuilt in place; a dead worker's task is retried by
Spark and its next attempt reads the partition's journal), so it becomes one ``engine_error`` row and the rest
completes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from . import faults
from .audio import measure as measure_audio
from .config import PRIORITIES, config_view
from .endpoints import BY_KIND, Classes, Reply, moderations
from .endpoints.common import ResponseOptions, with_request_seed
from .engine_host.client import EngineClient, engine_for
from .engine_host.isolation import MAX_ENGINE_REBUILDS, Journal, isolation_plan, quarantine_message
from .engine_host.placement import TaskPlace, task_gpus
from .engine_host.protocol import (AudioClip, EngineDied, EngineFaulted, EngineGone, EngineRequest, Parse,
                                   RequestFailure)
from .engine_host.spec import EngineSpec, ProcessSettings
from .errors import ErrorCode, RequestError, truncate
from .filesystems import S3Access, s3_access
from .media import AUDIO, MediaPolicy, label, read_media
from .schemas import RESULT_FIELDS, PartitionRecord

if TYPE_CHECKING:
    from .context import RunContext

log = logging.getLogger(__name__)

#: The ``system_fingerprint`` of an answer of the engine stand-in, before its profile's name.
STANDIN_FINGERPRINT = "spark-llm-standin:"


@dataclass(frozen=True)
class InferContext:
    engine: EngineSpec
    served_model_name: str
    batch_id: str
    process: ProcessSettings
    wave: int = 0
    metrics: Any = None  # a Spark accumulator of per-partition records for the progress line (see metrics.py), or None
    journal: Optional[str] = None  #: where partitions keep their quarantine journals (see engine_host/isolation.py)
    journal_s3: Optional[S3Access] = None  #: how the tasks reach the journal's bucket (a journal on S3)
    run_id: str = ""               #: the run (an engine that cannot start is not tried again within it)
    #: planned partitions of the run before this model's (a batch of several models numbers them across its models)
    partition_offset: int = 0
    priority: int = 1  #: the batch's turn in the engines it shares (0 most urgent: config.PRIORITIES' index)
    #: where the inference tasks feed engines (:attr:`~spark_llm.engine_host.placement.EngineLayout.place`); the
    #: task adds the GPUs Spark gives it
    place: TaskPlace = TaskPlace()
    media: MediaPolicy = MediaPolicy()  #: where the requests' images are read from
    classes: Classes = Classes()  #: a classifier's labels and what they mean for moderation

    @classmethod
    def of_run(cls, run: "RunContext", partition_offset: int = 0) -> "InferContext":
        """The inference tasks' context of a run of one model (``run.cfg``), its partitions numbered after
        ``partition_offset`` (the run's earlier models')."""
        from .models import class_labels, local_copy

        cfg = run.cfg
        labels = class_labels(local_copy(cfg.model, weights=False)) if cfg.model else ()
        return cls(engine=EngineSpec.from_config(cfg), served_model_name=cfg.served_model_name or "",
                   batch_id=run.batch_id, process=config_view(ProcessSettings, cfg), metrics=run.metrics,
                   journal=f"{run.paths.staging}/quarantine/{run.run_id}", run_id=run.run_id,
                   journal_s3=s3_access(run.spark, run.paths.staging),
                   partition_offset=partition_offset, place=run.layout.place,
                   priority=PRIORITIES.index(cfg.priority), media=MediaPolicy.of(cfg),
                   classes=moderations.classes(labels, cfg.moderation_labels, cfg.moderation_threshold))

    @property
    def simulated(self) -> Optional[str]:
        """The engine stand-in answering this model's requests (``engine_standin``), or None for vLLM."""
        return self.engine.standin

    @property
    def request_seeds(self) -> Optional[int]:
        """The batch's seed when sampled requests get seeds of their own (``sampling_seeds: request``), else None."""
        settings = self.engine.settings
        return settings.seed if settings.sampling_seeds == "request" else None

    def partition(self, pdf: Any) -> int:
        """The run's number of the partition ``pdf`` (its planned partition, after the earlier models')."""
        return int(pdf["_part"].iat[0]) + self.partition_offset if "_part" in pdf else -1


# ---- the partition function ------------------------------------------------------------------------------------

def infer_partition(batches: Iterator, ctx: InferContext) -> Iterator:
    """mapInPandas body: every request of the partition in one streamed engine call, each row answered as soon as
    its requests finish while the engine goes on with the rest; one result row per input row."""
    import pandas as pd

    started = time.time()
    frames = [pdf for pdf in batches if len(pdf)]
    if not frames:
        return
    pdf = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    n = len(pdf)
    rows = [_base_row(pdf, i, ctx) for i in range(n)]
    options = [ResponseOptions.from_json(x) for x in pdf["options_json"]]
    kinds = list(pdf["kind"])
    inputs = _engine_requests(pdf, options, ctx.media, ctx.request_seeds)
    requests, owner = inputs.requests, inputs.owner

    def answer(i: int, outputs: list) -> None:
        rows[i]["model"] = options[i].adapter or ctx.served_model_name
        reply = Reply(rows[i]["request_id"], rows[i]["model"], int(time.time()), options[i], ctx.classes,
                      inputs.audio_seconds.get(i))
        _answer(rows[i], outputs, kinds[i], reply, ctx.simulated)
    for i, failure in inputs.unreadable.items():  # an image gone or changed since its tokens were counted
        answer(i, [failure])
    gpus = task_gpus(ctx.engine.tensor_parallel_size)
    journal = Journal.open(ctx.journal, ctx.partition(pdf), ctx.journal_s3)
    with engine_for(ctx.engine, ctx.process, ctx.place.with_gpus(gpus), ctx.run_id) as engine:
        engine.priority = ctx.priority
        t0, engine_started = time.monotonic(), time.time()
        guarded = generate_guarded(engine, requests, owner, pdf, journal, answer)
        engine_s = time.monotonic() - t0 - engine.rebuild_seconds
        engine_finished = time.time()
    log.info("partition: %d requests in %.1fs on engine %s (load %.1fs)", n, engine_s, engine.slot.name,
             engine.load_seconds)
    faults.maybe_kill_worker(set(pdf["custom_id"]))
    for i in guarded.quarantined:
        rows[i].update(error_code=ErrorCode.ENGINE_ERROR.value, error_message=quarantine_message(guarded.deaths))
    unanswered = [i for i, r in enumerate(rows) if r["response_body"] is None and r["error_code"] is None]
    if unanswered:  # the conservation check: every request of the partition has a response or an error
        raise AssertionError(f"{len(unanswered)} of {n} requests got neither a response nor an error")
    results = guarded.results
    cached = sum(r.num_cached_tokens for r in results if r is not None and not isinstance(r, RequestFailure))
    record = replace(_metrics_record(ctx, pdf, rows, (started, engine_s), engine, gpus),
                     cached_prompt_tokens=cached, engine_deaths=guarded.deaths,
                     engine_started_at=engine_started, engine_finished_at=engine_finished)
    if ctx.metrics is not None:  # the live progress line (classic sessions)
        ctx.metrics.add([record])
    rows[0]["partition_metrics"] = record.to_json()  # the metrics table, from the staged results
    out = pd.DataFrame(rows, columns=list(RESULT_FIELDS))
    for col in ("line_number", "prompt_tokens", "completion_tokens", "total_tokens", "created"):
        out[col] = out[col].astype("Int64")
    yield out


@dataclass(frozen=True)
class Guarded:
    """A partition's engine results: per engine request its output or failure (None for quarantined rows)."""

    results: list
    quarantined: set[int]  #: rows set aside as poison requests
    deaths: int            #: engine deaths on record for the partition (earlier attempts' and this one's)


def generate_guarded(engine: EngineClient, requests: list, owner: list[int], pdf: Any,
                     journal: Optional[Journal], on_row: Callable[[int, list], None]) -> Guarded:
    """All requests of the partition through the engine, in one streamed call unless deaths are on record;
    ``on_row(i, outputs)`` as soon as every request of row ``i`` has its result. A call during which the engine
    dies is recorded as a death, the engine rebuilt, and the rows not answered yet replanned
    (:func:`~spark_llm.engine_host.isolation.isolation_plan`). While deaths are on record the partition runs alone on
    the engine (:meth:`~spark_llm.engine_host.EngineClient.alone`): a death during its calls is then its own, never
    a request of the slot's other feeder."""
    rows = _PartitionCalls(requests, owner, pdf, journal, on_row)
    deaths = journal.deaths() if journal is not None else []
    gone = 0  # engines found gone before a call: not deaths
    faulted = False  # an engine failed every request alike under this task (EngineFaulted)
    while True:
        plan = isolation_plan(rows.unanswered(), deaths)
        if plan.isolating:
            log.warning("partition: %d engine death(s) on record; isolating in %d calls, %d request(s) set aside",
                        len(deaths), len(plan.calls), len(plan.quarantined))
        call: list[str] = []
        try:
            with engine.alone() if deaths else contextlib.nullcontext():
                for call in plan.calls:
                    rows.run(engine, call)
        except EngineGone as exc:  # lost before the call (under the slot's other feeder): nothing was in flight
            rows.not_in_flight()
            gone += 1
            if gone > 4 * MAX_ENGINE_REBUILDS:
                raise
            log.info("partition: %s; starting or finding the slot's next engine", str(exc).splitlines()[0])
            engine.rebuild(died=False)
            continue
        except EngineFaulted as exc:  # no request is to blame: the call runs again on a new engine, once
            rows.not_in_flight()
            if faulted:
                raise engine.failed_for_run(f"{exc}, also after the engine was rebuilt") from None
            faulted = True
            log.warning("partition: %s; rebuilding the engine", str(exc).splitlines()[0])
            engine.rebuild(died=False)
            continue
        except EngineDied as exc:
            deaths.append(frozenset(call))
            if engine.rebuilds >= MAX_ENGINE_REBUILDS:
                raise
            log.warning("partition: the engine died with %d request(s) in flight (%s); rebuilding it", len(call),
                        str(exc).splitlines()[0])
            engine.rebuild()
            continue
        return Guarded(rows.results, {rows.row_of[r] for r in plan.quarantined}, len(deaths))


class _PartitionCalls:
    """A partition's rows and their engine requests (a row may have several: one per prompt), answered call by
    call; each call is marked in flight in the journal while it runs (a death in it blames its requests)."""

    def __init__(self, requests: list, owner: list[int], pdf: Any, journal: Optional[Journal],
                 on_row: Callable[[int, list], None]):
        self.requests, self.owner, self.journal, self.on_row = requests, owner, journal, on_row
        self.ids = [str(x) for x in pdf["id"]]
        self.custom_ids = [str(x) for x in pdf["custom_id"]]
        self.row_of = {rid: i for i, rid in enumerate(self.ids)}
        self.by_row: dict[int, list[int]] = {}
        for j, i in enumerate(owner):
            self.by_row.setdefault(i, []).append(j)
        self.results: list = [None] * len(requests)
        # rows without requests were answered before (an unreadable image)
        self.done: set[str] = {r for i, r in enumerate(self.ids) if i not in self.by_row}
        self.marker: Any = None  #: the journal's in-flight marker of the call running

    def unanswered(self) -> list[str]:
        return [r for r in self.ids if r not in self.done]

    def run(self, engine: EngineClient, call: list[str]) -> None:
        """One streamed engine call of ``call``'s rows; each row answered as soon as all its requests are."""
        rows = [self.row_of[r] for r in call]
        idx = [j for i in rows for j in self.by_row[i]]
        left = {i: len(self.by_row[i]) for i in rows}

        def got(k: int, out: Any) -> None:
            j = idx[k]
            self.results[j] = out
            i = self.owner[j]
            left[i] -= 1
            if not left[i]:
                self.done.add(self.ids[i])
                self.on_row(i, [self.results[x] for x in self.by_row[i]])
        self.marker = self.journal.mark(call) if self.journal is not None else None
        custom_ids = {self.custom_ids[i] for i in rows}
        faults.before_engine_call(custom_ids)
        engine.stream([self.requests[j] for j in idx], got,
                      starting=lambda: faults.engine_call_starting(custom_ids, engine.info.pid))
        self.not_in_flight()

    def not_in_flight(self) -> None:
        """The call's marker cleared: it ended, or it failed with no request to blame."""
        if self.marker is not None:
            self.journal.clear(self.marker)
            self.marker = None


@dataclass(frozen=True)
class _EngineInputs:
    """A partition's engine requests and what the answers need of how they were made."""

    requests: list[EngineRequest]
    owner: list[int]                          #: the row each request belongs to
    unreadable: dict[int, RequestFailure]     #: rows whose media could not be read (no request: their failure)
    audio_seconds: dict[int, float]           #: rows with a clip: its length, for the answer's usage


def _engine_requests(pdf: Any, options: list[ResponseOptions], media: MediaPolicy,
                     batch_seed: Optional[int] = None) -> _EngineInputs:
    """One engine request per prompt of every row (its endpoint's task, the prompt's token ids, the settings,
    what the engine should parse out of the answer, the adapter and, for a row with images, their bytes, read here
    and decoded by the engine). With ``batch_seed``, a sampled prompt without a seed gets its own
    (:func:`~spark_llm.endpoints.common.with_request_seed`)."""
    inputs = _EngineInputs([], [], {}, {})
    for i, (kind, sampling_json, prompts, custom_id) in enumerate(zip(pdf["kind"], pdf["sampling_json"],
                                                                     pdf["prompt_token_ids"], pdf["custom_id"])):
        endpoint, opts = BY_KIND[kind], options[i]
        sampling = json.loads(sampling_json)
        parse = Parse(endpoint.PARSE_REASONING, opts.tools if opts.tool_choice == "auto" else None, opts.echo_prompt)
        urls = opts.images or []
        try:
            images = tuple(read_media(u, media, label(k, len(urls), u)) for k, u in enumerate(urls))
            clip = _audio_clip(opts, media)
        except RequestError as exc:
            inputs.unreadable[i] = RequestFailure("media", exc.message, exc.code.value)
            continue
        if clip is not None:
            inputs.audio_seconds[i] = clip.seconds
        seeded = batch_seed is not None and endpoint.TASK.generates
        for k, ids in enumerate(prompts):
            ids = ids.tolist() if hasattr(ids, "tolist") else [int(t) for t in ids]
            params = with_request_seed(sampling, batch_seed, str(custom_id), k) if seeded else sampling
            inputs.requests.append(EngineRequest(ids, params, endpoint.TASK, parse, opts.adapter, images,
                                                 clip.clip if clip is not None else None))
            inputs.owner.append(i)
    return inputs


@dataclass(frozen=True)
class _ReadClip:
    clip: AudioClip
    seconds: float


def _audio_clip(options: ResponseOptions, media: MediaPolicy) -> Optional[_ReadClip]:
    """A transcription's audio as read, for its model's rate (decoded by the engine), and its length (the
    answer's usage is in seconds). None for a request without audio."""
    if options.audio is None:
        return None
    data = read_media(options.audio, media, "the request's audio", AUDIO)
    seconds = measure_audio(data, "the request's audio").seconds
    return _ReadClip(AudioClip(data, int(options.sample_rate or 0)), seconds)


def _answer(row: dict, outputs: list, kind: str, reply: Reply, simulated: Optional[str] = None) -> None:
    """Fill a result row from its engine outputs: the endpoint's response body, or the first failure's error. An
    answer of the engine stand-in (``simulated``: its setting) says so in the row's notes and, where the response
    has one, its ``system_fingerprint``."""
    failure = next((o for o in outputs if isinstance(o, RequestFailure)), None)
    if failure is not None:
        if failure.code is not None:  # a bad image or audio file
            row.update(error_code=failure.code, error_message=truncate(failure.message, 1000))
        elif failure.kind == "invalid":
            row.update(error_code=ErrorCode.INVALID_REQUEST.value,
                       error_message=f"request parameters rejected by the engine: {failure.message}")
        else:
            row.update(error_code=ErrorCode.ENGINE_ERROR.value, error_message=truncate(failure.message, 1000))
        return
    answer = BY_KIND[kind].respond(outputs, reply)
    if simulated:
        if "system_fingerprint" in answer.body:
            answer.body["system_fingerprint"] = f"{STANDIN_FINGERPRINT}{simulated.split(',')[0]}"
        note = f"simulated answer of the engine stand-in {simulated!r}, not of a model"
        row["notes"] = f"{note}; {row['notes']}" if row["notes"] else note
    row.update(
        text=answer.text, finish_reason=answer.finish_reason, created=reply.created,
        tool_calls=json.dumps(answer.tool_calls, ensure_ascii=False) if answer.tool_calls else None,
        reasoning=answer.reasoning, embeddings=answer.embeddings, flagged=answer.flagged, labels=answer.labels,
        scores=answer.scores, category_scores=answer.category_scores,
        prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens,
        total_tokens=answer.prompt_tokens + answer.completion_tokens,
        response_body=json.dumps(answer.body, ensure_ascii=False, separators=(",", ":")),
    )


def _base_row(pdf: Any, i: int, ctx: InferContext) -> dict:
    row = dict.fromkeys(RESULT_FIELDS)
    row.update(id=pdf["id"].iat[i], custom_id=pdf["custom_id"].iat[i], file=pdf["file"].iat[i],
               line_number=int(pdf["line_number"].iat[i]), endpoint=pdf["url"].iat[i],
               request_id=pdf["request_id"].iat[i],
               model=ctx.served_model_name, request=pdf["request"].iat[i], notes=pdf["notes"].iat[i],
               prompt_tokens=int(pdf["prompt_tokens"].iat[i]))
    return row


def _metrics_record(ctx: InferContext, pdf: Any, rows: list, times: tuple[float, float], engine: EngineClient,
                    gpus: Optional[list[str]]) -> PartitionRecord:
    started, engine_s = times
    ok = [r for r in rows if r["error_code"] is None]
    errors: dict[str, int] = {}
    for r in rows:
        if r["error_code"] is not None:
            errors[r["error_code"]] = errors.get(r["error_code"], 0) + 1
    p_tok = sum(r["prompt_tokens"] for r in ok)
    c_tok = sum(r["completion_tokens"] for r in ok)
    return PartitionRecord(
        wave=ctx.wave, partition=ctx.partition(pdf), model=ctx.served_model_name, worker_pid=os.getpid(),
        rows=len(rows), prompt_tokens=p_tok, completion_tokens=c_tok, engine_load_seconds=round(engine.load_seconds, 3),
        engine_seconds=round(engine_s, 3), engine_slot=engine.slot.name, engine_pid=engine.info.pid,
        gpus=",".join(gpus or []), tokens_per_second=round((p_tok + c_tok) / engine_s, 1) if engine_s > 0 else 0.0,
        errors_by_code=json.dumps(errors, sort_keys=True), started_at=started, finished_at=time.time())
