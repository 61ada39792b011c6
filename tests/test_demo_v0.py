"""The traced CPU demo (real verl v0 trainer, agent loops, reward and sglang server code on a
real Ray cluster; stand-ins only for GPU parts): the trace trees in its OTLP-JSON output
and the legacy files it wrote."""

import collections
import glob
import json
import os
import re

import pytest

from otel_verl.exporters.otlp_json_file import spans_from_files
from otel_verl.ids import trace_id_for_uid

from demo_checks import by_id, children, csv_rows, matches, progress_lines

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS, PROMPTS, N = 2, 4, 4


@pytest.fixture(scope="module")
def demo(shared_demo):
    trace_dir, summary = shared_demo(STEPS, PROMPTS, N)
    spans = spans_from_files(summary["outputs"]["otlp_json"])
    return trace_dir, summary, spans






def test_demo_ran_what_it_says(demo):
    _, summary, spans = demo
    assert summary["steps_run"] == STEPS and summary["validation"]["passes"] == 1
    assert summary["ray"]["runtime_env_applied"]
    trajectories = [s for s in spans if s["name"].startswith("invoke_agent")]
    # validation rollouts (one pass ran) are not traced: only training trajectories
    assert len(trajectories) == STEPS * PROMPTS * N
    # every generate call the stand-in server answered for training has its LLM span
    chats = [s for s in spans if s["name"].startswith("chat ")]
    validation_requests = summary["validation"]["trajectories"] * 2
    assert len(chats) == summary["server"]["requests"] - validation_requests


def test_every_uid_is_one_trace_with_worker_subtrees_parented_by_propagated_context(demo):
    _, _, spans = demo
    spans_by_id = by_id(spans)
    uids = sorted({s["attributes"]["verl.uid"] for s in spans if s["name"] == "verl.sample"})
    assert len(uids) == STEPS * PROMPTS
    for uid in uids:
        mine = [s for s in spans if s["attributes"].get("verl.uid") == uid]
        assert {s["traceId"] for s in mine} == {"%032x" % trace_id_for_uid(uid)}
        trace = [s for s in spans if s["traceId"] == mine[0]["traceId"]]
        [root] = [s for s in trace if s["name"] == "verl.sample"]
        assert root["parentSpanId"] is None and root["resource"]["verl.role"] == "trainer"
        assert root["attributes"]["verl.sample.outcome"] == "trained"
        [rollout] = children(trace, root, "verl.rollout")
        trajectories = children(trace, rollout, "invoke_agent")
        assert sorted(t["attributes"]["verl.traj_uid"] for t in trajectories) == [str(i) for i in range(N)]
        for traj in trajectories:
            # produced in the AgentLoopWorker process, child of the trainer's span by carrier
            assert traj["resource"]["verl.role"] == "agent_loop_worker"
            assert traj["resource"]["process.pid"] != root["resource"]["process.pid"]
            assert traj["attributes"]["gen_ai.operation.name"] == "invoke_agent"
            # the agent run is no span: its class is on the trajectory, its turns and tools are children
            assert not children(trace, traj, "verl.agent_run")
            assert traj["attributes"]["verl.agent_loop.class"] == "ToolAgentLoop"
            run = traj
            chats = children(trace, run, "chat ")
            assert len(chats) == 2  # tool call turn + answer turn
            for chat in chats:
                attrs = chat["attributes"]
                assert attrs["gen_ai.operation.name"] == "chat"
                assert attrs["gen_ai.provider.name"] == "sglang"
                assert attrs["gen_ai.request.model"]
                assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
                assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
                [server] = children(trace, chat, "verl.llm_server.generate")
                assert server["resource"]["verl.role"] == "llm_server"
                assert server["kind"] == 2  # SERVER
                # the engine's timing is on the server's span, not again on the chat span
                assert "verl.llm.server.e2e_latency" in server["attributes"]
                assert not [k for k in attrs if k.startswith("verl.llm.server.")]
            [tool] = children(trace, run, "execute_tool")
            assert tool["attributes"]["gen_ai.tool.name"] == "calculator"
            [reward] = children(trace, traj, "verl.reward")
            assert "verl.reward.score" in reward["attributes"]
            # verl's RewardLoopWorker actor computed it: its span, by the carrier in the data
            [actor] = children(trace, reward, "verl.reward_worker.compute_score")
            assert actor["resource"]["verl.role"] == "reward_worker" and actor["kind"] == 2  # SERVER
            assert actor["attributes"]["verl.reward.score"] == reward["attributes"]["verl.reward.score"]
            assert actor["attributes"]["verl.uid"] == uid
            assert actor["attributes"]["verl.reward.manager"] == "NaiveRewardManager"
        stages = {s["attributes"]["verl.stage"]: s for s in children(trace, root, "verl.sample_stage")}
        assert set(stages) == {"reward", "old_log_prob", "ref_log_prob", "adv", "update_actor"}
        for stage, span in stages.items():
            assert sorted(span["attributes"]["verl.traj_uids"]) == [str(i) for i in range(N)]
            [link] = span["links"]
            linked = spans_by_id[link["spanId"]]  # many per-uid spans -> one batch stage span
            assert linked["name"] == f"verl.stage {stage}"
            assert linked["attributes"]["verl.global_step"] == root["attributes"]["verl.global_step"]


