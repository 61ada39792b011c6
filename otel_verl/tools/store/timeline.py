"""The report's ``timeline`` from the span store (what ``--png`` draws): per step of the steps
section, its stage bars and its training trajectories' bars, in seconds since the step
started (its ``verl.step`` span, else its first stage), each list by start; stages that ran
at once get lanes (:func:`otel_verl.tools.report.analysis.assign_lanes`). Bars that start in
the same nanosecond come in span id order.

A step may hold thousands of trajectories: :func:`rows` reads one step at a time and
yields it, for a caller that renders step by step; :func:`build` lists them all.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from otel_verl.tools.report.analysis import assign_lanes
from otel_verl.tools.store.store import Store

# the steps of the steps section (a verl.step span, or stages without one) and when each started
_STEP_STARTS = """
SELECT step, if(max(is_step) = 1, minIf(start_ns, is_step = 1), min(start_ns)) AS start_ns
FROM (SELECT step, start_ns, 1 AS is_step FROM steps WHERE {where}
      UNION ALL SELECT step, start_ns, 0 AS is_step FROM stages WHERE {where})
GROUP BY step ORDER BY step
"""
_ONE_STEP = "run_id = {run:String} AND step = {step:Int64}"
_STAGE_BARS = f"""
SELECT stage, (start_ns - {{t0:Int64}}) / 1e9 AS start_s, duration_s
FROM stages WHERE {_ONE_STEP} ORDER BY start_ns, span_id
"""
_TRAJECTORY_BARS = f"""
SELECT (start_ns - {{t0:Int64}}) / 1e9 AS start_s, duration_s
FROM trajectories WHERE {_ONE_STEP} AND NOT validate ORDER BY start_ns, span_id
"""


def rows(store: Store, run: Optional[str], steps: Optional[Tuple[int, int]] = None) -> Iterator[Dict[str, Any]]:
    """The timeline of ``run`` (of ``steps`` (first, last) when given), one step at a time."""
    params: Dict[str, Any] = {"run": run or "", "first": steps[0] if steps else -1, "last": steps[1] if steps else 1 << 62}
    where = "run_id = {run:String} AND step BETWEEN {first:Int64} AND {last:Int64}"
    for start in store.rows(_STEP_STARTS.format(where=where), params):
        one = {"run": run or "", "step": start["step"], "t0": start["start_ns"]}
        stages = store.rows(_STAGE_BARS, one)
        assign_lanes(stages)
        yield {"step": start["step"], "stages": stages, "trajectories": store.rows(_TRAJECTORY_BARS, one)}


def build(store: Store, run: Optional[str], steps: Optional[Tuple[int, int]] = None) -> List[Dict[str, Any]]:
    """The whole timeline as a list (every step's bars at once: for a few steps)."""
    return list(rows(store, run, steps))
