"""The seed-comparison benchmark runs in a reduced size and its output is consistent.

Only breakage is caught here (no timing assertions: CI machines are noisy): every variant
ran, the legacy outputs hold exactly the rows the events call for, nothing was dropped,
and the report has every target row.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.verl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_seed_comparison.py")


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "result.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("RAY_AUTH_MODE", "disabled")
    doc = os.path.join(ROOT, "docs", "PERFORMANCE.md")
    before = open(doc, encoding="utf-8").read() if os.path.exists(doc) else None
    proc = subprocess.run([sys.executable, SCRIPT, "--scale", "ci", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = open(doc, encoding="utf-8").read() if os.path.exists(doc) else None
    assert before == after, "--scale ci must leave docs/PERFORMANCE.md alone"
    return json.loads(out.read_text()), proc.stdout


def test_every_variant_and_scenario_present(ci_run):
    result, stdout = ci_run
    assert set(result["scenarios"]) == {"A", "B"}
    for scenario in result["scenarios"].values():
        assert set(scenario["variants"]) == {"seed", "legacy", "legacy+otlp", "legacy+otlp offload"}
        for row in scenario["variants"].values():
            for key in ("total_s", "trainer_s", "worker_s", "server_s", "per_traj_us"):
                assert math.isfinite(row[key])
        # the export process's CPU is read apart, and only that variant has one
        assert scenario["variants"]["legacy+otlp offload"]["worker_export_s"] > 0
        assert scenario["variants"]["legacy+otlp"]["worker_export_s"] == 0
    for label in ("Per step, by variant", "Against the goals", "Installed-but-disabled", "legacy+otlp", "seed",
                  "via its export process"):
        assert label in stdout


def test_otel_verl_wrote_every_expected_row_and_dropped_nothing(ci_run):
    result, _ = ci_run
    for scenario in result["scenarios"].values():
        expected = scenario["expected"]
        for variant in ("legacy", "legacy+otlp", "legacy+otlp offload"):
            row = scenario["variants"][variant]
            assert row["health"]["dropped"] == {}, (variant, row["health"])
            assert row["health"]["failures"] == {}, (variant, row["health"])
            for key in ("csv_rows", "jsonl_lines", "task_lines"):
                assert row["outputs"][key] == expected[key], (variant, key, row["outputs"], expected)
            assert row["outputs"]["flow_stdout_lines"] == 0  # [FLOW_TRACE] stdout is opt-in


def test_seed_baseline_accounts_for_every_row(ci_run):
    result, _ = ci_run
    for scenario in result["scenarios"].values():
        seed = scenario["variants"]["seed"]
        expected = scenario["expected"]
        assert seed["seed_rows_offered"] == expected["csv_rows"]
        # the seed printed every row, and wrote the ones its queue accepted
        assert seed["outputs"]["flow_stdout_lines"] == expected["csv_rows"]
        assert seed["outputs"]["csv_rows"] == expected["csv_rows"] - seed["seed_dropped"]
        assert seed["outputs"]["jsonl_lines"] == expected["jsonl_lines"]
        assert seed["outputs"]["task_lines"] == expected["task_lines"]


def test_sustained_memory_and_disabled_sections(ci_run):
    result, _ = ci_run
    sustained = result["sustained"]
    assert sustained["steps"] >= 3
    assert sustained["health"]["dropped"] == {}
    assert sustained["outputs"]["csv_rows"] == sustained["expected"]["csv_rows"]
    assert result["memory"]["steps"] >= 3 and math.isfinite(result["memory"]["growth_mb"])
    assert result["disabled"] and all(math.isfinite(v) for v in result["disabled"].values())


def test_worker_overhead_seed_replay_writes_the_seeds_outputs(tmp_path, monkeypatch):
    """bench_worker_overhead's in-process seed row runs the seed's hooks for real: every
    trajectory leaves its CSV rows, its JSONL line and its Task line; the bare baseline
    writes nothing."""
    from transformers import AutoTokenizer

    from otel_verl.demo.tiny_model import ensure_tiny_model

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_seed_comparison
    import bench_worker_overhead as bench

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    trajectories, turns = 8, 2
    bench._seed_micro_workload(trajectories, turns, tokenizer, None)  # bare: nothing to write
    replay = bench_seed_comparison.Seed(str(tmp_path / "seed"))
    replay.step = 1
    bench._seed_micro_workload(trajectories, turns, tokenizer, replay)
    replay.flush()
    replay.close()

    def lines(sub):
        root = tmp_path / "seed" / sub
        return [line for path in sorted(root.iterdir()) for line in path.read_text().splitlines()]

    rows = lines("sample")
    # per trajectory: agent_task_started, two LLM_GENERATE rows a turn, the reward, agent_run_completed
    assert len(rows) == trajectories * (3 + 2 * turns)
    jsonl = [json.loads(line) for line in lines("trajectory")]
    assert len(jsonl) == trajectories
    assert all(len(json.loads(t["raw_message"])["turns"]) == turns for t in jsonl)
    assert sum(line.startswith("Task ") for line in lines("progress")) == trajectories


def test_the_wrapper_benchmark_runs_and_loses_nothing(tmp_path):
    """bench_worker_wrappers (the per-turn figures through the real wrappers), tiny
    size: both configurations ran, every measure is a number, no span or line was lost."""
    out = tmp_path / "wrappers.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_worker_wrappers.py"), "--quick",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [r["offload"] for r in results.values()] == ["1", "0"]
    for result in results.values():
        assert result["health"] == {"failures": {}, "dropped": {}}
        assert set(result["best"]) == {f"{mode}/{agent}" for mode in ("stock", "traced") for agent in ("single", "llm4", "tool4")}
        assert all(math.isfinite(v) for row in result["best"].values() for v in row.values())
    assert "per LLM turn" in proc.stdout and "via an export process" in proc.stdout


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="valgrind (Debian package) is not installed")
def test_the_instruction_count_benchmark_counts_the_measured_round(tmp_path):
    """bench_worker_instructions (callgrind around one measured round), tiny size: every
    configuration counted, tracing adds instructions to a trajectory and to an LLM turn."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_worker_instructions.py"), "--quick"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = dict(re.findall(r"\((\w+, \w+)\): (\d+)k a trajectory", proc.stdout))
    assert set(counts) == {f"{agent}, {mode}" for agent in ("single", "llm4") for mode in ("stock", "traced")}
    assert all(int(v) > 0 for v in counts.values())
    added = dict(re.findall(r"per (single-turn trajectory|extra LLM turn): +(-?\d+)k", proc.stdout))
    assert int(added["single-turn trajectory"]) > 0 and int(added["extra LLM turn"]) > 0, proc.stdout


