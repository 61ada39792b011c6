"""OTLP through the SDK's exporters (``OTEL_VERL_ACCELERATED=false``): a batch cut into
requests under the receivers' size limit, text the SDK's encoder fails on repaired, and
only the spans not delivered counted as lost; the SDK's own batch processor then, and the
spans still reaching a receiver."""

from __future__ import annotations

import base64
import math
import struct
from importlib.metadata import version
from typing import Any, List

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import fault_workload as w
from otel_verl import bootstrap, health, outputs, settings
from otel_verl.accelerated.batch import BatchExportProcessor
from otel_verl.accelerated.otlp_exporter import MAX_REQUEST_BYTES
from otel_verl.exporters.otlp import RequestSplittingExporter

from test_otlp_exporter import demo_spans, receiver  # noqa: F401  (receiver: a fixture)
from test_otlp_json_file import make_spans

# a chat message at the content limit: 8000 characters, 9600 UTF-8 bytes
TEXT = "w\u00f6rd " * 1600


def content_spans(count: int, processor: Any = None) -> List[Any]:
    """Chat spans carrying GenAI message content (two texts each), as a content-capturing
    run makes them."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "verl"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    if processor is not None:
        provider.add_span_processor(processor)
    tracer = provider.get_tracer("otel_verl")
    for i in range(count):
        tracer.start_span(f"chat m{i}", attributes={
            "gen_ai.input.messages": TEXT, "gen_ai.output.messages": TEXT, "verl.global_step": i}).end()
    return list(memory.get_finished_spans())


class RecordingExporter(SpanExporter):
    """A stand-in for the SDK's OTLP exporter: records each request; the ``failing``-th
    (1-based) request fails, or raises with ``raising``."""

    def __init__(self, failing: int = 0, raising: bool = False) -> None:
        self.requests: List[List[Any]] = []
        self.failing, self.raising = failing, raising
        self.shut_down = False

    def export(self, spans):
        self.requests.append(list(spans))
        if len(self.requests) == self.failing:
            if self.raising:
                raise ConnectionError("stand-in failure")
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.shut_down = True


def span_messages(request: ExportTraceServiceRequest) -> List[Any]:
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def ids(spans) -> List[Any]:
    """What identifies the spans of a request: the SDK's exporter gets spans rebuilt from
    otel_verl's records, not the very objects the batch held."""
    return [(span.name, span.context.span_id, span.start_time) for span in spans]


def test_a_batch_is_cut_into_requests_under_the_bound_in_order():
    spans = content_spans(40)
    total = encode_spans(spans).ByteSize()
    assert total > 700_000
    recorder = RecordingExporter()
    assert RequestSplittingExporter(recorder, max_request_bytes=100_000).export(spans) is SpanExportResult.SUCCESS
    requests = recorder.requests
    assert ids(span for request in requests for span in request) == ids(spans)  # in order, every span once
    assert all(encode_spans(request).ByteSize() <= 100_000 for request in requests)
    assert len(requests) <= math.ceil(total / 100_000) + 1  # full requests, not a span each


def test_a_span_over_the_bound_goes_alone_and_a_usual_batch_goes_whole():
    spans = make_spans()
    alone = RecordingExporter()
    RequestSplittingExporter(alone, max_request_bytes=100).export(spans)  # less than any span
    assert [ids(request) for request in alone.requests] == [ids([span]) for span in spans]
    whole = RecordingExporter()
    exporter = RequestSplittingExporter(whole)
    exporter.export(spans)
    assert [ids(request) for request in whole.requests] == [ids(spans)]
    # what the SDK's exporter gets encodes as the spans themselves would
    assert encode_spans(whole.requests[0]).SerializeToString() == encode_spans(spans).SerializeToString()
    exporter.shutdown()
    assert whole.shut_down


@pytest.mark.parametrize("raising", [False, True])
def test_a_failed_request_ends_the_batch_and_only_undelivered_spans_count_as_lost(raising):
    recorder = RecordingExporter(failing=2, raising=raising)
    exporter = RequestSplittingExporter(recorder, max_request_bytes=100_000)
    # as bootstrap builds the OTLP output; one batch for all spans
    processor = BatchExportProcessor(exporter, "otlp", schedule_delay_s=60)
    spans = content_spans(40, processor)
    assert processor.force_flush()
    first, second = recorder.requests[:2]
    assert len(recorder.requests) == 2  # nothing sent after the failed request
    assert exporter.failed_spans == len(spans) - len(first) > len(second)
    assert health.snapshot()["dropped"] == {"otlp": len(spans) - len(first)}
    assert health.snapshot()["failures"] == ({"otlp.export": 1} if raising else {})
    processor.shutdown()


