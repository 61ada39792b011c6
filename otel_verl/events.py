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

    with events.trajectory(uid, traj_uid, step=3, agent_name="tool_agent", parent=carrier):
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call(prompt_ids, model="qwen") as turn:
                ...
                turn.finish(token_ids, stop_reason="stop", server_meta={...})
            with events.tool_call("calculator"):
                ...
        with events.reward() as reward:
            reward.score(1.0)
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_verl import carriers, health, semconv as sc
from otel_verl.ids import id_list, id_str, root_span_id_for_uid, trace_id_for_uid
from otel_verl.record import RolloutData, TrajectoryData, TurnData, record_of, start_span
from otel_verl.semconv import Kind, Outcome, Stage

# --------------------------------------------------------------------------- runtime


class _Runtime:
    """What :func:`otel_verl.bootstrap.configure` hands to the events API."""

    def __init__(self, tracer: trace.Tracer, id_generator: Any, settings: Any, sampler: Any = None) -> None:
        self.tracer = tracer
        self.ids = id_generator
        self.settings = settings
        self.sampler = sampler  # decides synthesised parents (sample roots seen without a carrier)
        self.samples = _SampleRegistry(settings.max_open_samples)


_runtime: Optional[_Runtime] = None


def _install(runtime: Optional[_Runtime]) -> None:
    global _runtime
    _runtime = runtime


def enabled() -> bool:
    return _runtime is not None


# --------------------------------------------------------------------------- helpers


def _now_ns() -> int:
    return time.time_ns()


def _text(value: Any) -> str:
    """Free text bound for an attribute or span name (names, labels; ids: ``id_str``)."""
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= sc.MAX_TEXT_CHARS else s[: sc.MAX_TEXT_CHARS]


def _capturing_content() -> bool:
    """Message content goes on spans only when OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT opts in."""
    rt = _runtime
    return rt is not None and bool(getattr(rt.settings, "capture_content", False))


def _content(value: Any) -> str:
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= sc.MAX_CONTENT_CHARS else s[: sc.MAX_CONTENT_CHARS]


def _messages_json(role: str, text: str, finish_reason: Optional[str] = None) -> str:
    """One GenAI message (``gen_ai.input.messages`` / ``gen_ai.output.messages`` shape) as
    a JSON string, its text bounded by ``MAX_CONTENT_CHARS``."""
    message: Dict[str, Any] = {"role": role, "parts": [{"type": "text", "content": _content(text)}]}
    if finish_reason is not None:
        message["finish_reason"] = _text(finish_reason)
    return json.dumps([message], ensure_ascii=False)


def _sample_root_context(uid: str) -> otel_context.Context:
    """Parent for a span of sample ``uid`` when no carrier came with it: the sample
    root's derived ids (see :func:`otel_verl.ids.root_span_id_for_uid`)."""
    trace_id = trace_id_for_uid(uid)
    sampler = getattr(_runtime, "sampler", None) if _runtime is not None else None
    sampled = sampler.is_sampled(trace_id) if hasattr(sampler, "is_sampled") else True
    parent = SpanContext(
        trace_id=trace_id,
        span_id=root_span_id_for_uid(uid),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _end(span: Any, outcome: Optional[str] = None, error: Optional[BaseException] = None) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:256]))
        span.set_attribute(sc.ERROR_TYPE, type(error).__qualname__)
    if outcome is not None:
        span.set_attribute(sc.SAMPLE_OUTCOME, outcome)
    span.end()


class _SampleEntry:
    __slots__ = ("root", "rollout", "step")

    def __init__(self, root: Any, step: int) -> None:
        self.root = root
        self.rollout: Any = None
        self.step = step


