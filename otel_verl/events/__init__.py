"""The domain events API: what happened to which sample, turned into spans.

Wrappers around verl (and custom agent loops) call these functions; they never build
spans themselves. Every function here is safe to call when tracing is off (it does
nothing) and never raises into the caller: a failure is counted in
:mod:`otel_verl.health` and reported once.

Trainer side::

    events.samples_created(uids, step=3, trainer="RayPPOTrainer")
    carriers = events.rollout_dispatched(uids, traj_uids, worker_indices, step=3, ...)
    with events.step_stage(Stage.OLD_LOG_PROB, step=3):
        ...
        events.sample_stage_done(Stage.OLD_LOG_PROB, uids, traj_uids, step=3, start_ns=t0)
    events.samples_finished(uids, Outcome.TRAINED)

Rollout worker side::

    with events.trajectory(uid, traj_uid, step=3, agent_name="tool_agent", provider="sglang", parent=carrier):
        with events.agent_run("ToolAgentLoop"):
            events.chat_messages(messages)  # read only with content capture on
            with events.llm_call(prompt_ids, model="qwen") as turn:
                ...
                turn.finish(token_ids, stop_reason="stop", server_meta={...})
            with events.tool_call("calculator", arguments='{"x": 1}') as tool:
                ...
                tool.result("2")
        with events.reward() as reward:
            reward.score(1.0)

Reward actor side (the reward span's carrier came with the data)::

    with events.reward_worker_call(carrier, reward_manager="NaiveRewardManager") as call:
        call.score(1.0)

The functions live in :mod:`.trainer` (trainer process), :mod:`.worker` (rollout worker),
:mod:`.server` (LLM server actor) and :mod:`.reward_worker` (reward actor), on top of the
shared plumbing in :mod:`._core`.
"""

from __future__ import annotations

from typing import Any

from otel_verl.events._core import TracingState, enabled, install, install_for, is_validating, state, validating, current_span_scope
from otel_verl.events._core import _capturing_content as capturing_content
from otel_verl.events.prompt_task import (
    end_open_prompt_tasks,
    open_prompt_task_count,
    prompt_task_finished,
    prompt_task_parent,
    prompt_task_started,
)
from otel_verl.events.reward_worker import RewardWorkerCall, reward_worker_call
from otel_verl.events.server import ServerCall, current_server_call, llm_server_call
from otel_verl.events.trainer import (
    StageHandle,
    current_stage,
    current_step,
    end_open_samples,
    end_samples_before,
    end_unconsumed_samples,
    fit_started,
    open_sample_count,
    rollout_dispatched,
    rollout_returned,
    sample_stage_done,
    samples_created,
    samples_finished,
    stage_begin,
    step,
    step_begin,
    step_end,
    step_stage,
)
from otel_verl.events.worker import (
    RewardHandle,
    ToolCall,
    Turn,
    agent_metrics,
    agent_run,
    chat_messages,
    current_trajectory,
    current_turn,
    llm_call,
    observation,
    reward,
    tool_call,
    trajectory,
    trajectory_score,
)
