"""An OTLP span exporter of otel_verl's own: its encoders, the SDK's settings and retries.

:class:`OtlpSpanExporter` is a ``SpanExporter`` taking otel_verl's span records (SDK
``ReadableSpan``s are converted) and sending them over OTLP/gRPC, OTLP/HTTP protobuf or
OTLP/HTTP JSON, encoded by :mod:`otel_verl.accelerated.otlp_encoding` (the SDK encoder's
bytes at a fraction of its CPU). It cuts a batch into requests under the receivers' 4 MiB
limit (gRPC's default receive limit in the Collector, Jaeger and Tempo) and says how many
spans of the last batch were not delivered (``failed_spans``, read by
:class:`otel_verl.accelerated.batch.BatchExportProcessor`).

Settings: an argument given to the constructor wins; else the signal's variable
(``OTEL_EXPORTER_OTLP_TRACES_*``), else the general one (``OTEL_EXPORTER_OTLP_*``), read
as the SDK's exporters read them:

- ``PROTOCOL``: ``grpc`` (the SDK's default), ``http/protobuf`` or ``http/json``.
- ``ENDPOINT``: gRPC: a URL or ``host:port`` (default ``http://localhost:4317``), the
  traces variable or the general one as it is; an ``https`` URL is TLS, an ``http`` URL
  plain text, anything else TLS unless ``INSECURE``. HTTP: the traces variable is the
  whole URL; the general one is a base URL that ``/v1/traces`` is appended to (default
  ``http://localhost:4318``). Credentials in the URL (``http://user:pass@host``) are sent
  as HTTP Basic authorization (an ``authorization`` header; an explicit one in
  ``HEADERS`` wins) and never logged.
- ``HEADERS``: ``key=value`` pairs, comma-separated, URL-decoded (``parse_env_headers``,
  liberal), keys lowercased; the traces variable replaces the general one.
- ``COMPRESSION``: ``gzip``, ``deflate`` or ``none`` (default); another value: none, with
  a warning.
- ``TIMEOUT``: seconds (as the SDK reads it; default 10) for one request with its
  retries.
- ``CERTIFICATE``, ``CLIENT_KEY``, ``CLIENT_CERTIFICATE``: PEM files of the CA to trust
  and of the client's key and certificate (mutual TLS), each traces variable before the
  general one.
- ``INSECURE`` (gRPC): ``true`` for plain text to an endpoint without ``https``.

Retries as the SDK's: HTTP 429, 502, 503, 504 and connection errors (a connection error
once at once, for a stale pooled connection), gRPC's retryable codes (CANCELLED,
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, OUT_OF_RANGE, UNAVAILABLE, DATA_LOSS),
with exponential backoff (1, 2, 4, ... s, ±20% jitter; ``Retry-After`` or gRPC's
``RetryInfo`` when the receiver sends one), at most 6 tries, and none that would end past
the request's timeout. Anything else fails the request at once. A partial success (the
receiver rejected some spans) is not retried: its rejected spans count as failed.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import math
import os
import random
import threading
import time
import zlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import unquote, urlsplit, urlunsplit

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from otel_verl import health
from otel_verl.accelerated.otlp_encoding import JsonEncoder, ProtobufEncoder, records_of
from otel_verl.settings import OTLP_PROTOCOLS
from otel_verl.version import __version__

logger = logging.getLogger("otel_verl")

# The most a request may carry. The margin is for what a receiver counts beyond the
# encoded request (gRPC's framing); the encoders size a request exactly.
MAX_REQUEST_BYTES = 4 * 1024 * 1024 - 64 * 1024

GRPC, HTTP_PROTOBUF, HTTP_JSON = "grpc", "http/protobuf", "http/json"
PROTOCOLS = OTLP_PROTOCOLS  # (GRPC, HTTP_PROTOBUF, HTTP_JSON)
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "v1/traces"
DEFAULT_TIMEOUT_S = 10.0
GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
USER_AGENT = f"otel-verl/{__version__}"

MAX_TRIES = 6
JITTER = 0.2
RETRYABLE_HTTP_STATUSES = frozenset({429, 502, 503, 504})
RETRYABLE_GRPC_CODES = ("CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "OUT_OF_RANGE",
                        "UNAVAILABLE", "DATA_LOSS")
COMPRESSIONS = ("none", "gzip", "deflate")


class OtlpSettings:
    """The exporter's settings, resolved from arguments and ``environ`` (see the module's
    description)."""

    def __init__(self, environ: Mapping[str, str], *, protocol: Optional[str] = None,
                 endpoint: Optional[str] = None, headers: Optional[Mapping[str, str]] = None,
                 timeout: Optional[float] = None, compression: Optional[str] = None,
                 insecure: Optional[bool] = None, certificate_file: Optional[str] = None,
                 client_key_file: Optional[str] = None, client_certificate_file: Optional[str] = None) -> None:
        def setting(name: str) -> Optional[str]:
            return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(f"OTEL_EXPORTER_OTLP_{name}")

        self.protocol = (protocol or setting("PROTOCOL") or GRPC).strip().lower()
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"OTLP protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if endpoint is None:
            endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if endpoint is None and self.protocol == GRPC:
            endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_GRPC_ENDPOINT
        elif endpoint is None:
            base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_HTTP_ENDPOINT
            endpoint = f"{base.rstrip('/')}/{TRACES_PATH}"
        # credentials taken out of the URL: sent as authorization, never logged with it
        self.endpoint, self.username, self.password = _split_credentials(endpoint.strip())

        self.headers: Dict[str, str] = dict(parse_env_headers(
            environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or environ.get("OTEL_EXPORTER_OTLP_HEADERS") or "",
            liberal=True))
        if headers:
            self.headers.update({str(key).lower(): str(value) for key, value in headers.items()})

        raw_timeout: Any = timeout if timeout is not None else setting("TIMEOUT")
        try:
            self.timeout_s = float(raw_timeout) if raw_timeout is not None else DEFAULT_TIMEOUT_S
            if not self.timeout_s > 0:
                raise ValueError(raw_timeout)
        except (TypeError, ValueError):
            logger.warning("otel_verl: OTLP timeout %r is not a number of seconds; using %s", raw_timeout,
                           DEFAULT_TIMEOUT_S)
            self.timeout_s = DEFAULT_TIMEOUT_S

        raw_compression = (compression or setting("COMPRESSION") or "none").strip().lower()
        if raw_compression not in COMPRESSIONS:
            logger.warning("otel_verl: OTLP compression %r is not one of %s; sending uncompressed",
                           raw_compression, ", ".join(COMPRESSIONS))
            raw_compression = "none"
        self.compression = raw_compression

        self.certificate_file = certificate_file or setting("CERTIFICATE")
        self.client_key_file = client_key_file or setting("CLIENT_KEY")
        self.client_certificate_file = client_certificate_file or setting("CLIENT_CERTIFICATE")

        # gRPC: as OTLPExporterMixin decides it
        scheme = urlsplit(self.endpoint).scheme
        if scheme == "https":
            insecure = False
        elif insecure is None:
            raw = environ.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or environ.get("OTEL_EXPORTER_OTLP_INSECURE")
            insecure = raw.strip().lower() == "true" if raw is not None else scheme == "http"
        self.insecure = bool(insecure)

    def basic_authorization(self) -> Optional[str]:
        if self.username is None:
            return None
        token = f"{self.username}:{self.password or ''}".encode("utf-8")
        return "Basic " + base64.b64encode(token).decode("ascii")

    def request_headers(self) -> Dict[str, str]:
        """The headers every request carries: an explicit ``authorization`` header wins
        over the endpoint's credentials, on every protocol."""
        headers = dict(self.headers)
        authorization = self.basic_authorization()
        if authorization is not None and "authorization" not in headers:
            headers["authorization"] = authorization
        return headers


