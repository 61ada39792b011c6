"""``otel-verl report --compare A B``: on synthetic runs whose ratios are known exactly
(``otlp_runs``), and on two real demo runs that differ in n."""

from __future__ import annotations

import collections
import json
import os

import pytest
from click.testing import CliRunner

from otel_verl.tools.cli import main
from otel_verl.tools.report.compare import compare
from reference_report import percentile
from store_checks import report_of
from test_cli import _merged_s

from otlp_runs import async_run, straggler_run

exact = lambda value: pytest.approx(value, abs=1e-9)  # noqa: E731  (times are whole nanoseconds)


def _write(run, tmp_path) -> str:
    return run.write(str(tmp_path / run.run_id))


def _cli(*args: str):
    return CliRunner().invoke(main, ["report", *args], catch_exceptions=False)


def _table(stdout: str, title: str) -> list:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 3, len(lines)) if not lines[i].strip()), len(lines))
    return [line.split() for line in lines[start + 3:end]]


def build_comparison(a: str, b: str):
    """``otel-verl report --compare A B --json``'s dict, built in this process."""
    return compare(report_of([a]), report_of([b]))


def test_a_run_twice_as_slow_is_2x_everywhere(tmp_path):
    a = _write(straggler_run(run_id="a"), tmp_path)
    b = _write(straggler_run(run_id="b", scale=2.0), tmp_path)
    result = build_comparison(a, b)
    assert result["differences"] == []
    assert result["summary"] == "the runs have the same shape: RayPPOTrainer, colocated, sync, 2 prompts x n=2, 2 steps"
    assert [(r["step"], r["a_s"], r["b_s"], r["ratio"]) for r in result["steps"]] == [
        (1, exact(20.0), exact(40.0), exact(2.0)), (2, exact(10.0), exact(20.0), exact(2.0))]
    assert result["steps_total"] == {"a_s": exact(30.0), "b_s": exact(60.0), "ratio": exact(2.0)}
    stages = {r["stage"]: r for r in result["stages"]}
    assert list(stages) == ["generation", "reward", "old_log_prob", "update_actor", "sync_params", "other"]
    assert stages["update_actor"]["a_s"] == exact(9.0)  # 4 s in step 1, 5 s in step 2
    assert all(r["ratio"] == exact(2.0) for r in stages.values())
    step_1 = result["rollout_latency"][0]
    assert step_1["step"] == 1 and step_1["a"]["count"] == step_1["b"]["count"] == 4 and step_1["ratio"]["count"] == 1.0
    # step 1's trajectories take 1, 1.1, 1.7 and 10 s
    assert (step_1["a"]["p50_s"], step_1["a"]["max_s"]) == (exact(1.4), exact(10.0))
    assert step_1["a"]["p90_s"] == exact(percentile([1.0, 1.1, 1.7, 10.0], 90))
    for row in result["rollout_latency"]:
        assert all(row["ratio"][key] == exact(2.0) for key in ("p50_s", "p90_s", "p99_s", "max_s"))


def test_runs_of_different_sizes_are_compared_on_the_steps_they_share(tmp_path):
    a = _write(straggler_run(run_id="a"), tmp_path)
    b = _write(straggler_run(run_id="b", scale=2.0, extra_step=True), tmp_path)
    result = build_comparison(a, b)
    assert result["differences"] == [{"what": "steps", "a": 2, "b": 3}]
    assert result["summary"] == "the runs differ: steps 2 vs 3; compared on what they share: 2 step(s), 5 stage(s)"
    assert [r["step"] for r in result["steps"]] == [1, 2] and [r["step"] for r in result["rollout_latency"]] == [1, 2]
    # B's third step is left out of the stage sums: still 2x (with it update_actor would be 28 / 9)
    assert all(r["ratio"] == exact(2.0) for r in result["stages"])


