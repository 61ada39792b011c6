"""The fault matrix: whatever goes wrong around tracing, training never notices.

Every case asserts the same three things: the training-side code sees no exception,
legacy files hold whole lines only, and every accepted row/line/span is either written or
counted in a reported drop counter (``otel_verl.health.snapshot()`` /
``writer.dropped_lines``). Cases that need ``configure()`` (process-wide state) run in a
fresh interpreter driving the workload of ``tests/fault_workload.py``.

1. OTLP endpoint down / slow / refusing / TLS mismatch, gRPC and HTTP
2. trace dir unwritable; disk full (RLIMIT_FSIZE, /dev/full)
3. malformed ids
4. a hooked verl method missing or renamed
5. a span processor or exporter that raises; a batch processor whose shutdown times out
6. a Ray worker killed mid-trajectory
7. normal exit and SIGTERM flush everything
8. the clock crossing an hour boundary (split itself: test_progress_log.py::
   test_hour_rollover_and_discovery_file; here only the accounting across the split)
9. two runs writing into one trace dir at once
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import fault_workload as w
from otel_verl import events, health
from otel_verl.ids import id_str

TIMEOUT_S = 2  # OTEL_EXPORTER_OTLP_TIMEOUT of the OTLP cases, in seconds (SDKs before 1.35 take integers only)


# --------------------------------------------------------------------------- helpers


fault_server, free_port = w.fault_server, w.free_port


def assert_legacy_complete(trace_dir, expect, *, otlp_files: bool = False, spans: int | None = None):
    lines = w.file_lines(str(trace_dir))
    assert len(lines["csv"]) == expect["csv_rows"]
    assert len(lines["progress"]) == expect["progress_lines"]
    assert len(lines["jsonl"]) == expect["jsonl_lines"]
    if otlp_files:
        assert len(w.otlp_spans(lines["otlp"])) == (spans if spans is not None else expect["spans"])
    return lines


def add(*counts):
    out = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


# --------------------------------------------------------------------------- 1. OTLP endpoint faults

_OTLP_WORKLOAD = """
    import time
    import otel_verl, fault_workload as w
    assert otel_verl.configure()
    counter = w.attach_counter()
    outputs = w.Outputs()
    uids = w.new_uids(4)
    first = w.emit(1, uids[:2], 2)
    time.sleep(0.4)  # the batch processor's thread is now stuck on the failing endpoint
    second = w.emit(2, uids[2:], 2, fit=False)
    t0 = time.perf_counter()
    otel_verl.shutdown()
    w.print_result(outputs.report(spans=counter.sampled, emit_s=[first, second], shutdown_s=time.perf_counter() - t0))
"""

# (fault, protocol): server mode and endpoint scheme
_OTLP_CASES = {
    "down": (None, "http"),
    "slow": ("silent", "http"),
    "refusing_close": ("close", "http"),
    "refusing_503": ("http503", "http"),
    "refusing_unavailable": ("grpc_unavailable", "http"),
    "https_to_plain": ("http200", "https"),
    "plain_to_tls": ("tls", "http"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "fault, protocol",
    [
        ("down", "grpc"), ("down", "http/protobuf"),
        ("slow", "grpc"), ("slow", "http/protobuf"),
        ("refusing_close", "grpc"), ("refusing_503", "http/protobuf"), ("refusing_unavailable", "grpc"),
        ("https_to_plain", "grpc"), ("https_to_plain", "http/protobuf"),
        ("plain_to_tls", "grpc"), ("plain_to_tls", "http/protobuf"),
    ],
)
def test_otlp_endpoint_faults_never_block_and_are_counted(tmp_path, fault, protocol):
    mode, scheme = _OTLP_CASES[fault]
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(fault_server(mode)) if mode else free_port()
        env = {
            "VERL_TRACE_DIR": str(tmp_path / "trace"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"{scheme}://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TIMEOUT": str(TIMEOUT_S),
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        result = w.parse_result(w.run_python(_OTLP_WORKLOAD, env, timeout=50).stdout)

    expect = add(w.expected(2, 2), w.expected(2, 2, fit=False))
    # the training-side calls never wait for the endpoint
    assert max(result["emit_s"]) / TIMEOUT_S < 0.25, result["emit_s"]
    # every sampled span was lost, and every one of them is counted under "otlp"
    assert result["spans"] == expect["spans"]
    assert result["exported"] == {"otlp": 0}
    assert result["health"]["dropped"] == {"otlp": expect["spans"]}
    # the legacy files are complete and hold whole lines only
    assert result["writers"] == {
        "progress_log": {"written": expect["progress_lines"], "dropped": 0},
        "sample_csv": {"written": expect["csv_rows"], "dropped": 0},
        "trajectory_jsonl": {"written": expect["jsonl_lines"], "dropped": 0},
    }
    assert_legacy_complete(tmp_path / "trace", expect)


BUDGET_S = 2  # OTEL_VERL_SHUTDOWN_TIMEOUT_S of the deadline cases

_BUDGET_WORKLOAD = """
    import time
    import otel_verl, fault_workload as w
    assert otel_verl.configure()
    counter = w.attach_counter()
    outputs = w.Outputs()
    w.emit(1, w.new_uids(4), 2)
    time.sleep(0.3)  # a batch is on its way to the collector
    t0 = time.perf_counter()
    flushed = otel_verl.flush()
    flush_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    otel_verl.shutdown()
    w.print_result(outputs.report(spans=counter.sampled, flushed=flushed, flush_s=flush_s,
                                  shutdown_s=time.perf_counter() - t0))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_flush_and_shutdown_keep_their_budget_against_a_collector_that_never_answers(tmp_path, protocol):
    """Each batch would wait out the exporter's 10 s timeout: the budget caps the flush
    and the shutdown, and what was not exported by then is counted."""
    with fault_server("silent") as port:
        env = {
            "VERL_TRACE_DIR": str(tmp_path / "trace"),
            "OTEL_VERL_OTLP_FILE": "1",  # beside OTLP: the files get their share of the deadline
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_VERL_SHUTDOWN_TIMEOUT_S": str(BUDGET_S),
        }
        result = w.parse_result(w.run_python(_BUDGET_WORKLOAD, env, timeout=60).stdout)
    expect = w.expected(4, 2)
    assert result["flushed"] is False
    assert result["flush_s"] < BUDGET_S + 2, result["flush_s"]
    assert result["shutdown_s"] < BUDGET_S + 2, result["shutdown_s"]
    assert result["spans"] == expect["spans"]
    assert result["exported"] == {"otlp": 0, "otlp_json_file": expect["spans"]}
    assert result["health"]["dropped"] == {"otlp": expect["spans"]}
    assert_legacy_complete(tmp_path / "trace", expect, otlp_files=True)


