"""``otel-verl doctor``, ``report`` and ``replay`` on the output of a real ``otel-verl demo``
run (v0 trainer; the v1 trainer has no demo yet) and on bad input.

The report's numbers are recomputed here from ``spans_from_files`` (the same spans, read by
the exporter module's own reader, and grouped here by a different route: by attributes
rather than by walking parent links); replay is checked against a local HTTP server that
keeps every POSTed body."""

from __future__ import annotations

import collections
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from click.testing import CliRunner

from otel_verl.tools.cli import main
from otel_verl.exporters.otlp_json_file import spans_from_files
import demo_checks

if __package__:  # tests/ is a package
    from .otel_binaries import jaeger_server  # noqa: F401  (fixture)
else:
    from otel_binaries import jaeger_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(900)

STEPS, PROMPTS, N = 2, 2, 2
CLEAN_ENV = {  # variables a developer's shell may carry that would change what the commands see
    "VERL_TRACE_DIR": None,
    "OTEL_EXPORTER_OTLP_ENDPOINT": None,
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": None,
    "OTEL_EXPORTER_OTLP_PROTOCOL": None,
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": None,
    "OTEL_TRACES_EXPORTER": None,
    "OTEL_SDK_DISABLED": None,
    "OTEL_VERL_ENABLED": None,
}


