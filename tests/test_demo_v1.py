"""The traced CPU demo on verl's v1 trainer (TaskRunnerV1 path: real PPOTrainer modes,
TransferQueue, ReplayBuffer, AgentLoopManagerTQ/WorkerTQ; stand-ins only for GPU parts),
one run per trainer mode: the trace trees in its OTLP-JSON output and the legacy files."""

from __future__ import annotations

import collections
import glob
import json
import os
import re

import pytest

from demo_checks import by_id, children, csv_rows, jsonl_lines, matches, progress_lines
import demo_checks
from otel_verl.exporters.otlp_json_file import spans_from_files
from otel_verl.ids import trace_id_for_uid
from test_harness_v1 import CHECKS, N, PROMPTS, STEPS

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore")]

MODES = ("sync", "colocate_async", "separate_async")
ASYNC_MODES = ("colocate_async", "separate_async")


@pytest.fixture(scope="module", params=MODES)
def demo(request, tmp_path_factory):
    from demo_process import run_in_child

    mode = request.param
    trace_dir = tmp_path_factory.mktemp(f"demo-v1-{mode}")
    args = {"trace_dir": str(trace_dir), "steps": STEPS, "prompts": PROMPTS, "n": N, "agent": "tool",
            "trainer": "v1", "mode": mode}
    summary = run_in_child("demo", args, str(tmp_path_factory.mktemp(f"demo-v1-{mode}-run")))
    spans = spans_from_files(summary["outputs"]["otlp_json"])
    return mode, str(trace_dir), summary, spans


def _aborted(attributes):
    # a request a weight sync aborted (the stand-in answers it with the tokens made so far)
    return bool({"abort", "aborted"} & set(attributes.get("gen_ai.response.finish_reasons", ())))


def _roots(spans):
    return [s for s in spans if s["name"] == "verl.sample"]


def test_the_real_v1_trainer_ran_each_step(demo):
    mode, _, summary, spans = demo
    CHECKS[mode](summary)
    assert {s["attributes"]["verl.trainer"] for s in spans if s["name"] == "verl.fit"} == {"PPOTrainerV1"}


def test_every_uid_is_one_trace_prompt_task_and_sessions_from_the_worker(demo):
    mode, _, summary, spans = demo
    spans_by_id = by_id(spans)
    trained = [r for r in _roots(spans) if r["attributes"]["verl.sample.outcome"] == "trained"]
    assert len(trained) == STEPS * PROMPTS
    for root in trained:
        uid = root["attributes"]["verl.uid"]
        trace = [s for s in spans if s["traceId"] == root["traceId"]]
        assert root["traceId"] == "%032x" % trace_id_for_uid(uid)
        assert {s["attributes"].get("verl.uid", uid) for s in trace} == {uid}  # nothing else in this trace
        assert root["parentSpanId"] is None and root["resource"]["verl.role"] == "trainer"
        [rollout] = children(trace, root, "verl.rollout")
        # the prompt's task runs in an AgentLoopWorkerTQ process, parented by the carrier
        [task] = children(trace, rollout, "verl.prompt_task")
        assert task["resource"]["verl.role"] == "agent_loop_worker"
        assert task["resource"]["process.pid"] != root["resource"]["process.pid"]
        sessions = children(trace, task, "invoke_agent")
        assert sorted(s["attributes"]["verl.traj_uid"] for s in sessions) == [str(i) for i in range(N)]
        for session in sessions:
            assert session["resource"]["process.pid"] == task["resource"]["process.pid"]
            # the agent loop's run() is no span: its class on the session, its turns and tools children
            assert session["attributes"]["verl.agent_loop.class"] == "ToolAgentLoop"
            chats = children(trace, session, "chat ")
            assert len(chats) == 2  # tool call turn + answer turn, however often a weight sync aborted them
            assert all(c["attributes"]["gen_ai.operation.name"] == "chat" for c in chats)
            assert all(c["attributes"]["gen_ai.usage.output_tokens"] > 0 and not _aborted(c["attributes"]) for c in chats)
            for chat in chats:
                attempts = sorted(children(trace, chat, "verl.llm.attempt"), key=lambda a: a["startTimeUnixNano"])
                if mode not in ASYNC_MODES:  # verl's plain client: one request per turn
                    assert not attempts
                    continue
                # verl's resuming client: one attempt span per engine request
                assert len(attempts) == chat["attributes"]["verl.llm.attempts"] >= 1
                assert [a["attributes"]["verl.llm.attempt_number"] for a in attempts] == list(range(1, len(attempts) + 1))
                assert [_aborted(a["attributes"]) for a in attempts] == [True] * (len(attempts) - 1) + [False]
            [tool] = children(trace, session, "execute_tool")
            assert tool["attributes"]["gen_ai.tool.name"] == "calculator"
            [reward] = children(trace, session, "verl.reward")
            assert reward["attributes"]["verl.reward.score"] in (0.0, 1.0)
            [actor] = children(trace, reward, "verl.reward_worker.compute_score")  # verl's RewardLoopWorker
            assert actor["resource"]["verl.role"] == "reward_worker"
            assert actor["attributes"]["verl.reward.score"] == reward["attributes"]["verl.reward.score"]
        stages = collections.defaultdict(list)
        for span in children(trace, root, "verl.sample_stage"):
            stages[span["attributes"]["verl.stage"]].append(span)
        assert {"sample", "old_log_prob", "ref_log_prob", "adv", "update_actor"} <= set(stages)
        for stage, spans_of_stage in stages.items():
            assert sorted(t for s in spans_of_stage for t in s["attributes"]["verl.traj_uids"]) == [str(i) for i in range(N)]
            for span in spans_of_stage:
                linked = spans_by_id[span["links"][0]["spanId"]]
                assert linked["name"] == f"verl.stage {'generation' if stage == 'sample' else stage}"


