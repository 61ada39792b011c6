"""The report computed in memory, in Python, from every span of the files: the reference
the span store's SQL report (:mod:`otel_verl.tools.store.report`, what ``otel-verl report``
prints) is tested against, section by section, on the demos and on generated runs. It is no
part of otel_verl: it holds every span of a run in memory, fine for a test's run, not for a
real one. Each figure is defined where otel_verl defines it (:mod:`otel_verl.tools.report.analysis`,
:mod:`otel_verl.tools.report.tail`); this module computes them another way, over span dicts.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from otel_verl import semconv as sc
from otel_verl.exporters.otlp_json_file import attributes_to_dict, flat_span
from otel_verl.tools.report.analysis import FINISHED_OUTCOMES, LastSeen, assign_lanes, losses, no_spans_section, read_sample_csv
from otel_verl.tools.report.inputs import InputError, Inputs, Lines, iter_lines, resolve
from otel_verl.tools.report.spans import NS, SpanIndex, duration_s, is_llm_call, is_trajectory, trajectory_split
from otel_verl.tools.report.tail import (NO_LINEAGE, SAMPLE_STAGE_PREFIX, WAITING_STAGES, Interval, Request,
                                         engine_requests, load_rank, main_replica)

STAGE_ORDER = [s.value for s in sc.Stage]
STEP_STAGE_PREFIX = sc.step_stage_span_name("")


def stage_of(span: Dict[str, Any]) -> str:
    return span["attributes"].get(sc.STAGE) or span["name"][len(STEP_STAGE_PREFIX):]


def merged(intervals: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The intervals (ns) merged into disjoint ones, in order; empty ones left out."""
    out: List[List[int]] = []
    for start, stop in sorted(intervals):
        if stop <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def union_s(intervals: Iterable[Tuple[int, int]]) -> float:
    """Seconds covered by at least one of the intervals (ns)."""
    return sum(b - a for a, b in merged(intervals)) / NS


def clipped(intervals: Iterable[Tuple[int, int]], lo: int, hi: int) -> List[Tuple[int, int]]:
    """The parts of the intervals within ``[lo, hi]``."""
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def read_spans(files: Sequence[str], lines: Lines) -> List[Dict[str, Any]]:
    """Every span as the flat dict of :func:`otel_verl.exporters.otlp_json_file.spans_from_files`."""
    out: List[Dict[str, Any]] = []
    for path, number, obj in iter_lines(files, lines):
        try:
            for resource_spans in obj["resourceSpans"]:
                resource = attributes_to_dict((resource_spans.get("resource") or {}).get("attributes"))
                for scope_spans in resource_spans.get("scopeSpans") or ():
                    scope = (scope_spans.get("scope") or {}).get("name", "")
                    for span in scope_spans.get("spans") or ():
                        flat = flat_span(span, resource, scope)
                        _check_types(flat)
                        flat["dropped"] = {  # what SDK span limits cut off
                            "attributes": int(span.get("droppedAttributesCount", 0)),
                            "events": int(span.get("droppedEventsCount", 0)),
                            "links": int(span.get("droppedLinksCount", 0)),
                        }
                        out.append(flat)
        except (AttributeError, TypeError, ValueError) as exc:
            raise InputError(f"{path}:{number}: malformed OTLP-JSON ({type(exc).__name__}: {exc})") from None
    return out


_TEXT_FIELDS = ("traceId", "spanId", "name")


def _check_types(flat: Dict[str, Any]) -> None:
    """TypeError where a span's field has a type no OTLP-JSON writer gives it (the report
    and the Perfetto writer read them as such)."""
    for key in _TEXT_FIELDS:
        if not isinstance(flat[key], str):
            raise TypeError(f"span {key} {flat[key]!r} is not a string")
    if not isinstance(flat["parentSpanId"], (str, type(None))):
        raise TypeError(f"span parentSpanId {flat['parentSpanId']!r} is not a string")
    if not isinstance(flat["kind"], int):
        raise TypeError(f"span kind {flat['kind']!r} is not an integer")
    for attributes in (flat["attributes"], flat["resource"]):
        for key in attributes:
            if not isinstance(key, str):
                raise TypeError(f"attribute key {key!r} is not a string")


