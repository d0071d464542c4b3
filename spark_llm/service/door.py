"""The front door: what every API call passes before a route reads it. A call under ``/v1/`` without one of the
server's keys is refused with 401 before a byte of its body is read, and a JSON body (every call but the multipart
uploads, whose parts stream to storage with limits of their own) is read here, at most ``max_json_bytes`` of it:
a larger one is refused with 413, so no client makes the server hold or parse more than that. Refusals carry
OpenAI's error body, as the routes' own do."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Mapping

from .access import key_owner, unknown_key
from .protocol import APIError

#: Largest JSON body a call may send: OpenAI's batch and upload requests are a few hundred bytes; metadata holds
#: at most 16 pairs of 64-character keys and 512-character values.
MAX_JSON_BYTES = 1 << 20


class FrontDoor:
    """Pure ASGI middleware (it sees the body as it arrives, which FastAPI's ``http`` middleware does not)."""

    def __init__(self, app: Any, keys: Callable[[], Mapping[str, str]], max_json_bytes: int = MAX_JSON_BYTES):
        self.app, self.keys, self.max_json_bytes = app, keys, max_json_bytes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        keys = self.keys()
        if keys and key_owner(keys, headers.get(b"authorization", b"").decode("latin-1")) is None:
            return await _refuse(send, unknown_key())
        if scope["method"] not in ("POST", "PUT", "PATCH") or headers.get(b"content-type", b"").startswith(
                b"multipart/"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"The request body is over {self.max_json_bytes:,} bytes, the most a JSON body "
                                  f"may be here.", code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_json_bytes:
            return await _refuse(send, too_large)
        body = bytearray()
        while True:  # the body read here, bounded (a chunked one has no length to refuse it by)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_json_bytes:
                return await _refuse(send, too_large)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, replay, send)


async def _refuse(send: Any, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


#: Bytes of a request's line and headers the server reads before it refuses them (431): OpenAI's clients send about
#: one kilobyte.
MAX_HEADER_BYTES = 64 * 1024


def uvicorn_config(app: Any, **settings: Any) -> Any:
    """The uvicorn settings the service runs ``app`` with: ``settings`` and the bounded HTTP protocol."""
    import uvicorn

    return uvicorn.Config(app, http=http_protocol(), **settings)


def http_protocol() -> Any:
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with the request line and headers bounded at
    :data:`MAX_HEADER_BYTES` (httptools, uvicorn's default where installed, reads headers of any size), and its
    refusal of a request it cannot read in OpenAI's error shape: 431 for headers over the bound, else 400."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
            self.refusal: Any = None
            next_event = self.conn.next_event

            def recording() -> Any:  # uvicorn drops h11's error, which says why (its error_status_hint)
                try:
                    return next_event()
                except h11.RemoteProtocolError as exc:
                    self.refusal = exc
                    raise
            self.conn.next_event = recording  # type: ignore[method-assign]

        def send_400_response(self, msg: str) -> None:
            status = getattr(self.refusal, "error_status_hint", 400)
            error = APIError(status, f"The request's line and headers are over {MAX_HEADER_BYTES:,} bytes." if
                             status == 431 else "The request is not valid HTTP/1.1.", code="invalid_http_request")
            body = json.dumps(error.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol
