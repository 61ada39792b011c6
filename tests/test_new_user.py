"""A new user's first hour, command by command as README walks it.

Two walks. On a light install (otel-verl without verl, as where the tools run: the
lowest-versions venv of ``scripts/test-lowest.sh`` is one): ``doctor``, the launcher in
this Python and in one without otel_verl, a misspelt setting, then ``report``, ``report
--perfetto`` and ``replay`` on a run's files. With verl: README's demo command, then the
commands it prints, the replay into a real Jaeger v2, as "Seeing a run in Jaeger" in
docs/BACKENDS.md says. Every command runs as a user starts it: the installed ``otel-verl``
script in a subprocess, its output read as a person would (no traceback, one line per
problem)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest

from otel_binaries import jaeger_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(900)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTEL_VERL = os.path.join(os.path.dirname(sys.executable), "otel-verl")
VERL_INSTALLED = importlib.util.find_spec("verl") is not None


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_TRACE"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def _run(*args: str, env: dict | None = None, timeout: float = 120, cwd: str = REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or _env())
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _lines(text: str) -> list:
    return [line for line in text.splitlines() if line.strip()]


def _write_a_run(trace_dir: str) -> int:
    """Two prompts traced through the events API into OTLP-JSON files, in a child Python
    (a tracing state of its own); returns how many spans it wrote."""
    script = f"""
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from conftest import Pipeline
from otel_verl import events
from otel_verl.exporters.otlp_json_file import OtlpJsonFileExporter
pipeline = Pipeline([SimpleSpanProcessor(OtlpJsonFileExporter({os.path.join(trace_dir, "otlp")!r}))])
uids = ["prompt-a", "prompt-b"]
events.samples_created(uids, step=1, trainer="RayPPOTrainer")
carriers = events.rollout_dispatched(uids, uids, [0, 0], step=1, trainer="RayPPOTrainer")
for uid, carrier in zip(uids, carriers):
    with events.trajectory(uid, uid, step=1, agent_name="tool_agent", parent=carrier):
        with events.llm_call([1, 2], model="m") as turn:
            turn.finish([3], stop_reason="stop")
