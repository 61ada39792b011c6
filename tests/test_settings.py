"""otel_verl's variable names: a misspelt ``OTEL_VERL_*`` setting is named with the closest
known one, refused where the user types it (``otel-verl run``, ``doctor``), a warning in a
traced process; every name the project itself uses is known; ``OTEL_VERL_ACCELERATED`` and
the deprecated name it replaces."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from otel_verl import settings

ROOT = Path(__file__).resolve().parent.parent
# This module's own names are misspelt on purpose; everything else the project ships is scanned.
SCANNED = ("otel_verl", "tests", "scripts", "benchmarks", "collector-config", "docs", ".ci", "README.md",
           "docker-compose.yml", "pyproject.toml")
# a misspelling other tests set to see it refused, as a user would
MISSPELT_ON_PURPOSE = {"tests/test_new_user.py": {"OTEL_VERL_OFLOAD"}}


@pytest.mark.parametrize("name, closest", [
    ("OTEL_VERL_OFLOAD", "OTEL_VERL_OFFLOAD"),
    ("OTEL_VERL_SHUTDOWN_TIMEOUT", "OTEL_VERL_SHUTDOWN_TIMEOUT_S"),
    ("otel_verl_offload", "OTEL_VERL_OFFLOAD"),  # the case matters to the process that reads it
    ("OTEL_VERL_TRACE_DIR", "VERL_TRACE_DIR"),  # the legacy switch has no OTEL_ prefix
    ("OTEL_VERL_COLOUR", None),
])
def test_unknown_name_is_refused_with_the_closest_known_one(name, closest):
    with pytest.raises(settings.UnknownSetting) as caught:
        settings.load({"VERL_TRACE_DIR": "/t", name: "1"}, strict=True)
    assert (caught.value.name, caught.value.closest) == (name, closest)
    expected = f"{name} is not a setting of otel_verl" + (f"; did you mean {closest}?" if closest else "")
    assert str(caught.value) == expected


def test_known_names_come_from_the_settings_constants():
    known = settings.known_names()
    assert {settings.OFFLOAD, settings.SHUTDOWN_TIMEOUT_S, settings.RUN_ID, settings.ROLE, settings.FORCE} <= known
    assert set(settings.OTHER_VARIABLES) <= known
    assert all(name.startswith(settings.OWN_PREFIX) for name in known)
    assert settings.load({name: "1" for name in settings.OTHER_VARIABLES}, strict=True)  # none is refused


def test_unknown_name_in_a_traced_process_is_one_warning_and_tracing_goes_on(caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    env = {"VERL_TRACE_DIR": "/t", "OTEL_VERL_OFLOAD": "1"}
    with caplog.at_level("WARNING", logger="otel_verl"):
        first = settings.load(env)
        settings.load(env)  # every process reads its settings more than once
    assert first.enabled and first.offload is None  # ignored: the default
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == ("otel_verl: OTEL_VERL_OFLOAD is not a setting of otel_verl; did you mean OTEL_VERL_OFFLOAD?; "
                       "ignored, tracing goes on")


@pytest.mark.parametrize("env, accelerated", [
    ({}, True),
    ({"OTEL_VERL_ACCELERATED": "false"}, False),
    ({"OTEL_VERL_ACCELERATED": "0"}, False),
    ({"OTEL_VERL_ACCELERATED": " True "}, True),
    ({"OTEL_VERL_ACCELERATED": ""}, True),  # blank is unset: the accelerators stay on
])
def test_accelerated_is_a_flag_on_by_default(env, accelerated, caplog):
    with caplog.at_level("WARNING", logger="otel_verl"):
        assert settings.load(env, strict=True).accelerated is accelerated
    assert not caplog.records


def test_a_bad_accelerated_value_is_refused_where_the_user_types_it():
    with pytest.raises(settings.ConfigError, match="OTEL_VERL_ACCELERATED='fast': expected one of 1/0, true/false"):
        settings.load({"OTEL_VERL_ACCELERATED": "fast"}, strict=True)
    with pytest.raises(settings.ConfigError, match="OTEL_VERL_OTLP_EXPORTER='jaeger': expected one of otel_verl, sdk"):
        settings.load({"OTEL_VERL_OTLP_EXPORTER": "jaeger"}, strict=True)


@pytest.mark.parametrize("old, accelerated", [("sdk", False), ("SDK", False), ("otel_verl", True)])
def test_the_deprecated_otlp_exporter_variable_maps_to_accelerated_with_one_warning(old, accelerated, caplog,
                                                                                    monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    env = {"VERL_TRACE_DIR": "/t", "OTEL_VERL_OTLP_EXPORTER": old}
    with caplog.at_level("WARNING", logger="otel_verl"):
        assert settings.load(env).accelerated is accelerated
        assert settings.load(env, strict=True).accelerated is accelerated  # known: the CLI does not refuse it
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (f"otel_verl: OTEL_VERL_OTLP_EXPORTER={old} is deprecated; "
                       f"read as OTEL_VERL_ACCELERATED={str(accelerated).lower()}")


def test_accelerated_set_wins_over_the_deprecated_variable(caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    env = {"OTEL_VERL_ACCELERATED": "true", "OTEL_VERL_OTLP_EXPORTER": "sdk"}
    with caplog.at_level("WARNING", logger="otel_verl"):
        assert settings.load(env).accelerated is True
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == "otel_verl: OTEL_VERL_OTLP_EXPORTER is deprecated and ignored: OTEL_VERL_ACCELERATED is set"


def test_run_refuses_a_misspelt_setting_before_the_command(tmp_path):
    """As it refuses a bad value: the command does not start."""
    marker = tmp_path / "started"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env["OTEL_VERL_OFLOAD"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "otel_verl.tools.cli", "run", "--trace-dir", str(tmp_path / "trace"), "--",
         sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "Error: OTEL_VERL_OFLOAD is not a setting of otel_verl; did you mean OTEL_VERL_OFFLOAD?")
    assert not marker.exists()


def test_doctor_flags_a_misspelt_setting_and_checks_the_rest(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from otel_verl.tools import cli

    monkeypatch.setattr(cli, "_version_checks", lambda: [])  # whether verl is installed here: test_cli's
    env = {**{k: None for k in os.environ if k.startswith(("OTEL_", "VERL_"))},
           "VERL_TRACE_DIR": str(tmp_path), "OTEL_VERL_OFLOAD": "1", "OTEL_VERL_JSONL_MAX_MB": "7"}
    result = CliRunner(env=env).invoke(cli.main, ["doctor", "--no-hooks"], catch_exceptions=False)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    problem = lines.index("problem: environment: OTEL_VERL_OFLOAD is not a setting of otel_verl; "
                          "did you mean OTEL_VERL_OFFLOAD?")
    assert lines[problem + 1] == "  fix: rename it to OTEL_VERL_OFFLOAD"
    assert lines[-1] == "doctor: 1 problem(s)"
    assert f"{tmp_path}: writable" in result.stdout  # the other settings are still checked


def _shipped_files():
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        for file in files:
            if file != Path(__file__).resolve() and "__pycache__" not in file.parts:
                yield file


def test_every_otel_verl_name_the_project_uses_is_known():
    """A variable that a tool, the demo, a shipped backend or a test reads is no misspelling:
    a new one is defined in settings (a constant, or OTHER_VARIABLES) or `run` refuses it."""
    known = settings.known_names()
    used = {}
    for file in _shipped_files():
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (images)
        where = str(file.relative_to(ROOT))
        for name in set(re.findall(r"OTEL_VERL_[A-Z0-9_]*[A-Z0-9]", text)) - MISSPELT_ON_PURPOSE.get(where, set()):
            used.setdefault(name, where)
    # a prefix the code tests names with (startswith) is no name of its own
    unknown = {n: f for n, f in used.items() if n not in known and not any(k.startswith(n) for k in known)}
    assert not unknown, unknown
