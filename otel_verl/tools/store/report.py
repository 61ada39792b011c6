"""The report's sections as SQL on the store's views: what ``otel-verl report`` prints
(:mod:`otel_verl.tools.report` lists the keys, :mod:`otel_verl.tools.report.analysis`
defines the figures; the tests hold each section equal to a reference computed in Python
from the same spans). Python only shapes rows the engine aggregated, at most one row per
step and stage.

:func:`read` is the whole report, what ``otel-verl report`` prints: ``inputs`` (what was
read), ``no_spans`` (why a trace dir holds none: its spans went to a collector, say) and
the sections :func:`build` makes.

Sections: ``steps`` (and ``stage_order``, ``stage_overlap``), ``rollout_latency``,
``trajectories``, ``slowest_trajectories`` (:mod:`.slowest`), ``tail`` (:mod:`.tail`),
``samples`` (:mod:`.samples`), ``losses`` (:mod:`.losses`), ``timeline``
(:mod:`.timeline`, when asked for: every trajectory's bar), ``shape``, ``runs``, ``trainer``.
``sections`` lists those built.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_verl import semconv as sc
from otel_verl.tools.report.analysis import no_spans_section
from otel_verl.tools.report.inputs import InputError, Inputs
from otel_verl.tools.store import losses, samples, slowest, tail
from otel_verl.tools.store import timeline as bars
from otel_verl.tools.store.intervals import union_ns
from otel_verl.tools.store.load import FILES_TABLE, Load, path_key
from otel_verl.tools.store.store import Store, rejected_lines

SECTIONS = ("steps", "stage_overlap", "rollout_latency", "trajectories", "slowest_trajectories", "tail", "samples",
            "losses", "shape")
STAGE_ORDER = [s.value for s in sc.Stage]
_ALWAYS = ("steps", "stage_overlap", "rollout_latency", "trajectories", "shape")

# a step's time no stage covers: its stages clipped to it, sorted, and their union summed
# (stages of one step may overlap: v1's generation and fetch_batch)
_STEPS = f"""
SELECT st.step AS step, any(st.start_ns) AS start_ns, any(st.duration_s) AS duration_s,
    {union_ns("groupArray((greatest(g.start_ns, st.start_ns), least(g.end_ns, st.end_ns)))")} AS covered_ns
FROM (SELECT * FROM steps WHERE {{where}}) AS st
LEFT JOIN (SELECT * FROM stages WHERE {{where}}) AS g ON g.run_id = st.run_id AND g.step = st.step
GROUP BY st.step
"""
_STAGES = """
SELECT step, stage, sum(duration_s) AS seconds, min(start_ns) AS start_ns
FROM stages WHERE {where} GROUP BY step, stage
"""
# how a step's stages overlap (analysis.concurrency): the time any ran, what their times add
# beyond it, and the stages that ran while another did
_UNION = f"""
SELECT step, sum(end_ns - start_ns) AS total_ns,
    {union_ns("groupArray((start_ns, end_ns))")} AS union_ns
FROM stages WHERE {{where}} GROUP BY step
"""
_CONCURRENT = """
SELECT DISTINCT a.step AS step, a.stage AS stage
FROM (SELECT * FROM stages WHERE {where}) AS a
INNER JOIN (SELECT * FROM stages WHERE {where}) AS b ON a.run_id = b.run_id AND a.step = b.step
WHERE a.stage != b.stage AND greatest(a.start_ns, b.start_ns) < least(a.end_ns, b.end_ns)
"""
_LATENCY = """
SELECT step, count() AS count, quantilesExactInclusive(0.5, 0.9, 0.99)(duration_s) AS q, max(duration_s) AS max_s
FROM trajectories WHERE NOT validate AND {where_nullable} GROUP BY step ORDER BY isNull(step), step
"""
# whether a sample of these steps was trained in a later step than the one that generated
# it; read from these steps' rows and their samples' trajectories only
_ASYNC = """
SELECT count() > 0 AS later FROM (SELECT uid, step FROM sample_stages WHERE {where}) AS ss
INNER JOIN (SELECT uid, min(step) AS generated FROM trajectories
            WHERE {run} AND step <= {{last:Int64}} AND uid IN (SELECT uid FROM sample_stages WHERE {where})
            GROUP BY uid) AS t ON t.uid = ss.uid
WHERE ss.step > t.generated
"""
_PER_STEP = """
SELECT max(prompts) AS prompts, max(n) AS n FROM (
    SELECT step, uniqExact(uid) AS prompts, max(trajectories) AS n
    FROM (SELECT step, uid, count() AS trajectories FROM trajectories WHERE NOT validate AND {where_nullable}
          GROUP BY step, uid)
    GROUP BY step)
