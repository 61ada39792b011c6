"""The tail of each step, explained: which trajectory set the step's rollout wall clock,
on which LLM server replica, how loaded the replicas were, how long each side of the
loop waited for the other, and how stale the trained samples were.

Definitions (the README's "Reading a run" says the same):

- A step's **trajectories** are the training trajectory spans (``invoke_agent``, not
  ``verl.validate``) that step trained: the ``verl.global_step`` of the
  ``verl.sample_stage`` spans that list the trajectory in ``verl.traj_uids`` (the earliest,
  should several steps list it), else of its sample's stage spans, else its sample root's
  ``verl.trained_step``. In the sync modes a trajectory no step trained belongs to the step
  that generated it (its own ``verl.global_step``); in the async ones, where a step trains
  what earlier weights generated, it gated no step and is counted as ``untrained``. Each
  row says the **generation steps** of its trajectories. A step's **rollout window** runs
  from the first one's start to the last one's end.
- The **critical-path trajectory** is the one that ended last (ties: the longer one): it
  set the end of the rollout window. Its split is :func:`spans.trajectory_split`'s, as
  for the slowest trajectories.
- An **engine request** is what one replica served: a ``verl.llm_server.generate`` span
  (under its ``chat`` turn, or under the turn's ``verl.llm.attempt`` when verl's client
  resumed it), else, without a server span, the attempt or the turn itself when it names
  its server. Its **replica** is the turn's (or attempt's) ``verl.llm.server_id``, else the
  server span's process (``ray.actor_id``, else ``service.instance.id``). The replica of a
  trajectory is the one that served the most of its requests' time.
- A replica's **busy time** in a step is the union of its engine requests' intervals
  within the step's rollout window (requests of any training trajectory: what the replica
  did during that window), its **requests** those overlapping the window. Every replica
  seen in the run is ranked, so one that served nothing in the step is the idlest with 0.
- The **training side's wait** in a step is the part of its ``verl.step`` span in which
  the trainer waits for samples: the ``generation`` and ``fetch_batch`` stages (v1's
  ``generation`` is its replay-buffer wait) and the gap from the step's start to its first
  other stage. The **rollout side's wait** is the part of the same span in which no
  training trajectory runs; a trajectory runs from its start to its end except between an
  aborted engine request and the attempt that resumes it (a weight sync's pause). One
  rule for every layout: in the sync ones it comes to the rollout (training waits) and the
  training stages (rollout idles); in ``colocate_async`` / ``separate_async`` it is what
  the spans' overlap leaves.
- The **staleness** histogram counts the ``verl.sample`` roots by ``verl.staleness`` (the
  weight updates between the oldest weights behind the sample and the ones its training
  step trains, as verl counts it: docs/SPANS.md, "Lineage") per ``verl.trained_step``;
  roots without both attributes are left out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple

from otel_verl import semconv as sc
from otel_verl.tools.report.spans import (NS, STEP_STAGE_PREFIX, SpanIndex, clipped, is_llm_call, merged, stage_of,
                                    trajectory_split, union_s)

SAMPLE_STAGE_PREFIX = sc.sample_stage_span_name("")
WAITING_STAGES = (sc.Stage.GENERATION.value, sc.Stage.FETCH_BATCH.value)  # the trainer waits for samples
NO_LINEAGE = "no lineage in these spans"

Interval = Tuple[int, int]
Request = Tuple[str, int, int]  # (replica, start ns, end ns)


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _replica_of_process(resource: Dict[str, Any]) -> Optional[str]:
    value = resource.get(sc.RAY_ACTOR_ID) or resource.get(sc.SERVICE_INSTANCE_ID)
    return str(value) if value else None


def engine_requests(traj: Dict[str, Any], index: SpanIndex) -> List[Request]:
    """The trajectory's engine requests as ``(replica, start, end)``; requests whose
    replica is unknown are left out."""
    out: List[Request] = []
    for turn in (s for s in index.descendants(traj) if is_llm_call(s)):
        attempts = [c for c in index.children_of(turn) if c["name"] == sc.SPAN_LLM_ATTEMPT]
        for unit in [turn, *attempts]:
            named = unit["attributes"].get(sc.LLM_SERVER_ID) or turn["attributes"].get(sc.LLM_SERVER_ID)
            servers = [c for c in index.children_of(unit) if c["name"] == sc.SPAN_LLM_SERVER]
            for server in servers:
                replica = str(named) if named else _replica_of_process(server.get("resource") or {})
                if replica:
                    out.append((replica, server["startTimeUnixNano"], server["endTimeUnixNano"]))
            # a turn with attempts is no request of its own: its attempts are
            if not servers and named and (unit is not turn or not attempts):
                out.append((str(named), unit["startTimeUnixNano"], unit["endTimeUnixNano"]))
    return out


def running_intervals(traj: Dict[str, Any], index: SpanIndex) -> List[Interval]:
    """When the trajectory runs: its span less the pauses between an aborted attempt's end
    and the next attempt's start of the same turn."""
    pauses: List[Interval] = []
    for turn in (s for s in index.descendants(traj) if is_llm_call(s)):
        attempts = sorted((c for c in index.children_of(turn) if c["name"] == sc.SPAN_LLM_ATTEMPT),
                          key=lambda s: s["startTimeUnixNano"])
        for before, after in zip(attempts, attempts[1:]):
            pauses.append((before["endTimeUnixNano"], after["startTimeUnixNano"]))
    out: List[Interval] = []
    cursor, end = traj["startTimeUnixNano"], traj["endTimeUnixNano"]
    for lo, hi in merged(clipped(pauses, cursor, end)):
        out.append((cursor, lo))
        cursor = hi
    out.append((cursor, end))
    return [(a, b) for a, b in out if b > a]


