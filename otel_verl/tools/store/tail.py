"""The report's ``tail`` from the span store: the keys and values of the in-memory one
(:mod:`otel_verl.tools.report.tail` defines every figure), as SQL on the store.

- Which step trained each training trajectory, its rollout window and critical-path
  trajectory: one aggregate row per step (``_assigned``, ``_WINDOWS``).
- The critical path's split and replicas: the in-memory :func:`spans.trajectory_split` and
  :func:`tail.engine_requests` on that one trajectory's spans (:func:`store.spans.subtree`).
- Engine requests and running intervals: the descendants of the training trajectories
  (a recursive walk down the parent links, ``_NODES``), only in the traces that matter for
  the step's window or span; busy and running time are interval unions folded in SQL.
- The staleness histogram: ``samples`` counted per trained step and staleness.

With ``steps`` (first, last): the rows of the steps those are (by the step that trained
them), the staleness of the samples they trained, the async trajectories generated in them
that no step trained; ``replicas`` stays every replica of the run (each step ranks them all).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from otel_verl import semconv as sc
from otel_verl.tools.report.spans import NS, SpanIndex, trajectory_split
from otel_verl.tools.report.tail import NO_LINEAGE, WAITING_STAGES, engine_requests, load_rank, main_replica
from otel_verl.tools.store.spans import subtree
from otel_verl.tools.store.store import Store


def _literals(values: Any) -> str:
    return ", ".join("'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" for v in values)


_LLM_OPS = _literals((sc.OP_CHAT, sc.OP_TEXT_COMPLETION))
_ATTEMPT, _SERVER = _literals([sc.SPAN_LLM_ATTEMPT]), _literals([sc.SPAN_LLM_SERVER])
_WAITING = _literals(WAITING_STAGES)
_RUN = "run_id = {run:String}"
_IN_STEPS = "BETWEEN {first:Int64} AND {last:Int64}"


def _union_ns(intervals: str) -> str:
    """The nanoseconds covered by an array of (start, end) intervals (``spans.union_s``)."""
    return (f"arrayFold((acc, x) -> (acc.1 + greatest(toInt64(0), x.2 - greatest(x.1, acc.2)), greatest(acc.2, x.2)), "
            f"arraySort(x -> x.1, {intervals}), (toInt64(0), toInt64(0))).1")


def _clipped(intervals: str, lo: str, hi: str) -> str:
    """``spans.clipped``: the parts of the intervals within [lo, hi]."""
    return (f"arrayMap(x -> (greatest(x.1, {lo}), least(x.2, {hi})), "
            f"arrayFilter(x -> x.2 > {lo} AND x.1 < {hi}, {intervals}))")


def _merged(intervals: str) -> str:
    """``spans.merged``: the intervals as disjoint ones, in order, empty ones left out."""
    return ("arrayFold((acc, x) -> if(notEmpty(acc) AND x.1 <= acc[-1].2, "
            "arrayPushBack(arrayPopBack(acc), (acc[-1].1, greatest(acc[-1].2, x.2))), arrayPushBack(acc, x)), "
            f"arraySort(arrayFilter(x -> x.2 > x.1, {intervals})), CAST([], 'Array(Tuple(Int64, Int64))'))")


def _assigned(candidates: str, uids: str) -> str:
    """Each training trajectory with the step that trained it (tail.py's rule: the earliest
    sample_stage listing it, else its sample's earliest stage, else the root's
    trained_step, else, sync, the step that generated it); ``candidates`` and ``uids``
    narrow the trajectories and samples read."""
    return f"""
SELECT t.trace_id AS trace_id, t.span_id AS span_id, t.step AS generation_step, t.start_ns AS start_ns,
    t.end_ns AS end_ns,
    coalesce(by_traj.step, by_uid.step, by_root.step, if({{async:Bool}}, NULL, t.step)) AS trained_step
FROM (SELECT * FROM trajectories WHERE {_RUN} AND NOT validate AND {candidates}) AS t
LEFT JOIN (SELECT uid, traj_uid, toNullable(min(step)) AS step FROM sample_stages ARRAY JOIN traj_uids AS traj_uid
           WHERE {_RUN} AND uid != '' AND {uids} GROUP BY uid, traj_uid) AS by_traj
    ON by_traj.uid = t.uid AND by_traj.traj_uid = t.traj_uid
LEFT JOIN (SELECT uid, toNullable(min(step)) AS step FROM sample_stages WHERE {_RUN} AND uid != '' AND {uids}
           GROUP BY uid) AS by_uid ON by_uid.uid = t.uid