def test_runs_of_different_trainers_and_modes_say_how_they_differ(tmp_path):
    a = _write(straggler_run(run_id="a"), tmp_path)
    b = _write(async_run(), tmp_path)
    result = build_comparison(a, b)
    assert result["differences"] == [
        {"what": "trainer", "a": "RayPPOTrainer", "b": "PPOTrainerV1"},
        {"what": "layout", "a": "colocated", "b": "disaggregated"},
        {"what": "mode", "a": "sync", "b": "async"},
        {"what": "n", "a": 2, "b": 1},
        {"what": "steps", "a": 2, "b": 1},
        {"what": "stages only in one", "a": ["generation", "reward"], "b": ["fetch_batch"]},
    ]
    assert result["summary"].startswith("the runs differ: trainer RayPPOTrainer vs PPOTrainerV1; layout colocated vs "
                                        "disaggregated; mode sync vs async; n 2 vs 1; steps 2 vs 1; stages only in one "
                                        "generation, reward vs fetch_batch; compared on what they share: 1 step(s), 3 stage(s)")
    stages = {r["stage"]: r for r in result["stages"]}
    assert list(stages) == ["old_log_prob", "update_actor", "sync_params", "other"]
    assert (stages["update_actor"]["a_s"], stages["update_actor"]["b_s"]) == (exact(4.0), exact(3.0))
    assert stages["update_actor"]["ratio"] == exact(0.75)
    [latency] = result["rollout_latency"]  # A has steps 1, 2; B's trajectories are of steps 0, 1
    assert (latency["step"], latency["a"]["count"], latency["b"]["count"]) == (1, 4, 2)


def test_compare_in_text_json_and_png(tmp_path):
    from PIL import Image

    a = _write(straggler_run(run_id="a"), tmp_path)
    b = _write(straggler_run(run_id="b", scale=2.0, extra_step=True), tmp_path)
    result = _cli("--compare", a, b)
    assert result.exit_code == 0, result.output
    assert "the runs differ: steps 2 vs 3" in result.stdout
    assert _table(result.stdout, "Steps (s): verl.step, A beside B") == [
        ["1", "20.000", "40.000", "2.00"], ["2", "10.000", "20.000", "2.00"], ["all", "30.000", "60.000", "2.00"]]
    assert _table(result.stdout, "Stages (s) summed")[3] == ["update_actor", "9.000", "18.000", "2.00"]
    latency = _table(result.stdout, "Rollout latency per step (s)")
    assert latency[:2] == [["1", "trajectories", "4", "4", "1.00"], ["p50", "1.400", "2.800", "2.00"]]

    png = tmp_path / "compare.png"
    as_json = _cli("--compare", a, b, "--json", "--png", str(png))
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    layout = data.pop("png")
    assert data == json.loads(json.dumps(build_comparison(a, b)))
    assert layout["steps"] == [1, 2] and layout["latency_steps"] == [1, 2]
    assert layout["stages"] == ["generation", "reward", "old_log_prob", "update_actor", "sync_params", "other"]
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (layout["width_px"], layout["height_px"])
        colors = collections.Counter(image.convert("RGB").getdata())
    assert colors[(0x1F, 0x77, 0xB4)] > 500 and colors[(0xFF, 0x7F, 0x0E)] > 500  # A's and B's bars


