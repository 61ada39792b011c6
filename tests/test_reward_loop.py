"""The reward actor's span: verl's real ``AgentLoopWorker._compute_score`` sends a
trajectory's reward DataProto to verl's real ``RewardLoopWorker.compute_score`` (with the
real ``NaiveRewardManager``), in-process: the Ray handle between them is a stand-in that
pickles the data as a Ray call would. The same path on a Ray cluster is checked by
test_demo_v0.py."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from otel_verl import carriers, events
from otel_verl import semconv as sc

pytestmark = pytest.mark.verl

UID = "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5"


class _TokenizerStandIn:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def _answer_is_six(data_source, solution_str, ground_truth, extra_info=None, **_):
    return 1.0 if solution_str.split()[-1] == ground_truth else 0.0


class _RemoteMethodStandIn:
    """``handle.compute_score`` of a Ray actor handle: the data crosses as pickled bytes."""

    def __init__(self, method):
        self.method = method
        self.received = []

    def remote(self, data):
        received = pickle.loads(pickle.dumps(data))
        self.received.append(received)
        return self.method(received)


class _RewardActorHandleStandIn:
    def __init__(self, reward_worker):
        self.compute_score = _RemoteMethodStandIn(reward_worker.compute_score)


def _reward_worker():
    from omegaconf import OmegaConf
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    worker = object.__new__(RewardLoopWorker)  # __init__ loads a tokenizer from a model path
    worker.config = OmegaConf.create({"reward": {"custom_reward_function": {"path": None},
                                                 "reward_model": {"enable": False}}})
    worker.reward_manager = NaiveRewardManager(worker.config, _TokenizerStandIn(), _answer_is_six)
    return worker


def _agent_loop_worker(handle):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = object.__new__(AgentLoopWorker)  # __init__ starts LLM clients
    worker.reward_loop_worker_handles = [handle]
    worker.processor = None
    worker.mm_processor_kwargs = None
    return worker


def _output():
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    return AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6], response_mask=[1, 1, 1],
                           num_turns=2, metrics=AgentLoopMetrics(), extra_fields={})


@pytest.fixture
def hooked(make_pipeline):
    import importlib

    from otel_verl.instrumentation import agent_loop, hooks, reward_loop
    from otel_verl.instrumentation.tracing import Tracing

    pipeline = make_pipeline()
    tracing = Tracing()
    reward_hooks, agent_hooks = reward_loop.hooks(tracing), agent_loop.hooks(tracing)
    table = [*agent_hooks, *reward_hooks]
    hooks.install_all(table)
    try:
        for module in (agent_loop.AGENT_LOOP, reward_loop.REWARD_LOOP):
            importlib.import_module(module)
        status = hooks.status()
        for hook in (*reward_hooks, *[h for h in agent_hooks if h.target.endswith("_compute_score")]):
            assert status[hook.name][0] == hooks.INSTALLED, status[hook.name]
        yield pipeline
    finally:
        hooks.uninstall_all()


def test_the_reward_actor_span_is_a_child_of_the_trajectory_reward_span(hooked):
    pipeline = hooked
    output = _output()
    row = {"uid": UID, "traj_uid": "1", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "6"},
           "extra_info": {}}

    async def run():  # verl's reward manager keeps the event loop it was made in
        handle = _RewardActorHandleStandIn(_reward_worker())
        with events.trajectory(UID, "1", step=3, agent_name="single_turn_agent"):
            await _agent_loop_worker(handle)._compute_score([output], row)
        return handle

    handle = asyncio.run(run())

    assert output.reward_score == 1.0
    [sent] = handle.compute_score.received
    assert carriers.COLUMN not in sent.non_tensor_batch  # popped before the reward manager saw the data
    assert carriers.COLUMN not in row  # verl's row is not touched
    spans = pipeline.spans()
    [reward] = [s for s in spans if s.name == sc.SPAN_REWARD]
    [actor] = [s for s in spans if s.name == sc.SPAN_REWARD_WORKER]
    assert actor.parent.span_id == reward.context.span_id and actor.context.trace_id == reward.context.trace_id
    assert actor.kind.name == "SERVER"
    assert dict(actor.attributes) == {sc.UID: UID, sc.TRAJ_UID: "1", sc.GLOBAL_STEP: 3,
                                      sc.REWARD_MANAGER: "NaiveRewardManager", sc.REWARD_SCORE: 1.0}
    assert reward.attributes[sc.REWARD_SCORE] == 1.0


def test_data_from_an_untraced_caller_is_scored_untraced(hooked):
    """The trainer's colocated reward path (compute_score_batch) sends no carrier."""
    from verl.protocol import DataProto
    import numpy as np
    import torch

    pipeline = hooked
    data = DataProto.from_dict(
        tensors={"responses": torch.tensor([[4, 6]]), "attention_mask": torch.tensor([[1, 1, 1, 1]])},
        non_tensors={"data_source": np.array(["openai/gsm8k"], dtype=object),
                     "reward_model": np.array([{"ground_truth": "6"}], dtype=object)},
    )

    async def run():
        return await _reward_worker().compute_score(data)

    result = asyncio.run(run())
    assert result["reward_score"] == 1.0
    assert [s.name for s in pipeline.spans()] == []