LEFT JOIN (SELECT uid, any(trained_step) AS step FROM samples
           WHERE {_RUN} AND uid != '' AND trained_step IS NOT NULL AND {uids} GROUP BY uid) AS by_root
    ON by_root.uid = t.uid
"""


# the trajectories that steps first..last may have trained: their samples' stages or roots
# name one of those steps, or they were generated in one
_CANDIDATES = f"""(uid IN (SELECT uid FROM sample_stages WHERE {_RUN} AND step {_IN_STEPS})
    OR uid IN (SELECT uid FROM samples WHERE {_RUN} AND trained_step {_IN_STEPS}) OR step {_IN_STEPS})"""
_CANDIDATE_UIDS = f"uid IN (SELECT uid FROM trajectories WHERE {_RUN} AND NOT validate AND {_CANDIDATES})"

# per step: its rollout window, and the trajectory that ended last (ties: the longer one)
_WINDOWS = """
SELECT trained_step AS step, min(start_ns) AS window_start, max(end_ns) AS window_end, count() AS trajectories,
    arraySort(groupUniqArray(generation_step)) AS generation_steps,
    argMax((trace_id, span_id, start_ns, generation_step), (end_ns, end_ns - start_ns, span_id)) AS last
FROM ({assigned}) WHERE trained_step {in_steps} GROUP BY trained_step
"""
_UNTRAINED = "SELECT count() AS n FROM ({assigned}) WHERE trained_step IS NULL AND {generated}"

# the descendants of the trajectories of `anchor` (trace_id, span_id, start_ns, end_ns) in
# their traces, as one row per trajectory: its span (s, e) and its descendants' `nodes`
# (span_id, parent, name, is_llm, server_id, process, start_ns, end_ns); referenced once,
# since the engine evaluates a CTE at each reference
_NODES = f"""
tree AS (
    SELECT trace_id, span_id, '' AS parent, span_id AS traj_span, '' AS name, toUInt8(0) AS is_llm,
        '' AS server_id, '' AS process, start_ns, end_ns, toUInt32(0) AS depth
    FROM anchor
    UNION ALL
    SELECT o.TraceId, o.SpanId, o.ParentSpanId, tree.traj_span, toString(o.SpanName),
        toUInt8(o.SpanAttributes['{sc.GEN_AI_OPERATION_NAME}'] IN ({_LLM_OPS})), toString(o.Replica),
        if(o.ResourceAttributes['{sc.RAY_ACTOR_ID}'] != '', o.ResourceAttributes['{sc.RAY_ACTOR_ID}'],
           o.ResourceAttributes['{sc.SERVICE_INSTANCE_ID}']),
        toUnixTimestamp64Nano(o.Timestamp), toUnixTimestamp64Nano(o.Timestamp) + toInt64(o.Duration),
        toUInt32(tree.depth + 1)
    FROM otel_traces AS o INNER JOIN tree ON o.TraceId = tree.trace_id AND o.ParentSpanId = tree.span_id
    WHERE o.RunId = {{run:String}} AND o.TraceId IN (SELECT trace_id FROM anchor) AND tree.depth < 64
),
trajectory_nodes AS (
    SELECT anyIf(start_ns, depth = 0) AS s, anyIf(end_ns, depth = 0) AS e,
        groupArrayIf((span_id, parent, name, is_llm, server_id, process, start_ns, end_ns), depth > 0) AS nodes,
        arrayFilter(n -> n.4 = 1, nodes) AS turns,
        arrayFilter(n -> n.3 = {_ATTEMPT} AND has(arrayMap(t -> t.1, turns), n.2), nodes) AS attempts
    FROM tree GROUP BY trace_id, traj_span
)
"""
# a trajectory's engine requests (tail.engine_requests) as (replica, start_ns, end_ns): its
# units, a turn (named: its server id) and each attempt of a resumed turn (named: its
# server id, else its turn's), as (span_id, named, start, end, is_turn); a unit's server
# spans, else the unit itself when it names its server (a turn with attempts is none)
_REQUESTS = f"""
arrayFlatten(arrayMap(u -> if(
    has(arrayMap(n -> n.2, arrayFilter(n -> n.3 = {_SERVER}, nodes)), u.1),
    arrayFilter(r -> r.1 != '', arrayMap(n -> (if(u.2 != '', u.2, n.6), n.7, n.8),
                                         arrayFilter(n -> n.2 = u.1 AND n.3 = {_SERVER}, nodes))),
    if(u.2 != '' AND (u.5 = 0 OR NOT has(arrayMap(a -> a.2, attempts), u.1)), [(u.2, u.3, u.4)],
       CAST([], 'Array(Tuple(String, Int64, Int64))'))),
  arrayConcat(arrayMap(t -> (t.1, t.5, t.7, t.8, toUInt8(1)), turns),
              arrayMap(a -> (a.1, if(a.5 != '', a.5, arrayFirst(t -> t.1 = a.2, turns).5), a.7, a.8, toUInt8(0)),
                       attempts))))
