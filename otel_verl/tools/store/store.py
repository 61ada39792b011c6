"""A span store: chDB in this process, kept beside the run, or a ClickHouse server; one
client (``clickhouse-connect``), one schema (``schema.sql``), one set of views
(``views.sql``), the same SQL on both."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from importlib import resources
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_verl.settings import redacted
from otel_verl.tools.report.inputs import InputError
from otel_verl.tools.store import load as loader

CLICKHOUSE_ENV = "OTEL_VERL_CLICKHOUSE"  # a ClickHouse server's URL: report and query use it
STORE_DIR = "store"  # in a trace dir: the embedded store of its spans
EXTRA = "otel-verl[report]"
EMBEDDED_CLEANUP = "old_parts_lifetime = 60, cleanup_delay_period = 1, cleanup_delay_period_random_add = 0"


class StoreUnavailable(InputError):
    """The store's client or engine is missing or cannot be reached: a one-line message."""


def _clickhouse_connect() -> Any:
    try:
        import clickhouse_connect
    except ImportError:
        raise StoreUnavailable(f"the span store needs chDB and clickhouse-connect: pip install '{EXTRA}'") from None
    return clickhouse_connect


def sql_file(name: str) -> str:
    return resources.files("otel_verl.tools.store").joinpath(name).read_text(encoding="utf-8")


def statements(sql: str) -> List[str]:
    """The statements of a SQL file: ``;`` at a line's end ends one; ``--`` lines are comments."""
    out, current = [], []
    for line in sql.splitlines():
        if line.lstrip().startswith("--"):
            continue
        current.append(line)
        if line.rstrip().endswith(";"):
            out.append("\n".join(current).rstrip().rstrip(";"))
            current = []
    if "".join(current).strip():
        out.append("\n".join(current))
    return out


class Store:
    """The spans of one or more runs, and the views the report reads."""

    def __init__(self, client: Any, *, path: Optional[str] = None) -> None:
        self.client = client
        self.path = path  # the embedded store's directory; None for a server

    @classmethod
    def embedded(cls, path: str) -> "Store":
        """The chDB store in ``path`` (created when missing), with the schema and views. A
        store that no longer opens (copied without its links, say: the engine's metadata
        links into its data) is rebuilt: it holds nothing the run's files do not."""
        try:
            return cls._embedded(path)
        except StoreUnavailable:
            raise
        except Exception:
            if not os.path.isdir(os.path.join(path, "metadata")):  # not a store of ours: left alone
                raise
        remove(path)
        return cls._embedded(path)

    @classmethod
    def _embedded(cls, path: str) -> "Store":
        clickhouse_connect = _clickhouse_connect()
        try:
            os.makedirs(path, exist_ok=True)
            client = clickhouse_connect.get_client(interface="chdb", path=path)
        except ImportError:
            raise StoreUnavailable(f"the embedded span store needs chDB: pip install '{EXTRA}'") from None
        except OSError as exc:
            raise StoreUnavailable(f"{path}: cannot create the span store ({exc.strerror or exc})") from None
        store = cls(client, path=path)
        try:
            store.create()
            # merges leave the parts they replaced on disk for old_parts_lifetime (8 minutes,
            # a server's guard against a crash before the merged part reaches the disk), longer
            # than a report runs: the store would keep twice its size. A store rebuilt from the
            # run's files can drop them sooner, at its next open.
            client.command(f"ALTER TABLE otel_traces MODIFY SETTING {EMBEDDED_CLEANUP}")
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def server(cls, url: str) -> "Store":
        """A ClickHouse server (``http(s)://user:password@host:port/database``) whose
        ``otel_traces`` the Collector writes; the views are created when missing."""
        clickhouse_connect = _clickhouse_connect()
        driver_log = logging.getLogger("clickhouse_connect")
        level = driver_log.level
        driver_log.setLevel(logging.CRITICAL)  # its own line for a failed connect; ours says it once
        try:
            client = clickhouse_connect.get_client(dsn=url)
        except Exception as exc:  # the driver's errors name the host and the cause
            raise StoreUnavailable(f"ClickHouse at {redacted(url)}: {_cause(exc)}") from None
        finally:
            driver_log.setLevel(level)
        store = cls(client)
        store.create()
        return store

    def create(self) -> None:
        for sql in (sql_file("schema.sql"), sql_file("views.sql")):
            for statement in statements(sql):
                self.client.command(statement)

    def reset(self) -> None:
        """Empties the store (its files were replaced): the next load reads them all."""
        for table in ("otel_traces", loader.FILES_TABLE, loader.LINES_TABLE, loader.DROPPED_TABLE, loader.REJECTED_TABLE):
            self.client.command(f"TRUNCATE TABLE IF EXISTS {table}")

    def load(self, files: Sequence[str]) -> loader.Load:
        return loader.load(self.client, files, self.reset)

    def query(self, sql: str, parameters: Optional[Dict[str, Any]] = None) -> Tuple[List[str], List[tuple]]:
        """``(column names, rows)``."""
        result = self.client.query(sql, parameters=parameters)
        return list(result.column_names), result.result_rows

    def rows(self, sql: str, parameters: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
        names, rows = self.query(sql, parameters)
        return [dict(zip(names, row)) for row in rows]

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_store(paths: Sequence[str], url: Optional[str]) -> Tuple[Store, Optional[loader.Load], Any]:
    """The store ``otel-verl report`` / ``query`` read: the ClickHouse server at ``url``,
    else the embedded store of ``paths`` with what they gained since the last load
    loaded. Returns ``(store, the load or None, the inputs or None)``."""
    from otel_verl.tools.report.inputs import resolve

    if url:
        if paths:
            raise InputError("give trace dirs or --clickhouse URL, not both (the Collector fills the server's store)")
        return Store.server(url), None, None
    inputs = resolve(paths)
    store = Store.embedded(embedded_path(paths))
    try:
        return store, store.load(inputs.otlp_files), inputs
    except BaseException:
        store.close()
        raise


def rejected_lines(store: Store, limit: int) -> Tuple[int, List[tuple]]:
    """``(how many, the first `limit` as (path, line, why))`` of the lines the store
    could not read as spans."""
    total = store.query(f"SELECT count() FROM {loader.REJECTED_TABLE}")[1][0][0]
    rows = store.query(f"SELECT Path, Line, Why FROM {loader.REJECTED_TABLE} ORDER BY Path, Line LIMIT {int(limit)}")[1]
    return total, rows


def embedded_path(paths: Sequence[str], cache_dir: Optional[str] = None) -> str:
    """Where the embedded store of ``paths`` lives: ``{trace_dir}/store`` for one trace dir,
    else a directory of otel_verl's cache named by the paths."""
    if len(paths) == 1 and os.path.isdir(os.path.join(paths[0], "otlp")):
        return os.path.join(paths[0], STORE_DIR)
    key = hashlib.sha256("\0".join(sorted(os.path.abspath(p) for p in paths)).encode()).hexdigest()[:16]
    base = cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otel_verl")
    return os.path.join(base, "stores", key)


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _cause(exc: BaseException) -> str:
    """The driver's error in a few words."""
    text = str(exc).strip()
    for cause in ("Connection refused", "Name or service not known", "timed out", "Authentication failed"):
        if cause.lower() in text.lower():
            return f"cannot connect ({cause.lower()})"
    return ((text.splitlines() or [type(exc).__name__])[0])[:300]