def _subprocess_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One `otel-verl demo` run, as a user starts it (a subprocess of the installed CLI)."""
    trace_dir = tmp_path_factory.mktemp("cli_demo")
    proc = subprocess.run(
        [sys.executable, "-m", "otel_verl.tools.cli", "demo", "--trace-dir", str(trace_dir),
         "--steps", str(STEPS), "--prompts", str(PROMPTS), "--n", str(N)],
        capture_output=True, text=True, timeout=840, env=_subprocess_env(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    spans = spans_from_files(str(trace_dir / "otlp"))
    assert spans
    return trace_dir, spans


def cli(*args: str, env: dict | None = None):
    result = CliRunner(env={**CLEAN_ENV, **(env or {})}).invoke(main, list(args), catch_exceptions=False)
    return result


def report_json(*paths: str, extra=()) -> dict:
    result = cli("report", *map(str, paths), "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _dur(span) -> float:
    return (span["endTimeUnixNano"] - span["startTimeUnixNano"]) / 1e9


def _merged_s(intervals) -> float:
    merged = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return sum(hi - lo for lo, hi in merged) / 1e9


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------- report


@pytest.mark.verl
@pytest.mark.e2e
def test_report_text_on_the_demo(demo):
    trace_dir, spans = demo
    result = cli("report", str(trace_dir))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert result.stderr == ""
    assert f"{len(spans)} spans in " in out
    assert "truncated: 0" in out
    for heading in ("Steps (s)", "Rollout latency per step", "Slowest trajectories", "Samples: "):
        assert heading in out
    assert f"Samples: {STEPS * PROMPTS} verl.sample roots (trained {STEPS * PROMPTS})" in out
    assert "never finished: none" in out
    assert "Loss counters: dropped none; failures none (the loss files of " in out
    assert out.count(" consistent") == 3


@pytest.mark.verl
@pytest.mark.e2e
def test_report_numbers_match_the_spans(demo, tmp_path):
    trace_dir, spans = demo
    report = report_json(trace_dir, extra=("--top", "3"))
    demo_checks.assert_the_store_reports_the_same(trace_dir, report, str(tmp_path / "store"))
    assert report["inputs"]["spans"] == len(spans)
    assert report["inputs"]["traces"] == len({s["traceId"] for s in spans})
    assert report["inputs"]["truncated"] == 0

    # steps: each verl.step span and the verl.stage spans of its global step
    steps = {s["attributes"]["verl.global_step"]: s for s in spans if s["name"] == "verl.step"}
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert [row["step"] for row in report["steps"]] == sorted(steps)
    for row in report["steps"]:
        step = steps[row["step"]]
        stage_spans = [s for s in spans if s["name"].startswith("verl.stage ")
                       and s["attributes"]["verl.global_step"] == row["step"]]
        assert row["finished"] and row["duration_s"] == pytest.approx(_dur(step))
        expected = collections.defaultdict(float)
        for s in stage_spans:
            expected[s["attributes"]["verl.stage"]] += _dur(s)
        assert row["stages"].keys() == expected.keys()
        assert {"generation", "old_log_prob", "update_actor"} <= expected.keys()
        for stage, seconds in expected.items():
            assert row["stages"][stage] == pytest.approx(seconds)
        lo, hi = step["startTimeUnixNano"], step["endTimeUnixNano"]
        covered = _merged_s((max(s["startTimeUnixNano"], lo), min(s["endTimeUnixNano"], hi)) for s in stage_spans)
        assert row["other_s"] == pytest.approx(_dur(step) - covered)
        assert 0 <= row["other_s"] < row["duration_s"]

    # rollout latency: trajectory span durations per verl.global_step
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert report["trajectories"] == len(trajectories) == STEPS * PROMPTS * N
    for row in report["rollout_latency"]:
        durations = [_dur(s) for s in trajectories if s["attributes"]["verl.global_step"] == row["step"]]
        assert row["count"] == len(durations) == PROMPTS * N
        for q in (50, 90, 99):
            assert row[f"p{q}_s"] == pytest.approx(float(np.percentile(durations, q)))
        assert row["max_s"] == pytest.approx(max(durations))

    # slowest trajectories and their split, from the spans that carry the same (uid, traj_uid)
    ranked = sorted(trajectories, key=_dur, reverse=True)[:3]
    assert [(t["uid"], t["traj_uid"]) for t in report["slowest_trajectories"]] == [
        (s["attributes"]["verl.uid"], s["attributes"]["verl.traj_uid"]) for s in ranked]
    for entry, traj in zip(report["slowest_trajectories"], ranked):
        mine = [s for s in spans if s["traceId"] == traj["traceId"]
                and s["attributes"].get("verl.traj_uid") == traj["attributes"]["verl.traj_uid"]]
        chats = [s for s in mine if s["name"].startswith("chat ")]
        tools = [s for s in mine if s["name"].startswith("execute_tool ")]
        rewards = [s for s in mine if s["name"] == "verl.reward"]
        assert entry["duration_s"] == pytest.approx(_dur(traj))
        assert entry["turns"] == len(chats) == 2 and entry["tool_calls"] == len(tools) == 1
        assert entry["llm_s"] == pytest.approx(sum(map(_dur, chats)))
        assert entry["tool_s"] == pytest.approx(sum(map(_dur, tools)))
        assert entry["reward_s"] == pytest.approx(sum(map(_dur, rewards)))
        assert entry["other_s"] == pytest.approx(_dur(traj) - entry["llm_s"] - entry["tool_s"] - entry["reward_s"])
        # the server's split, from the verl.llm.server.* attributes of the chats' server spans
        servers = [[s for s in spans if s["parentSpanId"] == c["spanId"] and s["name"] == "verl.llm_server.generate"]
                   for c in chats]
        assert all(len(found) == 1 for found in servers)
        meta = [{k.rsplit(".", 1)[1]: v for k, v in found[0]["attributes"].items() if k.startswith("verl.llm.server.")}
                for found in servers]
        server = entry["llm_server_s"]
        assert server is not None, "the sglang stand-in reports per-request timing"
        assert server["e2e"] == pytest.approx(sum(m["e2e_latency"] for m in meta))
        assert server["queue"] == pytest.approx(sum(m["queue_time"] for m in meta))
        ttft = [m["prefill_finished_time"] - m["request_received_ts"] for m in meta]  # sglang 0.5.12's keys
        assert server["prefill"] == pytest.approx(sum(t - m["queue_time"] for t, m in zip(ttft, meta)), abs=1e-6)
        assert server["decode"] == pytest.approx(sum(m["e2e_latency"] - t for t, m in zip(ttft, meta)), abs=1e-6)
        assert server["queue"] + server["prefill"] + server["decode"] == pytest.approx(server["e2e"], abs=1e-6)
        assert server["e2e"] <= entry["llm_s"]  # the server's work happens inside the client's call
        assert server["client_overhead"] == pytest.approx(entry["llm_s"] - server["e2e"])

    # samples and losses
    samples = report["samples"]
    assert samples["roots"] == STEPS * PROMPTS and samples["outcomes"] == {"trained": STEPS * PROMPTS}
    assert samples["unfinished_count"] == 0 and samples["unfinished"] == []
    losses = report["losses"]
    assert losses["recorded"] == {"dropped": {}, "failures": {}}  # from the demo's metric files
    assert losses["span_limit_drops"] == {"attributes": 0, "events": 0, "links": 0}
    assert [c["legacy"] for c in losses["consistency"]] == [STEPS * PROMPTS * N] * 3
    assert {c["verdict"] for c in losses["consistency"]} == {"consistent"}


@pytest.mark.verl
@pytest.mark.e2e
def test_report_reads_otlp_files_and_dirs_alike(demo):
    trace_dir, spans = demo
    files = sorted(str(p) for p in (trace_dir / "otlp").glob("*.jsonl"))
    by_dir = report_json(trace_dir / "otlp")
    by_files = report_json(*files)
    assert by_dir["steps"] == by_files["steps"] and by_dir["inputs"]["spans"] == len(spans)
    # no legacy files next to bare OTLP files: nothing to compare, said so
    assert by_files["losses"]["consistency"] == [] and by_files["inputs"]["legacy_files"]["sample_csv"] == 0


@pytest.mark.verl
@pytest.mark.e2e
def test_report_png_timeline(demo, tmp_path):
    from PIL import Image

    from otel_verl.tools.report import timeline

    trace_dir, spans = demo
    png = tmp_path / "timeline.png"
    report = report_json(trace_dir, extra=("--png", str(png)))
    layout = report["png"]
    # one row per step, with its stage bars and one bar per trajectory
    assert [row["step"] for row in layout["rows"]] == list(range(1, STEPS + 1))
    for row in layout["rows"]:
        stage_spans = [s for s in spans if s["name"].startswith("verl.stage ") and s["attributes"]["verl.global_step"] == row["step"]]
        assert row["stage_bars"] == len(stage_spans)
        assert row["trajectory_bars"] == PROMPTS * N
    assert 5_000 < png.stat().st_size < 200_000
    with Image.open(png) as image:
        assert image.format == "PNG"
        assert image.size == (layout["width_px"], layout["height_px"])
        rgb = image.convert("RGB")
        colors = collections.Counter(rgb.getdata())
    assert len(colors) > 20  # drawn, not blank
    trajectory_rgb = tuple(int(timeline.TRAJECTORY_COLOR[i:i + 2], 16) for i in (1, 3, 5))
    assert colors[trajectory_rgb] > 500  # the trajectory bars are there

    # the picture grows by one row per step
    one_step = dict(report, timeline=report["timeline"][:1])
    small = tmp_path / "one.png"
    small_layout = timeline.draw(one_step, str(small))
    with Image.open(small) as image:
        assert image.size == (small_layout["width_px"], small_layout["height_px"])
        assert image.size[0] == layout["width_px"]
        assert layout["height_px"] - image.size[1] == round(timeline.ROW_INCHES * timeline.DPI)

    # a long run shows MAX_ROWS steps, spread from the first to the last
    rows = [dict(report["timeline"][0], step=i) for i in range(1, 101)]
    long_layout = timeline.layout(dict(report, timeline=rows))
    shown = [row["step"] for row in long_layout["rows"]]
    assert len(shown) == timeline.MAX_ROWS and shown[0] == 1 and shown[-1] == 100
    assert long_layout["steps_total"] == 100


@pytest.mark.verl
@pytest.mark.e2e
def test_report_tolerates_a_truncated_last_line(demo, tmp_path):
    trace_dir, spans = demo
    copy = tmp_path / "otlp"
    shutil.copytree(trace_dir / "otlp", copy)
    victim = sorted(copy.glob("*.jsonl"))[0]
    first_line = victim.read_bytes().splitlines(keepends=True)[0]
    with open(victim, "ab") as f:
        f.write(first_line[: len(first_line) // 2])  # a writer caught mid-line
    result = cli("report", str(copy))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("\n") == 1 and "truncated line" in result.stderr and str(victim) in result.stderr
    assert "truncated: 1" in result.stdout
    report = report_json(copy)
    assert report["inputs"]["truncated"] == 1 and report["inputs"]["spans"] == len(spans)


def _rewrite_otlp(src_dir, dst_dir, edit) -> None:
    """Copy OTLP-JSON files, passing each span dict through ``edit`` (None drops it)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(src_dir.glob("*.jsonl")):
        out = []
        for line in path.read_text().splitlines():
            obj = json.loads(line)
            for rs in obj["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    ss["spans"] = [e for e in (edit(s) for s in ss["spans"]) if e is not None]
            out.append(json.dumps(obj))
        (dst_dir / path.name).write_text("\n".join(out) + "\n")


def _attr(span, key):
    return next((kv["value"] for kv in span.get("attributes", ()) if kv["key"] == key), {})


@pytest.mark.verl
@pytest.mark.e2e
def test_report_lists_samples_that_never_finished(demo, tmp_path):
    trace_dir, spans = demo
    roots = sorted((s for s in spans if s["name"] == "verl.sample"), key=lambda s: s["attributes"]["verl.uid"])
    lost_uid = roots[0]["attributes"]["verl.uid"]  # its root never ended (process killed)
    shut_uid = roots[1]["attributes"]["verl.uid"]  # ended at shutdown, never trained

    def edit(span):
        if span.get("name") != "verl.sample":
            return span
        uid = _attr(span, "verl.uid").get("stringValue")
        if uid == lost_uid:
            return None
        if uid == shut_uid:
            for kv in span["attributes"]:
                if kv["key"] == "verl.sample.outcome":
                    kv["value"] = {"stringValue": "unfinished_at_shutdown"}
        return span

    _rewrite_otlp(trace_dir / "otlp", tmp_path / "run" / "otlp", edit)
    samples = report_json(tmp_path / "run" / "otlp")["samples"]
    assert samples["unfinished_count"] == 2
    by_uid = {u["uid"]: u for u in samples["unfinished"]}
    assert by_uid[lost_uid]["state"] == "no finished verl.sample span"
    assert by_uid[lost_uid]["last_seen"].startswith("span ")
    assert by_uid[shut_uid]["state"] == "outcome unfinished_at_shutdown"
    assert samples["outcomes"] == {"trained": STEPS * PROMPTS - 2, "unfinished_at_shutdown": 1}

    # next to the legacy files: the CSV's COMPLETE rows show the lost root's sample did
    # finish; a uid the CSV saw start and never complete is listed
    for name in ("sample", "progress", "trajectory"):
        shutil.copytree(trace_dir / name, tmp_path / "run" / name)
    csv_file = sorted((tmp_path / "run" / "sample").glob("*.csv"))[0]
    ghost = "00000000-0000-4000-8000-00000000beef"
    with open(csv_file, "a") as f:
        f.write(f"job,sample,{ghost}/sample,RUNNING,1700000000000,from=DataLoader|to=RayPPOTrainer|"
                f"stage=DATA_PREPROCESS|global_step=1|detail=uid_generated\n")
    result = cli("report", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "never finished: 2" in result.stdout and ghost in result.stdout
    samples = report_json(tmp_path / "run")["samples"]
    assert {u["uid"]: u["state"] for u in samples["unfinished"]} == {
        shut_uid: "outcome unfinished_at_shutdown",
        ghost: "no finished verl.sample span",
    }
    assert [u["last_seen"] for u in samples["unfinished"] if u["uid"] == ghost] == ["CSV DATA_PREPROCESS"]


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d / "missing", "no such file or directory"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "no OTLP-JSON files"),
        (lambda d: _write(d / "rows.csv", "a,b,c\n1,2,3\n"), "rows.csv:1: not JSON"),
        (lambda d: _write(d / "config.json", '{"hello": "world"}\n'), "config.json:1: JSON but no OTLP spans"),
        (lambda d: _write(d / "list.jsonl", "[1, 2, 3]\n"), "list.jsonl:1: not OTLP span data"),
        (lambda d: _write(d / "blob.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00garbage\n"), "blob.jsonl:1: not JSON"),
        (lambda d: _write(d / "nothing.jsonl", ""), "no spans"),
        (lambda d: _write(d / "zero.jsonl", '{"resourceSpans": []}\n'), "zero.jsonl:1: JSON but no OTLP spans"),
    ],
    ids=["missing", "empty-dir", "csv", "foreign-json", "json-array", "binary", "empty-file", "no-spans"],
)
def test_report_bad_input_is_one_line_error(tmp_path, make, needle):
    path = make(tmp_path)
    assert_one_line_error(cli("report", str(path)), needle)
    assert_one_line_error(cli("report", str(path), "--json"), needle)


