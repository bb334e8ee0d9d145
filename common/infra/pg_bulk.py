"""Bulk INSERT .. ON CONFLICT DO NOTHING on Postgres as one statement with one JSON parameter.

SQLAlchemy's insertmanyvalues writes a VALUES list with one placeholder per cell, so every chunk sends a new
statement of thousands of parameters that psycopg re-parses in Python, most of an ingest chunk's cost
(bench/ingest.py); column arrays cost nearly as much in psycopg's text escaping.
Here the rows travel as one JSON document (json.dumps runs in C) that Postgres turns back into rows of the
columns' types with `json_to_recordset`; the statement text depends only on the table and columns,
so psycopg caches the parsed query and Postgres plans it once.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import JSON, Table, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeDecorator

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]


def _json_kind(column: Any) -> JSON | None:
    kind = column.type
    kind = kind.impl if isinstance(kind, TypeDecorator) else kind
    return kind if isinstance(kind, JSON) else None


@cache
def _statement(table: Table, keys: tuple[str, ...], names: tuple[str, ...], conflict: tuple[str, ...],
               returning: str | None) -> Any:
    quote = _DIALECT.identifier_preparer.quote
    columns = [table.c[n] for n in names]
    # The JSON keys are the rows' own keys (mapped attribute names), typed by the definition list. A JSON
    # column's value travels as its own JSON text: json_to_recordset would otherwise turn a nested \u0000
    # into text and fail, where the `json` type itself keeps it.
    definition = ", ".join(f"{quote(k)} {'text' if _json_kind(c) is not None else c.type.compile(_DIALECT)}"
                           for k, c in zip(keys, columns, strict=True))
    picked = ", ".join(f"CAST(r.{quote(k)} AS json)" if _json_kind(c) is not None else f"r.{quote(k)}"
                       for k, c in zip(keys, columns, strict=True))
    sql = (f"INSERT INTO {_DIALECT.identifier_preparer.format_table(table)} ({', '.join(quote(n) for n in names)}) "
           f"SELECT {picked} FROM json_to_recordset(CAST(:rows AS json)) AS r({definition}) "
           f"ON CONFLICT ({', '.join(quote(c) for c in conflict)}) DO NOTHING")
    if returning is not None:
        sql += f" RETURNING {quote(returning)}"
    return text(sql)


@cache
def _encoders(table: Table, names: tuple[str, ...]) -> tuple[Any, ...]:
    """Per column, what the ORM's bind step would do to a value before it is sent (None: nothing)."""
    out: list[Any] = []
    for name in names:
        column = table.c[name]
        json_kind = _json_kind(column)
        if json_kind is not None:
            # The ORM/Core insert writes None as the JSON `null` unless the column says none_as_null.
            keep_null = json_kind.none_as_null
            out.append(lambda v, keep_null=keep_null: None if v is None and keep_null else json.dumps(v))
        elif isinstance(column.type, TypeDecorator):
            out.append(lambda v, kind=column.type: kind.process_bind_param(v, _DIALECT))
        else:
            out.append(None)
    return tuple(out)


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("naive datetime in a bulk insert")  # as models.UTCDateTime refuses it
        return value.isoformat()
    raise TypeError(f"cannot send {type(value).__name__} in a bulk insert")


def insert_json_rows(
    session: Session, model: type[Any], rows: list[dict[str, Any]], conflict_columns: list[str],
    returning: str | None = None,
) -> set[Any]:
    """Insert `rows` (dicts keyed by mapped attribute name, all with the same keys), skipping conflicts on
    `conflict_columns`; the `returning` column's values for the rows written (empty without one)."""
    mapper = model.__mapper__
    keys = tuple(rows[0])
    names = tuple(mapper.attrs[k].columns[0].name for k in keys)
    stmt = _statement(model.__table__, keys, names, tuple(conflict_columns), returning)
    encode = [(k, f) for k, f in zip(keys, _encoders(model.__table__, names), strict=True) if f is not None]
    if encode:
        rows = [{**row, **{k: f(row[k]) for k, f in encode}} for row in rows]
    result = session.execute(stmt, {"rows": json.dumps(rows, default=_default)})
    return set(result.scalars()) if returning is not None else set()
