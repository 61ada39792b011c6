"""The report's ``samples`` section from the span store (:mod:`otel_verl.tools.report.analysis`
defines it).

- ``roots`` / ``outcomes``: the run's ``verl.sample`` roots, one per uid, by outcome.
- ``csv_uids``: the uids of the sample-flow CSV files
  (:func:`otel_verl.tools.report.analysis.read_sample_csv`; files beside the spans, not spans).
- ``unfinished`` (``unfinished_count`` before ``limit``): roots whose outcome is not a
  finished one, and uids seen in worker spans or the CSV without a root nor a ``COMPLETE``
  CSV row (validation uids left out); each with where and at which step it was last seen.
  The engine finds each uid's last span (argMax by end time; at equal ends, the one that
  started first) and returns the candidates only; the CSV's later rows win over it.

With ``steps``: the roots those steps trained or staged (as ``report.build``'s outcomes);
the unfinished of those roots, and the others whose last-seen step is one of those steps or
that those steps staged; ``csv_uids``: the CSV uids whose last CSV row is of those steps.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from otel_verl.tools.report.analysis import FINISHED_OUTCOMES, LastSeen, read_sample_csv
from otel_verl.tools.report.inputs import Inputs
from otel_verl.tools.store.store import Store

# each uid's roots (the one that ended last stands for it, as one root per uid is the rule)
_ROOTS = """
SELECT uid, argMax((outcome, step), (end, start)) AS root FROM samples
WHERE {sample_filter} AND uid != '' GROUP BY uid
"""
_OUTCOMES = "SELECT root.1 AS outcome, count() AS n FROM ({roots}) GROUP BY outcome"
# the uids that may be unfinished (and the CSV's open uids, to tell which have spans):
# their last span (name, step, end) and their root's outcome and step (any root of the run
# is one: a root the steps did not select does not make its uid rootless)
_CANDIDATES = """
WITH seen AS (
    SELECT uid, argMax((name, step), (end_ns, -start_ns)) AS last, max(end_ns) AS last_ns
    FROM spans WHERE run_id = {{run:String}} AND uid != '' GROUP BY uid),
roots AS ({roots})
SELECT seen.uid AS uid, last.1 AS name, last.2 AS step, last_ns, roots.uid != '' AS has_root,
    root.1 AS outcome, root.2 AS root_step,
    seen.uid IN (SELECT uid FROM trajectories WHERE run_id = {{run:String}} AND validate) AS validation,
    seen.uid IN (SELECT uid FROM sample_stages WHERE {staged}) AS staged
FROM seen LEFT JOIN roots ON roots.uid = seen.uid
WHERE (has_root AND outcome NOT IN {{finished:Array(String)}}
        AND seen.uid IN (SELECT uid FROM samples WHERE {selected}))
    OR (NOT has_root AND NOT validation AND ({no_root}))
    OR seen.uid IN {{csv_open:Array(String)}}
"""


def build(store: Store, run: Optional[str], steps: Optional[Tuple[int, int]], *, inputs: Optional[Inputs] = None,
          limit: Optional[int] = 20) -> Dict[str, Any]:
    """The ``samples`` section of ``run`` (of ``steps`` (first, last) when given); ``inputs``:
    the files beside an embedded store (:func:`otel_verl.tools.store.store.open_store`), for
    the CSV; ``limit`` caps the listed unfinished samples (``None``: all)."""
    params: Dict[str, Any] = {"run": run or "", "first": steps[0] if steps else -1,
                              "last": steps[1] if steps else 1 << 62, "finished": list(FINISHED_OUTCOMES)}
    run_filter = "run_id = {run:String}"
    staged = f"{run_filter} AND step BETWEEN {{first:Int64}} AND {{last:Int64}}"
    sample_filter = run_filter
    no_root_filter = "1"
    if steps:  # the samples those steps trained or staged (report.build's outcomes), or last saw
        sample_filter += (" AND (trained_step BETWEEN {first:Int64} AND {last:Int64} OR uid IN (SELECT uid FROM "
                          f"sample_stages WHERE {staged}))")
        no_root_filter = "staged OR last.2 BETWEEN {first:Int64} AND {last:Int64}"

    outcomes = {r["outcome"] or "(none)": r["n"]
                for r in store.rows(_OUTCOMES.format(roots=_ROOTS.format(sample_filter=sample_filter)), params)}
    csv_uids, csv_complete, csv_last = read_sample_csv(inputs.sample_csv if inputs else ())
    params["csv_open"] = sorted(csv_uids - csv_complete)
    rows = store.rows(_CANDIDATES.format(roots=_ROOTS.format(sample_filter=run_filter), selected=sample_filter,
                                         staged=staged, no_root=no_root_filter), params)

    def selected(step: Any, staged_: bool = False) -> bool:
        return not steps or staged_ or (isinstance(step, int) and steps[0] <= step <= steps[1])

    def last_seen(uid: str, span: LastSeen) -> LastSeen:
        csv = csv_last.get(uid)
        return csv if csv and csv[0] > span[0] else span

    unfinished: List[Dict[str, Any]] = []
    no_root: List[Tuple[str, LastSeen, bool]] = []
    for r in rows:
        seen = last_seen(r["uid"], (r["last_ns"], f"span {r['name']}", r["step"]))
        if r["has_root"]:
            if r["outcome"] not in FINISHED_OUTCOMES:
                unfinished.append({"uid": r["uid"], "state": f"outcome {r['outcome'] or '(none)'}",
                                   "step": r["root_step"], "last_seen": seen[1]})
        elif not r["validation"] and r["uid"] not in csv_complete:
            no_root.append((r["uid"], seen, r["staged"]))
    with_spans = {r["uid"] for r in rows}
    no_root += [(uid, csv_last.get(uid, (0, "CSV", None)), False)
                for uid in params["csv_open"] if uid not in with_spans]
    for uid, (_, where, step), staged_ in no_root:
        if selected(step, staged_):
            unfinished.append({"uid": uid, "state": "no finished verl.sample span", "step": step, "last_seen": where})
    unfinished.sort(key=lambda u: (u["step"] if isinstance(u["step"], int) else -1, u["uid"]))
    if steps:
        csv_uids = {uid for uid in csv_uids if selected(csv_last.get(uid, (0, "", None))[2])}
    return {
        "roots": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "csv_uids": len(csv_uids),
        "unfinished_count": len(unfinished),
        "unfinished": unfinished if limit is None else unfinished[: max(0, limit)],
    }
