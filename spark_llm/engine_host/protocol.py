"""What crosses an engine's Unix socket, defined once for both ends: the messages, their version, and the plain
records a request's answer travels as (picklable, no vLLM needed to read them).

A task's connection (:mod:`~spark_llm.engine_host.client`) carries calls, one after another::

    task -> engine   (Ask.PING,)                          is the engine still here for a call?
    engine -> task   (Reply.OK, None) | (Reply.GONE, why)
    task -> engine   (Ask.STREAM, n, priority)             a call of n requests (priority: 0 most urgent) ...
    task -> engine   (Ask.ADD, [(index, request), ...])    ... sent in chunks of STREAM_CHUNK
    engine -> task   (Reply.RESULTS, [(index, Output | RequestFailure), ...])   as requests finish
    engine -> task   (Reply.DONE, None) | (Reply.DEAD, why) | (Reply.GONE, why) | (Reply.ERROR, why)

or one ``(Ask.SHUTDOWN,)`` (another engine needs the devices: the server stops once the calls under way end). A
request is ``(prompt token ids, SamplingParams keyword arguments, what to parse out of the answer)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: Version of what crosses the socket, part of every engine's key: a task never talks to an engine server of an
#: older spark_llm that may still be running on the host.
PROTOCOL = 5
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
    ERROR = "error"      #: a fault of the engine server, not of a request: the call's requests got no answer


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
    """One request's answer, shaped like vLLM's ``RequestOutput`` as far as the response bodies read it."""

    prompt_token_ids: list[int]
    outputs: list[Choice]
    num_cached_tokens: int = 0  #: prompt tokens served from vLLM's prefix cache
    embedding: Optional[list[float]] = None  #: a pooling engine's answer

    @classmethod
    def of(cls, out: Any) -> "Output":
        """vLLM's ``RequestOutput`` (or ``EmbeddingRequestOutput``) as plain data."""
        def logprobs(c: Any) -> Optional[list[dict[int, TokenLogprob]]]:
            if c.logprobs is None:
                return None
            return [{int(t): TokenLogprob(float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in pos.items()}
                    for pos in c.logprobs]

        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        if hasattr(out.outputs, "embedding"):  # EmbeddingRequestOutput: one vector, no choices
            return cls(prompt_token_ids=list(out.prompt_token_ids or []), outputs=[], num_cached_tokens=cached,
                       embedding=[float(x) for x in out.outputs.embedding])
        return cls(prompt_token_ids=list(out.prompt_token_ids or []),
                   outputs=[Choice(c.index, c.text, list(c.token_ids), c.finish_reason, logprobs(c))
                            for c in out.outputs],
                   num_cached_tokens=cached)


@dataclass
class RequestFailure:
    """Why one request got no output: ``invalid`` sampling settings, an ``engine`` error on this request, or a bad
    ``image`` (``code``: its error code, :data:`~spark_llm.media.IMAGE_CODES`)."""

    kind: str
    message: str
    code: Optional[str] = None


class EngineDied(RuntimeError):
    """The engine process died (or its engine is dead) during a call: the requests in flight got no answer."""


class EngineGone(RuntimeError):
    """The engine was gone, or on its way out, before a call's requests reached it (its slot's other feeder's
    request killed it, say): the task starts or finds another engine and makes the call again; no request of the
    call was in flight, so none of them is suspected."""