def test_the_sdk_cost_benchmark_prices_a_trajectorys_spans_and_records():
    """bench_sdk_costs, tiny size: a single-turn trajectory's 4 spans and 9 metric records
    (trajectory 1, LLM call 3, server 4, reward 1) are priced, and the metrics processor
    with each backend."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_sdk_costs.py"), "--quick"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "spans per trajectory: 4 (" in proc.stdout, proc.stdout
    assert re.search(r"metric records: 9 per trajectory x [\d.]+ us", proc.stdout), proc.stdout
    assert re.search(r"OTLP protobuf encoding: [1-9]\d* us per trajectory", proc.stdout), proc.stdout
    assert re.search(r"metrics processor: -?[\d.]+ us per trajectory with its own aggregation, -?[\d.]+ us into",
                     proc.stdout), proc.stdout


def test_the_span_cost_benchmark_prices_each_output_by_kind_of_span():
    """bench_span_costs, tiny size: a row per output and for the events API, a column per
    kind of span, nothing lost."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_span_costs.py"), "--quick"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for part in ("events API, no output (the calling thread)", "sample_csv", "progress_log", "trajectory_jsonl",
                 "otlp_json_file", "otlp", "metrics", "all of the above"):
        assert re.fullmatch(r"\| [^|]+ \| -?\d+ µs \| -?\d+ µs \| -?\d+ µs \|", rows[part]), proc.stdout
    assert "dropped: none; failures: none" in proc.stdout, proc.stdout


