"""Trainer side of verl's v0 ``RayPPOTrainer`` (runs in the TaskRunner actor).

``fit()`` keeps the whole step inline, so the step is observed from the calls it makes:

- ``marked_timer(name, ...)``, a module global of ray_trainer looked up at call time, is
  rebound: each stage block (gen, reward, old_log_prob, ref, values, adv, update_actor,
  save_checkpoint, update_weights, testing) becomes a step-stage span.
- ``_get_gen_batch`` sees the new prompt uids (sample roots) and starts the step;
  ``compute_data_metrics`` ... ``Tracking.log`` bracket "record metrics" and end it.
- ``AgentLoopManager.generate_sequences`` dispatches trajectories: it gives each row its
  traj_uid and carrier (one column, popped by the worker) and re-attaches ``traj_uid``
  to the output (verl drops input columns in streaming-reward mode).
- The batch stages (extract_reward, _compute_old_log_prob, _compute_ref_log_prob,
  compute_advantage, _update_actor) report per-uid stage spans from the batch's id columns.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional

from otel_verl import bootstrap, carriers, events, health
from otel_verl.ids import id_list
from otel_verl.instrumentation._args import bound, self_and_args
from otel_verl.instrumentation.hooks import Hook
from otel_verl.semconv import Outcome, Role, Stage

RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
TRACKING = "verl.utils.tracking"
TRAINER = "RayPPOTrainer"
COMPONENT = "trainer_v0"

TRAJ_UID_COLUMN = "traj_uid"

# marked_timer names in RayPPOTrainer.fit -> step stage
STAGE_BY_TIMER = {
    "gen": Stage.GENERATION,
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


class _Trainer:
    """The trainer being traced in this process (one per TaskRunner)."""

    instance: Any = None
    record_metrics: Optional[events.StageHandle] = None


def _global_step() -> int:
    return int(getattr(_Trainer.instance, "global_steps", -1) or -1)


# --------------------------------------------------------------------------- fit and steps


def _fit(wrapped, instance, args, kwargs):
    try:
        bootstrap.ensure(Role.TRAINER)
        _Trainer.instance = instance
        config = instance.config
        actor = config.actor_rollout_ref.actor
        events.fit_started(
            trainer=TRAINER,
            total_training_steps=int(instance.total_training_steps),
            train_batch_size=int(config.data.train_batch_size),
            rollout_n=int(config.actor_rollout_ref.rollout.n),
            ppo_mini_batch_size=int(actor.ppo_mini_batch_size),
            ppo_epochs=int(actor.get("ppo_epochs", 1)),
        )
    except Exception as exc:
        health.record_failure("trainer_v0.fit", exc)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _end_record_metrics()
        events.step_end()
        bootstrap.flush()
        flush_actors(_worker_actors(instance))


def _worker_actors(trainer: Any) -> List[Any]:
    """The actors whose spans the end of training must not lose: agent loop workers,
    reward workers and LLM servers (attribute names from verl 0.9.1's ray_trainer)."""
    handles: List[Any] = []
    handles += list(getattr(getattr(trainer, "async_rollout_manager", None), "agent_loop_workers", None) or [])
    handles += list(getattr(getattr(trainer, "reward_loop_manager", None), "reward_loop_workers", None) or [])
    handles += list(getattr(getattr(trainer, "llm_server_manager", None), "server_handles", None) or [])
    return handles


def flush_actors(handles: List[Any], timeout_s: float = 30.0) -> None:
    """Ask each actor to flush its tracing outputs and wait (bounded).

    At the end of a job Ray kills actors without running their exit handlers, so what
    their batch processors still hold would be lost; fit's end is the last moment the
    trainer can ask them to write it out.
    """
    if not handles:
        return
    try:
        import ray

        refs = [handle.__ray_call__.remote(bootstrap.flush_in_actor) for handle in handles]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception as exc:
        health.record_failure("trainer_v0.flush_actors", exc)


class _StageTimer:
    """``marked_timer(...)``'s context manager with a step-stage span around it."""

    __slots__ = ("_timer", "_stage", "_handle", "_scope")

    def __init__(self, timer: Any, stage: Stage) -> None:
        self._timer = timer
        self._stage = stage
        self._handle = None
        self._scope = None

    def __enter__(self) -> Any:
        try:
            self._handle = events.stage_begin(self._stage, step=_global_step(), trainer=TRAINER)
            self._scope = events.current_span_scope(self._handle.span)
            self._scope.__enter__()
        except Exception as exc:
            health.record_failure("trainer_v0.marked_timer", exc)
        return self._timer.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return self._timer.__exit__(*exc_info)
        finally:
            try:
                if self._scope is not None:
                    self._scope.__exit__(None, None, None)
                if self._handle is not None:
                    self._handle.end(exc_info[1])
            except Exception as exc:
                health.record_failure("trainer_v0.marked_timer", exc)


def _marked_timer(wrapped, instance, args, kwargs):
    timer = wrapped(*args, **kwargs)
    name = args[0] if args else kwargs.get("name")
    stage = STAGE_BY_TIMER.get(name)
    if stage is None or events.is_validating() or _Trainer.instance is None:
        return timer
    return _StageTimer(timer, stage)


def _get_gen_batch(wrapped, instance, args, kwargs):
    if not events.is_validating():
        try:
            _, values = bound(wrapped, instance, args, kwargs)
            step = int(instance.global_steps)
            _Trainer.instance = instance
            _end_record_metrics()
            # v0 trains every sample in the step that created it: whatever is still open
            # from an earlier step was not trained (critic warm-up, a skipped update).
            events.end_samples_before(step, Outcome.DROPPED)
            batches = max(1, len(instance.train_dataloader))
            events.step_begin(step, trainer=TRAINER, epoch=(step - 1) // batches, consumed_batches=(step - 1) % batches)
            events.samples_created(values["batch"].non_tensor_batch["uid"], step=step, trainer=TRAINER)
        except Exception as exc:
            health.record_failure("trainer_v0._get_gen_batch", exc)
    return wrapped(*args, **kwargs)


def _validate(wrapped, instance, args, kwargs):
    with events.validating():
        return wrapped(*args, **kwargs)


def _compute_data_metrics(wrapped, instance, args, kwargs):
    if _Trainer.instance is not None and not events.is_validating() and _Trainer.record_metrics is None:
        _Trainer.record_metrics = events.stage_begin(Stage.RECORD_METRICS, step=_global_step(), trainer=TRAINER)
    return wrapped(*args, **kwargs)


def _tracking_log(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    finally:
        if _Trainer.record_metrics is not None:  # the step's metrics are logged: step done
            _end_record_metrics()
            events.step_end()


def _end_record_metrics() -> None:
    handle, _Trainer.record_metrics = _Trainer.record_metrics, None
    if handle is not None:
        handle.end()


# --------------------------------------------------------------------------- dispatch


def _traj_uids(prompts: Any, uids: List[str]) -> List[str]:
    """Each row's traj_uid: the occurrence count of its uid (``i % n`` for verl's
    interleaved repeat); REMAX's greedy baseline rows are ``baseline``."""
    do_sample = prompts.non_tensor_batch.get("__do_sample__")
    seen: dict = {}
    out = []
    for i, uid in enumerate(uids):
        if do_sample is not None and not bool(do_sample[i]):
            out.append("baseline")
            continue
        k = seen.get(uid, 0)
        seen[uid] = k + 1
        out.append(str(k))
    return out


def _worker_indices(prompts: Any, n_workers: int) -> List[int]:
    """Which AgentLoopWorker each row goes to, as ``DataProto.chunk`` splits the batch
    (torch.chunk sizes when there are tensors, numpy.array_split otherwise)."""
    n = len(prompts)
    if n_workers <= 1 or n == 0:
        return [0] * n
    if prompts.batch is not None:
        size = -(-n // n_workers)
        return [min(i // size, n_workers - 1) for i in range(n)]
    base, extra = divmod(n, n_workers)
    out: List[int] = []
    for k in range(n_workers):
        out.extend([k] * (base + (1 if k < extra else 0)))
    return out


async def _generate_sequences(wrapped, instance, args, kwargs):
    manager, rest = self_and_args(instance, args)
    prompts = rest[0] if rest else kwargs.get("prompts")
    dispatched = None
    try:
        meta = prompts.meta_info
        validate = bool(meta.get("validate", False)) or events.is_validating()
        if not validate and "uid" in prompts.non_tensor_batch:
            uids = id_list(prompts.non_tensor_batch["uid"])
            traj_uids = _traj_uids(prompts, uids)
            workers = _worker_indices(prompts, len(getattr(manager, "agent_loop_workers", [])) or 1)
            step = int(meta.get("global_steps", _global_step()))
            row_carriers = events.rollout_dispatched(uids, traj_uids, workers, step=step, trainer=TRAINER)
            if row_carriers is not None:
                carriers.inject_column(prompts, row_carriers)
                dispatched = (uids, traj_uids)
    except Exception as exc:
        health.record_failure("trainer_v0.generate_sequences", exc)
    try:
        output = await wrapped(*args, **kwargs)
    except BaseException as exc:
        if dispatched is not None:
            events.rollout_returned(dispatched[0], error=exc)
        raise
    finally:
        if dispatched is not None:
            carriers.pop_column(prompts)
    if dispatched is not None:
        _after_generation(output, *dispatched)
    return output


@health.guarded(default=None)
def _after_generation(output: Any, uids: List[str], traj_uids: List[str]) -> None:
    import numpy as np

    columns = output.non_tensor_batch
    columns.pop(carriers.COLUMN, None)
    if TRAJ_UID_COLUMN not in columns and len(output) == len(traj_uids):
        columns[TRAJ_UID_COLUMN] = np.array(traj_uids, dtype=object)  # row order is preserved
    events.rollout_returned(uids)
    batch = output.batch
    if batch is not None and "responses" in batch.keys() and "attention_mask" in batch.keys():
        response_len = batch["responses"].shape[-1]
        events.current_stage().response_tokens(int(batch["attention_mask"][:, -response_len:].sum()))


# --------------------------------------------------------------------------- batch stages


def _batch_ids(batch: Any) -> "tuple[Any, Any]":
    columns = batch.non_tensor_batch
    return columns.get("uid"), columns.get(TRAJ_UID_COLUMN)


def _batch_stage(stage: Stage, batch_arg: str, *, finishes: bool = False):
    """Wrapper for a method or function that runs one batch stage on ``batch_arg``."""

    def wrapper(wrapped, instance, args, kwargs):
        if events.is_validating() or _Trainer.instance is None:
            return wrapped(*args, **kwargs)
        start_ns = time.time_ns()
        result = wrapped(*args, **kwargs)
        try:
            _, values = bound(wrapped, instance, args, kwargs)
            batch = values.get(batch_arg)
            uids, traj_uids = _batch_ids(batch)
            if uids is not None and not batch.meta_info.get("validate", False):
                events.sample_stage_done(stage, uids, traj_uids, step=_global_step(), start_ns=start_ns, trainer=TRAINER)
                if finishes:
                    events.samples_finished(uids, Outcome.TRAINED)
        except Exception as exc:
            health.record_failure(f"trainer_v0.{stage.value}", exc)
        return result

    return wrapper


HOOKS = [
    Hook(RAY_TRAINER, "RayPPOTrainer.fit", _fit, (), COMPONENT),
    Hook(RAY_TRAINER, "marked_timer", _marked_timer, ("name",), COMPONENT),
    Hook(RAY_TRAINER, "RayPPOTrainer._get_gen_batch", _get_gen_batch, ("batch",), COMPONENT),
    Hook(RAY_TRAINER, "RayPPOTrainer._validate", _validate, (), COMPONENT),
    Hook(RAY_TRAINER, "compute_data_metrics", _compute_data_metrics, ("batch",), COMPONENT),
    Hook(TRACKING, "Tracking.log", _tracking_log, ("data", "step"), COMPONENT),
    Hook(AGENT_LOOP, "AgentLoopManager.generate_sequences", _generate_sequences, ("prompts",), COMPONENT,
         redecorate=lambda fn: __import__("verl.utils.ray_utils", fromlist=["auto_await"]).auto_await(fn)),
    Hook(RAY_TRAINER, "extract_reward", _batch_stage(Stage.REWARD, "batch"), ("batch",), COMPONENT),
    Hook(RAY_TRAINER, "RayPPOTrainer._compute_old_log_prob", _batch_stage(Stage.OLD_LOG_PROB, "batch"), ("batch",), COMPONENT),
    Hook(RAY_TRAINER, "RayPPOTrainer._compute_ref_log_prob", _batch_stage(Stage.REF_LOG_PROB, "batch"), ("batch",), COMPONENT),
    Hook(RAY_TRAINER, "compute_advantage", _batch_stage(Stage.ADVANTAGE, "data"), ("data",), COMPONENT),
    Hook(RAY_TRAINER, "RayPPOTrainer._update_actor", _batch_stage(Stage.UPDATE_ACTOR, "batch", finishes=True), ("batch",), COMPONENT),
]
