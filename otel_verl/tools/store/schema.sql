-- The span store of otel_verl: the table the OpenTelemetry Collector's clickhouseexporter
-- writes (v0.161.0, internal/sqltemplates/traces_table.sql: the same columns, names and
-- types, in the same order), plus materialized columns for what the views filter and group
-- by. The embedded store (chDB) and a ClickHouse server are created from this file; the
-- Collector's config says `create_schema: false`, so it inserts into this table.
-- The sort key puts one step of one run together: reading it is a narrow read. The
-- template's bloom filters over the attribute maps are left out: the views filter on the
-- materialized columns, and those four indexes made a load 40% slower.
CREATE TABLE IF NOT EXISTS otel_traces (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    -- otel_verl's columns, computed by the store from the attributes at insert
    RunId LowCardinality(String) MATERIALIZED ResourceAttributes['verl.run_id'],
    Role LowCardinality(String) MATERIALIZED ResourceAttributes['verl.role'],
    Step Int64 MATERIALIZED toInt64OrDefault(SpanAttributes['verl.global_step'], toInt64(-1)) CODEC(Delta, ZSTD(1)),
    Uid String MATERIALIZED SpanAttributes['verl.uid'] CODEC(ZSTD(1)),
    TrajUid String MATERIALIZED SpanAttributes['verl.traj_uid'] CODEC(ZSTD(1)),
    Replica LowCardinality(String) MATERIALIZED SpanAttributes['verl.llm.server_id'],
    WeightVersion Nullable(Int64) MATERIALIZED toInt64OrNull(SpanAttributes['verl.weight_version']),
    Staleness Nullable(Int64) MATERIALIZED toInt64OrNull(SpanAttributes['verl.staleness']),
    Reward Nullable(Float64) MATERIALIZED toFloat64OrNull(SpanAttributes['verl.reward.score']),
    Outcome LowCardinality(String) MATERIALIZED SpanAttributes['verl.sample.outcome'],
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_uid Uid TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(Timestamp)
ORDER BY (RunId, Step, SpanName, Timestamp)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1;