def main_replica(requests: List[Request]) -> Optional[str]:
    """The replica that served the most of ``requests``' time (ties: by name)."""
    served: Dict[str, int] = defaultdict(int)
    for replica, start, end in requests:
        served[replica] += end - start
    return min(served, key=lambda r: (-served[r], r)) if served else None


def _replica_load(replicas: List[str], requests: List[Request], window: Interval) -> List[Dict[str, Any]]:
    lo, hi = window
    per: Dict[str, List[Interval]] = defaultdict(list)
    for replica, start, end in requests:
        per[replica].append((start, end))
    wall = (hi - lo) / NS
    rows = []
    for replica in replicas:
        inside = clipped(per.get(replica, ()), lo, hi)
        busy = union_s(inside)
        rows.append({"replica": replica, "busy_s": busy, "requests": len(inside),
                     "busy_fraction": busy / wall if wall > 0 else None})
    return rows


def load_rank(load: Dict[str, Any]) -> Tuple[float, int, str]:
    """How a window's replicas rank from idlest to busiest: busy time, then requests, then name."""
    return load["busy_s"], load["requests"], load["replica"]


def _waiting(step_span: Dict[str, Any], stages: List[Dict[str, Any]], running: List[Interval]) -> Dict[str, float]:
    lo, hi = step_span["startTimeUnixNano"], step_span["endTimeUnixNano"]
    working = [s for s in stages if stage_of(s) not in WAITING_STAGES]
    waits = [(s["startTimeUnixNano"], s["endTimeUnixNano"]) for s in stages if stage_of(s) in WAITING_STAGES]
    first_work = min((s["startTimeUnixNano"] for s in working), default=hi)
    waits.append((lo, first_work))
    return {
        "step_s": (hi - lo) / NS,
        "training_s": union_s(clipped(waits, lo, hi)),
        "rollout_s": (hi - lo) / NS - union_s(clipped(running, lo, hi)),
    }


def trained_steps(spans: Iterable[Dict[str, Any]]) -> Tuple[Dict[Tuple[str, str], int], Dict[str, int]]:
    """``({(uid, traj_uid): step}, {uid: step})``: the step that trained each trajectory
    and each sample, from the ``verl.sample_stage`` spans (the earliest step that lists
    them), then the sample roots' ``verl.trained_step``."""
    per_traj: Dict[Tuple[str, str], int] = {}
    per_uid: Dict[str, int] = {}
    roots: Dict[str, int] = {}
    for span in spans:
        attrs = span["attributes"]
        uid = attrs.get(sc.UID)
        if not isinstance(uid, str):
            continue
        if span["name"] == sc.SPAN_SAMPLE:
            trained = _int(attrs.get(sc.TRAINED_STEP))
            if trained is not None:
                roots[uid] = trained
            continue
        step = _int(attrs.get(sc.GLOBAL_STEP))
        if step is None or not span["name"].startswith(SAMPLE_STAGE_PREFIX):
            continue
        per_uid[uid] = min(step, per_uid.get(uid, step))
        for traj in attrs.get(sc.TRAJ_UIDS) or ():
            key = (uid, str(traj))
            per_traj[key] = min(step, per_traj.get(key, step))
    return per_traj, {**roots, **per_uid}