class _SampleRegistry:
    """Open sample root spans on the trainer, bounded: the oldest is ended (with an
    explanatory outcome) when the limit is reached, so nothing stays open forever."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._open: "OrderedDict[str, _SampleEntry]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, uid: str, entry: _SampleEntry) -> None:
        evicted = []
        with self._lock:
            self._open[uid] = entry
            while len(self._open) > self._limit:
                evicted.append(self._open.popitem(last=False)[1])
        for old in evicted:
            _end_sample_entry(old, Outcome.OPEN_LIMIT.value)

    def get(self, uid: str) -> Optional[_SampleEntry]:
        return self._open.get(uid)

    def pop(self, uid: str) -> Optional[_SampleEntry]:
        with self._lock:
            return self._open.pop(uid, None)

    def created_before(self, step: int) -> List[str]:
        with self._lock:
            return [uid for uid, entry in self._open.items() if entry.step < step]

    def drain(self) -> List[_SampleEntry]:
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
        return entries

    def __len__(self) -> int:
        return len(self._open)


def _end_sample_entry(entry: _SampleEntry, outcome: str) -> None:
    if entry.rollout is not None and entry.rollout.is_recording():
        _end(entry.rollout, outcome)
    _end(entry.root, outcome)


def _after_fork_in_child() -> None:
    global _open
    _open = _OpenSpans()
    if _runtime is not None:
        _runtime.samples = _SampleRegistry(_runtime.settings.max_open_samples)


def open_sample_count() -> int:
    return len(_runtime.samples) if _runtime is not None else 0


def end_open_samples(outcome: str = Outcome.SHUTDOWN.value) -> int:
    """End every span still open on the trainer (called at shutdown): sample roots with
    ``outcome``, the open step and its stages. Returns how many samples were open."""
    if _runtime is None:
        return 0
    with _open.lock:
        stages, _open.stages = list(_open.stages), []
    for span in reversed(stages):
        _end(span, outcome)
    step_end()
    entries = _runtime.samples.drain()
    for entry in entries:
        _end_sample_entry(entry, outcome)
    return len(entries)


# --------------------------------------------------------------------------- trainer: run & steps

_validating: contextvars.ContextVar[bool] = contextvars.ContextVar("otel_verl_validating", default=False)


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
    rt = _runtime
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
    span = start_span(rt.tracer, sc.SPAN_FIT, Kind.FIT, context=otel_context.Context(), attributes=attrs)
    span.end(end_time=span.start_time + 1000)  # 1 µs: backends flag zero-duration spans


class _OpenSpans:
    """The trainer's open step span and stage spans. A step ends when the next begins
    (or explicitly); stage spans parent to the open step of the same global step."""

    def __init__(self) -> None:
        self.step: Any = None
        self.step_number: Optional[int] = None
        self.stages: List[Any] = []
        self.lock = threading.Lock()


_open = _OpenSpans()


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
    rt = _runtime
    if rt is None:
        return
    step_end()
    attrs: Dict[str, Any] = {sc.GLOBAL_STEP: int(global_step), sc.TRAINER: trainer, sc.LAYOUT: layout}
    if epoch is not None:
        attrs[sc.EPOCH] = int(epoch)
    if consumed_batches is not None:
        attrs[sc.CONSUMED_BATCHES] = int(consumed_batches)
    span = start_span(rt.tracer, sc.SPAN_STEP, Kind.STEP, context=otel_context.Context(), attributes=attrs)
    with _open.lock:
        _open.step, _open.step_number = span, int(global_step)


@health.guarded(default=None)
def step_end(error: Optional[BaseException] = None) -> None:
    with _open.lock:
        span, _open.step, _open.step_number = _open.step, None, None
    if span is not None:
        _end(span, error=error)


def current_step() -> Optional[int]:
    return _open.step_number


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

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    @health.guarded(default=None)
    def response_tokens(self, n_tokens: int) -> None:
        """Non-pad response tokens generated in this stage (gives gen throughput)."""
        if self.span is not None:
            self.span.set_attribute(sc.RESPONSE_TOKENS, int(n_tokens))

    @health.guarded(default=None)
    def end(self, error: Optional[BaseException] = None) -> None:
        span, self.span = self.span, None
        if span is None:
            return
        with _open.lock:
            if span in _open.stages:
                _open.stages.remove(span)
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
    rt = _runtime
    if rt is None:
        return _NULL_STAGE
    try:
        stage_value = stage.value if isinstance(stage, Stage) else str(stage)
        global_step = step if step is not None else _open.step_number
        attrs: Dict[str, Any] = {sc.STAGE: stage_value, sc.LAYOUT: layout}
        if global_step is not None:
            attrs[sc.GLOBAL_STEP] = int(global_step)
        if trainer:
            attrs[sc.TRAINER] = trainer
        step_span = _open.step
        in_step = step_span is not None and (global_step is None or global_step == _open.step_number)
        parent = trace.set_span_in_context(step_span) if in_step else otel_context.Context()
        span = start_span(rt.tracer, sc.step_stage_span_name(stage_value), Kind.STEP_STAGE, context=parent, attributes=attrs)
        with _open.lock:
            _open.stages.append(span)
        return StageHandle(span)
    except Exception as exc:
        health.record_failure("events.stage_begin", exc)
        return _NULL_STAGE


def current_stage() -> StageHandle:
    """The innermost open step stage (for facts reported from inside it)."""
    with _open.lock:
        return StageHandle(_open.stages[-1]) if _open.stages else _NULL_STAGE


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


@contextlib.contextmanager
def validating() -> Iterator[None]:
    """Marks a validation pass: its samples are not traced (unless switched on) and never
    reach the legacy outputs."""
    with _set(_validating, True):
        yield


def is_validating() -> bool:
    return _validating.get()


# --------------------------------------------------------------------------- trainer: samples


def _skip_validation(validate: Optional[bool]) -> bool:
    return _is_validation(validate) and not _runtime.settings.trace_validation


def _is_validation(validate: Optional[bool]) -> bool:
    return bool(_validating.get() if validate is None else validate)


def _with_validate(attrs: Dict[str, Any], validate: Optional[bool]) -> Dict[str, Any]:
    """Traced validation spans say so (legacy outputs skip them)."""
    if _is_validation(validate):
        attrs[sc.VALIDATE] = True
    return attrs


@health.guarded(default=None)
def samples_created(uids: Any, *, step: int, trainer: str, validate: Optional[bool] = None) -> None:
    """New prompt uids entered training: opens one sample root span (a trace) per uid."""
    rt = _runtime
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
            Kind.SAMPLE,
            context=empty,
            attributes=_with_validate({sc.UID: uid, sc.GLOBAL_STEP: int(step), sc.TRAINER: trainer}, validate),
        )
        rt.samples.add(uid, _SampleEntry(span, int(step)))


@health.guarded(default=None)
def samples_finished(uids: Any, outcome: "Outcome | str", *, detail: Optional[str] = None) -> None:
    """The sample's trajectories were trained on, filtered or dropped: ends its root."""
    rt = _runtime
    if rt is None:
        return
    value = outcome.value if isinstance(outcome, Outcome) else str(outcome)
    for uid in dict.fromkeys(id_list(uids)):
        entry = rt.samples.pop(uid)
        if entry is not None:
            if detail:
                entry.root.set_attribute(sc.SAMPLE_OUTCOME + ".detail", _text(detail))
            _end_sample_entry(entry, value)


