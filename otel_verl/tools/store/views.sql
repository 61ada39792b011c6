-- The analytics surface of otel_verl's span store: typed views over otel_traces, one per
-- thing an RL engineer asks about. docs/STORE.md lists their columns. Times: `start` and
-- `end` are DateTime64(9); `start_ns`/`end_ns` the same as Unix nanoseconds (for exact
-- interval arithmetic); durations in seconds. `step` is verl.global_step (NULL: none).

-- every span, its common fields typed
CREATE OR REPLACE VIEW spans AS
SELECT RunId AS run_id, Role AS role, ServiceName AS service, TraceId AS trace_id, SpanId AS span_id,
    ParentSpanId AS parent_span_id, SpanName AS name, SpanKind AS kind, Timestamp AS start,
    addNanoseconds(Timestamp, Duration) AS end, toUnixTimestamp64Nano(Timestamp) AS start_ns,
    toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) AS end_ns, Duration / 1e9 AS duration_s,
    if(Step >= 0, Step, NULL) AS step, Uid AS uid, TrajUid AS traj_uid, StatusCode AS status,
    SpanAttributes['error.type'] AS error_type, SpanAttributes AS attributes, ResourceAttributes AS resource
FROM otel_traces;

-- the run itself: verl.fit, one per run
CREATE OR REPLACE VIEW runs AS
SELECT RunId AS run_id, SpanAttributes['verl.trainer'] AS trainer, Timestamp AS start,
    addNanoseconds(Timestamp, Duration) AS end, Duration / 1e9 AS duration_s,
    toInt64OrNull(SpanAttributes['verl.total_training_steps']) AS total_training_steps,
    toInt64OrNull(SpanAttributes['verl.train_batch_size']) AS train_batch_size,
    toInt64OrNull(SpanAttributes['verl.rollout_n']) AS rollout_n, TraceId AS trace_id, SpanId AS span_id
FROM otel_traces WHERE SpanName = 'verl.fit';

-- training steps: verl.step
CREATE OR REPLACE VIEW steps AS
SELECT RunId AS run_id, Step AS step, SpanAttributes['verl.trainer'] AS trainer,
    SpanAttributes['verl.layout'] AS layout, toInt64OrNull(SpanAttributes['verl.epoch']) AS epoch,
    Timestamp AS start, addNanoseconds(Timestamp, Duration) AS end, toUnixTimestamp64Nano(Timestamp) AS start_ns,
    toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) AS end_ns, Duration / 1e9 AS duration_s,
    TraceId AS trace_id, SpanId AS span_id
FROM otel_traces WHERE SpanName = 'verl.step' AND Step >= 0;

-- a step's stages: verl.stage {stage} (stages of one step may overlap: v1's generation and fetch_batch)
CREATE OR REPLACE VIEW stages AS
SELECT RunId AS run_id, Step AS step,
    if(SpanAttributes['verl.stage'] != '', SpanAttributes['verl.stage'], substring(SpanName, 12)) AS stage,
    Timestamp AS start, addNanoseconds(Timestamp, Duration) AS end, toUnixTimestamp64Nano(Timestamp) AS start_ns,
    toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) AS end_ns, Duration / 1e9 AS duration_s,
    SpanAttributes['verl.layout'] AS layout, TraceId AS trace_id, SpanId AS span_id, ParentSpanId AS parent_span_id
FROM otel_traces WHERE startsWith(SpanName, 'verl.stage ') AND Step >= 0;

-- weight syncs: the sync_params stages
CREATE OR REPLACE VIEW weight_syncs AS
SELECT run_id, step, start, end, start_ns, end_ns, duration_s, trace_id, span_id
FROM stages WHERE stage = 'sync_params';