def test_the_perfetto_benchmark_converts_every_generated_span(tmp_path):
    """bench_perfetto, tiny size (16 prompts x 4 trajectories of 2 turns): every generated
    span is a slice of the file it timed, with a track and a flow per trajectory."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_perfetto.py"), "--quick",
                           "--json", str(out), "--keep", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # the step and its 9 stages, verl.fit; per prompt 7 trainer spans; per trajectory the agent span,
    # 2 turns and their server requests, a tool call, the reward and the reward worker's span
    assert result["spans"] == 11 + 16 * 7 + 16 * 4 * 8
    assert result["slices"] == result["spans"] and result["left_out"] == {}
    assert result["trajectory_tracks"] == result["flows"] == 16 * 4
    assert math.isfinite(result["total_s"]) and result["bytes"] == (tmp_path / "step.pftrace").stat().st_size
    trace = pb.Trace()
    trace.ParseFromString((tmp_path / "step.pftrace").read_bytes())
    starts = [p for p in trace.packet if p.HasField("track_event")
              and p.track_event.type in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_INSTANT)]
    assert len(starts) == result["spans"]
    assert f"{result['spans']:,} spans" in proc.stdout and "conversion: " in proc.stdout and " MB, " in proc.stdout


def test_the_otlp_encoder_benchmark_prices_each_kind_of_span(tmp_path):
    """bench_otlp_encoder, tiny size: every kind of span priced for both encoders (the
    benchmark itself checks that our bytes are the SDK's), nothing lost or failed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_otlp_encoder.py"), "--quick",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"chat", "trajectory", "stage", "whole step"}
    for row in result["rows"].values():
        assert row["spans"] > 0 and row["attributes_per_span"] > 0
        assert all(math.isfinite(row[key]) and row[key] > 0
                   for key in ("sdk_us", "ours_us", "ours_encoding_us", "ours_json_us"))
    assert result["rows"]["chat"]["attributes_per_span"] >= 12
    assert result["health"]["failures"] == {} and result["health"]["dropped"] == {}
    assert "records_of + encode" in proc.stdout and "whole step" in proc.stdout


def test_the_report_scale_benchmark_loads_each_step_once_and_queries_every_step(tmp_path):
    """bench_report_scale, tiny size (2 and 4 steps of 16 prompts x 4): the first load holds
    every generated span, the next load only the appended step's, and the whole-run and
    one-step queries and the store's report see every step and trajectory, and one step's Perfetto trace holds that step's spans."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_report_scale.py"), "--quick",
                           "--json", str(out), "--work", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # per step: the step and its 9 stages; per prompt 7 trainer spans; per trajectory the agent
    # span, its turn and server request, the reward and the reward worker's span; verl.fit once
    step_spans = 10 + 16 * 7 + 16 * 4 * 5
    assert result["step_spans"] == step_spans
    assert [row["steps"] for row in result["rows"]] == [2, 4]
    for row in result["rows"]:
        steps, first, second = row["steps"], row["first_load"], row["second_load"]
        assert row["spans"] == first["spans"] == first["rows"] == 1 + steps * step_spans
        assert second["spans"] == step_spans and second["rows"] == first["rows"] + step_spans
        assert 0 < first["parts_bytes"] <= row["store_bytes"] and row["ratio"] == row["store_bytes"] / row["json_bytes"]
        assert first["parts"] >= 1
        queries = row["queries"]["queries"]
        assert [r[:2] for r in queries["run/trajectories"]["rows"]] == [[s, 16 * 4] for s in range(1, steps + 1)]
        assert len(queries["run/stages"]["rows"]) == steps * 9
        assert queries["step/trajectories"]["rows"][0][:2] == [row["one_step"], 16 * 4]
        assert {r[0] for r in queries["step/stages"]["rows"]} == {row["one_step"]}
        assert len(queries["step/stages"]["rows"]) == 9
        assert queries["run/report"]["rows"] == [[s] for s in range(1, steps + 1)]
        assert queries["step/report"]["rows"] == [[row["one_step"]]]
        assert row["perfetto"]["spans"] == row["perfetto"]["slices"] == step_spans  # one step's, each a slice
        for query in queries.values():
            assert math.isfinite(query["first_s"]) and math.isfinite(query["median_s"])
        assert all(m["rss_mb"] > 0 for m in (first, second, row["queries"], row["perfetto"]))
    assert "store / JSON: at most" in proc.stdout and "one step, trajectories (warm)" in proc.stdout
    assert not list(tmp_path.glob("bench-report-scale-*")), "the generated run is deleted"