@health.guarded(default=0)
def end_samples_before(step: int, outcome: "Outcome | str") -> int:
    """End the open samples created before ``step`` (v0 trains a sample in its own step)."""
    rt = _runtime
    if rt is None:
        return 0
    stale = rt.samples.created_before(int(step))
    samples_finished(stale, outcome)
    return len(stale)


def _sample_parent(rt: _Runtime, uid: str, *, prefer_rollout: bool = False) -> otel_context.Context:
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
    rt = _runtime
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
            Kind.ROLLOUT,
            data,
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
                entry.rollout.end()
            entry.rollout = span
        carrier_by_uid[uid] = carriers.TraceCarrier.from_span(span)
    return [
        carrier_by_uid[uid].with_row({"traj_uid": traj, "worker": int(worker)})
        for uid, traj, worker in zip(uid_list, traj_list, worker_indices)
    ]


@health.guarded(default=None)
def rollout_returned(uids: Any, *, error: Optional[BaseException] = None) -> None:
    """The generation call that carried these uids returned: ends their rollout spans."""
    rt = _runtime
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
    linked to the step's stage span) listing the uid's traj_uids in batch order."""
    rt = _runtime
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
    links = [Link(stage_span_ctx)] if stage_span_ctx.is_valid else None
    end_ns = _now_ns()
    name = sc.sample_stage_span_name(stage_value)
    for uid, trajs in grouped.items():
        span = start_span(
            rt.tracer,
            name,
            Kind.SAMPLE_STAGE,
            trajs,
            context=_sample_parent(rt, uid),
            links=links,
            start_time=start_ns,
            attributes=_with_validate(
                {sc.UID: uid, sc.TRAJ_UIDS: trajs, sc.STAGE: stage_value, sc.GLOBAL_STEP: int(step), sc.TRAINER: trainer},
                validate,
            ),
        )
        span.end(end_time=end_ns)


# --------------------------------------------------------------------------- rollout worker

_current_traj: contextvars.ContextVar[Optional["_Trajectory"]] = contextvars.ContextVar("otel_verl_traj", default=None)
_SUPPRESSED = object()  # a validation trajectory: everything inside it is silent
_current_turn: contextvars.ContextVar[Optional["Turn"]] = contextvars.ContextVar("otel_verl_turn", default=None)


class _Trajectory:
    __slots__ = ("span", "data", "agent_loop_class", "worker_index")

    def __init__(self, span: Any, data: TrajectoryData, worker_index: Optional[int]) -> None:
        self.span = span
        self.data = data
        self.agent_loop_class: Optional[str] = None
        self.worker_index = worker_index


def _active_traj() -> Optional[_Trajectory]:
    traj = _current_traj.get()
    return traj if traj is not None and traj is not _SUPPRESSED else None


@contextlib.contextmanager
def trajectory(
    uid: Any,
    traj_uid: Any,
    *,
    step: int,
    agent_name: str,
    parent: Any = None,
    n_samples: Optional[int] = None,
    worker_index: Optional[int] = None,
    trainer_api: str = "v0",
    validate: bool = False,
    decode: Any = None,
    encode: Any = None,
) -> Iterator[Optional[TrajectoryData]]:
    """One (uid, traj_uid) agent run in a rollout worker: a GenAI ``invoke_agent`` span.

    ``parent`` is the carrier the trainer sent with the row; without one the span is
    parented to the sample root's derived ids. Yields the trajectory's data (``None``
    when not traced) so the caller may add metrics.
    """
    rt = _runtime
    if rt is None:
        yield None
        return
    if validate and not rt.settings.trace_validation:
        with _set(_current_traj, _SUPPRESSED):
            yield None
        return
    traj = None
    try:
        uid_s, traj_s = id_str(uid), id_str(traj_uid)
        agent_name = _text(agent_name)
        parent_ctx = carriers.context_from(parent) if parent is not None else None
        if parent_ctx is None:
            parent_ctx = _sample_root_context(uid_s)
        data = TrajectoryData(
            uid=uid_s,
            traj_uid=traj_s,
            global_step=int(step),
            n_samples=n_samples,
            agent_name=agent_name,
            created_at=time.time(),
            trainer_api=trainer_api,
            decode=decode,
            encode=encode,
        )
        attrs = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT,
            sc.GEN_AI_AGENT_NAME: agent_name,
            sc.GEN_AI_CONVERSATION_ID: f"{uid_s}/{traj_s}",
            sc.UID: uid_s,
            sc.TRAJ_UID: traj_s,
            sc.GLOBAL_STEP: int(step),
        }
        if worker_index is not None:
            attrs[sc.WORKER_INDEX] = int(worker_index)
        if validate:
            attrs[sc.VALIDATE] = True
        span = start_span(
            rt.tracer, sc.agent_span_name(agent_name), Kind.TRAJECTORY, data, context=parent_ctx, kind=SpanKind.INTERNAL, attributes=attrs
        )
        traj = _Trajectory(span, data, worker_index)
    except Exception as exc:  # tracing failed: run untraced
        health.record_failure("events.trajectory", exc)
        yield None
        return
    with current_span_scope(traj.span), _set(_current_traj, traj):
        try:
            yield traj.data
        except BaseException as exc:
            _finish_trajectory(traj, exc)
            raise
        else:
            _finish_trajectory(traj, None)


def _finish_trajectory(traj: _Trajectory, error: Optional[BaseException]) -> None:
    try:
        traj.data.completed_at = time.time()
        if traj.data.reward_score is not None:
            traj.span.set_attribute(sc.REWARD_SCORE, traj.data.reward_score)
        traj.span.set_attribute(sc.NUM_TURNS, len(traj.data.turns))
        _end(traj.span, error=error)
    except Exception as exc:
        health.record_failure("events.trajectory.end", exc)


@contextlib.contextmanager
def agent_run(agent_loop_class: str) -> Iterator[None]:
    """The agent loop's ``run()`` inside the current trajectory."""
    traj = _active_traj()
    if traj is None:
        yield
        return
    agent_loop_class = _text(agent_loop_class)
    traj.agent_loop_class = agent_loop_class
    span = _start_guarded(
        sc.SPAN_AGENT_RUN,
        Kind.AGENT_RUN,
        None,
        {sc.AGENT_LOOP_CLASS: agent_loop_class, sc.UID: traj.data.uid, sc.TRAJ_UID: traj.data.traj_uid, sc.GLOBAL_STEP: traj.data.global_step},
        data=traj.data,
    )
    with current_span_scope(span):
        yield from _run_in_span(span)


