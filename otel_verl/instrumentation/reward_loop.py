"""Reward actor side: verl's ``RewardLoopWorker.compute_score`` as a span under the
trajectory's reward span.

The rollout worker computes a trajectory's reward by sending a one-trajectory DataProto
to a ``RewardLoopWorker`` actor (``compute_score.remote(data)``). verl builds that
DataProto's columns from the row's keyword arguments, so the reward span's carrier rides
as one more column (see :mod:`.agent_loop`); it is popped here before the reward manager
(possibly a user's, which may walk every column) sees the data.
"""

from __future__ import annotations

from typing import Any, List, Optional

from otel_verl import carriers, events, health
from otel_verl.instrumentation._args import arguments
from otel_verl.instrumentation.hooks import Hook
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Role

REWARD_LOOP = "verl.experimental.reward_loop.reward_loop"
COMPONENT = "reward_loop"


def _carrier_of(column: Any) -> Optional[Any]:
    """The column's carrier (every row of one trajectory's data holds the same one)."""
    if column is None or len(column) == 0:
        return None
    return column[-1]


def _compute_score(tracing: Tracing):
    async def wrapper(wrapped, instance, args, kwargs):
        parent = None
        try:
            data = arguments(wrapped, instance, args, kwargs)[1].get("data")
            parent = _carrier_of(carriers.pop_column(data))  # popped even when tracing is off here
        except Exception as exc:
            health.record_failure("reward_loop.compute_score", exc)
        if parent is None or not tracing.active(Role.REWARD_WORKER):
            return await wrapped(*args, **kwargs)
        manager = getattr(instance, "reward_manager", None)
        manager_name = type(manager).__name__ if manager is not None else None
        with events.reward_worker_call(parent, reward_manager=manager_name) as call:
            result = await wrapped(*args, **kwargs)
            call.score(result.get("reward_score") if isinstance(result, dict) else None)
            return result

    return wrapper


def hooks(tracing: Tracing) -> List[Hook]:
    return [Hook(REWARD_LOOP, "RewardLoopWorker.compute_score", _compute_score(tracing), ("data",), COMPONENT)]