def test_otlp_endpoint_control_case_exports_everything(tmp_path):
    """The same workload against a working OTLP/HTTP receiver: nothing dropped (the
    matrix's counts above are the workload's, not an artefact of the failure)."""
    capture = tmp_path / "capture.bin"
    with fault_server("capture", str(capture)) as port:
        env = {"VERL_TRACE_DIR": str(tmp_path / "trace"), "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}
        result = w.parse_result(w.run_python(_OTLP_WORKLOAD, env, timeout=50).stdout)
    expect = add(w.expected(2, 2), w.expected(2, 2, fit=False))
    assert result["exported"] == {"otlp": expect["spans"]} and result["health"]["dropped"] == {}
    assert capture.stat().st_size > 0
    assert_legacy_complete(tmp_path / "trace", expect)


# --------------------------------------------------------------------------- 2. unwritable / full disk

_FILE_WORKLOAD = """
    import otel_verl, fault_workload as w
    from otel_verl import bootstrap
    assert otel_verl.configure()
    counter = w.attach_counter()
    outputs = w.Outputs()
    for step in range(1, 5):
        w.emit(step, w.new_uids(2), 2, fit=step == 1)
        bootstrap.flush()
    otel_verl.shutdown()
    w.print_result(outputs.report(spans=counter.sampled))
"""


def _join(*snippets: str) -> str:
    return "".join(textwrap.dedent(s) for s in snippets)


def _four_steps():
    return add(w.expected(2, 2), *[w.expected(2, 2, fit=False)] * 3)


@pytest.mark.timeout(60)
def test_unwritable_trace_dir_counts_every_line(tmp_path):
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("makedirs below a regular file fails, even as root")
    proc = w.run_python(_FILE_WORKLOAD, {"VERL_TRACE_DIR": str(blocker / "trace")})
    result = w.parse_result(proc.stdout)
    expect = _four_steps()
    assert result["writers"] == {
        "progress_log": {"written": 0, "dropped": expect["progress_lines"]},
        "sample_csv": {"written": 0, "dropped": expect["csv_rows"]},
        "trajectory_jsonl": {"written": 0, "dropped": expect["jsonl_lines"]},
    }
    assert result["exported"] == {"otlp_json_file": 0}
    assert result["health"]["dropped"].pop("otlp_json_metrics_file") >= 1  # each collection the files could not hold
    assert result["health"]["dropped"] == {
        "progress_log": expect["progress_lines"],
        "sample_csv": expect["csv_rows"],
        "trajectory_jsonl": expect["jsonl_lines"],
        "otlp_json_file": expect["spans"],
    }
    # progress lines still reach stdout
    assert proc.stdout.count("is completed, score=1.0 status=Finished") == expect["jsonl_lines"]


def _assert_written_or_counted(result, expect, lines):
    """Each output: written + dropped == accepted, and the files hold exactly the written."""
    writers = result["writers"]
    for output, key, kind in (("sample_csv", "csv_rows", "csv"), ("progress_log", "progress_lines", "progress"),
                              ("trajectory_jsonl", "jsonl_lines", "jsonl")):
        counts = writers[output]
        assert counts["written"] + counts["dropped"] == expect[key], output
        assert len(lines[kind]) == counts["written"], output
        assert result["health"]["dropped"].get(output, 0) == counts["dropped"], output
    exported = result["exported"]["otlp_json_file"]
    assert exported + result["health"]["dropped"].get("otlp_json_file", 0) == expect["spans"] == result["spans"]
    assert len(w.otlp_spans(lines["otlp"])) == exported


@pytest.mark.timeout(60)
def test_file_size_limit_leaves_whole_lines_and_counts_the_rest(tmp_path):
    limit = 16 * 1024
    code = f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    """
    result = w.parse_result(w.run_python(_join(code, _FILE_WORKLOAD), {"VERL_TRACE_DIR": str(tmp_path / "trace")}).stdout)
    lines = w.file_lines(str(tmp_path / "trace"))  # whole lines only
    assert all(os.path.getsize(p) <= limit for p in lines["files"])
    expect = _four_steps()
    _assert_written_or_counted(result, expect, lines)
    assert result["writers"]["sample_csv"]["dropped"] > 0  # the limit did bite
    assert result["health"]["dropped"].get("otlp_json_file", 0) > 0


@pytest.mark.timeout(60)
def test_dev_full_counts_every_line_and_never_raises(tmp_path):
    trace = tmp_path / "trace"
    code = f"""
        import os, socket, time
        trace = {str(trace)!r}
        host, pid = socket.gethostname(), os.getpid()
        for sub, name in (("sample", f"{{host}}-pid{{pid}}.csv"), ("otlp", f"spans-{{host}}-pid{{pid}}.jsonl"),
                          ("progress", time.strftime("%Y%m%d-%H") + ".log")):
            os.makedirs(os.path.join(trace, sub), exist_ok=True)
            os.symlink("/dev/full", os.path.join(trace, sub, name))  # every write: ENOSPC
    """
    result = w.parse_result(w.run_python(_join(code, _FILE_WORKLOAD), {"VERL_TRACE_DIR": str(trace)}).stdout)
    expect = _four_steps()
    assert result["writers"]["sample_csv"] == {"written": 0, "dropped": expect["csv_rows"]}
    assert result["writers"]["trajectory_jsonl"] == {"written": expect["jsonl_lines"], "dropped": 0}
    progress = result["writers"]["progress_log"]
    assert progress["written"] + progress["dropped"] == expect["progress_lines"] and progress["dropped"] > 0
    assert result["exported"] == {"otlp_json_file": 0}
    assert result["health"]["dropped"]["otlp_json_file"] == expect["spans"]
    assert result["health"]["dropped"]["sample_csv"] == expect["csv_rows"]
    lines = w.file_lines(str(trace))  # /dev/full reads as zeros: only the real files count
    assert len(lines["jsonl"]) == expect["jsonl_lines"]


# --------------------------------------------------------------------------- 3. malformed ids


def _malformed_ids():
    from tensordict import NonTensorData

    return [
        None,
        np.int64(7),
        np.str_("numpy-str-uid"),
        NonTensorData(data="ntd-uid", batch_size=[]),
        "not-a-uuid",
        "L" * 100_000,
        b"bytes-uid",
        np.array(["one-element-array"], dtype=object),
    ]


@pytest.mark.verl
def test_malformed_ids_write_rows_with_normalised_bounded_ids(make_pipeline, tmp_path):
    from otel_verl.legacy.sample_csv import SampleCsvProcessor
    from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor
    from otel_verl.semconv import Stage

    trace = str(tmp_path / "trace")
    csv_proc = SampleCsvProcessor(trace, discovery_path=None)
    jsonl_proc = TrajectoryJsonlProcessor(trace, discovery_path=None)
    pipeline = make_pipeline([csv_proc, jsonl_proc])
    ids = _malformed_ids()
    normalised = [id_str(v) for v in ids]
    assert normalised[:4] == ["None", "7", "numpy-str-uid", "ntd-uid"] and len(normalised[5]) == 256
    assert normalised[7] == "one-element-array"
    # traj ids as verl may hand them: numpy ints, NonTensorData, strings
    traj_ids = [np.int64(0), "1"]
    uid_col = np.array([u for u in ids for _ in traj_ids], dtype=object)
    traj_col = np.array([t for _ in ids for t in traj_ids], dtype=object)

    events.samples_created(np.array(ids, dtype=object), step=np.int64(1), trainer="RayPPOTrainer")
    carriers = events.rollout_dispatched(uid_col, traj_col, np.zeros(len(uid_col), dtype=np.int64), step=1,
                                         trainer="RayPPOTrainer")
    assert carriers is not None and len(carriers) == len(uid_col)
    for uid, traj, carrier in zip(uid_col, traj_col, carriers):
        with events.trajectory(uid, traj, step=1, agent_name="tool_agent", parent=carrier):
            with events.agent_run("ToolAgentLoop"):
                with events.llm_call([1, 2], model="m") as turn:
                    turn.finish([3], stop_reason="stop")
    events.rollout_returned(uid_col)
    events.sample_stage_done(Stage.UPDATE_ACTOR, uid_col, traj_col, step=1, start_ns=time.time_ns(),
                             trainer="RayPPOTrainer")
    events.samples_finished(ids, "trained")
    assert csv_proc.force_flush() and jsonl_proc.force_flush()

    # the 100k-character id is cut and counted as such; nothing else fails or is dropped
    counts = health.snapshot()
    assert counts["dropped"] == {} and set(counts["failures"]) == {"ids.long_id"}
    rows = []
    for path in glob.glob(os.path.join(trace, "sample", "*.csv")):
        with open(path, newline="") as f:
            rows.extend(csv.reader(f))
    per_uid_rows = 1 + 2 * 2 + 4 * 2 + 2  # created; repeat+dispatch; 4 worker rows per traj; update
    assert len(rows) == len(ids) * per_uid_rows
    sample_ids = {r[2] for r in rows}
    assert sample_ids == {f"{u}/{t}" for u in normalised for t in ("sample", "0", "1")}
    assert max(len(r[2]) for r in rows) <= 256 + len("/sample")
    jsonl = [line for p in glob.glob(os.path.join(trace, "trajectory", "*.jsonl")) for line in open(p)]
    assert len(jsonl) == len(ids) * 2
    for span in pipeline.spans():
        for key in ("verl.uid", "verl.traj_uid"):
            if key in span.attributes:
                assert span.attributes[key] in normalised + ["0", "1"]
    assert {s.attributes["verl.uid"] for s in pipeline.spans() if s.name == "verl.sample"} == set(normalised)


def test_malformed_call_arguments_never_raise(make_pipeline):
    """Wrong types where numbers or sequences are expected: counted, never raised."""
    make_pipeline([])
    events.samples_created(object(), step="not-a-step", trainer="RayPPOTrainer")
    events.rollout_dispatched(["u"], ["0"], [None], step=1, trainer="RayPPOTrainer")
    events.sample_stage_done("reward", ["u"], None, step=1, start_ns="x", trainer="RayPPOTrainer")
    with events.trajectory("u", "0", step="x", agent_name=None) as data:
        assert data is None
    with events.trajectory(["u"], {"t": 1}, step=1, agent_name=12345):
        with events.llm_call(None, max_tokens="many") as turn:  # no len(), no int()
            turn.finish(None, output_tokens="x")
        with events.tool_call(None, call_id=object()):
            pass
    assert health.snapshot()["failures"]  # counted, none raised


# --------------------------------------------------------------------------- 4. hooks missing / renamed


@pytest.mark.verl
@pytest.mark.timeout(120)
def test_missing_or_renamed_verl_method_is_skipped_with_one_warning():
    code = """
        import io, json, logging, sys
        log = io.StringIO()
        handler = logging.StreamHandler(log)
        logging.getLogger("otel_verl").addHandler(handler)
        logging.getLogger("otel_verl").setLevel(logging.WARNING)

        from verl.experimental.agent_loop import tool_agent_loop
        ToolAgentLoop = tool_agent_loop.ToolAgentLoop
        del ToolAgentLoop._call_tool  # missing in this "verl version"
        ToolAgentLoop._handle_tools_state_renamed = ToolAgentLoop._handle_processing_tools_state
        del ToolAgentLoop._handle_processing_tools_state  # renamed

        from otel_verl.instrumentation import VerlInstrumentor, all_hooks, hooks
        VerlInstrumentor().instrument()
        VerlInstrumentor().instrument()  # a second activation adds nothing
        status = hooks.status()
        loaded = [h.name for h in all_hooks() if h.module in sys.modules]
        print("RESULT " + json.dumps({"status": status, "loaded": loaded, "log": log.getvalue()}))
    """
    proc = w.run_python(code, {}, timeout=110)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    status, log = result["status"], result["log"]
    tal = "verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop."
    assert status[tal + "_call_tool"] == ["skipped", "ToolAgentLoop._call_tool not found"]
    assert status[tal + "_handle_processing_tools_state"] == [
        "skipped", "ToolAgentLoop._handle_processing_tools_state not found"]
    others = [name for name in result["loaded"] if not name.startswith(tal)]
    assert others, "the agent loop module should be loaded with the tool agent loop"
    assert all(status[name][0] == "installed" for name in others), {n: status[n] for n in others}
    warnings = [line for line in log.splitlines() if "skipped" in line]
    assert len(warnings) == 2
    assert sum("_call_tool" in line for line in warnings) == 1
    assert sum("_handle_processing_tools_state" in line for line in warnings) == 1


# --------------------------------------------------------------------------- 5. raising processors / exporters

_RAISING = """
    class Raising:
        def on_start(self, span, parent_context=None):
            raise RuntimeError("on_start")
        def on_end(self, span):
            raise RuntimeError("on_end")
        def shutdown(self):
            raise RuntimeError("shutdown")
        def force_flush(self, timeout_millis=30000):
            raise RuntimeError("force_flush")
"""


@pytest.mark.timeout(60)
def test_a_raising_span_processor_is_counted_and_starves_no_other_output(tmp_path):
    code = _RAISING + """
    import otel_verl, fault_workload as w
    from otel_verl import bootstrap, legacy
    original = legacy.outputs
    legacy.outputs = lambda cfg: [(Raising, Raising)] + original(cfg)  # first in line
    assert otel_verl.configure()
    counter = w.attach_counter()
    outputs = w.Outputs()
    w.emit(1, w.new_uids(2), 2)
    bootstrap.flush()
    otel_verl.shutdown()
    w.print_result(outputs.report(spans=counter.sampled))
    """
    result = w.parse_result(w.run_python(code, {"VERL_TRACE_DIR": str(tmp_path / "trace")}).stdout)
    expect = w.expected(2, 2)
    assert result["spans"] == expect["spans"]
    failures = result["health"]["failures"]
    assert failures["span_processor.Raising.on_start"] == expect["spans"]
    assert failures["span_processor.Raising.on_end"] == expect["spans"]
    assert failures["span_processor.Raising.shutdown"] == 1
    assert failures["span_processor.Raising.force_flush"] >= 1
    assert not [k for k in failures if not k.startswith("span_processor.Raising.")]
    assert result["health"]["dropped"] == {}
    assert_legacy_complete(tmp_path / "trace", expect, otlp_files=True)


@pytest.mark.timeout(60)
def test_a_raising_batch_exporter_is_counted(tmp_path):
    code = """
    import otel_verl, fault_workload as w
    from otel_verl.exporters import otlp_json_file
    def export(self, spans):
        raise RuntimeError("exporter bug")
    otlp_json_file.OtlpJsonFileExporter.export = export
    assert otel_verl.configure()
    counter = w.attach_counter()
    outputs = w.Outputs()
    w.emit(1, w.new_uids(2), 2)
    otel_verl.shutdown()
    w.print_result(outputs.report(spans=counter.sampled))
    """
    result = w.parse_result(w.run_python(code, {"VERL_TRACE_DIR": str(tmp_path / "trace")}).stdout)
    expect = w.expected(2, 2)
    assert result["health"]["dropped"] == {"otlp_json_file": expect["spans"]}
    assert result["health"]["failures"]["otlp_json_file.export"] >= 1
    assert_legacy_complete(tmp_path / "trace", expect)


def test_a_raising_processor_in_a_plain_sdk_provider_never_reaches_the_caller(make_pipeline, tmp_path):
    """Even without bootstrap's isolating processor list (a provider someone else built),
    the events API swallows and counts what a processor raises."""
    from otel_verl.legacy.sample_csv import SampleCsvProcessor
    from otel_verl.semconv import Stage

    ns = {}
    exec(_RAISING.replace("\n    ", "\n"), ns)  # noqa: S102 - the class above
    class RaisingButClosable(ns["Raising"]):
        def shutdown(self):  # the fixture's provider.shutdown() would raise it
            pass

    make_pipeline([SampleCsvProcessor(str(tmp_path), discovery_path=None), RaisingButClosable()])
    with events.step(1, trainer="RayPPOTrainer"):
        events.samples_created(["u1"], step=1, trainer="RayPPOTrainer")
        with events.step_stage(Stage.GENERATION, step=1):
            carriers = events.rollout_dispatched(["u1"], ["0"], [0], step=1, trainer="RayPPOTrainer")
            with events.trajectory("u1", "0", step=1, agent_name="a", parent=(carriers or [None])[0]):
                with events.agent_run("X"), events.llm_call([1]) as turn, events.tool_call("t"):
                    turn.finish([2])
                with events.reward() as reward:
                    reward.score(1)
        events.sample_stage_done(Stage.REWARD, ["u1"], ["0"], step=1, start_ns=time.time_ns(), trainer="T")
        events.samples_finished(["u1"], "trained")
    assert health.snapshot()["failures"]


def test_batch_processor_shutdown_timeout_counts_what_is_left(make_pipeline):
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_verl.accelerated.batch import BatchExportProcessor

    class Stuck(SpanExporter):
        def __init__(self):
            self.entered = threading.Event()
            self.release = threading.Event()

        def export(self, spans):
            self.entered.set()
            self.release.wait(10)
            return SpanExportResult.FAILURE

        def shutdown(self):
            pass

    exporter = Stuck()
    processor = BatchExportProcessor(exporter, "otlp", shutdown_timeout_s=0.3, max_batch=1, schedule_delay_s=0.01)
    make_pipeline([processor])
    events.samples_created([f"u{i}" for i in range(5)], step=1, trainer="RayPPOTrainer")
    events.samples_finished([f"u{i}" for i in range(5)], "trained")
    assert exporter.entered.wait(5)
    processor.shutdown()  # times out with one batch in flight and the rest queued
    assert health.snapshot()["dropped"] == {"otlp": 5}  # every span: none was delivered
    exporter.release.set()
    processor.shutdown()  # idempotent: the late failures are not counted twice
    assert health.snapshot()["dropped"] == {"otlp": 5}


def test_a_flush_through_the_provider_keeps_its_timeout(make_pipeline):
    """The SDK's batch processor exports its whole queue in force_flush, whatever the
    timeout (here 10 batches of 0.5 s each); otel_verl's keeps it."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_verl.accelerated.batch import BatchExportProcessor

    class Slow(SpanExporter):
        def __init__(self):
            self.done = threading.Event()

        def export(self, spans):
            self.done.wait(0.5)
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    exporter = Slow()
    pipeline = make_pipeline([BatchExportProcessor(exporter, "otlp", max_batch=2, schedule_delay_s=60)])
    events.samples_created([f"u{i}" for i in range(20)], step=1, trainer="RayPPOTrainer")
    events.samples_finished([f"u{i}" for i in range(20)], "trained")
    t0 = time.monotonic()
    flushed = pipeline.provider.force_flush(200)
    elapsed = time.monotonic() - t0
    exporter.done.set()  # the rest goes at once
    assert flushed is False
    assert elapsed < 0.2 + 2, elapsed


@pytest.mark.timeout(60)
def test_shutdown_gives_every_processor_one_deadline_and_counts_what_is_left(make_pipeline):
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_verl.accelerated.batch import BatchExportProcessor
    from otel_verl.sampling import IsolatingSpanProcessor

    release = threading.Event()

    class Stuck(SpanExporter):
        def export(self, spans):
            release.wait(30)
            return SpanExportResult.FAILURE

        def shutdown(self):
            pass

    class Hung:
        def on_start(self, span, parent_context=None):
            pass

        def on_end(self, span):
            pass

        def shutdown(self):  # takes no timeout: waited for until the deadline only
            release.wait(30)

        def force_flush(self, timeout_millis=30000):
            return True

    budget = IsolatingSpanProcessor(timeout_s=0.5)
    for processor in (BatchExportProcessor(Stuck(), "otlp", schedule_delay_s=0.01), Hung(),
                      BatchExportProcessor(Stuck(), "otlp_json_file", schedule_delay_s=0.01)):
        budget.add_span_processor(processor)
    make_pipeline([budget])
    events.samples_created([f"u{i}" for i in range(5)], step=1, trainer="RayPPOTrainer")
    events.samples_finished([f"u{i}" for i in range(5)], "trained")
    time.sleep(0.1)  # both batch processors are now stuck exporting
    t0 = time.monotonic()
    budget.shutdown()
    elapsed = time.monotonic() - t0
    release.set()
    assert elapsed < 0.5 + 2, elapsed
    assert health.snapshot()["dropped"] == {"otlp": 5, "otlp_json_file": 5}
    assert health.snapshot()["failures"] == {"span_processor.Hung.shutdown": 1}


def test_spans_dropped_from_a_full_queue_are_counted_when_dropped(make_pipeline):
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_verl.accelerated.batch import BatchExportProcessor

    class Slow(SpanExporter):
        def __init__(self):
            self.release = threading.Event()
            self.count = 0

        def export(self, spans):
            self.release.wait(10)
            self.count += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    exporter = Slow()
    processor = BatchExportProcessor(exporter, "otlp", max_queue_spans=4, max_batch=4, schedule_delay_s=60)
    make_pipeline([processor])
    events.samples_created([f"u{i}" for i in range(20)], step=1, trainer="RayPPOTrainer")
    events.samples_finished([f"u{i}" for i in range(20)], "trained")
    # at most a batch in the exporter and a queue's worth waiting: the rest counted already
    assert health.snapshot()["dropped"].get("otlp", 0) >= 20 - 2 * 4
    exporter.release.set()
    assert processor.force_flush()
    assert exporter.count + health.snapshot()["dropped"].get("otlp", 0) == 20
    assert exporter.count < 20
    processor.shutdown()
    assert exporter.count + health.snapshot()["dropped"].get("otlp", 0) == 20


# --------------------------------------------------------------------------- 6. Ray worker killed


def _trajectory_actor(ray):
    @ray.remote(num_cpus=0, max_restarts=0)
    class TrajectoryActor:
        def __init__(self):
            import otel_verl

            self.on = otel_verl.configure(role="agent_loop_worker")

        def info(self):
            import os

            return os.getpid(), self.on

        def complete(self, uids):
            from otel_verl import events

            for uid in uids:
                with events.trajectory(uid, "0", step=1, agent_name="tool_agent"):
                    with events.agent_run("ToolAgentLoop"):
                        with events.llm_call([1, 2, 3], model="tiny") as turn:
                            turn.finish([4], stop_reason="stop")
                    with events.reward() as reward:
                        reward.score(1.0)
            return len(uids)

        def hang(self, uid):
            import time

            from otel_verl import events

            with events.trajectory(uid, "0", step=1, agent_name="tool_agent"):
                with events.agent_run("ToolAgentLoop"):
                    with events.llm_call([1, 2, 3], model="tiny"):
                        time.sleep(600)  # killed in here, the LLM span open

    return TrajectoryActor


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_ray_worker_killed_mid_trajectory(ray_cluster, tmp_path):
    ray = ray_cluster
    trace = tmp_path / "trace"
    Actor = _trajectory_actor(ray)
    env = {"VERL_TRACE_DIR": str(trace), "OTEL_VERL_ENABLED": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    actor = Actor.options(runtime_env={"env_vars": env}).remote()
    pid, on = ray.get(actor.info.remote(), timeout=60)
    assert on
    done = ["done-a", "done-b"]
    assert ray.get(actor.complete.remote(done), timeout=60) == 2
    ref = actor.hang.remote("open-c")

    csv_path = trace / "sample" / f"{socket.gethostname()}-pid{pid}.csv"

    def contents():
        return [r[2:] for r in csv.reader(io.StringIO(csv_path.read_text(), newline=""))] if csv_path.exists() else []

    deadline = time.time() + 30
    while time.time() < deadline:  # the writer thread flushes each batch as it comes
        open_rows = [r for r in contents() if r[0] == "open-c/0"]
        if len(open_rows) == 2 and len(glob.glob(str(trace / "trajectory" / "*.jsonl"))) == 1:
            break
        time.sleep(0.1)
    written_before_kill = contents()
    ray.kill(actor, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=60)

    lines = w.file_lines(str(trace))  # whole lines only, in every file the actor wrote
    rows = [[r["sample_id"], r["sample_status"], r["timestamp"], r["content"]] for r in lines["csv"]]
    assert rows[: len(written_before_kill)] == written_before_kill
    details = {}
    for r in lines["csv"]:
        details.setdefault(r["sample_id"], []).append(r["content"].rsplit("detail=", 1)[-1])
    for uid in done:
        assert details[f"{uid}/0"] == ["agent_task_started", "sending_generate_request", "received_generate_response",
                                       "agent_run_completed", "reward_score_computed_score=1.0"]
    assert details["open-c/0"] == ["agent_task_started", "sending_generate_request"]
    assert sorted(line["prompt_uid"] for line in lines["jsonl"]) == done
    assert sum("is completed" in line for line in lines["progress"]) == 2
    # the cluster and tracing elsewhere carry on
    other = Actor.options(runtime_env={"env_vars": env}).remote()
    assert ray.get(other.complete.remote(["after-kill"]), timeout=60) == 1
    ray.kill(other)


# --------------------------------------------------------------------------- 7. exit and SIGTERM


_EXIT_WORKLOAD = """
    import sys, time
    import otel_verl, fault_workload as w
    from otel_verl import events
    assert otel_verl.configure()
    w.emit(1, ["u-a", "u-b"], 2)
    events.samples_created(["u-open"], step=2, trainer="RayPPOTrainer")  # never finished
    print("READY", flush=True)
    if sys.argv[-1] == "idle":
        time.sleep(60)
"""


def _assert_everything_flushed(trace):
    expect = w.expected(2, 2)
    expect["csv_rows"] += 1  # u-open's uid_generated
    lines = assert_legacy_complete(trace, expect, otlp_files=True, spans=expect["spans"] + 1)
    attrs = [{a["key"]: a["value"] for a in s["attributes"]} for s in w.otlp_spans(lines["otlp"])]
    open_sample = [a for a in attrs if a.get("verl.uid") == {"stringValue": "u-open"}]
    assert len(open_sample) == 1  # ended by the shutdown, and exported
    assert open_sample[0]["verl.sample.outcome"] == {"stringValue": "unfinished_at_shutdown"}


@pytest.mark.timeout(60)
def test_normal_exit_flushes_every_output(tmp_path):
    trace = tmp_path / "trace"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_WORKLOAD), "exit"],
                          env=w.clean_env({"VERL_TRACE_DIR": str(trace)}), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_everything_flushed(trace)


