"""otel_verl's span store: the Collector ``clickhouseexporter``'s ``otel_traces`` table on
ClickHouse's engine (chDB in-process beside the run, or a ClickHouse server), the views the
report and ``otel-verl query`` read (``views.sql``) and the loader of OTLP-JSON files
(:mod:`otel_verl.tools.store.load`). chDB and clickhouse-connect come with the ``report``
extra; a training process never imports this package."""

from otel_verl.tools.store.store import CLICKHOUSE_ENV, Store, StoreUnavailable, embedded_path

__all__ = ["CLICKHOUSE_ENV", "Store", "StoreUnavailable", "embedded_path"]
