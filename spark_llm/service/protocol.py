"""OpenAI's Files, Batches, Uploads and webhook endpoints shapes, as openai-python's types define them
(``openai.types.FileObject``, ``openai.types.webhooks.WebhookEndpoint``, the cursor page; the batch object is the
job's own, :class:`spark_llm.batch.Batch`), and its error body: one exception, :class:`APIError`, renders ``{"error": {"message", "type", "param",
"code"}}`` with the status the SDK maps to its exception classes."""

from __future__ import annotations

from typing import Any, Generic, Literal, Optional, TypeVar

from pydantic import BaseModel, Field, field_validator

T = TypeVar("T")

#: Seconds an ``expires_after`` / ``output_expires_after`` may give, as OpenAI bounds them (1 hour to 30 days).
EXPIRES_AFTER_SECONDS = (3600, 2_592_000)
#: OpenAI's metadata limits: pairs, key length, value length.
METADATA_LIMITS = (16, 64, 512)


class APIError(Exception):
    """An API call refused, rendered as OpenAI's error body with ``status`` (400 -> ``BadRequestError``, 401 ->
    ``AuthenticationError``, 404 -> ``NotFoundError`` in openai-python)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, message: str, param: Optional[str] = None, code: Optional[str] = None) -> "APIError":
        return cls(400, message, param=param, code=code)

    @classmethod
    def not_found(cls, what: str, id: str) -> "APIError":
        """What OpenAI answers for an id that does not exist or is another key's: the two look the same."""
        return cls(404, f"No {what} found with id '{id}'.", param="id", code=None)


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_AFTER_SECONDS[0], le=EXPIRES_AFTER_SECONDS[1])


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output", "vision", "user_data"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: Optional[int] = None
    status_details: Optional[str] = None

    @classmethod
    def of(cls, record: Any) -> "FileObject":
        """A stored file's object (a :class:`~spark_llm.service.store.FileRecord`)."""
        return cls(id=record.id, bytes=record.bytes, created_at=record.created_at, filename=record.filename,
                   purpose=record.purpose, expires_at=record.expires_at)


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreate(BaseModel):
    """``POST /v1/batches``' body (openai-python's ``BatchCreateParams``)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[dict[str, str]] = None
    output_expires_after: Optional[ExpiresAfter] = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        pairs, key_chars, value_chars = METADATA_LIMITS
        if v is not None:
            if len(v) > pairs:
                raise ValueError(f"metadata holds {len(v)} pairs; at most {pairs} are allowed")
            for key, value in v.items():
                if len(key) > key_chars:
                    raise ValueError(f"metadata key {key[:20]!r}... is over {key_chars} characters")
                if len(value) > value_chars:
                    raise ValueError(f"metadata value of {key!r} is over {value_chars} characters")
        return v


class Upload(BaseModel):
    """openai-python's ``Upload``: a file sent in parts (``POST /v1/uploads``)."""

    id: str
    object: Literal["upload"] = "upload"
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    file: Optional[FileObject] = None


class UploadPart(BaseModel):
    id: str
    object: Literal["upload.part"] = "upload.part"
    created_at: int
    upload_id: str


class UploadCreate(BaseModel):
    """``POST /v1/uploads``' body (openai-python's ``UploadCreateParams``)."""

    bytes: int = Field(ge=1)
    filename: str
    mime_type: str
    purpose: str
    expires_after: Optional[ExpiresAfter] = None  #: of the file the upload becomes


class UploadComplete(BaseModel):
    """``POST /v1/uploads/{id}/complete``' body: the parts in the file's order, and the whole file's MD5 (hex),
    checked when given."""

    part_ids: list[str]
    md5: Optional[str] = None


class WebhookEndpoint(BaseModel):
    """openai-python's ``WebhookEndpoint``: where a key's batch events go (``/v1/webhook_endpoints``)."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    updated_at: Optional[int] = None
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: Optional[str] = None


class WebhookEndpointWithSecret(WebhookEndpoint):
    """An endpoint as created or after its secret was rotated: the only time the secret is shown."""

    signing_secret: str


class WebhookEndpointCreate(BaseModel):
    """``POST /v1/webhook_endpoints``' body (openai-python's ``WebhookCreateParams``)."""

    name: str = Field(min_length=1, max_length=255)
    url: str = Field(min_length=1, max_length=2048)
    event_types: list[str] = Field(min_length=1)


class WebhookEndpointUpdate(BaseModel):
    """``POST /v1/webhook_endpoints/{id}``' body: what changes."""

    name: Optional[str] = Field(None, min_length=1, max_length=255)
    url: Optional[str] = Field(None, min_length=1, max_length=2048)
    event_types: Optional[list[str]] = Field(None, min_length=1)


class WebhookRotateSecret(BaseModel):
    keep_old_secret_active_for_24_hours: bool = False


class WebhookTest(BaseModel):
    event_type: str


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookEndpointTestResult(BaseModel):
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: Literal[True] = True


class WebhookEventTypes(BaseModel):
    object: Literal["list"] = "list"
    data: list[str]


class Page(BaseModel, Generic[T]):
    """A cursor page (openai-python's ``SyncCursorPage``): the next page is ``after=<last id>``."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False

    @classmethod
    def of(cls, items: list[Any], has_more: bool) -> "Page":
        return cls(data=items, first_id=items[0].id if items else None, last_id=items[-1].id if items else None,
                   has_more=has_more)
