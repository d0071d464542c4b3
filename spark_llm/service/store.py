"""Where the service keeps its state: file, upload, batch and webhook records in a SQL database through SQLAlchemy
(a SQLite file under the storage root by default, PostgreSQL for a shared one), so that a server started again
finds its queue, the batches it was running and the webhooks it had still to send. Records cross modules as
dataclasses (:class:`FileRecord`, :class:`BatchRecord`, ...); a batch's status only moves through
:meth:`Store.move`, a compare-and-set on the status the lifecycle allows, which adds the webhook event of a final
status in the same transaction."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import typing
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from ..batch import Batch, BatchErrors, RequestCounts, Usage
from ..host import private_file
from . import lifecycle
from .audit import audit
from .lifecycle import Status
from .migrations import schema_table, upgrade

log = logging.getLogger(__name__)

metadata = sa.MetaData()
schema_table(metadata)

files_table = sa.Table(
    "files", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # the listing order
    sa.Column("id", sa.String(64), unique=True, nullable=False),
    sa.Column("owner", sa.String(64), nullable=False, index=True),
    sa.Column("filename", sa.String(255), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.BigInteger),
    sa.Column("location", sa.Text, nullable=False),  # where the bytes are, under the storage root
)

uploads_table = sa.Table(
    "uploads", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), unique=True, nullable=False),
    sa.Column("owner", sa.String(64), nullable=False, index=True),
    sa.Column("filename", sa.String(255), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),  # announced at creation; the parts must add up to it
    sa.Column("mime_type", sa.String(255), nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("file_id", sa.String(64)),
    sa.Column("file_expires_after", sa.Integer),  # the file's own expires_after, in seconds
)

upload_parts_table = sa.Table(
    "upload_parts", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), unique=True, nullable=False),
    sa.Column("upload_id", sa.String(64), nullable=False, index=True),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("location", sa.Text, nullable=False),
)

webhook_endpoints_table = sa.Table(
    "webhook_endpoints", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), unique=True, nullable=False),
    sa.Column("owner", sa.String(64), nullable=False, index=True),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("event_types", sa.Text, nullable=False),  # space-separated
    sa.Column("secret", sa.String(128), nullable=False),  # signs the deliveries (an HMAC needs it as it is)
    sa.Column("old_secret", sa.String(128)),  # a rotated secret that still signs until old_secret_until
    sa.Column("old_secret_until", sa.BigInteger),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.BigInteger, nullable=False),
)

#: The outbox: an event is added in the transaction that makes its batch final, so none is lost to a crash.
webhook_events_table = sa.Table(
    "webhook_events", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), unique=True, nullable=False),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("type", sa.String(64), nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
)

#: One event to one endpoint, until delivered or given up.
webhook_deliveries_table = sa.Table(
    "webhook_deliveries", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(64), nullable=False),
    sa.Column("endpoint_id", sa.String(64), nullable=False, index=True),
    sa.Column("state", sa.String(16), nullable=False, index=True),  # pending, delivered, given_up
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("next_at", sa.Float, nullable=False),  # when it is due (while one server sends it: its hold)
    sa.Column("last_status", sa.Integer),  # the receiver's last HTTP status
    sa.Column("last_error", sa.Text),
)


@dataclass(frozen=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    location: str
    expires_at: Optional[int] = None


@dataclass(frozen=True)
class UploadRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    mime_type: str
    created_at: int
    expires_at: int
    status: str  #: pending, completed, cancelled (expired: read from expires_at)
    file_id: Optional[str] = None
    file_expires_after: Optional[int] = None


@dataclass(frozen=True)
class PartRecord:
    id: str
    upload_id: str
    bytes: int
    created_at: int
    location: str


class BatchRecord(Batch):
    """A batch as the service keeps it: OpenAI's :class:`~spark_llm.batch.Batch` (its API object is this record's
    Batch fields) and the service's own fields; its table, :data:`batches_table`, follows from its fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    status: Status  #: the enum itself (``is Status.CANCELLING``), where the API object has its value
    request_counts: RequestCounts = RequestCounts(total=0, completed=0, failed=0)
    owner: str  #: the key's owner id
    output_expires_after: Optional[int] = None  #: seconds after completion its output files are deleted
    runs: int = 0  #: runs started: the next one resumes
    # the server running the batch and until when its hold lasts without renewal (see Store.claim)
    lease_holder: Optional[str] = None
    lease_until: Optional[float] = None
    priority: Optional[str] = None  #: high, normal, low (config.PRIORITIES)

    def api_object(self) -> Batch:
        """What the API answers for it: its Batch fields."""
        return Batch.model_validate(self.model_dump(mode="json", include=set(Batch.model_fields)))

    def expired(self, now: Optional[float] = None) -> bool:
        """Its completion window has run out."""
        return self.expires_at is not None and (now or time.time()) >= self.expires_at


