"""The numbers of ``otel-verl report``, computed from spans (and a trace dir's legacy files).

Every figure names the spans it comes from (``docs/SPANS.md``):

- **steps**: ``verl.step`` spans and their ``verl.stage {stage}`` spans, grouped by
  ``verl.global_step``; a stage's time is the sum of its spans in that step, ``other`` is
  the step time no stage span covers. Stages may run at once (v1's ``generation`` beside
  ``fetch_batch``): each keeps its own time, and ``stage_overlap`` says per step the time
  any ran (``stages_union_s``), how much more their times add to (``concurrent_s``) and
  which ran while another did.
- **rollout latency**: durations of the trajectory spans (``invoke_agent ...``) per
  ``verl.global_step``; validation trajectories (``verl.validate``) are left out.
- **slowest trajectories**: the trajectory span split into LLM time (its ``chat`` /
  ``text_completion`` spans, with the server's queue / prefill / decode from the
  ``verl.llm.server.*`` attributes of their ``verl.llm_server.generate`` children), tool time (``execute_tool`` spans), reward
  (``verl.reward`` spans) and the rest.
- **samples**: ``verl.sample`` roots by outcome; a uid seen in worker spans or the
  sample-flow CSV without a finished root (and without a ``COMPLETE`` CSV row) never finished.
- **losses**: otel_verl's own counters of what it could not write and of the failures it
  swallowed (``otel_verl.dropped`` / ``otel_verl.failures``), as a trace dir's metric
  files (``otlp-metrics/``) last recorded them, summed over processes; without metric files
  "none recorded". Also whether the legacy files and the spans tell the same story (a
  start row without a span, where the end lines agree, is a trajectory still running).
- **tail**: per step the critical-path trajectory, the busiest and idlest LLM server
  replica and each side's waiting time; the staleness of the trained samples
  (:mod:`otel_verl.tools.report.tail` defines them).
- **shape**: trainer, layout, sync or async, prompts per step, n, steps (what
  :mod:`otel_verl.tools.report.compare` tells two runs apart by).
"""

from __future__ import annotations

import csv
import itertools
import math
import re
from collections import Counter, defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from otel_verl import semconv as sc
from otel_verl.exporters import metrics as metric_names
from otel_verl.tools.report import tail
from otel_verl.tools.report.inputs import (InputError, Inputs, Lines, parse_line, read_counters, read_loss_files, read_spans,
                                           resolve)
from otel_verl.tools.report.spans import (NS, STEP_STAGE_PREFIX, SpanIndex as _Index, duration_s, is_trajectory, merged,
                                    stage_of as _stage_of, training_trajectories, trajectory_split,
                                    union_s as _union_s)
from otel_verl.tools.report.spans import server_split  # noqa: F401  (callers import it from here)

