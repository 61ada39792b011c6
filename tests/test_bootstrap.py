"""configure(): once per process, fork-safe, the embedded OTLP-JSON default, and per-sample
sampling that leaves the legacy outputs complete. Each case runs in a fresh interpreter:
configure() installs process-wide state (the global TracerProvider)."""

import csv
import glob
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from otel_verl.exporters.otlp_json_file import spans_from_files

CSV_HEADERS = ["job_id", "cat", "sample_id", "sample_status", "timestamp", "content"]


def _run(code: str, env: dict) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _csv_rows(trace_dir):
    rows = []
    for path in glob.glob(os.path.join(trace_dir, "sample", "*.csv")):
        with open(path, newline="") as f:
            rows.extend(dict(zip(CSV_HEADERS, r)) for r in csv.reader(f))
    return rows


def test_configure_is_idempotent_and_builds_the_embedded_default(tmp_path):
    out = _run("""
        from opentelemetry import trace
        import otel_verl
        from otel_verl import bootstrap, events
        assert otel_verl.configure() is True
        provider = bootstrap.provider()
        assert otel_verl.configure() is True and bootstrap.provider() is provider
        assert trace.get_tracer_provider() is provider
        events.samples_created(["u-1"], step=1, trainer="RayPPOTrainer")
        events.samples_finished(["u-1"], "trained")
        otel_verl.shutdown()
        print(sorted(provider.resource.attributes.items()))
    """, {"VERL_TRACE_DIR": str(tmp_path), "OTEL_SERVICE_NAME": "grpo-job", "OTEL_VERL_RUN_ID": "run-9",
          "OTEL_VERL_ROLE": "trainer"})
    resource = dict(eval(out))  # noqa: S307 - our own repr
    assert resource["service.name"] == "grpo-job"
    assert resource["service.namespace"] == "verl"
    assert resource["verl.run_id"] == "run-9"
    assert resource["verl.role"] == "trainer"
    assert resource["process.pid"] > 0 and resource["host.name"]
    spans = spans_from_files(glob.glob(str(tmp_path / "otlp" / "*.jsonl")))
    assert [s["name"] for s in spans] == ["verl.sample"]
    assert spans[0]["traceId"] == "%032x" % otel_verl_trace_id("u-1")
    assert [r["content"] for r in _csv_rows(tmp_path)] == ["from=DataLoader|to=RayPPOTrainer|stage=DATA_PREPROCESS|global_step=1|detail=uid_generated"]


RESOURCE_OF_A_PROCESS = """
    import json, sys
    from otel_verl import bootstrap, events
    from otel_verl.semconv import Role
    provider = bootstrap.provider_for_role(Role(sys.argv[1]))  # as the first wrapper asks
    assert bootstrap.provider_for_role(Role.TRAINER) is provider  # the first role stays
    events.samples_created(["u-1", "u-2"], step=1, trainer="RayPPOTrainer")
    events.samples_finished(["u-1", "u-2"], "trained")
    bootstrap.shutdown()
    print(json.dumps(dict(provider.resource.attributes)))
"""