def test_every_aborted_request_is_an_attempt_of_its_turn(demo):
    mode, _, summary, spans = demo
    aborted = [s for s in spans if s["name"] == "verl.llm.attempt" and _aborted(s["attributes"])]
    # (the server also aborts requests of prompts the run ends before training). It answers
    # abort to a request it stopped mid-decode and to one it rejected while paused.
    assert len(aborted) <= summary["server"]["aborted"] + summary["server"]["rejected"]
    if mode in ASYNC_MODES:  # the stand-in server interrupts every few requests
        assert len(aborted) >= 3
    else:
        assert not aborted and not summary["server"]["aborted"]


def test_verl_s_sglang_server_served_every_engine_request_on_a_named_replica(demo):
    """Every mode runs verl's own SGLangHttpServer over a stand-in engine: each engine request
    (a turn, or each attempt of a turn verl's client resumed) has its server span, in a
    server actor's process (its replica), with the engine's queue / prefill / decode split;
    the report names the replicas and splits each trajectory's LLM time."""
    from otel_verl.tools.report.spans import server_split
    from test_cli import report_json

    mode, trace_dir, summary, spans = demo
    per_server = summary["server"]["per_server"]
    assert {s["server_class"] for s in per_server} == {"SGLangHttpServer"}
    request_name = "verl.llm.attempt" if mode in ASYNC_MODES else "chat "
    requests = [s for s in spans if s["name"].startswith(request_name)]
    assert len(requests) >= STEPS * PROMPTS * N * 2
    replicas, unwritten = set(), 0
    for request in requests:
        servers = children(spans, request, "verl.llm_server.generate")
        if not servers:
            unwritten += 1
            continue
        [server] = servers
        assert server["resource"]["verl.role"] == "llm_server" and server["kind"] == 2  # SERVER
        assert server["resource"]["process.pid"] in {s["pid"] for s in per_server}
        replicas.add(server["resource"]["ray.actor_id"])
        split = server_split(server)
        assert None not in split.values(), server["attributes"]
        assert split["queue"] + split["prefill"] + split["decode"] == pytest.approx(split["e2e"], abs=1e-6)
    # a server span that ended within a second of the end, when Ray kills the server actors,
    # may not be written: then its loss file counts it
    assert unwritten <= _servers_unsent(trace_dir)
    report = report_json(trace_dir)
    assert set(report["tail"]["replicas"]) == replicas
    assert report["slowest_trajectories"]
    for row in report["slowest_trajectories"]:
        assert None not in row["llm_server_s"].values(), row


def _servers_unsent(trace_dir):
    """The spans the LLM servers' loss files count dropped or pending in their OTLP-JSON file."""
    total = 0
    for path in glob.glob(os.path.join(trace_dir, "losses", "*.json")):
        with open(path) as f:
            losses = json.load(f)
        if losses["resource"].get("verl.role") == "llm_server":
            total += losses["dropped"].get("otlp_json_file", 0) + losses["pending"].get("otlp_json_file", 0)
    return total