#: How a batch's field is stored when it is not one column of its own name: the request counts as columns named as
#: their own fields (a commit adds to them in SQL), the usage as its two token counts (the rest follows from them),
#: the error list and the metadata as JSON text.
_FLATTENED = {"request_counts": tuple(RequestCounts.model_fields), "usage": ("input_tokens", "output_tokens")}
_JSON_FIELDS = {"errors": "errors_json", "metadata": "metadata_json"}
#: Columns looked up by, beside the id.
_INDEXED = ("owner", "status")


@dataclass(frozen=True)
class BatchChange:
    """What a move or an update of a batch sets beside its status: the fields given (the others stay as they are),
    stored as :data:`batches_table` keeps its record's fields."""

    counts: Optional[RequestCounts] = None
    input_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    model: Optional[str] = None
    errors: Optional[BatchErrors] = None
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    runs: Optional[int] = None

    def columns(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, RequestCounts):  # its own columns, as _FLATTENED stores a record's counts
                out.update(value.model_dump())
            elif f.name in _JSON_FIELDS:
                out[_JSON_FIELDS[f.name]] = value.model_dump_json(exclude_none=True)
            else:
                out[f.name] = value
        return out


def _columns_of(record: type[BaseModel]) -> list[sa.Column]:
    """The columns of a table of ``record``s: ``seq`` first (the order of the queue and the listings), then one
    per field (:data:`_FLATTENED`, :data:`_JSON_FIELDS` aside): a field without a default is NOT NULL, one whose
    default is not None is NOT NULL with that default."""
    columns = [sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True)]
    for name, field in record.model_fields.items():
        if name == "object":  # a constant
            continue
        if name in _FLATTENED:
            counts = name == "request_counts"
            columns += [sa.Column(part, sa.BigInteger, nullable=not counts, default=0 if counts else None)
                        for part in _FLATTENED[name]]
        elif name in _JSON_FIELDS:
            columns.append(sa.Column(_JSON_FIELDS[name], sa.Text))
        else:
            kinds = [t for t in typing.get_args(field.annotation) if t is not type(None)] or [field.annotation]
            kind = {int: sa.BigInteger, float: sa.Float}.get(kinds[0], sa.Text)
            default = None if field.is_required() else field.default
            columns.append(sa.Column(name, kind, nullable=default is None and not field.is_required(),
                                     default=default, unique=name == "id", index=name in _INDEXED))
    return columns


batches_table = sa.Table("batches", metadata, *_columns_of(BatchRecord))


@dataclass(frozen=True)
class WebhookEndpointRecord:
    id: str
    owner: str
    name: str
    url: str
    event_types: tuple[str, ...]
    secret: str
    created_at: int
    updated_at: int
    old_secret: Optional[str] = None
    old_secret_until: Optional[int] = None


@dataclass(frozen=True)
class Delivery:
    """A delivery due: the event, the endpoint it goes to, how many times it was tried."""

    seq: int
    attempts: int
    event_id: str
    type: str
    batch_id: str
    event_created_at: int
    endpoint: WebhookEndpointRecord


class DeliveryState(NamedTuple):
    """Where one delivery stands."""

    endpoint_id: str
    state: str  #: pending, delivered, given_up
    attempts: int
    last_status: Optional[int]  #: the receiver's answer to the last attempt


@dataclass
class Stats:
    """What :meth:`Store.stats` counts."""

    batches: dict[str, int] = dataclasses.field(default_factory=dict)  #: by status
    completed: int = 0  #: requests answered, over every batch
    failed: int = 0  #: error rows, over every batch
    input_tokens: int = 0
    output_tokens: int = 0
    requests_left: int = 0  #: requests of unfinished batches with neither an answer nor an error yet
    oldest_queued: Optional[int] = None  #: created_at of the oldest batch not started yet
    leases: dict[str, int] = dataclasses.field(default_factory=dict)  #: batches held by each server


