"""The direct OTLP protobuf encoder: the very message the SDK's encoder builds."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_verl.exporters import otlp_proto
from otel_verl.exporters.otlp_proto import encode_spans_bytes, grpc_span_exporter, http_span_exporter

from test_otlp_json_file import make_spans


def _parsed(data: bytes) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(data)


def test_bytes_parse_into_the_sdk_message():
    spans = make_spans()
    # odd values (maps, unencodable objects, int64 overflow): the batch goes to the SDK encoder
    assert _parsed(encode_spans_bytes(spans)) == encode_spans(spans)
    plain = [s for s in spans if s.name not in ("odd values", "raw")]
    direct = otlp_proto._encode(plain)  # no fallback
    assert _parsed(direct) == encode_spans(plain)
    # cached attribute encodings give the same bytes the second time
    assert otlp_proto._encode(plain) == direct


def test_events_api_spans_encode_directly(make_pipeline):
    from otel_verl import events

    pipeline = make_pipeline()
    with events.trajectory("u1", "0", step=3, agent_name="tool_agent", n_samples=2):
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call([1, 2, 3], model="m", request_id="r", max_tokens=8, temperature=0.5) as turn:
                turn.finish([4, 5], stop_reason="stop", server_meta={"e2e_latency": 0.5})
            with events.tool_call("calc", call_id="c1"):
                pass
        with events.reward() as reward:
            reward.score(1.0)
    spans = pipeline.spans()
    assert len(spans) >= 4
    assert _parsed(otlp_proto._encode(spans)) == encode_spans(spans)


def test_lean_spans_with_error_events_links_and_sdk_checked_attributes(make_pipeline):
    """The encoder reads a LeanSpan's fields directly: every field it can hold."""
    from opentelemetry import trace

    from otel_verl import events
    from otel_verl.lean_span import LeanSpan

    pipeline = make_pipeline()
    try:
        with events.trajectory("u2", "1", step=1, agent_name="a"):
            span = trace.get_current_span()
            span.add_event("note", {"k": 1})
            span.add_link(span.get_span_context(), {"why": "self"})
            span.set_attribute("user.values", [1, 2])  # another library's: the SDK's checks from now on
            raise ValueError("boom")
    except ValueError:
        pass
    spans = pipeline.spans()
    assert [type(s) for s in spans] == [LeanSpan]
    assert spans[0].status.description and spans[0].events and spans[0].links
    assert _parsed(otlp_proto._encode(spans)) == encode_spans(spans)


def test_cached_attribute_encodings_keep_their_value_types(make_pipeline):
    # True == 1 == 1.0 and (True,) == (1,): the cache must not give one's bytes to another
    from otel_verl import events

    pipeline = make_pipeline()
    for value in ("1", 1, True, 1.0, ("x",), (True,), (1,), ("x", "y")):
        with events.trajectory("u3", "0", step=1, agent_name="a"):
            from opentelemetry import trace

            trace.get_current_span().set_attribute("v", value)
    spans = pipeline.spans()
    assert len(spans) == 8
    assert _parsed(otlp_proto._encode(spans)) == encode_spans(spans)
    assert _parsed(otlp_proto._encode(spans)) == encode_spans(spans)  # from the cache


@contextlib.contextmanager
def _otlp_http_receiver(statuses=()):
    """A local OTLP/HTTP endpoint: yields (traces URL, bodies it accepted); answers the
    requests with ``statuses`` in turn, then 200."""
    received, answers = [], iter(statuses)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status = next(answers, 200)
            if status == 200:
                received.append(body)
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/traces", received
    finally:
        server.shutdown()


