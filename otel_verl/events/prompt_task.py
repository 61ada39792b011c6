"""Rollout-worker events of verl's v1 trainer: one prompt's task running its sessions.

``AgentLoopWorkerTQ`` runs each prompt (uid) as a task that marks the prompt "running"
in TransferQueue, runs ``rollout.n`` sessions (trajectories, ``traj_uid`` = session id)
and marks it "finished" or "failure". The prompt-task span covers that task; the
session trajectories opened while it runs are its children.

    events.prompt_task_started(uid, step=3, agent_name="tool_agent", parent=carrier)
    ...  # sessions: events.trajectory(uid, session_id, parent=events.prompt_task_parent(uid))
    events.prompt_task_finished(uid, failed=False)
"""

from __future__ import annotations

from typing import Any, Optional

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from otel_verl import carriers, health, semconv as sc
from otel_verl.events import _core
from otel_verl.ids import id_str
from otel_verl.payload import Payload, end_span, start_span
from otel_verl.semconv import Subject

@health.guarded(default=None)
def prompt_task_started(
    uid: Any,
    *,
    step: int,
    agent_name: str,
    parent: Any = None,
    worker_index: Optional[int] = None,
) -> None:
    """A prompt's task started (verl marked it "running"). ``parent`` is the trainer's
    carrier for the row; without one the span parents to the sample root's derived ids."""
    rt = _core.state()
    if rt is None:
        return
    uid_s = id_str(uid)
    parent_ctx = carriers.context_from(parent) if parent is not None else None
    if parent_ctx is None:
        parent_ctx = _core._sample_root_context(uid_s)
    agent_name = _core._text(agent_name)
    attrs = {sc.UID: uid_s, sc.GLOBAL_STEP: int(step), sc.GEN_AI_AGENT_NAME: agent_name}
    if worker_index is not None:
        attrs[sc.WORKER_INDEX] = int(worker_index)
    span = start_span(rt.tracer, sc.SPAN_PROMPT_TASK, Payload(Subject.PROMPT_TASK), context=parent_ctx, attributes=attrs)
    rt.prompt_tasks.add(uid_s, span)


@health.guarded(default=None)
def prompt_task_finished(uid: Any, *, failed: bool = False) -> None:
    """verl marked the prompt "finished" or "failure": every session has settled."""
    rt = _core.state()
    span = rt.prompt_tasks.pop(id_str(uid)) if rt is not None else None
    if span is None:
        return
    if failed:
        span.set_status(Status(StatusCode.ERROR, "a session of this prompt failed"))
    end_span(span)


def prompt_task_parent(uid: Any) -> Optional[otel_context.Context]:
    """Parent context for a session of ``uid``: its open prompt task (``None`` if none)."""
    rt = _core.state()
    span = rt.prompt_tasks.get(id_str(uid)) if rt is not None else None
    return trace.set_span_in_context(span) if span is not None else None


def end_open_prompt_tasks(outcome: str = sc.Outcome.SHUTDOWN.value) -> int:
    """End every prompt task still open (worker shutdown)."""
    rt = _core.state()
    spans = rt.prompt_tasks.drain() if rt is not None else []
    for span in spans:
        _core._end(span, outcome)
    return len(spans)


def open_prompt_task_count() -> int:
    rt = _core.state()
    return len(rt.prompt_tasks) if rt is not None else 0