-- trajectories: invoke_agent spans; step is the step whose weights generated it
CREATE OR REPLACE VIEW trajectories AS
SELECT RunId AS run_id, if(Step >= 0, Step, NULL) AS step, Uid AS uid, TrajUid AS traj_uid,
    SpanAttributes['gen_ai.agent.name'] AS agent, SpanAttributes['verl.agent_loop.class'] AS agent_class,
    toInt64OrNull(SpanAttributes['verl.agent_loop.worker_index']) AS worker_index,
    toInt64OrNull(SpanAttributes['verl.num_turns']) AS turns, Reward AS reward,
    toInt64OrNull(SpanAttributes['verl.weight_version.min']) AS weight_version_min,
    toInt64OrNull(SpanAttributes['verl.weight_version.max']) AS weight_version_max,
    SpanAttributes['verl.validate'] = 'true' AS validate, Timestamp AS start, addNanoseconds(Timestamp, Duration) AS end,
    toUnixTimestamp64Nano(Timestamp) AS start_ns, toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) AS end_ns,
    Duration / 1e9 AS duration_s, StatusCode AS status, SpanAttributes['error.type'] AS error_type,
    TraceId AS trace_id, SpanId AS span_id
FROM otel_traces WHERE SpanAttributes['gen_ai.operation.name'] = 'invoke_agent';

-- LLM turns: the client's chat / text_completion spans (a resumed turn is one, with attempts)
CREATE OR REPLACE VIEW llm_turns AS
SELECT RunId AS run_id, if(Step >= 0, Step, NULL) AS step, Uid AS uid, TrajUid AS traj_uid,
    SpanAttributes['gen_ai.operation.name'] AS operation, SpanAttributes['gen_ai.request.model'] AS model,
    SpanAttributes['gen_ai.provider.name'] AS provider, Replica AS replica, WeightVersion AS weight_version,
    toInt64OrNull(SpanAttributes['gen_ai.usage.input_tokens']) AS input_tokens,
    toInt64OrNull(SpanAttributes['gen_ai.usage.output_tokens']) AS output_tokens,
    toInt64OrDefault(SpanAttributes['verl.llm.attempts'], toInt64(1)) AS attempts,
    SpanAttributes['verl.llm.request_id'] AS request_id, Timestamp AS start, addNanoseconds(Timestamp, Duration) AS end,
    toUnixTimestamp64Nano(Timestamp) AS start_ns, toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) AS end_ns,
    Duration / 1e9 AS duration_s, StatusCode AS status, SpanAttributes['error.type'] AS error_type,
    TraceId AS trace_id, SpanId AS span_id, ParentSpanId AS parent_span_id
FROM otel_traces WHERE SpanAttributes['gen_ai.operation.name'] IN ('chat', 'text_completion');

-- the LLM servers' side of each engine request: verl.llm_server.generate, with the engine's
-- own timing keys (sglang / vLLM meta_info, seconds) as it reported them
CREATE OR REPLACE VIEW llm_requests AS
SELECT RunId AS run_id, TraceId AS trace_id, SpanId AS span_id, ParentSpanId AS parent_span_id,
    ResourceAttributes['service.instance.id'] AS server_instance, SpanAttributes['gen_ai.provider.name'] AS provider,
    toFloat64OrNull(SpanAttributes['verl.llm.server.e2e_latency']) AS e2e_s,
    toFloat64OrNull(SpanAttributes['verl.llm.server.queue_time']) AS queue_s,
    Timestamp AS start, toUnixTimestamp64Nano(Timestamp) AS start_ns, Duration / 1e9 AS duration_s,
    mapFilter((k, v) -> startsWith(k, 'verl.llm.server.'), SpanAttributes) AS meta
FROM otel_traces WHERE SpanName = 'verl.llm_server.generate';

-- tool calls: execute_tool spans
CREATE OR REPLACE VIEW tool_calls AS
SELECT RunId AS run_id, if(Step >= 0, Step, NULL) AS step, Uid AS uid, TrajUid AS traj_uid,
    SpanAttributes['gen_ai.tool.name'] AS tool, SpanAttributes['gen_ai.tool.type'] AS tool_type,
    SpanAttributes['gen_ai.tool.call.id'] AS call_id, Timestamp AS start, addNanoseconds(Timestamp, Duration) AS end,
    toUnixTimestamp64Nano(Timestamp) AS start_ns, Duration / 1e9 AS duration_s, StatusCode AS status,
    SpanAttributes['error.type'] AS error_type, positionCaseInsensitive(SpanAttributes['error.type'], 'timeout') > 0
        OR positionCaseInsensitive(StatusMessage, 'timed out') > 0 AS timed_out,
    TraceId AS trace_id, SpanId AS span_id, ParentSpanId AS parent_span_id
