"""CPU harness: verl's real v1 PPO trainer (TransferQueue) on a local Ray cluster, stand-ins only for GPUs.

``run_v1(output_dir, mode=...)`` runs verl 0.9.1's v1 trainer (``verl/trainer/ppo/v1``, the
default trainer of ``main_ppo`` in 0.9.1) the way ``TaskRunnerV1.run`` does:
``tq.init(config.transfer_queue)``, ``trainer_cls(config)``, ``trainer.init()``,
``AgentLoopManagerTQ.create(...)``, ``trainer.fit(agent_loop_manager)``, ``tq.close()``.
``mode`` picks the real trainer class: ``sync`` (``PPOTrainerSync``), ``colocate_async``
(``PPOTrainerColocateAsync``) or ``separate_async`` (``PPOTrainerSeparateAsync``).

Real verl code (unchanged):

* ``PPOTrainer.fit`` / ``step`` / ``_step_once`` and every stage method (``prepare_step``,
  ``_add_batch_to_generate``, ``_submit_batch_to_rollout``, ``_balance_batch``,
  ``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``_compute_advantage``,
  ``_update_actor``, ``_compute_metrics``, ``_log_rollout_data``, ``_validate``) and each
  mode's hooks (``on_init_end``, ``on_train_begin`` warm-up batches, ``on_step_begin``,
  ``on_sample_end`` abort/sleep, ``on_step_end`` weight sync, separate_async's hybrid
  switch-to-trainer/rollout and Decoupled-PPO ``save_model_to_cpu`` / ``restore_model_from_cpu``);
* TransferQueue 0.1.11 (controller + ``SimpleStorageUnit`` actors on the local Ray cluster,
  sized to one storage unit: ``transfer_queue.backend.SimpleStorage.num_data_storage_units=1``,
  so controller + storage take the 2 CPUs; all other actors need no CPU reservation);
* ``ReplayBuffer`` (sync) / ``ReplayBufferAsync`` (async modes), with verl's off-policy gate;
* ``AgentLoopManagerTQ`` -> ``AgentLoopWorkerTQ`` actors -> ``SingleTurnAgentLoop`` /
  ``ToolAgentLoop`` (hermes, calculator tool) -> ``LLMServerClient`` (sync) or
  ``FullyAsyncLLMServerClient`` (async modes: resumes aborted requests, partial rollout) ->
  ``GlobalRequestLoadBalancer`` -> server actors;
* rewards: ``RewardLoopManager`` / ``RewardLoopWorker`` with the rule-based gsm8k score,
  streamed from the agent loop (no reward model);
* ``CheckpointEngineManager`` (``naive`` backend for the colocated replicas) and
  ``RolloutReplica`` lifecycle calls (sleep, wake, abort, resume);
* data (``RLHFDataset``, ``StatefulDataLoader``), config (``ppo_trainer`` Hydra config) and
  metrics (``Tracking`` console + file), shared with the v0 harness (:mod:`otel_verl.demo.common`).

Stand-ins, only for what needs a GPU (all ``...StandIn`` classes):

* :class:`~otel_verl.demo.workers_standin_v1.ActorRolloutRefWorkerGroupV1StandIn` for the
  actor/rollout/ref worker group (its methods go through verl's real ``tqbridge``, reading
  and writing TransferQueue as the GPU workers do);
* :class:`~otel_verl.demo.workers_standin.RolloutReplicaStandIn` /
  :class:`~otel_verl.demo.workers_standin.LLMServerManagerStandIn` and
  :class:`~otel_verl.demo.llm_server_standin.LLMServerStandIn` (or verl's
  ``SGLangHttpServer`` over a stand-in engine) for the sglang/vLLM servers, hybrid and
  standalone;
* separate_async only: :class:`~otel_verl.demo.workers_standin_v1.CheckpointEngineStandIn`
  (backend ``"standin"``, loaded by verl through ``checkpoint_engine.custom_backend_module``)
  and :class:`~otel_verl.demo.workers_standin_v1.CheckpointEngineManagerStandIn` for the
  NCCL weight sync to the standalone rollout.

They are wired in by subclasses of the real trainer classes (:class:`PPOTrainerSyncStandIns`,
:class:`PPOTrainerColocateAsyncStandIns`, :class:`PPOTrainerSeparateAsyncStandIns`) that
override only ``_setup`` (the GPU wiring; it follows ``PPOTrainer._setup`` /
``PPOTrainerSeparateAsync._setup`` step by step), as the v0 harness overrides only
``init_workers``.

The harness imports no tracing. ``runtime_env`` reaches every Ray worker and ``on_ray_init()``
runs in the trainer's process after Ray is up, before any verl object is built (as in
:func:`otel_verl.demo.harness.run_v0`).

    python -m otel_verl.demo.harness_v1 --out /tmp/v1 --mode colocate_async --steps 2 --prompts 4 --n 4

Notes for tracing (what this harness showed about verl 0.9.1's v1 path)
-----------------------------------------------------------------------
* Per step, ``fit`` runs ``on_step_begin`` -> ``step()`` (``prepare_step`` ->
  ``_add_batch_to_generate`` -> ``_next_train_batch`` + ``_submit_batch_to_rollout``, then
  ``parameter_sync_step`` times ``_step_once``: ``replay_buffer.sample`` ->
  ``on_sample_end`` -> ``_balance_batch`` -> ``_compute_old_log_prob`` -> ``_compute_ref_log_prob``
  -> ``_compute_advantage`` -> ``_update_actor``) -> ``on_step_end`` (weight sync) ->
  ``_validate`` (test_freq) -> ``_compute_metrics`` -> ``_log_rollout_data`` ->
  ``tq.kv_clear(batch.keys)``. Only separate_async runs ``_step_once`` more than once per step
  (``parameter_sync_step``, here 2: two mini-batches of ``prompts/2`` prompts per step).
* ``prepare_step`` submits the prompts of step k *before* sampling; in sync mode
  ``ReplayBuffer.sample`` then blocks until exactly those are done. In the async modes
  ``on_train_begin`` first submits ``num_warmup_batches`` (1) extra batch, so step k samples
  the oldest finished groups: step 2 trains prompts submitted during step 1 (tag
  ``global_steps`` = 1) while step 2's own prompts are still generating. The trained keys'
  tags carry ``global_steps`` (dataloader step), ``min_global_steps`` / ``max_global_steps``
  (weight versions that generated the trajectory; they differ when a request was aborted and
  resumed across a weight sync).
* Keys: prompt ``uid`` (uuid4, ``_fetch_one_gen_batch``) is the TQ key of the prompt entry
  (tags ``is_prompt``, ``status`` pending/running/finished/failure); each trajectory is
  ``f"{uid}_{session_id}_{i}"``. The trainer's ``KVBatchMeta`` only has trajectory keys.
  ``session_id`` (0..n-1) is a kwarg of ``_run_agent_loop``; ``global_steps`` and ``index``
  too. The rollout dump's ``uid`` column holds the trajectory keys, not the prompt uid.
* TQ calls: trainer ``kv_batch_put`` (prompts; with fields in async modes), ``kv_list``
  (replay buffer polling every 2 s), ``kv_batch_get`` / ``kv_batch_put`` in each stage,
  ``kv_clear``; workers ``async_kv_put`` (prompt status) and ``async_kv_batch_put``
  (trajectories); the worker-group methods read/write via ``tqbridge`` (``async_get_data`` /
  ``async_put`` on the client).
* ``marked_timer`` names: common ``step``, ``gen`` (the replay-buffer sample, not the
  generation itself), ``old_log_prob``, ``ref``, ``adv``, ``update_actor``, ``update_weights``,
  ``testing``, ``dump_rollout_generations``; separate_async adds ``switch_to_trainer`` (step
  1, hybrid replicas leave the balancer) and ``switch_to_rollout`` / ``switch_wait`` when
  hybrid switching is enabled. ``timing_s/gen`` therefore measures waiting for samples.
* colocate_async's ``on_sample_end`` aborts in-flight requests (``abort_replicas``) and sleeps
  the replicas; ``FullyAsyncLLMServerClient.generate`` retries the aborted request after 1 s
  with prompt + partial tokens, so one agent-loop turn can span several server requests with
  the same request_id (server stats ``aborted``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from otel_verl.demo.common import (
    DEFAULT_NUM_CPUS,
    PHASES_FILE,
    _kill,
    _read_jsonl,
    _server_choice,
    build_config,
    harness_overrides,
    prepare_inputs,
    prepare_output_dir,
    start_ray_and_fit,
)
from otel_verl.demo.progress import note_phase

MODES = ("sync", "colocate_async", "separate_async")
TQ_STORAGE_UNITS = 1
SEPARATE_PARAMETER_SYNC_STEP = 2
# the async modes' stand-in server interrupts every k-th request (see run_v1)
DEFAULT_PREEMPT_EVERY = 7


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
def v1_overrides(mode: str, *, prompts: int, parameter_sync_step: int = SEPARATE_PARAMETER_SYNC_STEP) -> List[str]:
    """``trainer.v1.*`` and ``transfer_queue.*`` overrides on top of :func:`harness_overrides`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    overrides = [
        f"trainer.v1.trainer_mode={mode}",
        "transfer_queue.enable=True",
        f"transfer_queue.backend.SimpleStorage.num_data_storage_units={TQ_STORAGE_UNITS}",
        "transfer_queue.backend.SimpleStorage.total_storage_size=20000",
    ]
    if mode == "separate_async":
        overrides += [
            f"trainer.v1.separate_async.parameter_sync_step={parameter_sync_step}",
            # one standalone rollout replica ("GPU") next to the hybrid one
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            # separate_async refuses the naive backend: a stand-in engine registered by verl's plug-in knob
            "actor_rollout_ref.rollout.checkpoint_engine.backend=standin",
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=otel_verl.demo.workers_standin_v1",
        ]
    return overrides


