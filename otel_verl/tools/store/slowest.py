"""The report's ``slowest_trajectories`` section from the span store.

The run's training trajectories (``NOT validate``) are ranked in SQL, longest first, ties by
span id (with ``steps``: among those of the steps that generated them); each of the first
``top`` is split by :func:`otel_verl.tools.report.spans.trajectory_split`, the one rule of the
split, on its own spans (:func:`otel_verl.tools.store.spans.subtree`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from otel_verl.tools.report.spans import SpanIndex, trajectory_split
from otel_verl.tools.store.spans import subtree
from otel_verl.tools.store.store import Store

_RANKED = """
SELECT trace_id, span_id FROM trajectories
WHERE run_id = {{run:String}} AND NOT validate {step_filter}
ORDER BY end_ns - start_ns DESC, span_id LIMIT {{top:UInt64}}
"""


def build(store: Store, run: Optional[str], steps: Optional[Tuple[int, int]], top: int = 5) -> List[Dict[str, Any]]:
    """The ``top`` slowest training trajectories of ``run`` (of ``steps`` (first, last) when
    given), each split by :func:`otel_verl.tools.report.spans.trajectory_split`."""
    params: Dict[str, Any] = {"run": run or "", "top": max(0, top)}
    step_filter = ""
    if steps:
        step_filter = "AND step BETWEEN {first:Int64} AND {last:Int64}"
        params.update(first=steps[0], last=steps[1])
    out = []
    for ranked in store.rows(_RANKED.format(step_filter=step_filter), params):
        spans = subtree(store, run, ranked["trace_id"], ranked["span_id"])
        trajectory = next(s for s in spans if s["spanId"] == ranked["span_id"])
        out.append(trajectory_split(trajectory, SpanIndex(spans)))
    return out