@health.guarded(default=None)
def agent_metrics(metrics: Mapping[str, Any]) -> None:
    """The agent loop's own metrics for the current trajectory (a plain dict)."""
    traj = _active_traj()
    if traj is not None and metrics:
        traj.data.agent_metrics.update(metrics)


@health.guarded(default=None)
def trajectory_score(score: Any) -> None:
    """A reward score the agent loop already had (no reward computation traced here)."""
    traj = _active_traj()
    if traj is not None and score is not None:
        traj.data.reward_score = float(score)
        traj.data.agent_metrics["reward_score"] = float(score)


class Turn:
    """What :func:`llm_call` yields: the caller reports the response through it."""

    __slots__ = ("span", "data", "_carrier", "_decode")

    def __init__(self, span: Any, data: Optional[TurnData], decode: Any = None) -> None:
        self.span = span
        self.data = data
        self._carrier: Optional[Dict[str, str]] = None
        self._decode = decode  # the tokenizer's decode, only when content capture is on

    def carrier(self) -> Dict[str, str]:
        """W3C headers of this turn's span, for the server side (``traceparent``...)."""
        if self._carrier is None:
            self._carrier = carriers.headers_of(self.span) if self.span is not None else {}
        return self._carrier

    @health.guarded(default=None)
    def finish(
        self,
        completion_ids: Sequence[int] = (),
        *,
        stop_reason: Any = None,
        output_tokens: Optional[int] = None,
        server_meta: Optional[Mapping[str, Any]] = None,
    ) -> None:
        data = self.data
        if data is None:
            return
        data.end_ts = time.time()
        data.completion_ids = completion_ids if completion_ids is not None else ()
        data.completion_token_count = output_tokens
        data.finish_reason = str(stop_reason) if stop_reason else ""  # as the seed: falsy -> ""
        if server_meta:
            data.server_meta.update(server_meta)
        span = self.span
        count = output_tokens if output_tokens is not None else len(data.completion_ids)
        span.set_attribute(sc.GEN_AI_USAGE_OUTPUT_TOKENS, int(count))
        if data.finish_reason:
            span.set_attribute(sc.GEN_AI_RESPONSE_FINISH_REASONS, (_text(data.finish_reason),))
        for key, value in data.server_meta.items():
            span.set_attribute(sc.LLM_SERVER_META_PREFIX + _text(key), value)
        if self._decode is not None:
            self._capture_content(span, data)

    def _capture_content(self, span: Any, data: TurnData) -> None:
        """Opt-in content: the decoded prompt and completion as GenAI messages."""
        try:
            count = data.prompt_token_count
            prompt_ids = data.prompt_ids[:count] if count is not None else data.prompt_ids
            prompt = self._decode(prompt_ids, skip_special_tokens=False)
            completion = self._decode(data.completion_ids, skip_special_tokens=False)
        except Exception as exc:
            health.record_failure("events.capture_content", exc)
            return
        span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, _messages_json("user", prompt))
        span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, _messages_json("assistant", completion, data.finish_reason or None))


