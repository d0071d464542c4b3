"""The database's schema over time: named migrations, applied in order, each once, recorded in the database's
``schema_migrations`` table, so that a server opens a database an older release made and upgrades it in place.

A table that does not exist yet is made as the code defines it now (a new database, or a table added since, like
the webhooks'); a migration changes a table that exists: it adds the columns a field added since needs. A new
database has every migration recorded as applied at its creation (it has what they add). Each migration does only
what is missing, so a database upgraded by a release before this record existed is upgraded once more safely."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import sqlalchemy as sa

schema_table_name = "schema_migrations"


@dataclass(frozen=True)
class Migration:
    """One step of the schema: its ``name`` (recorded once applied; never renamed) and what it does to a database
    (a connection in the upgrade's transaction, and the tables as the code defines them now)."""

    name: str
    apply: Callable[[Any, sa.MetaData], None]


def add_columns(table: str, *names: str) -> Callable[[Any, sa.MetaData], None]:
    """A migration's step: add the columns ``names`` of ``table``, as the code defines them now, where missing
    (a NOT NULL column with its default; an older row then has that default)."""

    def apply(db: Any, metadata: sa.MetaData) -> None:
        have = {c["name"] for c in sa.inspect(db).get_columns(table)}
        for name in names:
            if name in have:
                continue
            column = metadata.tables[table].c[name]
            kind = column.type.compile(db.dialect)
            default = column.default.arg if column.default is not None else None
            extra = f" NOT NULL DEFAULT {default!r}" if default is not None and not column.nullable else ""
            db.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {name} {kind}{extra}"))
    return apply


#: Every migration since the first release, oldest first; a new one goes at the end.
MIGRATIONS: tuple[Migration, ...] = (
    Migration("2026-11-batches-lease", add_columns("batches", "lease_holder", "lease_until")),
    Migration("2026-11-batches-priority", add_columns("batches", "priority")),
)


def schema_table(metadata: sa.MetaData) -> sa.Table:
    """The record of the migrations applied, in ``metadata``."""
    return sa.Table(schema_table_name, metadata,
                    sa.Column("name", sa.String(128), primary_key=True),
                    sa.Column("applied_at", sa.BigInteger, nullable=False))


def upgrade(db: Any, metadata: sa.MetaData, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[str]:
    """Bring the database of ``db`` (a connection in a transaction) to the schema of ``metadata``: make the tables
    it lacks, then apply each migration not recorded, in order, recording it. The names applied."""
    new = not sa.inspect(db).has_table("batches")
    metadata.create_all(db)
    record = metadata.tables[schema_table_name]
    done = {row.name for row in db.execute(sa.select(record.c.name))}
    applied = []
    for migration in migrations:
        if migration.name in done:
            continue
        if not new:
            migration.apply(db, metadata)
            applied.append(migration.name)
        db.execute(record.insert().values(name=migration.name, applied_at=int(time.time())))
    return applied
