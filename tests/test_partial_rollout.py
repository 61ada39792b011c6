"""A turn that verl's resuming client (``FullyAsyncLLMServerClient``) completes over several
aborted engine requests is one turn: one chat span with an attempt span per request, one
``LLM_GENERATE`` row pair, one JSONL turn with the whole completion.

The client is verl's own class with otel_verl's hooks on it; the load balancer and the
LLM server are in-process stand-ins for their Ray actors (the server side runs
otel_verl's real server wrapper), so no Ray cluster and no engine are needed."""

from __future__ import annotations

import asyncio
import json

import pytest
import wrapt

from otel_verl import events
from otel_verl.legacy.sample_csv import SampleCsvProcessor
from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor
from otel_verl.instrumentation import hooks, llm_client, llm_server
from otel_verl.instrumentation.tracing import Tracing

from demo_checks import csv_rows, jsonl_lines

pytestmark = pytest.mark.verl

PROMPT = [11, 12, 13]
# what the stand-in server decodes per request before an abort interrupts it; the last
# request runs to the end
PIECES = [[101, 102], [103], [], [104, 105, 106]]
# the weight version the server holds at each request: a sync between the second and third
VERSIONS = [3, 3, 4, 4]


class _Remote:
    """A stand-in for one method of a Ray actor handle: ``.remote(...)`` is awaitable."""

    def __init__(self, method):
        self.remote = method


class ResumingServerStandIn:
    """Stand-in for an LLM server replica whose requests a weight sync aborts: request k
    returns ``PIECES[k]`` with stop reason ``aborted``, the last one ``completed``.
    ``generate`` carries otel_verl's real server-side wrapper."""

    def __init__(self):
        self.requests = []  # (request id as the engine saw it, prompt ids)
        self.generate = _Remote(wrapt.FunctionWrapper(self._generate, llm_server._server_generate(Tracing(), "sglang")))

    async def _generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None):
        from verl.workers.rollout.replica import TokenOutput

        k = len(self.requests)
        self.requests.append((request_id, list(prompt_ids)))
        server = events.current_server_call()
        if server is not None:  # what sglang's TokenizerManager hook records per request
            server.record_meta({"e2e_latency": 0.01 * (k + 1), "queue_time": 0.001 * (k + 1)})
        last = k == len(PIECES) - 1
        # verl's servers say which weights served the request (their global_steps)
        return TokenOutput(token_ids=PIECES[k], stop_reason="completed" if last else "aborted",
                           extra_fields={"global_steps": VERSIONS[k]})


class LoadBalancerStandIn:
    """Stand-in for verl's load-balancer actor: one server, no acquire fields."""

    def __init__(self, server):
        async def fields():
            return []

        async def acquire_server(request_id, **_):
            return "replica-0", server

        self.require_acquire_fields = _Remote(fields)
        self.require_release_fields = _Remote(fields)
        self.acquire_server = _Remote(acquire_server)
        self.release_server = _Remote(lambda **_: None)


@pytest.fixture
def resumed_turn(make_pipeline, tmp_path, monkeypatch):
    """Runs one trajectory whose single turn verl's resuming client completes over three
    aborts; gives (finished spans, trace dir, the server stand-in)."""
    from omegaconf import OmegaConf
    from verl.workers.rollout import llm_server as verl_llm_server

    real_sleep = asyncio.sleep
    monkeypatch.setattr(verl_llm_server.asyncio, "sleep", lambda s: real_sleep(0))  # verl waits 1 s per retry
    trace_dir = tmp_path / "trace"
    csv = SampleCsvProcessor(str(trace_dir), discovery_path=str(tmp_path / "discovery.txt"))
    jsonl = TrajectoryJsonlProcessor(str(trace_dir), discovery_path=str(tmp_path / "discovery.txt"))
    pipeline = make_pipeline([csv, jsonl])
    hooks.install_all(llm_client.hooks(Tracing()))
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": "/models/tiny-qwen"},
                                                     "rollout": {"name": "sglang", "response_length": 64}}})
    server = ResumingServerStandIn()
    client = verl_llm_server.FullyAsyncLLMServerClient(config, load_balancer_handle=LoadBalancerStandIn(server))

    async def one_trajectory():
        with events.trajectory("u7", "2", step=1, agent_name="single_turn_agent", n_samples=1,
                               decode=lambda ids, **_: " ".join(map(str, ids))):
            output = await client.generate("sticky-1", prompt_ids=list(PROMPT), sampling_params={"temperature": 1.0})
        return output

    try:
        output = asyncio.run(one_trajectory())
    finally:
        hooks.uninstall_all()
    assert output.token_ids == [t for piece in PIECES for t in piece] and output.stop_reason == "completed"
    assert csv.force_flush() and jsonl.force_flush()
    return pipeline.spans(), str(trace_dir), server


