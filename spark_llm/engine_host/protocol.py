"""What crosses an engine's Unix socket, defined once for both ends: the messages, their version, and the plain
records a request's answer travels as (picklable, no vLLM needed to read them).

A task's connection (:mod:`~spark_llm.engine_host.client`) carries calls, one after another::

    task -> engine   (Ask.PING,)                          is the engine still here for a call?
    engine -> task   (Reply.OK, None) | (Reply.GONE, why)
    task -> engine   (Ask.STREAM, n, priority)             a call of n requests (priority: 0 most urgent) ...
    task -> engine   (Ask.ADD, [(index, request), ...])    ... sent in chunks of STREAM_CHUNK
    engine -> task   (Reply.RESULTS, [(index, Output | RequestFailure), ...])   as requests finish
    engine -> task   (Reply.DONE, None) | (Reply.DEAD, why) | (Reply.FAULT, why) | (Reply.GONE, why)
                     | (Reply.ERROR, why)

or one ``(Ask.SHUTDOWN,)`` (another engine needs the devices: the server stops once the calls under way end). A
request is an :class:`EngineRequest`; its answer an :class:`Output` of its :class:`EngineTask`, or a
:class:`RequestFailure`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, NamedTuple, Optional

#: Version of what crosses the socket, part of every engine's key: a task never talks to an engine server of an
#: older spark_llm that may still be running on the host.
PROTOCOL = 9
#: Requests per message of a streamed call: the engine starts on the first chunk while the rest are on their way.
STREAM_CHUNK = 256


class Ask:
    """Messages a task sends its engine."""

    PING = "ping"
    STREAM = "stream"
    ADD = "add"
    SHUTDOWN = "shutdown"


class Reply:
    """Messages an engine sends a task."""

    OK = "ok"
    GONE = "gone"        #: the engine was gone or stopping before the call's requests reached it
    RESULTS = "results"
    DONE = "done"
    DEAD = "dead"        #: the engine died with the call in flight
    FAULT = "fault"      #: the engine failed every request it was given the same way (not the requests' fault)
    ERROR = "error"      #: a fault of the engine server, not of a request: the call's requests got no answer


class EngineTask(str, Enum):
    """What an engine does with a request: vLLM's generation, or one of its pooling tasks. Each endpoint module names
    the task it needs (``TASK``); the engine server calls vLLM for it (a pooling task: :data:`POOLING_CALLS`)."""

    GENERATE = "generate"
    EMBED = "embed"
    CLASSIFY = "classify"  #: a sequence classifier's class probabilities (moderations, classify, score, rerank)
    TRANSCRIBE = "transcribe"  #: a speech-to-text model's text of an audio clip (transcriptions, translations)

    @property
    def generates(self) -> bool:
        """Whether an engine generates tokens for it (vLLM's ``generate``), rather than pooling."""
        return self in (EngineTask.GENERATE, EngineTask.TRANSCRIBE)

    @property
    def runner(self) -> str:
        """The vLLM runner of the engines that do this task (``runner`` in the settings): generate or pooling."""
        return "generate" if self.generates else "pooling"


#: The ``vllm.LLM`` method that does each pooling task, over whole calls (a new pooling task is a line here).
POOLING_CALLS = {EngineTask.EMBED: "embed", EngineTask.CLASSIFY: "classify"}


class Parse(NamedTuple):
    """What the engine parses out of a generated answer (:class:`~spark_llm.endpoints.engine_side.Parsers`)."""

    reasoning: bool = False             #: split the reasoning from the answer (the endpoint's PARSE_REASONING)
    tools: Optional[list[dict]] = None  #: the request's tools, when it lets the model call them: find the calls
    echo: bool = False  #: give the prompt back as text (:attr:`Output.prompt_text`; completions' ``echo``)


class AudioClip(NamedTuple):
    """An audio file as read (WAV, or what ``soundfile`` reads), and the sampling rate its model hears at: the
    engine decodes it to that rate (:func:`~spark_llm.audio.decode_clip`)."""

    data: bytes
    sample_rate: int


class EngineRequest(NamedTuple):
    """One prompt of a request, as it crosses to the engine (a named tuple: it pickles as cheaply as a tuple)."""

    token_ids: list[int]
    params: dict[str, Any]  #: SamplingParams (generate) or PoolingParams (pooling tasks) keyword arguments, as JSON
    task: EngineTask = EngineTask.GENERATE
    parse: Parse = Parse()
    adapter: Optional[str] = None  #: the LoRA adapter to run it with (None: the base model)
    images: tuple[bytes, ...] = ()  #: the request's images as read, decoded by the engine
    #: the audio a speech-to-text model's encoder hears (:attr:`EngineTask.TRANSCRIBE`); token_ids: its decoder's
    audio: Optional[AudioClip] = None


@dataclass(frozen=True)
class SlotRecord:
    """A slot's record of its engine server (:mod:`~spark_llm.engine_host.directory`): ``<slot>.starting`` while it
    starts, ``<slot>.json`` once it listens, which the tasks read to connect to it, or to stop it. A process is named
    by its pid with its start time, so that a pid the kernel gave another process since is never taken for it."""

    pid: int
    pid_started: Optional[int] = None  #: :func:`~spark_llm.host.process_start_time` of ``pid``
    key: str = ""                      #: the engine's settings (:attr:`~spark_llm.engine_host.spec.EngineSpec.key`)
    devices: tuple[str, ...] = ()
    launcher: Optional[int] = None     #: the process that forked this one for the slot (CPU slots started together)
    started_at: Optional[float] = None
    authkey: Optional[str] = None      #: the socket's key: set once the server listens
    load_seconds: float = 0.0          #: how long the engine took to load

    @property
    def listening(self) -> bool:
        """A ready server's record (it has a socket key), not a starting one's."""
        return self.authkey is not None

    @classmethod
    def of(cls, data: Optional[dict]) -> Optional["SlotRecord"]:
        """The record in a slot file's JSON, or None for none or one that names no process."""
        if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
            return None
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "devices": tuple(str(d) for d in data.get("devices") or ())})

    def as_json(self) -> dict:
        return {k: list(v) if k == "devices" else v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class SlotStats:
    """A running engine server's busy seconds so far (``<slot>.stats``; their rate is its busy fraction)."""

    pid: int
    busy_seconds: float

    @classmethod
    def of(cls, data: Optional[dict]) -> Optional["SlotStats"]:
        if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
            return None
        return cls(data["pid"], float(data.get("busy_seconds") or 0.0))


@dataclass
class TokenLogprob:
    logprob: float
    rank: Optional[int]
    decoded_token: Optional[str]


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[dict[int, TokenLogprob]]] = None
    #: set by the engine's parsers (:class:`~spark_llm.endpoints.engine_side.Parsers`) when ``parsed``
    parsed: bool = False
    content: Optional[str] = None           #: the answer: text without the reasoning and the tool-call markup
    reasoning: Optional[str] = None
    reasoning_tokens: int = 0
    tool_calls: Optional[list[dict]] = None  #: [{"name", "arguments"}] found by the tool-call parser