def _resource_of_a_process(trace_dir, role, env=None):
    """The resource a fresh process builds for ``role``, and its spans in the OTLP files."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RESOURCE_OF_A_PROCESS), role],
                          env={**base, "VERL_TRACE_DIR": str(trace_dir), **(env or {})},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1]), spans_from_files(glob.glob(str(trace_dir / "otlp" / "*.jsonl")))


def test_each_role_is_its_own_service_and_each_process_its_own_instance(tmp_path):
    server, server_spans = _resource_of_a_process(tmp_path / "server", "llm_server")
    worker, worker_spans = _resource_of_a_process(tmp_path / "worker", "agent_loop_worker")
    assert (server["service.name"], server["verl.role"]) == ("verl-llm-server", "llm_server")
    assert (worker["service.name"], worker["verl.role"]) == ("verl-rollout-worker", "agent_loop_worker")
    assert server["service.namespace"] == worker["service.namespace"] == "verl"
    # one instance id per process, a uuid, on every span of that process
    assert server["service.instance.id"] != worker["service.instance.id"]
    assert str(uuid.UUID(server["service.instance.id"])) == server["service.instance.id"]
    for resource, spans in ((server, server_spans), (worker, worker_spans)):
        assert len(spans) == 2
        assert {s["resource"]["service.instance.id"] for s in spans} == {resource["service.instance.id"]}
        assert {s["resource"]["service.name"] for s in spans} == {resource["service.name"]}


def test_the_users_service_attributes_win(tmp_path):
    by_name, _ = _resource_of_a_process(tmp_path / "a", "llm_server", {"OTEL_SERVICE_NAME": "grpo-job"})
    assert by_name["service.name"] == "grpo-job" and by_name["verl.role"] == "llm_server"
    assert by_name["service.namespace"] == "verl" and by_name["service.instance.id"]
    by_attributes, _ = _resource_of_a_process(tmp_path / "b", "trainer", {
        "OTEL_RESOURCE_ATTRIBUTES": "service.name=rl,service.namespace=team-a,service.instance.id=pod-7"})
    assert {k: by_attributes[k] for k in ("service.name", "service.namespace", "service.instance.id")} == {
        "service.name": "rl", "service.namespace": "team-a", "service.instance.id": "pod-7"}
    assert by_attributes["verl.role"] == "trainer"
    # as the SDK has it: OTEL_SERVICE_NAME wins over service.name in OTEL_RESOURCE_ATTRIBUTES
    both, _ = _resource_of_a_process(tmp_path / "c", "trainer", {
        "OTEL_SERVICE_NAME": "grpo-job", "OTEL_RESOURCE_ATTRIBUTES": "service.name=rl"})
    assert both["service.name"] == "grpo-job"


def test_service_name_per_role():
    from otel_verl import semconv as sc

    names = {role: sc.service_name(role) for role in sc.Role}
    assert names == {
        sc.Role.TRAINER: "verl-trainer",
        sc.Role.AGENT_LOOP_WORKER: "verl-rollout-worker",
        sc.Role.LLM_SERVER: "verl-llm-server",
        sc.Role.REWARD_WORKER: "verl-reward-worker",
        sc.Role.DRIVER: "verl-driver",
        sc.Role.WORKER: "verl-worker",
    }
    assert sc.service_name("llm_server") == "verl-llm-server"  # the role's value, as OTEL_VERL_ROLE gives it
    assert sc.service_name("data_loader") == "verl-data-loader"  # a role of the user's own


def otel_verl_trace_id(uid):
    from otel_verl.ids import trace_id_for_uid

    return trace_id_for_uid(uid)


def test_configure_works_after_fork_and_each_process_writes_its_own_files(tmp_path):
    out = _run("""
        import os
        import otel_verl
        from otel_verl import events
        assert otel_verl.configure()
        events.samples_created(["parent-uid"], step=1, trainer="RayPPOTrainer")
        pid = os.fork()
        if pid == 0:
            ok = otel_verl.configure()
            events.samples_created(["child-uid"], step=1, trainer="RayPPOTrainer")
            otel_verl.shutdown()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        otel_verl.shutdown()
        print(os.getpid(), pid, status)
    """, {"VERL_TRACE_DIR": str(tmp_path)})
    parent, child, status = map(int, out.split())
    assert status == 0
    files = {os.path.basename(p) for p in glob.glob(str(tmp_path / "sample" / "*.csv"))}
    assert any(f.endswith(f"-pid{child}.csv") for f in files) and any(f.endswith(f"-pid{parent}.csv") for f in files)
    by_file = {}
    for path in glob.glob(str(tmp_path / "sample" / "*.csv")):
        with open(path, newline="") as f:
            by_file[os.path.basename(path)] = [r[2] for r in csv.reader(f)]
    child_rows = next(v for k, v in by_file.items() if k.endswith(f"-pid{child}.csv"))
    parent_rows = next(v for k, v in by_file.items() if k.endswith(f"-pid{parent}.csv"))
    assert child_rows == ["child-uid/sample"]
    assert parent_rows == ["parent-uid/sample"]  # rows the parent wrote before fork are not duplicated


def test_unsampled_samples_skip_otlp_but_reach_legacy_outputs(tmp_path):
    uids = [str(uuid.uuid4()) for _ in range(60)]
    _run(f"""
        import otel_verl
        from otel_verl import events
        otel_verl.configure()
        uids = {uids!r}
        events.samples_created(uids, step=1, trainer="RayPPOTrainer")
        for uid in uids:
            with events.trajectory(uid, "0", step=1, agent_name="single_turn_agent"):
                with events.agent_run("SingleTurnAgentLoop"):
                    with events.llm_call([1, 2, 3], model="tiny") as turn:
                        turn.finish([4, 5], stop_reason="stop")
        events.samples_finished(uids, "trained")
        otel_verl.shutdown()
    """, {"VERL_TRACE_DIR": str(tmp_path), "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
          "OTEL_TRACES_SAMPLER_ARG": "0.5"})
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    from otel_verl.ids import trace_id_for_uid
    from otel_verl.sampling import record_dropped_samples

    sampler = record_dropped_samples(TraceIdRatioBased(0.5))
    expected = {u for u in uids if sampler.is_sampled(trace_id_for_uid(u))}
    assert 0 < len(expected) < len(uids)
    spans = spans_from_files(glob.glob(str(tmp_path / "otlp" / "*.jsonl")))
    exported_uids = {s["attributes"]["verl.uid"] for s in spans}
    assert exported_uids == expected
    assert all(len([s for s in spans if s["attributes"]["verl.uid"] == u]) == 3 for u in expected)  # sample, traj, chat
    rows = _csv_rows(tmp_path)
    assert {r["sample_id"].split("/")[0] for r in rows} == set(uids)  # legacy CSV: every sample
    assert len(rows) == len(uids) * 5


def test_a_provider_installed_first_by_another_library_is_left_alone(tmp_path):
    out = _run("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        theirs = TracerProvider()  # e.g. sglang's, set in its server process first
        trace.set_tracer_provider(theirs)
        import otel_verl
        from otel_verl import bootstrap, events
        assert otel_verl.configure()
        assert trace.get_tracer_provider() is theirs
        assert bootstrap.provider() is not theirs
        events.samples_created(["u-2"], step=3, trainer="RayPPOTrainer")
        otel_verl.shutdown()
        print("ok")
    """, {"VERL_TRACE_DIR": str(tmp_path)})
    assert out.strip() == "ok"
    assert [r["sample_id"] for r in _csv_rows(tmp_path)] == ["u-2/sample"]
    assert [s["name"] for s in spans_from_files(glob.glob(str(tmp_path / "otlp" / "*.jsonl")))] == ["verl.sample"]


