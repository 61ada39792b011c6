"""The traced CPU demo in the cases tests/test_demo_v0.py does not run: REMAX (a greedy
baseline row per prompt in the same generate call) and a custom agent loop loaded from
verl's registry (``rollout.agent.agent_loop_config_path``) and verl's experimental
SeparateRayPPOTrainer (the disaggregated layout). Each case is one small real
run (1 step, 2 prompts, n=2; no validation), shared by its tests."""

import collections
import csv
import glob
import json
import os

import pytest

import demo_checks

from otel_verl.exporters.otlp_json_file import spans_from_files
from otel_verl.ids import trace_id_for_uid

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS, PROMPTS, N = 1, 2, 2
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CSV_HEADERS = ["job_id", "cat", "sample_id", "sample_status", "timestamp", "content"]
TRAIN_STAGES = {"reward", "old_log_prob", "ref_log_prob", "adv", "update_actor"}


def _run(trace_dir, **kwargs):
    """run_demo in a child interpreter (see tests/demo_process.py)."""
    from demo_process import run_in_child

    args = {"trace_dir": str(trace_dir), "steps": STEPS, "prompts": PROMPTS, "n": N, "validate": False, **kwargs}
    summary = run_in_child("demo", args, str(trace_dir) + "-run")
    return str(trace_dir), summary, spans_from_files(summary["outputs"]["otlp_json"])


@pytest.fixture(scope="module")
def remax(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("remax"), agent="single", adv_estimator="remax")


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    import custom_agent_loop

    config_path = custom_agent_loop.write_agent_loop_config(str(tmp_path_factory.mktemp("agent_loops")))
    pythonpath = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    return _run(
        tmp_path_factory.mktemp("custom"),
        agent="single",
        agent_name=custom_agent_loop.AGENT_NAME,
        agent_loop_config_path=config_path,
        worker_env={"PYTHONPATH": pythonpath},  # the agent loop's module, in every Ray worker
    )


# --------------------------------------------------------------------------- helpers


def _children(spans, parent, name_prefix=""):
    return [s for s in spans if s["parentSpanId"] == parent["spanId"] and s["name"].startswith(name_prefix)]


def _sample_traces(spans):
    """{uid: (root, spans of its trace)} for every sample root."""
    out = {}
    for root in (s for s in spans if s["name"] == "verl.sample"):
        uid = root["attributes"]["verl.uid"]
        out[uid] = (root, [s for s in spans if s["traceId"] == root["traceId"]])
    return out


def _csv_rows(trace_dir):
    rows = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "sample", "*.csv"))):
        with open(path, newline="") as f:
            for row in csv.reader(f):
                rec = dict(zip(CSV_HEADERS, row))
                rec["fields"] = dict(part.split("=", 1) for part in rec["content"].split("|"))
                rows.append(rec)
    return rows


def _flows(trace_dir):
    """{sample_id: [((stage, from, to, detail), row), ...]} in timestamp order (ties: file order)."""
    by_sample = collections.defaultdict(list)
    for index, row in enumerate(_csv_rows(trace_dir)):
        f = row["fields"]
        by_sample[row["sample_id"]].append((int(row["timestamp"]), index, (f["stage"], f["from"], f["to"], f.get("detail", "")), row))
    return {k: [(t[2], t[3]) for t in sorted(v, key=lambda t: t[:2])] for k, v in by_sample.items()}


def _jsonl_lines(trace_dir):
    lines = []
    for path in glob.glob(os.path.join(trace_dir, "trajectory", "*.jsonl")):
        with open(path, encoding="utf-8") as f:
            lines.extend(json.loads(line) for line in f)
    return lines


def _task_lines(trace_dir):
    lines = []
    for path in glob.glob(os.path.join(trace_dir, "progress", "*.log")):
        with open(path, encoding="utf-8") as f:
            lines.extend(line.rstrip("\n") for line in f if line.startswith("Task "))
    return lines