_NULL_TURN = Turn(None, None)


@contextlib.contextmanager
def llm_call(
    prompt_ids: Sequence[int],
    *,
    model: Optional[str] = None,
    provider: str = "verl",
    operation: str = sc.OP_CHAT,
    request_id: Optional[str] = None,
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
) -> Iterator[Turn]:
    """One generate call of the current trajectory (GenAI ``chat``/``text_completion``)."""
    traj = _active_traj()
    if traj is None:
        yield _NULL_TURN
        return
    try:
        data = TurnData(prompt_ids=prompt_ids, start_ts=time.time(), prompt_token_count=len(prompt_ids))
        operation, model = _text(operation), _text(model) if model else None
        attrs: Dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: operation,
            sc.GEN_AI_PROVIDER_NAME: _text(provider),
            sc.GEN_AI_USAGE_INPUT_TOKENS: data.prompt_token_count,
            sc.UID: traj.data.uid,
            sc.TRAJ_UID: traj.data.traj_uid,
            sc.GLOBAL_STEP: traj.data.global_step,
            sc.AGENT_LOOP_CLASS: traj.agent_loop_class or "AgentLoop",
        }
        if model:
            attrs[sc.GEN_AI_REQUEST_MODEL] = model
        if request_id:
            attrs[sc.LLM_REQUEST_ID] = _text(request_id)
        if max_tokens is not None:
            attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
        if temperature is not None:
            attrs[sc.GEN_AI_REQUEST_TEMPERATURE] = float(temperature)
        if top_p is not None:
            attrs[sc.GEN_AI_REQUEST_TOP_P] = float(top_p)
    except Exception as exc:  # malformed arguments: the call runs untraced
        health.record_failure("events.llm_call", exc)
        yield _NULL_TURN
        return
    span = _start_guarded(sc.llm_span_name(operation, model), Kind.LLM_CALL, None, attrs, kind=SpanKind.CLIENT, data=data)
    if span is None:
        yield _NULL_TURN
        return
    traj.data.turns.append(data)
    turn = Turn(span, data, traj.data.decode if _capturing_content() else None)
    with current_span_scope(span), _set(_current_turn, turn):
        try:
            yield from _run_in_span(span, turn)
        except BaseException:
            # A generate call that raised is no turn of the trajectory (the legacy JSONL
            # only ever recorded calls that returned); its span keeps the error.
            _forget_turn(traj.data, data)
            raise
    if not data.end_ts:
        data.end_ts = time.time()