def _split_credentials(endpoint: str) -> Tuple[str, Optional[str], Optional[str]]:
    """``endpoint`` without ``user:password@``, and the (URL-decoded) user and password."""
    parts = urlsplit(endpoint)
    if not parts.netloc or "@" not in parts.netloc:
        return endpoint, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    without = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return without, unquote(user), unquote(password)


class OtlpSpanExporter(SpanExporter):
    """Sends span records over OTLP (see the module's description for the settings).

    ``export`` never raises: a request that fails after its retries ends the batch
    (every further request would wait out its timeout again), and ``failed_spans`` says
    how many spans of the batch were not delivered. ``environ`` replaces ``os.environ``
    (for tests and configurators)."""

    def __init__(self, endpoint: Optional[str] = None, *, protocol: Optional[str] = None,
                 headers: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
                 compression: Optional[str] = None, insecure: Optional[bool] = None,
                 certificate_file: Optional[str] = None, client_key_file: Optional[str] = None,
                 client_certificate_file: Optional[str] = None, max_request_bytes: int = MAX_REQUEST_BYTES,
                 environ: Optional[Mapping[str, str]] = None, output: str = "otlp") -> None:
        self.settings = OtlpSettings(
            os.environ if environ is None else environ, protocol=protocol, endpoint=endpoint, headers=headers,
            timeout=timeout, compression=compression, insecure=insecure, certificate_file=certificate_file,
            client_key_file=client_key_file, client_certificate_file=client_certificate_file)
        self.output = output
        self.max_request_bytes = max_request_bytes
        self.failed_spans = 0
        self.encoder = JsonEncoder(output) if self.settings.protocol == HTTP_JSON else ProtobufEncoder(output)
        self._lock = threading.Lock()  # the batch processor's thread and a flushing caller may both export
        self._shutdown = threading.Event()  # set: no more exports, retries stop waiting
        self._reported: set = set()
        self.transport = (_GrpcTransport(self.settings, self._shutdown) if self.settings.protocol == GRPC
                          else _HttpTransport(self.settings, self._shutdown))

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if not spans:
            self.failed_spans = 0
            return SpanExportResult.SUCCESS
        if self._shutdown.is_set():
            self.failed_spans = len(spans)
            return SpanExportResult.FAILURE
        with self._lock:
            try:
                self.failed_spans = self._export(spans)
            except Exception as exc:  # a bug of ours or a transport's: the batch counts as not delivered
                health.record_failure(f"{self.output}.export", exc)
                self.failed_spans = len(spans)
        return SpanExportResult.FAILURE if self.failed_spans else SpanExportResult.SUCCESS

    def _export(self, spans: Sequence[Any]) -> int:
        """How many spans of ``spans`` were not delivered."""
        try:
            requests = list(self.encoder.requests(records_of(spans), self.max_request_bytes))
        except Exception as exc:  # the SDK's encoder could not write it either
            health.record_failure(f"{self.output}.encode", exc)
            return len(spans)
        delivered = rejected = 0
        for body, count in requests:
            outcome = self.transport.send(body)
            if not outcome.delivered:
                self._report(outcome.error.split(":", 1)[0], outcome.error)
                break
            delivered += count
            if outcome.rejected:
                rejected += min(outcome.rejected, count)
                self._report("partial success", f"the receiver rejected {outcome.rejected} span(s): {outcome.error}")
        return len(spans) - delivered + rejected

    def _report(self, kind: str, error: str) -> None:
        """Log why an export failed, once per kind of error (the loss itself is counted
        by the caller, :class:`~otel_verl.accelerated.batch.BatchExportProcessor`)."""
        if kind in self._reported or len(self._reported) >= 100:
            return
        self._reported.add(kind)
        logger.warning("otel_verl: OTLP export to %s failed: %s; further failures of this kind are counted only",
                       self.settings.endpoint, error[:500])

    def shutdown(self) -> None:
        if self._shutdown.is_set():
            return
        self._shutdown.set()  # a retry waiting its backoff gives up now
        try:
            self.transport.close()  # a request in flight fails now rather than at its timeout
        except Exception as exc:
            health.record_failure(f"{self.output}.shutdown", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered: every export is sent before it returns


class _Outcome:
    """What sending one request came to."""

    __slots__ = ("delivered", "rejected", "error")

    def __init__(self, delivered: bool, rejected: int = 0, error: str = "") -> None:
        self.delivered = delivered
        self.rejected = rejected  # a partial success's rejected spans
        self.error = error


def _backoff_s(attempt: int) -> float:
    return 2 ** attempt * random.uniform(1 - JITTER, 1 + JITTER)


def _read_file(path: Optional[str], what: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        health.record_failure(f"otlp.{what}", exc)
        return None


def _partial_success(body: bytes, json_body: bool) -> Tuple[int, str]:
    """``(rejected spans, error message)`` of an ExportTraceServiceResponse."""
    if not body:
        return 0, ""
    if json_body:
        partial = json.loads(body).get("partialSuccess") or {}
        return int(partial.get("rejectedSpans") or 0), str(partial.get("errorMessage") or "")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    partial = ExportTraceServiceResponse.FromString(body).partial_success
    return int(partial.rejected_spans), partial.error_message


class _HttpTransport:
    """OTLP/HTTP with ``requests``, as the SDK's HTTP exporter sends."""

    def __init__(self, settings: OtlpSettings, shutdown: threading.Event) -> None:
        import requests

        self.settings = settings
        self.shutdown = shutdown
        self.json_body = settings.protocol == HTTP_JSON
        self.session = requests.Session()
        # given with each request: a session's own would lose to REQUESTS_CA_BUNDLE
        self.tls: Dict[str, Any] = {}
        if settings.certificate_file:
            self.tls["verify"] = settings.certificate_file
        client_certificate, client_key = settings.client_certificate_file, settings.client_key_file
        if client_certificate:
            self.tls["cert"] = (client_certificate, client_key) if client_key else client_certificate
        self.headers = {"content-type": "application/json" if self.json_body else "application/x-protobuf",
                        "user-agent": USER_AGENT, **settings.request_headers()}
        if settings.compression != "none" and "content-encoding" not in self.headers:
            self.headers["content-encoding"] = settings.compression
        self.connection_errors = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)

    def compress(self, body: bytes) -> bytes:
        if self.settings.compression == "gzip":
            return gzip.compress(body, compresslevel=6)
        if self.settings.compression == "deflate":
            return zlib.compress(body)
        return body

    def post(self, data: bytes, timeout_s: float) -> Any:
        return self.session.post(self.settings.endpoint, data=data, headers=self.headers, timeout=timeout_s,
                                 allow_redirects=False, **self.tls)

    def send(self, body: bytes) -> _Outcome:
        data = self.compress(body)
        deadline = time.monotonic() + self.settings.timeout_s
        error = "no try"
        for attempt in range(MAX_TRIES):
            backoff = _backoff_s(attempt)
            try:
                try:
                    response = self.post(data, max(deadline - time.monotonic(), 0.001))
                except self.connection_errors:
                    if deadline - time.monotonic() <= 0:
                        raise
                    # once at once: usually a pooled connection the receiver had closed
                    response = self.post(data, max(deadline - time.monotonic(), 0.001))
            except self.connection_errors as exc:
                error, retryable = f"{type(exc).__name__}: {exc}", True
            except Exception as exc:
                return _Outcome(False, error=f"{type(exc).__name__}: {exc}")
            else:
                status = response.status_code
                if 200 <= status < 300:
                    try:
                        rejected, message = _partial_success(response.content, self.json_body)
                    except Exception:  # a receiver's answer we cannot read: it took the request
                        rejected, message = 0, ""
                    return _Outcome(True, rejected, message)
                error = f"HTTP {status}: {response.reason} {response.text[:200]!r}"
                retryable = status in RETRYABLE_HTTP_STATUSES
                retry_after = _retry_after_s(response.headers.get("retry-after")) if retryable else None
                if retry_after is not None:
                    backoff = retry_after
            if not retryable:
                return _Outcome(False, error=error)
            if attempt + 1 == MAX_TRIES or backoff > deadline - time.monotonic() or self.shutdown.is_set():
                return _Outcome(False, error=f"{error} (gave up: timeout, tries or shutdown)")
            if self.shutdown.wait(backoff):
                return _Outcome(False, error=f"{error} (shut down while retrying)")
        return _Outcome(False, error=error)

    def close(self) -> None:
        self.session.close()


def _retry_after_s(value: Optional[str]) -> Optional[float]:
    """The delay of a ``Retry-After`` header (seconds, or an HTTP date)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


class _GrpcTransport:
    """OTLP/gRPC through the public ``grpc`` API, the request already serialized."""

    def __init__(self, settings: OtlpSettings, shutdown: threading.Event) -> None:
        import grpc

        self.grpc = grpc
        self.settings = settings
        self.shutdown = shutdown
        parts = urlsplit(settings.endpoint)
        self.target = parts.netloc if parts.netloc else settings.endpoint
        self.metadata: List[Tuple[str, str]] = list(settings.request_headers().items())
        self.compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            settings.compression, grpc.Compression.NoCompression)
        self.retryable = frozenset(getattr(grpc.StatusCode, name) for name in RETRYABLE_GRPC_CODES)
        self.credentials = None if settings.insecure else grpc.ssl_channel_credentials(
            root_certificates=_read_file(settings.certificate_file, "certificate"),
            private_key=_read_file(settings.client_key_file, "client_key"),
            certificate_chain=_read_file(settings.client_certificate_file, "client_certificate"))
        self.channel: Any = None
        self.call: Any = None
        self.open()

    def open(self) -> None:
        options = [("grpc.primary_user_agent", USER_AGENT)]
        if self.credentials is None:
            self.channel = self.grpc.insecure_channel(self.target, options=options, compression=self.compression)
        else:
            self.channel = self.grpc.secure_channel(self.target, self.credentials, options=options,
                                                    compression=self.compression)
        self.call = self.channel.unary_unary(GRPC_METHOD, request_serializer=None, response_deserializer=None)

    def send(self, body: bytes) -> _Outcome:
        grpc = self.grpc
        deadline = time.monotonic() + self.settings.timeout_s
        error = "no try"
        for attempt in range(MAX_TRIES):
            try:
                response = self.call(body, metadata=self.metadata, timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
                error = f"gRPC {getattr(code, 'name', code)}: {details}"
                if code not in self.retryable:
                    return _Outcome(False, error=error)
                backoff = _retry_info_s(exc)
                if backoff is None:
                    backoff = _backoff_s(attempt)
                if code == grpc.StatusCode.UNAVAILABLE and attempt == 0 and not self.shutdown.is_set():
                    self.reopen()  # as the SDK: a fresh channel reconnects at once
                if attempt + 1 == MAX_TRIES or backoff > deadline - time.monotonic() or self.shutdown.is_set():
                    return _Outcome(False, error=f"{error} (gave up: timeout, tries or shutdown)")
                if self.shutdown.wait(backoff):
                    return _Outcome(False, error=f"{error} (shut down while retrying)")
                continue
            try:
                rejected, message = _partial_success(response, False)
            except Exception:  # an answer we cannot read: the receiver took the request
                rejected, message = 0, ""
            return _Outcome(True, rejected, message)
        return _Outcome(False, error=error)

    def reopen(self) -> None:
        try:
            self.channel.close()
        except Exception:  # closing a broken channel: nothing to do about it
            pass
        self.open()

    def close(self) -> None:
        self.channel.close()


def _retry_info_s(error: Any) -> Optional[float]:
    """The delay a receiver asked for in ``google.rpc.RetryInfo``, if it did."""
    try:
        trailing: Iterable[Tuple[str, Any]] = error.trailing_metadata() or ()
        raw = dict(trailing).get("google.rpc.retryinfo-bin")
        if raw is None:
            return None
        from google.rpc.error_details_pb2 import RetryInfo

        delay = RetryInfo.FromString(raw).retry_delay
        return delay.seconds + delay.nanos / 1e9
    except Exception:  # no such module, or a value we cannot read: our own backoff then
        return None
