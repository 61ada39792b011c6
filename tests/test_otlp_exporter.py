"""otel_verl's OTLP exporter: the SDK's settings, its transports and retries, the size
bound and the loss count, against scripted receivers (``otlp_receivers.py``, in their own
process) and, marked e2e, a real otelcol and a real Jaeger v2 on every protocol."""

from __future__ import annotations

import base64
import datetime
import gzip
import json
import logging
import math
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from otel_verl import health
from otel_verl.accelerated.batch import BatchExportProcessor
from otel_verl.accelerated.otlp_encoding import JsonEncoder, ProtobufEncoder, records_of
from otel_verl.accelerated.otlp_exporter import OtlpSettings, OtlpSpanExporter
from otel_verl.exporters.otlp_json_file import to_protobuf_json

from otel_binaries import jaeger_server, otelcol_factory  # noqa: F401  (fixtures)
from test_otlp_encoding import batch

TESTS_DIR = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- spans


def demo_spans(count: int = 6, text: str = "") -> List[Any]:
    """Spans as a run makes them: GenAI chat spans under a trajectory, a link, an event,
    an error, every attribute type."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "verl-rollout-worker", "verl.role": "w"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("otel_verl", "0.1.0")
    for i in range(count):
        with tracer.start_as_current_span("invoke_agent tool_agent", attributes={"verl.uid": f"u{i}"}) as root:
            with tracer.start_as_current_span("chat qwen", kind=SpanKind.CLIENT, attributes={
                    "gen_ai.request.model": "qwen", "gen_ai.usage.input_tokens": 128 + i, "temperature": 0.7,
                    "gen_ai.response.finish_reasons": ("stop",), "ok": True, "text": text or f"wörd {i}"}) as chat:
                chat.add_event("retry", {"attempt": 2})
            with tracer.start_as_current_span("verl.sample_stage adv", links=[Link(root.get_span_context())]):
                pass
            failing = tracer.start_span("execute_tool calc")
            failing.set_status(Status(StatusCode.ERROR, "boom"))
            failing.end()
    return list(memory.get_finished_spans())


# --------------------------------------------------------------------------- scripted receivers


class Receiver:
    """A scripted receiver process (see otlp_receivers.py)."""

    def __init__(self, tmp_path: Path, protocol: str, answers: List[Dict[str, Any]], tls: Any = None) -> None:
        self.capture = tmp_path / f"capture-{time.monotonic_ns()}.jsonl"
        config = tmp_path / f"receiver-{time.monotonic_ns()}.json"
        config.write_text(json.dumps({"protocol": protocol, "answers": answers, "capture": str(self.capture),
                                      "tls": tls}))
        self.proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "otlp_receivers.py"), str(config)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = (self.proc.stdout.readline() if self.proc.stdout else "").strip()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"receiver did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.port = int(line.split()[1])

    def requests(self) -> List[Dict[str, Any]]:
        if not self.capture.exists():
            return []
        return [json.loads(line) for line in self.capture.read_text().splitlines()]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def receiver(tmp_path):
    started: List[Receiver] = []

    def start(protocol: str, answers: List[Dict[str, Any]], tls: Any = None) -> Receiver:
        started.append(Receiver(tmp_path, protocol, answers, tls))
        return started[-1]

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def exporters():
    made: List[OtlpSpanExporter] = []

    def make(**kwargs: Any) -> OtlpSpanExporter:
        kwargs.setdefault("environ", {})
        made.append(OtlpSpanExporter(**kwargs))
        return made[-1]

    yield make
    for exporter in made:
        exporter.shutdown()


OK_HTTP = {"status": 200}
OK_GRPC = {"code": "OK"}


def endpoint_of(protocol: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{port}" + ("" if protocol == "grpc" else "/v1/traces")


def body_of(request: Dict[str, Any]) -> bytes:
    body = bytes.fromhex(request["body_hex"])
    encoding = request["headers"].get("content-encoding")
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


# --------------------------------------------------------------------------- settings


def test_settings_follow_the_sdks_variables_and_precedence():
    grpc = OtlpSettings({})
    assert (grpc.protocol, grpc.endpoint, grpc.insecure, grpc.timeout_s, grpc.compression) == (
        "grpc", "http://localhost:4317", True, 10.0, "none")
    http = OtlpSettings({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert http.endpoint == "http://localhost:4318/v1/traces"
    # the general endpoint is a base URL for HTTP (one slash), the traces one the whole URL
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    assert OtlpSettings(env).endpoint == "http://collector:4318/v1/traces"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://other:9999/custom"
    assert OtlpSettings(env).endpoint == "http://other:9999/custom"
    assert OtlpSettings(env, endpoint="http://arg:1/x").endpoint == "http://arg:1/x"
    # gRPC takes the general endpoint as it is
    assert OtlpSettings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}).endpoint == "http://collector:4317"
    # the traces variable before the general one, each setting on its own
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "3", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5",
           "OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem",
           "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/k.pem", "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/other.pem",
           "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/c.pem"}
    s = OtlpSettings(env)
    assert (s.protocol, s.timeout_s, s.compression) == ("http/json", 2.5, "gzip")
    assert (s.certificate_file, s.client_key_file, s.client_certificate_file) == ("/ca.pem", "/k.pem", "/c.pem")
    assert OtlpSettings(env, timeout=7, compression="deflate").timeout_s == 7
    with pytest.raises(ValueError):
        OtlpSettings({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})


def test_headers_are_url_decoded_lowercased_and_the_traces_variable_wins():
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "Api-Key=general", "OTEL_EXPORTER_OTLP_TRACES_HEADERS":
           "Api-Key=a%20b%3Dc,x-tenant = t1 ,liberal=not url encoded"}
    assert OtlpSettings(env).headers == {"api-key": "a b=c", "x-tenant": "t1", "liberal": "not url encoded"}
    assert OtlpSettings({"OTEL_EXPORTER_OTLP_HEADERS": "a=1"}, headers={"B": "2"}).headers == {"a": "1", "b": "2"}


def test_insecure_and_tls_are_decided_as_the_sdks_grpc_exporter_does():
    assert OtlpSettings({}, endpoint="http://h:4317").insecure is True
    assert OtlpSettings({}, endpoint="https://h:4317").insecure is False
    assert OtlpSettings({"OTEL_EXPORTER_OTLP_INSECURE": "true"}, endpoint="https://h:4317").insecure is False
    assert OtlpSettings({}, endpoint="h:4317").insecure is False  # no scheme: TLS unless told
    assert OtlpSettings({"OTEL_EXPORTER_OTLP_INSECURE": "True"}, endpoint="h:4317").insecure is True
    assert OtlpSettings({"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
                        endpoint="h:4317").insecure is False


def test_bad_timeout_and_compression_fall_back_with_a_warning(caplog):
    s = OtlpSettings({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon", "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"})
    assert (s.timeout_s, s.compression) == (10.0, "none")
    assert "soon" in caplog.text and "zstd" in caplog.text


def test_credentials_are_taken_out_of_the_endpoint():
    s = OtlpSettings({}, endpoint="https://us%40er:p%3Ass@collector:4318/v1/traces", protocol="http/protobuf")
    assert (s.endpoint, s.username, s.password) == ("https://collector:4318/v1/traces", "us@er", "p:ss")
    assert s.basic_authorization() == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert OtlpSettings({}).basic_authorization() is None


# --------------------------------------------------------------------------- what is sent


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
@pytest.mark.parametrize("compression", ["none", "gzip", "deflate"])
def test_the_request_is_our_encoding_with_the_headers(receiver, exporters, protocol, compression):
    server = receiver("grpc" if protocol == "grpc" else "http", [OK_GRPC if protocol == "grpc" else OK_HTTP])
    env = {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "api-key=s%20ecret,x-tenant=t1",
           "OTEL_EXPORTER_OTLP_COMPRESSION": compression}
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol, environ=env)
    spans = demo_spans()
    assert exporter.export(spans) is SpanExportResult.SUCCESS and exporter.failed_spans == 0
    (request,) = server.requests()
    headers = request["headers"]
    assert headers["api-key"] == "s ecret" and headers["x-tenant"] == "t1"
    encoder = JsonEncoder() if protocol == "http/json" else ProtobufEncoder()
    if protocol == "grpc":
        assert request["path"].endswith("TraceService/Export")
        # gRPC decompressed it (what went on the wire: the e2e tests send gzip to otelcol)
        assert bytes.fromhex(request["body_hex"]) == encoder.encode(records_of(spans))
        assert headers["user-agent"].startswith("otel-verl/")
    else:
        assert request["path"] == "/v1/traces"
        assert headers["content-type"] == ("application/json" if protocol == "http/json" else "application/x-protobuf")
        assert headers.get("content-encoding", "none") == compression
        assert body_of(request) == encoder.encode(records_of(spans))
        assert headers["user-agent"].startswith("otel-verl/")


def test_readable_spans_and_records_are_both_taken(receiver, exporters):
    server = receiver("http", [OK_HTTP])
    exporter = exporters(endpoint=endpoint_of("http", server.port), protocol="http/protobuf")
    spans = demo_spans(2)
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert exporter.export(records_of(spans)) is SpanExportResult.SUCCESS
    first, second = server.requests()
    assert first["body_hex"] == second["body_hex"]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_credentials_in_the_endpoint_are_sent_as_basic_auth_and_never_logged(receiver, exporters, protocol, caplog):
    caplog.set_level(logging.DEBUG)
    kind = "grpc" if protocol == "grpc" else "http"
    server = receiver(kind, [{"code": "INVALID_ARGUMENT"} if kind == "grpc" else {"status": 400}])
    endpoint = endpoint_of(protocol, server.port).replace("://", "://verl:s3cr%40t@")
    exporter = exporters(endpoint=endpoint, protocol=protocol)
    assert exporter.export(demo_spans(1)) is SpanExportResult.FAILURE  # a failure is logged, with the endpoint
    (request,) = server.requests()
    assert request["headers"]["authorization"] == "Basic " + base64.b64encode(b"verl:s3cr@t").decode()
    assert f"127.0.0.1:{server.port}" in caplog.text
    assert "s3cr" not in caplog.text and "verl:s" not in caplog.text and "dmVyb" not in caplog.text


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_an_explicit_authorization_header_wins_over_credentials_in_the_endpoint(receiver, exporters, protocol):
    kind = "grpc" if protocol == "grpc" else "http"
    server = receiver(kind, [OK_GRPC if kind == "grpc" else OK_HTTP])
    endpoint = endpoint_of(protocol, server.port).replace("://", "://verl:s3cr%40t@")
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t0ken"}
    exporter = exporters(endpoint=endpoint, protocol=protocol, environ=env)
    assert exporter.export(demo_spans(1)) is SpanExportResult.SUCCESS
    (request,) = server.requests()
    assert request["headers"]["authorization"] == "Bearer t0ken"


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate,
    both signed by it (PEM files)."""
    pytest.importorskip("cryptography")
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = tmp_path_factory.mktemp("certs")
    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, key: Any, cert: Any) -> Dict[str, str]:
        key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return {"key": str(key_path), "cert": str(cert_path)}

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "otel-verl test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(name: str, usage: Any, san: Any = None) -> Dict[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        return write(name, key, builder.sign(ca_key, hashes.SHA256()))

    out = {"ca": write("ca", ca_key, ca)["cert"]}
    out["server"] = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH, x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    out["client"] = leaf("otel-verl client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return out


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_mutual_tls_with_the_certificate_variables(receiver, exporters, certificates, protocol):
    kind = "grpc" if protocol == "grpc" else "http"
    tls = {**certificates["server"], "client_ca": certificates["ca"]}
    server = receiver(kind, [OK_GRPC if kind == "grpc" else OK_HTTP], tls=tls)
    endpoint = endpoint_of(protocol, server.port, scheme="https")
    with_client = {"OTEL_EXPORTER_OTLP_CERTIFICATE": certificates["ca"],
                   "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": certificates["client"]["key"],
                   "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": certificates["client"]["cert"]}
    spans = demo_spans(1)
    assert exporters(endpoint=endpoint, protocol=protocol, environ=with_client).export(spans) is SpanExportResult.SUCCESS
    assert len(server.requests()) == 1
    # without a client certificate the server refuses the handshake; without the CA the
    # client refuses the server
    for env in ({"OTEL_EXPORTER_OTLP_CERTIFICATE": certificates["ca"]},
                {k: v for k, v in with_client.items() if k != "OTEL_EXPORTER_OTLP_CERTIFICATE"}):
        exporter = exporters(endpoint=endpoint, protocol=protocol, environ=env, timeout=1.5)
        assert exporter.export(spans) is SpanExportResult.FAILURE and exporter.failed_spans == len(spans)
    assert len(server.requests()) == 1


# --------------------------------------------------------------------------- retries and deadlines


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_transient_refusal_is_retried_with_backoff_within_the_deadline(receiver, exporters, protocol):
    refusal = {"code": "UNAVAILABLE"} if protocol == "grpc" else {"status": 503}
    server = receiver("grpc" if protocol == "grpc" else "http", [refusal, OK_GRPC if protocol == "grpc" else OK_HTTP])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol, timeout=5)
    started = time.monotonic()
    assert exporter.export(demo_spans(1)) is SpanExportResult.SUCCESS
    first, second = server.requests()
    assert 0.75 <= second["t"] - first["t"] <= 1.5  # 1 s, +-20% jitter
    assert first["body_hex"] == second["body_hex"]
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_receivers_retry_delay_is_honoured(receiver, exporters, protocol):
    refusal = ({"code": "RESOURCE_EXHAUSTED", "retry_delay_s": 0.1} if protocol == "grpc"
               else {"status": 429, "headers": {"Retry-After": "0"}})
    server = receiver("grpc" if protocol == "grpc" else "http", [refusal, OK_GRPC if protocol == "grpc" else OK_HTTP])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol, timeout=5)
    assert exporter.export(demo_spans(1)) is SpanExportResult.SUCCESS
    first, second = server.requests()
    assert second["t"] - first["t"] < 0.6  # not our own 1 s backoff


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_retries_stop_before_a_backoff_would_pass_the_deadline(receiver, exporters, protocol):
    refusal = {"code": "UNAVAILABLE"} if protocol == "grpc" else {"status": 503}
    server = receiver("grpc" if protocol == "grpc" else "http", [refusal])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol, timeout=2)
    started = time.monotonic()
    assert exporter.export(demo_spans(1)) is SpanExportResult.FAILURE
    elapsed = time.monotonic() - started
    # tries at 0 s and ~1 s; the next backoff (~2 s) would end past the 2 s deadline
    assert len(server.requests()) == 2 and 0.75 <= elapsed < 2.0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_receiver_that_never_answers_keeps_the_timeout(receiver, exporters, protocol):
    server = receiver("grpc" if protocol == "grpc" else "http", [{"silent": True}])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol, timeout=1.5)
    spans = demo_spans(2)
    started = time.monotonic()
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert 1.3 <= time.monotonic() - started < 3.0
    assert exporter.failed_spans == len(spans)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_down_endpoint_fails_within_the_timeout(exporters, protocol):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = exporters(endpoint=endpoint_of(protocol, port), protocol=protocol, timeout=1.5)
    started = time.monotonic()
    assert exporter.export(demo_spans(1)) is SpanExportResult.FAILURE
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_a_bad_request_is_not_retried(receiver, exporters, protocol):
    kind = "grpc" if protocol == "grpc" else "http"
    server = receiver(kind, [{"code": "INVALID_ARGUMENT"} if kind == "grpc" else {"status": 400}, OK_HTTP])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol)
    assert exporter.export(demo_spans(1)) is SpanExportResult.FAILURE
    assert len(server.requests()) == 1


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_a_partial_success_is_not_retried_and_its_rejected_spans_count(receiver, exporters, protocol):
    kind = "grpc" if protocol == "grpc" else "http"
    partial = ExportTraceServiceResponse(partial_success=ExportTracePartialSuccess(rejected_spans=2,
                                                                                  error_message="too old"))
    if protocol == "http/json":
        body = json.dumps({"partialSuccess": {"rejectedSpans": "2", "errorMessage": "too old"}}).encode()
    else:
        body = partial.SerializeToString()
    answer = {"code": "OK", "body_hex": body.hex()} if kind == "grpc" else {"status": 200, "body_hex": body.hex()}
    server = receiver(kind, [answer])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol)
    spans = demo_spans(2)
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert exporter.failed_spans == 2 and len(server.requests()) == 1


