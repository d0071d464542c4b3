"""OpenAI's webhook endpoints API (openai-python's ``client.webhooks.create`` / ``list`` / ``retrieve`` /
``update`` / ``delete`` / ``rotate_secret`` / ``test``): a key registers the URLs its batches' events go to, each
with a signing secret shown once. What is sent, and how, is :mod:`.delivery`; the hosts a URL may name are the
operator's (``webhook_hosts``)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from fastapi import APIRouter, Depends, Query, Request

from .access import new_id, owner, service_of
from .audit import audit
from .delivery import (OLD_SECRET_SECONDS, event_body, headers, new_secret, secret_hint, send, signing_secrets,
                       url_refused)
from .lifecycle import EVENT
from .protocol import (APIError, Page, WebhookEndpoint, WebhookEndpointCreate, WebhookEndpointDeleted,
                       WebhookEndpointTestResult, WebhookEndpointUpdate, WebhookEndpointWithSecret, WebhookEventTypes,
                       WebhookRotateSecret, WebhookTest)
from .store import WebhookEndpointRecord

#: The events this server sends: a batch's end.
EVENT_TYPES = tuple(EVENT.values())
#: Endpoints a key may register.
MAX_ENDPOINTS = 20

router = APIRouter()


def endpoint_object(record: WebhookEndpointRecord) -> WebhookEndpoint:
    return WebhookEndpoint(id=record.id, created_at=record.created_at, updated_at=record.updated_at, name=record.name,
                           url=record.url, event_types=list(record.event_types),
                           signing_secret_hint=secret_hint(record.secret))


def with_secret(record: WebhookEndpointRecord) -> WebhookEndpointWithSecret:
    return WebhookEndpointWithSecret(**endpoint_object(record).model_dump(), signing_secret=record.secret)


def _checked(request: Request, url: Optional[str], event_types: Optional[list[str]]) -> None:
    if url is not None:
        refused = url_refused(url, service_of(request).settings.webhook_hosts)
        if refused is not None:
            raise APIError.invalid(f"Invalid url: {refused}.", param="url")
    for type in event_types or ():
        if type not in EVENT_TYPES:
            raise APIError.invalid(f"Event type {type!r} is not sent by this server; it sends "
                                   f"{', '.join(EVENT_TYPES)}.", param="event_types")


def _own(request: Request, id: str, who: str) -> WebhookEndpointRecord:
    record = service_of(request).store.endpoint(id, who)
    if record is None:
        raise APIError.not_found("webhook endpoint", id)
    return record


@router.get("/webhook_event_types")
def event_types(who: str = Depends(owner)) -> WebhookEventTypes:
    return WebhookEventTypes(data=list(EVENT_TYPES))


@router.post("/webhook_endpoints")
def create_endpoint(request: Request, body: WebhookEndpointCreate,
                    who: str = Depends(owner)) -> WebhookEndpointWithSecret:
    _checked(request, body.url, body.event_types)
    store = service_of(request).store
    if len(store.endpoints(who, MAX_ENDPOINTS, None)[0]) >= MAX_ENDPOINTS:
        raise APIError.invalid(f"This key has {MAX_ENDPOINTS} webhook endpoints, its limit; delete one first.")
    now = int(time.time())
    record = WebhookEndpointRecord(id=new_id("we_"), owner=who, name=body.name, url=body.url,
                                   event_types=tuple(dict.fromkeys(body.event_types)), secret=new_secret(),
                                   created_at=now, updated_at=now)
    store.add_endpoint(record)
    audit("webhook_endpoint.created", owner=who, endpoint=record.id, url=record.url)
    return with_secret(record)


@router.get("/webhook_endpoints")
def list_endpoints(request: Request, who: str = Depends(owner), limit: int = Query(20, ge=1, le=100),
                   after: Optional[str] = None) -> Page[WebhookEndpoint]:
    records, more = service_of(request).store.endpoints(who, limit, after)
    return Page.of([endpoint_object(r) for r in records], more)


@router.get("/webhook_endpoints/{endpoint_id}")
def retrieve_endpoint(request: Request, endpoint_id: str, who: str = Depends(owner)) -> WebhookEndpoint:
    return endpoint_object(_own(request, endpoint_id, who))


@router.post("/webhook_endpoints/{endpoint_id}")
def update_endpoint(request: Request, endpoint_id: str, body: WebhookEndpointUpdate,
                    who: str = Depends(owner)) -> WebhookEndpoint:
    record = _own(request, endpoint_id, who)
    _checked(request, body.url, body.event_types)
    changes = {k: v for k, v in dict(name=body.name, url=body.url,
                                     event_types=tuple(dict.fromkeys(body.event_types or ())) or None).items()
               if v is not None and v != getattr(record, k)}
    if changes:  # an unchanged update does not move updated_at, as OpenAI's
        record = replace(record, **changes, updated_at=int(time.time()))
        service_of(request).store.update_endpoint(record)
        audit("webhook_endpoint.updated", owner=who, endpoint=record.id, url=record.url)
    return endpoint_object(record)


@router.delete("/webhook_endpoints/{endpoint_id}")
def delete_endpoint(request: Request, endpoint_id: str, who: str = Depends(owner)) -> WebhookEndpointDeleted:
    if not service_of(request).store.delete_endpoint(endpoint_id, who):
        raise APIError.not_found("webhook endpoint", endpoint_id)
    audit("webhook_endpoint.deleted", owner=who, endpoint=endpoint_id)
    return WebhookEndpointDeleted(id=endpoint_id)


@router.post("/webhook_endpoints/{endpoint_id}/rotate_secret")
def rotate_secret(request: Request, endpoint_id: str, body: Optional[WebhookRotateSecret] = None,
                  who: str = Depends(owner)) -> WebhookEndpointWithSecret:
    """A new secret; the old one goes on signing (beside it) for 24 hours when asked, else it ends now."""
    record = _own(request, endpoint_id, who)
    now = int(time.time())
    keep = body is not None and body.keep_old_secret_active_for_24_hours
    record = replace(record, secret=new_secret(), updated_at=now, old_secret=record.secret if keep else None,
                     old_secret_until=now + OLD_SECRET_SECONDS if keep else None)
    service_of(request).store.update_endpoint(record)
    audit("webhook_endpoint.secret_rotated", owner=who, endpoint=record.id, old_kept=keep)
    return with_secret(record)


@router.post("/webhook_endpoints/{endpoint_id}/test")
def test_endpoint(request: Request, endpoint_id: str, body: WebhookTest,
                  who: str = Depends(owner)) -> WebhookEndpointTestResult:
    """Send the endpoint one event of ``event_type`` now, about a batch id that names no batch, and say what the
    receiver answered (a receiver out of reach is a 400 that says why)."""
    record = _own(request, endpoint_id, who)
    _checked(request, record.url, [body.event_type])
    now = time.time()
    event_id = new_id("evt_test_")
    payload = event_body(event_id, body.event_type, new_id("batch_test_"), int(now))
    attempt = send(record.url, payload, headers(signing_secrets(record, now), event_id, int(now), payload))
    audit("webhook.test", owner=who, endpoint=record.id, type=body.event_type, status=attempt.status)
    if attempt.status is None:
        raise APIError.invalid(f"The endpoint's URL could not be reached: {attempt.error}.", param="url",
                               code="webhook_unreachable")
    return WebhookEndpointTestResult(webhook_endpoint_id=record.id, event_type=body.event_type,
                                     status_code=attempt.status)