def _batch_row(batch: BatchRecord) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, value in batch.model_dump(mode="json", exclude={"object"}).items():
        if name in _FLATTENED:
            row.update({part: (value or {}).get(part) for part in _FLATTENED[name]})
        elif name in _JSON_FIELDS:
            row[_JSON_FIELDS[name]] = None if value is None else json.dumps(value)
        else:
            row[name] = value
    return row


def _batch_record(row: Any) -> BatchRecord:
    values = dict(row._mapping)
    values.pop("seq", None)
    counts = {part: values.pop(part) for part in _FLATTENED["request_counts"]}
    tokens = {part: values.pop(part) for part in _FLATTENED["usage"]}
    usage = None if tokens["input_tokens"] is None else Usage(
        input_tokens=tokens["input_tokens"], output_tokens=tokens["output_tokens"] or 0,
        total_tokens=tokens["input_tokens"] + (tokens["output_tokens"] or 0))
    for name, column in _JSON_FIELDS.items():
        text = values.pop(column)
        values[name] = None if text is None else json.loads(text)
    return BatchRecord(**values, request_counts=RequestCounts(**counts), usage=usage)


def _endpoint_row(record: WebhookEndpointRecord) -> dict[str, Any]:
    return {**dataclasses.asdict(record), "event_types": " ".join(record.event_types)}


def _endpoint_record(row: Any) -> WebhookEndpointRecord:
    values = {name: row._mapping[name] for name in WebhookEndpointRecord.__dataclass_fields__}
    return WebhookEndpointRecord(**{**values, "event_types": tuple(values["event_types"].split())})


def _file_record(row: Any) -> FileRecord:
    values = dict(row._mapping)
    values.pop("seq", None)
    return FileRecord(**values)


#: The PostgreSQL advisory lock the servers take while they make or upgrade the tables (CREATE TABLE IF NOT EXISTS
#: of two servers at once collides in PostgreSQL's catalog: one of them failed to start).
SCHEMA_LOCK = 0x5350_4C4C  # "SPLL"