_RECEIVER_WORKLOAD = """
    import json
    import otel_verl
    from opentelemetry import trace
    from otel_verl import health

    assert otel_verl.configure()
    text = "w\\u00f6rd " * 1600
    tracer = trace.get_tracer("test")
    for i in range({spans}):
        tracer.start_span(f"chat m{{i}}", attributes={{"gen_ai.input.messages": text,
                                                    "gen_ai.output.messages": text}}).end()
    otel_verl.shutdown()
    print("RESULT " + json.dumps(health.snapshot()))
"""


def _captured_requests(path) -> List[ExportTraceServiceRequest]:
    data = path.read_bytes()
    requests, i = [], 0
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        requests.append(ExportTraceServiceRequest.FromString(data[i + 4 : i + 4 + n]))
        i += 4 + n
    return requests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol, receiver", [("grpc", "grpc_capture"), ("http/protobuf", "capture")])
def test_a_receiver_gets_every_span_of_batches_over_its_limit(tmp_path, protocol, receiver):
    """configure()'s OTLP output against a real receiver (its own process; the gRPC one
    refuses messages over 4 MiB, as the Collector does): the default batch of 512 chat
    spans with content (~10 MB) arrives whole, in requests under the limit."""
    capture = tmp_path / "capture.bin"
    count = 600
    with w.fault_server(receiver, str(capture)) as port:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
               "OTEL_VERL_OFFLOAD": "0"}
        proc = w.run_python(_RECEIVER_WORKLOAD.format(spans=count), env, timeout=100)
    assert w.parse_result(proc.stdout) == {"failures": {}, "dropped": {}}
    requests = _captured_requests(capture)
    assert len(requests) >= 3 and all(r.ByteSize() <= MAX_REQUEST_BYTES for r in requests)
    names = [span.name for request in requests for span in span_messages(request)]
    assert sorted(names) == sorted(f"chat m{i}" for i in range(count))


_STOCK_EXPORTER = """
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult
    from test_otlp import content_spans

    exporter = OTLPSpanExporter(endpoint="127.0.0.1:{port}", insecure=True, timeout=1)
    assert exporter.export(content_spans(300)) is SpanExportResult.FAILURE
    assert exporter.export(content_spans(3)) is SpanExportResult.SUCCESS
"""


@pytest.mark.skipif(tuple(int(part) for part in version("opentelemetry-sdk").split(".")[:2]) < (1, 40),
                    reason="older SDKs' gRPC exporter retries a refused request past this test's time")
@pytest.mark.timeout(60)
def test_the_grpc_receiver_refuses_a_request_over_its_limit(tmp_path):
    """What the splitting is for (and that the receiver above has the limit): the stock
    exporter alone loses a whole batch of content spans."""
    capture = tmp_path / "capture.bin"
    with w.fault_server("grpc_capture", str(capture)) as port:
        w.run_python(_STOCK_EXPORTER.format(port=port), {}, timeout=50)
    assert [len(span_messages(r)) for r in _captured_requests(capture)] == [3]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("explicit", [True, False])
def test_credentials_in_the_endpoint_go_as_otel_verls_exporter_sends_them(receiver, monkeypatch, protocol, explicit):
    """The SDK's exporter as bootstrap builds it, against a real local receiver: an
    explicit ``authorization`` header wins over the endpoint's credentials, which are
    sent as Basic authorization otherwise."""
    kind = "grpc" if protocol == "grpc" else "http"
    server = receiver(kind, [{"code": "OK"} if kind == "grpc" else {"status": 200}])
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
                 "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"):
        monkeypatch.delenv(name, raising=False)
    path = "" if kind == "grpc" else "/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://verl:s3cr%40t@127.0.0.1:{server.port}{path}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "5")
    if explicit:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20t0ken")
    monkeypatch.setenv("OTEL_VERL_ACCELERATED", "false")
    exporter = outputs.otlp_exporter(settings.load())
    try:
        assert exporter.export(demo_spans(1)) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    (request,) = server.requests()
    basic = "Basic " + base64.b64encode(b"verl:s3cr@t").decode()
    assert request["headers"]["authorization"] == ("Bearer t0ken" if explicit else basic)


