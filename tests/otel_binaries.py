"""Locate (or build) the Go tracing binaries and run them for tests.

Binaries come from scripts/build-otel-binaries.sh, which builds them from the
Go module proxy into ``${OTEL_VERL_BIN_CACHE:-~/.cache/otel_verl/bin}``:

* ``jaeger``  - Jaeger v2.13 (memory storage, OTLP in, /api/v3 query API)
* ``otelcol`` - minimal OpenTelemetry Collector (otlp, otlp_json_file,
  batch, resource, tail_sampling, debug, otlp_grpc, otlp_http, file, prometheus,
  loadbalancing, clickhouse)

When a binary is missing (or otelcol was built from other sources), the script
runs first if ``OTEL_VERL_BUILD_BINARIES=1`` or ``CI=true``. If it is still unavailable, tests fail under CI and are skipped
elsewhere (``require_binary``).

Reusable pieces for end-to-end tests: ``free_ports``, ``wait_for_port``,
``wait_for_http``, ``ManagedProcess`` and the fixtures ``jaeger_server``
(Jaeger on free loopback ports) and ``otelcol_factory`` (start collectors with
a config file and env overrides). ``JaegerServer`` also searches traces (HTTP
API v3 by service/operation; gRPC API v3 and the legacy HTTP API by attribute);
``flat_spans`` turns an OTLP-JSON answer into the flat span dicts of
``otel_verl.exporters.otlp_json_file.spans_from_files``. Import the fixtures into a
test module (or a conftest.py) to use them::

    from otel_binaries import jaeger_server, otelcol_factory  # noqa: F401
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-otel-binaries.sh"
CONFIG_DIR = REPO_ROOT / "collector-config"
BINARIES = ("jaeger", "otelcol")
# A cold build of both on 2 cores takes several minutes.
BUILD_TIMEOUT_S = float(os.environ.get("OTEL_VERL_BUILD_TIMEOUT", "3000"))

_build_error: dict[str, str] = {}  # binary -> why the build failed (once per session)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def bin_dir() -> Path:
    """Cache dir the build script writes to (same default as the script)."""
    d = os.environ.get("OTEL_VERL_BIN_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "otel_verl" / "bin"


def _want_build() -> bool:
    return in_ci() or os.environ.get("OTEL_VERL_BUILD_BINARIES", "") == "1"


def otelcol_sources() -> str:
    """The sha256 of what otelcol is built from (as scripts/build-otel-binaries.sh
    computes it and stores it next to the binary in ``otelcol.sources``)."""
    import hashlib

    src = REPO_ROOT / "scripts" / "otelcol"
    return hashlib.sha256(b"".join((src / f).read_bytes() for f in ("go.mod", "go.sum", "main.go"))).hexdigest()


def _up_to_date(name: str) -> bool:
    """``name`` is built, and (otelcol) from the sources in this checkout."""
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        return False
    if name != "otelcol":
        return True
    stamp = bin_dir() / "otelcol.sources"
    return stamp.is_file() and stamp.read_text().strip() == otelcol_sources()


def _build(name: str) -> str | None:
    """Run the build script for ``name``; return an error text or None."""
    if name in _build_error:
        return _build_error[name]
    bin_dir().mkdir(parents=True, exist_ok=True)
    # Serialise builds across processes (pytest-xdist workers, CI's background build:
    # the build script takes the same lock).
    with open(bin_dir() / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _up_to_date(name):
            return None
        try:
            # its own process group: on timeout the go build it runs is stopped too
            proc = subprocess.Popen(
                ["bash", str(BUILD_SCRIPT), name],
                cwd=REPO_ROOT,
                env={**os.environ, "OTEL_VERL_BUILD_LOCKED": "1"},  # held here
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                _, stderr = proc.communicate(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise
        except (OSError, subprocess.TimeoutExpired) as e:
            err = f"{BUILD_SCRIPT} {name}: {e}"
        else:
            err = None if proc.returncode == 0 else (
                f"{BUILD_SCRIPT} {name} exited {proc.returncode}:\n{stderr[-3000:]}"
            )
    if err:
        _build_error[name] = err
    return err


def find_binary(name: str) -> tuple[str | None, str]:
    """Return (path, "") or (None, reason it is unavailable)."""
    assert name in BINARIES, name
    path = bin_dir() / name
    if _up_to_date(name):
        return str(path), ""
    if not _want_build():
        state = "built from other sources (scripts/otelcol changed)" if path.is_file() else "not built"
        return None, (
            f"{path} {state}; run scripts/build-otel-binaries.sh "
            "(or set OTEL_VERL_BUILD_BINARIES=1 to build it from the test)"
        )
    err = _build(name)
    if err is None and _up_to_date(name):
        return str(path), ""
    return None, err or f"build script ran but {path} is missing"


def require_binary(name: str) -> str:
    """Path of ``name``; pytest.fail under CI, pytest.skip elsewhere."""
    path, reason = find_binary(name)
    if path is None:
        if in_ci():
            pytest.fail(f"{name} binary unavailable: {reason}", pytrace=False)
        pytest.skip(f"{name} binary unavailable: {reason}")
    return path


# --------------------------------------------------------------------------
# Ports and readiness


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free TCP ports (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def wait_for_port(host: str, port: int, timeout: float = 30.0, proc: "ManagedProcess | None" = None) -> None:
    """Wait until ``host:port`` accepts TCP connections."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None:
            proc.check_alive()
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} not accepting connections after {timeout}s"
                                   + (f"\n{proc.log_tail()}" if proc else ""))
            time.sleep(0.1)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``url``; returns (status, body) also for HTTP error statuses."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for_http(url: str, timeout: float = 30.0, proc: "ManagedProcess | None" = None,
                  ok=(200,)) -> bytes:
    """Poll ``url`` until it answers with a status in ``ok``; return the body."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        if proc is not None:
            proc.check_alive()
        try:
            status, body = http_get(url, timeout=2.0)
            if status in ok:
                return body
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout}s ({last})"
                               + (f"\n{proc.log_tail()}" if proc else ""))
        time.sleep(0.2)


# --------------------------------------------------------------------------
# Processes


@dataclass
class ManagedProcess:
    """A child process with its output in a log file; stop() is idempotent."""

    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})}, cwd=REPO_ROOT,
                start_new_session=True,  # its own process group: signals don't hit pytest
            )
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.log_path} (tail) ---\n{text[-n:]}"

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (collectors flush and shut down cleanly), then SIGKILL."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        return p.returncode

    def __enter__(self) -> "ManagedProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------
# Jaeger


@dataclass
class JaegerServer:
    process: ManagedProcess
    otlp_grpc_port: int
    otlp_http_port: int
    query_http_port: int
    host: str = "127.0.0.1"
    query_grpc_port: int | None = None  # gRPC query API (api_v2 / api_v3 QueryService)

    @property
    def otlp_grpc_endpoint(self) -> str:  # host:port, as collector exporters want it
        return f"{self.host}:{self.otlp_grpc_port}"

    @property
    def otlp_http_endpoint(self) -> str:  # OTLP/HTTP base URL (POST {url}/v1/traces)
        return f"http://{self.host}:{self.otlp_http_port}"

    @property
    def query_url(self) -> str:
        return f"http://{self.host}:{self.query_http_port}"

    def get_trace(self, trace_id: str, raw: bool = False) -> dict | None:
        """OTLP-JSON ``{"resourceSpans": [...]}`` of a trace, or None (404).

        ``raw``: skip Jaeger's query-time adjusters (``raw_traces=true``). Poll with it
        while spans are still arriving: with memory storage the adjusters change the
        stored spans in place, so a query that sees a child before its parent leaves a
        ``@jaeger@warnings`` attribute ("parent span ID=... is not in the trace;
        skipping clock skew adjustment") on that span for good."""
        query = "?raw_traces=true" if raw else ""
        status, body = http_get(f"{self.query_url}/api/v3/traces/{trace_id}{query}")
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"Jaeger /api/v3/traces/{trace_id}: HTTP {status} {body[:300]!r}")
        return json.loads(body)["result"]

    def wait_for_trace(self, trace_id: str, min_spans: int = 1, timeout: float = 30.0, raw: bool = False) -> dict:
        """Poll until the trace has at least ``min_spans`` spans (``raw``: see get_trace)."""
        deadline = time.monotonic() + timeout
        found = 0
        while True:
            self.process.check_alive()
            trace = self.get_trace(trace_id, raw=raw)
            found = len(span_ids(trace)) if trace else 0
            if found >= min_spans:
                return trace
            if time.monotonic() > deadline:
                raise TimeoutError(f"trace {trace_id}: {found}/{min_spans} spans in Jaeger after {timeout}s")
            time.sleep(0.25)

    def services(self) -> list[str]:
        """HTTP API v3 GET /api/v3/services: the service names Jaeger has spans of."""
        return self._get_json("/api/v3/services")["services"]

    def operations(self, service: str) -> list[dict]:
        """HTTP API v3 GET /api/v3/operations: ``[{"name": ..., "spanKind": ...}]`` of a service."""
        return self._get_json(f"/api/v3/operations?{urllib.parse.urlencode({'service': service})}")["operations"]

    def _get_json(self, path: str) -> dict:
        status, body = http_get(f"{self.query_url}{path}")
        if status != 200:
            raise RuntimeError(f"Jaeger {path}: HTTP {status} {body[:300]!r}")
        return json.loads(body)

    # Searching. Jaeger v2.13 (module v1.76.0) answers searches from three APIs:
    # - HTTP API v3 GET /api/v3/traces: query.service_name, query.operation_name,
    #   query.start_time_min/max (RFC 3339, both required), query.num_traces (required
    #   in practice: the memory store rejects a search depth of 0 with HTTP 500),
    #   query.duration_min/max. It has NO attribute filter: the gateway builds the query
    #   with an empty attribute map and ignores any other parameter (query.attributes,
    #   query.attributes.<key>, ... all return unfiltered results).
    # - gRPC API v3 jaeger.api_v3.QueryService/FindTraces: TraceQueryParameters has
    #   map<string,string> attributes (matched against span, scope, resource and event
    #   attributes of any one span, values compared as strings).
    # - the legacy HTTP API GET /api/traces?service=S&tags={"k":"v"} (or tag=k:v).

    def find_traces(self, service: str, *, operation: str | None = None, lookback_s: float = 3600.0,
                    num_traces: int = 1000, extra: dict[str, str] | None = None) -> dict:
        """HTTP API v3 search; OTLP-JSON ``{"resourceSpans": [...]}`` (empty when none)."""
        params = {
            "query.service_name": service,
            "query.start_time_min": _rfc3339(datetime.now(timezone.utc) - timedelta(seconds=lookback_s)),
            "query.start_time_max": _rfc3339(datetime.now(timezone.utc) + timedelta(minutes=5)),
            "query.num_traces": str(num_traces),
        }
        if operation:
            params["query.operation_name"] = operation
        params.update(extra or {})
        status, body = http_get(f"{self.query_url}/api/v3/traces?{urllib.parse.urlencode(params)}")
        if status == 404:
            return {"resourceSpans": []}
        if status != 200:
            raise RuntimeError(f"Jaeger /api/v3/traces: HTTP {status} {body[:300]!r}")
        return json.loads(body)["result"]

    def find_traces_grpc(self, service: str, *, operation: str | None = None,
                         attributes: dict[str, str] | None = None, lookback_s: float = 3600.0,
                         num_traces: int = 1000, timeout: float = 30.0) -> dict:
        """gRPC API v3 FindTraces (with attribute filters); OTLP-JSON with hex ids."""
        import grpc
        from google.protobuf import json_format
        from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

        if self.query_grpc_port is None:
            raise RuntimeError("this JaegerServer was started without a known gRPC query port")
        request = _api_v3_find_traces_request_class()()
        query = request.query
        query.service_name = service
        if operation:
            query.operation_name = operation
        for key, value in (attributes or {}).items():
            query.attributes[key] = str(value)
        query.start_time_min.FromDatetime(datetime.now(timezone.utc) - timedelta(seconds=lookback_s))
        query.start_time_max.FromDatetime(datetime.now(timezone.utc) + timedelta(minutes=5))
        query.search_depth = num_traces
        merged = TracesData()
        with grpc.insecure_channel(f"{self.host}:{self.query_grpc_port}") as channel:
            call = channel.unary_stream(
                "/jaeger.api_v3.QueryService/FindTraces",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=TracesData.FromString,
            )
            try:
                for chunk in call(request, timeout=timeout):
                    merged.resource_spans.extend(chunk.resource_spans)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        return _ids_to_hex(json_format.MessageToDict(merged))

    def find_trace_ids_by_tags(self, service: str, tags: dict[str, str], *, operation: str | None = None,
                               lookback_s: float = 3600.0, limit: int = 1000) -> set[str]:
        """Legacy HTTP API search with a tag filter; the trace ids found."""
        now_us = int(time.time() * 1e6)
        params = {"service": service, "tags": json.dumps(tags), "limit": str(limit),
                  "start": str(now_us - int(lookback_s * 1e6)), "end": str(now_us + 300_000_000)}
        if operation:
            params["operation"] = operation
        status, body = http_get(f"{self.query_url}/api/traces?{urllib.parse.urlencode(params)}")
        if status != 200:
            raise RuntimeError(f"Jaeger /api/traces: HTTP {status} {body[:300]!r}")
        return {t["traceID"] for t in json.loads(body).get("data") or []}