@pytest.mark.timeout(60)
def test_sigterm_while_idle_flushes_and_dies_of_sigterm(tmp_path):
    trace = tmp_path / "trace"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_EXIT_WORKLOAD), "idle"],
                            env=w.clean_env({"VERL_TRACE_DIR": str(trace)}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, err[-4000:]
    _assert_everything_flushed(trace)


_SIGTERM_IN_A_BATCH = """
    import time
    import otel_verl, fault_workload as w
    from otel_verl import health
    assert otel_verl.configure()
    counter = w.attach_counter()
    w.emit(1, w.new_uids(4), 2)
    time.sleep(0.3)  # a batch is on its way to a collector that never answers
    print("SPANS", counter.sampled, flush=True)
    # SIGTERM comes while this thread holds a lock the shutdown takes (as when it
    # interrupts a span ending and counting a loss)
    with health._lock:
        print("READY", flush=True)
        time.sleep(1.0)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("offload", ["0", "1"])
def test_sigterm_during_a_batch_to_a_silent_collector_dies_within_the_budget(tmp_path, offload):
    import ast
    import re

    with fault_server("silent") as port:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_VERL_OFFLOAD": offload,  # 1: the spans are exported by the export process
            "OTEL_VERL_SHUTDOWN_TIMEOUT_S": str(BUDGET_S),
        }
        proc = w.popen_python(_SIGTERM_IN_A_BATCH, env)
        try:
            lines = iter(proc.stdout.readline, "")
            spans = next(int(line.split()[1]) for line in lines if line.startswith("SPANS "))
            assert next(lines).strip() == "READY"
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            _, err = proc.communicate(timeout=BUDGET_S + 20)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == -signal.SIGTERM, err[-4000:]
    assert elapsed < BUDGET_S + 2, elapsed
    report = re.search(r"at shutdown: dropped=(\{.*?\}) failures=", err)
    assert report, err[-4000:]
    assert ast.literal_eval(report.group(1)) == {"otlp": spans}


# --------------------------------------------------------------------------- 8. hour boundary


def test_hour_boundary_split_accounts_for_every_line(make_pipeline, tmp_path):
    """The split itself: test_progress_log.py::test_hour_rollover_and_discovery_file. Here:
    lines emitted across the boundary land whole in their own hour's file, none lost."""
    from otel_verl.legacy.progress_log import ProgressLogProcessor

    t0 = time.mktime((2026, 8, 20, 11, 59, 59, 0, 0, -1)) + 0.5  # half a second before a local hour
    now = [t0]
    proc = ProgressLogProcessor(str(tmp_path), stdout=io.StringIO(), clock=lambda: now[0], discovery_path=None)
    make_pipeline([proc])
    for step in range(200):
        if step == 100:
            now[0] = t0 + 1.0
        with events.step(step, trainer="SeparateRayPPOTrainer", layout="disaggregated"):
            pass
    assert proc.force_flush()
    assert proc.writer.written_lines == 200 and proc.writer.dropped_lines == 0
    lines = w.file_lines(str(tmp_path))
    before, after = (time.strftime("%Y%m%d-%H", time.localtime(t)) + ".log" for t in (t0, t0 + 1.0))
    by_file = {os.path.basename(p): n for p, n in lines["files"].items()}
    assert by_file == {before: 100, after: 100}
    assert lines["progress"] == [f"==================== Step {s} ====================" for s in range(200)]


# --------------------------------------------------------------------------- 9. two runs, one trace dir


@pytest.mark.timeout(90)
def test_two_runs_share_one_trace_dir(tmp_path):
    trace, go = tmp_path / "trace", tmp_path / "go"
    code = """
        import os, sys, time
        import otel_verl, fault_workload as w
        assert otel_verl.configure()
        outputs = w.Outputs()
        tag = os.environ["OTEL_VERL_RUN_ID"]
        print("READY", flush=True)
        while not os.path.exists(sys.argv[-1]):
            time.sleep(0.01)
        for step in range(1, 6):
            w.emit(step, [f"{tag}-{step}-{i}" for i in range(2)], 2, fit=step == 1)
        otel_verl.shutdown()
        w.print_result(outputs.report())
    """
    procs = {}
    for run in ("run-A", "run-B"):
        procs[run] = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(go)],
            env=w.clean_env({"VERL_TRACE_DIR": str(trace), "OTEL_VERL_RUN_ID": run}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for p in procs.values():
        assert p.stdout.readline().strip() == "READY"
    go.write_text("go")
    results = {}
    for run, p in procs.items():
        out, err = p.communicate(timeout=80)
        assert p.returncode == 0, err[-4000:]
        results[run] = w.parse_result(out)
    per_run = add(w.expected(2, 2), *[w.expected(2, 2, fit=False)] * 4)
    lines = w.file_lines(str(trace))  # whole lines only (the shared progress file included)
    assert len(lines["progress"]) == 2 * per_run["progress_lines"]
    host = socket.gethostname()
    for run, result in results.items():
        pid = result["pid"]
        assert all(v["dropped"] == 0 for v in result["writers"].values()) and result["health"]["dropped"] == {}
        with open(trace / "sample" / f"{host}-pid{pid}.csv", newline="") as f:
            uids = {r[2].split("/")[0] for r in csv.reader(f)} - {"*"}
        assert uids == {f"{run}-{s}-{i}" for s in range(1, 6) for i in range(2)}
        jsonl = glob.glob(str(trace / "trajectory" / f"trajectory_{pid}_*.jsonl"))
        assert len(jsonl) == 1
        assert sum(1 for _ in open(jsonl[0])) == per_run["jsonl_lines"]
        otlp_path = trace / "otlp" / f"spans-{host}-pid{pid}.jsonl"
        spans = w.otlp_spans([json.loads(line) for line in open(otlp_path)])
        assert len(spans) == per_run["spans"]
        assert {s["resource"]["verl.run_id"] for s in spans} == {run}
        assert sum(f"Task {run}-" in line for line in lines["progress"]) == per_run["jsonl_lines"]
    assert len(glob.glob(str(trace / "sample" / "*.csv"))) == 2
    assert len(glob.glob(str(trace / "otlp" / "*.jsonl"))) == 2


class SlowFileOutput:
    """A file output whose writes take a while: what it holds shows in ``pending()``
    until its flush (or the wait its ``checkpoint`` returns) has written it."""

    writes_files = True

    def __init__(self, held: int) -> None:
        self.held = held

    def on_start(self, span, parent_context=None):
        pass

    def on_end(self, span):
        pass

    def pending(self):
        return {"slow_file": self.held}

    def checkpoint(self):
        def wait(timeout_s=None):
            time.sleep(0.3)
            self.held = 0
            return True

        return wait

    def force_flush(self, timeout_millis=30000):
        return self.checkpoint()(timeout_millis / 1000)

    def shutdown(self):
        pass


def _pending_in_loss_file(trace_dir) -> dict:
    [path] = glob.glob(os.path.join(trace_dir, "losses", "*.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)["pending"]


def test_a_flush_writes_the_loss_file_after_the_outputs_it_speaks_of(make_pipeline, tmp_path):
    """The end of a run flushes every process before Ray ends it: the loss file written by
    that flush says what the outputs hold after theirs, not what they held before."""
    from otel_verl.exporters.loss_file import LossFileProcessor
    from otel_verl.sampling import IsolatingSpanProcessor

    output = SlowFileOutput(held=5)
    processor = IsolatingSpanProcessor(timeout_s=5)
    processor.add_span_processor(LossFileProcessor(str(tmp_path), outputs=[output], interval_s=3600))
    processor.add_span_processor(output)
    assert processor.force_flush()
    assert _pending_in_loss_file(tmp_path) == {}


def test_the_export_process_writes_the_loss_file_after_the_outputs_a_flush_waits_for(tmp_path):
    from otel_verl import settings
    from otel_verl.exporters.loss_file import LossFileProcessor
    from otel_verl.offload import wire
    from otel_verl.offload.host import Host

    output = SlowFileOutput(held=5)
    reply = io.BytesIO()
    host = Host(wire.HostConfig(settings.load({}), {}, "", os.getpid()), reply=reply,
                processors=[LossFileProcessor(str(tmp_path), outputs=[output], interval_s=3600), output])
    host.handle(wire.Flush(1, {"dropped": {}, "failures": {}}))
    deadline = time.monotonic() + 10
    while not reply.getvalue() and time.monotonic() < deadline:  # the Flushed answer
        time.sleep(0.01)
    assert wire.read_frame(io.BytesIO(reply.getvalue())).seq == 1
    assert _pending_in_loss_file(tmp_path) == {}
    host.close()
