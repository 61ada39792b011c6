"""The CPU harness runs verl's real v0 PPO loop on a real local Ray cluster (stand-ins only for GPUs).

These tests check real outcomes of real verl code: RayPPOTrainer.fit ran the requested steps,
the agent loop produced prompts * n trajectories per step, the ToolAgentLoop executed the
calculator tool and ran a second assistant turn, the scores are exactly what verl's gsm8k
reward function gives for the dumped responses, and the validation pass ran once. One Ray
cluster is shared by the module. No tracing is involved.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.filterwarnings("ignore")]

STEPS, PROMPTS, N = 2, 4, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from otel_verl.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


@pytest.fixture(scope="module")
def harness_ray(tmp_path_factory):
    """One local Ray cluster for the module, with a setup hook that records every worker process."""
    import ray

    from otel_verl.demo.harness import init_ray
    from otel_verl.demo.probe import PROBE_DIR_ENV

    probe_dir = str(tmp_path_factory.mktemp("probe"))
    started = init_ray(
        runtime_env={
            "worker_process_setup_hook": "otel_verl.demo.probe.setup_hook",
            "env_vars": {PROBE_DIR_ENV: probe_dir},
        }
    )
    yield {"probe_dir": probe_dir, "started": started}
    if started:
        ray.shutdown()


def _rollout_rows(summary, step):
    with open(os.path.join(summary["paths"]["rollout_dumps"], f"{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_common(summary, *, steps=STEPS, prompts=PROMPTS, n=N, validate=True):
    from verl.utils.reward_score import default_compute_score

    # RayPPOTrainer.fit ran every step, with the stand-in worker groups driven through verl's own methods
    assert summary["steps_run"] == steps
    assert summary["global_steps"] == list(range(1, steps + 1))
    calls = summary["worker_group_calls"]
    assert calls["update_actor"] == steps and calls["compute_log_prob"] == steps
    assert calls["compute_ref_log_prob"] == steps  # use_kl_loss -> ref policy
    assert summary["weight_versions"] == list(range(0, steps + 1))  # initial sync + one per step

    # the agent loop produced prompts * n trajectories per step, with response tokens
    assert summary["trajectories_per_step"] == {step: prompts * n for step in range(1, steps + 1)}
    for step in range(1, steps + 1):
        assert summary["metrics_per_step"][step]["response_length/mean"] > 0
        rows = _rollout_rows(summary, step)
        assert all(row["output"].strip() for row in rows)
        # the scores are verl's rule-based gsm8k reward of the dumped responses, and not all equal
        for row in rows:
            assert row["score"] == float(default_compute_score("openai/gsm8k", row["output"], row["gts"]))
        scores = summary["scores_per_step"][step]
        assert scores["distinct"] == [0.0, 1.0]
        assert summary["metrics_per_step"][step]["critic/score/mean"] == pytest.approx(scores["mean"])

    # exactly one validation pass, at the last step (greedy: the stand-in answers correctly)
    validation = summary["validation"]
    if validate:
        assert validation["ran"] and validation["passes"] == 1 and validation["trajectories"] == 4
        assert validation["metrics"]["val-core/openai/gsm8k/acc/mean@1"] == pytest.approx(1.0)
        assert any(k.startswith("val-core/") for k in summary["metrics_per_step"][steps])
        assert not any(k.startswith("val-") for k in summary["metrics_per_step"][1])
    else:
        assert not validation["ran"]

    # every LLM request went through LLMServerClient -> load balancer -> the server actor
    server = summary["server"]["per_server"][0]
    assert server["global_steps"] == steps and not server["asleep"]


@pytest.mark.timeout(900)
def test_single_turn_agent(harness_ray, model_dir, tmp_path):
    from otel_verl.demo.harness import run_v0

    summary = run_v0(str(tmp_path / "single"), steps=STEPS, prompts=PROMPTS, n=N, agent="single", model_dir=model_dir)
    print(json.dumps(summary["timings"]))

    _assert_common(summary)
    assert summary["ray"]["started_by_harness"] is False  # the module's cluster was reused
    for step in (1, 2):
        assert summary["metrics_per_step"][step]["num_turns/mean"] == 2  # user + assistant
    assert summary["tool"]["calls"] == 0
    assert summary["server"]["requests"] == STEPS * PROMPTS * N + 4  # + validation
    assert os.path.exists(summary["paths"]["summary"])


@pytest.mark.timeout(900)
def test_tool_agent(harness_ray, model_dir, tmp_path):
    from otel_verl.demo.harness import run_v0
    from otel_verl.demo.probe import recorded_pids

    summary = run_v0(str(tmp_path / "tool"), steps=STEPS, prompts=PROMPTS, n=N, agent="tool", model_dir=model_dir)
    print(json.dumps(summary["timings"]))

    _assert_common(summary)
    trajectories = STEPS * PROMPTS * N + 4
    # the calculator ran once per trajectory, inside the AgentLoopWorker processes (not this one)
    tool = summary["tool"]
    assert tool["calls"] == tool["ok_calls"] == trajectories
    assert tool["worker_pids"] and os.getpid() not in tool["worker_pids"]
    # each trajectory: tool call -> tool response -> second assistant turn with the final answer
    assert summary["server"]["tool_call_outputs"] == trajectories
    assert summary["server"]["second_turn_requests"] == trajectories
    for step in (1, 2):
        assert summary["metrics_per_step"][step]["num_turns/mean"] == 4  # user, assistant, tool, assistant
        assert tool["trajectories_with_tool_roundtrip"][step] == PROMPTS * N
        for row in _rollout_rows(summary, step):
            call_part, _, answer_part = row["output"].partition("<tool_response>")
            assert '"name": "calculator"' in call_part and "</tool_response>" in answer_part
            assert row["gts"] in answer_part.split("</tool_response>")[0]  # the tool's real result came back

    # the runtime_env's setup hook reached the worker processes (the path a tracing layer uses)
    if harness_ray["started"]:
        pids = recorded_pids(harness_ray["probe_dir"])
        assert set(tool["worker_pids"]) <= pids
        assert summary["server"]["per_server"][0]["pid"] in pids


@pytest.mark.timeout(900)
def test_sglang_server_and_trainer_in_actor(harness_ray, model_dir, tmp_path):
    """A small run with verl's real SGLangHttpServer.generate as the server and the trainer in a Ray actor."""
    from otel_verl.demo.harness import run_v0

    summary = run_v0(
        str(tmp_path / "sglang"), steps=1, prompts=2, n=2, agent="tool", validate=False, agent_workers=1,
        server="sglang", trainer_in_actor=True, model_dir=model_dir,
    )
    _assert_common(summary, steps=1, prompts=2, n=2, validate=False)
    assert summary["server"]["per_server"][0]["server_class"] == "SGLangHttpServer"
    assert summary["tool"]["calls"] == 4


