"""Spans read back from the store as the flat dicts the file readers give
(:func:`otel_verl.exporters.otlp_json_file.flat_span`), for what draws spans one by one
(``report --perfetto``): only the rows of the steps it draws are read.

The store keeps attribute values as text, as the Collector's exporter does; they are read
back by one rule: a text that reads as a JSON number, ``true`` or ``false`` is that value,
a JSON array is a list of values read by the same rule, any other text stays text. So
``"3"`` comes back as 3 whether it was an int or a string ``"3"``, alike on every span;
identifiers (uid, traj_uid, the LLM server's id) always stay text.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from otel_verl import semconv as sc
from otel_verl.tools.store.store import Store

KINDS = {"Unspecified": 0, "Internal": 1, "Server": 2, "Client": 3, "Producer": 4, "Consumer": 5}
STATUSES = {"Unset": 0, "Ok": 1, "Error": 2}
_NUMBER_START = frozenset("-0123456789[")
IDENTIFIERS = frozenset((sc.UID, sc.TRAJ_UID, sc.LLM_SERVER_ID))  # text even when they read as numbers
_COLUMNS = """TraceId, SpanId, ParentSpanId, SpanName, SpanKind, toUnixTimestamp64Nano(Timestamp) AS start_ns, Duration,
    SpanAttributes, ResourceAttributes, ScopeName, StatusCode, StatusMessage,
    arrayMap(t -> toUnixTimestamp64Nano(t), `Events.Timestamp`) AS event_ns, `Events.Name` AS event_names,
    `Events.Attributes` AS event_attributes, `Links.TraceId` AS link_traces, `Links.SpanId` AS link_spans,
    `Links.Attributes` AS link_attributes"""

# the rows of steps first..last of a run, and the rows without a step (sample roots, LLM
# server requests) of the traces those steps' rows are in
_ROWS = f"""
SELECT {_COLUMNS}
FROM otel_traces
WHERE RunId = {{run:String}} AND (Step BETWEEN {{first:Int64}} AND {{last:Int64}}
    OR Step = -1 AND TraceId IN (SELECT TraceId FROM otel_traces
                                 WHERE RunId = {{run:String}} AND Step BETWEEN {{first:Int64}} AND {{last:Int64}}))
ORDER BY Timestamp
"""
_RUN_ROWS = f"SELECT {_COLUMNS} FROM otel_traces WHERE {{every:Bool}} OR RunId = {{run:String}} ORDER BY Timestamp"
# one span and its descendants, found down the parent links within its trace
_SUBTREE = f"""
WITH RECURSIVE tree AS (
    SELECT TraceId AS trace_id, SpanId AS span_id, 0 AS depth FROM otel_traces
    WHERE RunId = {{run:String}} AND TraceId = {{trace:String}} AND SpanId = {{span:String}}
    UNION ALL
    SELECT o.TraceId, o.SpanId, tree.depth + 1 FROM otel_traces AS o
    INNER JOIN tree ON o.TraceId = tree.trace_id AND o.ParentSpanId = tree.span_id
    WHERE o.RunId = {{run:String}} AND o.TraceId = {{trace:String}} AND tree.depth < 64
)
SELECT {_COLUMNS} FROM otel_traces
WHERE RunId = {{run:String}} AND TraceId = {{trace:String}} AND SpanId IN (SELECT span_id FROM tree)
ORDER BY Timestamp
"""


def value(text: str) -> Any:
    """An attribute's text as the value it reads as (the module's rule)."""
    if text in ("true", "false"):
        return text == "true"
    if not text or text[0] not in _NUMBER_START:
        return text
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    if isinstance(parsed, list):
        return [value(v) if isinstance(v, str) else v for v in parsed]
    return parsed if isinstance(parsed, (int, float)) else text


def attributes(mapping: Dict[str, str]) -> Dict[str, Any]:
    return {key: text if key in IDENTIFIERS else value(text) for key, text in mapping.items()}


def of_steps(store: Store, run_id: Optional[str], steps: Tuple[int, int]) -> List[Dict[str, Any]]:
    """The flat spans of ``steps`` (first, last) of ``run_id``, in start order."""
    return _flat(store.query(_ROWS, {"run": run_id or "", "first": steps[0], "last": steps[1]})[1])


def of_run(store: Store, run_id: Optional[str]) -> List[Dict[str, Any]]:
    """The flat spans of the whole run ``run_id`` (``None``: every span of the store, as
    an embedded store holds its files'), in start order."""
    return _flat(store.query(_RUN_ROWS, {"every": run_id is None, "run": run_id or ""})[1])


def subtree(store: Store, run_id: Optional[str], trace_id: str, span_id: str) -> List[Dict[str, Any]]:
    """The flat spans of one span and its descendants (a trajectory's, for its split), in
    start order."""
    return _flat(store.query(_SUBTREE, {"run": run_id or "", "trace": trace_id, "span": span_id})[1])


def _flat(rows: List[tuple]) -> List[Dict[str, Any]]:
    out = []
    for (trace, span, parent, name, kind, start, duration, attrs, resource, scope, status, message,
         event_ns, event_names, event_attrs, link_traces, link_spans, link_attrs) in rows:
        out.append({
            "traceId": trace, "spanId": span, "parentSpanId": parent or None, "name": name,
            "kind": KINDS.get(kind, 0), "startTimeUnixNano": start, "endTimeUnixNano": start + duration,
            "attributes": attributes(attrs), "resource": attributes(resource), "scope": scope,
            "status": {"code": STATUSES.get(status, 0), "message": message},
            "events": [{"name": n, "timeUnixNano": t, "attributes": attributes(a)}
                       for n, t, a in zip(event_names, event_ns, event_attrs)],
            "links": [{"traceId": t, "spanId": s, "attributes": attributes(a)}
                      for t, s, a in zip(link_traces, link_spans, link_attrs)],
        })
    return out
