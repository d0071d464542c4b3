"""Webhook delivery, as OpenAI's Batch API sends its events: when a batch ends, a ``batch.completed`` /
``batch.failed`` / ``batch.expired`` / ``batch.cancelled`` event goes to each endpoint its key registered for that
type (:mod:`.webhooks`), signed the Standard Webhooks way, so ``client.webhooks.unwrap`` of openai-python (or the
``standardwebhooks`` library) verifies it with the endpoint's secret.

At least once: the event is written in the transaction that makes the batch final (the store's outbox), and a
delivery stays pending until the receiver answers 2xx, tried again with a doubling wait until
``webhook_retry_for_seconds`` have passed. Each attempt has the event's id as ``webhook-id``, so a receiver drops a
repeat. Several servers share the outbox: each attempt is claimed by one (a compare-and-set on its count)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import threading
import time
from typing import NamedTuple, Optional
from urllib.parse import urlsplit

from ..errors import describe_exception
from .audit import audit
from .settings import ServiceSettings
from .store import Delivery, Store, WebhookEndpointRecord

log = logging.getLogger(__name__)

#: Seconds between the sender's looks for deliveries due.
SEND_TICK_SECONDS = 1.0
#: Seconds a receiver has to answer one delivery.
SEND_TIMEOUT_SECONDS = 10.0
#: Longest wait between two attempts of a delivery.
MAX_RETRY_SECONDS = 3600.0
#: How long a rotated secret still signs when the rotation asked to keep it (OpenAI: 24 hours).
OLD_SECRET_SECONDS = 24 * 3600


class Attempt(NamedTuple):
    """What one attempt came to: the receiver's status (None: no answer) and why it failed (None: it did not)."""

    status: Optional[int]
    error: Optional[str]

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def new_secret() -> str:
    """A signing secret in Standard Webhooks' form: ``whsec_`` and 32 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    """What the API shows of a secret after its creation: its prefix and last four characters."""
    return f"whsec_...{secret[-4:]}"


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """One ``webhook-signature`` value: ``v1,`` and the base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}`` under the
    secret's bytes (base64 after ``whsec_``)."""
    key = base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") else secret.encode()
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signing_secrets(endpoint: WebhookEndpointRecord, now: float) -> list[str]:
    """The secrets that sign a delivery to ``endpoint`` at ``now``: its own, and a rotated one still kept."""
    kept = endpoint.old_secret if endpoint.old_secret and (endpoint.old_secret_until or 0) > now else None
    return [endpoint.secret] + ([kept] if kept else [])


