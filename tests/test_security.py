"""What may leave the process, and how big it may be.

- Message content (prompts, completions, observations, tool arguments) never leaves over
  OTLP unless OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT opts in; every exported
  byte (a real OTLP/HTTP receiver's request bodies, the embedded OTLP-JSON files) is
  searched for distinctive markers. The legacy trajectory JSONL keeps its texts.
- Free-text attributes are bounded (ids 256, names 256, opt-in content 8 KiB).
- No environment values or secrets are copied into spans or resources, and trace
  carriers (which travel inside data that may be persisted) carry no settings at all:
  context and run id only.
- Files and directories otel_verl creates are never world-writable, whatever the umask.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import stat
import struct

import pytest

import fault_workload as w
from otel_verl import carriers, events, health, semconv as sc, settings

MARK = {
    "prompt": "PROMPT-7f3a9c-MARK",
    "completion": "COMPLETION-5b81e2-MARK",
    "observation": "OBSERVATION-c04d6f-MARK",
    "tool": "TOOLARG-91ae3b-MARK",
}

# decode(prompt ids) / decode(completion ids) give marker texts, as a tokenizer would
_CONTENT_WORKLOAD = f"""
    import otel_verl, fault_workload as w
    MARK = {MARK!r}
    LONG = int(__import__("os").environ.get("LONG_COMPLETION", "0"))

    def decode(ids, skip_special_tokens=False):
        ids = list(ids)
        if ids and ids[0] == 11:
            return "<|user|>" + MARK["prompt"]
        return MARK["completion"] + "x" * LONG

    def encode(text, add_special_tokens=True):
        return [ord(c) for c in text[:8]]

    assert otel_verl.configure()
    counter = w.attach_counter()
    outputs = w.Outputs()
    w.emit(1, w.new_uids(2), 2, decode=decode, encode=encode,
           tool_arguments='{{"query": "' + MARK["tool"] + '"}}', observation=MARK["observation"])
    otel_verl.shutdown()
    w.print_result(outputs.report(spans=counter.sampled))
