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

from typing import Any, List

from otel_verl import carriers, events, health
from otel_verl.ids import id_list
from otel_verl.instrumentation import _trainer
from otel_verl.instrumentation._args import arguments
from otel_verl.instrumentation.hooks import Hook
from otel_verl.semconv import Outcome, Stage

RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
TRAINER = "RayPPOTrainer"
COMPONENT = "trainer_v0"

TRAJ_UID_COLUMN = "traj_uid"


def _worker_actors(trainer: Any) -> List[Any]:
    """The actors whose spans the end of training must not lose: agent loop workers,
    reward workers and LLM servers (attribute names from verl 0.9.1's ray_trainer)."""
    return _trainer.actor_handles(
        (trainer, "async_rollout_manager", "agent_loop_workers"),
        (trainer, "reward_loop_manager", "reward_loop_workers"),
        (trainer, "llm_server_manager", "server_handles"),
    )


def _get_gen_batch(traced: _trainer.TracedTrainer):
    def wrapper(wrapped, instance, args, kwargs):
        if not events.is_validating():
            try:
                _, values = arguments(wrapped, instance, args, kwargs)
                step = int(instance.global_steps)
                if traced.instance is not instance:
                    traced.bind(instance, TRAINER)
                traced.end_record_metrics()
                # v0 trains every sample in the step that created it: whatever is still open
                # from an earlier step was not trained (critic warm-up, a skipped update).
                events.end_samples_before(step, Outcome.DROPPED)
                batches = max(1, len(instance.train_dataloader))
                events.step_begin(step, trainer=TRAINER, layout=traced.layout,
                                  epoch=(step - 1) // batches, consumed_batches=(step - 1) % batches)
                events.samples_created(values["batch"].non_tensor_batch["uid"], step=step, trainer=TRAINER)
            except Exception as exc:
                health.record_failure("trainer_v0._get_gen_batch", exc)
        return wrapped(*args, **kwargs)

    return wrapper


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
        return _trainer.chunk_worker_indices(n, n_workers)
    base, extra = divmod(n, n_workers)
    out: List[int] = []
    for k in range(n_workers):
        out.extend([k] * (base + (1 if k < extra else 0)))
    return out


def _generate_sequences(traced: _trainer.TracedTrainer):
    async def wrapper(wrapped, instance, args, kwargs):
        dispatched = None
        try:
            manager, values = arguments(wrapped, instance, args, kwargs)
            prompts = values["prompts"]
            meta = prompts.meta_info
            validate = bool(meta.get("validate", False)) or events.is_validating()
            if not validate and "uid" in prompts.non_tensor_batch:
                uids = id_list(prompts.non_tensor_batch["uid"])
                traj_uids = _traj_uids(prompts, uids)
                workers = _worker_indices(prompts, len(getattr(manager, "agent_loop_workers", [])) or 1)
                step = int(meta.get("global_steps", traced.global_step()))
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

    return wrapper


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


def _batch_stage(traced: _trainer.TracedTrainer, stage: Stage, batch_arg: str, *, finishes: bool = False):
    """Wrapper for a method or function that runs one batch stage on ``batch_arg`` (a DataProto)."""

    def ids_of(wrapped, instance, args, kwargs, result):
        batch = arguments(wrapped, instance, args, kwargs)[1].get(batch_arg)
        uids, traj_uids = _batch_ids(batch)
        if uids is None or batch.meta_info.get("validate", False):
            return None
        # the agent loop's min_global_steps column: the oldest weights behind each row
        return _trainer.BatchRows(uids, traj_uids, batch.non_tensor_batch.get("min_global_steps"))

    return _trainer.batch_stage_wrapper(traced, stage, TRAINER, ids_of, finishes=finishes)


def hooks(traced: _trainer.TracedTrainer) -> List[Hook]:
    return [
        Hook(RAY_TRAINER, "RayPPOTrainer.fit", _trainer.fit_wrapper(traced, TRAINER, _worker_actors), (), COMPONENT),
        Hook(RAY_TRAINER, "marked_timer", _trainer.marked_timer_wrapper(traced), ("name",), COMPONENT),
        Hook(RAY_TRAINER, "RayPPOTrainer._get_gen_batch", _get_gen_batch(traced), ("batch",), COMPONENT),
        Hook(RAY_TRAINER, "RayPPOTrainer._validate", _trainer.validate, (), COMPONENT),
        Hook(RAY_TRAINER, "compute_data_metrics", _trainer.record_metrics_wrapper(traced), ("batch",), COMPONENT),
        Hook(AGENT_LOOP, "AgentLoopManager.generate_sequences", _generate_sequences(traced), ("prompts",), COMPONENT,
             redecorate=lambda fn: __import__("verl.utils.ray_utils", fromlist=["auto_await"]).auto_await(fn)),
        Hook(RAY_TRAINER, "extract_reward", _batch_stage(traced, Stage.REWARD, "batch"), ("batch",), COMPONENT),
        Hook(RAY_TRAINER, "RayPPOTrainer._compute_old_log_prob", _batch_stage(traced, Stage.OLD_LOG_PROB, "batch"),
             ("batch",), COMPONENT),
        Hook(RAY_TRAINER, "RayPPOTrainer._compute_ref_log_prob", _batch_stage(traced, Stage.REF_LOG_PROB, "batch"),
             ("batch",), COMPONENT),
        Hook(RAY_TRAINER, "compute_advantage", _batch_stage(traced, Stage.ADVANTAGE, "data"), ("data",), COMPONENT),
        Hook(RAY_TRAINER, "RayPPOTrainer._update_actor", _batch_stage(traced, Stage.UPDATE_ACTOR, "batch", finishes=True),
             ("batch",), COMPONENT),
    ]