FROM otel_traces WHERE SpanAttributes['gen_ai.operation.name'] = 'execute_tool';

-- rewards: verl.reward spans (one per scored trajectory)
CREATE OR REPLACE VIEW rewards AS
SELECT RunId AS run_id, if(Step >= 0, Step, NULL) AS step, Uid AS uid, TrajUid AS traj_uid, Reward AS score,
    Timestamp AS start, Duration / 1e9 AS duration_s, StatusCode AS status, TraceId AS trace_id, SpanId AS span_id,
    ParentSpanId AS parent_span_id
FROM otel_traces WHERE SpanName = 'verl.reward';

-- samples: verl.sample roots, one per prompt (uid): how each ended, when it was trained, how stale
CREATE OR REPLACE VIEW samples AS
SELECT RunId AS run_id, Uid AS uid, if(Step >= 0, Step, NULL) AS step, Outcome AS outcome,
    SpanAttributes['verl.sample.outcome.detail'] AS outcome_detail,
    toInt64OrNull(SpanAttributes['verl.trained_step']) AS trained_step, Staleness AS staleness,
    toInt64OrNull(SpanAttributes['verl.weight_version.min']) AS weight_version_min, Timestamp AS start,
    addNanoseconds(Timestamp, Duration) AS end, Duration / 1e9 AS duration_s, TraceId AS trace_id, SpanId AS span_id
FROM otel_traces WHERE SpanName = 'verl.sample';

-- the trainer's per-sample stages: which step consumed which trajectories
CREATE OR REPLACE VIEW sample_stages AS
SELECT RunId AS run_id, Step AS step, Uid AS uid, SpanAttributes['verl.stage'] AS stage,
    JSONExtract(SpanAttributes['verl.traj_uids'], 'Array(String)') AS traj_uids, Timestamp AS start,
    Duration / 1e9 AS duration_s, TraceId AS trace_id, SpanId AS span_id
FROM otel_traces WHERE startsWith(SpanName, 'verl.sample_stage ') AND Step >= 0;

-- engine requests: what one LLM server replica served (report/tail.py's rule, by parent
-- links instead of a walk down the tree). A unit is an LLM turn or a verl.llm.attempt under
-- one (verl's client resumed the turn); a request is a verl.llm_server.generate span under
-- a unit, else a unit without one that names its server (a turn with attempts is none: its
-- attempts are). replica: the unit's verl.llm.server_id (an attempt's, else its turn's),
-- else the server span's process; requests of no known replica are left out. uid, traj_uid
-- and step are the turn's (worker.py puts its trajectory's there): with trace_id they name
-- the trajectory. span_id: the server span, else the unit. `step` is toNullable(Step), not
-- if(...), so that a filter on it reaches the sort key
CREATE OR REPLACE VIEW engine_requests AS
WITH turns AS (
    SELECT RunId AS run_id, TraceId AS trace_id, SpanId AS turn_span_id, Uid AS uid, TrajUid AS traj_uid,
        toNullable(Step) AS step, toString(Replica) AS named, Timestamp AS ts, Duration AS dur
    FROM otel_traces WHERE SpanAttributes['gen_ai.operation.name'] IN ('chat', 'text_completion') AND Step >= 0
    UNION ALL
    SELECT RunId, TraceId, SpanId, Uid, TrajUid, CAST(NULL, 'Nullable(Int64)'), toString(Replica), Timestamp, Duration
    FROM otel_traces WHERE SpanAttributes['gen_ai.operation.name'] IN ('chat', 'text_completion') AND Step < 0),
