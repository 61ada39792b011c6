"""sglang's per-request timing keys, as the trajectory JSONL and the report read them.

The meta shapes are those sglang 0.5.12 and 0.5.23 write for a finished request with and
without ``enable_metrics`` (and an older sglang's, which the seed's formulas were written for).
"""

from __future__ import annotations

import pytest

from otel_verl import semconv as sc, server_timing as st
from otel_verl.tools.report.spans import server_split

WITH_METRICS_0_5_12 = {
    "e2e_latency": 1.5, "request_received_ts": 100.0, "api_server_dispatch_finish_ts": 100.125,
    "forward_entry_time": 100.25, "prefill_finished_time": 100.5, "queue_time": 0.125,
    "response_sent_to_client_ts": 101.5, "request_finished_ts": 101.5,
}
WITH_METRICS_0_5_23 = {**WITH_METRICS_0_5_12, "first_token_latency": 0.625, "decode_throughput": 40.0}
WITHOUT_METRICS = {"e2e_latency": 1.5}
OLDER_SGLANG = {"e2e_latency": 1.5, "queue_time": 0.25, "request_received_ts": 100.0, "prefill_finished_ts": 100.5,
                "prefill_launch_latency": 0.125}


@pytest.mark.parametrize("meta, ttft", [
    (WITH_METRICS_0_5_12, 0.5),
    (WITH_METRICS_0_5_23, 0.5),
    ({"e2e_latency": 1.0, "first_token_latency": 0.625}, 0.625),
    (OLDER_SGLANG, 0.5),
    (WITHOUT_METRICS, None),
    ({"prefill_finished_time": 100.5}, None),  # no arrival to measure from
])
def test_time_to_first_token(meta, ttft):
    assert st.ttft_s(meta) == ttft


@pytest.mark.parametrize("meta, missing", [
    (WITHOUT_METRICS, True),
    ({"e2e_latency": 1.5, "prompt_tokens": 3, "finish_reason": {"type": "stop"}}, True),
    (WITH_METRICS_0_5_12, False),
    (WITH_METRICS_0_5_23, False),
    (OLDER_SGLANG, False),
    ({}, False),  # no answer at all is not "metrics off"
    ({"queue_time": 0.1}, False),
])
def test_timing_missing_means_an_answer_without_the_metrics_keys(meta, missing):
    assert st.timing_missing(meta) is missing


def _server_span(meta):
    return {"attributes": {sc.llm_server_meta_attribute(k): v for k, v in meta.items() if isinstance(v, (int, float))}}


def test_report_split_from_sglang_0_5_12_and_0_5_23_keys():
    for meta in (WITH_METRICS_0_5_12, WITH_METRICS_0_5_23):
        split = server_split(_server_span(meta))
        assert split["e2e"] == 1.5 and split["queue"] == 0.125
        assert split["prefill"] == pytest.approx(0.5 - 0.125)  # ttft minus queue
        assert split["decode"] == pytest.approx(1.5 - 0.5)
    split = server_split(_server_span({"e2e_latency": 1.0, "queue_time": 0.25, "first_token_latency": 0.5}))
    assert (split["queue"], split["prefill"], split["decode"]) == (0.25, 0.25, 0.5)


def test_report_split_from_older_keys_and_without_metrics():
    split = server_split(_server_span(OLDER_SGLANG))
    assert (split["queue"], split["prefill"], split["decode"]) == (0.25, 0.25, 1.0)
    split = server_split(_server_span({"e2e_latency": 1.0, "queue_time": 0.25, "prefill_launch_latency": 0.125}))
    assert (split["prefill"], split["decode"]) == (0.125, 0.625)
    # only e2e_latency: the split is unknown, not "all decode"
    assert server_split(_server_span(WITHOUT_METRICS)) == {"e2e": 1.5, "queue": None, "prefill": None, "decode": None}
    assert server_split(_server_span({})) is None


def test_a_trajectory_with_one_call_without_metrics_has_no_split_but_its_e2e():
    from otel_verl.tools.report.spans import SpanIndex, trajectory_split

    def span(span_id, parent, name, attrs, start, end):
        return {"traceId": "t", "spanId": span_id, "parentSpanId": parent, "name": name, "attributes": attrs,
                "startTimeUnixNano": int(start * 1e9), "endTimeUnixNano": int(end * 1e9)}

    chat = {sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT}
    spans = [
        span("traj", None, "invoke_agent a", {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT}, 0, 10),
        span("c1", "traj", "chat", chat, 0, 4),
        span("s1", "c1", sc.SPAN_LLM_SERVER, _server_span(WITH_METRICS_0_5_12)["attributes"], 1, 3),
        span("c2", "traj", "chat", chat, 5, 8),
        span("s2", "c2", sc.SPAN_LLM_SERVER, _server_span(WITHOUT_METRICS)["attributes"], 5, 7),
    ]
    server = trajectory_split(spans[0], SpanIndex(spans))["llm_server_s"]
    assert server == {"e2e": 3.0, "queue": None, "prefill": None, "decode": None, "client_overhead": 4.0}


def test_a_resumed_call_sums_the_split_of_its_attempts_engine_requests():
    """verl's resuming client (the v1 async trainers) makes one ``verl.llm.attempt`` per engine
    request, each with its server span below it: the call's split is theirs, summed."""
    from otel_verl.tools.report.spans import SpanIndex, trajectory_split

    def span(span_id, parent, name, attrs, start, end):
        return {"traceId": "t", "spanId": span_id, "parentSpanId": parent, "name": name, "attributes": attrs,
                "startTimeUnixNano": int(start * 1e9), "endTimeUnixNano": int(end * 1e9)}

    aborted = {"e2e_latency": 0.5, "request_received_ts": 200.0, "queue_time": 0.0, "prefill_finished_time": 200.25,
               "request_finished_ts": 200.5}
    spans = [
        span("traj", None, "invoke_agent a", {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT}, 0, 10),
        span("c1", "traj", "chat", {sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT, sc.LLM_ATTEMPTS: 2}, 0, 6),
        span("a1", "c1", sc.SPAN_LLM_ATTEMPT, {}, 0, 1),
        span("s1", "a1", sc.SPAN_LLM_SERVER, _server_span(aborted)["attributes"], 0.25, 0.75),
        span("a2", "c1", sc.SPAN_LLM_ATTEMPT, {}, 2, 6),
        span("s2", "a2", sc.SPAN_LLM_SERVER, _server_span(WITH_METRICS_0_5_12)["attributes"], 3, 4.5),
    ]
    server = trajectory_split(spans[0], SpanIndex(spans))["llm_server_s"]
    assert server["e2e"] == pytest.approx(2.0) and server["queue"] == pytest.approx(0.125)
    assert server["prefill"] == pytest.approx(0.25 + 0.375) and server["decode"] == pytest.approx(0.25 + 1.0)
    assert server["client_overhead"] == pytest.approx(4.0)