def _write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_report_png_without_matplotlib_names_the_extra(make_pipeline, monkeypatch, tmp_path):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_verl import events
    from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter

    pipeline = make_pipeline([SimpleSpanProcessor(OtlpJsonFileExporter(str(tmp_path / "otlp")))])
    events.samples_created(["u-1"], step=1, trainer="RayPPOTrainer")
    events.samples_finished(["u-1"], "trained")
    pipeline.provider.force_flush()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails as when not installed
    png = tmp_path / "timeline.png"
    assert_one_line_error(cli("report", str(tmp_path), "--png", str(png)), "matplotlib", "pip install 'otel-verl[report]'")
    assert not png.exists()
    # the rest of the report needs no matplotlib
    assert report_json(tmp_path)["inputs"]["spans"] == 1


def test_report_without_a_path_is_a_usage_error():
    result = cli("report")
    assert result.exit_code == 2 and "Missing argument" in result.stderr


# --------------------------------------------------------------------------- replay


class Collector:
    """A tiny OTLP/HTTP receiver: keeps every POST, answers from a script of statuses."""

    def __init__(self, statuses=()):
        self.requests = []
        self.statuses = list(statuses)  # answered first, in order; then 200
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.requests.append((self.path, self.headers.get("Content-Type"), body))
                status = collector.statuses.pop(0) if collector.statuses else 200
                reply = b"{}" if status == 200 else b'{"message": "scripted failure"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _span_ids_json(bodies):
    return sorted(s["spanId"] for b in bodies for rs in json.loads(b)["resourceSpans"]
                  for ss in rs["scopeSpans"] for s in ss["spans"])


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_sends_every_span_as_otlp_json(demo):
    trace_dir, spans = demo
    with Collector() as collector:
        result = cli("replay", str(trace_dir), "--endpoint", collector.url)
    assert result.exit_code == 0, result.output
    assert {(path, ctype) for path, ctype, _ in collector.requests} == {("/v1/traces", "application/json")}
    assert _span_ids_json(b for _, _, b in collector.requests) == sorted(s["spanId"] for s in spans)
    lines = sum(1 for p in (trace_dir / "otlp").glob("*.jsonl") for _ in open(p))
    assert len(collector.requests) == lines
    assert f"sent {len(spans)} of {len(spans)} spans ({lines} of {lines} lines" in result.stdout


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["json", "protobuf"])
def test_replay_into_jaeger(demo, jaeger_server, protocol):
    """End to end: every trace of the demo, span for span, in a real Jaeger v2."""
    trace_dir, spans = demo
    result = cli("replay", str(trace_dir), "--endpoint", f"http://127.0.0.1:{jaeger_server.otlp_http_port}",
                 "--protocol", protocol)
    assert result.exit_code == 0, result.output
    by_trace = collections.defaultdict(set)
    for s in spans:
        by_trace[s["traceId"]].add(s["spanId"])
    for trace_id, ids in by_trace.items():
        got = jaeger_server.wait_for_trace(trace_id, min_spans=len(ids))
        assert {s["spanId"] for rs in got["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]} == ids


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_sends_protobuf(demo):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    trace_dir, spans = demo
    with Collector() as collector:
        result = cli("replay", *map(str, sorted((trace_dir / "otlp").glob("*.jsonl"))),
                     "--endpoint", collector.url + "/v1/traces", "--protocol", "protobuf")
    assert result.exit_code == 0, result.output
    assert {ctype for _, ctype, _ in collector.requests} == {"application/x-protobuf"}
    got = {}
    for _, _, body in collector.requests:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got[s.span_id.hex()] = (s.trace_id.hex(), s.name, s.start_time_unix_nano)
    assert got == {s["spanId"]: (s["traceId"], s["name"], s["startTimeUnixNano"]) for s in spans}


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_retries_5xx_then_succeeds(demo):
    trace_dir, spans = demo
    with Collector(statuses=[503, 500]) as collector:
        result = cli("replay", str(trace_dir / "otlp"), "--endpoint", collector.url, "--retries", "3")
    assert result.exit_code == 0, result.output
    assert "retries: 2" in result.stdout
    ok = [b for (_, _, b), status in zip(collector.requests, [503, 500] + [200] * len(collector.requests)) if status == 200]
    assert _span_ids_json(ok) == sorted(s["spanId"] for s in spans)


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_counts_lines_it_could_not_send(demo, tmp_path):
    trace_dir, spans = demo
    lines = sum(1 for p in (trace_dir / "otlp").glob("*.jsonl") for _ in open(p))
    with Collector(statuses=[400]) as collector:  # the first line is refused for good
        result = cli("replay", str(trace_dir), "--endpoint", collector.url)
    assert result.exit_code == 1
    assert len(collector.requests) == lines  # a 4xx is not retried
    first = json.loads(collector.requests[0][2])
    n_first = sum(len(ss["spans"]) for rs in first["resourceSpans"] for ss in rs["scopeSpans"])
    assert f"Error: 1 of {lines} lines ({n_first} spans) could not be sent" in result.stderr
    assert "HTTP 400" in result.stderr and "Traceback" not in result.output

    # nobody listening: every line fails after its retries
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = cli("replay", str(trace_dir), "--endpoint", f"http://127.0.0.1:{port}", "--retries", "1")
    assert result.exit_code == 1
    assert f"Error: {lines} of {lines} lines ({len(spans)} spans) could not be sent" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.verl
@pytest.mark.e2e
def test_replay_bad_input_sends_nothing(demo, tmp_path):
    trace_dir, _ = demo
    foreign = _write(tmp_path / "foreign.jsonl", '{"not": "traces"}\n')
    with Collector() as collector:
        assert_one_line_error(cli("replay", str(tmp_path / "missing.jsonl"), "--endpoint", collector.url),
                              "no such file or directory")
        assert_one_line_error(cli("replay", str(trace_dir), str(foreign), "--endpoint", collector.url),
                              "not OTLP trace data")
        assert_one_line_error(cli("replay", str(trace_dir), "--endpoint", "localhost:4318"), "expected an OTLP/HTTP URL")
        empty = tmp_path / "empty"
        empty.mkdir()
        assert_one_line_error(cli("replay", str(empty), "--endpoint", collector.url), "no OTLP-JSON files")
    assert collector.requests == []


# --------------------------------------------------------------------------- doctor


@pytest.mark.verl
def test_doctor_on_this_machine(tmp_path):
    """The full check, as a user runs it: imports verl, installs the hooks in its own process."""
    import importlib.util

    proc = subprocess.run(
        [sys.executable, "-m", "otel_verl.tools.cli", "doctor", "--trace-dir", str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=300, env=_subprocess_env(COLUMNS="200"),
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "doctor: no problems" in out.splitlines()[-1]
    from importlib import metadata

    assert any(line.split()[:3] == ["verl", "ok", metadata.version("verl")] for line in out.splitlines())
    rows = {line.split()[1]: line for line in out.splitlines() if line.strip().startswith(("trainer_v0 ", "agent_loop ", "llm_client ", "llm_server "))}
    for hook in ("verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit", "verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop",
                 "verl.workers.rollout.llm_server:LLMServerClient.generate"):
        assert " ok " in rows[hook] and "installs" in rows[hook]
    if importlib.util.find_spec("sglang") is None:
        assert "not importable here" in rows["sglang.srt.managers.tokenizer_manager:TokenizerManager.generate_request"]
        assert " info " in rows["verl.workers.rollout.sglang_rollout.async_sglang_server:SGLangHttpServer.generate"]
    assert any(line.startswith("hooks: ") and " 0 skipped or failing" in line for line in out.splitlines())
    assert "trace dir" in out and "will be created" in out


def _doctor(env: dict, *args: str):
    return cli("doctor", "--no-hooks", *args, env=env)


def _problem_lines(result):
    lines = result.stdout.splitlines()
    return [(lines[i], lines[i + 1]) for i, line in enumerate(lines) if line.startswith("problem: ")]


@pytest.mark.verl
def test_doctor_quick_check_passes_with_a_trace_dir(tmp_path):
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "doctor: no problems"
    assert f"{tmp_path}: writable" in result.stdout
    assert "export process ok outputs written by an export process in: trainer, agent_loop_worker" in " ".join(result.stdout.split())
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path), "OTEL_VERL_OFFLOAD": "0"})
    assert "none: every process writes its own outputs" in " ".join(result.stdout.split())
    # nothing configured: tracing would be off, a warning with its fix, not a failure
    result = _doctor({})
    assert result.exit_code == 0
    assert "warning: tracing: off: nothing to export to" in result.stdout
    assert "  fix: set VERL_TRACE_DIR or OTEL_EXPORTER_OTLP_ENDPOINT" in result.stdout


@pytest.mark.verl
def test_doctor_bad_setting(tmp_path):
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path), "OTEL_VERL_JSONL_MAX_MB": "lots"})
    assert result.exit_code == 1
    [(problem, fix)] = _problem_lines(result)
    assert "OTEL_VERL_JSONL_MAX_MB='lots'" in problem
    assert fix == "  fix: set OTEL_VERL_JSONL_MAX_MB to a valid value or unset it"
    assert result.stdout.splitlines()[-1] == "doctor: 1 problem(s)"