"""
_TRAINING_TRAJECTORIES = f"SELECT trace_id, span_id, start_ns, end_ns FROM trajectories WHERE {_RUN} AND NOT validate"
_REPLICAS = f"""
WITH RECURSIVE anchor AS ({_TRAINING_TRAJECTORIES}), {_NODES}
SELECT DISTINCT arrayJoin({_REQUESTS}).1 AS replica FROM trajectory_nodes ORDER BY replica
"""
# each replica's requests overlapping the window [lo, hi] and their union within it; the
# traces read are those with an engine request (a server span, attempt or turn) in the window
_REPLICA_LOAD = f"""
WITH RECURSIVE
anchor AS ({_TRAINING_TRAJECTORIES} AND trace_id IN (
    SELECT TraceId FROM otel_traces
    WHERE RunId = {{run:String}}
        AND (SpanName IN ({_ATTEMPT}, {_SERVER}) OR SpanAttributes['{sc.GEN_AI_OPERATION_NAME}'] IN ({_LLM_OPS}))
        AND toUnixTimestamp64Nano(Timestamp) < {{hi:Int64}}
        AND toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) > {{lo:Int64}})),
{_NODES}
SELECT request.1 AS replica, count() AS requests,
    {_union_ns("groupArray((greatest(request.2, {lo:Int64}), least(request.3, {hi:Int64})))")} AS busy_ns
FROM (SELECT arrayJoin({_REQUESTS}) AS request FROM trajectory_nodes)
WHERE request.3 > {{lo:Int64}} AND request.2 < {{hi:Int64}} GROUP BY replica
"""
# the time within [lo, hi] some training trajectory runs (tail.running_intervals: its span
# less the pauses between consecutive attempts of a turn), of the trajectories overlapping it
_PAUSES = """
arrayFlatten(arrayMap(sorted -> arrayMap(i -> (sorted[i].2, sorted[i + 1].1), range(1, length(sorted))),
    arrayMap(t -> arraySort(arrayMap(a -> (a.7, a.8), arrayFilter(a -> a.2 = t.1, attempts))), turns)))
"""
_RUNNING = f"""
WITH RECURSIVE
anchor AS ({_TRAINING_TRAJECTORIES} AND start_ns < {{hi:Int64}} AND end_ns > {{lo:Int64}}),
{_NODES}
SELECT {_union_ns(_clipped("groupArray(x)", "{lo:Int64}", "{hi:Int64}"))} AS running_ns
FROM (SELECT arrayJoin(arrayFilter(x -> x.2 > x.1, arrayZip(arrayConcat([s], arrayMap(x -> x.2, merged)),
                                                            arrayConcat(arrayMap(x -> x.1, merged), [e])))) AS x
      FROM (SELECT s, e, {_merged(_clipped(_PAUSES, "s", "e"))} AS merged FROM trajectory_nodes))
"""
# per step span: the trainer's waits (the waiting stages, and the gap from the step's start
# to its first other stage), their union within the span
_STEP_WAITS = f"""
SELECT s.step AS step, s.start_ns AS lo, s.end_ns AS hi,
    {_union_ns(_clipped("arrayPushBack(g.waits, (s.start_ns, ifNull(g.first_work, s.end_ns)))",
                        "s.start_ns", "s.end_ns"))} AS waiting_ns
FROM (SELECT step, any(start_ns) AS start_ns, any(end_ns) AS end_ns FROM steps WHERE {_RUN} AND step {_IN_STEPS}
      GROUP BY step) AS s
LEFT JOIN (SELECT step, groupArrayIf((start_ns, end_ns), stage IN ({_WAITING})) AS waits,
               minIfOrNull(start_ns, stage NOT IN ({_WAITING})) AS first_work
           FROM stages WHERE {_RUN} AND step {_IN_STEPS} GROUP BY step) AS g ON g.step = s.step
