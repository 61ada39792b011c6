"""``otel-verl replay``: send OTLP-JSON files to a collector, Jaeger or Tempo over OTLP/HTTP.

Each line of an otel_verl ``{trace_dir}/otlp/*.jsonl`` file (or of the Collector file
exporter's output, the same format) is one ``{"resourceSpans": [...]}`` export request.
It is POSTed to ``{endpoint}/v1/traces`` as is (``application/json``: OTLP/JSON uses hex
ids), or as protobuf (``application/x-protobuf``) after
:func:`otel_verl.exporters.otlp_json_file.to_protobuf_json` and protobuf's ``ParseDict``.
Every file is read and checked before the first request, so bad input sends nothing; text
that is not well-formed UTF-8 is sent as U+FFFD and counted (``repaired``).

One deadline covers the whole replay (``timeout``, 60 s by default): 5xx / 429 answers and
lost connections are retried with exponential backoff within it, any other answer fails
the line, and what is left when it passes is not sent. A connection refused (or a host
that does not resolve) before any line was sent stops the replay at once: the endpoint is
wrong or down, and waiting would only hide it. What was not sent is named by file and line
(:meth:`ReplayResult.unsent_text`). Progress goes to stderr: a bar on a terminal, else a
line every few seconds and after each file.

    from otel_verl.tools.replay import replay
    result = replay(["/data/trace"], "http://localhost:4318")
    assert result.ok, result.unsent_text()
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from otel_verl.exporters.otlp_json_file import to_protobuf_json
from otel_verl.tools.report.inputs import InputError, Lines, count_spans, iter_lines, resolve

PROTOCOLS = ("json", "protobuf")
DEADLINE_S = 60.0  # the whole replay, retries included
REQUEST_TIMEOUT_S = 10.0  # one request, within the deadline
PROGRESS_EVERY_S = 5.0  # a progress line without a terminal
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
    lines_failed: int = 0  # not sent: refused by the receiver, or not tried after a stop
    spans_failed: int = 0
    spans_rejected: int = 0  # accepted requests whose partial_success rejected spans
    retries: int = 0
    truncated: List[Tuple[str, int]] = field(default_factory=list)  # (path, bytes) skipped
    repaired: List[Tuple[str, int]] = field(default_factory=list)  # (path, characters sent as U+FFFD)
    skipped: List[Tuple[str, str]] = field(default_factory=list)  # (path, what it is): no file to read
    errors: List[str] = field(default_factory=list)  # first few failure messages
    unsent: Dict[str, List[int]] = field(default_factory=dict)  # path -> numbers of the lines not sent
    stopped: str = ""  # why the lines after some point were not tried ("" when all were)

    @property
    def ok(self) -> bool:
        return self.lines_failed == 0 and self.spans_rejected == 0

    def unsent_text(self, files: int = 3) -> str:
        """The lines not sent, by file: ``a.jsonl lines 1-9, 12; b.jsonl line 3``."""
        parts = [f"{path} {_ranges(numbers)}" for path, numbers in list(self.unsent.items())[:files]]
        if len(self.unsent) > files:
            parts.append(f"and lines of {len(self.unsent) - files} more file(s)")
        return "; ".join(parts)


def _ranges(numbers: List[int]) -> str:
    spans: List[List[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)
    return ("line " if len(numbers) == 1 else "lines ") + text


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


def _cannot_connect(exc: OSError) -> bool:
    """A connection refused or a host that does not resolve: no retry makes it answer soon."""
    reason = getattr(exc, "reason", exc)  # urllib wraps it in a URLError
    return isinstance(reason, (ConnectionRefusedError, socket.gaierror))


def _describe(exc: OSError) -> str:
    reason = getattr(exc, "reason", exc)  # urllib wraps it in a URLError
    if isinstance(reason, OSError):
        return f"{type(reason).__name__}: {reason.strerror or reason}"
    return f"{type(exc).__name__}: {reason}"


class _Stop(Exception):
    """Nothing more is to be tried: the deadline passed, or the endpoint refuses connections."""


class _Sender:
    """POSTs lines with retries, all within one deadline."""

    def __init__(self, url: str, content_type: str, headers: Mapping[str, str], *, deadline_s: float,
                 request_timeout: float, retries: int, backoff: float, result: ReplayResult,
                 sleep: Callable[[float], None], clock: Callable[[], float],
                 on_retry: Callable[[str, float], None]) -> None:
        self.url, self.content_type, self.headers = url, content_type, dict(headers)
        self.deadline_s, self.request_timeout = deadline_s, request_timeout
        self.retries, self.backoff = retries, backoff
        self.result, self.sleep, self.clock, self.on_retry = result, sleep, clock, on_retry
        self.ends_at = clock() + deadline_s

    def _left(self) -> float:
        left = self.ends_at - self.clock()
        if left <= 0:
            raise _Stop(f"the deadline of {self.deadline_s:g} s (--timeout) passed")
        return left

    def send(self, body: bytes) -> Tuple[bool, str, bytes, str]:
        """``(ok, error message, response body, response content type)``; :class:`_Stop`."""
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.result.retries += 1
                delay = min(self.backoff * 2 ** (attempt - 1), 30.0, self._left())
                self.on_retry(error, delay)
                self.sleep(delay)
            try:
                status, answer, answer_type = post(self.url, body, self.content_type, self.headers,
                                                   min(self.request_timeout, self._left()))
            except OSError as exc:  # refused, reset, DNS, timeout (URLError is an OSError)
                error = _describe(exc)
                if not self.result.lines_sent and _cannot_connect(exc):
                    raise _Stop(f"cannot connect ({error}) and nothing was sent yet: is the collector running "
                                "and listening there?") from None
                continue
            if 200 <= status < 300:
                return True, "", answer, answer_type
            error = f"HTTP {status}: {answer[:200].decode('utf-8', 'replace').strip()}"
            if status not in _RETRY_STATUS and status < 500:
                break  # the request itself is wrong: retrying would not help
        return False, error, b"", ""


class _Progress:
    """What is sent so far, on stderr: tqdm's bar on a terminal, else a line every
    :data:`PROGRESS_EVERY_S` seconds and after each file (a log shows the replay is alive)."""

    def __init__(self, result: ReplayResult, shown: Optional[bool], clock: Callable[[], float]) -> None:
        self.result, self.clock = result, clock
        self.bar = None
        self.lines = False
        if shown is not False:
            if sys.stderr.isatty():
                from tqdm import tqdm

                self.bar = tqdm(total=result.spans, unit="span", desc="replay", file=sys.stderr)
            else:
                self.lines = True
        self.started = self.said = clock()

    def _say(self, text: str) -> None:
        self.said = self.clock()
        print(f"replay: {text}", file=sys.stderr, flush=True)

    def start(self) -> None:
        r = self.result
        if self.lines:
            self._say(f"sending {r.spans} spans ({r.lines} lines, {r.files} files) to {r.url}")

    def line_done(self, spans: int) -> None:
        if self.bar is not None:
            self.bar.update(spans)
        elif self.lines and self.clock() - self.said >= PROGRESS_EVERY_S:
            self._say(self._status())

    def retry(self, error: str, delay: float) -> None:
        if self.lines and self.clock() + delay - self.said >= PROGRESS_EVERY_S:  # said before a long wait
            self._say(f"{self._status()}; retrying a line in {delay:.1f} s after {error}")

    def file_done(self, path: str) -> None:
        if self.lines and self.clock() - self.said >= 1.0:  # many small files: at most a line a second
            self._say(f"{self._status()}; done with {path}")

    def _status(self) -> str:
        r = self.result
        failed = f", {r.lines_failed} failed" if r.lines_failed else ""
        return (f"{r.spans_sent} of {r.spans} spans sent ({r.lines_sent} of {r.lines} lines{failed}) "
                f"in {self.clock() - self.started:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def replay(
    paths: Sequence[str],
    endpoint: str,
    *,
    protocol: str = "json",
    headers: Optional[Mapping[str, str]] = None,
    timeout: float = DEADLINE_S,
    request_timeout: float = REQUEST_TIMEOUT_S,
    retries: int = 5,
    backoff: float = 0.5,
    progress: Optional[bool] = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ReplayResult:
    """Send every line of the OTLP-JSON files under ``paths`` within ``timeout`` seconds;
    never raises for a line that could not be sent (it is counted in the result, and named
    in ``unsent``). :class:`InputError` for bad input. ``progress``: ``False`` shows none."""
    if protocol not in PROTOCOLS:
        raise InputError(f"protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    url = traces_url(endpoint)
    inputs = resolve(paths)
    files = inputs.otlp_files
    result = ReplayResult(url=url, files=len(files), skipped=list(inputs.skipped))
    # first pass: check every line (bad input sends nothing) and count for the progress
    checked = Lines()
    for path, number, obj in iter_lines(files, checked):
        try:
            result.spans += count_spans(obj)
        except (AttributeError, TypeError) as exc:
            raise InputError(f"{path}:{number}: malformed OTLP-JSON ({type(exc).__name__}: {exc})") from None
    result.lines = checked.lines
    result.truncated = [(t.path, t.size) for t in checked.truncated]
    result.repaired = list(checked.repaired.items())
    if not result.lines:
        raise InputError(f"nothing to send: no OTLP-JSON lines in {', '.join(paths)}")

    shown = _Progress(result, progress, clock)
    sender = _Sender(url, _CONTENT_TYPE[protocol], headers or {}, deadline_s=timeout, request_timeout=request_timeout,
                     retries=retries, backoff=backoff, result=result, sleep=sleep, clock=clock, on_retry=shown.retry)
    shown.start()
    lines = iter_lines(files, Lines())
    try:
        current = None
        for path, number, obj in lines:
            if current is not None and path != current:
                shown.file_done(current)
            current = path
            n = count_spans(obj)
            try:
                body = encode(obj, protocol)
            except Exception as exc:  # protobuf's ParseError on data JSON lets through
                ok, error, answer, answer_type = False, f"cannot encode as {protocol}: {type(exc).__name__}: {exc}", b"", ""
            else:
                ok, error, answer, answer_type = sender.send(body)
            if ok:
                result.lines_sent += 1
                result.spans_sent += n
                rejected, message = _rejected_spans(answer, answer_type)
                if rejected:
                    result.spans_rejected += rejected
                    error = f"{path}:{number}: {rejected} span(s) rejected by the receiver: {message}"
            else:
                _not_sent(result, path, number, n)
                error = f"{path}:{number}: {error}"
            if error and len(result.errors) < 5:
                result.errors.append(error)
            shown.line_done(n)
    except _Stop as stop:
        result.stopped = str(stop)
        _not_sent(result, path, number, n)
        for path, number, obj in lines:  # the rest, counted and named
            _not_sent(result, path, number, count_spans(obj))
    finally:
        shown.close()
    return result


def _not_sent(result: ReplayResult, path: str, number: int, spans: int) -> None:
    result.lines_failed += 1
    result.spans_failed += spans
    result.unsent.setdefault(path, []).append(number)
