"""Rollout-worker side: trajectories, agent runs, tools, observations and reward.

Runs in the AgentLoopWorker (and v1 AgentLoopWorkerTQ) actor processes. Each sample
runs in its own asyncio Task, so the trajectory span opened around
``AgentLoopWorker._run_agent_loop`` is current for everything the agent loop does
(``run()``, LLM calls, tools, ``_compute_score``) through contextvars.

The trainer's per-row carrier (a ``otel_traceparent`` column, see
:mod:`otel_verl.carriers`) reaches ``_run_agent_loop`` as a keyword argument; it is popped
there, before the agent loop, the reward DataProto or TransferQueue can see it, and
removed from the batch-level columns ``_postprocess`` copies into the output.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, List, Optional

from otel_verl import carriers, events, health
from otel_verl.instrumentation._args import arguments, with_argument
from otel_verl.instrumentation.hooks import Hook, install_on
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Role

AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
TOOL_AGENT_LOOP = "verl.experimental.agent_loop.tool_agent_loop"
COMPONENT = "agent_loop"


def _trajectory_args(worker: Any, trajectory: Optional[dict], kwargs: dict, carrier: Any) -> dict:
    """:func:`events.trajectory`'s arguments from ``_run_agent_loop``'s (``kwargs``: the
    row's columns) and the carrier the trainer sent with the row."""
    row = getattr(carrier, "row", None) or {}
    trajectory = trajectory or {}
    session_id = kwargs.get("session_id")
    traj_uid = row.get("traj_uid")
    if traj_uid is None or traj_uid == "N/A":
        traj_uid = session_id if session_id is not None else kwargs.get("traj_uid", "N/A")
    rollout_config = getattr(worker, "rollout_config", None)
    uid = kwargs.get("uid", "N/A")
    # v1: a session is a child of its prompt's task (see agent_loop_tq)
    prompt_task = events.prompt_task_parent(uid) if session_id is not None else None
    return dict(
        uid=uid,
        traj_uid=traj_uid,
        step=int(trajectory.get("step", kwargs.get("global_steps", -1)) or -1),
        agent_name=str(kwargs.get("agent_name") or "agent"),
        provider=_provider(worker, rollout_config),
        parent=prompt_task if prompt_task is not None else carrier,
        n_samples=getattr(rollout_config, "n", None),
        worker_index=row.get("worker"),
        trainer_api="v1" if session_id is not None else "v0",
        validate=bool(trajectory.get("validate", False)),
        tokenizer=getattr(worker, "tokenizer", None),
    )


PROVIDER_ATTR = "_otel_verl_provider"  # (rollout config, provider) on the worker


def _provider(worker: Any, rollout_config: Any) -> str:
    """``gen_ai.provider.name``: the rollout engine (``rollout.name``: sglang, vllm), else
    ``verl``. Read once per worker and config: an OmegaConf lookup costs tens of µs."""
    cached = getattr(worker, PROVIDER_ATTR, None)
    if cached is not None and cached[0] is rollout_config:
        return cached[1]
    name = getattr(rollout_config, "name", None)
    provider = str(name) if name else "verl"
    try:
        setattr(worker, PROVIDER_ATTR, (rollout_config, provider))
    except Exception:  # a worker that takes no attributes: read it every time
        pass
    return provider


def _run_agent_loop(tracing: Tracing):
    async def wrapper(wrapped, instance, args, kwargs):
        carrier = carriers.pop_kwargs(kwargs)  # verl passes the row's columns as keywords: ours never reaches it
        if not tracing.active(Role.AGENT_LOOP_WORKER):
            return await wrapped(*args, **kwargs)
        try:
            worker, values = arguments(wrapped, instance, args, kwargs)
            traj_args = _trajectory_args(worker, values.get("trajectory"), kwargs, carrier)
        except Exception as exc:
            health.record_failure("agent_loop._run_agent_loop", exc)
            return await wrapped(*args, **kwargs)
        with events.trajectory(**traj_args):
            return await wrapped(*args, **kwargs)

    return wrapper


def _postprocess(wrapped, instance, args, kwargs):
    # Input columns are copied into the output in non-streaming reward mode: never ours.
    try:
        _, values = arguments(wrapped, instance, args, kwargs)
        columns = values.get("input_non_tensor_batch")
        if isinstance(columns, dict) and carriers.COLUMN in columns:
            columns = {k: v for k, v in columns.items() if k != carriers.COLUMN}
            args, kwargs = with_argument(wrapped, instance, args, kwargs, "input_non_tensor_batch", columns)
    except Exception as exc:
        health.record_failure("agent_loop._postprocess", exc)
    return wrapped(*args, **kwargs)


async def _agent_run(wrapped, instance, args, kwargs):
    agent_loop = args[0] if instance is None and args else instance  # self comes first when called through the class
    with events.agent_run(type(agent_loop).__name__):
        # Every agent loop starts from the row's chat messages (its first LLM call's input).
        events.chat_messages(kwargs.get("raw_prompt"))
        return await wrapped(*args, **kwargs)


async def _handle_generating_state(wrapped, instance, args, kwargs):
    # ToolAgentLoop's conversation, as its next LLM call sends it (content capture only).
    if events.capturing_content():
        try:
            events.chat_messages(arguments(wrapped, instance, args, kwargs)[1]["agent_data"].messages)
        except Exception as exc:
            health.record_failure("agent_loop._handle_generating_state", exc)
    return await wrapped(*args, **kwargs)


def _worker_init(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    # Agent loop classes are known only now (the registry, plus any loaded from
    # agent_loop_config_path in __init__): wrap each one's own run().
    try:
        wrap_registered_agent_loops()
    except Exception as exc:
        health.record_failure("agent_loop.registry", exc)
    return result


def wrap_registered_agent_loops() -> List[str]:
    module = sys.modules.get(AGENT_LOOP)
    registry = getattr(module, "_agent_loop_registry", {}) or {}
    wrapped_names = []
    for config in list(registry.values()):
        target = config.get("_target_") if hasattr(config, "get") else None
        if not target:
            continue
        module_name, _, class_name = str(target).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as exc:
            health.record_failure(f"agent_loop.import {target}", exc)
            continue
        for klass in cls.__mro__:  # the class that actually defines run()
            if "run" in vars(klass) and klass.__module__ != AGENT_LOOP:
                install_on(klass, "run", _agent_run)
                wrapped_names.append(klass.__qualname__)
                break
    return wrapped_names


async def _compute_score(wrapped, instance, args, kwargs):
    try:
        worker, values = arguments(wrapped, instance, args, kwargs)
        outputs = values.get("outputs") or []
        final = outputs[-1] if outputs else None
        scored_here = final is not None and final.reward_score is None and getattr(worker, "reward_loop_worker_handles", None) is not None
    except Exception as exc:
        health.record_failure("agent_loop._compute_score", exc)
        return await wrapped(*args, **kwargs)
    if not scored_here:
        result = await wrapped(*args, **kwargs)
        _record_outcome(final, None)
        return result
    with events.reward() as reward:
        args, kwargs = _with_reward_carrier(wrapped, instance, args, kwargs, reward)
        result = await wrapped(*args, **kwargs)
        _record_outcome(final, reward)
    return result


def _with_reward_carrier(wrapped, instance, args, kwargs, reward):
    """``_compute_score``'s arguments with the reward span's carrier added to a copy of
    its ``kwargs`` (the row's columns, which verl turns into the columns of the reward
    DataProto it sends the reward actor; the row's own dict stays untouched)."""
    try:
        carrier = reward.carrier()
        row = arguments(wrapped, instance, args, kwargs)[1].get("kwargs")
        if carrier is None or not isinstance(row, dict):
            return args, kwargs
        return with_argument(wrapped, instance, args, kwargs, "kwargs", {**row, carriers.COLUMN: carrier})
    except Exception as exc:
        health.record_failure("agent_loop.reward_carrier", exc)
        return args, kwargs


@health.guarded(default=None)
def _record_outcome(final: Any, reward: Any) -> None:
    if final is None:
        return
    metrics = getattr(final, "metrics", None)
    if metrics is not None:
        events.agent_metrics(metrics.model_dump() if hasattr(metrics, "model_dump") else dict(metrics))
    if final.reward_score is not None:
        label = _reward_label(final)
        if reward is not None:
            reward.score(final.reward_score, label=label)
        else:
            events.trajectory_score(final.reward_score, label=label)


def _reward_label(final: Any) -> "str | None":
    """The reward's verdict in words, where verl's reward gives one: a text ``label`` in
    its extra info, else its ``acc`` (verl's math and code scorers) as correct/incorrect."""
    extra = getattr(final, "extra_fields", None)
    info = extra.get("reward_extra_info") if isinstance(extra, dict) else None
    if not isinstance(info, dict):
        return None
    label = info.get("label")
    if isinstance(label, str):
        return label
    acc = info.get("acc")
    acc = acc.item() if hasattr(acc, "item") else acc  # a numpy scalar
    if isinstance(acc, (bool, int, float)) and acc in (0, 1):
        return "correct" if acc else "incorrect"
    return None


async def _call_tool(wrapped, instance, args, kwargs):
    try:
        tool_call = arguments(wrapped, instance, args, kwargs)[1].get("tool_call")
        name = str(getattr(tool_call, "name", "tool"))
        call_id = getattr(tool_call, "tool_call_id", None)
        tool_arguments = getattr(tool_call, "arguments", None)  # on the span only with content capture on
    except Exception as exc:
        health.record_failure("agent_loop._call_tool", exc)
        return await wrapped(*args, **kwargs)
    with events.tool_call(name, call_id=call_id, arguments=tool_arguments) as call:
        result = await wrapped(*args, **kwargs)
        call.result(_tool_result_text(result))  # on the span only with content capture on
        return result


def _tool_result_text(result: Any) -> Any:
    """The text of ``_call_tool``'s ``(ToolResponse, reward, metrics)``."""
    response = result[0] if isinstance(result, tuple) and result else result
    return getattr(response, "text", None)


async def _handle_processing_tools_state(wrapped, instance, args, kwargs):
    try:
        agent_data = arguments(wrapped, instance, args, kwargs)[1].get("agent_data")
        before = len(agent_data.messages)
    except Exception as exc:
        health.record_failure("agent_loop._handle_processing_tools_state", exc)
        return await wrapped(*args, **kwargs)
    result = await wrapped(*args, **kwargs)
    _report_observations(agent_data, before)
    return result


@health.guarded(default=None)
def _report_observations(agent_data: Any, before: int) -> None:
    events.observation(_observation_texts(agent_data.messages[before:]))


def _observation_texts(messages: List[Any]) -> List[str]:
    texts = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("tool", "function"):
            continue
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(c.get("text", "") if isinstance(c, dict) else str(c) for c in content)
        texts.append(str(content))
    return texts


def hooks(tracing: Tracing) -> List[Hook]:
    return [
        Hook(AGENT_LOOP, "AgentLoopWorker.__init__", _worker_init, ("config",), COMPONENT),
        Hook(AGENT_LOOP, "AgentLoopWorker._run_agent_loop", _run_agent_loop(tracing),
             ("sampling_params", "trajectory", "agent_name"), COMPONENT),
        Hook(AGENT_LOOP, "AgentLoopWorker._postprocess", _postprocess, ("input_non_tensor_batch",), COMPONENT),
        Hook(AGENT_LOOP, "AgentLoopWorker._compute_score", _compute_score, ("outputs", "kwargs"), COMPONENT),
        Hook(TOOL_AGENT_LOOP, "ToolAgentLoop._call_tool", _call_tool, ("tool_call",), COMPONENT),
        Hook(TOOL_AGENT_LOOP, "ToolAgentLoop._handle_generating_state", _handle_generating_state, ("agent_data",),
             COMPONENT),
        Hook(TOOL_AGENT_LOOP, "ToolAgentLoop._handle_processing_tools_state", _handle_processing_tools_state,
             ("agent_data",), COMPONENT),
    ]