events.rollout_returned(uids)
events.samples_finished(uids, "trained")
pipeline.provider.force_flush()
print(len(pipeline.spans()))
pipeline.close()
"""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = _run(sys.executable, "-c", script, env=_env(PYTHONPATH=tests_dir), cwd=tests_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


@pytest.mark.skipif(VERL_INSTALLED, reason="verl is installed here: the light-install walk runs where it is not "
                                           "(scripts/test-lowest.sh's venv)")
def test_the_walk_on_a_light_install(tmp_path):
    from test_cli import Collector, _span_ids_json

    from otel_verl.exporters.otlp_json_file import spans_from_files

    trace_dir = str(tmp_path / "trace")
    # doctor: a short page, one problem for the missing verl, with its fix
    # a new user's machine has no engine wheels cached (other tests here fill the cache)
    empty_cache = str(tmp_path / "wheels")
    proc = _run(OTEL_VERL, "doctor", env=_env(VERL_TRACE_DIR=trace_dir, OTEL_VERL_WHEEL_CACHE=empty_cache))
    lines = _lines(proc.stdout + proc.stderr)
    assert len(lines) <= 40, proc.stdout
    problems = [line for line in lines if line.startswith("problem:")]
    assert len(problems) == 1 and "verl" in problems[0], proc.stdout
    assert "otel-verl[verl]" in proc.stdout and "ModuleNotFoundError" not in proc.stdout

    # a misspelt setting is refused before the command runs, naming the right one
    marker = tmp_path / "ran"
    proc = _run(OTEL_VERL, "run", "--trace-dir", trace_dir, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
                env=_env(OTEL_VERL_OFLOAD="1"))
    assert proc.returncode == 2 and "did you mean OTEL_VERL_OFFLOAD?" in proc.stderr, proc.stderr
    assert not marker.exists()

    # the launcher in this Python, which has no verl to trace: the program runs, one line says why nothing is traced
    proc = _run(OTEL_VERL, "run", "--trace-dir", trace_dir, "--", sys.executable, "-c", "print('ran')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
    assert _lines(proc.stderr) == [f"otel_verl: tracing is off in {sys.executable}: verl is not installed here "
                                   "(install otel-verl[verl] where training runs)"]

    # ... and in a Python without otel_verl
    foreign = tmp_path / "foreign"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(foreign)], check=True, timeout=120)
    python = str(foreign / "bin" / "python")
    proc = _run(OTEL_VERL, "run", "--trace-dir", trace_dir, "--", python, "-c", "print('ran')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
    assert _lines(proc.stderr) == [f"otel-verl: tracing is off in {python}: it cannot import otel_verl "
                                   "(install otel-verl in that environment)"]

    # the tools on a run's files: report, its Perfetto trace, replay
    written = _write_a_run(trace_dir)
    assert written > 0
    proc = _run(OTEL_VERL, "report", trace_dir)
    assert proc.returncode == 0 and "Steps (s)" in proc.stdout and "prompt" in proc.stdout.lower(), proc.stdout
    pftrace = os.path.join(trace_dir, "run.pftrace")
    proc = _run(OTEL_VERL, "report", trace_dir, "--perfetto", pftrace)
    if "protobuf 6.31" in proc.stderr:  # the lowest OpenTelemetry pins a protobuf the perfetto package refuses
        assert proc.returncode == 1 and len(_lines(proc.stderr)) == 1, proc.stderr
    else:
        assert proc.returncode == 0 and os.path.getsize(pftrace) > 0, proc.stdout + proc.stderr
    with Collector() as collector:
        proc = _run(OTEL_VERL, "replay", trace_dir, "--endpoint", collector.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = spans_from_files(os.path.join(trace_dir, "otlp"))
    assert len(spans) == written
    assert _span_ids_json(b for _, _, b in collector.requests) == sorted(s["spanId"] for s in spans)


@pytest.mark.verl
@pytest.mark.e2e
def test_the_walk_with_verl_from_the_demo_to_jaeger(tmp_path, jaeger_server):
    out = str(tmp_path / "demo")
    # README's first command, as printed there, with a small run
    proc = _run("bash", "scripts/demo.sh", out, "--steps", "1", "--prompts", "2", "--n", "2", "--agent", "single",
                timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert "next:" in lines, proc.stdout[-3000:]
    commands = [shlex.split(line) for line in lines[lines.index("next:") + 1:] if line.startswith("  otel-verl ")]
    assert [c[1] for c in commands] == ["report", "report", "replay"], commands

    # doctor where training runs: nothing to fix
    proc = _run(OTEL_VERL, "doctor", env=_env(VERL_TRACE_DIR=out))
    assert proc.returncode == 0 and "problem:" not in proc.stdout, proc.stdout[-3000:]

    # the printed report and Perfetto commands, as printed
    report, perfetto, replay = commands
    proc = _run(OTEL_VERL, *report[1:])
    assert proc.returncode == 0 and "Steps (s)" in proc.stdout, proc.stdout
    assert "did not shut down" not in proc.stdout and "unsent" not in proc.stdout, proc.stdout
    proc = _run(OTEL_VERL, *perfetto[1:])
    assert proc.returncode == 0 and os.path.getsize(perfetto[-1]) > 0, proc.stdout + proc.stderr

    # "Seeing a run in Jaeger" (docs/BACKENDS.md), without Docker: the Jaeger built here, the printed
    # replay command pointed at its OTLP/HTTP port, then its API
    endpoint = replay.index("--endpoint") + 1
    replay[endpoint] = f"http://127.0.0.1:{jaeger_server.otlp_http_port}"
    proc = _run(OTEL_VERL, *replay[1:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wanted = {"verl-trainer", "verl-rollout-worker", "verl-llm-server"}
    deadline = time.monotonic() + 30
    while True:  # Jaeger stores what it received a moment later (that section's `curl .../api/v3/services`)
        with urllib.request.urlopen(f"{jaeger_server.query_url}/api/v3/services", timeout=10) as reply:
            services = set(json.load(reply).get("services", ()))
        if wanted <= services or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert wanted <= services, services