def _content_spans(make_pipeline, trajectories=40, chars=8000):
    """Chat spans carrying GenAI message content (two texts of ``chars`` each)."""
    from otel_verl import events

    pipeline = make_pipeline(env={"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"})
    text = "w\u00f6rd " * (chars // 5)
    for i in range(trajectories):
        with events.trajectory(f"u{i}", "0", step=1, agent_name="a", decode=lambda ids, **kw: text):
            with events.llm_call([1, 2, 3], model="m") as turn:
                turn.finish([4, 5], stop_reason="stop")
    spans = pipeline.spans()
    assert len(spans) == 2 * trajectories
    return spans


def _span_messages(data: bytes) -> list:
    return [span for rs in _parsed(data).resource_spans for ss in rs.scope_spans for span in ss.spans]


def test_a_batch_is_split_into_requests_under_the_size_bound(make_pipeline):
    spans = _content_spans(make_pipeline)
    whole = encode_spans_bytes(spans)
    assert len(whole) > 600_000
    requests = otlp_proto.encode_requests(spans, 100_000)
    assert len(requests) >= 7 and all(len(data) <= 100_000 for _, data in requests)
    for request_spans, data in requests:
        assert _parsed(data) == encode_spans(request_spans)  # each a whole request of its spans
    # in order, every span once
    assert [s for request_spans, _ in requests for s in request_spans] == list(spans)
    assert [m for _, data in requests for m in _span_messages(data)] == _span_messages(whole)
    # under the default bound one request carries them all; a span over the bound goes alone
    assert [len(r) for r, _ in otlp_proto.encode_requests(spans)] == [len(spans)]
    alone = otlp_proto.encode_requests(spans, 1_000)
    assert [len(r) for r, _ in alone] == [1] * len(spans)


def test_values_left_to_the_sdk_encoder_are_split_too():
    spans = make_spans()  # "odd values": an int64 overflow the SDK's encoder handles
    requests = otlp_proto.encode_requests(spans, 1_500)
    assert len(requests) > 1
    assert all(len(data) <= 1_500 or len(request_spans) == 1 for request_spans, data in requests)
    assert [s for request_spans, _ in requests for s in request_spans] == list(spans)
    for request_spans, data in requests:
        assert _parsed(data) == encode_spans(request_spans)


def test_a_resource_value_left_to_the_sdk_encoder_falls_back_too():
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "t", "huge": 1 << 64}))  # int64 overflow
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for i in range(3):
        provider.get_tracer("t").start_span(f"s{i}").end()
    spans = memory.get_finished_spans()
    requests = otlp_proto.encode_requests(spans)
    assert [list(r) for r, _ in requests] == [list(spans)]
    assert _parsed(requests[0][1]) == encode_spans(spans)


def test_a_refused_request_ends_the_batch_and_only_undelivered_spans_count_as_dropped(make_pipeline):
    from otel_verl import health
    from otel_verl.sampling import _CountingExporter

    spans = _content_spans(make_pipeline, trajectories=20)
    requests = otlp_proto.encode_requests(spans, 100_000)
    assert len(requests) >= 3
    with _otlp_http_receiver([200, 400]) as (url, received):  # the second request is refused
        exporter = http_span_exporter(endpoint=url, max_request_bytes=100_000)
        counting = _CountingExporter(exporter, "otlp")
        assert counting.export(spans) is SpanExportResult.FAILURE
        delivered = len(requests[0][0])
        assert len(received) == 1 and len(_span_messages(received[0])) == delivered  # none after the refusal
        assert exporter.failed_spans == len(spans) - delivered
        assert health.snapshot()["dropped"] == {"otlp": len(spans) - delivered}
        assert counting.exported == delivered
        assert counting.export(spans) is SpanExportResult.SUCCESS and exporter.failed_spans == 0
        assert len(received) == 1 + len(requests)
        exporter.shutdown()


def test_http_exporter_posts_the_direct_encoding():
    with _otlp_http_receiver() as (url, received):
        spans = [s for s in make_spans() if s.name not in ("odd values", "raw")]
        exporter = http_span_exporter(endpoint=url)
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        assert _parsed(received[0]) == encode_spans(spans)
        # the SDK's own exporter in the same process is unaffected
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        assert OTLPSpanExporter(endpoint=url).export(spans) is SpanExportResult.SUCCESS
        assert _parsed(received[1]) == encode_spans(spans)
        exporter.shutdown()


def test_grpc_exporter_translates_to_the_sdk_message():
    spans = [s for s in make_spans() if s.name not in ("odd values", "raw")]
    exporter = grpc_span_exporter(endpoint="localhost:1", insecure=True)
    try:
        assert exporter._translate_data(spans) == encode_spans(spans)
    finally:
        exporter.shutdown()
