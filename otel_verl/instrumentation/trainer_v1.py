"""Trainer side of verl's v1 trainer (``verl/trainer/ppo/v1``, runs in TaskRunnerV1).

Samples travel through TransferQueue and may be trained in a later step than the one
that produced them (async modes), so a sample's root span stays open from the fetch of
its prompt until its trajectories are trained on, evicted, cleared or left at the end
of fit (each ends with an outcome saying which; the open set is bounded).

- ``marked_timer`` (rebound in trainer_base and each trainer-mode module): ``step`` starts
  the step span; gen, reward, old_log_prob, ref, values, adv, update_critic,
  update_actor, save_checkpoint, update_weights and testing become step-stage spans.
- ``_fetch_one_gen_batch`` sees the new prompt uids (sample roots).
- ``AgentLoopManagerTQ.generate_sequences`` dispatches the prompts: a carrier per row
  as a TensorDict field, added after verl stored the prompts in TransferQueue and
  removed when the call returns, so it is never written there.
- ``ReplayBuffer.sample`` hands trajectories to training (TRAIN_SAMPLE; in
  separate_async a fetch-batch stage around it); ``_evict_terminal_groups`` ends evicted
  or filtered samples; the batch-stage methods report per-uid stage spans from the
  TransferQueue keys ``{uid}_{session_id}_{index}`` (padding skipped); ``_update_actor``
  ends the trained samples and ``kv_clear`` of trajectory keys the untrained rest.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

from otel_verl import carriers, clock, events, health
from otel_verl.ids import id_list
from otel_verl.instrumentation import _trainer
from otel_verl.instrumentation._args import arguments
from otel_verl.instrumentation.hooks import Hook
from otel_verl.semconv import Layout, Outcome, Stage

V1 = "verl.trainer.ppo.v1"
TRAINER_BASE = f"{V1}.trainer_base"
MODE_MODULES = (f"{V1}.trainer_sync", f"{V1}.trainer_colocate_async", f"{V1}.trainer_separate_async")
AGENT_LOOP_TQ = f"{V1}.agent_loop_tq"
REPLAY_BUFFER = f"{V1}.replay_buffer"
TRANSFER_QUEUE = "transfer_queue"
TRAINER = "PPOTrainerV1"
COMPONENT = "trainer_v1"
NO_TRAJ = "N/A"
DISAGGREGATED_MODES = ("separate_async",)

def ids_from_keys(keys: Any, tags: Any) -> Tuple[List[str], List[str]]:
    """(uids, traj_uids) of TransferQueue trajectory keys ``{uid}_{session_id}_{index}``.

    Padding entries (tag ``is_padding``) are skipped; a key that does not parse gives
    uid = the key and traj ``N/A``."""
    uids: List[str] = []
    trajs: List[str] = []
    for key, _ in _rows(keys, tags):
        parts = key.rsplit("_", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            uids.append(parts[0])
            trajs.append(parts[1])
        else:
            uids.append(key)
            trajs.append(NO_TRAJ)
    return uids, trajs


def oldest_versions(keys: Any, tags: Any) -> List[Any]:
    """The oldest weight version behind each row of :func:`ids_from_keys` (its tag's
    ``min_global_steps``, set by the agent loop when it stored the trajectory)."""
    return [tag.get("min_global_steps") if isinstance(tag, dict) else None for _, tag in _rows(keys, tags)]


def _rows(keys: Any, tags: Any) -> Iterator[Tuple[str, Any]]:
    """(key, tag) of a batch's trajectories, padding entries (tag ``is_padding``) skipped."""
    tags = list(tags) if tags is not None else []
    for i, key in enumerate(id_list(keys)):
        tag = tags[i] if i < len(tags) else None
        if not (isinstance(tag, dict) and tag.get("is_padding", False)):
            yield key, tag


def _layout(instance: Any) -> str:
    mode = str(getattr(instance, "trainer_mode", "") or "")
    return Layout.DISAGGREGATED.value if mode in DISAGGREGATED_MODES else Layout.COLOCATED.value


def _disaggregated(traced: _trainer.TracedTrainer) -> bool:
    return traced.layout == Layout.DISAGGREGATED.value


# --------------------------------------------------------------------------- fit and steps


def _worker_actors(trainer: Any) -> List[Any]:
    return _trainer.actor_handles(
        (trainer, "agent_loop_manager", "agent_loop_workers"),
        (trainer, "reward_loop_manager", "reward_loop_workers"),
        (trainer, "llm_server_manager", "server_handles"),
    )


def _end_unconsumed_samples() -> None:
    # Prompts prefetched for steps that never ran (async warm-up, the last step's refill)
    # were never consumed: their roots end saying so.
    events.end_unconsumed_samples(Outcome.NOT_CONSUMED)


def _marked_timer(traced: _trainer.TracedTrainer, stage_timer):
    """trainer_base's ``marked_timer``: ``stage_timer``'s stages, and its ``step`` block
    begins the step."""

    def wrapper(wrapped, instance, args, kwargs):
        name = args[0] if args else kwargs.get("name")
        if name == "step" and traced.active and not events.is_validating():
            _step_begin(traced)
        return stage_timer(wrapped, instance, args, kwargs)

    return wrapper


