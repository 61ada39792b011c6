"""OTLP receivers with scripted answers for the exporter's transport tests, run as a
separate process (a gRPC server in the pytest process would share it with the fork-based
tests).

``python otlp_receivers.py CONFIG_JSON`` listens on a free loopback port, prints
``PORT <n>`` and serves until killed. The config:

- ``protocol``: ``http`` or ``grpc``;
- ``answers``: what to answer, request after request (the last one then on): HTTP
  ``{"status": 503, "headers": {...}, "body_hex": ""}``; gRPC ``{"code": "UNAVAILABLE",
  "details": "...", "retry_delay_s": 0.1}`` or ``{"code": "OK", "body_hex": ""}``;
  ``{"silent": true}``: never answer (the request is still captured);
- ``capture``: a file each request is appended to as a JSON line (``path``,
  ``headers``: lowercased names, ``body_hex``: as received, still compressed);
- ``tls``: ``{"cert": ..., "key": ..., "client_ca": ...}`` (PEM files; ``client_ca``:
  clients must present a certificate it signed).
"""

from __future__ import annotations

import http.server
import json
import socketserver
import ssl
import sys
import threading
import time
from typing import Any, Dict


class Script:
    """The answers, one per request, and the capture file."""

    def __init__(self, config: Dict[str, Any]) -> None:
        self.answers = config["answers"]
        self.capture = config["capture"]
        self.count = 0
        self.lock = threading.Lock()

    def next(self, path: str, headers: Dict[str, str], body: bytes) -> Dict[str, Any]:
        with self.lock:
            answer = self.answers[min(self.count, len(self.answers) - 1)]
            self.count += 1
            with open(self.capture, "a", encoding="utf-8") as f:
                f.write(json.dumps({"path": path, "headers": headers, "body_hex": body.hex(), "t": time.time()})
                        + "\n")
        return answer


def _announce(port: int) -> None:
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()


def serve_http(config: Dict[str, Any], script: Script) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = script.next(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            if answer.get("silent"):
                time.sleep(3600)
                return
            payload = bytes.fromhex(answer.get("body_hex", ""))
            self.send_response(answer.get("status", 200))
            for name, value in answer.get("headers", {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", self.headers.get("Content-Type") or "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    tls = config.get("tls")
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls["cert"], tls["key"])
        if tls.get("client_ca"):
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(tls["client_ca"])
        server.socket = context.wrap_socket(server.socket, server_side=True)
    _announce(server.server_address[1])
    server.serve_forever()


def serve_grpc(config: Dict[str, Any], script: Script) -> None:
    from concurrent import futures

    import grpc

    def export(request: bytes, context: Any) -> bytes:
        metadata = {key.lower(): value for key, value in context.invocation_metadata()}
        answer = script.next("/opentelemetry.proto.collector.trace.v1.TraceService/Export", metadata, request)
        if answer.get("silent"):
            time.sleep(3600)
        code = answer.get("code", "OK")
        if code != "OK":
            if answer.get("retry_delay_s") is not None:
                from google.protobuf.duration_pb2 import Duration
                from google.rpc.error_details_pb2 import RetryInfo

                delay = answer["retry_delay_s"]
                info = RetryInfo(retry_delay=Duration(seconds=int(delay), nanos=int(delay % 1 * 1e9)))
                context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
            context.abort(getattr(grpc.StatusCode, code), answer.get("details", "scripted"))
        return bytes.fromhex(answer.get("body_hex", ""))

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export, request_deserializer=lambda b: b,
                                                       response_serializer=lambda b: b)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handler,))
    tls = config.get("tls")
    if tls:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_server_credentials(
            [(read(tls["key"]), read(tls["cert"]))],
            root_certificates=read(tls["client_ca"]) if tls.get("client_ca") else None,
            require_client_auth=bool(tls.get("client_ca")))
        port = server.add_secure_port("127.0.0.1:0", credentials)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _announce(port)
    while True:
        time.sleep(3600)


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        config = json.load(f)
    script = Script(config)
    (serve_grpc if config["protocol"] == "grpc" else serve_http)(config, script)


if __name__ == "__main__":
    main()