def _expected_flow(agent_class, agent_name, turns, trained):
    """One trajectory's CSV rows, for an agent loop making ``turns`` generate calls."""
    rows = [
        ("DATA_PREPROCESS", "RayPPOTrainer", "RayPPOTrainer", "traj_uid_generated_by_repeat"),
        ("DATA_DISPATCH", "AgentLoopManager", "AgentLoopWorker_{k}", "dispatched_to_agent_loop_worker"),
        ("AGENT_LOOP", "AgentLoopWorker", f"AgentLoop({agent_name})", "agent_task_started"),
    ]
    for _ in range(turns):
        rows += [
            ("LLM_GENERATE", agent_class, "RolloutReplica", "sending_generate_request"),
            ("LLM_GENERATE", "RolloutReplica", agent_class, "received_generate_response"),
        ]
    rows += [
        ("AGENT_LOOP", f"AgentLoop({agent_name})", "AgentLoopWorker", "agent_run_completed"),
        ("ROLLOUT_REWARD", "RewardLoopWorker", "AgentLoopWorker", "reward_score_computed_score={score}"),
    ]
    if trained:
        rows += [
            ("TRAIN_REWARD", "RayPPOTrainer", "RewardManager", "reward_extracted"),
            ("TRAIN_LOGPROB", "ActorRolloutRefWorker", "RayPPOTrainer", "old_log_prob_computed"),
            ("TRAIN_REF_LOGPROB", "RefPolicyWorker", "RayPPOTrainer", "ref_log_prob_computed"),
            ("TRAIN_ADVANTAGE", "RayPPOTrainer", "RayPPOTrainer", "advantage_computed"),
            ("TRAIN_UPDATE", "ActorRolloutRefWorker", "RayPPOTrainer", "actor_parameters_updated"),
        ]
    return rows


def _normalise(flow):
    """Worker index and score are run-dependent: keep their shape only."""
    out = []
    for stage, src, dst, detail in flow:
        if dst.startswith("AgentLoopWorker_") and dst[len("AgentLoopWorker_"):].isdigit():
            dst = "AgentLoopWorker_{k}"
        if detail.startswith("reward_score_computed_score="):
            float(detail.split("=", 1)[1])
            detail = "reward_score_computed_score={score}"
        out.append((stage, src, dst, detail))
    return out


# --------------------------------------------------------------------------- REMAX


def test_remax_ran_one_greedy_baseline_per_prompt(remax):
    _, summary, spans = remax
    assert summary["steps_run"] == STEPS and summary["config"]["adv_estimator"] == "remax"
    # verl's rollout dump holds the trained rows only; the server answered the baselines too
    assert summary["trajectories_per_step"] == {"1": PROMPTS * N}
    assert summary["server"]["requests"] == PROMPTS * (N + 1)
    assert summary["worker_group_calls"]["update_actor"] == STEPS
    assert len([s for s in spans if s["name"].startswith("invoke_agent")]) == PROMPTS * (N + 1)
    assert all(s["status"]["code"] != 2 for s in spans)  # nothing failed (STATUS_CODE_ERROR)


def test_remax_baseline_trajectories_live_in_the_sample_trace(remax):
    _, _, spans = remax
    traces = _sample_traces(spans)
    assert len(traces) == PROMPTS
    sampled = [str(i) for i in range(N)]
    for uid, (root, trace) in traces.items():
        assert root["traceId"] == "%032x" % trace_id_for_uid(uid)
        assert root["attributes"]["verl.sample.outcome"] == "trained"
        [rollout] = _children(trace, root, "verl.rollout")
        # batch order of the combined generate call: the n sampled rows, then the baseline
        assert rollout["attributes"]["verl.traj_uids"] == sampled + ["baseline"]
        trajectories = {t["attributes"]["verl.traj_uid"]: t for t in _children(trace, rollout, "invoke_agent")}
        assert sorted(trajectories) == sorted(sampled + ["baseline"])
        for traj_uid, traj in trajectories.items():
            assert traj["resource"]["verl.role"] == "agent_loop_worker"
            assert traj["attributes"]["gen_ai.conversation.id"] == f"{uid}/{traj_uid}"
            assert not _children(trace, traj, "verl.agent_run")  # the agent run is no span
            assert traj["attributes"]["verl.agent_loop.class"] == "SingleTurnAgentLoop"
            [chat] = _children(trace, traj, "chat ")
            # the baseline is greedy (__do_sample__=False -> temperature 0), the samples are not
            assert (chat["attributes"]["gen_ai.request.temperature"] == 0.0) == (traj_uid == "baseline")
            [server] = _children(trace, chat, "verl.llm_server.generate")
            assert server["resource"]["verl.role"] == "llm_server"
            [reward] = _children(trace, traj, "verl.reward")
            assert "verl.reward.score" in reward["attributes"]
        # fit slices the baseline rows off before training: the stages see the n samples only
        stages = {s["attributes"]["verl.stage"]: s for s in _children(trace, root, "verl.sample_stage")}
        assert set(stages) == TRAIN_STAGES
        for span in stages.values():
            assert sorted(span["attributes"]["verl.traj_uids"]) == sampled