@health.guarded(default=None)
def _step_begin(traced: _trainer.TracedTrainer) -> None:
    step = traced.global_step()
    traced.end_record_metrics()
    per_epoch = max(1, int(getattr(traced.instance, "steps_per_epoch", 1) or 1))
    events.step_begin(
        step,
        trainer=TRAINER,
        layout=traced.layout,
        epoch=(step - 1) // per_epoch,
        consumed_batches=(step - 1) % per_epoch,
    )


def _fetch_one_gen_batch(traced: _trainer.TracedTrainer):
    def wrapper(wrapped, instance, args, kwargs):
        batch = wrapped(*args, **kwargs)
        if traced.active and not events.is_validating():
            try:
                events.samples_created(batch["uid"], step=traced.global_step(), trainer=TRAINER)
            except Exception as exc:
                health.record_failure("trainer_v1._fetch_one_gen_batch", exc)
        return batch

    return wrapper


# --------------------------------------------------------------------------- dispatch


def _generate_sequences(traced: _trainer.TracedTrainer):
    def wrapper(wrapped, instance, args, kwargs):
        prompts = None
        injected = False
        try:
            prompts = arguments(wrapped, instance, args, kwargs)[1].get("prompts")
            injected = _dispatch(traced, instance, prompts)
        except Exception as exc:
            health.record_failure("trainer_v1.generate_sequences", exc)
        try:
            return wrapped(*args, **kwargs)
        finally:
            if injected:
                carriers.pop_tensordict(prompts)

    return wrapper


def _dispatch(traced: _trainer.TracedTrainer, manager: Any, prompts: Any) -> bool:
    """Open the prompts' rollout spans and give each row its carrier (uid, step, worker
    and agent name ride along for the worker's prompt task)."""
    keys = prompts.keys()
    if events.is_validating() or "uid" not in keys or ("validate" in keys and bool(_scalar(prompts.get("validate")))):
        return False
    uids = id_list(prompts["uid"])
    step = int(_scalar(prompts.get("global_steps")) if "global_steps" in keys else traced.global_step())
    workers = _trainer.chunk_worker_indices(len(uids), len(getattr(manager, "agent_loop_workers", None) or []) or 1)
    row_carriers = events.rollout_dispatched(uids, [NO_TRAJ] * len(uids), workers, step=step, trainer=TRAINER, variant="v1")
    if row_carriers is None:
        return False
    agent_names = _agent_names(manager, prompts, len(uids))
    carriers.inject_tensordict(
        prompts,
        [
            carrier.with_row({**(carrier.row or {}), "uid": uid, "step": step, "agent_name": agent_name})
            for carrier, uid, agent_name in zip(row_carriers, uids, agent_names)
        ],
    )
    return True


def _scalar(value: Any) -> Any:
    data = getattr(value, "data", value)  # NonTensorData
    return data.item() if hasattr(data, "item") else data


def _agent_names(manager: Any, prompts: Any, n: int) -> List[str]:
    if "agent_name" in prompts.keys():
        names = prompts["agent_name"]
        return id_list(names) if len(id_list(names)) == n else [str(_scalar(names))] * n
    try:
        default = manager.config.actor_rollout_ref.rollout.agent.default_agent_loop
    except Exception:
        default = None
    return [str(default or "agent")] * n


# --------------------------------------------------------------------------- replay buffer


def _sample(traced: _trainer.TracedTrainer):
    def wrapper(wrapped, instance, args, kwargs):
        try:
            partition = arguments(wrapped, instance, args, kwargs)[1].get("partition_id")
        except Exception as exc:
            health.record_failure("trainer_v1.sample", exc)
            partition = None
        if not (traced.active and not events.is_validating() and partition == "train"):
            return wrapped(*args, **kwargs)
        fetch = events.stage_begin(Stage.FETCH_BATCH, step=traced.global_step(), trainer=TRAINER,
                                   layout=traced.layout) if _disaggregated(traced) else None
        started = clock.monotonic_ns()
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            if fetch is not None:
                fetch.end(exc)
            raise
        if fetch is not None:
            fetch.end()
        _sampled(traced, result, clock.epoch_ns_since(started))  # its duration true across a jump of the system clock
        return result

    return wrapper


@health.guarded(default=None)
def _sampled(traced: _trainer.TracedTrainer, result: Any, start_ns: int) -> None:
    batch = result[0] if isinstance(result, tuple) else result
    uids, trajs = ids_from_keys(batch.keys, batch.tags)
    events.rollout_returned(uids)
    events.sample_stage_done(Stage.SAMPLE, uids, trajs, step=traced.global_step(), start_ns=start_ns,
                             trainer=TRAINER)
    if not _disaggregated(traced):  # generated tokens of this batch: the gen throughput line
        tokens = sum(int(tag.get("response_len", 0) or 0) for tag in batch.tags
                     if isinstance(tag, dict) and not tag.get("is_padding", False))
        events.current_stage().response_tokens(tokens)


