"""The report's ``losses`` section from the span store
(:func:`otel_verl.tools.report.analysis.losses` defines each figure).

- ``recorded`` / ``note``: the processes' loss or metric files (small files beside the
  spans, not spans).
- ``span_limit_drops``: what SDK span limits cut off, summed by the loader at each load
  (``otel_verl_dropped``; the exporter's table has no column for it, so a server's store
  says 0).
- ``truncated_lines``: the lines the store could not read as spans: last lines still being
  written (this load's ``pending``) and lines it rejected (``otel_verl_rejected``).
- ``consistency``: the legacy files' line counts against the run's training trajectory
  spans, counted in SQL.

The section is whole-run whatever steps are selected: the files and counters it reads have
no step, and the dropped counts are kept per load. The spans it counts are the run's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from otel_verl.tools.report.analysis import losses
from otel_verl.tools.report.inputs import Inputs
from otel_verl.tools.store import load as loader
from otel_verl.tools.store.store import Store, rejected_lines

_SPANS = """
SELECT (SELECT count() > 0 FROM otel_traces WHERE RunId = {run:String}) AS any_span,
    (SELECT count() FROM trajectories WHERE run_id = {run:String} AND NOT validate) AS trajectories
"""
_DROPPED = f"SELECT sum(Attributes) AS attributes, sum(Events) AS events, sum(Links) AS links FROM {loader.DROPPED_TABLE}"


def build(store: Store, run: Optional[str], *, inputs: Optional[Inputs] = None,
          load: Optional[loader.Load] = None) -> Dict[str, Any]:
    """The ``losses`` section of ``run`` (``inputs`` and ``load``: what
    :func:`otel_verl.tools.store.store.open_store` returned; ``None`` for a server's store,
    which has no files beside it). Whole-run, whatever steps a report selects."""
    counted = store.rows(_SPANS, {"run": run or ""})[0]
    dropped = {"attributes": 0, "events": 0, "links": 0}
    if _exists(store, loader.DROPPED_TABLE):
        dropped.update({k: int(v) for k, v in store.rows(_DROPPED)[0].items()})
    rejected = rejected_lines(store, 0)[0] if _exists(store, loader.REJECTED_TABLE) else 0
    return losses(inputs or Inputs(), span_limit_drops=dropped,
                  truncated_lines=len(load.pending if load else ()) + rejected,
                  trajectory_spans=counted["trajectories"] if counted["any_span"] else None)


def _exists(store: Store, table: str) -> bool:
    """Whether the loader's table is there: a server's store has none (the Collector fills it)."""
    return bool(store.query(f"EXISTS TABLE {table}")[1][0][0])