@pytest.mark.verl
def test_doctor_unreachable_and_reachable_endpoint(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path), "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, "--timeout", "1")
    assert result.exit_code == 1
    [(problem, fix)] = _problem_lines(result)
    assert f"127.0.0.1:{port} unreachable" in problem
    assert fix.startswith("  fix: start the collector at") and "OTEL_EXPORTER_OTLP_ENDPOINT" in fix

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = _doctor({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"127.0.0.1:{port}"})
        assert result.exit_code == 0, result.output
        assert f"127.0.0.1:{port} accepts connections" in result.stdout
        # a protocol the exporter does not know is a bad setting
        result = _doctor({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "pigeon"})
        assert result.exit_code == 1
        [(problem, fix)] = _problem_lines(result)
        assert "OTEL_EXPORTER_OTLP_PROTOCOL='pigeon'" in problem and "grpc, http/protobuf, http/json" in fix
        result = _doctor({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc-web"})
        [(problem, fix)] = _problem_lines(result)
        assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='grpc-web'" in problem  # the variable that holds it
        assert fix.startswith("  fix: set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL to one of grpc")


@pytest.mark.verl
def test_doctor_unwritable_trace_dir(tmp_path):
    blocker = _write(tmp_path / "a-file", "x")
    result = _doctor({"VERL_TRACE_DIR": str(blocker / "trace")})
    assert result.exit_code == 1
    [(problem, fix)] = _problem_lines(result)
    assert "trace dir" in problem and "is not a directory" in problem
    assert fix.startswith("  fix: choose a writable directory")
    if sys.platform.startswith("linux"):  # /proc takes no files, not even root's
        result = _doctor({}, "--trace-dir", "/proc/otel-verl-doctor-test")
        assert result.exit_code == 1
        [(problem, _)] = _problem_lines(result)
        assert "cannot create a file in /proc" in problem
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        result = _doctor({"VERL_TRACE_DIR": str(locked)})
        assert result.exit_code == 1 and "cannot create a file" in result.stdout


@pytest.mark.verl
def test_doctor_verl_outside_the_supported_range(monkeypatch, tmp_path):
    import otel_verl.tools.cli as cli_module

    real = cli_module._version
    monkeypatch.setattr(cli_module, "_version", lambda dist: "0.8.2" if dist == "verl" else real(dist))
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path)})
    assert result.exit_code == 1
    [(problem, fix)] = _problem_lines(result)
    assert "verl: 0.8.2 is outside the supported range" in problem and "pip install 'verl" in fix
    monkeypatch.setattr(cli_module, "_version", lambda dist: None if dist == "verl" else real(dist))
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path)})
    assert result.exit_code == 1 and "problem: verl: not installed" in result.stdout