# ---------------------------------------------------------------------------------------------
# the trainers: verl's v1 trainer classes with the GPU wiring of _setup replaced
# ---------------------------------------------------------------------------------------------
class _StandInSetup:
    """``_setup`` that follows ``PPOTrainer._setup`` with CPU stand-ins for the GPU parts."""

    def __init__(self, config: Any, *, server_cls: Any = None, server_kwargs: Optional[dict] = None) -> None:
        self._server_cls = server_cls
        self._server_kwargs = dict(server_kwargs or {})
        super().__init__(config)  # type: ignore[call-arg]

    def _setup(self) -> None:
        self._setup_with_standins()

    def _setup_with_standins(self) -> None:
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.experimental.reward_loop import RewardLoopManager
        from verl.utils.config import omega_conf_to_dataclass

        from otel_verl.demo.workers_standin import LLMServerManagerStandIn
        from otel_verl.demo.workers_standin_v1 import ActorRolloutRefWorkerGroupV1StandIn

        self: Any
        if self.use_critic:
            raise NotImplementedError("the v1 CPU harness has no critic stand-in; use a critic-free estimator (grpo)")
        if self.use_teacher_policy:
            raise NotImplementedError("the v1 CPU harness has no teacher-model stand-in")
        if self.config.reward.reward_model.enable:
            raise NotImplementedError("the v1 CPU harness has no reward-model stand-in; use the rule-based reward")
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        self._init_resource_pool_mgr()
        # (GPU) resource_pool_manager.create_resource_pool(): GPU placement groups, skipped
        self.resource_pool_to_cls = {}
        lora_rank = self.config.actor_rollout_ref.model.get("lora", {}).get("rank", 0)
        if lora_rank <= 0:
            lora_rank = self.config.actor_rollout_ref.model.get("lora_rank", 0)
        self.ref_in_actor = lora_rank > 0 or self.config.actor_rollout_ref.model.get("lora_adapter_path") is not None

        # 1.-6. worker groups (GPU) -> one stand-in for actor, rollout and ref
        self.actor_rollout_wg = ActorRolloutRefWorkerGroupV1StandIn(
            self.config, self.resource_pool_manager.get_n_gpus(), step_getter=lambda: getattr(self, "global_steps", None)
        )
        self.actor_rollout_wg.init_model()
        if self.use_reference_policy or self.ref_in_actor:
            self.ref_policy_wg = self.actor_rollout_wg

        # 7. reward loop (real, rule-based: streamed from the agent loop)
        self.reward_loop_manager = RewardLoopManager(config=self.config, rm_resource_pool=None)
        # 8. no teacher
        self.teacher_model_manager = None
        self.distillation_config = None
        # 9. rollout replicas colocated with the "training GPUs" (stand-in servers)
        if getattr(self, "_enable_hybrid_replicas", True):
            self.llm_server_manager = LLMServerManagerStandIn.create(
                config=self.config, worker_group=self.actor_rollout_wg, rollout_resource_pool=None,
                server_cls=self._server_cls, server_kwargs=self._server_kwargs,
            )
        else:
            self.llm_server_manager = LLMServerManagerStandIn.create_empty(
                config=self.config, server_cls=self._server_cls, server_kwargs=self._server_kwargs
            )
        # 10. checkpoint engine manager (real, naive backend as verl forces it here)
        checkpoint_engine_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
        checkpoint_engine_config.backend = "naive"
        self.checkpoint_manager = CheckpointEngineManager(
            config=checkpoint_engine_config,
            actor_wg=self.actor_rollout_wg,
            replicas=self.llm_server_manager.get_replicas(),
        )
        self.checkpoint_manager.sleep_replicas()
        self._load_checkpoint()

    # ---- harness helpers (not used by verl) --------------------------------------------------
    def standin_server_managers(self) -> List[Any]:
        return [m for m in (getattr(self, "llm_server_manager", None), getattr(self, "standalone_server_manager", None)) if m]

    def standin_actor_handles(self) -> List[Any]:
        handles: List[Any] = []
        manager = getattr(self, "agent_loop_manager", None)
        handles += list(getattr(manager, "agent_loop_workers", []) or [])
        reward = getattr(self, "reward_loop_manager", None)
        handles += list(getattr(reward, "reward_loop_workers", []) or [])
        for llm in self.standin_server_managers():
            handles += [s for r in getattr(llm, "rollout_replicas", []) for s in r.servers]
            if getattr(llm, "global_load_balancer", None) is not None:
                handles.append(llm.global_load_balancer)
        return handles

    def server_stats(self) -> List[Dict[str, Any]]:
        import ray

        out: List[Dict[str, Any]] = []
        for kind, llm in zip(("hybrid", "standalone"), (getattr(self, "llm_server_manager", None),
                                                       getattr(self, "standalone_server_manager", None))):
            servers = [s for r in getattr(llm, "rollout_replicas", []) for s in r.servers] if llm else []
            for stats in ray.get([s.get_stats.remote() for s in servers]) if servers else []:
                out.append({**stats, "kind": kind})
        return out