"""


def _captured_bodies(path) -> bytes:
    data = path.read_bytes() if path.exists() else b""
    bodies, i = [], 0
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        bodies.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return b"\n".join(bodies)


def _otlp_file_bytes(trace) -> bytes:
    return b"\n".join(open(p, "rb").read() for p in glob.glob(str(trace / "otlp" / "*.jsonl")))


def _run_exported(tmp_path, extra_env=None):
    """The content workload with an OTLP/HTTP endpoint (a capturing receiver) and the
    embedded OTLP-JSON files both on. Returns (result, wire bytes, OTLP-JSON bytes)."""
    capture = tmp_path / "capture.bin"
    trace = tmp_path / "trace"
    with w.fault_server("capture", str(capture)) as port:
        env = {
            "VERL_TRACE_DIR": str(trace),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_VERL_OTLP_FILE": "1",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            **(extra_env or {}),
        }
        result = w.parse_result(w.run_python(_CONTENT_WORKLOAD, env).stdout)
    expect = w.expected(2, 2)
    assert result["exported"] == {"otlp": expect["spans"], "otlp_json_file": expect["spans"]}
    wire, files = _captured_bodies(capture), _otlp_file_bytes(trace)
    assert wire and files
    return result, wire, files


# --------------------------------------------------------------------------- message content


@pytest.mark.timeout(60)
def test_message_content_never_leaves_over_otlp_by_default(tmp_path):
    _, wire, files = _run_exported(tmp_path)
    for name, marker in MARK.items():
        assert marker.encode() not in wire, f"{name} text went over OTLP"
        assert marker.encode() not in files, f"{name} text is in the OTLP-JSON files"
    assert b"gen_ai.input.messages" not in wire + files and b"gen_ai.tool.call.arguments" not in wire + files
    # the legacy trajectory JSONL is the one place the texts belong
    jsonl = b"".join(open(p, "rb").read() for p in glob.glob(str(tmp_path / "trace" / "trajectory" / "*.jsonl")))
    for name in ("prompt", "completion", "observation"):
        assert MARK[name].encode() in jsonl


@pytest.mark.timeout(60)
def test_message_content_opt_in_puts_bounded_genai_messages_on_spans(tmp_path):
    _, wire, files = _run_exported(
        tmp_path, {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true", "LONG_COMPLETION": "100000"})
    for name in ("prompt", "completion", "tool"):
        assert MARK[name].encode() in wire and MARK[name].encode() in files
    spans = w.otlp_spans([json.loads(line) for line in files.decode().splitlines()])
    llm = [s for s in spans if s["name"] == "chat tiny-model"]
    tools = [s for s in spans if s["name"] == "execute_tool calculator"]
    assert len(llm) == 4 and len(tools) == 4
    for span in llm:
        attrs = {a["key"]: a["value"].get("stringValue") for a in span["attributes"]}
        inputs = json.loads(attrs[sc.GEN_AI_INPUT_MESSAGES])
        outputs = json.loads(attrs[sc.GEN_AI_OUTPUT_MESSAGES])
        assert inputs == [{"role": "user", "parts": [{"type": "text", "content": "<|user|>" + MARK["prompt"]}]}]
        assert outputs[0]["role"] == "assistant" and outputs[0]["finish_reason"] == "stop"
        text = outputs[0]["parts"][0]["content"]
        assert text.startswith(MARK["completion"]) and len(text) == sc.MAX_CONTENT_CHARS  # cut, still valid JSON
    for span in tools:
        attrs = {a["key"]: a["value"].get("stringValue") for a in span["attributes"]}
        assert attrs[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"query": "' + MARK["tool"] + '"}'


def test_content_capture_switch_in_process(make_pipeline):
    """The events API reads the switch from the settings it was installed with."""
    for env, captured in (({"OTEL_VERL_ENABLED": "1"}, False),
                          ({"OTEL_VERL_ENABLED": "1", settings.CAPTURE_CONTENT: "true"}, True)):
        pipeline = make_pipeline([], env=env)
        with events.trajectory("u", "0", step=1, agent_name="a", decode=lambda ids, **kw: "TEXT"):
            with events.llm_call([1, 2]) as turn:
                turn.finish([3], stop_reason="stop")
            with events.tool_call("t", arguments="ARGS"):
                pass
        keys = {k for s in pipeline.spans() for k in s.attributes}
        content_keys = {sc.GEN_AI_INPUT_MESSAGES, sc.GEN_AI_OUTPUT_MESSAGES, sc.GEN_AI_TOOL_CALL_ARGUMENTS}
        assert (keys & content_keys == content_keys) is captured and (not keys & content_keys) is (not captured)
        pipeline.close()
        pipeline.exporter.clear()


# --------------------------------------------------------------------------- attribute sizes


def test_long_ids_and_names_are_bounded_on_spans(make_pipeline):
    pipeline = make_pipeline([])
    huge = "Z" * 100_000
    events.samples_created([huge], step=1, trainer="RayPPOTrainer")
    carrier = events.rollout_dispatched([huge], [huge], [0], step=1, trainer="RayPPOTrainer")[0]
    with events.trajectory(huge, huge, step=1, agent_name=huge, parent=carrier):
        with events.agent_run(huge):
            with events.llm_call([1, 2], model=huge, provider=huge, request_id=huge) as turn:
                turn.finish([3], stop_reason=huge, server_meta={huge: 1.0})
            with events.tool_call(huge, call_id=huge, tool_type=huge):
                pass
    events.samples_finished([huge], "filtered", detail=huge)
    with events.llm_server_call(turn.carrier(), request_id=huge, provider=huge) as call:
        call.record_meta({huge: 2.0})
    spans = pipeline.spans()
    assert len(spans) == 6  # the agent run is no span
    # an id this long is cut and counted, nothing else fails
    assert set(health.snapshot()["failures"]) == {"ids.long_id"}
    for span in spans:
        assert len(span.name) <= sc.MAX_TEXT_CHARS + len("invoke_agent "), span.name[:40]
        for key, value in span.attributes.items():
            assert len(key) <= len(sc.LLM_SERVER_META_PREFIX) + sc.MAX_TEXT_CHARS
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if isinstance(v, str):
                    assert len(v) <= 2 * sc.MAX_TEXT_CHARS + 1, (span.name[:20], key)  # conversation id: uid/traj


# --------------------------------------------------------------------------- environment and secrets

SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "supersecret-aws-9d1",
    "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok123-otlp-4c2",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-api-key=tok456-traces-8e7",
    "MY_DB_PASSWORD": "hunter2-db-31f",
}


@pytest.mark.timeout(60)
def test_no_environment_or_secrets_in_spans_resources_or_carriers(tmp_path):
    capture, trace = tmp_path / "capture.bin", tmp_path / "trace"
    code = """
        import pickle
        import otel_verl, fault_workload as w
        from otel_verl import activation, events
        assert otel_verl.configure()
        outputs = w.Outputs()
        w.emit(1, ["u-1", "u-2"], 2)
        events.samples_created(["u-3"], step=2, trainer="RayPPOTrainer")
        carriers = events.rollout_dispatched(["u-3"], ["0"], [0], step=2, trainer="RayPPOTrainer")
        blob = pickle.dumps(carriers)
        forwarded = activation.runtime_env()["env_vars"]
        events.samples_finished(["u-3"], "trained")
        otel_verl.shutdown()
        w.print_result(outputs.report(carrier_hex=blob.hex(), run_id=carriers[0].run_id,
                                      forwarded=sorted(forwarded)))
    """
    with w.fault_server("capture", str(capture)) as port:
        env = {"VERL_TRACE_DIR": str(trace), "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_VERL_OTLP_FILE": "1",
               "OTEL_BSP_SCHEDULE_DELAY": "50", **SECRETS}
        result = w.parse_result(w.run_python(code, env).stdout)
    wire, files = _captured_bodies(capture), _otlp_file_bytes(trace)
    assert wire and files and result["health"]["dropped"] == {}
    legacy = b"".join(open(p, "rb").read() for p in glob.glob(str(trace / "**" / "*"), recursive=True)
                      if os.path.isfile(p))
    carrier_bytes = bytes.fromhex(result["carrier_hex"])
    for name, secret in SECRETS.items():
        for where, data in (("OTLP wire", wire), ("OTLP-JSON", files), ("trace dir", legacy),
                            ("pickled carrier", carrier_bytes)):
            assert secret.encode() not in data, f"{name} found in {where}"
    # carriers name their run and take no settings along; Ray's runtime env (not
    # persisted with data, but logged by Ray) forwards them, never a secret
    assert result["run_id"] and result["run_id"].encode() in carrier_bytes
    assert str(trace).encode() not in carrier_bytes and f"127.0.0.1:{port}".encode() not in carrier_bytes
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in result["forwarded"]
    assert not set(SECRETS) & set(result["forwarded"])


def test_a_carrier_takes_no_setting_along(monkeypatch):
    env = {
        "VERL_TRACE_DIR": "/data/trace",
        "DLC_JOB_ID": "job-1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/etc/client.key",
        "OTEL_VERL_RUN_ID": "run-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from opentelemetry.trace import NonRecordingSpan, SpanContext

    span = NonRecordingSpan(SpanContext(trace_id=1, span_id=2, is_remote=False))
    carrier = carriers.TraceCarrier.from_span(span)
    data = pickle.dumps(carrier)
    assert carrier.run_id == "run-1"
    assert [name for name, value in env.items() if value.encode() in data] == ["OTEL_VERL_RUN_ID"]
    # the Ray runtime env keeps the settings, never a credential
    assert sorted(settings.forwarded_env(env)) == ["DLC_JOB_ID", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_VERL_RUN_ID",
                                                   "VERL_TRACE_DIR"]


# --------------------------------------------------------------------------- file modes


def _modes(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


@pytest.mark.timeout(60)
def test_created_files_and_directories_are_never_world_writable(tmp_path):
    """Under umask 0 (the worst case: mode arguments alone decide), every directory and
    file otel_verl creates under the trace dir, and the discovery files, are not
    world-writable. The discovery paths are redirected into tmp_path so the files are
    created by this run; the real /tmp ones are checked too."""
    root = tmp_path / "deep" / "nested"
    disc = tmp_path / "discovery"
    disc.mkdir()
    code = f"""
        import os
        os.umask(0)
        from otel_verl.legacy import progress_log, sample_csv, trajectory_jsonl
        for cls, name in ((sample_csv.SampleCsvProcessor, "sample"), (progress_log.ProgressLogProcessor, "progress"),
                          (trajectory_jsonl.TrajectoryJsonlProcessor, "trajectory")):
            cls.__init__.__kwdefaults__["discovery_path"] = os.path.join({str(disc)!r}, name + ".txt")
        import otel_verl, fault_workload as w
        assert otel_verl.configure()
        w.emit(1, ["u-1"], 2)
        otel_verl.shutdown()
    """
    w.run_python(code, {"VERL_TRACE_DIR": str(root / "trace")})
    modes = {**_modes(tmp_path / "deep"), **_modes(disc)}
    assert len([p for p in modes if p.endswith((".csv", ".log", ".jsonl"))]) == 5  # csv, progress, jsonl, otlp spans and metrics
    assert sorted(os.listdir(disc)) == ["progress.txt", "sample.txt", "trajectory.txt"]
    world_writable = {p: oct(m) for p, m in modes.items() if m & stat.S_IWOTH}
    assert not world_writable
    for path, mode in modes.items():
        assert mode & 0o777 == (0o755 if os.path.isdir(path) else 0o644), (path, oct(mode))
    # the real node-local discovery files (written by any traced run on this machine)
    w.run_python("import otel_verl, fault_workload as w\nassert otel_verl.configure()\nw.emit(1, ['u'], 1)\n"
                 "otel_verl.shutdown()\n", {"VERL_TRACE_DIR": str(tmp_path / "plain")})
    for path in ("/tmp/verl_trace_sample_path.txt", "/tmp/verl_progress_path.txt",
                 "/tmp/verl_trace_trajectory_path.txt"):
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and not st.st_mode & stat.S_IWOTH, (path, oct(st.st_mode))