def _forget_turn(traj_data: TrajectoryData, turn_data: TurnData) -> None:
    turns = traj_data.turns
    for i in range(len(turns) - 1, -1, -1):
        if turns[i] is turn_data:  # identity: TurnData compares by value
            del turns[i]
            return


@health.guarded(default=None)
def observation(texts: Sequence[str]) -> None:
    """Tool/environment messages added after the current trajectory's last turn."""
    traj = _active_traj()
    if traj is None or not traj.data.turns or not texts:
        return
    last = traj.data.turns[-1]
    last.observation_text = "\n".join(texts)
    last.observation_start_ts = last.end_ts or None
    last.observation_end_ts = time.time()


@contextlib.contextmanager
def tool_call(
    name: str, *, call_id: Optional[str] = None, tool_type: str = "function", arguments: Any = None
) -> Iterator[Any]:
    """One tool execution of the current trajectory (GenAI ``execute_tool``).

    ``arguments`` (the model's argument text) goes on the span only when content capture
    is switched on (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``)."""
    traj = _active_traj()
    if traj is None:
        yield None
        return
    name = _text(name)
    attrs = {
        sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
        sc.GEN_AI_TOOL_NAME: name,
        sc.GEN_AI_TOOL_TYPE: _text(tool_type),
        sc.UID: traj.data.uid,
        sc.TRAJ_UID: traj.data.traj_uid,
        sc.GLOBAL_STEP: traj.data.global_step,
    }
    if call_id:
        attrs[sc.GEN_AI_TOOL_CALL_ID] = _text(call_id)
    if arguments is not None and _capturing_content():
        attrs[sc.GEN_AI_TOOL_CALL_ARGUMENTS] = _content(arguments)
    span = _start_guarded(sc.tool_span_name(name), Kind.TOOL, None, attrs)
    with current_span_scope(span):
        yield from _run_in_span(span)


class RewardHandle:
    __slots__ = ("span", "traj")

    def __init__(self, span: Any, traj: Optional[_Trajectory]) -> None:
        self.span = span
        self.traj = traj

    @health.guarded(default=None)
    def score(self, value: Any) -> None:
        if self.traj is None:
            return
        score = float(value)
        self.traj.data.reward_score = score
        self.traj.data.agent_metrics["reward_score"] = score
        if self.span is not None:
            self.span.set_attribute(sc.REWARD_SCORE, score)