def test_shutdown_ends_a_retry_at_once_and_later_exports_fail(receiver, exporters):
    server = receiver("http", [{"status": 503}])
    exporter = exporters(endpoint=endpoint_of("http", server.port), protocol="http/protobuf", timeout=30)
    results: List[Any] = []
    worker = threading.Thread(target=lambda: results.append(exporter.export(demo_spans(1))))
    worker.start()
    time.sleep(0.3)  # the first try refused, the export waits its backoff
    started = time.monotonic()
    exporter.shutdown()
    worker.join(5)
    assert results == [SpanExportResult.FAILURE] and time.monotonic() - started < 1.0
    assert exporter.export(demo_spans(1)) is SpanExportResult.FAILURE and exporter.failed_spans == 4
    assert exporter.force_flush() is True


# --------------------------------------------------------------------------- requests under the limit, loss counts


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_a_batch_goes_as_requests_under_the_bound_and_failed_spans_count_the_rest(receiver, exporters, protocol):
    kind = "grpc" if protocol == "grpc" else "http"
    ok = OK_GRPC if kind == "grpc" else OK_HTTP
    server = receiver(kind, [ok, ok, {"code": "INVALID_ARGUMENT"} if kind == "grpc" else {"status": 400}])
    exporter = exporters(endpoint=endpoint_of(protocol, server.port), protocol=protocol, max_request_bytes=20_000)
    spans = demo_spans(20, text="w\u00f6rd " * 300)
    processor = BatchExportProcessor(exporter, "otlp", schedule_delay_s=60)
    for span in spans:
        processor.on_end(span)
    assert processor.force_flush()
    requests = server.requests()
    assert len(requests) == 3  # nothing sent after the refused request
    sent = [body_of(r) for r in requests]
    assert all(len(body) <= 20_000 for body in sent)
    if protocol == "http/json":
        delivered = sum(len(s) for b in sent[:2] for rs in json.loads(b)["resourceSpans"]
                        for ss in rs["scopeSpans"] for s in [ss["spans"]])
    else:
        delivered = sum(len(ss.spans) for b in sent[:2] for rs in ExportTraceServiceRequest.FromString(b).resource_spans
                        for ss in rs.scope_spans)
    assert 0 < delivered < len(spans)
    assert exporter.failed_spans == len(spans) - delivered
    assert health.snapshot()["dropped"] == {"otlp": len(spans) - delivered}
    processor.shutdown()