class Store:
    """The records, in the database at ``url``; every call is its own transaction and safe from any thread.

    One class for all the service's tables (files, batches, uploads, webhooks, leases; a section each), not one per
    table: a call's transaction may span several (a batch's final move writes its webhook event and a delivery per
    endpoint, a batch's create checks its file), and every part of the server holds this one."""

    def __init__(self, url: str):
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            if url.startswith("sqlite:///"):  # made 0600 before SQLite opens it (its -wal and -shm files follow it)
                private_file(url[len("sqlite:///"):])
        self.engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        with self.engine.begin() as db:
            if db.dialect.name == "postgresql":  # servers starting together on a new database: one makes the tables
                db.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK})
            applied = upgrade(db, metadata)
        if applied:
            log.info("database upgraded: %s", ", ".join(applied))

    def close(self) -> None:
        self.engine.dispose()

    @property
    def shared(self) -> bool:
        """Whether several servers may use these records (PostgreSQL; SQLite is one server's)."""
        return self.engine.dialect.name == "postgresql"

    @contextlib.contextmanager
    def turn(self, name: str) -> Iterator[None]:
        """The block runs while this server holds ``name``'s turn among the servers on these records: a session
        advisory lock of PostgreSQL, held on a connection of its own (a server that dies lets go with it). On SQLite,
        one server's records, no wait."""
        if not self.shared:
            yield
            return
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
        with self.engine.connect() as db:
            db.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            db.commit()
            try:
                yield
            finally:
                db.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                db.commit()

    def ping(self) -> None:
        """Raise when the database does not answer."""
        with self.engine.connect() as db:
            db.execute(sa.text("SELECT 1"))

    # ---- files ---------------------------------------------------------------------------------------------------
    def add_file(self, record: FileRecord) -> None:
        with self.engine.begin() as db:
            db.execute(files_table.insert().values(**dataclasses.asdict(record)))

    def file(self, id: str, owner: Optional[str] = None) -> Optional[FileRecord]:
        """The file ``id`` (of ``owner``, when given: another key's file is not found)."""
        query = files_table.select().where(files_table.c.id == id)
        if owner is not None:
            query = query.where(files_table.c.owner == owner)
        with self.engine.connect() as db:
            row = db.execute(query).first()
        return _file_record(row) if row else None

    def files(self, owner: str, purpose: Optional[str], limit: int, after: Optional[str],
              newest_first: bool) -> tuple[list[FileRecord], bool]:
        """A page of ``owner``'s files and whether more follow."""
        t = files_table
        query = t.select().where(t.c.owner == owner)
        if purpose:
            query = query.where(t.c.purpose == purpose)
        return self._page(t, query, limit, after, newest_first, _file_record)

    def expired_files(self, now: float) -> list[FileRecord]:
        """Files past their ``expires_at`` that no unfinished batch reads."""
        t, b = files_table, batches_table
        reading = sa.select(b.c.input_file_id).where(b.c.status.notin_([s.value for s in lifecycle.FINAL]))
        query = t.select().where(t.c.expires_at.is_not(None), t.c.expires_at <= now, t.c.id.notin_(reading))
        with self.engine.connect() as db:
            return [_file_record(r) for r in db.execute(query)]

    def delete_file(self, id: str) -> Optional[BatchRecord]:
        """Delete file ``id``'s record unless an unfinished batch reads it: None when deleted (or gone already),
        else such a batch. Atomic with :meth:`add_batch`: the two lock the file's row first (:func:`_lock_file`),
        so a batch created as its file is deleted either finds it gone or keeps it."""
        b = batches_table
        with self.engine.begin() as db:
            if not _lock_file(db, id):
                return None
            reader = db.execute(b.select().where(b.c.input_file_id == id,
                                                 b.c.status.notin_([s.value for s in lifecycle.FINAL]))).first()
            if reader is not None:
                return _batch_record(reader)
            db.execute(files_table.delete().where(files_table.c.id == id))
        return None

    # ---- chunked uploads -----------------------------------------------------------------------------------------
    def add_upload(self, record: UploadRecord) -> None:
        with self.engine.begin() as db:
            db.execute(uploads_table.insert().values(**dataclasses.asdict(record)))

    def upload(self, id: str, owner: str) -> Optional[UploadRecord]:
        t = uploads_table
        with self.engine.connect() as db:
            row = db.execute(t.select().where(t.c.id == id, t.c.owner == owner)).first()
        return UploadRecord(**{k: v for k, v in row._mapping.items() if k != "seq"}) if row else None

    def add_part(self, record: PartRecord) -> None:
        with self.engine.begin() as db:
            db.execute(upload_parts_table.insert().values(**dataclasses.asdict(record)))

    def parts(self, upload_id: str) -> list[PartRecord]:
        t = upload_parts_table
        with self.engine.connect() as db:
            rows = db.execute(t.select().where(t.c.upload_id == upload_id).order_by(t.c.seq)).all()
        return [PartRecord(**{k: v for k, v in r._mapping.items() if k != "seq"}) for r in rows]

    def end_upload(self, id: str, status: str, file: Optional[FileRecord] = None) -> bool:
        """Move a pending upload to ``status`` (completed, with its ``file`` registered in the same transaction,
        or cancelled); False when it was no longer pending (a second complete or cancel)."""
        t = uploads_table
        with self.engine.begin() as db:
            moved = db.execute(t.update().where(t.c.id == id, t.c.status == "pending")
                               .values(status=status, file_id=file.id if file else None)).rowcount
            if moved and file is not None:
                db.execute(files_table.insert().values(**dataclasses.asdict(file)))
        return bool(moved)

    # ---- batches -------------------------------------------------------------------------------------------------
    def add_batch(self, record: BatchRecord) -> bool:
        """Add ``record`` if its input file is still its owner's (False: the file was deleted meanwhile)."""
        with self.engine.begin() as db:
            if not _lock_file(db, record.input_file_id, record.owner):
                return False
            db.execute(batches_table.insert().values(**_batch_row(record)))
        return True

    def batch(self, id: str, owner: Optional[str] = None) -> Optional[BatchRecord]:
        query = batches_table.select().where(batches_table.c.id == id)
        if owner is not None:
            query = query.where(batches_table.c.owner == owner)
        with self.engine.connect() as db:
            row = db.execute(query).first()
        return _batch_record(row) if row else None

    def batches(self, owner: str, limit: int, after: Optional[str]) -> tuple[list[BatchRecord], bool]:
        """A page of ``owner``'s batches, newest first, and whether more follow."""
        t = batches_table
        return self._page(t, t.select().where(t.c.owner == owner), limit, after, True, _batch_record)

    def unfinished(self) -> list[BatchRecord]:
        """Every batch not in a final status, oldest first: the queue, the running ones, and after a restart the
        ones a server was running when it stopped."""
        t = batches_table
        query = t.select().where(t.c.status.notin_([s.value for s in lifecycle.FINAL])).order_by(t.c.seq)
        with self.engine.connect() as db:
            return [_batch_record(r) for r in db.execute(query)]

    def unfinished_of(self, owner: str) -> list[BatchRecord]:
        """``owner``'s batches not in a final status."""
        t = batches_table
        query = t.select().where(t.c.owner == owner, t.c.status.notin_([s.value for s in lifecycle.FINAL]))
        with self.engine.connect() as db:
            return [_batch_record(r) for r in db.execute(query.order_by(t.c.seq))]

    def move(self, id: str, to: Status, change: Optional[BatchChange] = None,
             now: Optional[int] = None) -> Optional[BatchRecord]:
        """Move batch ``id`` to status ``to`` (setting its timestamp and the fields of ``change``) if its status
        allows it: the batch as it is now, or None when it was not in a status ``to`` may follow (another call moved
        it)."""
        values = {"status": to.value, lifecycle.TIMESTAMP[to]: now or int(time.time()),
                  **(change.columns() if change is not None else {})}
        allowed = [s.value for s in lifecycle.sources(to)]
        t = batches_table
        with self.engine.begin() as db:
            done = db.execute(t.update().where(t.c.id == id, t.c.status.in_(allowed)).values(**values)).rowcount
            if done and to in lifecycle.EVENT:
                _add_event(db, id, lifecycle.EVENT[to], values[lifecycle.TIMESTAMP[to]])
        if not done:
            return None
        batch = self.batch(id)
        if batch is not None:
            reason = batch.errors.data[0].code if to is Status.FAILED and batch.errors and batch.errors.data else None
            counts = batch.request_counts
            audit(f"batch.{to.value}", batch=id, owner=batch.owner, server=batch.lease_holder, total=counts.total,
                  completed=counts.completed, failed=counts.failed, reason=reason)
        return batch

    def update(self, id: str, change: BatchChange) -> None:
        """Set fields of batch ``id`` that are not its status (counts, files, runs)."""
        with self.engine.begin() as db:
            db.execute(batches_table.update().where(batches_table.c.id == id).values(**change.columns()))

    def add_counts(self, id: str, completed: int = 0, failed: int = 0) -> None:
        t = batches_table
        with self.engine.begin() as db:
            db.execute(t.update().where(t.c.id == id).values(completed=t.c.completed + completed,
                                                               failed=t.c.failed + failed))

    # ---- webhooks ------------------------------------------------------------------------------------------------
    def add_endpoint(self, record: WebhookEndpointRecord) -> None:
        with self.engine.begin() as db:
            db.execute(webhook_endpoints_table.insert().values(**_endpoint_row(record)))

    def endpoint(self, id: str, owner: str) -> Optional[WebhookEndpointRecord]:
        t = webhook_endpoints_table
        with self.engine.connect() as db:
            row = db.execute(t.select().where(t.c.id == id, t.c.owner == owner)).first()
        return _endpoint_record(row) if row else None

    def endpoints(self, owner: str, limit: int, after: Optional[str]) -> tuple[list[WebhookEndpointRecord], bool]:
        """A page of ``owner``'s webhook endpoints, newest first, and whether more follow."""
        t = webhook_endpoints_table
        return self._page(t, t.select().where(t.c.owner == owner), limit, after, True, _endpoint_record)

    def update_endpoint(self, record: WebhookEndpointRecord) -> None:
        t = webhook_endpoints_table
        with self.engine.begin() as db:
            db.execute(t.update().where(t.c.id == record.id).values(**_endpoint_row(record)))

    def delete_endpoint(self, id: str, owner: str) -> bool:
        """Delete ``owner``'s endpoint ``id`` and what it had still to be sent; False when there is none."""
        t, d = webhook_endpoints_table, webhook_deliveries_table
        with self.engine.begin() as db:
            if not db.execute(t.delete().where(t.c.id == id, t.c.owner == owner)).rowcount:
                return False
            db.execute(d.delete().where(d.c.endpoint_id == id, d.c.state == "pending"))
        return True

    def due_deliveries(self, now: float, limit: int) -> list[Delivery]:
        """Pending deliveries due at ``now``, the longest waiting first."""
        d, e, w = webhook_deliveries_table, webhook_events_table, webhook_endpoints_table
        query = (sa.select(d.c.seq, d.c.attempts, e.c.id.label("event_id"), e.c.type, e.c.batch_id,
                           e.c.created_at.label("event_created_at"), *w.c)
                 .join(e, e.c.id == d.c.event_id).join(w, w.c.id == d.c.endpoint_id)
                 .where(d.c.state == "pending", d.c.next_at <= now).order_by(d.c.next_at).limit(limit))
        with self.engine.connect() as db:
            return [Delivery(r.seq, r.attempts, r.event_id, r.type, r.batch_id, r.event_created_at,
                             _endpoint_record(r)) for r in db.execute(query)]

    def claim_delivery(self, delivery: Delivery, until: float) -> bool:
        """Take ``delivery`` for one attempt, due again at ``until`` should this server die sending it: False
        when another server took it first (a compare-and-set on its attempts)."""
        d = webhook_deliveries_table
        with self.engine.begin() as db:
            return db.execute(d.update().where(d.c.seq == delivery.seq, d.c.state == "pending",
                                               d.c.attempts == delivery.attempts)
                              .values(attempts=delivery.attempts + 1, next_at=until)).rowcount > 0

    def delivery_tried(self, delivery: Delivery, state: str, next_at: float, status: Optional[int],
                       error: Optional[str]) -> None:
        """Record an attempt's outcome: ``state`` delivered, given_up, or pending again at ``next_at``."""
        d = webhook_deliveries_table
        with self.engine.begin() as db:
            db.execute(d.update().where(d.c.seq == delivery.seq).values(
                state=state, next_at=next_at, last_status=status, last_error=error))

    def deliveries(self, batch_id: str) -> list[DeliveryState]:
        """Where the deliveries of ``batch_id``'s events stand."""
        d, e = webhook_deliveries_table, webhook_events_table
        query = (sa.select(d.c.endpoint_id, d.c.state, d.c.attempts, d.c.last_status).join(e, e.c.id == d.c.event_id)
                 .where(e.c.batch_id == batch_id).order_by(d.c.seq))
        with self.engine.connect() as db:
            return [DeliveryState(*r) for r in db.execute(query)]

    # ---- what the metrics read ---------------------------------------------------------------------------------
    def stats(self) -> "Stats":
        """Counts over every batch, in two aggregate queries (a scrape's cost does not grow with the batches'
        requests)."""
        t = batches_table
        by_status = sa.select(t.c.status, sa.func.count(), sa.func.sum(t.c.total), sa.func.sum(t.c.completed),
                              sa.func.sum(t.c.failed), sa.func.sum(t.c.input_tokens),
                              sa.func.sum(t.c.output_tokens), sa.func.min(t.c.created_at)).group_by(t.c.status)
        leases = sa.select(t.c.lease_holder, sa.func.count()).where(
            t.c.lease_holder.is_not(None), t.c.lease_until > time.time()).group_by(t.c.lease_holder)
        with self.engine.connect() as db:
            rows = db.execute(by_status).all()
            held = dict(db.execute(leases).all())
        stats = Stats(leases=held)
        for status, n, total, completed, failed, tokens_in, tokens_out, oldest in rows:
            stats.batches[status] = n
            stats.completed += completed or 0
            stats.failed += failed or 0
            stats.input_tokens += tokens_in or 0
            stats.output_tokens += tokens_out or 0
            if Status(status) not in lifecycle.FINAL:
                stats.requests_left += (total or 0) - (completed or 0) - (failed or 0)
            if status == Status.VALIDATING.value:
                stats.oldest_queued = oldest
        return stats

    # ---- leases: which server runs a batch ----------------------------------------------------------------------
    def claim(self, id: str, holder: str, seconds: float) -> bool:
        """Take batch ``id`` for server ``holder`` for ``seconds``: when nobody holds it, ``holder`` already does,
        or the holder's lease ran out (that server died or lost the database). One UPDATE whose condition the
        database checks against the row as it is when the update runs, so of two servers claiming at once one
        gets it."""
        now = time.time()
        t = batches_table
        free = sa.or_(t.c.lease_holder.is_(None), t.c.lease_holder == holder, t.c.lease_until < now)
        with self.engine.begin() as db:
            taken = db.execute(t.update().where(t.c.id == id, free)
                               .values(lease_holder=holder, lease_until=now + seconds)).rowcount
        return bool(taken)

    def renew(self, ids: list[str], holder: str, seconds: float) -> set[str]:
        """Extend ``holder``'s leases on ``ids``; the ids it still holds (a lease lost to another server is not
        among them)."""
        if not ids:
            return set()
        t = batches_table
        with self.engine.begin() as db:
            db.execute(t.update().where(t.c.id.in_(ids), t.c.lease_holder == holder)
                       .values(lease_until=time.time() + seconds))
            return {r[0] for r in db.execute(sa.select(t.c.id).where(t.c.id.in_(ids), t.c.lease_holder == holder))}

    def release(self, id: str, holder: str) -> None:
        """Let go of ``holder``'s lease on ``id`` (its run ended, or the server stops: another may take it now)."""
        t = batches_table
        with self.engine.begin() as db:
            db.execute(t.update().where(t.c.id == id, t.c.lease_holder == holder)
                       .values(lease_holder=None, lease_until=None))

    # ---- paging --------------------------------------------------------------------------------------------------
    def _page(self, t: sa.Table, query: Any, limit: int, after: Optional[str], newest_first: bool,
              record: Any) -> tuple[list, bool]:
        """A page of the rows of ``query`` (one owner's) after the cursor ``after``, which must be one of those
        rows: any other id, another owner's too, is unknown and pages nothing, so a list says nothing of others'
        ids."""
        if after:
            cursor = query.with_only_columns(t.c.seq).where(t.c.id == after).scalar_subquery()
            query = query.where(t.c.seq < cursor if newest_first else t.c.seq > cursor)
        query = query.order_by(t.c.seq.desc() if newest_first else t.c.seq).limit(limit + 1)
        with self.engine.connect() as db:
            rows = [record(r) for r in db.execute(query)]
        return rows[:limit], len(rows) > limit