def _rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@lru_cache(maxsize=None)
def _api_v3_find_traces_request_class():
    """``jaeger.api_v3.FindTracesRequest`` built at run time (Jaeger ships no Python
    stubs): the fields of jaeger-idl proto/api_v3/query_service.proto."""
    from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory, timestamp_pb2

    pool = descriptor_pool.DescriptorPool()
    for module in (timestamp_pb2, duration_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    F = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(
        name="otel_verl_tests/jaeger_api_v3.proto", package="jaeger.api_v3", syntax="proto3",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/duration.proto"],
    )
    q = f.message_type.add(name="TraceQueryParameters")
    entry = q.nested_type.add(name="AttributesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    for name, number, ftype, type_name in (
        ("service_name", 1, F.TYPE_STRING, None),
        ("operation_name", 2, F.TYPE_STRING, None),
        ("start_time_min", 4, F.TYPE_MESSAGE, ".google.protobuf.Timestamp"),
        ("start_time_max", 5, F.TYPE_MESSAGE, ".google.protobuf.Timestamp"),
        ("duration_min", 6, F.TYPE_MESSAGE, ".google.protobuf.Duration"),
        ("duration_max", 7, F.TYPE_MESSAGE, ".google.protobuf.Duration"),
        ("search_depth", 8, F.TYPE_INT32, None),
        ("raw_traces", 9, F.TYPE_BOOL, None),
    ):
        field_ = q.field.add(name=name, number=number, type=ftype, label=F.LABEL_OPTIONAL)
        if type_name:
            field_.type_name = type_name
    q.field.add(name="attributes", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                type_name=".jaeger.api_v3.TraceQueryParameters.AttributesEntry")
    r = f.message_type.add(name="FindTracesRequest")
    r.field.add(name="query", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                type_name=".jaeger.api_v3.TraceQueryParameters")
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("jaeger.api_v3.FindTracesRequest"))