def test_async_modes_train_in_a_later_step_in_the_same_trace(demo):
    mode, _, summary, spans = demo
    later = 0
    for root in _roots(spans):
        trace = [s for s in spans if s["traceId"] == root["traceId"]]
        rollout_steps = {s["attributes"]["verl.global_step"] for s in trace if s["name"] in ("verl.rollout", "verl.prompt_task")
                         or s["name"].startswith("invoke_agent")}
        stage_steps = {s["attributes"]["verl.global_step"] for s in trace if s["name"].startswith("verl.sample_stage")}
        if not stage_steps:
            continue
        assert len(rollout_steps) == 1 and len(stage_steps) == 1
        [produced], [trained] = rollout_steps, stage_steps
        assert trained in (produced, produced + 1)
        later += trained == produced + 1
    if mode in ASYNC_MODES:  # step 2 trains warm-up prompts of step 1 (all, unless one was still resuming)
        assert 0 < later <= PROMPTS
    else:
        assert later == 0


def test_unconsumed_samples_end_saying_so(demo):
    mode, _, _, spans = demo
    outcomes = collections.Counter(r["attributes"]["verl.sample.outcome"] for r in _roots(spans))
    # async modes prefetch one batch more than they train: left waiting when fit ended
    assert outcomes == ({"trained": STEPS * PROMPTS, "never_consumed": PROMPTS} if mode in ASYNC_MODES
                        else {"trained": STEPS * PROMPTS})
    assert not [s for s in spans if s["name"] == "verl.prompt_task" and s["attributes"].get("verl.sample.outcome")]


def test_each_step_is_a_trace_with_its_stages(demo):
    mode, _, _, spans = demo
    steps = sorted((s for s in spans if s["name"] == "verl.step"), key=lambda s: s["attributes"]["verl.global_step"])
    assert [s["attributes"]["verl.global_step"] for s in steps] == list(range(1, STEPS + 1))
    layout = "disaggregated" if mode == "separate_async" else "colocated"
    for step in steps:
        assert step["attributes"]["verl.layout"] == layout
        stages = [s["attributes"]["verl.stage"] for s in children(spans, step, "verl.stage")]
        for expected in ("generation", "old_log_prob", "ref_log_prob", "adv", "update_actor", "sync_params", "record_metrics"):
            assert expected in stages
        assert ("fetch_batch" in stages) == (mode == "separate_async")
        if mode != "separate_async":
            [generation] = children(spans, step, "verl.stage generation")
            assert generation["attributes"]["verl.generation.response_tokens"] > 0


V1_SESSION_SEQUENCE = [
    ("AGENT_LOOP", "AgentLoopWorkerTQ", "AgentLoopWorkerTQ", f"session_started_session_id=*_rollout_n={N}"),
    ("LLM_GENERATE", "ToolAgentLoop", "RolloutReplica", "sending_generate_request"),
    ("LLM_GENERATE", "RolloutReplica", "ToolAgentLoop", "received_generate_response"),
    ("AGENT_TOOL", "Tool", "ToolAgentLoop", "tool_executed_name=calculator"),
    ("LLM_GENERATE", "ToolAgentLoop", "RolloutReplica", "sending_generate_request"),
    ("LLM_GENERATE", "RolloutReplica", "ToolAgentLoop", "received_generate_response"),
    ("AGENT_LOOP", "AgentLoop(tool_agent)", "AgentLoopWorker", "agent_run_completed"),
    ("ROLLOUT_REWARD", "RewardLoopWorker", "AgentLoopWorker", "reward_score_computed_score=*"),
    ("TRAIN_SAMPLE", "ReplayBuffer", "PPOTrainerV1", "sampled_from_replay_buffer"),
    ("TRAIN_LOGPROB", "ActorRolloutWorker", "PPOTrainerV1", "old_log_prob_computed"),
    ("TRAIN_REF_LOGPROB", "RefPolicyWorker", "PPOTrainerV1", "ref_log_prob_computed"),
    ("TRAIN_ADVANTAGE", "PPOTrainerV1", "PPOTrainerV1", "advantage_computed"),
    ("TRAIN_UPDATE", "ActorRolloutWorker", "PPOTrainerV1", "actor_parameters_updated"),
]
V1_PROMPT_SEQUENCE = [
    ("DATA_PREPROCESS", "DataLoader", "PPOTrainerV1", "uid_generated"),
    ("DATA_DISPATCH", "PPOTrainerV1", "AgentLoopManagerTQ", "dispatched_to_agent_loop_manager"),
    ("DATA_DISPATCH", "AgentLoopManagerTQ", "AgentLoopWorkerTQ_*", "dispatched_to_agent_loop_worker"),
    ("AGENT_LOOP", "AgentLoopWorkerTQ", "AgentLoop(tool_agent)", "agent_task_started"),
]