def test_bad_optional_values_leave_tracing_on_with_one_warning_each(tmp_path):
    """A process whose optional settings are nonsense still traces, with their defaults:
    no message content, and one warning per bad variable however often it is read."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import otel_verl
        from otel_verl import events, settings
        assert otel_verl.configure() is True
        settings.load()  # read again, as activation and the instrumentation do
        with events.trajectory("u-1", "0", step=1, agent_name="a", decode=lambda ids, **kw: "TEXT"):
            events.chat_messages([{"role": "user", "content": "TEXT"}])
            with events.llm_call([1, 2]) as turn:
                turn.finish([3], stop_reason="stop")
        otel_verl.shutdown()
    """)], env={**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))},
                "VERL_TRACE_DIR": str(tmp_path), "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "verbose",
                "OTEL_VERL_JSONL_MAX_MB": "lots"},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT='verbose'") == 1, proc.stderr
    assert proc.stderr.count("OTEL_VERL_JSONL_MAX_MB='lots'") == 1, proc.stderr
    spans = spans_from_files(glob.glob(str(tmp_path / "otlp" / "*.jsonl")))
    assert sorted(s["name"] for s in spans) == ["chat", "invoke_agent a"]
    assert not any("gen_ai.input.messages" in s["attributes"] for s in spans)