def _one_line_error(result, *needles: str) -> None:
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_compare_bad_input_is_one_line_error(tmp_path):
    a = _write(straggler_run(run_id="a"), tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-spans").mkdir()
    (tmp_path / "no-spans" / "zero.jsonl").write_text("")  # its process died before its first batch
    _one_line_error(_cli("--compare", a, str(tmp_path / "empty")), str(tmp_path / "empty"), "no OTLP-JSON files")
    _one_line_error(_cli("--compare", str(tmp_path / "no-spans"), a, "--json"), "no spans", str(tmp_path / "no-spans"))
    _one_line_error(_cli("--compare", a, str(tmp_path / "missing")), "no such file or directory")
    _one_line_error(_cli("--compare", a), "--compare takes two runs", "got 1 path(s)")
    _one_line_error(_cli("--compare", a, a, a), "got 3 path(s)")


# --------------------------------------------------------------------------- two real demo runs

STEPS, PROMPTS = 2, 4


@pytest.fixture(scope="module")
def demo_n2(shared_demo):
    return str(shared_demo(STEPS, PROMPTS, 2)[0])


@pytest.fixture(scope="module")
def demo_n4(shared_demo):
    return str(shared_demo(STEPS, PROMPTS, 4)[0])


def _spans(trace_dir: str):
    from otel_verl.exporters.otlp_json_file import spans_from_files

    return spans_from_files(os.path.join(trace_dir, "otlp"))


def _dur(span) -> float:
    return (span["endTimeUnixNano"] - span["startTimeUnixNano"]) / 1e9


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_compare_two_demo_runs(demo_n2, demo_n4, tmp_path):
    result = _cli("--compare", demo_n2, demo_n4, "--json", "--png", str(tmp_path / "compare.png"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["differences"] == [{"what": "n", "a": 2, "b": 4}]
    assert data["summary"].startswith("the runs differ: n 2 vs 4; compared on what they share: 2 step(s)")
    spans = {"a": _spans(demo_n2), "b": _spans(demo_n4)}
    # recomputed from the spans by name, not through the report's grouping
    for row in data["steps"]:
        for side in "ab":
            [step] = [s for s in spans[side] if s["name"] == "verl.step" and s["attributes"]["verl.global_step"] == row["step"]]
            assert row[f"{side}_s"] == exact(_dur(step))
        assert row["ratio"] == exact(row["b_s"] / row["a_s"])
    for row in data["stages"]:
        if row["stage"] == "other":
            continue
        for side in "ab":
            total = sum(_dur(s) for s in spans[side] if s["name"] == f"verl.stage {row['stage']}")
            assert row[f"{side}_s"] == exact(total)
    for row in data["rollout_latency"]:
        assert (row["a"]["count"], row["b"]["count"], row["ratio"]["count"]) == (PROMPTS * 2, PROMPTS * 4, 2.0)
        for side in "ab":
            durations = [_dur(s) for s in spans[side] if s["name"].startswith("invoke_agent")
                         and s["attributes"]["verl.global_step"] == row["step"]]
            assert row[side]["max_s"] == exact(max(durations))
            assert row[side]["p50_s"] == exact(percentile(durations, 50))
    assert os.path.getsize(tmp_path / "compare.png") > 5_000

    text = _cli("--compare", demo_n2, demo_n4)
    assert text.exit_code == 0, text.output
    assert "the runs differ: n 2 vs 4" in text.stdout
    assert [row[0] for row in _table(text.stdout, "Steps (s): verl.step, A beside B")] == ["1", "2", "all"]


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_the_tail_of_a_demo_run(demo_n2):
    """The critical path, its replica, the replicas' load and the waits of a real run,
    recomputed from its spans by name and parent links."""
    spans = _spans(demo_n2)
    tail = report_of([demo_n2])["tail"]
    servers = [s for s in spans if s["name"] == "verl.llm_server.generate"]
    assert tail["replicas"] == sorted({s["resource"]["ray.actor_id"] for s in servers})
    for row in tail["steps"]:
        trajs = [s for s in spans if s["name"].startswith("invoke_agent") and s["attributes"]["verl.global_step"] == row["step"]]
        last = max(trajs, key=lambda s: (s["endTimeUnixNano"], _dur(s)))
        path = row["critical_path"]
        assert (path["uid"], path["traj_uid"]) == (last["attributes"]["verl.uid"], last["attributes"]["verl.traj_uid"])
        chats = {c["spanId"] for c in spans if c["name"].startswith("chat ") and c["parentSpanId"] == last["spanId"]}
        assert path["replicas"] == sorted({s["resource"]["ray.actor_id"] for s in servers if s["parentSpanId"] in chats})

        lo, hi = min(t["startTimeUnixNano"] for t in trajs), max(t["endTimeUnixNano"] for t in trajs)
        for load in row["replicas"]["per_replica"]:
            inside = [(max(s["startTimeUnixNano"], lo), min(s["endTimeUnixNano"], hi)) for s in servers
                      if s["resource"]["ray.actor_id"] == load["replica"]
                      and s["endTimeUnixNano"] > lo and s["startTimeUnixNano"] < hi]
            assert load["requests"] == len(inside) and load["busy_s"] == exact(_merged_s(inside))

        step = [s for s in spans if s["name"] == "verl.step" and s["attributes"]["verl.global_step"] == row["step"]][0]
        stages = [s for s in spans if s["name"].startswith("verl.stage ") and s["attributes"]["verl.global_step"] == row["step"]]
        first_work = min(s["startTimeUnixNano"] for s in stages if s["attributes"]["verl.stage"] != "generation")
        # sync: the trainer waits from the step's start through generation until its next stage;
        # the rollout idles for the step time its trajectories leave
        assert row["waiting"]["training_s"] == exact((first_work - step["startTimeUnixNano"]) / 1e9)
        lo, hi = step["startTimeUnixNano"], step["endTimeUnixNano"]
        covered = _merged_s([(max(s["startTimeUnixNano"], lo), min(s["endTimeUnixNano"], hi)) for s in trajs])
        assert row["waiting"]["rollout_s"] == exact(_dur(step) - covered)

    roots = [s for s in spans if s["name"] == "verl.sample" and "verl.staleness" in s["attributes"]]
    if roots:  # the spans carry lineage: the histogram counts them
        assert sum(r["samples"] for r in tail["staleness"]["per_step"]) == len(roots)
    else:
        assert tail["staleness"]["note"] == "no lineage in these spans"