@dataclass
class Output:
    """One request's answer, shaped like vLLM's ``RequestOutput`` as far as the response bodies read it: the choices
    of a generation, or a pooling task's result (``task`` says which)."""

    prompt_token_ids: list[int]
    outputs: list[Choice]
    num_cached_tokens: int = 0  #: prompt tokens served from vLLM's prefix cache
    task: EngineTask = EngineTask.GENERATE
    prompt_text: Optional[str] = None  #: the prompt decoded, when the request asked to have it echoed
    embedding: Optional[list[float]] = None  #: :attr:`EngineTask.EMBED`'s answer
    #: :attr:`EngineTask.CLASSIFY`'s answer: a probability per class of the model (its ``id2label`` order), after the
    #: activation its config asks for (sigmoid for multi-label classifiers, else softmax)
    probs: Optional[list[float]] = None

    @classmethod
    def of(cls, out: Any, task: EngineTask = EngineTask.GENERATE) -> "Output":
        """vLLM's answer to a request of ``task`` as plain data: a ``RequestOutput``, or the ``PoolingRequestOutput``
        of a pooling task (``EmbeddingRequestOutput``, ``ClassificationRequestOutput``)."""
        def logprobs(c: Any) -> Optional[list[dict[int, TokenLogprob]]]:
            if c.logprobs is None:
                return None
            return [{int(t): TokenLogprob(float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in pos.items()}
                    for pos in c.logprobs]

        prompt, cached = list(out.prompt_token_ids or []), int(getattr(out, "num_cached_tokens", 0) or 0)
        if task is EngineTask.EMBED:
            return cls(prompt, [], cached, task, embedding=[float(x) for x in out.outputs.embedding])
        if task is EngineTask.CLASSIFY:
            return cls(prompt, [], cached, task, probs=[float(x) for x in out.outputs.probs])
        # a transcription's prompt_token_ids are its decoder's (vLLM keeps the encoder's apart)
        return cls(prompt, [Choice(c.index, c.text, list(c.token_ids), c.finish_reason, logprobs(c))
                            for c in out.outputs], cached, task)


@dataclass
class RequestFailure:
    """Why one request got no output: ``invalid`` sampling settings, an ``engine`` error on this request, or a bad
    ``image`` or audio file (``code``: its error code, :data:`~spark_llm.media.IMAGE_CODES`, ``audio_*``)."""

    kind: str
    message: str
    code: Optional[str] = None


class EngineDied(RuntimeError):
    """The engine process died (or its engine is dead) during a call: the requests in flight got no answer."""


class EngineFaulted(RuntimeError):
    """The engine failed every request it was given the same way, alone as together, and ended: a setting or state
    of the engine's, not a request, is at fault, so no request is suspected; the engine is rebuilt once, and a second
    such failure stops the batch with it."""


class EngineGone(RuntimeError):
    """The engine was gone, or on its way out, before a call's requests reached it (its slot's other feeder's
    request killed it, say): the task starts or finds another engine and makes the call again; no request of the
    call was in flight, so none of them is suspected."""
