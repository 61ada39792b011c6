"""``otel-verl report`` (text, ``--json``, ``--png``, ``--perfetto``, ``--compare``) and
``replay`` on hostile input, and ``replay`` against endpoints that refuse or fail.

The commands run as a user runs them: a subprocess of the CLI whose stdout is strict UTF-8
(``PYTHONIOENCODING``), as on a UTF-8 terminal, with a timeout (a FIFO read would block for
ever). The runs are synthetic OTLP-JSON files (``otlp_runs``); replay posts to a local HTTP
receiver in this process, or to a closed port."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

import pytest

from otlp_runs import TRAINER, otlp_attributes, straggler_run, timing

try:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2  # noqa: F401
    PERFETTO_LOADS = True
except Exception:  # the lowest-versions venv: protobuf 5, older than perfetto's code
    PERFETTO_LOADS = False
NEEDS_PERFETTO = pytest.mark.skipif(not PERFETTO_LOADS, reason="the perfetto package needs a newer protobuf runtime")

SURROGATES = ("\udc80", "\ud800", "\udfff", "\ud83d")  # lone: a low, a high, the last, half an emoji
NOT_UTF8_NAME = os.fsdecode(b"spans-\xff.jsonl")  # a file name that is not UTF-8 (surrogateescape)


def otel_verl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(PYTHONIOENCODING="utf-8:strict", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "otel_verl.tools.cli", *args], capture_output=True, text=True,
                          encoding="utf-8", errors="surrogateescape", timeout=timeout, env=env)


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def stderr_lines(proc: subprocess.CompletedProcess, prefix: str = "") -> List[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith(prefix) and line.strip()]


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert_no_traceback(proc)
    errors = stderr_lines(proc, "Error: ")
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# --------------------------------------------------------------------------- hostile runs


def hostile_run(directory) -> Dict[str, Any]:
    """A sync run with lone surrogates in every kind of text a span carries: the slowest
    trajectory's uid and traj (the text report shows them), a replica id, a span's name,
    attribute keys and values, resource, scope, events, links and status; a line whose
    surrogate is raw bytes, one with bytes that are not UTF-8; a second file whose name is
    not UTF-8. Returns the trace dir and, per file, how many characters UTF-8 cannot carry."""
    run = straggler_run()
    a, b, c, d = SURROGATES
    uid, traj = f"slow-{a}", f"t{b}"
    root = run.sample(uid, 0, 19, trained_in=1)
    run.trajectory(root, traj, 1, 1, 15, [{"at": (1.1, 14), "server": (1.2, 13, f"replica-{c}", timing(11, 1, 3))}],
                   tool=(14, 14.5))
    span = run.span(a, 3, 4, {f"key-{b}": f"value-{c}", "list": [d, "ok"]},
                    resource={**TRAINER, f"host.{a}": f"h{b}-{c}"})
    span["events"] = [{"name": f"event-{c}", "timeUnixNano": span["startTimeUnixNano"],
                       "attributes": otlp_attributes({f"e-{d}": f"v-{a}"})}]
    span["links"] = [{"traceId": span["traceId"], "spanId": span["spanId"], "attributes": otlp_attributes({"l": b})}]
    span["status"] = {"code": 2, "message": f"failed-{c}"}
    trace_dir = run.write(str(directory))
    spans_file = os.path.join(trace_dir, "otlp", "spans.jsonl")
    with open(spans_file, "rb") as f:  # what UTF-8 cannot carry: the surrogates json.loads reads back
        planted = sum(1 for line in f for text in texts_of(json.loads(line)) for ch in text if 0xD800 <= ord(ch) <= 0xDFFF)
    assert planted >= 20
    raw = {"resourceSpans": [{"resource": {"attributes": otlp_attributes({"service.name": "raw"})},
                              "scopeSpans": [{"scope": {"name": "raw"}, "spans": [{
                                  "traceId": "%032x" % 0xBAD, "spanId": "%016x" % 0xBAD, "name": "RAW",
                                  "kind": 1, "startTimeUnixNano": "1700000001000000000",
                                  "endTimeUnixNano": "1700000002000000000"}]}]}]}
    with open(spans_file, "ab") as f:
        # a surrogate as raw bytes (json.loads reads bytes with surrogatepass); two bytes that are not UTF-8
        f.write(json.dumps(raw).encode().replace(b'"RAW"', b'"raw-\xed\xb2\x80"') + b"\n")
        raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"] = "%016x" % 0xBAD2
        f.write(json.dumps(raw).encode().replace(b'"RAW"', b'"bad-\xff\xfe"') + b"\n")
    other = {"resourceSpans": [{"resource": {"attributes": otlp_attributes({"service.name": f"other-{a}"})},
                                "scopeSpans": [{"spans": [{
                                    "traceId": "%032x" % 0xD0C, "spanId": "%016x" % 0xD0C, "name": "ok",
                                    "startTimeUnixNano": "1700000001000000000",
                                    "endTimeUnixNano": "1700000002000000000"}]}]}]}
    other_file = os.path.join(trace_dir, "otlp", NOT_UTF8_NAME)
    with open(other_file, "w", encoding="utf-8") as f:
        f.write(json.dumps(other) + "\n")
    return {"dir": trace_dir, "uid": uid, "traj": traj,
            "repairs": {spans_file: planted + 1 + 2, other_file: 1}}


def texts_of(value: Any) -> List[str]:
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in [k] + texts_of(v)]
    if isinstance(value, list):
        return [t for v in value for t in texts_of(v)]
    return [value] if isinstance(value, str) else []


def lone_surrogates(value: Any) -> List[str]:
    """Every text in a parsed JSON value that UTF-8 cannot carry."""
    return [t for t in texts_of(value) if any(0xD800 <= ord(ch) <= 0xDFFF for ch in t)]


def _repaired(text: str) -> str:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return hostile_run(tmp_path_factory.mktemp("hostile") / "run")


def _said_repaired(proc: subprocess.CompletedProcess) -> Dict[str, int]:
    said = (re.match(r"warning: (.*): (\d+) character\(s\) not well-formed UTF-8", line)
            for line in stderr_lines(proc, "warning: "))
    return {m.group(1): int(m.group(2)) for m in said if m}


def assert_repaired_and_said(proc: subprocess.CompletedProcess, run: Dict[str, Any]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert _said_repaired(proc) == {_repaired(path): n for path, n in run["repairs"].items()}, proc.stderr


def test_report_text_shows_lone_surrogates_as_replacement_characters(hostile):
    proc = otel_verl("report", hostile["dir"])
    assert_repaired_and_said(proc, hostile)
    assert f"{_repaired(hostile['uid'])}/{_repaired(hostile['traj'])}" in proc.stdout


def test_report_json_holds_no_lone_surrogate_from_the_spans(hostile):
    proc = otel_verl("report", hostile["dir"], "--json")
    assert_repaired_and_said(proc, hostile)
    data = json.loads(proc.stdout)
    # the file name is the one text kept as the system gave it (a name that is not UTF-8)
    assert set(lone_surrogates(data)) == {os.path.join(hostile["dir"], "otlp", NOT_UTF8_NAME)}
    assert data["inputs"]["repaired"] == sum(hostile["repairs"].values())
    slowest = data["slowest_trajectories"][0]
    assert (slowest["uid"], slowest["traj_uid"]) == (_repaired(hostile["uid"]), _repaired(hostile["traj"]))


def test_report_png_and_compare_read_lone_surrogates(hostile, tmp_path):
    png = str(tmp_path / "timeline.png")
    proc = otel_verl("report", hostile["dir"], "--png", png)
    assert_repaired_and_said(proc, hostile)
    assert os.path.getsize(png) > 0
    proc = otel_verl("report", "--compare", hostile["dir"], hostile["dir"], "--png", str(tmp_path / "compare.png"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len([line for line in stderr_lines(proc, "warning: ") if "not well-formed UTF-8" in line]) == 4


def test_an_output_file_name_that_is_not_utf8_is_printed(hostile, tmp_path):
    png = os.path.join(str(tmp_path), os.fsdecode(b"timeline-\xff.png"))
    proc = otel_verl("report", hostile["dir"], "--png", png)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"timeline: {_repaired(png)}" in proc.stdout
    assert os.path.exists(png)


def test_loss_file_names_with_lone_surrogates_are_shown_with_replacement_characters(tmp_path):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    os.makedirs(os.path.join(trace_dir, "losses"))
    with open(os.path.join(trace_dir, "losses", "losses-host-pid1.json"), "w", encoding="utf-8") as f:
        json.dump({"dropped": {f"otlp{SURROGATES[0]}": 3}, "failures": {f"x{SURROGATES[1]}": 1}, "final": True}, f)
    proc = otel_verl("report", trace_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dropped otlp\ufffd=3; failures x\ufffd=1" in proc.stdout
    proc = otel_verl("report", trace_dir, "--json")
    assert json.loads(proc.stdout)["losses"]["recorded"] == {"dropped": {"otlp\ufffd": 3},
                                                             "failures": {"x\ufffd": 1}}


# --------------------------------------------------------------------------- files that are no files


def _special_files(trace_dir: str) -> Dict[str, str]:
    """A FIFO, a socket, a device and a directory where each kind of file of a trace dir is
    looked for: {path: what the warning calls it}."""
    made = {}
    for part, name in (("otlp", "fifo.jsonl"), ("sample", "fifo.csv"), ("progress", "fifo.log"),
                       ("trajectory", "fifo.jsonl"), ("losses", "fifo.json"), ("otlp-metrics", "fifo.jsonl")):
        os.makedirs(os.path.join(trace_dir, part), exist_ok=True)
        os.mkfifo(os.path.join(trace_dir, part, name))
        made[os.path.join(trace_dir, part, name)] = "a FIFO"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(trace_dir, "otlp", "socket.jsonl"))
    sock.close()
    made[os.path.join(trace_dir, "otlp", "socket.jsonl")] = "a socket"
    for part, name in (("otlp", "zero.jsonl"), ("progress", "zero.log")):
        os.symlink("/dev/zero", os.path.join(trace_dir, part, name))
        made[os.path.join(trace_dir, part, name)] = "a character device"
    os.mkdir(os.path.join(trace_dir, "sample", "directory.csv"))
    made[os.path.join(trace_dir, "sample", "directory.csv")] = "a directory"
    return made


def _said_skipped(proc: subprocess.CompletedProcess) -> Dict[str, str]:
    out = {}
    for line in stderr_lines(proc, "warning: "):
        if line.endswith(", not a file: skipped"):
            path, _, what = line[len("warning: "):-len(", not a file: skipped")].rpartition(" is ")
            out[path] = what
    return out


@pytest.fixture()
def special(tmp_path):
    run = straggler_run()
    trace_dir = run.write(str(tmp_path / "run"))
    return trace_dir, _special_files(trace_dir), sum(len(spans) for _, spans in run.spans.values())


@pytest.mark.parametrize("extra", [(), ("--json",), pytest.param(("--perfetto", "out.pftrace"), marks=NEEDS_PERFETTO)],
                         ids=["text", "json", "perfetto"])
def test_fifos_sockets_devices_and_directories_are_skipped_and_said(special, tmp_path, extra):
    trace_dir, made, spans = special
    extra = tuple(str(tmp_path / e) if e.endswith(".pftrace") else e for e in extra)
    proc = otel_verl("report", trace_dir, *extra, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert _said_skipped(proc) == made
    if extra == ("--json",):
        data = json.loads(proc.stdout)
        assert data["inputs"]["spans"] == spans
        assert {s["path"]: s["what"] for s in data["inputs"]["skipped_files"]} == made


def test_report_compare_skips_them_too(special):
    trace_dir, made, _ = special
    proc = otel_verl("report", "--compare", trace_dir, trace_dir, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _said_skipped(proc) == made


def test_a_fifo_named_on_the_command_line_is_a_one_line_error(tmp_path):
    fifo = str(tmp_path / "spans.jsonl")
    os.mkfifo(fifo)
    one_line_error(otel_verl("report", fifo, timeout=60), fifo, "a FIFO, not a file or directory")
    one_line_error(otel_verl("replay", fifo, "--endpoint", "http://127.0.0.1:1", timeout=60), "a FIFO")


# --------------------------------------------------------------------------- files that cannot be read


def _line(**span: Any) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})


# what `report` warns of the line (the span store names it and loads the file's other
# spans; a file with no span left is a one-line error), and what `replay` says of it (None:
# replay sends a span's fields as they are, the receiver judges them)
@pytest.mark.parametrize("content, store_warns, replay_says", [
    (_line(name="a", traceId="1" * 32, spanId="2" * 16) + "\n" + '{"resourceSpans": [{"scopeSpans": \n'
     + _line(name="b", traceId="1" * 32, spanId="3" * 16) + "\n", "spans.jsonl:2: not JSON",
     "spans.jsonl:2: not an OTLP-JSON line"),
    ('{"resourceSpans": [5]}\n', "spans.jsonl:1: not OTLP span data", "spans.jsonl:1: malformed OTLP-JSON"),
    # the store, as the Collector's exporter, keeps a name that is a number as its text
    (_line(name=5, traceId="1" * 32, spanId="2" * 16) + "\n", None, None),
    (_line(name="a", traceId="1" * 32, spanId="2" * 16, attributes={"key": "not a list"}) + "\n",
     "spans.jsonl:1: not OTLP span data", None),
], ids=["cut-mid-file", "resource-spans-not-objects", "name-not-text", "attributes-not-a-list"])
def test_malformed_lines_name_file_and_line(tmp_path, content, store_warns, replay_says):
    path = tmp_path / "spans.jsonl"
    path.write_text(content)
    loads = content.count('"spans": [{') > (1 if store_warns else 0)  # a span is left to report on
    for extra in ((), ("--json",)) + ((("--perfetto", str(tmp_path / "out.pftrace")),) if PERFETTO_LOADS else ()):
        proc = otel_verl("report", str(path), *extra)
        assert_no_traceback(proc)
        if loads:
            assert proc.returncode == 0, proc.stderr
        else:
            one_line_error(proc, f"no spans in {path} (1 file(s)", store_warns)  # the error names the line
        warnings = stderr_lines(proc, "warning: ")
        assert [w for w in warnings if store_warns in w] if store_warns and loads else not warnings, proc.stderr
    if replay_says:
        one_line_error(otel_verl("replay", str(path), "--endpoint", "http://127.0.0.1:1"), replay_says)


def test_a_line_cut_mid_file_says_so(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text('{"resourceSpans": [{"scopeSpans": \n' + _line(name="b", traceId="1" * 32, spanId="3" * 16) + "\n")
    proc = otel_verl("report", str(path))  # the store loads the rest and names the line
    assert proc.returncode == 0 and "spans.jsonl:1: not JSON" in proc.stderr, proc.stderr


def test_an_unreadable_file_is_a_one_line_error_naming_it(tmp_path):
    trace_dir = straggler_run().write(str(tmp_path / "run"))
    path = os.path.join(trace_dir, "otlp", "spans.jsonl")
    os.chmod(path, 0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("this user reads a file of mode 000 (root)")
        one_line_error(otel_verl("report", trace_dir), path, "cannot read (Permission denied)")
        one_line_error(otel_verl("replay", trace_dir, "--endpoint", "http://127.0.0.1:1"), path, "Permission denied")
    finally:
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


# --------------------------------------------------------------------------- replay


class Receiver:
    """An OTLP/HTTP receiver in this process: keeps each POST's body, answers from a script
    of statuses (then 200)."""

    def __init__(self, statuses=()) -> None:
        self.bodies: List[bytes] = []
        self.answered: List[int] = []
        self.statuses = list(statuses)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.answered.append(status)
                if status == 200:
                    receiver.bodies.append(body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thirteen_lines(directory) -> Dict[str, Any]:
    """13 OTLP-JSON lines (a demo run's worth) of 3 spans each, in one file."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), "spans.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for line in range(13):
            spans = [{"traceId": "%032x" % (line + 1), "spanId": "%016x" % (100 * line + i), "name": f"s{i}",
                      "kind": 1, "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000"}
                     for i in range(3)]
            f.write(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n")
    return {"path": path, "lines": 13, "spans": 39}


def test_replay_sends_lone_surrogates_as_replacement_characters(hostile):
    for protocol in ("json", "protobuf"):
        with Receiver() as receiver:
            proc = otel_verl("replay", hostile["dir"], "--endpoint", receiver.url, "--protocol", protocol)
        assert_repaired_and_said(proc, hostile)
        if protocol == "json":
            sent = [json.loads(body.decode("utf-8")) for body in receiver.bodies]  # strict UTF-8
            assert lone_surrogates(sent) == []
            names = {s["name"] for line in sent for rs in line["resourceSpans"] for ss in rs["scopeSpans"]
                     for s in ss["spans"]}
            assert {_repaired(SURROGATES[0]), "raw-\ufffd"} <= names
        assert f"sent {sum(1 for _ in _span_ids(receiver.bodies, protocol))} of" in proc.stdout


def _span_ids(bodies: List[bytes], protocol: str):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    for body in bodies:
        if protocol == "json":
            yield from (s["spanId"] for rs in json.loads(body)["resourceSpans"] for ss in rs["scopeSpans"]
                        for s in ss["spans"])
        else:
            yield from (s.span_id.hex() for rs in ExportTraceServiceRequest.FromString(body).resource_spans
                        for ss in rs.scope_spans for s in ss.spans)


def test_replay_skips_special_files_and_sends_the_rest(special):
    trace_dir, made, spans = special
    with Receiver() as receiver:
        proc = otel_verl("replay", trace_dir, "--endpoint", receiver.url, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _said_skipped(proc) == made
    assert len(list(_span_ids(receiver.bodies, "json"))) == spans


def test_replay_to_a_refused_endpoint_stops_at_once_and_names_what_was_not_sent(tmp_path):
    """Where every line was retried about 15 s before (200 s for these 13 lines)."""
    files = thirteen_lines(tmp_path / "otlp")
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    proc = otel_verl("replay", str(tmp_path), "--endpoint", url)
    took = time.monotonic() - started
    error = one_line_error(proc, "13 of 13 lines (39 spans) could not be sent", "Connection refused",
                           f"not sent: {files['path']} lines 1-13")
    assert "nothing was sent yet" in error
    assert took < 20, took  # generous: the refusal is known after one connection attempt
    assert stderr_lines(proc, "replay: sending 39 spans (13 lines, 1 files)"), proc.stderr


def test_replay_stops_at_its_deadline_and_names_what_was_not_sent(tmp_path):
    """A receiver that answers 503 for ever: retried with backoff until --timeout, then the
    line and the rest are named as not sent."""
    files = thirteen_lines(tmp_path / "otlp")
    with Receiver(statuses=[200] + [503] * 1000) as receiver:
        started = time.monotonic()
        proc = otel_verl("replay", str(tmp_path), "--endpoint", receiver.url, "--timeout", "3")
        took = time.monotonic() - started
    one_line_error(proc, "12 of 13 lines (36 spans) could not be sent", "the deadline of 3 s (--timeout) passed",
                   f"not sent: {files['path']} lines 2-13")
    assert receiver.answered[0] == 200 and set(receiver.answered[1:]) == {503} and len(receiver.answered) >= 3
    assert took < 20, took  # generous: 3 s of retries


def test_replay_retries_within_the_deadline_and_says_so_without_a_terminal(tmp_path):
    """503 four times, then 200: 7.5 s of backoff on the first line (0.5 + 1 + 2 + 4), which a
    log without a terminal sees as a progress line; then every line is sent."""
    thirteen_lines(tmp_path / "otlp")
    with Receiver(statuses=[503] * 4) as receiver:
        proc = otel_verl("replay", str(tmp_path), "--endpoint", receiver.url)
    assert proc.returncode == 0, proc.stderr
    assert "sent 39 of 39 spans (13 of 13 lines, 1 files)" in proc.stdout and "retries: 4" in proc.stdout
    progress = stderr_lines(proc, "replay: ")
    assert progress[0].startswith("replay: sending 39 spans (13 lines, 1 files) to ")
    assert any("0 of 39 spans sent (0 of 13 lines) in " in line and "retrying a line in 4.0 s after HTTP 503" in line
               for line in progress), progress
    assert len(list(_span_ids(receiver.bodies, "json"))) == 39


def test_replay_says_when_each_file_is_done(tmp_path):
    """Many files, each taking more than a second (its first answer is a 503): a line per file."""
    for name in ("a", "b", "c"):
        thirteen_lines(tmp_path / "otlp" / name)
    paths = [str(tmp_path / "otlp" / name / "spans.jsonl") for name in ("a", "b", "c")]
    statuses: List[int] = []
    for _ in paths:
        statuses += [503, 503] + [200] * 13  # backoff 0.5 + 1 s on each file's first line
    with Receiver(statuses=statuses[:-13]) as receiver:
        proc = otel_verl("replay", *paths, "--endpoint", receiver.url)
    assert proc.returncode == 0, proc.stderr
    done = [line for line in stderr_lines(proc, "replay: ") if "; done with " in line]
    assert [line.rpartition("done with ")[2] for line in done] == paths[:2], proc.stderr


def test_replay_help_documents_the_deadline():
    proc = otel_verl("replay", "--help")
    assert "--timeout" in proc.stdout and "60" in proc.stdout and "whole replay" in proc.stdout
