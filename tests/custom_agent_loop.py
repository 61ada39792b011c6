"""A custom agent loop for tests: loaded by verl's ``AgentLoopWorker`` from
``rollout.agent.agent_loop_config_path`` (see :func:`write_agent_loop_config`), never
imported by otel_verl itself.

``EchoTwiceAgentLoop`` is verl's ``SingleTurnAgentLoop`` (text only) that asks the model
twice through ``self.server_manager.generate`` -- a draft, then the same prompt again --
and returns the second answer as the single assistant turn. So tracing has to find its
two LLM turns at the LLM client, with no hook of its own.

This module must be importable in the Ray workers: put ``tests/`` on their ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.profiler import simple_timer

AGENT_NAME = "my_agent"
CLASS_NAME = "EchoTwiceAgentLoop"
MODULE = "custom_agent_loop"  # as imported with tests/ on sys.path
GENERATE_CALLS = 2


class EchoTwiceAgentLoop(AgentLoopBase):
    """Two generate calls per run; otherwise single-turn semantics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_length = self.rollout_config.response_length

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        priority = int(priority)
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        output = None
        metrics: dict[str, Any] = {}
        with simple_timer("generate_sequences", metrics):
            for _ in range(GENERATE_CALLS):
                output = await self.server_manager.generate(
                    request_id=uuid4().hex,
                    prompt_ids=list(prompt_ids),
                    sampling_params=sampling_params,
                    priority=priority,
                )
        metrics["num_preempted"] = output.num_preempted if output.num_preempted is not None else -1
        merge_result, response_mask, response_logprobs = await self.ct_merge_assistant_token(
            prompt_ids,
            output.token_ids,
            [],
            [] if output.log_probs else None,
            assistant_logprobs=output.log_probs if output.log_probs else None,
        )
        response_ids = merge_result.token_ids[-len(response_mask) :] if response_mask else []
        prompt_ids = merge_result.token_ids[: len(merge_result.token_ids) - len(response_mask)]
        result = AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length] if response_logprobs else None,
            num_turns=2,
            metrics=metrics,
            extra_fields=output.extra_fields,
        )
        result.extra_fields.update({"turn_scores": [], "tool_rewards": []})
        return result


def write_agent_loop_config(directory: str) -> str:
    """The ``agent_loop_config_path`` YAML registering :class:`EchoTwiceAgentLoop` as ``my_agent``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "agent_loops.yaml")
    with open(path, "w") as f:
        f.write(f"- name: {AGENT_NAME}\n  _target_: {MODULE}.{CLASS_NAME}\n")
    return path
