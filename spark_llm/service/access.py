"""Who is calling and what the routes work with: the :class:`Service` (settings, store, file storage, scheduler,
keys) and the caller's owner id from their API key, shared by every router of the API."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Mapping, Optional

from fastapi import Request

from .files import FileStorage
from .protocol import APIError
from .scheduler import Scheduler
from .settings import NO_KEY_OWNER, ServiceSettings
from .store import BatchRecord, FileRecord, Store


@dataclass(frozen=True)
class Service:
    """What the routes work with."""

    settings: ServiceSettings
    store: Store
    files: FileStorage
    scheduler: Scheduler

    @property
    def keys(self) -> dict[str, str]:
        """API key -> owner id, as the keys file says now; empty: no keys, one owner."""
        return self.settings.keys()


def service_of(request: Request) -> Service:
    return request.app.state.service


def key_owner(keys: Mapping[str, str], authorization: str) -> Optional[str]:
    """The owner id of the key an ``Authorization`` header gives (``Bearer <key>``), or None for no known key."""
    scheme, _, key = authorization.partition(" ")
    return keys.get(key.strip()) if scheme.lower() == "bearer" else None


def owner(request: Request) -> str:
    """The caller's owner id, from ``Authorization: Bearer <key>`` (401 without a known key; the front door,
    :mod:`.door`, has refused such a call already)."""
    keys = service_of(request).keys
    if not keys:
        return NO_KEY_OWNER
    who = key_owner(keys, request.headers.get("authorization", ""))
    if who is None:
        raise unknown_key()
    return who


def unknown_key() -> APIError:
    """The refusal of a call without one of the server's keys, as OpenAI answers it (401)."""
    return APIError(401, "Incorrect API key provided. Give one of this server's keys as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def own_file(request: Request, id: str, who: str) -> FileRecord:
    """The caller's file ``id``: 404 when it does not exist or is another key's (the two look the same)."""
    record = service_of(request).store.file(id, owner=who)
    if record is None:
        raise APIError.not_found("file", id)
    return record


def own_batch(request: Request, id: str, who: str) -> BatchRecord:
    """The caller's batch ``id``: 404 when it does not exist or is another key's."""
    record = service_of(request).store.batch(id, owner=who)
    if record is None:
        raise APIError.not_found("batch", id)
    return record