def training_trajectories(spans: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [s for s in spans if is_trajectory(s) and not s["attributes"].get(sc.VALIDATE)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def steps_section(spans: List[Dict[str, Any]]) -> Tuple[List[str], List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``(stage names in order, one row per step, how each step's stages overlap)``."""
    step_spans: Dict[int, Dict[str, Any]] = {}
    stages: Dict[int, Dict[str, List[Dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        step = span["attributes"].get(sc.GLOBAL_STEP)
        if not isinstance(step, int):
            continue
        if span["name"] == sc.SPAN_STEP:
            step_spans[step] = span
        elif span["name"].startswith(STEP_STAGE_PREFIX):
            stages[step][stage_of(span)].append(span)
    seen = {stage for per_step in stages.values() for stage in per_step}
    order = [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))
    rows = []
    overlap = []
    for step in sorted(set(step_spans) | set(stages)):
        span = step_spans.get(step)
        per_stage = stages.get(step, {})
        intervals = {stage: [(s["startTimeUnixNano"], s["endTimeUnixNano"]) for s in per_stage[stage]]
                     for stage in order if stage in per_stage}
        overlap.append({"step": step, **concurrency(intervals)})
        row: Dict[str, Any] = {
            "step": step,
            "finished": span is not None,
            "start_unix_nano": span["startTimeUnixNano"] if span else min(s["startTimeUnixNano"] for v in per_stage.values() for s in v),
            "duration_s": duration_s(span) if span else None,
            "stages": {stage: sum(duration_s(s) for s in per_stage[stage]) for stage in order if stage in per_stage},
            "other_s": None,
        }
        if span is not None:
            lo, hi = span["startTimeUnixNano"], span["endTimeUnixNano"]
            covered = union_s(
                (max(s["startTimeUnixNano"], lo), min(s["endTimeUnixNano"], hi))
                for v in per_stage.values() for s in v
                if s["endTimeUnixNano"] > lo and s["startTimeUnixNano"] < hi
            )
            row["other_s"] = row["duration_s"] - covered
        rows.append(row)
    return order, rows, overlap


def concurrency(intervals: Dict[str, List[Tuple[int, int]]]) -> Dict[str, Any]:
    """How a step's stages overlap, from each stage's ``(start, end)`` intervals (ns):
    ``stages_union_s``, the time any stage ran; ``concurrent_s``, what the stages' times
    add beyond it (0 when they ran one after another); ``concurrent_stages``, the stages
    that ran while another did."""
    own = {stage: merged(spans_of) for stage, spans_of in intervals.items()}
    union = union_s(i for spans_of in own.values() for i in spans_of)
    total = sum(hi - lo for spans_of in intervals.values() for lo, hi in spans_of) / NS
    concurrent = set()
    for (a, a_spans), (b, b_spans) in itertools.combinations(own.items(), 2):
        if any(max(lo_a, lo_b) < min(hi_a, hi_b) for lo_a, hi_a in a_spans for lo_b, hi_b in b_spans):
            concurrent.update((a, b))
    return {
        "stages_union_s": union,
        "concurrent_s": max(0.0, total - union),
        "concurrent_stages": [stage for stage in intervals if stage in concurrent],
    }


def rollout_section(trajectories: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    by_step: Dict[Any, List[float]] = defaultdict(list)
    for span in trajectories:
        by_step[span["attributes"].get(sc.GLOBAL_STEP)].append(duration_s(span))
    rows = []
    for step in sorted(by_step, key=lambda s: (s is None, s if isinstance(s, int) else 0)):
        values = by_step[step]
        rows.append({
            "step": step,
            "count": len(values),
            "p50_s": percentile(values, 50),
            "p90_s": percentile(values, 90),
            "p99_s": percentile(values, 99),
            "max_s": max(values),
        })
    return rows


def slowest_section(trajectories: List[Dict[str, Any]], index: SpanIndex, top: int) -> List[Dict[str, Any]]:
    ranked = sorted(trajectories, key=lambda s: (-duration_s(s), s["spanId"]))[: max(0, top)]
    return [trajectory_split(t, index) for t in ranked]


def samples_section(spans: List[Dict[str, Any]], csv_paths: Sequence[str], limit: Optional[int]) -> Dict[str, Any]:
    roots: Dict[str, Dict[str, Any]] = {}
    validation_uids = set()
    last_seen: Dict[str, LastSeen] = {}
    for span in spans:
        attrs = span["attributes"]
        uid = attrs.get(sc.UID)
        if not isinstance(uid, str):
            continue
        if span["name"] == sc.SPAN_SAMPLE:
            roots[uid] = span
        if is_trajectory(span) and attrs.get(sc.VALIDATE):
            validation_uids.add(uid)
        t = span["endTimeUnixNano"] or span["startTimeUnixNano"]
        if uid not in last_seen or t > last_seen[uid][0]:
            last_seen[uid] = (t, f"span {span['name']}", attrs.get(sc.GLOBAL_STEP))
    csv_uids, csv_complete, csv_last = read_sample_csv(csv_paths)
    for uid, seen in csv_last.items():
        if uid not in last_seen or seen[0] > last_seen[uid][0]:
            last_seen[uid] = seen
    outcomes = Counter(root["attributes"].get(sc.SAMPLE_OUTCOME) or "(none)" for root in roots.values())
    unfinished = []
    for uid, root in roots.items():
        outcome = root["attributes"].get(sc.SAMPLE_OUTCOME)
        if outcome not in FINISHED_OUTCOMES:
            unfinished.append({"uid": uid, "state": f"outcome {outcome or '(none)'}",
                               "step": root["attributes"].get(sc.GLOBAL_STEP), "last_seen": last_seen[uid][1]})
    seen = (set(last_seen) | csv_uids) - validation_uids
    for uid in sorted(seen - set(roots) - csv_complete):
        t, where, step = last_seen.get(uid, (0, "CSV", None))
        unfinished.append({"uid": uid, "state": "no finished verl.sample span", "step": step, "last_seen": where})
    unfinished.sort(key=lambda u: (u["step"] if isinstance(u["step"], int) else -1, u["uid"]))
    return {
        "roots": len(roots),
        "outcomes": dict(sorted(outcomes.items())),
        "csv_uids": len(csv_uids),
        "unfinished_count": len(unfinished),
        "unfinished": unfinished if limit is None else unfinished[: max(0, limit)],
    }


def losses_section(spans: List[Dict[str, Any]], trajectories: List[Dict[str, Any]], inputs: Inputs,
                   lines: Lines) -> Dict[str, Any]:
    """What could have been lost, and whether the outputs agree with each other."""
    limits = {"attributes": 0, "events": 0, "links": 0}
    for span in spans:
        for key in limits:
            limits[key] += span.get("dropped", {}).get(key, 0)
    return losses(inputs, span_limit_drops=limits, truncated_lines=len(lines.truncated),
                  trajectory_spans=len(trajectories) if spans else None)


def shape_section(spans: List[Dict[str, Any]], fit: Dict[str, Any], trainer: Optional[str], steps: List[Dict[str, Any]],
                  trajectories: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What kind of run it is: trainer, layout, ``async`` when a sample was trained in a
    later step than the one that generated it (its ``verl.sample_stage`` spans' step past
    its trajectories'), else ``sync``; prompts per step and n (``verl.fit``'s
    ``train_batch_size`` and ``rollout_n``, else counted from the trajectories), steps."""
    layouts = sorted({str(s["attributes"][sc.LAYOUT]) for s in spans
                      if s["name"] in (sc.SPAN_STEP, sc.SPAN_FIT) and s["attributes"].get(sc.LAYOUT)})
    generated: Dict[str, int] = {}
    uids_per_step: Dict[Any, set] = defaultdict(set)
    trajs_per_uid: Counter = Counter()
    for traj in trajectories:
        uid, step = traj["attributes"].get(sc.UID), traj["attributes"].get(sc.GLOBAL_STEP)
        uids_per_step[step].add(uid)
        trajs_per_uid[uid] += 1
        if isinstance(step, int) and isinstance(uid, str):
            generated[uid] = min(step, generated.get(uid, step))
    later = any(
        isinstance(s["attributes"].get(sc.GLOBAL_STEP), int) and s["attributes"].get(sc.UID) in generated
        and s["attributes"][sc.GLOBAL_STEP] > generated[s["attributes"][sc.UID]]
        for s in spans if s["name"].startswith(sc.sample_stage_span_name(""))
    )
    return {
        "trainer": trainer,
        "layout": "/".join(layouts) or None,
        "mode": "async" if later else "sync",
        "prompts": fit.get(sc.TRAIN_BATCH_SIZE) or max((len(u) for u in uids_per_step.values()), default=None),
        "n": fit.get(sc.ROLLOUT_N) or max(trajs_per_uid.values(), default=None),
        "steps": len(steps),
    }


def build(paths: Sequence[str], *, top: int = 5, unfinished_limit: Optional[int] = 20) -> Dict[str, Any]:
    """The whole report as a JSON-ready dict (see :mod:`otel_verl.tools.report` for its keys);
    ``unfinished_limit`` caps the listed unfinished samples (``None``: all)."""
    inputs = resolve(paths)
    lines = Lines()
    spans = read_spans(inputs.otlp_files, lines)
    # a trace dir whose spans went to a collector only still has its legacy files and counters
    if not spans and not (inputs.loss_files or inputs.sample_csv or inputs.metric_files):
        raise InputError(f"no spans in {', '.join(paths)} ({len(inputs.otlp_files)} file(s), {lines.lines} line(s))")
    no_spans = None if spans else no_spans_section(paths, inputs)
    index = SpanIndex(spans)
    stage_order, steps, stage_overlap = steps_section(spans)
    trajectories = training_trajectories(spans)
    runs = sorted({str(s["resource"].get(sc.RUN_ID)) for s in spans if s["resource"].get(sc.RUN_ID)})
    fit = next((s["attributes"] for s in spans if s["name"] == sc.SPAN_FIT), {})
    trainer = fit.get(sc.TRAINER) or next((s["attributes"].get(sc.TRAINER) for s in spans if s["name"] == sc.SPAN_STEP), None)
    shape = shape_section(spans, fit, trainer, steps, trajectories)
    return {
        "inputs": {
            "paths": list(paths),
            "otlp_files": inputs.otlp_files,
            "lines": lines.lines,
            "spans": len(spans),
            "traces": len({s["traceId"] for s in spans}),
            "truncated": len(lines.truncated),
            "truncated_files": [{"path": t.path, "bytes": t.size} for t in lines.truncated],
            "repaired": sum(lines.repaired.values()),
            "repaired_files": [{"path": path, "characters": n} for path, n in lines.repaired.items()],
            "skipped_files": [{"path": path, "what": what} for path, what in inputs.skipped],
            "legacy_files": {
                "sample_csv": len(inputs.sample_csv),
                "progress": len(inputs.progress_logs),
                "trajectory_jsonl": len(inputs.trajectory_jsonl),
            },
        },
        "no_spans": no_spans,
        "runs": runs or (no_spans["runs"] if no_spans else []),
        "trainer": trainer,
        "shape": shape,
        "stage_order": stage_order,
        "steps": steps,
        "stage_overlap": stage_overlap,
        "rollout_latency": rollout_section(trajectories),
        "trajectories": len(trajectories),
        "slowest_trajectories": slowest_section(trajectories, index, top),
        "tail": tail_section(spans, index, trajectories, asynchronous=shape["mode"] == "async"),
        "samples": samples_section(spans, inputs.sample_csv, unfinished_limit),
        "losses": losses_section(spans, trajectories, inputs, lines),
        "timeline": _timeline_data(spans, steps, trajectories),
    }


def _timeline_data(spans: List[Dict[str, Any]], steps: List[Dict[str, Any]],
                   trajectories: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per step: stage bars and trajectory bars in seconds since the step started."""
    by_step = {row["step"]: row["start_unix_nano"] for row in steps}
    out: Dict[int, Dict[str, Any]] = {step: {"step": step, "stages": [], "trajectories": []} for step in by_step}
    for span in spans:
        step = span["attributes"].get(sc.GLOBAL_STEP)
        if step in out and span["name"].startswith(STEP_STAGE_PREFIX):
            t0 = by_step[step]
            out[step]["stages"].append({
                "stage": stage_of(span),
                "start_s": (span["startTimeUnixNano"] - t0) / NS,
                "duration_s": duration_s(span),
            })
    for span in trajectories:
        step = span["attributes"].get(sc.GLOBAL_STEP)
        if step in out:
            out[step]["trajectories"].append({
                "start_s": (span["startTimeUnixNano"] - by_step[step]) / NS,
                "duration_s": duration_s(span),
            })
    for row in out.values():
        row["stages"].sort(key=lambda b: b["start_s"])
        row["trajectories"].sort(key=lambda b: b["start_s"])
        assign_lanes(row["stages"])
    return [out[step] for step in sorted(out)]


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