"""
_STALENESS = f"""
SELECT trained_step, staleness, count() AS samples FROM samples
WHERE {_RUN} AND trained_step {_IN_STEPS} AND staleness IS NOT NULL
GROUP BY trained_step, staleness ORDER BY trained_step, staleness
"""


def build(store: Store, run: Optional[str], steps: Optional[Tuple[int, int]], asynchronous: bool) -> Dict[str, Any]:
    """The ``tail`` section of ``run`` (of ``steps`` (first, last) when given);
    ``asynchronous``: the report's shape mode is ``async``."""
    params: Dict[str, Any] = {"run": run or "", "first": steps[0] if steps else -(1 << 62),
                              "last": steps[1] if steps else 1 << 62, "async": asynchronous}
    assigned = _assigned(_CANDIDATES, _CANDIDATE_UIDS) if steps else _assigned("1", "1")
    windows = {r["step"]: r for r in store.rows(_WINDOWS.format(assigned=assigned, in_steps=_IN_STEPS), params)}
    waits = {r["step"]: r for r in store.rows(_STEP_WAITS, params)}
    replicas = [r["replica"] for r in store.rows(_REPLICAS, params)]
    rows = []
    for step in sorted(set(windows) | set(waits)):
        row: Dict[str, Any] = {"step": step, "rollout_window": None, "critical_path": None, "replicas": None,
                               "waiting": None}
        window = windows.get(step)
        if window:
            lo, hi = window["window_start"], window["window_end"]
            row["rollout_window"] = {"start_unix_nano": lo, "end_unix_nano": hi, "wall_s": (hi - lo) / NS,
                                     "trajectories": window["trajectories"],
                                     "generation_steps": window["generation_steps"]}
            row["critical_path"] = _critical_path(store, params, window)
            if replicas:
                row["replicas"] = _replica_load(store, params, replicas, lo, hi)
        if step in waits:
            row["waiting"] = _waiting(store, params, waits[step])
        rows.append(row)
    untrained = 0
    if asynchronous:
        generated = f"generation_step {_IN_STEPS}" if steps else "1"
        untrained = store.rows(_UNTRAINED.format(assigned=assigned, generated=generated), params)[0]["n"]
    return {"replicas": replicas, "steps": rows, "untrained": untrained, "staleness": staleness(store, params)}


def staleness(store: Store, params: Dict[str, Any]) -> Dict[str, Any]:
    """``tail.staleness_section`` of the samples trained in steps ``params`` first..last."""
    per_step: Dict[int, List[Dict[str, Any]]] = {}
    for r in store.rows(_STALENESS, params):
        per_step.setdefault(r["trained_step"], []).append({"staleness": r["staleness"], "samples": r["samples"]})
    rows = [{"trained_step": step, "samples": sum(h["samples"] for h in histogram), "histogram": histogram}
            for step, histogram in per_step.items()]
    return {"lineage": bool(rows), "note": None if rows else NO_LINEAGE, "per_step": rows}


def _critical_path(store: Store, params: Dict[str, Any], window: Dict[str, Any]) -> Dict[str, Any]:
    trace_id, span_id, start_ns, generation_step = window["last"]
    spans = subtree(store, params["run"], trace_id, span_id)
    index = SpanIndex(spans)
    last = next(s for s in spans if s["spanId"] == span_id)
    mine = engine_requests(last, index)
    return {**trajectory_split(last, index), "generation_step": generation_step, "replica": main_replica(mine),
            "replicas": sorted({r for r, _, _ in mine}), "started_s": (start_ns - window["window_start"]) / NS}


def _replica_load(store: Store, params: Dict[str, Any], replicas: List[str], lo: int, hi: int) -> Dict[str, Any]:
    served = {r["replica"]: r for r in store.rows(_REPLICA_LOAD, {**params, "lo": lo, "hi": hi})}
    wall = (hi - lo) / NS
    load = []
    for replica in replicas:
        mine = served.get(replica, {"busy_ns": 0, "requests": 0})
        busy = mine["busy_ns"] / NS
        load.append({"replica": replica, "busy_s": busy, "requests": mine["requests"],
                     "busy_fraction": busy / wall if wall > 0 else None})
    return {"busiest": max(load, key=load_rank), "idlest": min(load, key=load_rank), "per_replica": load}


def _waiting(store: Store, params: Dict[str, Any], step: Dict[str, Any]) -> Dict[str, float]:
    lo, hi = step["lo"], step["hi"]
    running_ns = store.rows(_RUNNING, {**params, "lo": lo, "hi": hi})[0]["running_ns"]
    return {"step_s": (hi - lo) / NS, "training_s": step["waiting_ns"] / NS,
            "rollout_s": (hi - lo) / NS - running_ns / NS}
