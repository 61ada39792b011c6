"""Trainer-side events: the run, steps and their stages, sample roots, dispatch to the
rollout workers and per-sample training stages."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link

from otel_verl import carriers, health, semconv as sc
from otel_verl.ids import id_list, root_span_id_for_uid, trace_id_for_uid
from otel_verl.payload import Payload, end_span, start_span
from otel_verl.rollout_data import RolloutData
from otel_verl.semconv import Subject, Outcome, Stage
from otel_verl.events import _core
from otel_verl.events._core import (
    TracingState,
    _text,
    _sample_root_context,
    _end,
    _SampleEntry,
    _end_sample_entry,
    _skip_validation,
    _with_validate,
    current_span_scope,
)


def open_sample_count() -> int:
    rt = _core.state()
    return len(rt.samples) if rt is not None else 0


def end_open_samples(outcome: str = Outcome.SHUTDOWN.value) -> int:
    """End every span still open on the trainer (called at shutdown): sample roots with
    ``outcome``, the open step and its stages. Returns how many samples were open."""
    rt = _core.state()
    if rt is None:
        return 0
    with rt.trainer.lock:
        stages, rt.trainer.stages = list(rt.trainer.stages), []
    for span in reversed(stages):
        _end(span, outcome)
    step_end()
    entries = rt.samples.drain()
    for entry in entries:
        _end_sample_entry(entry, outcome)
    return len(entries)




# --------------------------------------------------------------------------- trainer: run & steps



@health.guarded(default=None)
def fit_started(
    *,
    trainer: str,
    layout: str = sc.Layout.COLOCATED.value,
    total_training_steps: int,
    train_batch_size: int,
    rollout_n: int,
    ppo_mini_batch_size: int,
    ppo_epochs: int = 1,
) -> None:
    """The run's shape, recorded once at the start of fit as an instant span."""
    rt = _core.state()
    if rt is None:
        return
    num_minibatches = ppo_epochs * (train_batch_size * rollout_n // max(1, ppo_mini_batch_size))
    attrs = {
        sc.TRAINER: trainer,
        sc.LAYOUT: layout,
        sc.TOTAL_TRAINING_STEPS: int(total_training_steps),
        sc.TRAIN_BATCH_SIZE: int(train_batch_size),
        sc.ROLLOUT_N: int(rollout_n),
        sc.PPO_MINI_BATCH_SIZE: int(ppo_mini_batch_size),
        sc.NUM_MINIBATCHES: int(num_minibatches),
    }
    span = start_span(rt.tracer, sc.SPAN_FIT, Payload(Subject.FIT), context=otel_context.Context(), attributes=attrs)
    end_span(span, end_time=span.start_time + 1000)  # 1 µs: backends flag zero-duration spans


@health.guarded(default=None)
def step_begin(
    global_step: int,
    *,
    trainer: str,
    layout: str = sc.Layout.COLOCATED.value,
    epoch: Optional[int] = None,
    consumed_batches: Optional[int] = None,
) -> None:
    """A training step starts: the root of its own trace. Ends the previous step."""
    rt = _core.state()
    if rt is None:
        return
    step_end()
    attrs: Dict[str, Any] = {sc.GLOBAL_STEP: int(global_step), sc.TRAINER: trainer, sc.LAYOUT: layout}
    if epoch is not None:
        attrs[sc.EPOCH] = int(epoch)
    if consumed_batches is not None:
        attrs[sc.CONSUMED_BATCHES] = int(consumed_batches)
    span = start_span(rt.tracer, sc.SPAN_STEP, Payload(Subject.STEP), context=otel_context.Context(), attributes=attrs)
    with rt.trainer.lock:
        rt.trainer.step, rt.trainer.step_number = span, int(global_step)


@health.guarded(default=None)
def step_end(error: Optional[BaseException] = None) -> None:
    rt = _core.state()
    if rt is None:
        return
    with rt.trainer.lock:
        span, rt.trainer.step, rt.trainer.step_number = rt.trainer.step, None, None
    if span is not None:
        _end(span, error=error)


def current_step() -> Optional[int]:
    rt = _core.state()
    return rt.trainer.step_number if rt is not None else None


@contextlib.contextmanager
def step(global_step: int, **kwargs: Any) -> Iterator[None]:
    """:func:`step_begin` ... :func:`step_end` as a context manager."""
    step_begin(global_step, **kwargs)
    try:
        yield
    except BaseException as exc:
        step_end(exc)
        raise
    else:
        step_end()


class StageHandle:
    """An open step stage: lets the code inside report batch facts, then ends it."""

    __slots__ = ("span", "_open")

    def __init__(self, span: Any, open_spans: Any = None) -> None:
        self.span = span
        self._open = open_spans  # the trainer spans of the state it was begun in

    @health.guarded(default=None)
    def response_tokens(self, n_tokens: int) -> None:
        """Non-pad response tokens generated in this stage (gives gen throughput)."""
        if self.span is not None:
            self.span.set_attribute(sc.RESPONSE_TOKENS, int(n_tokens))

    @health.guarded(default=None)
    def exhausted(self) -> None:
        """A fetch stage found no batch left: the data source ended (the epoch's end)."""
        if self.span is not None:
            self.span.set_attribute(sc.FETCH_EXHAUSTED, True)

    @health.guarded(default=None)
    def end(self, error: Optional[BaseException] = None) -> None:
        span, self.span = self.span, None
        if span is None:
            return
        with self._open.lock:
            if span in self._open.stages:
                self._open.stages.remove(span)
        _end(span, error=error)


_NULL_STAGE = StageHandle(None)


def stage_begin(
    stage: "Stage | str",
    *,
    step: Optional[int] = None,
    trainer: Optional[str] = None,
    layout: str = sc.Layout.COLOCATED.value,
) -> StageHandle:
    """One stage of a training step (generation, compute log prob, sync params, ...).

    Nested under the open step span when its global step matches; a stage outside any
    step (the initial weight sync) gets a trace of its own.
    """
    rt = _core.state()
    if rt is None:
        return _NULL_STAGE
    try:
        open_spans = rt.trainer
        stage_value = stage.value if isinstance(stage, Stage) else str(stage)
        global_step = step if step is not None else open_spans.step_number
        attrs: Dict[str, Any] = {sc.STAGE: stage_value, sc.LAYOUT: layout}
        if global_step is not None:
            attrs[sc.GLOBAL_STEP] = int(global_step)
        if trainer:
            attrs[sc.TRAINER] = trainer
        step_span = open_spans.step
        in_step = step_span is not None and (global_step is None or global_step == open_spans.step_number)
        parent = trace.set_span_in_context(step_span) if in_step else otel_context.Context()
        span = start_span(rt.tracer, sc.step_stage_span_name(stage_value), Payload(Subject.STEP_STAGE), context=parent,
                          attributes=attrs)
        with open_spans.lock:
            open_spans.stages.append(span)
        return StageHandle(span, open_spans)
    except Exception as exc:
        health.record_failure("events.stage_begin", exc)
        return _NULL_STAGE


def current_stage() -> StageHandle:
    """The innermost open step stage (for facts reported from inside it)."""
    rt = _core.state()
    if rt is None:
        return _NULL_STAGE
    open_spans = rt.trainer
    with open_spans.lock:
        return StageHandle(open_spans.stages[-1], open_spans) if open_spans.stages else _NULL_STAGE


@contextlib.contextmanager
def step_stage(stage: "Stage | str", **kwargs: Any) -> Iterator[StageHandle]:
    """:func:`stage_begin` as a context manager; the stage span is current inside."""
    handle = stage_begin(stage, **kwargs)
    with current_span_scope(handle.span):
        try:
            yield handle
        except BaseException as exc:
            handle.end(exc)
            raise
        else:
            handle.end()



# --------------------------------------------------------------------------- trainer: samples



@health.guarded(default=None)
def samples_created(uids: Any, *, step: int, trainer: str, validate: Optional[bool] = None) -> None:
    """New prompt uids entered training: opens one sample root span (a trace) per uid."""
    rt = _core.state()
    if rt is None or _skip_validation(validate):
        return
    empty = otel_context.Context()
    for uid in dict.fromkeys(id_list(uids)):  # unique, in batch order
        if rt.samples.get(uid) is not None:
            continue
        rt.ids.next_ids(trace_id_for_uid(uid), root_span_id_for_uid(uid))
        span = start_span(
            rt.tracer,
            sc.SPAN_SAMPLE,
            Payload(Subject.SAMPLE),
            context=empty,
            attributes=_with_validate({sc.UID: uid, sc.GLOBAL_STEP: int(step), sc.TRAINER: trainer}, validate),
        )
        rt.samples.add(uid, _SampleEntry(span, int(step)))


@health.guarded(default=None)
def samples_finished(uids: Any, outcome: "Outcome | str", *, detail: Optional[str] = None,
                     trained_step: Optional[int] = None, oldest_versions: Any = None) -> None:
    """The sample's trajectories were trained on, filtered or dropped: ends its root.

    ``trained_step``: the step that trained them; ``oldest_versions`` (one per entry of
    ``uids``, where known): the oldest weight version behind each row. The root then says
    its lineage: the step, the oldest version behind any of its rows and its staleness,
    as verl counts it (``trained_step - 1 - oldest``: 0 when the weights that generated it
    are the ones this step trains, on policy)."""
    rt = _core.state()
    if rt is None:
        return
    value = outcome.value if isinstance(outcome, Outcome) else str(outcome)
    uid_list = id_list(uids)
    oldest = _oldest_per_uid(uid_list, oldest_versions) if trained_step is not None else {}
    for uid in dict.fromkeys(uid_list):
        entry = rt.samples.pop(uid)
        if entry is not None:
            if detail:
                entry.root.set_attribute(sc.SAMPLE_OUTCOME + ".detail", _text(detail))
            if trained_step is not None:
                _set_lineage(entry.root, int(trained_step), oldest.get(uid))
            _end_sample_entry(entry, value)


def _oldest_per_uid(uids: List[str], versions: Any) -> Dict[str, int]:
    """The oldest weight version of each uid's rows (rows that say none are left out)."""
    if versions is None:
        return {}
    out: Dict[str, int] = {}
    for uid, version in zip(uids, list(versions)):
        try:
            version = int(version)
        except (TypeError, ValueError):  # None, or not a number: no version for this row
            continue
        if uid not in out or version < out[uid]:
            out[uid] = version
    return out


def _set_lineage(root: Any, trained_step: int, oldest: Optional[int]) -> None:
    root.set_attribute(sc.TRAINED_STEP, trained_step)
    if oldest is not None:
        root.set_attributes({sc.WEIGHT_VERSION_MIN: oldest, sc.STALENESS: trained_step - 1 - oldest})


@health.guarded(default=0)
def end_samples_before(step: int, outcome: "Outcome | str") -> int:
    """End the open samples created before ``step`` (v0 trains a sample in its own step)."""
    rt = _core.state()
    if rt is None:
        return 0
    before = int(step)
    stale = rt.samples.matching(lambda entry: entry.step < before)
    samples_finished(stale, outcome)
    return len(stale)


@health.guarded(default=0)
def end_unconsumed_samples(outcome: "Outcome | str" = Outcome.NOT_CONSUMED) -> int:
    """End every open sample root, whatever its step (prompts prefetched for steps that
    never ran); the step and its stages stay as they are."""
    rt = _core.state()
    if rt is None:
        return 0
    uids = rt.samples.keys()
    samples_finished(uids, outcome)
    return len(uids)


def _sample_parent(rt: TracingState, uid: str, *, prefer_rollout: bool = False) -> otel_context.Context:
    entry = rt.samples.get(uid)
    if entry is not None:
        span = entry.rollout if (prefer_rollout and entry.rollout is not None) else entry.root
        return trace.set_span_in_context(span)
    return _sample_root_context(uid)


@health.guarded(default=None)
def rollout_dispatched(
    uids: Any,
    traj_uids: Any,
    worker_indices: Sequence[int],
    *,
    step: int,
    trainer: str,
    variant: str = "v0",
    validate: Optional[bool] = None,
) -> Optional[List[Any]]:
    """A batch of trajectories was handed to the agent loop workers.

    Opens one rollout span per uid (child of its sample root) and returns, per row, the
    carrier the worker must use as its trajectory's parent (``None`` when not traced).
    """
    rt = _core.state()
    if rt is None or _skip_validation(validate):
        return None
    uid_list = id_list(uids)
    traj_list = id_list(traj_uids)
    if len(traj_list) != len(uid_list):
        traj_list = (traj_list * len(uid_list))[: len(uid_list)] if len(traj_list) == 1 else ["N/A"] * len(uid_list)
    per_uid: "OrderedDict[str, RolloutData]" = OrderedDict()
    for uid, traj, worker in zip(uid_list, traj_list, worker_indices):
        data = per_uid.get(uid)
        if data is None:
            data = per_uid[uid] = RolloutData([], [], variant)
        data.traj_uids.append(traj)
        data.worker_indices.append(int(worker))
    carrier_by_uid: Dict[str, Any] = {}
    for uid, data in per_uid.items():
        span = start_span(
            rt.tracer,
            sc.SPAN_ROLLOUT,
            Payload(Subject.ROLLOUT, data),
            context=_sample_parent(rt, uid),
            attributes=_with_validate(
                {
                    sc.UID: uid,
                    sc.GLOBAL_STEP: int(step),
                    sc.TRAINER: trainer,
                    sc.TRAJ_UIDS: data.traj_uids,
                    sc.WORKER_INDICES: data.worker_indices,
                },
                validate,
            ),
        )
        entry = rt.samples.get(uid)
        if entry is not None:
            if entry.rollout is not None and entry.rollout.is_recording():
                end_span(entry.rollout)
            entry.rollout = span
        carrier_by_uid[uid] = carriers.TraceCarrier.from_span(span)
    return [
        carrier_by_uid[uid].with_row({"traj_uid": traj, "worker": int(worker)})
        for uid, traj, worker in zip(uid_list, traj_list, worker_indices)
    ]


@health.guarded(default=None)
def rollout_returned(uids: Any, *, error: Optional[BaseException] = None) -> None:
    """The generation call that carried these uids returned: ends their rollout spans."""
    rt = _core.state()
    if rt is None:
        return
    for uid in dict.fromkeys(id_list(uids)):
        entry = rt.samples.get(uid)
        if entry is not None and entry.rollout is not None:
            _end(entry.rollout, error=error)
            entry.rollout = None


@health.guarded(default=None)
def sample_stage_done(
    stage: "Stage | str",
    uids: Any,
    traj_uids: Any,
    *,
    step: int,
    start_ns: int,
    trainer: str,
    validate: Optional[bool] = None,
) -> None:
    """A batch stage finished for these rows: one span per uid (child of its sample root,
    linked to the step's stage span) listing the uid's traj_uids in batch order.
    ``start_ns``: epoch ns the stage began; taken now as ``otel_verl.clock.epoch_ns_since``
    of a monotonic start, the spans last what the stage took even across a clock jump."""
    rt = _core.state()
    if rt is None or _skip_validation(validate):
        return
    stage_value = stage.value if isinstance(stage, Stage) else str(stage)
    uid_list = id_list(uids)
    traj_list = id_list(traj_uids) if traj_uids is not None else ["N/A"] * len(uid_list)
    if len(traj_list) != len(uid_list):
        traj_list = ["N/A"] * len(uid_list)
    grouped: "OrderedDict[str, List[str]]" = OrderedDict()
    for uid, traj in zip(uid_list, traj_list):
        grouped.setdefault(uid, []).append(traj)
    stage_span = current_stage().span or trace.get_current_span()
    stage_span_ctx = stage_span.get_span_context()
    links = [Link(stage_span_ctx)] if stage_span_ctx.is_valid else []
    end_ns = _core._now_ns()
    name = sc.sample_stage_span_name(stage_value)
    step = int(step)
    trainer = _text(trainer)
    for uid, trajs in grouped.items():
        attrs = _with_validate(
            {sc.UID: uid, sc.TRAJ_UIDS: tuple(trajs), sc.STAGE: stage_value, sc.GLOBAL_STEP: step, sc.TRAINER: trainer},
            validate,
        )
        span = start_span(rt.tracer, name, Payload(Subject.SAMPLE_STAGE, trajs), context=_sample_parent(rt, uid),
                          links=links, start_time=start_ns, attributes=attrs)
        end_span(span, end_time=end_ns)