def _ids_to_hex(traces: dict) -> dict:
    """protobuf JSON (base64 ids) -> OTLP/JSON (hex ids), in place."""
    import base64

    def hex_(value: str) -> str:
        return base64.b64decode(value).hex()

    for rs in traces.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = hex_(span[key])
                for link in span.get("links", []):
                    for key in ("traceId", "spanId"):
                        if link.get(key):
                            link[key] = hex_(link[key])
    return traces


def trace_ids(otlp_json: dict | None) -> set[str]:
    """Hex trace ids in an OTLP-JSON TracesData object."""
    return {s["traceId"] for s in flat_spans(otlp_json)}


def flat_spans(otlp_json: dict | None) -> list[dict]:
    """The spans of an OTLP-JSON TracesData object (a Jaeger answer, a file line) as the
    flat dicts ``otel_verl.exporters.otlp_json_file.spans_from_files`` returns."""
    from otel_verl.exporters.otlp_json_file import attributes_to_dict, flat_span

    out = []
    for rs in (otlp_json or {}).get("resourceSpans", []):
        resource = attributes_to_dict(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            scope = ss.get("scope", {}).get("name", "")
            out.extend(flat_span(s, resource, scope) for s in ss.get("spans", []))
    return out


def span_ids(otlp_json: dict | None) -> set[str]:
    """Hex span ids in an OTLP-JSON TracesData object."""
    out = set()
    for rs in (otlp_json or {}).get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            out.update(s["spanId"] for s in ss.get("spans", []))
    return out


def start_jaeger(workdir: Path, config: Path | None = None) -> JaegerServer:
    """Start Jaeger on free loopback ports with collector-config/jaeger.yaml
    (ports set through its env variables) or another config; wait until its
    query API answers."""
    binary = require_binary("jaeger")
    grpc, http, q_http, q_grpc, health = free_ports(5)
    env = {
        "JAEGER_LISTEN_HOST": "127.0.0.1",
        "JAEGER_OTLP_GRPC_PORT": str(grpc),
        "JAEGER_OTLP_HTTP_PORT": str(http),
        "JAEGER_QUERY_HTTP_PORT": str(q_http),
        "JAEGER_QUERY_GRPC_PORT": str(q_grpc),
        "JAEGER_HEALTH_PORT": str(health),
    }
    cfg = config or CONFIG_DIR / "jaeger.yaml"
    proc = ManagedProcess([binary, "--config", str(cfg)], workdir / "jaeger.log", env).start()
    server = JaegerServer(proc, grpc, http, q_http, query_grpc_port=q_grpc)
    try:
        wait_for_http(f"{server.query_url}/api/v3/services", timeout=60, proc=proc)
        wait_for_port("127.0.0.1", grpc, timeout=30, proc=proc)
    except BaseException:
        proc.stop()
        raise
    return server


# --------------------------------------------------------------------------
# Collector


@dataclass
class Collector:
    process: ManagedProcess
    grpc_port: int
    http_port: int
    env: dict[str, str]

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def start_otelcol(config: Path, workdir: Path, env: dict[str, str] | None = None,
                  wait: bool = True) -> Collector:
    """Start otelcol with ``config``; its OTLP receivers and its Prometheus endpoint on free
    loopback ports (OTELCOL_GRPC_ENDPOINT / OTELCOL_HTTP_ENDPOINT /
    OTELCOL_PROMETHEUS_ENDPOINT: collectors started side by side must not share the
    configs' default :8889), plus ``env`` overrides."""
    binary = require_binary("otelcol")
    grpc, http, prometheus = free_ports(3)
    full_env = {
        "OTELCOL_GRPC_ENDPOINT": f"127.0.0.1:{grpc}",
        "OTELCOL_HTTP_ENDPOINT": f"127.0.0.1:{http}",
        "OTELCOL_PROMETHEUS_ENDPOINT": f"127.0.0.1:{prometheus}",
        **(env or {}),
    }
    proc = ManagedProcess([binary, "--config", str(config)],
                          workdir / f"otelcol-{Path(config).stem}.log", full_env).start()
    col = Collector(proc, grpc, http, full_env)
    if wait:
        try:
            wait_for_port("127.0.0.1", http, timeout=30, proc=proc)
            wait_for_port("127.0.0.1", grpc, timeout=30, proc=proc)
        except BaseException:
            proc.stop()
            raise
    return col


# --------------------------------------------------------------------------
# Fixtures (import them into a test module or conftest.py)


@pytest.fixture
def jaeger_server(tmp_path):
    """A fresh Jaeger (memory storage) on free loopback ports."""
    server = start_jaeger(tmp_path)
    yield server
    server.process.stop()


@pytest.fixture
def otelcol_factory(tmp_path):
    """``start(config, env=None) -> Collector``; all are stopped at teardown."""
    with ExitStack() as stack:
        def start(config, env=None, wait=True):
            col = start_otelcol(Path(config), tmp_path, env, wait)
            stack.callback(col.process.stop)
            return col
        yield start