def test_a_batch_the_sdk_cannot_encode_either_counts_as_failed(exporters):
    exporter = exporters(endpoint="http://127.0.0.1:9", protocol="http/protobuf")
    records = records_of(demo_spans(1))
    records[0].dropped_attributes = 1 << 40  # beyond uint32: neither encoder writes it
    assert exporter.export(records) is SpanExportResult.FAILURE
    assert exporter.failed_spans == len(records)
    assert "otlp.encode" in health.snapshot()["failures"]


def test_an_empty_batch_succeeds_without_a_request(exporters):
    exporter = exporters(endpoint="http://127.0.0.1:9", protocol="http/protobuf")
    assert exporter.export([]) is SpanExportResult.SUCCESS and exporter.failed_spans == 0


# --------------------------------------------------------------------------- real receivers

PROTOCOLS = ["grpc", "http/protobuf", "http/json"]


def _sent_spans(spans: List[Any]) -> Dict[str, Any]:
    """The SDK's encoding of ``spans``, span by span (protobuf messages by span id)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return {span.span_id.hex(): span for rs in encode_spans(spans).resource_spans for ss in rs.scope_spans
            for span in ss.spans}


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_otelcol_receives_every_span_whole(otelcol_factory, tmp_path, protocol):
    config = tmp_path / "otelcol.yaml"
    out = tmp_path / "traces.jsonl"
    config.write_text(f"""
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: ${{env:OTELCOL_GRPC_ENDPOINT}}
      http:
        endpoint: ${{env:OTELCOL_HTTP_ENDPOINT}}