def test_remax_legacy_outputs(remax):
    trace_dir, _, spans = remax
    flows = _flows(trace_dir)
    uids = sorted(_sample_traces(spans))
    sampled_flow = _expected_flow("SingleTurnAgentLoop", "single_turn_agent", 1, trained=True)
    for uid in uids:
        for traj in range(N):
            flow = flows[f"{uid}/{traj}"]
            assert _normalise([r for r, _ in flow]) == sampled_flow
            assert [row["sample_status"] for _, row in flow] == ["RUNNING"] * (len(flow) - 1) + ["COMPLETE"]
        # "baseline" is no digit: its rows are "{uid}/sample", next to uid_generated; it is
        # dispatched, run and scored, never trained
        sample_rows = flows[f"{uid}/sample"]
        assert sample_rows[0][0] == ("DATA_PREPROCESS", "DataLoader", "RayPPOTrainer", "uid_generated")
        assert collections.Counter(_normalise([r for r, _ in sample_rows[1:]])) == collections.Counter(
            _expected_flow("SingleTurnAgentLoop", "single_turn_agent", 1, trained=False)
        )
        assert all(row["sample_status"] == "RUNNING" for _, row in sample_rows)
    lines = _jsonl_lines(trace_dir)
    assert len(lines) == PROMPTS * (N + 1)
    baselines = [line for line in lines if line["sample_index"] is None]
    assert sorted(line["prompt_uid"] for line in baselines) == uids
    for line in baselines:
        rest = json.loads(line["raw_message"])
        assert rest["request_id"] == "baseline" and len(rest["turns"]) == 1
    tasks = _task_lines(trace_dir)
    assert len(tasks) == PROMPTS * (N + 1)
    for uid in uids:
        assert sum(t.startswith(f"Task {uid}/baseline is completed, score=") for t in tasks) == 1


# --------------------------------------------------------------------------- custom agent loop


def test_custom_agent_loop_ran_from_the_registry(custom):
    import custom_agent_loop

    _, summary, spans = custom
    assert summary["steps_run"] == STEPS
    assert summary["trajectories_per_step"] == {"1": PROMPTS * N}
    assert summary["server"]["requests"] == PROMPTS * N * custom_agent_loop.GENERATE_CALLS
    assert all(s["status"]["code"] != 2 for s in spans)


def test_custom_agent_loop_turns_are_captured_at_the_llm_client(custom):
    import custom_agent_loop

    _, _, spans = custom
    traces = _sample_traces(spans)
    assert len(traces) == PROMPTS
    for uid, (root, trace) in traces.items():
        [rollout] = _children(trace, root, "verl.rollout")
        trajectories = _children(trace, rollout, "invoke_agent")
        assert sorted(t["attributes"]["verl.traj_uid"] for t in trajectories) == [str(i) for i in range(N)]
        for traj in trajectories:
            assert traj["name"] == f"invoke_agent {custom_agent_loop.AGENT_NAME}"
            assert traj["attributes"]["gen_ai.agent.name"] == custom_agent_loop.AGENT_NAME
            assert traj["attributes"]["verl.num_turns"] == custom_agent_loop.GENERATE_CALLS
            assert traj["attributes"]["verl.agent_loop.class"] == custom_agent_loop.CLASS_NAME
            chats = _children(trace, traj, "chat ")
            assert len(chats) == custom_agent_loop.GENERATE_CALLS
            for chat in chats:
                assert chat["kind"] == 3  # CLIENT
                assert chat["attributes"]["verl.agent_loop.class"] == custom_agent_loop.CLASS_NAME
                assert chat["attributes"]["verl.traj_uid"] == traj["attributes"]["verl.traj_uid"]
                [server] = _children(trace, chat, "verl.llm_server.generate")
                assert server["resource"]["verl.role"] == "llm_server"
            [reward] = _children(trace, traj, "verl.reward")
            assert reward["attributes"]["verl.reward.score"] in (0.0, 1.0)