@pytest.mark.verl
def test_doctor_required_hook_skipped(monkeypatch, tmp_path):
    """A required hook whose target drifted, or whose module cannot be imported, fails the
    check; an LLM-server hook whose engine is not installed here is only noted."""
    import types

    import otel_verl.instrumentation as instrumentation
    from otel_verl.instrumentation import hooks
    from otel_verl.instrumentation.hooks import Hook

    class Target:
        def method(self, batch):
            return batch

    module = types.ModuleType("otel_verl_doctor_fake")
    module.Target = Target
    monkeypatch.setitem(sys.modules, "otel_verl_doctor_fake", module)

    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    fake = [
        Hook("otel_verl_doctor_fake", "Target.renamed", wrapper, component="trainer_v0"),
        Hook("otel_verl_no_such_module_a", "Worker.run", wrapper, component="agent_loop"),
        Hook("otel_verl_no_such_module_b", "Server.generate", wrapper, component="llm_server"),
        Hook("otel_verl_doctor_fake", "Target.method", wrapper, ("batch",), component="llm_client"),
    ]
    monkeypatch.setattr(instrumentation, "all_hooks", lambda: fake)
    try:
        result = cli("doctor", env={"VERL_TRACE_DIR": str(tmp_path), "COLUMNS": "200"})
    finally:
        hooks.uninstall_all()
    assert result.exit_code == 1
    problems = dict(_problem_lines(result))
    assert len(problems) == 2
    drift = next(p for p in problems if "otel_verl_doctor_fake:Target.renamed" in p)
    assert "skipped: Target.renamed not found" in drift
    assert problems[drift].startswith("  fix: use a verl in the supported range")
    missing = next(p for p in problems if "otel_verl_no_such_module_a" in p)
    assert "not importable here: ModuleNotFoundError" in missing and "pip install 'otel-verl[verl]'" in problems[missing]
    assert "otel_verl_no_such_module_b" in result.stdout and "needed only where this LLM server runs" in result.stdout
    assert "hooks: 1 install, 2 skipped or failing, 1 not importable here" in result.stdout