def test_each_step_is_a_trace_with_its_stages(demo):
    _, _, spans = demo
    steps = [s for s in spans if s["name"] == "verl.step"]
    assert sorted(s["attributes"]["verl.global_step"] for s in steps) == [1, 2]
    for step in steps:
        stages = [s["attributes"]["verl.stage"] for s in children(spans, step, "verl.stage")]
        for expected in ("generation", "reward", "old_log_prob", "ref_log_prob", "adv", "update_actor", "sync_params", "record_metrics"):
            assert expected in stages
        generation = next(s for s in children(spans, step, "verl.stage generation"))
        assert generation["attributes"]["verl.generation.response_tokens"] > 0




V0_TOOL_SEQUENCE = [
    ("DATA_PREPROCESS", "RayPPOTrainer", "RayPPOTrainer", "traj_uid_generated_by_repeat"),
    ("DATA_DISPATCH", "AgentLoopManager", "AgentLoopWorker_*", "dispatched_to_agent_loop_worker"),
    ("AGENT_LOOP", "AgentLoopWorker", "AgentLoop(tool_agent)", "agent_task_started"),
    ("LLM_GENERATE", "ToolAgentLoop", "RolloutReplica", "sending_generate_request"),
    ("LLM_GENERATE", "RolloutReplica", "ToolAgentLoop", "received_generate_response"),
    ("AGENT_TOOL", "Tool", "ToolAgentLoop", "tool_executed_name=calculator"),
    ("LLM_GENERATE", "ToolAgentLoop", "RolloutReplica", "sending_generate_request"),
    ("LLM_GENERATE", "RolloutReplica", "ToolAgentLoop", "received_generate_response"),
    ("AGENT_LOOP", "AgentLoop(tool_agent)", "AgentLoopWorker", "agent_run_completed"),
    ("ROLLOUT_REWARD", "RewardLoopWorker", "AgentLoopWorker", "reward_score_computed_score=*"),
    ("TRAIN_REWARD", "RayPPOTrainer", "RewardManager", "reward_extracted"),
    ("TRAIN_LOGPROB", "ActorRolloutRefWorker", "RayPPOTrainer", "old_log_prob_computed"),
    ("TRAIN_REF_LOGPROB", "RefPolicyWorker", "RayPPOTrainer", "ref_log_prob_computed"),
    ("TRAIN_ADVANTAGE", "RayPPOTrainer", "RayPPOTrainer", "advantage_computed"),
    ("TRAIN_UPDATE", "ActorRolloutRefWorker", "RayPPOTrainer", "actor_parameters_updated"),
]




