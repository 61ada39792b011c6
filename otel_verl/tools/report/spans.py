"""What the report reads off one trajectory's spans (the store reads them back with
:func:`otel_verl.tools.store.spans.subtree`): durations, kinds, the parent index and the
trajectory's time split into LLM (with the server's queue / prefill / decode), tools,
reward and the rest, as the slowest trajectories and each step's critical path show it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

from otel_verl import semconv as sc, server_timing

NS = 1e9
LLM_OPERATIONS = (sc.OP_CHAT, sc.OP_TEXT_COMPLETION)


def duration_s(span: Dict[str, Any]) -> float:
    return (span["endTimeUnixNano"] - span["startTimeUnixNano"]) / NS


def is_trajectory(span: Dict[str, Any]) -> bool:
    return span["attributes"].get(sc.GEN_AI_OPERATION_NAME) == sc.OP_INVOKE_AGENT


def is_llm_call(span: Dict[str, Any]) -> bool:
    return span["attributes"].get(sc.GEN_AI_OPERATION_NAME) in LLM_OPERATIONS


def is_tool(span: Dict[str, Any]) -> bool:
    return span["attributes"].get(sc.GEN_AI_OPERATION_NAME) == sc.OP_EXECUTE_TOOL


def server_split(server_span: Dict[str, Any]) -> Optional[Dict[str, Optional[float]]]:
    """The server's view of one LLM call (:func:`otel_verl.server_timing.split`) from the
    ``verl.llm.server.*`` attributes of its server span, as a dict: ``e2e``, ``queue``,
    ``prefill``, ``decode`` in seconds; ``None`` when the server reported no e2e_latency."""
    prefix = sc.LLM_SERVER_META_PREFIX
    meta = {key[len(prefix):]: value for key, value in server_span["attributes"].items() if key.startswith(prefix)}
    timing = server_timing.split(meta)
    if timing is None:
        return None
    return {"e2e": timing.e2e, "queue": timing.queue, "prefill": timing.prefill, "decode": timing.decode}


class SpanIndex:
    """Each span's children, by (trace id, parent span id)."""

    def __init__(self, spans: List[Dict[str, Any]]) -> None:
        self.children: Dict[Tuple[str, str], List[Dict[str, Any]]] = defaultdict(list)
        for span in spans:
            if span["parentSpanId"]:
                self.children[(span["traceId"], span["parentSpanId"])].append(span)

    def children_of(self, span: Dict[str, Any]) -> List[Dict[str, Any]]:
        return self.children.get((span["traceId"], span["spanId"]), [])

    def descendants(self, span: Dict[str, Any]) -> List[Dict[str, Any]]:
        out, todo = [], [span]
        while todo:
            current = todo.pop()
            kids = self.children.get((current["traceId"], current["spanId"]), ())
            out.extend(kids)
            todo.extend(kids)
        return out


def trajectory_split(traj: Dict[str, Any], index: SpanIndex) -> Dict[str, Any]:
    """A trajectory span's time: LLM (its ``chat`` / ``text_completion`` spans, with the
    server's queue / prefill / decode and the client's rest), tools, reward, other."""
    attrs = traj["attributes"]
    below = index.descendants(traj)
    llm = [s for s in below if is_llm_call(s)]
    tools = [s for s in below if is_tool(s)]
    rewards = [s for s in below if s["name"] == sc.SPAN_REWARD]
    total = duration_s(traj)
    llm_s = sum(duration_s(s) for s in llm)
    tool_s = sum(duration_s(s) for s in tools)
    reward_s = sum(duration_s(s) for s in rewards)
    splits = [call_server_split(s, index) for s in llm]
    server = None
    if llm and all(splits):
        # a part one call lacks (a server without its metrics) is unknown for the trajectory
        server = {key: None if any(s[key] is None for s in splits) else sum(s[key] for s in splits)
                  for key in ("e2e", "queue", "prefill", "decode")}
        server["client_overhead"] = llm_s - server["e2e"]  # transport, routing, tokenizing
    return {
        "uid": attrs.get(sc.UID),
        "traj_uid": attrs.get(sc.TRAJ_UID),
        "step": attrs.get(sc.GLOBAL_STEP),
        "trace_id": traj["traceId"],
        "span_id": traj["spanId"],
        "duration_s": total,
        "turns": len(llm),
        "llm_s": llm_s,
        "llm_server_s": server,
        "tool_s": tool_s,
        "tool_calls": len(tools),
        "reward_s": reward_s,
        "other_s": total - llm_s - tool_s - reward_s,
    }


def server_spans_of(llm_span: Dict[str, Any], index: SpanIndex) -> List[Dict[str, Any]]:
    """The LLM call's server spans: its ``verl.llm_server.generate`` child, else, when verl's
    client resumed the call, its ``verl.llm.attempt`` children's (one per engine request);
    else the call's own span (earlier otel_verl builds put the server's timing there too)."""
    children = index.children_of(llm_span)
    servers = [c for c in children if c["name"] == sc.SPAN_LLM_SERVER]
    if not servers:
        servers = [s for a in children if a["name"] == sc.SPAN_LLM_ATTEMPT
                   for s in index.children_of(a) if s["name"] == sc.SPAN_LLM_SERVER]
    return servers or [llm_span]


def call_server_split(llm_span: Dict[str, Any], index: SpanIndex) -> Optional[Dict[str, Optional[float]]]:
    """The server's view of one LLM call, summed over its engine requests (a resumed call
    has several); ``None`` when one of them reported no e2e_latency, a part ``None`` when
    one of them lacks it."""
    splits = [server_split(s) for s in server_spans_of(llm_span, index)]
    if not all(splits):
        return None
    return {key: None if any(s[key] is None for s in splits) else sum(s[key] for s in splits)
            for key in ("e2e", "queue", "prefill", "decode")}