@pytest.mark.verl
def test_doctor_labels_optional_hooks_and_counts_one_cause_once(monkeypatch, tmp_path):
    """Each optional component says where its hooks are needed; required hooks kept out by
    one import error are one problem."""
    import otel_verl.instrumentation as instrumentation
    from otel_verl.instrumentation import hooks
    from otel_verl.instrumentation.hooks import Hook

    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    fake = [
        Hook("otel_verl_no_such_module_a", "Worker.run", wrapper, component="agent_loop"),
        Hook("otel_verl_no_such_module_a", "Worker.stop", wrapper, component="agent_loop"),
        Hook("otel_verl_no_such_module_b", "Server.generate", wrapper, component="llm_server"),
        Hook("otel_verl_no_such_module_c", "Trainer.fit", wrapper, component="trainer_separation"),
        Hook("otel_verl_no_such_module_d", "Worker.score", wrapper, component="reward_loop"),
    ]
    monkeypatch.setattr(instrumentation, "all_hooks", lambda: fake)
    try:
        result = cli("doctor", env={"VERL_TRACE_DIR": str(tmp_path), "COLUMNS": "200"})
    finally:
        hooks.uninstall_all()
    assert result.exit_code == 1
    assert _problem_lines(result) == [(
        "problem: 2 hooks: not importable here: ModuleNotFoundError: No module named 'otel_verl_no_such_module_a'",
        "  fix: install verl with what its agent loop imports: pip install 'otel-verl[verl]'")]
    text = " ".join(result.stdout.split())
    for module, where in (("b", "needed only where this LLM server runs"),
                          ("c", "needed only with verl's experimental disaggregated trainer"),
                          ("d", "needed only where verl's reward loop workers run")):
        assert f"otel_verl_no_such_module_{module} not available (see engine sources) ({where})" in text
    assert text.count("LLM server") == 1


