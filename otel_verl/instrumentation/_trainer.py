"""What the v0 and v1 trainer instrumentations share (both run in the TaskRunner actor).

One trainer is traced per process: a :class:`TracedTrainer`, made by
``all_hooks`` and handed to each trainer module's ``hooks(traced)``, holds it, its
``verl.trainer`` name and layout, and the open "record metrics" stage (started where
metrics are computed, ended by ``Tracking.log``, which is also where the step ends).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, NamedTuple, Optional

from otel_verl import clock, events, health
from otel_verl.deadline import Deadline
from otel_verl.instrumentation import tracing
from otel_verl.instrumentation.hooks import Hook
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Layout, Outcome, Role, Stage

TRACKING = "verl.utils.tracking"
COMPONENT = "trainer"


# marked_timer names in verl's trainers (v0 ray_trainer, the separation trainer, v1
# trainer_base and its mode modules) -> step stage
STAGE_BY_TIMER = {
    "gen": Stage.GENERATION,  # v1: the replay-buffer sample, i.e. waiting for the batch
    "reward": Stage.REWARD,
    "old_log_prob": Stage.OLD_LOG_PROB,
    "ref": Stage.REF_LOG_PROB,  # str(Role.RefPolicy)
    "values": Stage.VALUES,
    "adv": Stage.ADVANTAGE,
    "update_critic": Stage.UPDATE_CRITIC,
    "update_actor": Stage.UPDATE_ACTOR,
    "save_checkpoint": Stage.SAVE_CHECKPOINT,
    "update_weights": Stage.SYNC_PARAMS,
    "testing": Stage.EVAL,
}


class TracedTrainer:
    """The trainer being traced in this process, and the tracing its wrappers report through."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self.instance: Any = None
        self.name: str = ""
        self.layout: str = Layout.COLOCATED.value
        self.record_metrics: Optional[events.StageHandle] = None

    def bind(self, instance: Any, name: str, layout: str = Layout.COLOCATED.value) -> None:
        self.instance, self.name, self.layout = instance, name, layout

    @property
    def active(self) -> bool:
        return self.instance is not None

    def global_step(self) -> int:
        return int(getattr(self.instance, "global_steps", -1) or -1)

    def end_record_metrics(self) -> None:
        handle, self.record_metrics = self.record_metrics, None
        if handle is not None:
            handle.end()


def fit_wrapper(
    traced: TracedTrainer,
    name: str,
    actors_of: Callable[[Any], List[Any]],
    *,
    layout_of: Callable[[Any], str] = lambda trainer: Layout.COLOCATED.value,
    before_end: Optional[Callable[[], None]] = None,
):
    """Wrapper for a trainer's ``fit``: switches tracing on in the trainer's process, binds
    the traced trainer, records the run's shape; at the end (``before_end`` first) ends
    what the step loop left open and flushes this process and ``actors_of(trainer)``."""

    def wrapper(wrapped, instance, args, kwargs):
        try:
            traced.tracing.active(Role.TRAINER)
            traced.bind(instance, name, layout_of(instance))
            fit_started(traced)
        except Exception as exc:
            health.record_failure(f"{COMPONENT}.{name}.fit", exc)
        try:
            return wrapped(*args, **kwargs)
        finally:
            try:  # never replaces fit's own result or exception
                if before_end is not None:
                    before_end()
                fit_finished(traced, actors_of(instance))
            except Exception as exc:
                health.record_failure(f"{COMPONENT}.{name}.fit_end", exc)

    return wrapper


def fit_started(traced: TracedTrainer) -> None:
    """The run's shape (config paths shared by verl's v0 and v1 trainers)."""
    instance = traced.instance
    config = instance.config
    actor = config.actor_rollout_ref.actor
    events.fit_started(
        trainer=traced.name,
        layout=traced.layout,
        total_training_steps=int(instance.total_training_steps),
        train_batch_size=int(config.data.train_batch_size),
        rollout_n=int(config.actor_rollout_ref.rollout.n),
        ppo_mini_batch_size=int(actor.ppo_mini_batch_size),
        ppo_epochs=int(actor.get("ppo_epochs", 1)),
    )


def fit_finished(traced: TracedTrainer, actors: List[Any]) -> None:
    """End what the step loop left open and make every process write its spans out, all
    within one flush timeout: the actors flush while this process does."""
    traced.end_record_metrics()
    events.step_end()
    deadline = Deadline(tracing.flush_timeout_s())
    flushing = flush_actors(actors)
    tracing.flush(deadline.left_s())
    await_flushes(flushing, deadline)


def flush_actors(handles: List[Any]) -> List[Any]:
    """Ask each actor to flush its tracing outputs; returns what to wait for.

    At the end of a job Ray kills actors without running their exit handlers, so what
    their batch processors still hold would be lost; fit's end is the last moment the
    trainer can ask them to write it out.
    """
    try:
        return [handle.__ray_call__.remote(tracing.flush_in_actor) for handle in handles]
    except Exception as exc:
        health.record_failure("trainer.flush_actors", exc)
        return []


