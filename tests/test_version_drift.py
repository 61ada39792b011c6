"""A verl release that moved or changed a hooked method: the hook is skipped with one
warning in each process that imports it, and the traced run still completes."""

import csv
import glob
import os

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.timeout(900)]


def test_removed_and_changed_hooks_are_skipped_and_the_run_completes(tmp_path, monkeypatch):
    from demo_process import run_in_child

    from otel_verl import activation
    from otel_verl.exporters.otlp_json_file import spans_from_files

    monkeypatch.setenv("VERL_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("OTEL_VERL_RUN_ID", "drift-run")
    runtime_env = activation.runtime_env()
    runtime_env["worker_process_setup_hook"] = "drift_setup.setup"
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
    summary = run_in_child("harness", {
        "output_dir": str(tmp_path / "harness"), "steps": 1, "prompts": 2, "n": 2, "agent": "single", "validate": False,
        "trainer_in_actor": True, "runtime_env": runtime_env, "_report_logs_dir": True,
    }, str(tmp_path / "run"))
    logs = summary["logs_dir"]
    assert summary["steps_run"] == 1 and summary["trajectories_per_step"] == {"1": 4}

    per_process = {}  # one warning per skipped hook in each process that imports its module
    for path in glob.glob(os.path.join(logs, "worker-*.err")):
        with open(path, errors="replace") as f:
            per_process[path] = [line for line in f if "otel_verl: hook" in line and "skipped" in line]
    ref = [[w for w in lines if "RayPPOTrainer._compute_ref_log_prob" in w] for lines in per_process.values()]
    tool = [[w for w in lines if "ToolAgentLoop._call_tool" in w] for lines in per_process.values()]
    assert any(ref) and any(tool)
    assert all(len(w) <= 1 for w in ref + tool)
    assert all("parameters changed (missing batch)" in w[0] for w in ref if w)
    assert all("ToolAgentLoop._call_tool not found" in w[0] for w in tool if w)

    # everything else is still traced; the skipped stage simply has no rows/spans
    stages = set()
    for path in glob.glob(str(tmp_path / "sample" / "*.csv")):
        with open(path, newline="") as f:
            stages |= {dict(p.split("=", 1) for p in row[5].split("|"))["stage"] for row in csv.reader(f)}
    assert "TRAIN_REF_LOGPROB" not in stages
    assert {"DATA_PREPROCESS", "AGENT_LOOP", "LLM_GENERATE", "TRAIN_LOGPROB", "TRAIN_UPDATE"} <= stages
    names = {s["name"] for s in spans_from_files(glob.glob(str(tmp_path / "otlp" / "*.jsonl")))}
    assert "verl.sample_stage ref_log_prob" not in names and "verl.sample_stage old_log_prob" in names
