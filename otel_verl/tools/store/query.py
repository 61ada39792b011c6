"""``otel-verl query``: a user's own SQL on the store's views, printed as a table, CSV or
JSON. The store is opened read-only for it (``readonly=2``: settings may change, data
may not)."""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import json
import math
import uuid
from typing import Any, List, Sequence

from otel_verl.tools.store.store import Store

FORMATS = ("table", "csv", "json")
READ_ONLY = {"readonly": 2}


def run(store: Store, sql: str) -> tuple:
    """``(column names, rows)`` of ``sql``."""
    result = store.client.query(sql, settings=READ_ONLY)
    return list(result.column_names), result.result_rows


def plain(value: Any) -> Any:
    """A cell as JSON can hold it."""
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID, bytes)):
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def as_csv(names: Sequence[str], rows: List[tuple]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(names)
    for row in rows:
        writer.writerow([json.dumps(plain(v)) if isinstance(v, (dict, list, tuple)) else plain(v) for v in row])
    return out.getvalue()


def as_json(names: Sequence[str], rows: List[tuple]) -> str:
    return json.dumps([{name: plain(value) for name, value in zip(names, row)} for row in rows], indent=1)


def render_table(names: Sequence[str], rows: List[tuple], console: Any) -> None:
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for name in names:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*("" if v is None else json.dumps(plain(v)) if isinstance(v, (dict, list, tuple)) else str(plain(v))
                        for v in row))
    console.print(table)
    console.print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}")