def headers(secrets_: list[str], message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of a delivery: Standard Webhooks' three (one signature per secret, space-separated)."""
    return {"content-type": "application/json", "user-agent": "spark_llm-webhooks", "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(s, message_id, timestamp, body) for s in secrets_)}


def event_body(event_id: str, type: str, batch_id: str, created_at: int) -> bytes:
    """The event as OpenAI sends it (openai-python's ``BatchCompletedWebhookEvent`` and its siblings)."""
    return json.dumps({"id": event_id, "object": "event", "created_at": created_at, "type": type,
                       "data": {"id": batch_id}}, separators=(",", ":")).encode()


def url_refused(url: str, allowed_hosts: Optional[str]) -> Optional[str]:
    """Why a webhook may not be sent to ``url`` under the operator's ``allowed_hosts`` (the ``webhook_hosts``
    setting: names or addresses, ``host:port`` for one port only), or None: it may. https is required unless the
    host is a loopback address; a URL with credentials in it is refused."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return f"{url!r} is not a URL"
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        return f"{url!r} is not an http(s) URL"
    if parts.username or parts.password:
        return "a webhook URL may not hold credentials"
    if parts.scheme == "http" and not _loopback(host):
        return "a webhook URL must be https (http only for a loopback host)"
    allowed = {h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip()}
    if host not in allowed and f"{host}:{port or (443 if parts.scheme == 'https' else 80)}" not in allowed:
        return (f"this server sends webhooks only to the hosts its operator allows (--webhook-hosts), and {host} "
                "is not one of them")
    return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def next_attempt_at(event_created_at: float, attempts: int, now: float, first_wait: float,
                    retry_for: float) -> Optional[float]:
    """When a delivery that failed its ``attempts``-th attempt at ``now`` is tried again: ``first_wait`` after the
    first failure, doubling with each (at most :data:`MAX_RETRY_SECONDS`); None once that would be past
    ``retry_for`` seconds after the event: it is given up."""
    at = now + min(first_wait * 2 ** (attempts - 1), MAX_RETRY_SECONDS)
    return at if at - event_created_at <= retry_for else None


def send(url: str, body: bytes, head: dict[str, str], timeout: float = SEND_TIMEOUT_SECONDS) -> Attempt:
    """POST one delivery; redirects are not followed (the allowed host is the one that receives)."""
    import httpx

    try:
        response = httpx.post(url, content=body, headers=head, timeout=timeout, follow_redirects=False)
    except httpx.HTTPError as exc:
        return Attempt(None, describe_exception(exc) or type(exc).__name__)
    if 200 <= response.status_code < 300:
        return Attempt(response.status_code, None)
    return Attempt(response.status_code, f"the receiver answered {response.status_code}")


class Sender:
    """Sends the deliveries due in ``store`` from a thread of its own, one after another."""

    def __init__(self, store: Store, settings: ServiceSettings):
        self.store, self.settings = store, settings
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spark_llm-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = SEND_TIMEOUT_SECONDS + 5) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.send_due(time.time())
            except Exception as exc:  # the database out of reach: the next look tries again
                log.warning("webhooks: %s; trying again", describe_exception(exc))
            self._stopping.wait(SEND_TICK_SECONDS)

    def send_due(self, now: float) -> int:
        """Try each delivery due at ``now`` once; the number tried."""
        tried = 0
        for delivery in self.store.due_deliveries(now, limit=100):
            if self._stopping.is_set():
                break
            if self.store.claim_delivery(delivery, until=time.time() + SEND_TIMEOUT_SECONDS + 30):
                self._attempt(delivery)
                tried += 1
        return tried

    def _attempt(self, delivery: Delivery) -> None:
        endpoint, attempt_no = delivery.endpoint, delivery.attempts + 1
        facts = dict(owner=endpoint.owner, endpoint=endpoint.id, event=delivery.event_id, type=delivery.type,
                     batch=delivery.batch_id, attempt=attempt_no)
        refused = url_refused(endpoint.url, self.settings.webhook_hosts)  # the allowed hosts may have changed
        if refused is not None:
            self.store.delivery_tried(delivery, "given_up", time.time(), None, refused)
            audit("webhook.given_up", **facts, reason=refused)
            return
        now = time.time()
        body = event_body(delivery.event_id, delivery.type, delivery.batch_id, delivery.event_created_at)
        outcome = send(endpoint.url, body, headers(signing_secrets(endpoint, now), delivery.event_id, int(now), body))
        if outcome.delivered:
            self.store.delivery_tried(delivery, "delivered", now, outcome.status, None)
            audit("webhook.delivered", **facts, status=outcome.status)
            return
        again = next_attempt_at(delivery.event_created_at, attempt_no, time.time(),
                                self.settings.webhook_retry_seconds, self.settings.webhook_retry_for_seconds)
        if again is None:
            self.store.delivery_tried(delivery, "given_up", now, outcome.status, outcome.error)
            audit("webhook.given_up", **facts, status=outcome.status, reason=outcome.error)
            log.warning("webhook %s of batch %s to %s: given up after %d attempts (%s)", delivery.type,
                        delivery.batch_id, endpoint.url, attempt_no, outcome.error)
            return
        self.store.delivery_tried(delivery, "pending", again, outcome.status, outcome.error)
        audit("webhook.failed", **facts, status=outcome.status, reason=outcome.error, retry_in=round(again - now, 1))