def _trainer_classes() -> Dict[str, type]:
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode, PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    class PPOTrainerSyncStandIns(_StandInSetup, PPOTrainerSync):
        """verl's ``PPOTrainerSync`` (``trainer_mode=sync``) with the stand-in ``_setup``."""

    class PPOTrainerColocateAsyncStandIns(_StandInSetup, PPOTrainerColocateAsync):
        """verl's ``PPOTrainerColocateAsync`` (``trainer_mode=colocate_async``) with the stand-in ``_setup``."""

    class PPOTrainerSeparateAsyncStandIns(_StandInSetup, PPOTrainerSeparateAsync):
        """verl's ``PPOTrainerSeparateAsync``; ``_setup`` follows ``PPOTrainerSeparateAsync._setup``
        (base setup, standalone rollout, its checkpoint manager, hybrid replicas in the balancer)."""

        def _setup(self) -> None:
            from verl.utils.config import omega_conf_to_dataclass

            from otel_verl.demo.workers_standin import LLMServerManagerStandIn
            from otel_verl.demo.workers_standin_v1 import CheckpointEngineManagerStandIn

            self._setup_with_standins()
            hybrid_num_replicas = len(self.llm_server_manager.rollout_replicas)
            self.standalone_server_manager = LLMServerManagerStandIn.create(
                config=self.config, start_rank=hybrid_num_replicas,
                server_cls=self._server_cls, server_kwargs=self._server_kwargs,
            )
            checkpoint_engine_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
            self.standalone_checkpoint_manager = CheckpointEngineManagerStandIn(
                config=checkpoint_engine_config,
                actor_wg=self.actor_rollout_wg,
                replicas=self.standalone_server_manager.get_replicas(),
            )
            if self._enable_hybrid_replicas:
                self.current_mode = HybridEngineMode.ROLLOUT
                self.add_replicas_to_balancer()
            else:
                self.current_mode = HybridEngineMode.TRAINER

    _CLASSES.update({
        "sync": PPOTrainerSyncStandIns,
        "colocate_async": PPOTrainerColocateAsyncStandIns,
        "separate_async": PPOTrainerSeparateAsyncStandIns,
    })
    return _CLASSES


