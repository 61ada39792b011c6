"""Activation in every process: runtime env, Hydra overrides, the launcher, the disabled path."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from otel_verl import activation, settings
from otel_verl.tools.cli import launch_env

VERL_INSTALLED = importlib.util.find_spec("verl") is not None


def test_runtime_env_adds_hook_and_forwards_tracing_variables():
    env = {"VERL_TRACE_DIR": "/t", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_VERL_RUN_ID": "r1",
           "DLC_JOB_ID": "job", "HOME": "/root", "SECRET_TOKEN": "x"}
    out = activation.runtime_env({"env_vars": {"OTEL_VERL_RUN_ID": "mine"}, "pip": ["x"]}, env=env)
    assert out["worker_process_setup_hook"] == "otel_verl.activation.worker_setup"
    assert out["pip"] == ["x"]
    assert out["env_vars"] == {"VERL_TRACE_DIR": "/t", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                               "OTEL_VERL_RUN_ID": "mine", "DLC_JOB_ID": "job",
                               "OTEL_RESOURCE_ATTRIBUTES": "verl.run_id=mine"}  # nothing else leaks


@pytest.mark.parametrize("attributes, expected", [
    (None, "verl.run_id=r%2F1"),
    ("team=rl,cluster=a", "team=rl,cluster=a,verl.run_id=r%2F1"),
    ("team=rl, verl.run_id=theirs", "team=rl, verl.run_id=theirs"),  # the user's wins
])
def test_runtime_env_names_the_run_in_the_engines_resource(attributes, expected, monkeypatch):
    """sglang and vLLM build their tracing resource from OTEL_RESOURCE_ATTRIBUTES: the run
    id there puts their spans in the run's collector files."""
    from opentelemetry.sdk.resources import Resource

    env = {"OTEL_VERL_RUN_ID": "r/1", **({"OTEL_RESOURCE_ATTRIBUTES": attributes} if attributes else {})}
    env_vars = activation.runtime_env(None, env=env)["env_vars"]
    assert env_vars["OTEL_RESOURCE_ATTRIBUTES"] == expected
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", expected)  # in the server actor
    engine_resource = Resource.create({"service.name": "sglang"})  # as the engines build it
    assert engine_resource.attributes["verl.run_id"] == ("theirs" if "theirs" in expected else "r/1")


def test_runtime_env_without_a_run_id_leaves_the_resource_alone():
    env_vars = activation.runtime_env(None, env={"OTEL_RESOURCE_ATTRIBUTES": "a=1"})["env_vars"]
    assert env_vars == {"OTEL_RESOURCE_ATTRIBUTES": "a=1"}


def test_runtime_env_keeps_a_users_own_hook(caplog):
    out = activation.runtime_env({"worker_process_setup_hook": "theirs.setup"}, env={})
    assert out["worker_process_setup_hook"] == "theirs.setup"
    assert "self-activation" in caplog.text


def test_hydra_overrides_quote_values_hydra_would_split():
    lines = activation.hydra_overrides({"VERL_TRACE_DIR": "/data/trace", "OTEL_RESOURCE_ATTRIBUTES": "a=1,b=2"})
    assert lines[0] == "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=otel_verl.activation.worker_setup"
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_TRACE_DIR=/data/trace" in lines
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.OTEL_RESOURCE_ATTRIBUTES='a=1,b=2'" in lines


def test_launch_env_puts_sitecustomize_first_and_fixes_run_id(tmp_path):
    env = launch_env({"PYTHONPATH": "/x"}, str(tmp_path))
    first = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(first, "sitecustomize.py"))
    assert env["PYTHONPATH"].endswith(os.pathsep + "/x")
    assert env["VERL_TRACE_DIR"] == str(tmp_path)
    assert env["OTEL_VERL_RUN_ID"]


