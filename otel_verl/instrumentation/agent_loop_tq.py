"""Rollout-worker side of verl's v1 trainer: the prompt tasks of ``AgentLoopWorkerTQ``.

``AgentLoopWorkerTQ`` is a ``@ray.remote`` class (pickled by value, its own methods
cannot be wrapped from outside), but it reports each prompt's lifecycle through
TransferQueue functions it looks up at call time: ``tq.async_kv_put(uid, tag={"status":
"running"})`` when the prompt's task starts, ``"finished"`` / ``"failure"`` when all its
sessions settled. Those calls open and end the prompt-task span. Its parent is the
carrier the trainer attached to the row (found by uid: it registered itself when the
row arrived in this process). The sessions themselves are trajectories
(:mod:`otel_verl.instrumentation.agent_loop`), children of the prompt task.
"""

from __future__ import annotations

from typing import Any, List

from otel_verl import carriers, events, health
from otel_verl.instrumentation._args import arguments
from otel_verl.instrumentation.hooks import Hook
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Role

TRANSFER_QUEUE = "transfer_queue"
COMPONENT = "agent_loop_tq"
TRAIN_PARTITION = "train"


def _async_kv_put(tracing: Tracing):
    async def wrapper(wrapped, instance, args, kwargs):
        status = None
        key = None
        try:
            _, values = arguments(wrapped, instance, args, kwargs)
            tag = values.get("tag")
            if values.get("partition_id") == TRAIN_PARTITION and values.get("fields") is None and isinstance(tag, dict):
                status, key = tag.get("status"), values.get("key")
                if status == "running":
                    _prompt_running(tracing, key)
        except Exception as exc:
            health.record_failure("agent_loop_tq.async_kv_put", exc)
        result = await wrapped(*args, **kwargs)
        if status in ("finished", "failure"):
            events.prompt_task_finished(key, failed=status == "failure")
        return result

    return wrapper


def _prompt_running(tracing: Tracing, uid: Any) -> None:
    tracing.active(Role.AGENT_LOOP_WORKER)
    carrier = carriers.take_arrived(uid)
    row = getattr(carrier, "row", None) or {}
    events.prompt_task_started(
        uid,
        step=int(row.get("step", -1)),
        agent_name=str(row.get("agent_name") or "agent"),
        parent=carrier,
        worker_index=row.get("worker"),
    )


def hooks(tracing: Tracing) -> List[Hook]:
    return [Hook(TRANSFER_QUEUE, "async_kv_put", _async_kv_put(tracing), ("key", "partition_id", "fields", "tag"), COMPONENT)]