def test_doctor_without_verl_is_short_and_names_the_cause_once(monkeypatch, tmp_path):
    """A light install (the tools only): one problem, verl, with how many hooks it leaves
    unchecked, in about 30 lines."""
    import importlib.util

    import otel_verl.tools.cli as cli_module
    from otel_verl.instrumentation import all_hooks

    if importlib.util.find_spec("verl") is not None:  # stand-in for a light install: verl (and Ray) hidden here
        real = cli_module._version
        monkeypatch.setattr(cli_module, "_version", lambda dist: None if dist in ("verl", "ray") else real(dist))
        monkeypatch.setitem(sys.modules, "verl", None)
        assert importlib.util.find_spec("verl") is None
    hook_count = len(all_hooks())
    result = cli("doctor", env={"VERL_TRACE_DIR": str(tmp_path), "OTEL_VERL_WHEEL_CACHE": str(tmp_path / "wheels")})
    lines = result.stdout.splitlines()
    assert result.exit_code == 1
    assert len(lines) <= 31, result.stdout
    assert _problem_lines(result) == [(f"problem: verl: not installed here: {hook_count} hooks cannot be checked",
                                       "  fix: install otel-verl[verl] where training runs: pip install 'otel-verl[verl]'")]
    assert f"hooks: not checked: verl is not installed here ({hook_count} hooks)" in lines
    assert "ModuleNotFoundError" not in result.stdout and "LLM server" not in result.stdout
    assert lines[-1] == "doctor: 1 problem(s)"


# --------------------------------------------------------------------------- doctor --config

ROLLOUT = "actor_rollout_ref.rollout"


def _warning_lines(result):
    lines = result.stdout.splitlines()
    return [(lines[i], lines[i + 1]) for i, line in enumerate(lines) if line.startswith("warning: ")]


