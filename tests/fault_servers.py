"""Misbehaving OTLP endpoints for the fault tests, run as a separate process.

``python fault_servers.py MODE [CAPTURE_FILE]`` listens on a free loopback port, prints
``PORT <n>`` and serves until killed. Kept out of the pytest process: a gRPC server there
would share the process with the fork-based tests.

Modes:
- ``silent``: accepts TCP connections and never answers (slow endpoint).
- ``close``: accepts and closes every connection at once (refusing).
- ``http503``: answers every HTTP request with 503 Service Unavailable (refusing).
- ``http200``: a plain-HTTP server answering 200 (TLS clients fail the handshake).
- ``grpc_unavailable``: a gRPC server whose TraceService/Export aborts with UNAVAILABLE.
- ``tls``: a TLS (self-signed) HTTP server answering 200; plain clients fail the handshake.
- ``capture``: an OTLP/HTTP receiver answering 200 that appends each request body to
  CAPTURE_FILE (length-prefixed) so a test can grep every byte that left the process.
- ``grpc_capture``: the same as an OTLP/gRPC receiver (gRPC's default 4 MiB message limit).
"""

from __future__ import annotations

import http.server
import os
import socket
import socketserver
import ssl
import struct
import sys
import tempfile
import threading
import time


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _announce(port: int) -> None:
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()


def serve_silent() -> None:
    sock = _listen()
    _announce(sock.getsockname()[1])
    held = []
    while True:
        conn, _ = sock.accept()
        held.append(conn)  # never read, never answer, never close


def serve_close() -> None:
    sock = _listen()
    _announce(sock.getsockname()[1])
    while True:
        conn, _ = sock.accept()
        conn.close()


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler(status: int, capture: str | None = None):
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if capture:
                with lock, open(capture, "ab") as f:
                    f.write(struct.pack(">I", len(body)) + body)
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    return Handler


def serve_http(status: int, capture: str | None = None, tls: bool = False) -> None:
    server = _Server(("127.0.0.1", 0), _handler(status, capture))
    if tls:
        cert, key = _self_signed()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    _announce(server.server_address[1])
    server.serve_forever()


def _self_signed() -> tuple:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256())
    )
    directory = tempfile.mkdtemp()
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def serve_grpc(export) -> None:
    """A gRPC TraceService whose Export is ``export(request bytes, context)``; the
    receive limit is gRPC's default 4 MiB, as the Collector's."""
    from concurrent import futures

    import grpc

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export, request_deserializer=lambda b: b,
                                                       response_serializer=lambda b: b)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _announce(port)
    while True:
        time.sleep(3600)


def serve_grpc_unavailable() -> None:
    import grpc

    def export(request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "collector overloaded")

    serve_grpc(export)


def serve_grpc_capture(capture: str) -> None:
    lock = threading.Lock()

    def export(request: bytes, context) -> bytes:
        with lock, open(capture, "ab") as f:
            f.write(struct.pack(">I", len(request)) + request)
        return b""  # an empty ExportTraceServiceResponse: all accepted

    serve_grpc(export)


def main() -> None:
    mode = sys.argv[1]
    capture = sys.argv[2] if len(sys.argv) > 2 else None
    if mode == "silent":
        serve_silent()
    elif mode == "close":
        serve_close()
    elif mode == "http503":
        serve_http(503)
    elif mode == "http200":
        serve_http(200)
    elif mode == "tls":
        try:
            import cryptography  # noqa: F401
        except ImportError:
            sys.stdout.write("SKIP cryptography not installed\n")
            sys.stdout.flush()
            sys.exit(0)
        serve_http(200, tls=True)
    elif mode == "capture":
        serve_http(200, capture=capture)
    elif mode == "grpc_unavailable":
        serve_grpc_unavailable()
    elif mode == "grpc_capture":
        serve_grpc_capture(capture)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
