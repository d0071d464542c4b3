"""The front door: what every API call passes before a route reads it. A call under ``/v1/`` without one of the
server's keys is refused with 401 before a byte of its body is read, and a JSON body (every call but the multipart
uploads, whose parts stream to storage with limits of their own) is read here, at most ``max_json_bytes`` of it:
a larger one is refused with 413, so no client makes the server hold or parse more than that. Refusals carry
OpenAI's error body, as the routes' own do."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Mapping

from .access import key_owner
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
            return await _refuse(send, APIError(401, "Incorrect API key provided. Give one of this server's keys as "
                                                     "'Authorization: Bearer <key>'.", code="invalid_api_key"))
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