def _flow(rows):
    return [(r["fields"]["stage"], r["fields"]["from"], r["fields"]["to"], r["fields"].get("detail", "")) for r in rows]


def _assert_sequence(got, want):
    """``got`` is ``want`` row by row: a request a weight sync aborted and verl resumed is
    still one LLM turn, one row pair."""
    assert len(got) == len(want), got
    for have, expected in zip(got, want):
        assert all(matches(w, h) for w, h in zip(expected, have)), (have, expected)


def test_sample_flow_csv_has_the_v1_sequence_per_trajectory(demo):
    mode, trace_dir, _, spans = demo
    by_sample = collections.defaultdict(list)
    for row in csv_rows(trace_dir):
        by_sample[row["sample_id"]].append(row)
    for root in _roots(spans):
        uid, step = root["attributes"]["verl.uid"], root["attributes"]["verl.global_step"]
        prompt_rows = sorted(by_sample[f"{uid}/sample"], key=lambda r: r["order"])
        _assert_sequence(_flow(prompt_rows), V1_PROMPT_SEQUENCE)
        assert all(r["fields"]["global_step"] == str(step) for r in prompt_rows)
        if root["attributes"]["verl.sample.outcome"] != "trained":
            continue
        for traj in range(N):
            rows = sorted(by_sample[f"{uid}/{traj}"], key=lambda r: r["order"])
            _assert_sequence(_flow(rows), V1_SESSION_SEQUENCE)
            stamps = [int(r["timestamp"]) for r in rows]
            assert stamps == sorted(stamps) and stamps[0] >= int(prompt_rows[-1]["timestamp"])
            assert [r["sample_status"] for r in rows] == ["RUNNING"] * (len(rows) - 1) + ["COMPLETE"]
    syncs = [r for r in csv_rows(trace_dir) if r["sample_id"] == "*/sample"]
    assert [r["fields"]["detail"] for r in syncs] == [f"weights_synced_global_step={s}" for s in range(1, STEPS + 1)]


def test_progress_log_has_the_mode_structure(demo):
    mode, trace_dir, _, _ = demo
    trainer = [line for line in progress_lines(trace_dir) if not line.startswith("Task ")]
    assert trainer[:2] == [f"Total training steps: {STEPS}", f"'train_batch_size': {PROMPTS},"]
    disagg = mode == "separate_async"
    prefix = "disagg: " if disagg else ""
    for step in range(1, STEPS + 1):
        banner = (f"==================== Step {step} ====================" if disagg else
                  f"==================== Epoch 0, consumed {step - 1} batches, Step {step} ====================")
        start = trainer.index(banner)
        end = trainer.index(f"{prefix}end record metrics", start)
        block = trainer[start + 1:end + 1]
        if disagg:
            fetch = [f"Step {step} rollout started",
                     f"Trainer: try to load global batch@{step}, chunk[0/0] from replay_queue",
                     f"Trainer: successfully load global batch@{step}, chunk[0/0] from replay_queue",
                     f"Step {step} rollout finished"]
            assert block[:4] == fetch
            assert not [line for line in block if line.startswith("gen throughput")]
        else:
            assert block[:4] == [f"Step {step} rollout started", "start generation", "end generation", f"Step {step} rollout finished"]
            assert re.fullmatch(r"gen throughput \(token/s\): \d+\.\d\d", block[4])
        for label in ("compute log prob", "compute ref log prob", "compute adv", "update actor", "sync params"):
            assert f"{prefix}start {label}" in block and f"{prefix}end {label}" in block
        assert block.index(f"Step {step} train started") < block.index(f"{prefix}start update actor")
        assert block.index(f"{prefix}end update actor") < block.index(f"Step {step} train finished")
        assert all(line.startswith(("Step ", "gen throughput", "Trainer: ", prefix)) for line in block)