def await_flushes(refs: List[Any], deadline: Deadline) -> None:
    if not refs:
        return
    try:
        import ray

        ray.wait(refs, num_returns=len(refs), timeout=deadline.left_s())
    except Exception as exc:
        health.record_failure("trainer.flush_actors", exc)


def actor_handles(*owners_and_attrs: "tuple[Any, str, str]") -> List[Any]:
    """Actor handles found at ``owner.<manager>.<list attr>`` (absent ones are skipped)."""
    handles: List[Any] = []
    for owner, manager, attr in owners_and_attrs:
        handles += list(getattr(getattr(owner, manager, None), attr, None) or [])
    return handles


def chunk_worker_indices(n_rows: int, n_workers: int) -> List[int]:
    """Which worker each row goes to when verl splits a batch with ``chunk(n_workers)``
    (torch semantics: contiguous chunks of ``ceil(n / k)`` rows)."""
    if n_workers <= 1 or n_rows == 0:
        return [0] * n_rows
    size = -(-n_rows // n_workers)
    return [min(i // size, n_workers - 1) for i in range(n_rows)]


@contextlib.contextmanager
def _in_stage_span(traced: TracedTrainer, timer: Any, stage: Stage) -> Iterator[Any]:
    """A trainer's ``marked_timer(...)`` context manager inside a step-stage span."""
    with events.step_stage(stage, step=traced.global_step(), trainer=traced.name, layout=traced.layout):
        with timer as value:
            yield value


def marked_timer_wrapper(traced: TracedTrainer):
    """Wrapper for a module's ``marked_timer`` global: known stage names (:data:`STAGE_BY_TIMER`)
    become spans."""

    def wrapper(wrapped, instance, args, kwargs):
        timer = wrapped(*args, **kwargs)
        name = args[0] if args else kwargs.get("name")
        stage = STAGE_BY_TIMER.get(name)
        if stage is None or events.is_validating() or not traced.active:
            return timer
        return _in_stage_span(traced, timer, stage)

    return wrapper


class BatchRows(NamedTuple):
    """The rows of a batch stage: uids and traj_uids, and where the batch says it, the
    oldest weight version behind each row (verl's ``min_global_steps``)."""

    uids: Any
    traj_uids: Any
    oldest_versions: Any = None


def batch_stage_wrapper(traced: TracedTrainer, stage: Stage, trainer_name: str, ids_of: Callable[..., Any], *,
                        finishes: bool = False):
    """Wrapper for a trainer method or module function that runs one batch stage: after it
    returns, one span per uid of its batch (``ids_of(wrapped, instance, args, kwargs,
    result)`` gives its :class:`BatchRows`, or None when the batch is not reported), and the
    samples end as trained in this step when ``finishes``. Runs only under ``trainer_name``
    (v1 calls some of v0's module functions, such as compute_advantage)."""

    def wrapper(wrapped, instance, args, kwargs):
        if events.is_validating() or traced.name != trainer_name:
            return wrapped(*args, **kwargs)
        started = clock.monotonic_ns()
        result = wrapped(*args, **kwargs)
        try:
            rows = ids_of(wrapped, instance, args, kwargs, result)
            if rows is not None:
                step = traced.global_step()
                # the start on the system clock as it reads now: the duration is true across a jump
                events.sample_stage_done(stage, rows.uids, rows.traj_uids, step=step,
                                         start_ns=clock.epoch_ns_since(started), trainer=trainer_name)
                if finishes:
                    events.samples_finished(rows.uids, Outcome.TRAINED, trained_step=step,
                                            oldest_versions=rows.oldest_versions)
        except Exception as exc:
            health.record_failure(f"{COMPONENT}.{trainer_name}.{stage.value}", exc)
        return result

    return wrapper


def validate(wrapped, instance, args, kwargs):
    with events.validating():
        return wrapped(*args, **kwargs)


def record_metrics_wrapper(traced: TracedTrainer):
    """Wrapper for where a trainer computes the step's metrics: "record metrics" begins."""

    def wrapper(wrapped, instance, args, kwargs):
        if traced.active and not events.is_validating() and traced.record_metrics is None:
            traced.record_metrics = events.stage_begin(
                Stage.RECORD_METRICS, step=traced.global_step(), trainer=traced.name, layout=traced.layout
            )
        return wrapped(*args, **kwargs)

    return wrapper


def _tracking_log(traced: TracedTrainer):
    def wrapper(wrapped, instance, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        finally:
            if traced.record_metrics is not None:  # the step's metrics are logged: step done
                traced.end_record_metrics()
                events.step_end()

    return wrapper


def hooks(traced: TracedTrainer) -> List[Hook]:
    return [Hook(TRACKING, "Tracking.log", _tracking_log(traced), ("data", "step"), COMPONENT)]