_CLASSES: Dict[str, type] = {}


def trainer_class(mode: str) -> type:
    """The stand-in-wired subclass of verl's registered v1 trainer for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return (_CLASSES or _trainer_classes())[mode]


# names for documentation / isinstance checks (resolved lazily: importing verl's trainers is slow)
def __getattr__(name: str) -> Any:
    mapping = {
        "PPOTrainerSyncStandIns": "sync",
        "PPOTrainerColocateAsyncStandIns": "colocate_async",
        "PPOTrainerSeparateAsyncStandIns": "separate_async",
    }
    if name in mapping:
        return trainer_class(mapping[name])
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------
# one run (in the trainer's process): what TaskRunnerV1.run does
# ---------------------------------------------------------------------------------------------
def _fit_v1(
    config: Any, *, server: str, server_kwargs: dict, file_log: str, on_fit: Optional[Callable[[Any, str], Any]] = None,
    phase_log: Optional[str] = None,
) -> Dict[str, Any]:
    import transfer_queue as tq
    from omegaconf import OmegaConf

    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn

    timings: Dict[str, float] = {}
    mode = config.trainer.v1.trainer_mode
    trainer_cls = trainer_class(mode)
    config.transfer_queue.enable = True
    OmegaConf.resolve(config)

    previous = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = file_log
    note_phase(phase_log, "starting TransferQueue (controller and storage actors)")
    t = time.time()
    tq.init(config.transfer_queue)
    timings["tq_init_s"] = time.time() - t
    trainer = None
    succeeded = False
    try:
        note_phase(phase_log, f"building verl's v1 trainer ({mode}) and its workers: LLM servers, reward workers")
        t = time.time()
        trainer = trainer_cls(config=config, server_cls=_server_choice(server), server_kwargs=server_kwargs)
        trainer.init()
        timings["trainer_init_s"] = time.time() - t
        note_phase(phase_log, "starting the agent loop workers")
        t = time.time()
        manager_class_fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        manager_cls = load_class_from_fqn(manager_class_fqn, "AgentLoopManager") if manager_class_fqn else AgentLoopManagerTQ
        agent_loop_manager = manager_cls.create(
            config=config,
            llm_client=trainer.get_llm_client(),
            teacher_client=trainer.get_teacher_client(),
            reward_loop_worker_handles=trainer.get_reward_handles(),
        )
        trainer.agent_loop_manager = agent_loop_manager  # fit sets it too; for teardown on failure
        timings["agent_loop_manager_s"] = time.time() - t
        if on_fit is not None:
            on_fit(trainer, "start")
        note_phase(phase_log, f"training: step 1 of {config.trainer.total_training_steps}")
        t = time.time()
        trainer.fit(agent_loop_manager)
        timings["fit_s"] = time.time() - t
        note_phase(phase_log, "training done; stopping the workers")
        succeeded = True
        on_fit_result = on_fit(trainer, "end") if on_fit is not None else None
        wg = trainer.actor_rollout_wg
        result: Dict[str, Any] = {
            "mode": mode,
            "trainer_class": [c.__name__ for c in type(trainer).__mro__[:3]],
            "timings": timings,
            "server_stats": trainer.server_stats(),
            "worker_group_calls": dict(wg.calls),
            "weight_versions": list(wg.weight_versions),
            "trained": list(wg.trained),
            "final_global_steps": trainer.global_steps,
            "on_fit": on_fit_result,
        }
    finally:
        try:
            tracking = getattr(trainer, "logger", None)
            if tracking is not None:
                tracking.finish(exit_code=0 if succeeded else 1)
        except Exception:
            pass
        if previous is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = previous
        if trainer is not None:
            num_reward_workers = int(config.reward.get("num_workers", 0) or 0)
            _kill(trainer.standin_actor_handles(), [f"reward_loop_worker_{i}" for i in range(num_reward_workers)])
        tq.close()
    return result


class TaskRunnerV1StandIn:
    """Hosts the v1 trainer inside a Ray actor, like verl's ``TaskRunnerV1`` (``trainer_in_actor=True``)."""

    def run(self, config: Any, server: str, server_kwargs: dict, file_log: str,
            on_fit: Optional[Callable[[Any, str], Any]] = None, phase_log: Optional[str] = None) -> Dict[str, Any]:
        return _fit_v1(config, server=server, server_kwargs=server_kwargs, file_log=file_log, on_fit=on_fit,
                       phase_log=phase_log)