def test_trajectory_jsonl_one_line_per_training_trajectory(demo):
    _, trace_dir, _, spans = demo
    lines = jsonl_lines(trace_dir)
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert len(lines) == len(trajectories) >= STEPS * PROMPTS * N
    chats = collections.Counter((s["attributes"]["verl.uid"], s["attributes"]["verl.traj_uid"]) for s in spans
                                if s["name"].startswith("chat "))
    for line in lines:
        rest = json.loads(line["raw_message"])
        assert rest["n_samples"] == N
        assert len(rest["turns"]) == chats[(line["prompt_uid"], str(line["sample_index"]))]
        assert rest["initial_prompt_text"]
        # every turn has its whole text, however often a weight sync aborted its request
        assert all(turn["completion_text"] and "abort" not in turn["finish_reason"] for turn in rest["turns"])
    tasks = [line for line in progress_lines(trace_dir) if line.startswith("Task ")]
    assert len(tasks) == len(lines)


# --------------------------------------------------------------------------- the CLI on v1 output


def _dur(span) -> float:
    return (span["endTimeUnixNano"] - span["startTimeUnixNano"]) / 1e9


def test_report_on_v1_output_matches_its_spans(demo, tmp_path):
    from PIL import Image

    from test_cli import cli, report_json

    mode, trace_dir, _, spans = demo
    text = cli("report", trace_dir)
    assert text.exit_code == 0 and "Traceback" not in text.output
    png = tmp_path / "timeline.png"
    report = report_json(trace_dir, extra=("--png", str(png)))
    assert report["inputs"]["spans"] == len(spans) and report["inputs"]["truncated"] == 0
    steps = {s["attributes"]["verl.global_step"]: s for s in spans if s["name"] == "verl.step"}
    assert [row["step"] for row in report["steps"]] == sorted(steps) == list(range(1, STEPS + 1))
    for row in report["steps"]:
        expected = collections.defaultdict(float)
        for s in spans:
            if s["name"].startswith("verl.stage ") and s["attributes"]["verl.global_step"] == row["step"]:
                expected[s["attributes"]["verl.stage"]] += _dur(s)
        assert row["stages"].keys() == expected.keys()
        for stage, seconds in expected.items():
            assert row["stages"][stage] == pytest.approx(seconds)
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert report["trajectories"] == len(trajectories)
    demo_checks.assert_the_store_reports_the_same(trace_dir, report, str(tmp_path / "store"))
    assert sum(row["count"] for row in report["rollout_latency"]) == len(trajectories)
    outcomes = collections.Counter(r["attributes"]["verl.sample.outcome"] for r in _roots(spans))
    assert report["samples"]["outcomes"] == dict(outcomes)
    # prompts prefetched but never trained are reported as samples that never finished
    assert report["samples"]["unfinished_count"] == outcomes.get("never_consumed", 0)
    assert {u["state"] for u in report["samples"]["unfinished"]} <= {"outcome never_consumed"}
    # a trajectory the rollout was still running when the run ended has a start row and no span
    started = {r["sample_id"] for r in csv_rows(trace_dir) if r["fields"]["detail"].startswith("session_started")}
    finished = {r["sample_id"] for r in csv_rows(trace_dir) if r["fields"]["detail"] == "agent_run_completed"}
    assert {f'{s["attributes"]["verl.uid"]}/{s["attributes"]["verl.traj_uid"]}' for s in trajectories} == finished
    running = len(started - finished)
    verdicts = [c["verdict"] for c in report["losses"]["consistency"]]
    assert verdicts[:2] == ["consistent", "consistent"]  # the lines written at a trajectory's end
    assert verdicts[2] == ("consistent" if not running else
                           f"{running} started and never finished: running when the run ended, or their process died")
    assert [row["step"] for row in report["png"]["rows"]] == list(range(1, STEPS + 1))
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (report["png"]["width_px"], report["png"]["height_px"])