"""


def run_ids(store: Store) -> List[str]:
    return [r[0] for r in store.query("SELECT DISTINCT RunId FROM otel_traces WHERE RunId != '' ORDER BY RunId")[1]]


def pick_run(store: Store, run_id: Optional[str]) -> Optional[str]:
    """The run to report on: ``run_id``, else the store's only one; an
    :class:`InputError` naming them when it holds several."""
    runs = run_ids(store)
    if run_id is not None:
        if run_id not in runs:
            raise InputError(f"no run {run_id!r} in the store (it holds {', '.join(runs) or 'none'})")
        return run_id
    if len(runs) > 1:
        raise InputError(f"the store holds {len(runs)} runs ({', '.join(runs)}): pick one with --run ID")
    return runs[0] if runs else None


def build(store: Store, *, run_id: Optional[str] = None, steps: Optional[Tuple[int, int]] = None, top: int = 5,
          inputs: Optional[Inputs] = None, load: Optional[Load] = None, timeline: bool = False,
          unfinished_limit: Optional[int] = 20, sections: Sequence[str] = SECTIONS) -> Dict[str, Any]:
    """The SQL report of one run (:func:`pick_run`), of ``steps`` (first, last) when given;
    ``top`` slowest trajectories; ``inputs`` and ``load``: the files beside an embedded
    store (:func:`otel_verl.tools.store.store.open_store`), for ``losses`` and the samples'
    CSV; ``timeline``: with the timeline's bars; ``unfinished_limit`` caps the listed
    unfinished samples (``None``: all); ``sections``: those to build of :data:`SECTIONS`
    (``steps``, ``stage_overlap``, ``rollout_latency``, ``trajectories`` and ``shape``
    always are), the others left out."""
    run = pick_run(store, run_id)
    params: Dict[str, Any] = {"run": run or "", "first": steps[0] if steps else -1, "last": steps[1] if steps else 1 << 62}
    run_filter = "run_id = {run:String}"
    where = f"{run_filter} AND step BETWEEN {{first:Int64}} AND {{last:Int64}}"
    where_nullable = where if steps else run_filter

    stage_rows = store.rows(_STAGES.format(where=where), params)
    step_rows = {r["step"]: r for r in store.rows(_STEPS.format(where=where), params)}
    seen = {r["stage"] for r in stage_rows}
    order = [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))
    by_step: Dict[int, Dict[str, Any]] = {}
    for r in stage_rows:
        entry = by_step.setdefault(r["step"], {"stages": {}, "start_ns": r["start_ns"]})
        entry["stages"][r["stage"]] = r["seconds"]
        entry["start_ns"] = min(entry["start_ns"], r["start_ns"])
    step_section = []
    for step in sorted(set(step_rows) | set(by_step)):
        span, stages = step_rows.get(step), by_step.get(step, {"stages": {}, "start_ns": None})
        step_section.append({
            "step": step,
            "finished": span is not None,
            "start_unix_nano": span["start_ns"] if span else stages["start_ns"],
            "duration_s": span["duration_s"] if span else None,
            "stages": {stage: stages["stages"][stage] for stage in order if stage in stages["stages"]},
            "other_s": span["duration_s"] - span["covered_ns"] / 1e9 if span else None,
        })

    unions = {r["step"]: r for r in store.rows(_UNION.format(where=where), params)}
    concurrent: Dict[int, set] = {}
    for r in store.rows(_CONCURRENT.format(where=where), params):
        concurrent.setdefault(r["step"], set()).add(r["stage"])
    overlap = []
    for row in step_section:
        union = unions.get(row["step"], {"total_ns": 0, "union_ns": 0})
        overlap.append({"step": row["step"], "stages_union_s": union["union_ns"] / 1e9,
                        "concurrent_s": max(0.0, (union["total_ns"] - union["union_ns"]) / 1e9),
                        "concurrent_stages": [s for s in row["stages"] if s in concurrent.get(row["step"], ())]})

    latency = [{"step": r["step"], "count": r["count"], "p50_s": r["q"][0], "p90_s": r["q"][1], "p99_s": r["q"][2],
                "max_s": r["max_s"]} for r in store.rows(_LATENCY.format(where_nullable=where_nullable), params)]
    fit = next(iter(store.rows("SELECT trainer, train_batch_size, rollout_n FROM runs WHERE run_id = {run:String} "
                               "LIMIT 1", params)), {})
    trainer = fit.get("trainer") or next(
        (r["trainer"] for r in store.rows("SELECT trainer FROM steps WHERE run_id = {run:String} AND trainer != '' "
                                          "LIMIT 1", params)), None)
    layouts = [r["layout"] for r in store.rows(
        "SELECT DISTINCT layout FROM (SELECT SpanAttributes['verl.layout'] AS layout FROM otel_traces "
        "WHERE RunId = {run:String} AND SpanName IN ('verl.step', 'verl.fit')) WHERE layout != '' ORDER BY layout",
        params)]
    later = store.rows(_ASYNC.format(run=run_filter, where=where), params)[0]["later"]
    counted = store.rows(_PER_STEP.format(where_nullable=where_nullable), params)[0]
    built = [s for s in SECTIONS if s in sections or s in _ALWAYS] + (["timeline"] if timeline else [])
    report = {
        "sections": built,
        "runs": [run] if run else [],
        "selected_steps": list(steps) if steps else None,
        "trainer": trainer,
        "shape": {
            "trainer": trainer,
            "layout": "/".join(layouts) or None,
            "mode": "async" if later else "sync",
            "prompts": fit.get("train_batch_size") or counted["prompts"] or None,
            "n": fit.get("rollout_n") or counted["n"] or None,
            "steps": len(step_section),
        },
        "stage_order": order,
        "steps": step_section,
        "stage_overlap": overlap,
        "rollout_latency": latency,
        "trajectories": sum(r["count"] for r in latency),
    }
    optional = {
        "slowest_trajectories": lambda: slowest.build(store, run, steps, top),
        "tail": lambda: tail.build(store, run, steps, asynchronous=bool(later)),
        "samples": lambda: samples.build(store, run, steps, inputs=inputs, limit=unfinished_limit),
        "losses": lambda: losses.build(store, run, inputs=inputs, load=load),
    }
    report.update({name: make() for name, make in optional.items() if name in built})
    if timeline:
        report["timeline"] = bars.build(store, run, steps)
    return report


def read(store: Store, paths: List[str], *, inputs: Optional[Inputs] = None, load: Optional[Load] = None,
         run_id: Optional[str] = None, **options: Any) -> Dict[str, Any]:
    """The whole report of ``paths`` (their embedded store with its ``inputs`` and ``load``,
    or a server's store): ``inputs``, ``no_spans`` and :func:`build`'s sections (``options``
    go to it). A trace dir without spans whose legacy or metric files are there (a run that
    sent its spans to a collector) gets ``no_spans``, why, and its sections empty; one
    without those either, an :class:`InputError`."""
    empty = inputs is not None and not store.query("SELECT count() FROM otel_traces")[1][0][0]
    if empty and not (inputs.loss_files or inputs.sample_csv or inputs.metric_files):
        lines = inputs_section(store, paths, inputs, load, None)["lines"]
        rejected, first = rejected_lines(store, 1)
        said = "".join(f"; {path}:{line}: {why}" for path, line, why in first)
        said += f" (and {rejected - 1} more line(s) no OTLP span data)" if rejected > 1 else ""
        raise InputError(f"no spans in {', '.join(paths)} ({len(inputs.otlp_files)} file(s), {lines} line(s){said})")
    no_spans = no_spans_section(paths, inputs) if empty else None
    run = None if empty else pick_run(store, run_id)
    report = {"inputs": inputs_section(store, paths, inputs, load, run), "no_spans": no_spans,
              **build(store, run_id=run, inputs=inputs, load=load, **options)}
    if no_spans:
        report["runs"] = no_spans["runs"]
    return report


def inputs_section(store: Store, paths: List[str], inputs: Optional[Inputs], load: Optional[Load],
                   run: Optional[str]) -> Dict[str, Any]:
    """What the report read: the files beside an embedded store (``inputs``, this ``load``)
    and the store's own count of their lines, spans and traces."""
    loaded: List[Dict[str, Any]] = []
    if inputs is not None:
        loaded = store.rows(f"SELECT Path AS path, Lines AS lines, Repaired AS repaired FROM {FILES_TABLE} FINAL "
                            "WHERE Path IN {paths:Array(String)}", {"paths": [path_key(p) for p in inputs.otlp_files]})
    # an embedded store holds the files' spans (a process without a run id's included); a
    # server's, many runs: the run's
    where = "1" if inputs is not None else "RunId = {run:String}"
    counted = store.rows(f"SELECT count() AS spans, uniqExact(TraceId) AS traces FROM otel_traces WHERE {where}",
                         {"run": run or ""})[0]
    pending = load.pending if load else []
    name = {path_key(path): path for path in (inputs.otlp_files if inputs else [])}  # the file's own name
    repaired = [{"path": name[r["path"]], "characters": r["repaired"]} for r in sorted(loaded, key=lambda r: r["path"])
                if r["repaired"]]
    return {
        "paths": list(paths),
        "otlp_files": inputs.otlp_files if inputs else [],
        "lines": sum(r["lines"] for r in loaded),
        "spans": counted["spans"],
        "traces": counted["traces"],
        "truncated": len(pending),
        "truncated_files": [{"path": path, "bytes": size} for path, size in pending],
        "repaired": sum(r["characters"] for r in repaired),
        "repaired_files": repaired,
        "skipped_files": [{"path": path, "what": what} for path, what in inputs.skipped] if inputs else [],
        "legacy_files": {
            "sample_csv": len(inputs.sample_csv) if inputs else 0,
            "progress": len(inputs.progress_logs) if inputs else 0,
            "trajectory_jsonl": len(inputs.trajectory_jsonl) if inputs else 0,
        },
    }


def parse_steps(text: str) -> Tuple[int, int]:
    """``"A-B"`` or ``"A"`` as ``(A, B)``; ValueError with a one-line message otherwise."""
    first, sep, last = text.partition("-")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A-B or A (step numbers)") from None
    if a > b or a < 0:
        raise ValueError(f"--steps {text!r}: expected A <= B, both >= 0")
    return a, b