def _otlp_env(**env: str) -> dict:
    """The variables of an OTLP run, as ``settings.load`` reads them."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            **env}


def test_not_accelerated_builds_the_sdks_exporter_and_batch_processor(tmp_path, monkeypatch):
    """``OTEL_VERL_ACCELERATED=false``: OTLP goes through the SDK's ``OTLPSpanExporter`` and
    ``BatchSpanProcessor``, the OTLP-JSON files keep otel_verl's batching (an output of its
    own), the metrics the SDK's ``MeterProvider``; the default is otel_verl's accelerators."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_verl.accelerated.otlp_exporter import OtlpSpanExporter
    from otel_verl.exporters.metrics import SpanMetricsProcessor

    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    # a queue bound under the SDK's default batch of 512, which the SDK alone would refuse
    env = _otlp_env(VERL_TRACE_DIR=str(tmp_path), OTEL_VERL_OTLP_FILE="1", OTEL_BSP_MAX_QUEUE_SIZE="100")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for accelerated in ("false", "true"):
        monkeypatch.setenv("OTEL_VERL_ACCELERATED", accelerated)
        processors = outputs.build(settings.load())
        try:
            otlp = [p for p in processors if isinstance(p, (BatchSpanProcessor, BatchExportProcessor))
                    and getattr(p, "output", "otlp") == "otlp"]
            assert len(otlp) == 1
            if accelerated == "false":
                assert isinstance(otlp[0], BatchSpanProcessor)
                assert isinstance(otlp[0].span_exporter, RequestSplittingExporter)
                assert isinstance(otlp[0].span_exporter.exporter, OTLPSpanExporter)
            else:
                assert isinstance(otlp[0], BatchExportProcessor) and isinstance(otlp[0].exporter, OtlpSpanExporter)
            files = [p for p in processors if getattr(p, "output", None) == "otlp_json_file"]
            assert len(files) == 1 and isinstance(files[0], BatchExportProcessor)
            (metrics,) = [p for p in processors if isinstance(p, SpanMetricsProcessor)]
            assert metrics.accelerated is (accelerated == "true")
        finally:
            for processor in processors:
                processor.shutdown()


_NOT_ACCELERATED_WORKLOAD = """
    import json
    import otel_verl
    from opentelemetry import trace
    from otel_verl import bootstrap, events, health

    assert otel_verl.configure()
    print("PROCESSORS " + json.dumps(sorted(type(p).__name__ for p in bootstrap.span_processors())))
    for i in range(3):  # the events API's spans, which reach the outputs as otel_verl's span records
        with events.trajectory(f"u{{i}}", "0", step=1, agent_name="a"):
            with events.llm_call([1, 2]) as turn:
                turn.finish([3], stop_reason="stop")
    trace.get_tracer("test").start_span("sdk span").end()  # and an SDK span
    otel_verl.shutdown()
    print("RESULT " + json.dumps(health.snapshot()))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol, receiver", [("grpc", "grpc_capture"), ("http/protobuf", "capture")])
@pytest.mark.parametrize("offload", ["0", "1"])
def test_not_accelerated_spans_reach_a_receiver_through_the_sdks_batch_processor(tmp_path, protocol, receiver,
                                                                                  offload):
    """configure() with ``OTEL_VERL_ACCELERATED=false`` against a real receiver: the SDK's
    ``BatchSpanProcessor`` and exporter take otel_verl's span records and the SDK's spans
    alike, in the process and in its export process (where every span is a record)."""
    capture = tmp_path / "capture.bin"
    with w.fault_server(receiver, str(capture)) as port:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
               "OTEL_VERL_ACCELERATED": "false", "OTEL_VERL_OFFLOAD": offload,
               "OTEL_METRICS_EXPORTER": "none"}  # the receiver's file holds trace requests only
        proc = w.run_python(_NOT_ACCELERATED_WORKLOAD.format(), env, timeout=100)
    assert w.parse_result(proc.stdout) == {"failures": {}, "dropped": {}}
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("PROCESSORS ")]
    if offload == "0":
        assert "BatchSpanProcessor" in line and "BatchExportProcessor" not in line
    names = [span.name for request in _captured_requests(capture) for span in span_messages(request)]
    assert sorted(names) == sorted(["chat"] * 3 + ["invoke_agent a"] * 3 + ["sdk span"])