exporters:
  file:
    path: {out}
    format: proto
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [file]
""")
    collector = otelcol_factory(config)
    endpoint = collector.otlp_grpc_endpoint if protocol == "grpc" else f"{collector.otlp_http_endpoint}/v1/traces"
    # compressed as a receiver must take it (gzip on gRPC: the only check of it on the wire)
    compression = {"grpc": "gzip", "http/protobuf": "deflate", "http/json": "gzip"}[protocol]
    exporter = OtlpSpanExporter(endpoint=endpoint, protocol=protocol, environ={}, max_request_bytes=60_000,
                                compression=compression)
    spans = [span for seed in range(6) for span in batch(seed)[0]] + demo_spans(10, text="x" * 5000)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    expected = _sent_spans(spans)
    received: Dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while len(received) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.3)
        received = _read_proto_file(out)
    assert set(received) == set(expected)
    for span_id, span in expected.items():
        # every field, as the SDK would have sent it (a NaN read from JSON is Go's NaN)
        assert _canonical_nans(received[span_id]) == _canonical_nans(span), span.name


def _canonical_nans(span: Any) -> Any:
    def fix(value: Any) -> None:
        kind = value.WhichOneof("value")
        if kind == "double_value" and math.isnan(value.double_value):
            value.double_value = math.nan
        elif kind == "array_value":
            for element in value.array_value.values:
                fix(element)
        elif kind == "kvlist_value":
            for pair in value.kvlist_value.values:
                fix(pair.value)

    copy = type(span)()
    copy.CopyFrom(span)
    for holder in [copy, *copy.events, *copy.links]:
        for pair in holder.attributes:
            fix(pair.value)
    return copy


def _read_proto_file(path: Path) -> Dict[str, Any]:
    """The spans in the collector's file exporter output (``format: proto``: each batch a
    4-byte big-endian length and a TracesData)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    spans, offset = {}, 0
    while offset + 4 <= len(data):
        length = int.from_bytes(data[offset:offset + 4], "big")
        if offset + 4 + length > len(data):
            break
        traces = TracesData.FromString(data[offset + 4:offset + 4 + length])
        offset += 4 + length
        for rs in traces.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans[span.span_id.hex()] = span
    return spans


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_jaeger_receives_every_span_whole(jaeger_server, protocol):
    endpoint = (f"http://{jaeger_server.otlp_grpc_endpoint}" if protocol == "grpc"
                else f"{jaeger_server.otlp_http_endpoint}/v1/traces")
    exporter = OtlpSpanExporter(endpoint=endpoint, protocol=protocol, environ={})
    spans = demo_spans(4)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    expected = _sent_spans(spans)
    by_trace: Dict[str, int] = {}
    for span in expected.values():
        by_trace[span.trace_id.hex()] = by_trace.get(span.trace_id.hex(), 0) + 1
    for trace_id, count in by_trace.items():
        trace = jaeger_server.wait_for_trace(trace_id, min_spans=count, raw=True)
        parsed = json_format.ParseDict(to_protobuf_json(trace), TracesData(), ignore_unknown_fields=True)
        got = {span.span_id.hex(): span for rs in parsed.resource_spans for ss in rs.scope_spans for span in ss.spans}
        assert len(got) == count
        for span_id, span in got.items():
            sent = expected[span_id]
            assert (span.name, span.kind, span.parent_span_id, span.start_time_unix_nano, span.end_time_unix_nano,
                    span.status) == (sent.name, sent.kind, sent.parent_span_id, sent.start_time_unix_nano,
                                     sent.end_time_unix_nano, sent.status)
            assert {kv.key: kv.value for kv in span.attributes} == {kv.key: kv.value for kv in sent.attributes}
            assert [(e.name, e.time_unix_nano) for e in span.events] == [(e.name, e.time_unix_nano) for e in sent.events]
            assert [(link.trace_id, link.span_id) for link in span.links] == [
                (link.trace_id, link.span_id) for link in sent.links]