def test_each_trained_sample_says_its_weights_the_step_that_trained_it_and_its_staleness(demo):
    from test_cli import report_json

    mode, trace_dir, _, spans = demo
    spans_by_id = by_id(spans)
    requests = [s for s in spans if s["name"] == "verl.llm.attempt"
                or (s["name"].startswith("chat") and not s["attributes"].get("verl.llm.attempts"))]
    assert requests and all(isinstance(s["attributes"].get("verl.weight_version"), int) for s in requests)
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    for traj in trajectories:  # the range of the versions its engine requests say
        versions = [r["attributes"]["verl.weight_version"] for r in requests
                    if _ancestor(spans_by_id, r, traj["spanId"])]
        assert (traj["attributes"]["verl.weight_version.min"], traj["attributes"]["verl.weight_version.max"]) == \
            (min(versions), max(versions))
    if mode == "separate_async":  # a weight sync aborted a turn, resumed on the new weights
        assert any(t["attributes"]["verl.weight_version.min"] < t["attributes"]["verl.weight_version.max"]
                   for t in trajectories)
    histogram = collections.Counter()
    for root in _roots(spans):
        attributes = root["attributes"]
        if attributes["verl.sample.outcome"] != "trained":
            assert "verl.trained_step" not in attributes
            continue
        trace = [s for s in spans if s["traceId"] == root["traceId"]]
        [update] = [s for s in trace if s["name"] == "verl.sample_stage update_actor"]
        assert attributes["verl.trained_step"] == update["attributes"]["verl.global_step"]
        oldest = min(t["attributes"]["verl.weight_version.min"] for t in trace if t["name"].startswith("invoke_agent"))
        assert attributes["verl.weight_version.min"] == oldest
        assert attributes["verl.staleness"] == attributes["verl.trained_step"] - 1 - oldest >= 0
        histogram[(attributes["verl.trained_step"], attributes["verl.staleness"])] += 1
    staleness = report_json(trace_dir)["tail"]["staleness"]
    assert {(row["trained_step"], h["staleness"]): h["samples"] for row in staleness["per_step"]
            for h in row["histogram"]} == dict(histogram)


def _ancestor(spans_by_id, span, span_id):
    """Whether ``span_id`` is ``span``'s parent, grandparent, ... (in these spans)."""
    parent = span.get("parentSpanId")
    while parent:
        if parent == span_id:
            return True
        parent = spans_by_id.get(parent, {}).get("parentSpanId")
    return False


def test_every_span_of_the_run_is_in_its_perfetto_trace(demo, tmp_path):
    from test_report_perfetto import check_run_in_perfetto

    _, trace_dir, _, _ = demo
    trace, _ = check_run_in_perfetto(trace_dir, tmp_path / "run.pftrace")
    assert any(t.name.startswith("prompt ") for t in trace.tracks.values())  # v1's prompt tasks
    assert any(name.startswith("LLM server") for name in trace.processes())


def test_replay_sends_every_v1_span(demo):
    from test_cli import Collector, _span_ids_json, cli

    mode, trace_dir, _, spans = demo
    if mode != "colocate_async":
        pytest.skip("one mode is enough: the files have the same shape in every mode")
    with Collector() as collector:
        result = cli("replay", trace_dir, "--endpoint", collector.url)
    assert result.exit_code == 0, result.output
    assert _span_ids_json(b for _, _, b in collector.requests) == sorted(s["spanId"] for s in spans)


# --------------------------------------------------------------------------- 20 steps: bounded


def test_open_sample_spans_stay_bounded_over_20_async_steps(tmp_path_factory):
    """colocate_async keeps a batch in flight ahead of training: over 20 steps the sample
    roots open at any step boundary never exceed what verl holds (the warm-up batch, the
    step's own batch and the one being trained), and every one of them ends."""
    from demo_process import run_in_child

    steps, prompts = 20, 2
    trace_dir = tmp_path_factory.mktemp("demo-v1-20-steps")
    args = {"trace_dir": str(trace_dir), "steps": steps, "prompts": prompts, "n": 1, "agent": "single",
            "trainer": "v1", "mode": "colocate_async", "validate": False}
    summary = run_in_child("demo", args, str(tmp_path_factory.mktemp("demo-v1-20-steps-run")), timeout=850)
    assert summary["steps_run"] == steps
    spans = spans_from_files(summary["outputs"]["otlp_json"])
    roots = _roots(spans)
    assert len(roots) == (steps + 1) * prompts  # one warm-up batch more than the steps trained
    step_starts = sorted(s["startTimeUnixNano"] for s in spans if s["name"] == "verl.step")
    assert len(step_starts) == steps
    open_at = [sum(1 for r in roots if r["startTimeUnixNano"] <= t < r["endTimeUnixNano"]) for t in step_starts]
    assert max(open_at) <= 3 * prompts, open_at
    assert open_at[-1] <= open_at[1] + prompts  # not growing with the steps
    outcomes = collections.Counter(r["attributes"]["verl.sample.outcome"] for r in roots)
    assert outcomes == {"trained": steps * prompts, "never_consumed": prompts}
