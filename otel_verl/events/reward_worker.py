"""Reward-actor events: the reward worker's side of one trajectory's reward computation."""

from __future__ import annotations

from typing import Any, ContextManager, Optional

from opentelemetry.trace import SpanKind

from otel_verl import carriers, health, semconv as sc
from otel_verl.events._core import SpanScope, _start, _text
from otel_verl.semconv import Subject

# What the worker's carrier row may put on the actor's span (see RewardHandle.carrier)
_SAMPLE_KEYS = (sc.UID, sc.TRAJ_UID, sc.GLOBAL_STEP)


class RewardWorkerCall(SpanScope):
    """The ``with`` block of :func:`reward_worker_call`, and what it yields: the caller
    reports the score the reward manager computed."""

    def value(self) -> "RewardWorkerCall":
        return self

    @health.guarded(default=None)
    def score(self, value: Any) -> None:
        if self.span is not None and value is not None:
            self.span.set_attribute(sc.REWARD_SCORE, float(value))


def reward_worker_call(parent: Any, *, reward_manager: Optional[str] = None) -> ContextManager[RewardWorkerCall]:
    """One ``compute_score`` call of a reward actor, parented to the trajectory's reward
    span that ``parent`` (the carrier the rollout worker sent with the data) names.
    Without a valid parent nothing is traced: the call did not come from a traced
    trajectory."""
    try:
        context = carriers.context_from(parent) if parent is not None else None
        if context is None:
            return RewardWorkerCall(None)
        row = getattr(parent, "row", None) or {}
        attrs = {key: row[key] for key in _SAMPLE_KEYS if row.get(key) is not None}
        if reward_manager:
            attrs[sc.REWARD_MANAGER] = _text(reward_manager)
        span = _start(sc.SPAN_REWARD_WORKER, Subject.REWARD_WORKER, context, attrs, kind=SpanKind.SERVER,
                      skippable=True)
        return RewardWorkerCall(span)
    except Exception as exc:  # the reward is computed untraced
        health.record_failure("events.reward_worker_call", exc)
        return RewardWorkerCall(None)