def run_v1(
    output_dir: str,
    *,
    mode: str = "sync",
    steps: int = 2,
    prompts: int = 4,
    n: int = 4,
    agent: str = "single",
    validate: bool = False,
    on_ray_init: Optional[Callable[[], Any]] = None,
    runtime_env: Optional[dict] = None,
    agent_workers: int = 2,
    num_cpus: int = DEFAULT_NUM_CPUS,
    server: str = "standin",
    latency_s: float = 0.05,
    preempt_every: Optional[int] = None,
    parameter_sync_step: int = SEPARATE_PARAMETER_SYNC_STEP,
    model_dir: Optional[str] = None,
    overrides: Sequence[str] = (),
    trainer_in_actor: bool = False,
    keep_ray: bool = False,
    log_to_driver: bool = False,
    agent_name: Optional[str] = None,
    agent_loop_config_path: Optional[str] = None,
    on_fit: Optional[Callable[[Any, str], Any]] = None,
) -> Dict[str, Any]:
    """Run verl's v1 trainer (``mode``) on CPU and return a summary dict.

    Arguments as :func:`otel_verl.demo.harness.run_v0`, plus ``mode`` (``sync``,
    ``colocate_async``, ``separate_async``) and ``parameter_sync_step`` (separate_async: local
    updates per step; ``prompts`` must be a multiple, each update samples
    ``prompts / parameter_sync_step`` prompts). ``validate`` defaults to False here (one
    validation pass at the last step when True). The advantage estimator is GRPO (no critic
    stand-in for v1). ``preempt_every``: every k-th request of the stand-in engine (either
    ``server``) is interrupted mid-decode and comes back aborted, so the async modes'
    resuming client shows its partial rollouts; default 7 in the async modes, 0 (never) in
    sync, whose plain client does not resume.
    """
    t_start = time.time()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "separate_async" and prompts % parameter_sync_step:
        raise ValueError(f"separate_async: prompts ({prompts}) must be a multiple of parameter_sync_step")
    out = prepare_output_dir(output_dir)
    phase_log = os.path.join(out, PHASES_FILE)
    note_phase(phase_log, "preparing the stand-in model, the data and verl's config")

    t = time.time()
    model_dir, train_path, val_path, tool_config_path, _tool_log = prepare_inputs(
        out, agent=agent, prompts=prompts, steps=steps + 2, model_dir=model_dir, agent_name=agent_name
    )
    overrides_all = harness_overrides(
        model_dir=model_dir, train_files=train_path, val_files=val_path, output_dir=out, steps=steps,
        prompts=prompts, n=n, agent=agent, validate=validate, agent_workers=agent_workers,
        tool_config_path=tool_config_path, adv_estimator="grpo", agent_name=agent_name,
        agent_loop_config_path=agent_loop_config_path, experiment_name=f"cpu_harness_v1_{mode}", use_v1=True,
        ppo_mini_batch_prompts=prompts // parameter_sync_step if mode == "separate_async" else prompts,
    ) + v1_overrides(mode, prompts=prompts, parameter_sync_step=parameter_sync_step) + list(overrides)
    config = build_config(overrides_all)
    prepare_s = time.time() - t

    env = dict(runtime_env or {})
    env["env_vars"] = {**dict(env.get("env_vars") or {}), "TRANSFER_QUEUE_ENABLE": "1"}  # as run_ppo sets it
    fit_result, started_ray, ray_init_s = start_ray_and_fit(
        label="run_v1", config=config, fit=_fit_v1, runner_cls=TaskRunnerV1StandIn, runtime_env=env,
        on_ray_init=on_ray_init, num_cpus=num_cpus, log_to_driver=log_to_driver, keep_ray=keep_ray,
        trainer_in_actor=trainer_in_actor, file_log=os.path.join(out, "metrics.jsonl"), server=server,
        server_kwargs=_server_kwargs(mode, latency_s, preempt_every), on_fit=on_fit, phase_log=phase_log,
    )

    summary = summarize_v1(out, fit_result, mode=mode, agent=agent, steps=steps, prompts=prompts, n=n)
    summary["timings"].update({"prepare_s": prepare_s, "ray_init_s": ray_init_s, "total_s": time.time() - t_start})
    summary["ray"] = {"started_by_harness": started_ray, "runtime_env_applied": started_ray or not runtime_env}
    summary["config"] = {
        "mode": mode, "agent": agent, "steps": steps, "prompts": prompts, "n": n, "validate": validate,
        "agent_workers": agent_workers, "server": server, "parameter_sync_step":
        parameter_sync_step if mode == "separate_async" else 1, "trainer_in_actor": trainer_in_actor,
        "model_dir": model_dir, "overrides": overrides_all, "tq_storage_units": TQ_STORAGE_UNITS,
    }
    summary["on_fit"] = fit_result.get("on_fit")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------