@pytest.mark.verl
def test_doctor_config_warns_when_sglang_will_not_report_its_timing(tmp_path):
    env = {"VERL_TRACE_DIR": str(tmp_path)}
    script = _write(tmp_path / "run.sh", f"python3 -m verl.trainer.main_ppo \\\n  {ROLLOUT}.name=sglang \\\n"
                                         "  trainer.n_gpus_per_node=8\n")
    result = _doctor(env, "--config", str(script))
    assert result.exit_code == 0, result.output
    [(warning, fix)] = _warning_lines(result)
    assert warning.startswith("warning: sglang timing: sglang will report only e2e_latency")
    assert fix == "  fix: add the Hydra override ++actor_rollout_ref.rollout.engine_kwargs.sglang.enable_metrics=True " \
                  "(otel-verl run adds it to verl.trainer.main_ppo)"
    assert result.stdout.splitlines()[-1] == "doctor: no problems (1 warning(s))"
    assert "rollout engine info sglang" in " ".join(result.stdout.split())

    # switched on: by the override (a later --config wins), or by verl's Prometheus switch
    result = _doctor(env, "--config", str(script), "--config", f"++{ROLLOUT}.engine_kwargs.sglang.enable_metrics=True")
    assert not _warning_lines(result) and "sglang timing ok sglang reports per-request timing" in " ".join(result.stdout.split())
    config = _write(tmp_path / "config.yaml", "actor_rollout_ref:\n  rollout:\n    name: sglang\n"
                                              "    disable_log_stats: false\n    prometheus:\n      enable: true\n")
    result = _doctor(env, "--config", str(config))
    assert not _warning_lines(result) and "(actor_rollout_ref.rollout.prometheus.enable=True)" in result.stdout
    # prometheus on with verl's default disable_log_stats: verl would refuse to start its servers
    result = _doctor(env, "--config", f"{ROLLOUT}.name=sglang {ROLLOUT}.prometheus.enable=True")
    [(warning, fix)] = _warning_lines(result)
    assert "needs actor_rollout_ref.rollout.disable_log_stats=False" in warning
    # another engine: nothing to warn about
    result = _doctor(env, "--config", f"{ROLLOUT}.name=vllm")
    assert result.exit_code == 0 and not _warning_lines(result)
    assert "rollout engine vllm: no sglang server to report it" in " ".join(result.stdout.split())
    # without --config: no verl config section
    assert "verl config" not in _doctor(env).stdout


@pytest.mark.verl
@pytest.mark.parametrize("make, needle", [
    (lambda d: str(d / "missing.yaml"), "missing.yaml': no such file, and not a Hydra override (key=value)"),
    (lambda d: str(_write(d / "broken.yaml", "actor_rollout_ref: {rollout: [\n")), "broken.yaml: not valid YAML"),
    (lambda d: str(d), "cannot read it"),
])
def test_doctor_config_unreadable_is_a_clear_usage_error(tmp_path, make, needle):
    result = _doctor({"VERL_TRACE_DIR": str(tmp_path)}, "--config", make(tmp_path))
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: Invalid value for ") and "--config" in lines[-1], result.stderr
    assert needle in lines[-1], result.stderr


# --------------------------------------------------------------------------- the older commands


def test_overrides_never_print_exporter_headers():
    token = "Authorization=Bearer s3cr3t-token"
    result = cli("overrides", env={"OTEL_EXPORTER_OTLP_HEADERS": token, "OTEL_EXPORTER_OTLP_TRACES_HEADERS": token,
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert result.exit_code == 0
    assert "s3cr3t" not in result.stdout and "s3cr3t" not in result.stderr
    assert "env_vars.OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318" in result.stdout
    assert "OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TRACES_HEADERS left out" in result.stderr


def test_overrides_and_run_add_the_sglang_timing_override(tmp_path):
    override = "++actor_rollout_ref.rollout.engine_kwargs.sglang.enable_metrics=True"
    assert override in cli("overrides").stdout.splitlines()
    assert override not in cli("overrides", "--no-sglang-timing").stdout
    show_args = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    main_ppo = ["-m", "verl.trainer.main_ppo", "actor_rollout_ref.rollout.name=sglang"]

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "otel_verl.tools.cli", "run", "--trace-dir", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=120, env=_subprocess_env())
        assert proc.returncode == 0, proc.stderr
        return proc

    proc = run("--", *show_args, *main_ppo)
    assert proc.stdout.strip() == repr([*main_ppo, override])  # appended, after the user's own overrides
    assert f"otel-verl: adding {override}" in proc.stderr and "--no-sglang-timing" in proc.stderr
    assert run("--no-sglang-timing", "--", *show_args, *main_ppo).stdout.strip() == repr(main_ppo)
    vllm = main_ppo[:2] + ["actor_rollout_ref.rollout.name=vllm"]
    assert run("--", *show_args, *vllm).stdout.strip() == repr(vllm)
    assert run("--", *show_args, "other").stdout.strip() == repr(["other"])  # not verl's main_ppo: untouched


def test_run_overrides_and_launch_env_still_work(tmp_path):
    from otel_verl.tools.cli import launch_env

    env = launch_env({"PATH": os.environ["PATH"]}, str(tmp_path))
    assert env["VERL_TRACE_DIR"] == str(tmp_path) and env["OTEL_VERL_RUN_ID"]
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("_sitecustomize")
    result = cli("overrides")
    assert result.exit_code == 0 and "worker_process_setup_hook=otel_verl.activation.worker_setup" in result.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "otel_verl.tools.cli", "run", "--trace-dir", str(tmp_path), "--",
         sys.executable, "-c", "import os, sys; print(os.environ['VERL_TRACE_DIR']); sys.exit(3)"],
        capture_output=True, text=True, timeout=120, env=_subprocess_env(),
    )
    assert proc.returncode == 3 and proc.stdout.strip() == str(tmp_path)