# eviction_reasons = (stale, dapo-filtered, failed, counts): outcome and detail of each
_EVICTIONS = ((0, Outcome.EVICTED, "stale"), (1, Outcome.FILTERED, "filter_groups"), (2, Outcome.EVICTED, "rollout_failure"))


def _evict_terminal_groups(wrapped, instance, args, kwargs):
    # Before the call: verl clears the groups from TransferQueue inside it.
    try:
        _, values = arguments(wrapped, instance, args, kwargs)
        reasons = values.get("eviction_reasons")
        if values.get("partition_id") == "train" and reasons:
            done: set = set()
            for index, outcome, detail in _EVICTIONS:
                uids = [uid for uid in (reasons[index] or ()) if uid not in done]
                done.update(uids)
                events.samples_finished(uids, outcome, detail=detail)
    except Exception as exc:
        health.record_failure("trainer_v1._evict_terminal_groups", exc)
    return wrapped(*args, **kwargs)


def _kv_clear(traced: _trainer.TracedTrainer):
    # After training (or a critic warm-up step) fit clears the step's trajectories: any
    # of their samples still open was consumed without an actor update.
    def wrapper(wrapped, instance, args, kwargs):
        try:
            _, values = arguments(wrapped, instance, args, kwargs)
            if traced.active and values.get("partition_id") == "train":
                keys = id_list(values.get("keys"))
                uids = [uid for uid, traj in zip(*ids_from_keys(keys, None)) if traj != NO_TRAJ]
                events.samples_finished(uids, Outcome.CLEARED)
        except Exception as exc:
            health.record_failure("trainer_v1.kv_clear", exc)
        return wrapped(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------- batch stages


def _batch_stage(traced: _trainer.TracedTrainer, stage: Stage, *, finishes: bool = False):
    """Wrapper for a v1 stage method ``(self, batch: KVBatchMeta, metrics) -> KVBatchMeta``."""

    def ids_of(wrapped, instance, args, kwargs, result):
        batch = result if hasattr(result, "keys") and hasattr(result, "tags") else arguments(wrapped, instance, args, kwargs)[1]["batch"]
        if getattr(batch, "partition_id", "train") != "train":
            return None
        return _trainer.BatchRows(*ids_from_keys(batch.keys, batch.tags), oldest_versions(batch.keys, batch.tags))

    return _trainer.batch_stage_wrapper(traced, stage, TRAINER, ids_of, finishes=finishes)


def hooks(traced: _trainer.TracedTrainer) -> List[Hook]:
    fit = _trainer.fit_wrapper(traced, TRAINER, _worker_actors, layout_of=_layout, before_end=_end_unconsumed_samples)
    stage_timer = _trainer.marked_timer_wrapper(traced)
    sample = _sample(traced)
    return [
        Hook(TRAINER_BASE, "PPOTrainer.fit", fit, ("agent_loop_manager",), COMPONENT),
        Hook(TRAINER_BASE, "marked_timer", _marked_timer(traced, stage_timer), ("name",), COMPONENT),
        *[Hook(module, "marked_timer", stage_timer, ("name",), COMPONENT) for module in MODE_MODULES],
        Hook(TRAINER_BASE, "PPOTrainer._fetch_one_gen_batch", _fetch_one_gen_batch(traced), (), COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._validate", _trainer.validate, (), COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._compute_metrics", _trainer.record_metrics_wrapper(traced), ("batch",), COMPONENT),
        Hook(AGENT_LOOP_TQ, "AgentLoopManagerTQ.generate_sequences", _generate_sequences(traced), ("prompts",), COMPONENT),
        Hook(REPLAY_BUFFER, "ReplayBuffer.sample", sample, ("global_steps", "partition_id"), COMPONENT),
        Hook(REPLAY_BUFFER, "ReplayBufferAsync.sample", sample, ("global_steps", "partition_id"), COMPONENT),
        Hook(REPLAY_BUFFER, "ReplayBuffer._evict_terminal_groups", _evict_terminal_groups,
             ("partition_id", "eviction_reasons"), COMPONENT),
        Hook(TRANSFER_QUEUE, "kv_clear", _kv_clear(traced), ("keys", "partition_id"), COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._compute_reward_colocate", _batch_stage(traced, Stage.REWARD), ("batch",), COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._compute_old_log_prob", _batch_stage(traced, Stage.OLD_LOG_PROB), ("batch",),
             COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._compute_ref_log_prob", _batch_stage(traced, Stage.REF_LOG_PROB), ("batch",),
             COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._compute_advantage", _batch_stage(traced, Stage.ADVANTAGE), ("batch",), COMPONENT),
        Hook(TRAINER_BASE, "PPOTrainer._update_actor", _batch_stage(traced, Stage.UPDATE_ACTOR, finishes=True), ("batch",),
             COMPONENT),
    ]