def summarize_v1(out: str, fit_result: Dict[str, Any], *, mode: str, agent: str, steps: int, prompts: int,
                 n: int) -> Dict[str, Any]:
    """verl's outputs (file logger, rollout dumps), the stand-in worker group's training record and server stats."""
    import glob

    metric_rows = _read_jsonl(os.path.join(out, "metrics.jsonl"))
    train_rows = [r for r in metric_rows if "training/global_step" in r["data"]]
    keep = ("critic/score/mean", "response_length/mean", "num_turns/mean", "actor/pg_loss", "actor/entropy")
    metrics_per_step = {
        int(r["step"]): {k: v for k, v in r["data"].items() if k in keep or k.startswith(("timing_s/", "val-core/"))}
        for r in train_rows
    }
    dumped: Dict[int, int] = {}
    dumped_keys: Dict[int, List[str]] = {}
    scores: Dict[int, Dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(out, "rollout", "*.jsonl"))):
        step = int(os.path.splitext(os.path.basename(path))[0])
        rows = _read_jsonl(path)
        dumped[step] = len(rows)
        dumped_keys[step] = [r.get("uid") for r in rows]
        values = [float(r["score"]) for r in rows]
        scores[step] = {"mean": sum(values) / len(values) if values else None, "distinct": sorted(set(values))}

    trained: Dict[int, Dict[str, Any]] = {}
    for rec in fit_result.get("trained", []):
        step = int(rec["step"])
        entry = trained.setdefault(step, {"updates": 0, "keys": [], "prompt_global_steps": [], "min_weight_versions": [],
                                          "max_weight_versions": [], "padding": 0})
        entry["updates"] += 1
        for key, tag in zip(rec["keys"], rec["tags"]):
            if tag.get("is_padding"):
                entry["padding"] += 1
                continue
            entry["keys"].append(key)
            entry["prompt_global_steps"].append(tag.get("global_steps"))
            entry["min_weight_versions"].append(tag.get("min_global_steps"))
            entry["max_weight_versions"].append(tag.get("max_global_steps"))
    for step, entry in trained.items():
        entry["trajectories"] = len(entry["keys"])
        entry["prompt_uids"] = sorted({k.rsplit("_", 2)[0] for k in entry["keys"]})
        entry["from_earlier_steps"] = sum(1 for g in entry["prompt_global_steps"] if g is not None and g < step)
    server_stats = fit_result.get("server_stats", [])
    return {
        "mode": mode,
        "agent": agent,
        "trainer_classes": fit_result.get("trainer_class"),
        "steps_requested": steps,
        "steps_run": len(train_rows),
        "global_steps": [int(r["step"]) for r in train_rows],
        "expected_trajectories_per_step": prompts * n,
        "trajectories_per_step": {s: e["trajectories"] for s, e in sorted(trained.items())},
        "dumped_trajectories_per_step": dumped,
        "dumped_keys_per_step": dumped_keys,
        "trained_per_step": {s: trained[s] for s in sorted(trained)},
        "scores_per_step": scores,
        "metrics_per_step": metrics_per_step,
        "server": {
            "requests": sum(s.get("requests", 0) for s in server_stats),
            "aborted": sum(s.get("aborted", 0) for s in server_stats),
            "rejected": sum(s.get("rejected", 0) for s in server_stats),
            "pauses": sum(s.get("pauses", 0) for s in server_stats),
            "tool_call_outputs": sum(s.get("tool_call_outputs", 0) for s in server_stats),
            "second_turn_requests": sum(s.get("tool_response_prompts", 0) for s in server_stats),
            "per_server": server_stats,
        },
        "worker_group_calls": fit_result.get("worker_group_calls", {}),
        "weight_versions": fit_result.get("weight_versions", []),
        "timings": dict(fit_result.get("timings", {})),
        "paths": {"output_dir": out, "metrics": os.path.join(out, "metrics.jsonl"),
                  "rollout_dumps": os.path.join(out, "rollout"), "summary": os.path.join(out, "summary.json")},
    }


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [
        f"mode={summary['mode']} agent={summary['agent']} steps run={summary['steps_run']}/"
        f"{summary['steps_requested']} global_steps={summary['global_steps']}",
        f"trajectories trained per step={summary['trajectories_per_step']} "
        f"(expected {summary['expected_trajectories_per_step']})",
        "trained from earlier steps' rollouts=" + json.dumps(
            {s: e["from_earlier_steps"] for s, e in summary["trained_per_step"].items()}),
        f"llm requests={summary['server']['requests']} aborted={summary['server']['aborted']} "
        f"rejected={summary['server']['rejected']} tool-call outputs={summary['server']['tool_call_outputs']}",
        f"worker group calls={summary['worker_group_calls']} weight versions={summary['weight_versions']}",
        "wall time: " + ", ".join(f"{k}={v:.1f}s" for k, v in summary["timings"].items()),
        f"outputs in {summary['paths']['output_dir']}",
    ]
    return "\n".join(lines)