def test_bad_switch_value_is_a_clear_user_error():
    with pytest.raises(settings.ConfigError, match="OTEL_VERL_FLOW_STDOUT='maybe'"):
        settings.load({"OTEL_VERL_FLOW_STDOUT": "maybe"}, strict=True)
    with pytest.raises(settings.ConfigError, match="OTEL_VERL_JSONL_MAX_MB"):
        settings.load({"OTEL_VERL_JSONL_MAX_MB": "-3"}, strict=True)
    with pytest.raises(settings.ConfigError, match="OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT='loud'"):
        settings.load({settings.CAPTURE_CONTENT: "loud"}, strict=True)


def test_core_switch_bad_value_raises_even_in_process():
    # Tracing on or off is not guessed: a bad value keeps it off with a clear error.
    with pytest.raises(settings.ConfigError, match="OTEL_VERL_ENABLED='maybe'"):
        settings.load({"OTEL_VERL_ENABLED": "maybe"})
    with pytest.raises(settings.ConfigError, match="OTEL_SDK_DISABLED"):
        settings.load({"OTEL_SDK_DISABLED": "perhaps"})


@pytest.mark.parametrize("name, bad, field, default", [
    ("OTEL_VERL_FLOW_STDOUT", "maybe", "flow_stdout", False),
    ("OTEL_VERL_TRACE_VALIDATION", "2", "trace_validation", False),
    ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "loud", "capture_content", False),
    ("OTEL_VERL_JSONL_MAX_MB", "-3", "jsonl_max_bytes", 100 * 1024 * 1024),
    ("OTEL_VERL_MAX_OPEN_SAMPLES", "many", "max_open_samples", 1 << 16),
    ("OTEL_VERL_MAX_QUEUE_MB", "0", "max_queue_bytes", 64 << 20),
    ("OTEL_VERL_JSONL_MAX_TEXT_CHARS", "-1", "jsonl_max_text_chars", 1 << 20),
    ("OTEL_VERL_OTLP_FILE", "yes please", "otlp_file", None),
    ("OTEL_VERL_OFFLOAD", "sometimes", "offload", None),
    ("OTEL_VERL_SHUTDOWN_TIMEOUT_S", "soon", "shutdown_timeout_s", settings.DEFAULT_SHUTDOWN_TIMEOUT_S),
    ("OTEL_VERL_ACCELERATED", "fast", "accelerated", True),
    ("OTEL_VERL_OTLP_EXPORTER", "jaeger", "accelerated", True),  # the deprecated name of the same setting
])
def test_bad_optional_value_in_process_falls_back_with_one_warning(name, bad, field, default, caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    env = {"OTEL_VERL_ENABLED": "1", name: bad}
    with caplog.at_level("WARNING", logger="otel_verl"):
        first = settings.load(env)
        again = settings.load(env)  # every process reads its settings more than once
    assert getattr(first, field) == getattr(again, field) == default
    assert first.enabled  # tracing as a whole stays on
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert f"{name}={bad!r}" in warnings[0] and "tracing goes on" in warnings[0]


@pytest.mark.parametrize("value, on_spans", [
    ("true", True), ("1", True), ("SPAN_ONLY", True), ("span_and_event", True), (" Span_Only ", True),
    ("false", False), ("0", False), ("", False), ("NO_CONTENT", False),
    ("EVENT_ONLY", False),  # otel_verl emits no GenAI events: nothing to put the content on
])
def test_content_capture_accepts_util_genai_modes(value, on_spans, caplog):
    with caplog.at_level("WARNING", logger="otel_verl"):
        assert settings.load({settings.CAPTURE_CONTENT: value}, strict=True).capture_content is on_spans
    assert not caplog.records


def test_shutdown_timeout_is_positive_seconds():
    assert settings.load({}).shutdown_timeout_s == settings.DEFAULT_SHUTDOWN_TIMEOUT_S == 10.0
    assert settings.load({"OTEL_VERL_SHUTDOWN_TIMEOUT_S": "2.5"}).shutdown_timeout_s == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(settings.ConfigError, match=f"OTEL_VERL_SHUTDOWN_TIMEOUT_S='{bad}'"):
            settings.load({"OTEL_VERL_SHUTDOWN_TIMEOUT_S": bad}, strict=True)


def test_rollout_workers_and_the_trainer_offload_their_outputs_by_default():
    from otel_verl.semconv import Role

    default = settings.load({})
    assert default.offloads(Role.AGENT_LOOP_WORKER.value) and default.offloads(Role.TRAINER.value)
    assert not any(default.offloads(role.value) for role in Role if role not in (Role.AGENT_LOOP_WORKER, Role.TRAINER))
    assert all(settings.load({"OTEL_VERL_OFFLOAD": "1"}).offloads(role.value) for role in Role)
    assert not any(settings.load({"OTEL_VERL_OFFLOAD": "0"}).offloads(role.value) for role in Role)
    with pytest.raises(settings.ConfigError, match="OTEL_VERL_OFFLOAD='sometimes'"):
        settings.load({"OTEL_VERL_OFFLOAD": "sometimes"}, strict=True)


def test_cli_run_rejects_bad_config_without_traceback():
    env = {**os.environ, "OTEL_VERL_FLOW_STDOUT": "maybe"}
    proc = subprocess.run([sys.executable, "-m", "otel_verl.tools.cli", "run", "--", "true"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "OTEL_VERL_FLOW_STDOUT" in proc.stderr and "Traceback" not in proc.stderr


def test_disabled_process_installs_nothing_and_builds_no_provider():
    code = textwrap.dedent("""
        import sys
        from otel_verl import activation, bootstrap
        from otel_verl.instrumentation import hooks
        assert activation.activate() is False
        assert bootstrap.configure() is False
        assert hooks.status() == {}
        assert not bootstrap.is_configured()
        assert not any(m in sys.modules for m in ("verl", "torch", "ray")), [m for m in ("verl","torch","ray") if m in sys.modules]
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


# A carrier sent by a traced process of run-a, with settings a receiver must not take on.
SENDER_ENV = {"VERL_TRACE_DIR": "/tmp/run-a-trace", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://run-a-collector:4317",
              "OTEL_VERL_RUN_ID": "run-a"}
SEND = """
    import pickle, sys
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
    from otel_verl import activation, carriers
    span = NonRecordingSpan(SpanContext(0x1234, 0x5678, False, TraceFlags(TraceFlags.SAMPLED)))
    sys.stdout.write(pickle.dumps(carriers.TraceCarrier.from_span(span, {"uid": "u-1"})).hex())
"""
RECEIVE = """
    import os, pickle, sys
    before = dict(os.environ)
    carrier = pickle.loads(bytes.fromhex(sys.stdin.read()))
    from otel_verl import activation
    changed = sorted(k for k in {**before, **os.environ} if before.get(k) != os.environ.get(k))
    print(carrier.headers["traceparent"][36:52], activation.is_active(), changed)
"""


def _python(code: str, env: dict, stdin: str = "") -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=stdin, env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip()


def test_a_carrier_changes_nothing_in_the_environment_where_it_arrives():
    carrier = _python(SEND, SENDER_ENV)
    assert _python(RECEIVE, {}, carrier) == "0000000000005678 False []"


@pytest.mark.parametrize("receiver_run_id, switched_on", [("run-a", True), ("run-b", False), (None, False)])
def test_a_carrier_switches_tracing_on_only_in_a_process_of_its_run(receiver_run_id, switched_on):
    receiver_env = {"OTEL_VERL_ENABLED": "1", **({"OTEL_VERL_RUN_ID": receiver_run_id} if receiver_run_id else {})}
    assert _python(RECEIVE, receiver_env, _python(SEND, SENDER_ENV)) == f"0000000000005678 {switched_on} []"


class _OlderFormatCarrier:
    """A carrier as the older format pickled it: the sender's settings where the run id is now."""

    def __reduce__(self):
        headers = {"traceparent": "00-00000000000000000000000000001234-0000000000005678-01"}
        return activation.restore_carrier, (headers, SENDER_ENV, {"uid": "u-1"})


def test_an_older_format_carrier_unpickles_and_switches_nothing_on():
    import pickle

    carrier = pickle.dumps(_OlderFormatCarrier()).hex()
    receiver_env = {"OTEL_VERL_ENABLED": "1", "OTEL_VERL_RUN_ID": "run-a"}
    assert _python(RECEIVE, receiver_env, carrier) == "0000000000005678 False []"


LAUNCHED = textwrap.dedent("""
    import os, ray
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Nested:
        def probe(self):
            from otel_verl import activation
            return activation.setup_hook_calls, activation.is_active(), os.environ.get("OTEL_VERL_RUN_ID")

    @ray.remote(num_cpus=0)
    class Parent:
        def probe(self):
            from otel_verl import activation
            child = Nested.remote()
            return (activation.setup_hook_calls, activation.is_active(), os.environ.get("OTEL_VERL_RUN_ID"),
                    ray.get(child.probe.remote()))

    from otel_verl import activation
    print("DRIVER", activation.is_active(), os.environ["OTEL_VERL_RUN_ID"])
    print("ACTORS", ray.get(Parent.remote().probe.remote()))
    ray.shutdown()
    raise SystemExit(7)
""")


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_launcher_activates_driver_actor_and_nested_actor(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(LAUNCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OTEL_VERL_RUN_ID": "launch-1"})
    proc = subprocess.run(
        [sys.executable, "-m", "otel_verl.tools.cli", "run", "--trace-dir", str(tmp_path / "trace"), "--", sys.executable, str(script)],
        env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 7, proc.stderr[-3000:]  # the command's exit code passes through
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("DRIVER", "ACTORS")))
    assert lines["DRIVER"] == "True launch-1"
    parent_calls, parent_active, parent_run, nested = eval(lines["ACTORS"])  # noqa: S307 - our own repr
    assert (parent_calls, parent_active, parent_run) == (1, True, "launch-1")
    assert tuple(nested) == (1, True, "launch-1")


# The second sitecustomize a user's environment already had (a distro's, a venv's): the
# launcher's must hand over to it in every Python.
PROBE_SITECUSTOMIZE = "import sys\nprint('probe sitecustomize ran in', sys.executable)\n"
LAUNCHED_CHECK = "import sys; print('command ran, otel_verl activated:', 'otel_verl.activation' in sys.modules)"


def _launch(python: str, tmp_path) -> subprocess.CompletedProcess:
    """``otel-verl run --trace-dir T -- PYTHON -c ...`` with a second sitecustomize on PYTHONPATH."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE_SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "otel_verl.tools.cli", "run", "--trace-dir", str(tmp_path / "trace"), "--",
         python, "-c", LAUNCHED_CHECK],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,  # not a checkout: its otel_verl is importable
    )


def test_launcher_in_a_python_without_otel_verl_says_so_in_one_line_and_chains_on(tmp_path):
    """A Python the launched command starts may not have otel_verl (a system Python, a venv
    of its own): the launcher's sitecustomize says so once and runs the next one."""
    venv = tmp_path / "foreign-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    foreign = str(venv / "bin" / "python")
    if subprocess.run([foreign, "-c", "import otel_verl"], capture_output=True, cwd=tmp_path).returncode == 0:
        pytest.skip("otel_verl is installed in the base Python itself: no Python without it here")
    proc = _launch(foreign, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"probe sitecustomize ran in {foreign}" in proc.stdout.splitlines()
    assert "command ran, otel_verl activated: False" in proc.stdout.splitlines()
    assert proc.stderr.splitlines() == [
        f"otel-verl: tracing is off in {foreign}: it cannot import otel_verl (install otel-verl in that environment)"]


def test_launcher_in_a_python_with_otel_verl_activates_and_chains_on(tmp_path):
    proc = _launch(sys.executable, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"probe sitecustomize ran in {sys.executable}" in proc.stdout.splitlines()
    assert "command ran, otel_verl activated: True" in proc.stdout.splitlines()
    assert "Error in sitecustomize" not in proc.stderr, proc.stderr
    # where verl is missing (the lowest-versions venv) the one line that says so is all
    said = [line for line in proc.stderr.splitlines() if "tracing is off" in line]
    assert said == ([] if VERL_INSTALLED else [
        f"otel_verl: tracing is off in {sys.executable}: verl is not installed here "
        "(install otel-verl[verl] where training runs)"]), proc.stderr