@pytest.mark.timeout(300)
def test_sglang_http_server_generate_runs_verl_method(model_dir):
    """verl's SGLangHttpServer.generate body runs over the stand-in engine; timing stays engine-side."""
    from otel_verl.demo import sglang_standin
    from otel_verl.demo.llm_server_standin import TokenizerManagerStandIn
    from otel_verl.demo.tools import TOOL_SCHEMA

    try:
        server = sglang_standin.make_sglang_server_standin(model_config=model_dir, global_steps=7)
        module = sglang_standin.import_sglang_server_module()
        assert type(server) is module.SGLangHttpServer
        # verl's method, not a copy (seen through otel_verl's wrapper when another test
        # in this process switched tracing on)
        method = vars(module.SGLangHttpServer)["generate"]
        assert server.generate.__func__ is getattr(method, "__wrapped__", method)

        seen = []
        inner = TokenizerManagerStandIn.generate_request

        async def recording(self, obj, request=None):  # what a tracing wrapper would see
            async for out in inner(self, obj, request):
                seen.append((obj, out["meta_info"]))
                yield out

        server.tokenizer_manager.generate_request = recording.__get__(server.tokenizer_manager)
        tokenizer = server.tokenizer_manager.tokenizer
        messages = [{"role": "user", "content": "A farm has 12 cows and 30 sheep. How many animals?"}]
        prompt_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        tool_prompt = tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], tokenize=True, add_generation_prompt=True)[
            "input_ids"
        ]

        async def run():
            greedy = await server.generate(prompt_ids, {"temperature": 0, "logprobs": True}, "req-1")
            tool_call = await server.generate(tool_prompt, {"temperature": 0, "max_new_tokens": 8}, "req-2")
            await server.sleep()  # verl's sleep -> ReleaseMemoryOccupationReqInput -> the engine
            with pytest.raises(RuntimeError):
                await server.generate(prompt_ids, {"temperature": 0}, "req-3")
            return greedy, tool_call

        greedy, tool_call = asyncio.run(run())
    finally:
        sglang_standin.uninstall()

    text = tokenizer.decode(greedy.token_ids)
    assert text.endswith("#### 42<|im_end|>") and greedy.stop_reason == "stop"
    assert len(greedy.log_probs) == len(greedy.token_ids)
    assert greedy.extra_fields == {"global_steps": 7}  # verl keeps no engine timing in TokenOutput
    # verl's body built the request: GenerateReqInput with its max_new_tokens rule and rid
    obj, meta = seen[0]
    assert type(obj).__name__ == "GenerateReqInput" and obj.rid == "req-1"
    assert obj.sampling_params["max_new_tokens"] == min(128, 512 + 128 - len(prompt_ids))
    assert obj.return_logprob is True and "logprobs" not in obj.sampling_params
    # verl's default rollout config leaves sglang's metrics off: only e2e_latency, as sglang
    assert isinstance(meta["e2e_latency"], float)
    assert not set(meta) & {"queue_time", "request_received_ts", "prefill_finished_time", "prefill_finished_ts"}
    assert meta["completion_tokens"] == len(greedy.token_ids)
    # caller's max_new_tokens honoured -> finish reason "length", cut tool call
    assert len(tool_call.token_ids) == 8 and tool_call.stop_reason == "length" and tool_call.log_probs is None
    import importlib.util

    assert importlib.util.find_spec("sglang") is None  # uninstall() removed the stand-in