def _server_kwargs(mode: str, latency_s: float, preempt_every: Optional[int]) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {"latency_s": latency_s}
    if preempt_every is None:
        preempt_every = 0 if mode == "sync" else DEFAULT_PREEMPT_EVERY
    if preempt_every:
        kwargs["preempt_every"] = int(preempt_every)
    return kwargs


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m otel_verl.demo.harness_v1",
        description="Run verl's real v1 PPO trainer (TransferQueue) on CPU with stand-ins for the GPU parts.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--mode", choices=MODES, default="sync")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--agent", choices=("single", "tool"), default="single")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--agent-workers", type=int, default=2)
    parser.add_argument("--server", choices=("standin", "sglang"), default="standin")
    parser.add_argument("--latency", type=float, default=0.05, help="simulated engine latency per request (s)")
    parser.add_argument("--preempt-every", type=int, default=None,
                        help="stand-in engine: abort every k-th request mid-decode (default 7 in async modes, 0: never)")
    parser.add_argument("--parameter-sync-step", type=int, default=SEPARATE_PARAMETER_SYNC_STEP)
    parser.add_argument("--trainer-in-actor", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="stream Ray worker logs")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value)")
    args = parser.parse_args(argv)
    summary = run_v1(
        args.out, mode=args.mode, steps=args.steps, prompts=args.prompts, n=args.n, agent=args.agent,
        validate=args.validate, agent_workers=args.agent_workers, server=args.server, latency_s=args.latency,
        preempt_every=args.preempt_every, parameter_sync_step=args.parameter_sync_step, overrides=args.overrides,
        trainer_in_actor=args.trainer_in_actor, log_to_driver=args.verbose,
    )
    print("=" * 80)
    print(format_summary(summary))
    ok = summary["steps_run"] == args.steps and all(
        v == summary["expected_trajectories_per_step"] for v in summary["trajectories_per_step"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