def _add_event(db: Any, batch_id: str, type: str, at: int) -> None:
    """Batch ``batch_id``'s event ``type`` in ``db``'s transaction, and a delivery of it due now to each of its
    owner's endpoints that takes the type."""
    b, w = batches_table, webhook_endpoints_table
    owner = db.execute(sa.select(b.c.owner).where(b.c.id == batch_id)).scalar_one()
    event_id = "evt_" + uuid.uuid4().hex[:24]
    db.execute(webhook_events_table.insert().values(id=event_id, owner=owner, type=type, batch_id=batch_id,
                                                    created_at=at))
    for endpoint in db.execute(w.select().where(w.c.owner == owner)):
        if type in endpoint.event_types.split():
            db.execute(webhook_deliveries_table.insert().values(event_id=event_id, endpoint_id=endpoint.id,
                                                                state="pending", attempts=0, next_at=at))


def _lock_file(db: Any, id: str, owner: Optional[str] = None) -> bool:
    """Lock file ``id``'s row (of ``owner``, when given) until ``db``'s transaction ends; False when there is none.
    A write that changes nothing, as the transaction's first statement: PostgreSQL then holds the row, and a
    concurrent lock waits and sees the row as the other transaction left it (gone, or read by a batch); SQLite
    takes its one write lock, so the whole transaction sees the latest state (SELECT ... FOR UPDATE is PostgreSQL's
    alone)."""
    t = files_table
    query = t.update().where(t.c.id == id).values(bytes=t.c.bytes)
    if owner is not None:
        query = query.where(t.c.owner == owner)
    return db.execute(query).rowcount > 0


def _sqlite_pragmas(connection: Any, record: Any) -> None:
    """WAL: the API's reads never wait for the scheduler's writes."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