@contextlib.contextmanager
def reward() -> Iterator[RewardHandle]:
    """Reward computation for the current trajectory, inside the rollout worker."""
    traj = _active_traj()
    if traj is None:
        yield RewardHandle(None, None)
        return
    span = _start_guarded(
        sc.SPAN_REWARD,
        Kind.REWARD,
        None,
        {sc.UID: traj.data.uid, sc.TRAJ_UID: traj.data.traj_uid, sc.GLOBAL_STEP: traj.data.global_step},
        data=traj.data,
    )
    with current_span_scope(span):
        yield from _run_in_span(span, RewardHandle(span, traj))


class ServerCall:
    """What :func:`llm_server_call` yields: collects the engine's per-request timing."""

    __slots__ = ("span", "meta", "headers")

    def __init__(self, span: Any, headers: Optional[Mapping[str, str]]) -> None:
        self.span = span
        self.headers = dict(headers or {})
        self.meta: Dict[str, float] = {}

    @health.guarded(default=None)
    def record_meta(self, meta: Mapping[str, Any]) -> None:
        """Keep the numeric keys of an engine's meta_info (names vary by version)."""
        for key, value in meta.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.meta[str(key)] = value
                if self.span is not None:
                    self.span.set_attribute(sc.LLM_SERVER_META_PREFIX + _text(key), value)


_current_server_call: contextvars.ContextVar[Optional[ServerCall]] = contextvars.ContextVar("otel_verl_server_call", default=None)


@contextlib.contextmanager
def llm_server_call(headers: Optional[Mapping[str, str]], *, request_id: str, provider: str) -> Iterator[ServerCall]:
    """The server side of one generate call, parented to the worker's turn span."""
    rt = _runtime
    parent = carriers.context_from(headers) if headers else None
    if rt is None or parent is None:
        call = ServerCall(None, headers)
        with _set(_current_server_call, call):
            yield call
        return
    span = _start_guarded(
        sc.SPAN_LLM_SERVER,
        Kind.LLM_SERVER,
        parent,
        {sc.LLM_REQUEST_ID: _text(request_id), sc.GEN_AI_PROVIDER_NAME: _text(provider)},
        kind=SpanKind.SERVER,
    )
    call = ServerCall(span, headers)
    with current_span_scope(span), _set(_current_server_call, call):
        yield from _run_in_span(span, call)


def current_server_call() -> Optional[ServerCall]:
    return _current_server_call.get()


def current_trajectory() -> Optional[TrajectoryData]:
    traj = _active_traj()
    return traj.data if traj is not None else None


def current_turn() -> Optional[Turn]:
    return _current_turn.get()


# --------------------------------------------------------------------------- span plumbing


def _start_guarded(
    name: str,
    kind_v: Kind,
    context: Optional[otel_context.Context],
    attributes: Mapping[str, Any],
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    data: Any = None,
) -> Any:
    """Start a span, or return ``None`` (counted) when tracing itself fails."""
    rt = _runtime
    if rt is None:
        return None
    try:
        return start_span(rt.tracer, name, kind_v, data, context=context, kind=kind, attributes=attributes)
    except Exception as exc:
        health.record_failure("events.start_span", exc)
        return None


@contextlib.contextmanager
def current_span_scope(span: Any) -> Iterator[None]:
    """Make ``span`` the current span inside the block (nothing when ``None``)."""
    if span is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        try:
            otel_context.detach(token)
        except Exception:  # detached in another context (generator closed elsewhere)
            pass


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        try:
            var.reset(token)
        except ValueError:
            pass


def _run_in_span(span: Any, value: Any = None) -> Iterator[Any]:
    """Body of a span's context manager (used with ``yield from``): yields ``value`` once,
    then ends the span, marking it failed when the caller's code raised (and re-raising
    that exception untouched)."""
    try:
        yield value
    except BaseException as exc:
        if span is not None:
            try:
                _end(span, error=exc)
            except Exception as inner:
                health.record_failure("events.end_span", inner)
        raise
    else:
        if span is not None:
            try:
                span.end()
            except Exception as inner:
                health.record_failure("events.end_span", inner)