FINISHED_OUTCOMES = (sc.Outcome.TRAINED.value, sc.Outcome.FILTERED.value)
STAGE_ORDER = [s.value for s in sc.Stage]
_TASK_LINE = re.compile(r"^Task .+/[^/]+ is completed, ")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# --------------------------------------------------------------------------- sections


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
            stages[step][_stage_of(span)].append(span)
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
            covered = _union_s(
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
    union = _union_s(i for spans_of in own.values() for i in spans_of)
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


def slowest_section(trajectories: List[Dict[str, Any]], index: _Index, top: int) -> List[Dict[str, Any]]:
    ranked = sorted(trajectories, key=lambda s: (-duration_s(s), s["spanId"]))[: max(0, top)]
    return [trajectory_split(t, index) for t in ranked]


def _read_csv_rows(paths: Sequence[str]) -> Iterable[List[str]]:
    for path in paths:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            yield from csv.reader(f)


LastSeen = Tuple[int, str, Optional[int]]  # time ns, where, step


def read_sample_csv(paths: Sequence[str]) -> Tuple[set, set, Dict[str, LastSeen]]:
    """The sample-flow CSV's uids, those with a ``COMPLETE`` row, and each uid's last row
    (the first of its latest) as ``(time ns, "CSV {stage}", global_step)``."""
    uids: set = set()
    complete: set = set()
    last: Dict[str, LastSeen] = {}
    for row in _read_csv_rows(paths):
        if len(row) < 6:
            continue
        uid = row[2].rpartition("/")[0]
        if not uid or uid == "*":
            continue
        uids.add(uid)
        if row[3] == "COMPLETE":
            complete.add(uid)
        try:
            t = int(row[4]) * 1_000_000
        except ValueError:
            continue
        fields = dict(part.split("=", 1) for part in row[5].split("|") if "=" in part)
        if uid not in last or t > last[uid][0]:
            step = fields.get("global_step")
            last[uid] = (t, f"CSV {fields.get('stage', '?')}", int(step) if step and step.isdigit() else None)
    return uids, complete, last


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


def _count_lines(paths: Sequence[str], predicate=lambda line: True) -> int:
    total = 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            total += sum(1 for line in f if line.strip() and predicate(line))
    return total


def _starts_trajectory(content: str) -> bool:
    """A CSV row that starts one trajectory: v0 ``agent_task_started``; v1 ``session_started``
    (v1's ``agent_task_started`` row starts a prompt's task, traj ``N/A``)."""
    if "|detail=session_started_" in content:
        return True
    return "|detail=agent_task_started" in content and not content.startswith("from=AgentLoopWorkerTQ|")


def losses_section(spans: List[Dict[str, Any]], trajectories: List[Dict[str, Any]], inputs: Inputs,
                   lines: Lines) -> Dict[str, Any]:
    """What could have been lost, and whether the outputs agree with each other."""
    limits = {"attributes": 0, "events": 0, "links": 0}
    for span in spans:
        for key in limits:
            limits[key] += span.get("dropped", {}).get(key, 0)
    return losses(inputs, span_limit_drops=limits, truncated_lines=len(lines.truncated),
                  trajectory_spans=len(trajectories) if spans else None)


def losses(inputs: Inputs, *, span_limit_drops: Dict[str, int], truncated_lines: int,
           trajectory_spans: Optional[int]) -> Dict[str, Any]:
    """The ``losses`` section from its counts: what SDK span limits cut off, the lines no
    span could be read from, and the training trajectory spans the legacy files' lines are
    held against (``None``: no span at all, nothing to compare; no_spans_section says why)."""
    checks = []
    if trajectory_spans is not None and inputs.has_legacy:
        n_spans = trajectory_spans
        task_lines = _count_lines(inputs.progress_logs, lambda line: bool(_TASK_LINE.match(line)))
        jsonl_lines = _count_lines(inputs.trajectory_jsonl)
        started = sum(1 for row in _read_csv_rows(inputs.sample_csv) if len(row) >= 6 and _starts_trajectory(row[5]))
        # lines written when a trajectory ends, as its span: these agree with the spans
        # where no span was lost, while a start row may belong to a trajectory still running
        ended = [n for n in (task_lines, jsonl_lines) if n]
        for label, legacy, at_start in (
            ("progress log 'Task ... is completed' lines", task_lines, False),
            ("trajectory JSONL lines", jsonl_lines, False),
            ("sample-flow CSV trajectory start rows", started, True),
        ):
            if legacy == n_spans:
                verdict = "consistent"
            elif at_start and legacy > n_spans and ended and set(ended) == {n_spans}:
                verdict = (f"{legacy - n_spans} started and never finished: running when the run ended, "
                           "or their process died")
            elif legacy > n_spans:
                verdict = "fewer spans than legacy lines: OTLP sampling on, or spans lost"
            else:
                verdict = "more spans than legacy lines: legacy lines lost (or files from another run)"
            checks.append({"what": label, "legacy": legacy, "trajectory_spans": n_spans, "verdict": verdict})
    recorded, note = _loss_counters(inputs)
    return {
        "recorded": recorded,
        "note": note,
        "span_limit_drops": span_limit_drops,
        "truncated_lines": truncated_lines,
        "consistency": checks,
    }


def _loss_counters(inputs: Inputs) -> Tuple[Optional[Dict[str, Dict[str, int]]], str]:
    """otel_verl's loss counters from each process's loss file, else from the metric files
    (``None`` without either), and a line saying what they are."""
    if inputs.loss_files:
        files = read_loss_files(inputs.loss_files)
        recorded = {kind: dict(sorted((name, n) for name, n in named.items() if n))
                    for kind, named in files.counts.items() if kind != "unsent" or any(named.values())}
        source = f"the loss files of {files.processes} process{'es' if files.processes != 1 else ''}"
        if files.not_shut_down:
            # a process killed with nothing unwritten lost nothing it held: no failure to report
            source += (f"; {files.not_shut_down} ended without a shutdown (killed, as Ray ends its actors at the end "
                       "of a run, or still running)")
            if files.holding:
                source += (f": unsent, what {files.holding} of them still held at their last write, within about "
                           "a second of their end; lost if killed")
            else:
                source += ", holding nothing unwritten at their last write, within about a second of their end"
    elif inputs.metric_files:
        counters, processes = read_counters(inputs.metric_files, (metric_names.DROPPED, metric_names.FAILURES))
        recorded = {kind: {"/".join(labels): n for labels, n in sorted(counters[name].items()) if n}
                    for kind, name in (("dropped", metric_names.DROPPED), ("failures", metric_names.FAILURES))}
        source = f"the metric files of {processes} process{'es' if processes != 1 else ''}"
    else:
        return None, ("none recorded: no loss or metric files among the inputs (no trace dir); "
                      "otel_verl logs its losses")
    said = "; ".join(f"{kind} " + (", ".join(f"{k}={n}" for k, n in counts.items()) or "none")
                     for kind, counts in recorded.items())
    return recorded, f"{said} ({source})"


def no_spans_section(paths: Sequence[str], inputs: Inputs) -> Dict[str, Any]:
    """Why a trace dir holds no span (``line``), and the runs its loss files name. A run
    writes its spans' OTLP-JSON files and its metric files beside them only without an
    OTLP endpoint: with neither, the spans went over OTLP to a collector."""
    runs = sorted({str(run) for run in map(_run_of_loss_file, inputs.loss_files) if run})
    where = ", ".join(paths)
    if inputs.otlp_files:
        reason = "empty"
        line = (f"no spans in {where}: its {len(inputs.otlp_files)} OTLP-JSON file(s) hold none "
                "(still being written, or their process died before its first batch)")
    elif inputs.metric_files:
        reason = "span files missing"
        line = (f"no spans in {where}: the run wrote its metric files (otlp-metrics/) but no otlp/ span files beside "
                "them: removed, or not copied with the trace dir")
    else:
        reason = "collector"
        run = runs[0] if len(runs) == 1 else "RUN_ID"
        line = (f"no spans in {where}: the run sent them over OTLP to a collector (its OTEL_EXPORTER_OTLP_ENDPOINT, "
                "which the trace dir does not record); report on them from the collector: "
                f"`otel-verl report DIR/{run}` on its file exporter's DIR (collector-config/otelcol-file.yaml), "
                f"or `otel-verl report --clickhouse URL --run {run}`")
    return {"reason": reason, "line": line, "runs": runs}


def _run_of_loss_file(path: str) -> Optional[str]:
    """The ``verl.run_id`` a loss file's process ran under (``None`` when unreadable:
    :func:`losses_section` says so)."""
    try:
        with open(path, "rb") as f:
            obj, _ = parse_line(f.read())
        return (obj.get("resource") or {}).get(sc.RUN_ID)
    except (OSError, ValueError, AttributeError):
        return None


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
    index = _Index(spans)
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
        "tail": tail.tail_section(spans, index, trajectories, asynchronous=shape["mode"] == "async"),
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
                "stage": _stage_of(span),
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


def assign_lanes(bars: List[Dict[str, Any]]) -> None:
    """Give each bar (sorted by start) the first ``lane`` free at its start, so that
    concurrent stages are drawn beside each other, not over each other."""
    lane_ends: List[float] = []
    for bar in bars:
        lane = next((i for i, end in enumerate(lane_ends) if end <= bar["start_s"]), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(0.0)
        lane_ends[lane] = bar["start_s"] + bar["duration_s"]
        bar["lane"] = lane