def test_sample_flow_csv_has_the_v0_sequence_per_trajectory(demo):
    trace_dir, _, spans = demo
    rows = csv_rows(trace_dir)
    by_sample = collections.defaultdict(list)
    for row in rows:
        by_sample[row["sample_id"]].append(row)
    steps = {s["attributes"]["verl.uid"]: s["attributes"]["verl.global_step"] for s in spans if s["name"] == "verl.sample"}
    for uid, step in steps.items():
        [created] = by_sample[f"{uid}/sample"]
        assert created["fields"] == {"from": "DataLoader", "to": "RayPPOTrainer", "stage": "DATA_PREPROCESS",
                                     "global_step": str(step), "detail": "uid_generated"}
        for traj in range(N):
            flow = sorted(by_sample[f"{uid}/{traj}"], key=lambda r: r["order"])
            got = [(r["fields"]["stage"], r["fields"]["from"], r["fields"]["to"], r["fields"].get("detail", "")) for r in flow]
            assert len(got) == len(V0_TOOL_SEQUENCE), got
            for have, want in zip(got, V0_TOOL_SEQUENCE):
                assert all(matches(w, h) for w, h in zip(want, have)), (have, want)
            stamps = [int(r["timestamp"]) for r in flow]
            assert stamps == sorted(stamps) and stamps[0] >= int(created["timestamp"])
            assert [r["sample_status"] for r in flow] == ["RUNNING"] * (len(flow) - 1) + ["COMPLETE"]
            for r in flow:
                if r["fields"]["stage"] not in ("LLM_GENERATE", "AGENT_TOOL", "ROLLOUT_REWARD"):
                    assert r["fields"]["global_step"] == str(step)
    syncs = [r for r in rows if r["sample_id"] == "*/sample"]
    assert [r["fields"]["detail"] for r in syncs] == [f"weights_synced_global_step={s}" for s in range(1, STEPS + 1)]




def test_progress_log_has_the_colocated_step_structure(demo):
    trace_dir, _, _ = demo
    lines = progress_lines(trace_dir)
    trainer = [line for line in lines if not line.startswith("Task ")]
    assert trainer[:6] == ["Total training steps: 2", "'train_batch_size': 4,", "'rollout_n': 4,",
                           "'ppo_mini_batch_size': 4,", "'num_minibatches': 4,", "'total_training_steps': 2"]
    for step in range(1, STEPS + 1):
        start = trainer.index(f"==================== Epoch 0, consumed {step - 1} batches, Step {step} ====================")
        block = trainer[start:start + 23]
        assert block[1:5] == [f"Step {step} rollout started", "start generation", "end generation", f"Step {step} rollout finished"]
        assert re.fullmatch(r"gen throughput \(token/s\): \d+\.\d\d", block[5])
        assert block[6:14] == ["start compute reward", "end compute reward", "start compute log prob", "end compute log prob",
                               "start compute ref log prob", "end compute ref log prob", "start compute adv", "end compute adv"]
        assert block[14:18] == [f"Step {step} train started", "start update actor", "end update actor", f"Step {step} train finished"]
        assert block[18:20] == ["start sync params", "end sync params"]
    assert trainer[-4:-2] == ["start eval", "end eval"]  # the one validation pass, at the last step
    assert trainer[-2:] == ["start record metrics", "end record metrics"]


def test_trajectory_jsonl_one_line_per_training_trajectory_with_its_turns(demo):
    trace_dir, _, spans = demo
    lines = []
    for path in glob.glob(os.path.join(trace_dir, "trajectory", "*.jsonl")):
        with open(path, encoding="utf-8") as f:
            lines.extend(json.loads(line) for line in f)
    assert len(lines) == STEPS * PROMPTS * N
    chats = collections.Counter((s["attributes"]["verl.uid"], s["attributes"]["verl.traj_uid"]) for s in spans if s["name"].startswith("chat "))
    for line in lines:
        rest = json.loads(line["raw_message"])
        turns = rest["turns"]
        assert len(turns) == chats[(line["prompt_uid"], str(line["sample_index"]))] == 2
        assert turns[0]["observation_text"] and turns[0]["observation_time_ms"] >= 0
        assert turns[1]["template_overhead_tokens"] > 0 and turns[1]["template_overhead_text"]
        # the demo switches sglang's metrics on as otel-verl run does: the timing of sglang
        # 0.5.12's keys (which have no prefill duration)
        for t in turns:
            assert t["sglang_time_ms"] > 0 and t["sglang_queue_time_ms"] >= 0 and t["sglang_ttft_ms"] > 0
            assert t["sglang_prefill_ms"] is None and t["sglang_decode_time_ms"] >= 0
        assert rest["agent_metrics"]["reward_score"] in (0.0, 1.0)
    tasks = [line for line in progress_lines(trace_dir) if line.startswith("Task ")]
    assert len(tasks) == len(lines)
    assert all(re.fullmatch(r"Task [0-9a-f-]{36}/\d is completed, score=(0\.0|1\.0) status=Finished", t) for t in tasks)