SGLANG_0_5_12_TIMING = {  # what sglang 0.5.12 adds to a finished request's meta_info with enable_metrics
    "request_received_ts", "api_server_dispatch_finish_ts", "forward_entry_time", "prefill_finished_time",
    "queue_time", "response_sent_to_client_ts", "request_finished_ts",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("switch", [
    {"engine_kwargs": {"sglang": {"enable_metrics": True}}},  # what otel-verl run adds
    {"prometheus": {"enable": True}},  # verl's Prometheus switch
    {},
])
def test_the_sglang_stand_in_reports_timing_as_verl_switches_sglang_metrics(model_dir, switch):
    """verl's SGLangHttpServer starts sglang with enable_metrics from engine_kwargs.sglang or
    prometheus.enable; the stand-in engine then answers with sglang 0.5.12's timing keys."""
    from otel_verl.demo import sglang_standin
    from otel_verl.demo.llm_server_standin import sglang_enable_metrics

    config = {"name": "sglang", "prompt_length": 512, "response_length": 128, "max_model_len": 640,
              "tensor_model_parallel_size": 1, "_target_": "verl.workers.config.RolloutConfig", **switch}
    if "prometheus" in config:
        config["prometheus"] = {"_target_": "verl.workers.config.PrometheusConfig", **config["prometheus"]}
    try:
        server = sglang_standin.make_sglang_server_standin(config, model_config=model_dir)
        seen = []
        inner = server.tokenizer_manager.generate_request

        async def recording(obj, request=None):
            async for out in inner(obj, request):
                seen.append(out["meta_info"])
                yield out

        server.tokenizer_manager.generate_request = recording
        asyncio.run(server.generate([1, 2, 3], {"temperature": 0}, "req-1"))
    finally:
        sglang_standin.uninstall()
    [meta] = seen
    assert sglang_enable_metrics(server.config) is bool(switch)
    if switch:
        assert SGLANG_0_5_12_TIMING <= set(meta)
        assert meta["request_received_ts"] <= meta["forward_entry_time"] <= meta["prefill_finished_time"]
        assert meta["prefill_finished_time"] <= meta["request_finished_ts"]
        # the keys sglang 0.5.12 does not write
        assert not set(meta) & {"prefill_finished_ts", "prefill_launch_latency", "first_token_latency"}
    else:
        assert not set(meta) & SGLANG_0_5_12_TIMING
    assert meta["e2e_latency"] > 0


def test_the_engine_stand_in_continues_a_resumed_partial_reply():
    """A request aborted mid-decode comes back with its partial reply appended to the
    prompt: the stand-in engine goes on from there, as sglang does (a fresh reply would
    leave a broken tool call before a whole one in the response)."""
    from otel_verl.demo.llm_server_standin import IM_END, IM_START, _continuation

    reply = 'I will add 3 and 4 with the calculator.\n<tool_call>\n{"name": "calculator"}\n</tool_call>'
    prompt = f"{IM_START}user\nAdd 3 and 4{IM_END}\n{IM_START}assistant\n"
    assert _continuation(prompt, reply) == reply  # a new turn
    partial = reply[:50]
    assert partial + _continuation(prompt + partial, reply) == reply
    assert _continuation(prompt + "something else", reply) == reply  # not this reply's start: a fresh one
    done = f"{prompt}{reply}{IM_END}\n{IM_START}user\n<tool_response>7</tool_response>{IM_END}\n{IM_START}assistant\n"
    assert _continuation(done, "The total is 7") == "The total is 7"
