"""``otel-verl replay``: send OTLP-JSON files to a collector, Jaeger or Tempo over OTLP/HTTP.

Each line of an otel_verl ``{trace_dir}/otlp/*.jsonl`` file (or of the Collector file
exporter's output, the same format) is one ``{"resourceSpans": [...]}`` export request.
It is POSTed to ``{endpoint}/v1/traces`` as is (``application/json``: OTLP/JSON uses hex
ids), or as protobuf (``application/x-protobuf``) after
:func:`otel_verl.exporters.otlp_json_file.to_protobuf_json` and protobuf's ``ParseDict``.
5xx / 429 answers and connection errors are retried with exponential backoff; any other
answer fails the line. Every file is read and checked before the first request, so bad
input sends nothing.

    from otel_verl.tools.replay import replay
    result = replay(["/data/trace"], "http://localhost:4318")
    assert result.lines_failed == 0
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from otel_verl.exporters.otlp_json_file import to_protobuf_json
from otel_verl.tools.report.inputs import InputError, Lines, count_spans, iter_lines, resolve

PROTOCOLS = ("json", "protobuf")
_CONTENT_TYPE = {"json": "application/json", "protobuf": "application/x-protobuf"}
_RETRY_STATUS = (429, 502, 503, 504)  # and every other 5xx


@dataclass
class ReplayResult:
    url: str
    files: int = 0
    lines: int = 0
    spans: int = 0
    lines_sent: int = 0
    spans_sent: int = 0
    lines_failed: int = 0
    spans_failed: int = 0
    spans_rejected: int = 0  # accepted requests whose partial_success rejected spans
    retries: int = 0
    truncated: List[Tuple[str, int]] = field(default_factory=list)  # (path, bytes) skipped
    errors: List[str] = field(default_factory=list)  # first few failure messages

    @property
    def ok(self) -> bool:
        return self.lines_failed == 0 and self.spans_rejected == 0


def traces_url(endpoint: str) -> str:
    """``{endpoint}/v1/traces`` (an endpoint already ending in ``/v1/traces`` is kept)."""
    parsed = urllib.parse.urlsplit(endpoint.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InputError(f"--endpoint {endpoint!r}: expected an OTLP/HTTP URL such as http://localhost:4318")
    path = parsed.path.rstrip("/")
    if not path.endswith("/v1/traces"):
        path += "/v1/traces"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, parsed.query, ""))


def encode(obj: Dict[str, Any], protocol: str) -> bytes:
    if protocol == "json":
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    message = json_format.ParseDict(to_protobuf_json(obj), ExportTraceServiceRequest())
    return message.SerializeToString()


def _rejected_spans(body: bytes, content_type: str) -> Tuple[int, str]:
    """``partial_success`` of an ExportTraceServiceResponse: (rejected spans, message)."""
    if not body:
        return 0, ""
    try:
        if "json" in content_type:
            partial = json.loads(body).get("partialSuccess") or {}
            return int(partial.get("rejectedSpans") or 0), str(partial.get("errorMessage") or "")
        if "protobuf" in content_type:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

            response = ExportTraceServiceResponse.FromString(body)
            return response.partial_success.rejected_spans, response.partial_success.error_message
    except Exception:
        pass  # an answer we cannot read is not a rejection
    return 0, ""


def post(url: str, body: bytes, content_type: str, headers: Mapping[str, str], timeout: float) -> Tuple[int, bytes, str]:
    """One POST: ``(status, body, content type)``; raises OSError on connection errors."""
    request = urllib.request.Request(url, data=body, method="POST", headers={**headers, "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(), exc.headers.get("Content-Type", "") if exc.headers else ""


def _send(url: str, body: bytes, content_type: str, headers: Mapping[str, str], *, timeout: float, retries: int,
          backoff: float, result: ReplayResult, sleep: Callable[[float], None]) -> Tuple[bool, str, bytes, str]:
    """POST with retries: ``(ok, error message, response body, response content type)``."""
    error = ""
    for attempt in range(retries + 1):
        if attempt:
            result.retries += 1
            sleep(min(backoff * 2 ** (attempt - 1), 30.0))
        try:
            status, answer, answer_type = post(url, body, content_type, headers, timeout)
        except OSError as exc:  # refused, reset, DNS, timeout (URLError is an OSError)
            error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            continue
        if 200 <= status < 300:
            return True, "", answer, answer_type
        error = f"HTTP {status}: {answer[:200].decode('utf-8', 'replace').strip()}"
        if status not in _RETRY_STATUS and status < 500:
            break  # the request itself is wrong: retrying would not help
    return False, error, b"", ""


def replay(
    paths: Sequence[str],
    endpoint: str,
    *,
    protocol: str = "json",
    headers: Optional[Mapping[str, str]] = None,
    timeout: float = 10.0,
    retries: int = 5,
    backoff: float = 0.5,
    progress: Optional[bool] = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ReplayResult:
    """Send every line of the OTLP-JSON files under ``paths``; never raises for a line that
    could not be sent (it is counted in the result). :class:`InputError` for bad input."""
    if protocol not in PROTOCOLS:
        raise InputError(f"protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    url = traces_url(endpoint)
    files = resolve(paths).otlp_files
    result = ReplayResult(url=url, files=len(files))
    # first pass: check every line (bad input sends nothing) and count for the progress bar
    checked = Lines()
    for _, _, obj in iter_lines(files, checked):
        result.spans += count_spans(obj)
    result.lines = checked.lines
    result.truncated = [(t.path, t.size) for t in checked.truncated]
    if not result.lines:
        raise InputError(f"nothing to send: no OTLP-JSON lines in {', '.join(paths)}")

    from tqdm import tqdm

    headers = dict(headers or {})
    content_type = _CONTENT_TYPE[protocol]
    bar = tqdm(total=result.spans, unit="span", desc="replay", disable=None if progress is None else not progress)
    try:
        for path, number, obj in iter_lines(files, Lines()):
            n = count_spans(obj)
            ok, error, answer, answer_type = _send(
                url, encode(obj, protocol), content_type, headers,
                timeout=timeout, retries=retries, backoff=backoff, result=result, sleep=sleep,
            )
            if ok:
                result.lines_sent += 1
                result.spans_sent += n
                rejected, message = _rejected_spans(answer, answer_type)
                if rejected:
                    result.spans_rejected += rejected
                    error = f"{path}:{number}: {rejected} span(s) rejected by the receiver: {message}"
            else:
                result.lines_failed += 1
                result.spans_failed += n
                error = f"{path}:{number}: {error}"
            if error and len(result.errors) < 5:
                result.errors.append(error)
            bar.update(n)
    finally:
        bar.close()
    return result
