"""The report's ``tail`` from the span store (:mod:`otel_verl.tools.report.tail` defines
every figure), as SQL on the store.

- Which step trained each training trajectory, its rollout window and critical-path
  trajectory: one aggregate row per step (``_assigned``, ``_WINDOWS``).
- The critical path's split and replicas: :func:`spans.trajectory_split` and
  :func:`tail.engine_requests` on that one trajectory's spans (:func:`store.spans.subtree`).
- Engine requests: the ``engine_requests`` view (parent links, no walk), of the training
  trajectories by their turns' (trace_id, uid, traj_uid); a window's load reads only the
  traces with a request-bearing span in it. Running intervals: the trajectories
  overlapping the step's span (its time in the sort key) less the pauses between their
  turns' attempts (the turns read by the trajectories' step). Busy and running time are
  interval unions folded in SQL.
- The staleness histogram: ``samples`` counted per trained step and staleness.

With ``steps`` (first, last): the rows of the steps those are (by the step that trained
them), the staleness of the samples they trained, the async trajectories generated in them
that no step trained; ``replicas`` stays every replica of the run (each step ranks them all):
the one read of the whole run.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from otel_verl import semconv as sc
from otel_verl.tools.report.spans import NS, SpanIndex, trajectory_split
from otel_verl.tools.report.tail import NO_LINEAGE, WAITING_STAGES, engine_requests, load_rank, main_replica
from otel_verl.tools.store.intervals import clipped, merged, union_ns
from otel_verl.tools.store.spans import subtree
from otel_verl.tools.store.store import Store


def _literals(values: Any) -> str:
    return ", ".join("'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" for v in values)


_LLM_OPS = _literals((sc.OP_CHAT, sc.OP_TEXT_COMPLETION))
_ATTEMPT, _SERVER = _literals([sc.SPAN_LLM_ATTEMPT]), _literals([sc.SPAN_LLM_SERVER])
_WAITING = _literals(WAITING_STAGES)
_RUN = "run_id = {run:String}"
_IN_STEPS = "BETWEEN {first:Int64} AND {last:Int64}"


def _assigned(candidates: str, uids: str) -> str:
    """Each training trajectory with the step that trained it (tail.py's rule: the earliest
    sample_stage listing it, else its sample's earliest stage, else the root's
    trained_step, else, sync, the step that generated it); ``candidates`` and ``uids``
    narrow the trajectories and samples read. The view ``trained_trajectories`` (what the
    dashboard reads) says the same for a whole run: the engine would not narrow its joins."""
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

# the engine requests of training trajectories: a request names its trajectory by its
# turn's (trace_id, uid, traj_uid), which worker.py copies from the trajectory
def _training(traces: str) -> str:
    return f"""(trace_id, uid, traj_uid) IN (
    SELECT trace_id, uid, traj_uid FROM trajectories WHERE {_RUN} AND NOT validate AND {traces})"""


_REPLICAS = f"""
SELECT DISTINCT replica FROM engine_requests WHERE {_RUN} AND {_training("1")} ORDER BY replica
"""
# each replica's requests overlapping the window [lo, hi] and their union within it; only
# the traces with a unit or server span in the window are read (a request is one of those)
_WINDOW_TRACES = f"""trace_id IN (
    SELECT TraceId FROM otel_traces
    WHERE RunId = {{run:String}}
        AND (SpanName IN ({_ATTEMPT}, {_SERVER}) OR SpanAttributes['{sc.GEN_AI_OPERATION_NAME}'] IN ({_LLM_OPS}))
        AND toUnixTimestamp64Nano(Timestamp) < {{hi:Int64}}
        AND toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) > {{lo:Int64}})"""
_REPLICA_LOAD = f"""
SELECT replica, count() AS requests,
    {union_ns("groupArray((greatest(start_ns, {lo:Int64}), least(end_ns, {hi:Int64})))")} AS busy_ns
FROM engine_requests
WHERE {_RUN} AND start_ns < {{hi:Int64}} AND end_ns > {{lo:Int64}} AND {_WINDOW_TRACES}
    AND {_training(_WINDOW_TRACES)}
GROUP BY replica
"""
# the time within [lo, hi] some training trajectory runs (tail.running_intervals: its span
# less the pauses between consecutive attempts of a turn), of the trajectories overlapping
# it; their turns are read by their step (the trajectory's, in the sort key)
_RUNNING = f"""
WITH overlapping AS (
    SELECT trace_id, uid, traj_uid, step, start_ns AS s, end_ns AS e FROM trajectories
    WHERE {_RUN} AND NOT validate AND start_ns < {{hi:Int64}} AND end_ns > {{lo:Int64}}),
turn_pauses AS (
    SELECT t.TraceId AS trace_id, t.Uid AS uid, t.TrajUid AS traj_uid,
        arraySort(groupArray((a.start_ns, a.end_ns))) AS sorted,
        arrayMap(i -> (sorted[i].2, sorted[i + 1].1), range(1, length(sorted))) AS pauses
    FROM otel_traces AS t
    INNER JOIN (SELECT TraceId, ParentSpanId, toUnixTimestamp64Nano(Timestamp) AS start_ns,
                    toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) AS end_ns
                FROM otel_traces WHERE RunId = {{run:String}} AND SpanName = {_ATTEMPT}) AS a
        ON a.TraceId = t.TraceId AND a.ParentSpanId = t.SpanId
    WHERE t.RunId = {{run:String}} AND t.Step IN (SELECT step FROM overlapping)
        AND t.SpanAttributes['{sc.GEN_AI_OPERATION_NAME}'] IN ({_LLM_OPS})
    GROUP BY t.TraceId, t.SpanId, t.Uid, t.TrajUid),
trajectory_pauses AS (
    SELECT trace_id, uid, traj_uid, arrayFlatten(groupArray(pauses)) AS pauses FROM turn_pauses
    GROUP BY trace_id, uid, traj_uid)
SELECT {union_ns(clipped("groupArray(x)", "{lo:Int64}", "{hi:Int64}"))} AS running_ns
FROM (SELECT arrayJoin(arrayFilter(x -> x.2 > x.1, arrayZip(arrayConcat([s], arrayMap(x -> x.2, merged)),
                                                            arrayConcat(arrayMap(x -> x.1, merged), [e])))) AS x
      FROM (SELECT o.s AS s, o.e AS e, {merged(clipped("p.pauses", "o.s", "o.e"))} AS merged
            FROM overlapping AS o
            LEFT JOIN trajectory_pauses AS p ON p.trace_id = o.trace_id AND p.uid = o.uid AND p.traj_uid = o.traj_uid))
"""
# per step span: the trainer's waits (the waiting stages, and the gap from the step's start
# to its first other stage), their union within the span
_STEP_WAITS = f"""
SELECT s.step AS step, s.start_ns AS lo, s.end_ns AS hi,
    {union_ns(clipped("arrayPushBack(g.waits, (s.start_ns, ifNull(g.first_work, s.end_ns)))",
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