def test_a_resumed_turn_is_one_chat_span_with_an_attempt_per_request(resumed_turn):
    spans, _, server = resumed_turn
    [chat] = [s for s in spans if s.name.startswith("chat")]
    attempts = sorted((s for s in spans if s.name == "verl.llm.attempt"), key=lambda s: s.attributes["verl.llm.attempt_number"])
    servers = [s for s in spans if s.name == "verl.llm_server.generate"]
    assert len(server.requests) == len(attempts) == len(servers) == len(PIECES)
    assert chat.attributes["verl.llm.attempts"] == len(PIECES)
    assert chat.attributes["gen_ai.usage.output_tokens"] == 6
    assert chat.attributes["gen_ai.response.finish_reasons"] == ("completed",)
    for number, (attempt, piece) in enumerate(zip(attempts, PIECES), start=1):
        assert attempt.parent.span_id == chat.context.span_id
        assert attempt.attributes["verl.llm.attempt_number"] == number
        assert attempt.attributes["gen_ai.usage.output_tokens"] == len(piece)
        assert attempt.attributes["verl.uid"] == "u7" and attempt.attributes["verl.traj_uid"] == "2"
        want = "completed" if number == len(PIECES) else "aborted"
        assert attempt.attributes["gen_ai.response.finish_reasons"] == (want,)
    # each server span hangs under the attempt whose request it served
    by_attempt = {s.parent.span_id for s in servers}
    assert by_attempt == {a.context.span_id for a in attempts}
    # the engine saw verl's fresh id per request, without our context; each resume sent
    # the tokens so far
    assert all(".otel." not in rid for rid, _ in server.requests)
    assert len({rid for rid, _ in server.requests}) == len(PIECES)
    sent = [len(prompt) for _, prompt in server.requests]
    assert sent == [3, 5, 6, 6]


def test_each_request_carries_the_weights_that_served_it_and_the_turn_their_range(resumed_turn):
    spans, _, _ = resumed_turn
    [chat] = [s for s in spans if s.name.startswith("chat")]
    [trajectory] = [s for s in spans if s.name.startswith("invoke_agent")]
    attempts = sorted((s for s in spans if s.name == "verl.llm.attempt"), key=lambda s: s.attributes["verl.llm.attempt_number"])
    assert [a.attributes["verl.weight_version"] for a in attempts] == VERSIONS
    assert chat.attributes["verl.weight_version"] == VERSIONS[-1]  # what served its last request
    for span in (chat, trajectory):
        assert (span.attributes["verl.weight_version.min"], span.attributes["verl.weight_version.max"]) == (3, 4)


def test_a_resumed_turn_writes_one_row_pair_and_one_jsonl_turn(resumed_turn):
    _, trace_dir, _ = resumed_turn
    llm_rows = sorted((r for r in csv_rows(trace_dir) if r["fields"]["stage"] == "LLM_GENERATE"), key=lambda r: r["order"])
    assert [r["fields"]["detail"] for r in llm_rows] == ["sending_generate_request", "received_generate_response"]
    [line] = jsonl_lines(trace_dir)
    turns = json.loads(line["raw_message"])["turns"]
    assert len(turns) == 1
    [turn] = turns
    assert turn["completion_text"] == "101 102 103 104 105 106"  # the whole completion, across attempts
    assert turn["finish_reason"] == "completed"
    # the first attempt's server timing stands for the turn
    assert turn["sglang_time_ms"] == pytest.approx(10.0) and turn["sglang_queue_time_ms"] == pytest.approx(1.0)