attempts AS (
    SELECT RunId AS run_id, TraceId AS trace_id, ParentSpanId AS turn_span_id, SpanId AS span_id,
        toString(Replica) AS named, Timestamp AS ts, Duration AS dur
    FROM otel_traces WHERE SpanName = 'verl.llm.attempt'),
units AS (
    SELECT run_id, trace_id, turn_span_id, turn_span_id AS unit_span_id, uid, traj_uid, step, named, ts, dur,
        (run_id, trace_id, turn_span_id) NOT IN (SELECT run_id, trace_id, turn_span_id FROM attempts) AS alone
    FROM turns
    UNION ALL
    SELECT t.run_id, t.trace_id, t.turn_span_id, a.span_id, t.uid, t.traj_uid, t.step,
        if(a.named != '', a.named, t.named), a.ts, a.dur, true
    FROM attempts AS a
    INNER JOIN turns AS t ON t.run_id = a.run_id AND t.trace_id = a.trace_id AND t.turn_span_id = a.turn_span_id),
servers AS (
    SELECT RunId AS run_id, TraceId AS trace_id, ParentSpanId AS unit_span_id, SpanId AS span_id, Timestamp AS ts,
        Duration AS dur, if(ResourceAttributes['ray.actor_id'] != '', ResourceAttributes['ray.actor_id'],
                            ResourceAttributes['service.instance.id']) AS process
    FROM otel_traces WHERE SpanName = 'verl.llm_server.generate')
SELECT u.run_id AS run_id, u.trace_id AS trace_id, u.turn_span_id AS turn_span_id, u.unit_span_id AS unit_span_id,
    if(s.span_id != '', s.span_id, u.unit_span_id) AS span_id, u.uid AS uid, u.traj_uid AS traj_uid, u.step AS step,
    if(u.named != '', u.named, s.process) AS replica, if(s.span_id != '', s.ts, u.ts) AS start,
    toUnixTimestamp64Nano(start) AS start_ns, start_ns + toInt64(if(s.span_id != '', s.dur, u.dur)) AS end_ns,
    (end_ns - start_ns) / 1e9 AS duration_s
FROM units AS u
LEFT JOIN servers AS s ON s.run_id = u.run_id AND s.trace_id = u.trace_id AND s.unit_span_id = u.unit_span_id
WHERE replica != '' AND (s.span_id != '' OR u.alone);

-- training trajectories with the step that trained them (report/tail.py's rule): the
-- earliest sample_stage listing the trajectory, else its sample's earliest stage, else its
-- root's trained_step; NULL when none says (a sync run's step is then the generation step,
-- `step`; an async run's trajectory gated no step)
CREATE OR REPLACE VIEW trained_trajectories AS
SELECT t.run_id AS run_id, t.step AS step, coalesce(by_traj.step, by_uid.step, by_root.step) AS trained_step,
    t.uid AS uid, t.traj_uid AS traj_uid, t.start AS start, t.end AS end, t.start_ns AS start_ns, t.end_ns AS end_ns,
    t.duration_s AS duration_s, t.trace_id AS trace_id, t.span_id AS span_id
FROM trajectories AS t
LEFT JOIN (SELECT run_id, uid, traj_uid, toNullable(min(step)) AS step FROM sample_stages ARRAY JOIN traj_uids AS traj_uid
           WHERE uid != '' GROUP BY run_id, uid, traj_uid) AS by_traj
    ON by_traj.run_id = t.run_id AND by_traj.uid = t.uid AND by_traj.traj_uid = t.traj_uid
LEFT JOIN (SELECT run_id, uid, toNullable(min(step)) AS step FROM sample_stages WHERE uid != '' GROUP BY run_id, uid) AS by_uid
    ON by_uid.run_id = t.run_id AND by_uid.uid = t.uid
LEFT JOIN (SELECT run_id, uid, any(trained_step) AS step FROM samples WHERE uid != '' AND trained_step IS NOT NULL
           GROUP BY run_id, uid) AS by_root ON by_root.run_id = t.run_id AND by_root.uid = t.uid
WHERE NOT t.validate;