def _steps_of(trajectories: List[Dict[str, Any]], spans: List[Dict[str, Any]],
              asynchronous: bool) -> Tuple[Dict[int, List[Dict[str, Any]]], int]:
    """The trajectories by the step that trained them (see the module docstring), and how
    many of them no step trained in an async run."""
    per_traj, per_uid = trained_steps(spans)
    by_step: Dict[int, List[Dict[str, Any]]] = defaultdict(list)
    untrained = 0
    for traj in trajectories:
        attrs = traj["attributes"]
        uid = attrs.get(sc.UID)
        step = per_traj.get((uid, str(attrs.get(sc.TRAJ_UID))), per_uid.get(uid))
        if step is None and not asynchronous:
            step = _int(attrs.get(sc.GLOBAL_STEP))
        if step is not None:
            by_step[step].append(traj)
        elif asynchronous:
            untrained += 1
    return by_step, untrained


def staleness_section(spans: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """Per ``verl.trained_step``, how many ``verl.sample`` roots had each ``verl.staleness``."""
    per_step: Dict[int, Counter] = defaultdict(Counter)
    for span in spans:
        if span["name"] != sc.SPAN_SAMPLE:
            continue
        staleness = _int(span["attributes"].get(sc.STALENESS))
        trained = _int(span["attributes"].get(sc.TRAINED_STEP))
        if staleness is not None and trained is not None:
            per_step[trained][staleness] += 1
    rows = [{"trained_step": step, "samples": sum(per_step[step].values()),
             "histogram": [{"staleness": k, "samples": v} for k, v in sorted(per_step[step].items())]}
            for step in sorted(per_step)]
    return {"lineage": bool(rows), "note": None if rows else NO_LINEAGE, "per_step": rows}


def tail_section(spans: List[Dict[str, Any]], index: SpanIndex, trajectories: List[Dict[str, Any]],
                 asynchronous: bool = False) -> Dict[str, Any]:
    """``{"replicas": every replica seen, "steps": one row per step, "untrained": async
    trajectories no step trained, "staleness": ...}``."""
    by_step, untrained = _steps_of(trajectories, spans, asynchronous)
    requests: List[Request] = []
    running: List[Interval] = []
    requests_of: Dict[Tuple[str, str], List[Request]] = {}  # by (trace id, span id)
    for traj in trajectories:
        mine = engine_requests(traj, index)
        requests += mine
        requests_of[(traj["traceId"], traj["spanId"])] = mine
        running += running_intervals(traj, index)
    step_spans: Dict[int, Dict[str, Any]] = {}
    stages: Dict[int, List[Dict[str, Any]]] = defaultdict(list)
    for span in spans:
        step = _int(span["attributes"].get(sc.GLOBAL_STEP))
        if step is None:
            continue
        if span["name"] == sc.SPAN_STEP:
            step_spans[step] = span
        elif span["name"].startswith(STEP_STAGE_PREFIX):
            stages[step].append(span)
    replicas = sorted({r for r, _, _ in requests})
    rows = []
    for step in sorted(set(by_step) | set(step_spans)):
        trajs = by_step.get(step, [])
        row: Dict[str, Any] = {"step": step, "rollout_window": None, "critical_path": None,
                               "replicas": None, "waiting": None}
        if trajs:
            window = (min(t["startTimeUnixNano"] for t in trajs), max(t["endTimeUnixNano"] for t in trajs))
            row["rollout_window"] = {"start_unix_nano": window[0], "end_unix_nano": window[1],
                                     "wall_s": (window[1] - window[0]) / NS, "trajectories": len(trajs),
                                     "generation_steps": _generation_steps(trajs)}
            last = max(trajs, key=lambda t: (t["endTimeUnixNano"], t["endTimeUnixNano"] - t["startTimeUnixNano"],
                                             t["spanId"]))
            mine = requests_of[(last["traceId"], last["spanId"])]
            row["critical_path"] = {**trajectory_split(last, index),
                                    "generation_step": _int(last["attributes"].get(sc.GLOBAL_STEP)),
                                    "replica": main_replica(mine),
                                    "replicas": sorted({r for r, _, _ in mine}),
                                    "started_s": (last["startTimeUnixNano"] - window[0]) / NS}
            if replicas:
                load = _replica_load(replicas, requests, window)
                row["replicas"] = {
                    "busiest": max(load, key=load_rank),
                    "idlest": min(load, key=load_rank),
                    "per_replica": load,
                }
        if step in step_spans:
            row["waiting"] = _waiting(step_spans[step], stages.get(step, []), running)
        rows.append(row)
    return {"replicas": replicas, "steps": rows, "untrained": untrained, "staleness": staleness_section(spans)}


def _generation_steps(trajectories: List[Dict[str, Any]]) -> List[int]:
    return sorted({step for step in (_int(t["attributes"].get(sc.GLOBAL_STEP)) for t in trajectories) if step is not None})
