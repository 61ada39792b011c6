"""The numbers of ``otel-verl report``: what each figure is, and the parts read from the
files beside the spans (legacy files, loss and metric files); the span store computes the
figures from spans in SQL (:mod:`otel_verl.tools.store.report`).

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
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from otel_verl import semconv as sc
from otel_verl.exporters import metrics as metric_names
from otel_verl.tools.report.inputs import Inputs, parse_line, read_counters, read_loss_files

FINISHED_OUTCOMES = (sc.Outcome.TRAINED.value, sc.Outcome.FILTERED.value)
_TASK_LINE = re.compile(r"^Task .+/[^/]+ is completed, ")


# --------------------------------------------------------------------------- sections


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