def test_custom_agent_loop_legacy_outputs(custom):
    import custom_agent_loop

    trace_dir, _, spans = custom
    flows = _flows(trace_dir)
    expected = _expected_flow(custom_agent_loop.CLASS_NAME, custom_agent_loop.AGENT_NAME,
                              custom_agent_loop.GENERATE_CALLS, trained=True)
    for uid in _sample_traces(spans):
        for traj in range(N):
            assert _normalise([r for r, _ in flows[f"{uid}/{traj}"]]) == expected
    lines = _jsonl_lines(trace_dir)
    assert len(lines) == PROMPTS * N
    for line in lines:
        rest = json.loads(line["raw_message"])
        assert len(rest["turns"]) == custom_agent_loop.GENERATE_CALLS
        assert [t["turn_index"] for t in rest["turns"]] == list(range(custom_agent_loop.GENERATE_CALLS))
        assert all(t["completion_text"] and t["finish_reason"] == "stop" for t in rest["turns"])
        assert rest["request_id"] == str(line["sample_index"])
    assert len(_task_lines(trace_dir)) == PROMPTS * N


# --------------------------------------------------------------------------- the separation trainer


@pytest.fixture(scope="module")
def separation(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("separation"), agent="single", trainer="separation", steps=2)


def test_separation_trainer_progress_is_disaggregated(separation):
    """verl's experimental SeparateRayPPOTrainer: `Step N` banners, `disagg: ` stage lines,
    the replay-queue fetch lines (no prefix) before each banner, step windows and the gen
    throughput line."""
    trace_dir, summary, _ = separation
    assert summary["config"]["trainer_class"] == "SeparateRayPPOTrainer" and summary["steps_run"] == 2
    lines = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "progress", "*.log"))):
        with open(path, encoding="utf-8") as f:
            lines += [line.rstrip("\n") for line in f if not line.startswith("Task ")]
    for step in (1, 2):
        banner = lines.index(f"==================== Step {step} ====================")
        assert lines[banner - 2:banner] == [
            f"Trainer: try to load global batch@{step}, chunk[0/0] from replay_queue",
            f"Trainer: successfully load global batch@{step}, chunk[0/0] from replay_queue",
        ]
        block = lines[banner + 1:lines.index("disagg: end record metrics", banner) + 1]
        assert block[:2] == [f"Step {step} rollout started", f"Step {step} rollout finished"]
        assert block[2].startswith("gen throughput (token/s): ")
        for label in ("compute reward", "compute log prob", "compute ref log prob", "compute adv", "update actor",
                      "sync params", "record metrics"):
            assert f"disagg: start {label}" in block and f"disagg: end {label}" in block
        assert block.index(f"Step {step} train started") < block.index("disagg: start update actor")


def test_separation_trainer_run_in_perfetto(separation, tmp_path):
    from test_report_perfetto import check_run_in_perfetto

    trace_dir, _, _ = separation
    check_run_in_perfetto(trace_dir, tmp_path / "run.pftrace")


def test_separation_trainer_report_on_the_store(separation, tmp_path):
    from click.testing import CliRunner

    from otel_verl.tools.cli import main

    trace_dir, _, _ = separation
    result = CliRunner().invoke(main, ["report", str(trace_dir), "--json"])
    assert result.exit_code == 0, result.output
    demo_checks.assert_the_store_reports_the_same(trace_dir, json.loads(result.stdout), str(tmp_path / "store"))


def test_separation_trainer_traces_each_uid_through_the_workers(separation):
    _, _, spans = separation
    roots = [s for s in spans if s["name"] == "verl.sample"]
    assert len(roots) == 2 * PROMPTS and {r["attributes"]["verl.sample.outcome"] for r in roots} == {"trained"}
    for root in roots:
        trace = [s for s in spans if s["traceId"] == root["traceId"]]
        assert root["traceId"] == "%032x" % trace_id_for_uid(root["attributes"]["verl.uid"])
        [rollout] = _children(trace, root, "verl.rollout")
        trajectories = _children(trace, rollout, "invoke_agent")
        assert len(trajectories) == N and {t["resource"]["verl.role"] for t in trajectories} == {"agent_loop_worker"}
        assert {s["attributes"]["verl.stage"] for s in _children(trace, root, "verl.sample_stage")} == TRAIN_STAGES
    steps = [s for s in spans if s["name"] == "verl.step"]
    assert {s["attributes"]["verl.layout"] for s in steps} == {"disaggregated"} and len(steps) == 2


# --------------------------------------------------------------------------- the demo command itself


SILENCE_LIMIT_S = 20  # the demo speaks at least every ~15 s (a heartbeat every 10 s); generous on a loaded box


def test_the_demo_command_tells_what_it_does_and_names_the_next_commands(tmp_path):
    """``otel-verl demo`` as README's first command runs it: a line at least every ~15 s
    (its phases, each step, a heartbeat while a phase is silent), then the summary and the
    commands to run next, which work on its output as printed."""
    import shlex
    import subprocess
    import sys
    import time

    from demo_process import REPO
    from otel_verl.exporters.otlp_json_file import spans_from_files
    from test_cli import Collector, _span_ids_json, cli

    trace_dir = str(tmp_path / "demo out")  # a space: the printed commands must quote it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_TRACE"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    command = [os.path.join(os.path.dirname(sys.executable), "otel-verl"), "demo", "--trace-dir", trace_dir,
               "--steps", "2", "--prompts", "2", "--n", "2", "--agent", "single"]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []  # (seconds since the start, line)
    for line in proc.stdout:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
    output = "\n".join(text for _, text in lines)
    assert proc.wait() == 0, output[-6000:]
    times = [0.0, *(t for t, _ in lines)]
    silences = [b - a for a, b in zip(times, times[1:])]
    assert max(silences) <= SILENCE_LIMIT_S, (max(silences), output)
    said = [text for _, text in lines if text.startswith("[demo ")]
    for phase in ("starting a local Ray cluster", "starting the workers", "training: step 1 of 2",
                  "step 1 of 2 done", "step 2 of 2 done", "shutdown"):
        assert any(phase in text for text in said), (phase, output)

    texts = [text for _, text in lines]
    commands = [shlex.split(text) for text in texts[texts.index("next:") + 1:] if text.startswith("  otel-verl ")]
    assert [c[1] for c in commands] == ["report", "report", "replay"]
    report, perfetto, replay = (c[1:] for c in commands)
    assert report == ["report", trace_dir]
    assert perfetto == ["report", trace_dir, "--perfetto", os.path.join(trace_dir, "run.pftrace")]
    result = cli(*report)
    assert result.exit_code == 0 and "Steps (s)" in result.output, result.output
    result = cli(*perfetto)
    assert result.exit_code == 0 and os.path.getsize(os.path.join(trace_dir, "run.pftrace")) > 0, result.output
    assert replay[:2] == ["replay", trace_dir] and replay[2] == "--endpoint"
    with Collector() as collector:  # in place of the Jaeger the printed endpoint names
        result = cli(*replay[:3], collector.url)
    assert result.exit_code == 0, result.output
    spans = spans_from_files(os.path.join(trace_dir, "otlp"))
    assert _span_ids_json(b for _, _, b in collector.requests) == sorted(s["spanId"] for s in spans)
