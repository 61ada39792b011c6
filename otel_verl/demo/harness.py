"""CPU harness: verl's real v0 PPO step loop on a real local Ray cluster, stand-ins only for GPUs.

``run_v0(output_dir, ...)`` runs ``RayPPOTrainer.fit`` (verl/trainer/ppo/ray_trainer.py,
unchanged) for a few steps on a CPU-only machine. Real verl code throughout:

* the Hydra config: ``compose(config_name="ppo_trainer")`` from the installed
  ``verl/trainer/config`` plus overrides (:func:`build_config`), checked by verl's
  ``validate_config`` as ``main_ppo`` does;
* data: verl's ``RLHFDataset`` / ``StatefulDataLoader`` over a local GSM8K-like parquet
  (:mod:`otel_verl.demo.data`), tokenized by a locally built stand-in tokenizer
  (:mod:`otel_verl.demo.tiny_model`);
* Ray: a real local cluster (``ray.init(num_cpus=2)``, or the caller's), with verl's
  ``get_ppo_ray_runtime_env`` merged with the caller's ``runtime_env`` (for example a
  ``worker_process_setup_hook`` and ``env_vars``), as ``main_ppo.run_ppo`` does;
* rollout: ``AgentLoopManager`` -> ``AgentLoopWorker`` actors -> ``SingleTurnAgentLoop`` /
  ``ToolAgentLoop`` (hermes parser, native ``calculator`` tool from
  :mod:`otel_verl.demo.tools`) -> ``LLMServerClient`` -> ``GlobalRequestLoadBalancer`` (via
  ``LLMServerManager`` / ``get_router_handle``) -> server actors;
* rewards: ``RewardLoopManager`` / ``RewardLoopWorker`` actors with verl's naive reward
  manager and the rule-based gsm8k ``compute_score``, streamed from the agent loop (the
  default when there is no reward model);
* weight sync: verl's ``CheckpointEngineManager`` (``naive`` backend) and the replicas'
  ``sleep`` / ``update_weights`` cycle;
* metrics: verl's ``Tracking`` (console + file backends), rollout / validation dumps.

Stand-ins, only where a GPU would be needed (see :mod:`otel_verl.demo.workers_standin` and
:mod:`otel_verl.demo.llm_server_standin`): the actor/rollout/ref and critic worker groups
(:class:`ActorRolloutRefWorkerGroupStandIn`, :class:`CriticWorkerGroupStandIn`), the rollout
replicas' server process (:class:`RolloutReplicaStandIn` launching :class:`LLMServerStandIn`
or, with ``server="sglang"``, verl's real ``SGLangHttpServer`` over a stand-in engine) and
the replica class choice in ``LLMServerManager`` (:class:`LLMServerManagerStandIn`). They
are wired in by :class:`RayPPOTrainerWithStandIns`, a ``RayPPOTrainer`` subclass that
overrides only ``init_workers``; ``fit`` and every other trainer method are inherited.

The harness does not import or enable any tracing. A tracing layer plugs in from outside:
``runtime_env`` reaches every Ray worker (the ``worker_process_setup_hook``), and
``on_ray_init()`` is called in the trainer's process after Ray is up and before any verl
object is built (the trainer runs in the calling process unless ``trainer_in_actor=True``,
in which case it runs inside a Ray actor, like verl's ``TaskRunner``, and only
``runtime_env`` reaches it).

    python -m otel_verl.demo.harness --out /tmp/demo --steps 2 --prompts 4 --n 4 --agent tool

    from otel_verl.demo.harness import run_v0
    summary = run_v0("/tmp/demo", steps=2, prompts=4, n=4, agent="tool")
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from otel_verl.demo.common import (  # noqa: E402,F401  (re-exported: harness.X keeps working)
    DEFAULT_NUM_CPUS, PHASES_FILE, PROJECT_NAME, PROMPT_LENGTH, RESPONSE_LENGTH, SERVER_KINDS, VAL_SIZE, _kill, _read_jsonl,
    _server_choice, _set_agent_name, build_config, harness_overrides, init_ray, prepare_inputs, prepare_output_dir,
    ray_runtime_env, start_ray_and_fit, verl_config_dir,
)
from otel_verl.demo.progress import note_phase


# ---------------------------------------------------------------------------------------------
# the trainer: verl's RayPPOTrainer with GPU worker groups replaced in init_workers only
# ---------------------------------------------------------------------------------------------
def _trainer_base():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    return RayPPOTrainer


class _StandInWorkers:
    """``init_workers`` of a v0-style trainer with CPU stand-ins for the GPU parts.

    It follows ``RayPPOTrainer.init_workers`` step by step: worker groups (stand-ins),
    ``RewardLoopManager`` (real), ``LLMServerManager.create`` (real, with the stand-in replica
    class), ``AgentLoopManager.create`` (real, or ``agent_loop_manager_class``),
    ``CheckpointEngineManager`` (real, or ``checkpoint_manager_class``) and the final
    ``sleep_replicas()``. Mixed into verl's trainer classes: ``fit`` and all their other
    methods are inherited unchanged.
    """

    def __init__(self, *args: Any, server_cls: Any = None, server_kwargs: Optional[dict] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._server_cls = server_cls
        self._server_kwargs = dict(server_kwargs or {})

    def init_workers(self) -> None:
        from verl.experimental.reward_loop import RewardLoopManager
        from verl.trainer.ppo.utils import Role
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.import_utils import load_class_from_fqn

        from otel_verl.demo.workers_standin import (
            ActorRolloutRefWorkerGroupStandIn,
            CriticWorkerGroupStandIn,
            LLMServerManagerStandIn,
        )

        if self.use_rm:
            raise NotImplementedError("the CPU harness has no reward-model stand-in; use the rule-based reward")
        if self.use_teacher_policy:
            raise NotImplementedError("the CPU harness has no teacher-model stand-in")
        world_size = self.resource_pool_manager.get_n_gpus()

        # worker groups (GPU) -> stand-ins
        actor_role = Role.ActorRolloutRef if Role.ActorRolloutRef in self.role_worker_mapping else Role.ActorRollout
        wg_cls = self.role_worker_mapping[actor_role]
        if self.use_critic:
            critic_cls = self.role_worker_mapping.get(Role.Critic, CriticWorkerGroupStandIn)
            self.critic_wg = critic_cls(self.config, world_size)
            self.critic_wg.reset()
            try:
                from verl.workers.utils.losses import value_loss

                self.critic_wg.set_loss_fn(functools.partial(value_loss, config=omega_conf_to_dataclass(self.config.critic)))
            except Exception:  # the stand-in never calls it; keep the call shape
                self.critic_wg.set_loss_fn(None)
        self.actor_rollout_wg = wg_cls(self.config, world_size)
        if self.use_reference_policy:
            self.ref_policy_wg = self.actor_rollout_wg  # ref fused in ActorRolloutRefWorker, as in verl 0.9
        self.actor_rollout_wg.init_model()

        # reward loop (real): rule-based reward, no reward model -> streamed from the agent loop
        self.reward_loop_manager = RewardLoopManager(config=self.config, rm_resource_pool=None)
        self.async_rollout_mode = True
        self.teacher_model_manager = None
        self.distillation_config = None

        manager_class_fqn = self.config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        if manager_class_fqn:
            AgentLoopManager = load_class_from_fqn(manager_class_fqn, "AgentLoopManager")
        else:
            from verl.experimental.agent_loop import AgentLoopManager

        enable_agent_reward_loop = not self.use_rm or self.config.reward.reward_model.enable_resource_pool
        self.llm_server_manager = LLMServerManagerStandIn.create(
            config=self.config,
            worker_group=self.actor_rollout_wg,
            rollout_resource_pool=None,
            server_cls=self._server_cls,
            server_kwargs=self._server_kwargs,
        )
        reward_loop_worker_handles = self.reward_loop_manager.reward_loop_workers if enable_agent_reward_loop else None
        self.async_rollout_manager = AgentLoopManager.create(
            config=self.config,
            llm_client=self.llm_server_manager.get_client(),
            teacher_client=None,
            reward_loop_worker_handles=reward_loop_worker_handles,
        )

        checkpoint_engine_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
        checkpoint_manager_class_fqn = self.config.actor_rollout_ref.rollout.get("checkpoint_manager_class")
        if checkpoint_manager_class_fqn:
            CheckpointEngineManager = load_class_from_fqn(checkpoint_manager_class_fqn, "CheckpointEngineManager")
        else:
            from verl.checkpoint_engine import CheckpointEngineManager
        self.checkpoint_manager = CheckpointEngineManager(
            config=checkpoint_engine_config,
            actor_wg=self.actor_rollout_wg,
            replicas=self.llm_server_manager.get_replicas(),
        )
        self.checkpoint_manager.sleep_replicas()

    # ---- harness helpers (not used by fit) ----------------------------------------------------
    def standin_actor_handles(self) -> List[Any]:
        """Every Ray actor this trainer started (for teardown on a shared cluster)."""
        handles: List[Any] = []
        manager = getattr(self, "async_rollout_manager", None)
        handles += list(getattr(manager, "agent_loop_workers", []) or [])
        handles += list(getattr(getattr(self, "reward_loop_manager", None), "reward_loop_workers", []) or [])
        llm = getattr(self, "llm_server_manager", None)
        if llm is not None:
            handles += [s for r in getattr(llm, "rollout_replicas", []) for s in r.servers]
            if getattr(llm, "global_load_balancer", None) is not None:
                handles.append(llm.global_load_balancer)
        return handles

    def server_stats(self) -> List[Dict[str, Any]]:
        import ray

        llm = getattr(self, "llm_server_manager", None)
        servers = [s for r in getattr(llm, "rollout_replicas", []) for s in r.servers] if llm else []
        return ray.get([s.get_stats.remote() for s in servers]) if servers else []


class RayPPOTrainerWithStandIns(_StandInWorkers, _trainer_base()):  # type: ignore[misc]
    """verl's ``RayPPOTrainer`` (v0) with CPU stand-ins wired by ``init_workers`` only."""


def _separation_base():
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer

    return SeparateRayPPOTrainer


TRAINER_CLASSES = ("RayPPOTrainer", "SeparateRayPPOTrainer")


def trainer_class(name: str) -> type:
    """``RayPPOTrainer`` or verl's experimental disaggregated ``SeparateRayPPOTrainer``, with
    the stand-in ``init_workers``."""
    if name == "RayPPOTrainer":
        return RayPPOTrainerWithStandIns
    if name == "SeparateRayPPOTrainer":
        class SeparateRayPPOTrainerWithStandIns(_StandInWorkers, _separation_base()):  # type: ignore[misc]
            """verl's ``SeparateRayPPOTrainer`` (its own fit / fit_step / _fit_* step) with
            CPU stand-ins wired by ``init_workers`` only."""

        return SeparateRayPPOTrainerWithStandIns
    raise ValueError(f"trainer_class must be one of {TRAINER_CLASSES}, got {name!r}")


def build_trainer(config: Any, *, server_cls: Any = None, server_kwargs: Optional[dict] = None,
                  trainer: str = "RayPPOTrainer"):
    """Construct the trainer the way verl's v0 ``TaskRunner.run`` does (minus GPU worker classes)."""
    from omegaconf import OmegaConf

    from verl.trainer.ppo.ray_trainer import ResourcePoolManager
    from verl.trainer.ppo.utils import Role, create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.workers.config import HFModelConfig

    from otel_verl.demo.workers_standin import ActorRolloutRefWorkerGroupStandIn, CriticWorkerGroupStandIn

    OmegaConf.resolve(config)
    use_ref, use_critic = need_reference_policy(config), need_critic(config)
    validate_config(config=config, use_reference_policy=use_ref, use_critic=use_critic)

    role = Role.ActorRolloutRef if use_ref else Role.ActorRollout
    role_worker_mapping: Dict[Any, Any] = {role: ActorRolloutRefWorkerGroupStandIn}
    mapping: Dict[Any, str] = {role: "global_pool"}
    if use_critic:
        role_worker_mapping[Role.Critic] = CriticWorkerGroupStandIn
        mapping[Role.Critic] = "global_pool"
    config.reward.reward_model.nnodes = config.trainer.nnodes
    config.reward.reward_model.n_gpus_per_node = config.trainer.n_gpus_per_node
    resource_pool_manager = ResourcePoolManager(
        resource_pool_spec={"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes}, mapping=mapping
    )

    model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    tokenizer, processor = model_config.tokenizer, model_config.processor
    train_dataset = create_rl_dataset(
        config.data.train_files, config.data, tokenizer, processor, is_train=True,
        max_samples=config.data.get("train_max_samples", -1),
    )
    val_dataset = create_rl_dataset(
        config.data.val_files, config.data, tokenizer, processor, is_train=False,
        max_samples=config.data.get("val_max_samples", -1),
    )
    return trainer_class(trainer)(
        config=config,
        tokenizer=tokenizer,
        processor=processor,
        role_worker_mapping=role_worker_mapping,
        resource_pool_manager=resource_pool_manager,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        collate_fn=collate_fn,
        train_sampler=create_rl_sampler(config.data, train_dataset),
        server_cls=server_cls,
        server_kwargs=server_kwargs,
    )


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------
def _fit(
    config: Any, *, server: str, server_kwargs: dict, file_log: str, on_fit: Optional[Callable[[Any, str], Any]] = None,
    phase_log: Optional[str] = None, trainer_class: str = "RayPPOTrainer",
) -> Dict[str, Any]:
    """Build the trainer, run init_workers and fit, collect what the summary needs. Runs where the trainer lives."""
    timings: Dict[str, float] = {}
    note_phase(phase_log, f"building verl's {trainer_class}: dataset, tokenizer, config check")
    t = time.time()
    trainer = build_trainer(config, server_cls=_server_choice(server), server_kwargs=server_kwargs, trainer=trainer_class)
    timings["build_trainer_s"] = time.time() - t
    previous = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = file_log
    try:
        note_phase(phase_log, "starting the workers: LLM servers, agent loop workers, reward workers (init_workers)")
        t = time.time()
        trainer.init_workers()
        timings["init_workers_s"] = time.time() - t
        if on_fit is not None:
            on_fit(trainer, "start")
        note_phase(phase_log, f"training: step 1 of {config.trainer.total_training_steps}")
        t = time.time()
        trainer.fit()
        timings["fit_s"] = time.time() - t
        note_phase(phase_log, "training done; stopping the workers")
        on_fit_result = on_fit(trainer, "end") if on_fit is not None else None
        result: Dict[str, Any] = {
            "timings": timings,
            "server_stats": trainer.server_stats(),
            "worker_group_calls": dict(trainer.actor_rollout_wg.calls),
            "weight_versions": list(trainer.actor_rollout_wg.weight_versions),
            "critic_calls": dict(trainer.critic_wg.calls) if getattr(trainer, "critic_wg", None) is not None else {},
            "final_global_steps": trainer.global_steps,
            "on_fit": on_fit_result,
        }
    finally:
        if previous is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = previous
        # RewardLoopManager names its workers reward_loop_worker_{i} (verl 0.9.1, reward_loop.py)
        num_reward_workers = int(config.reward.get("num_workers", 0) or 0)
        _kill(trainer.standin_actor_handles(), [f"reward_loop_worker_{i}" for i in range(num_reward_workers)])
    return result


class TaskRunnerStandIn:
    """Hosts the trainer inside a Ray actor, like verl's ``TaskRunner`` (``trainer_in_actor=True``)."""

    def run(
        self, config: Any, server: str, server_kwargs: dict, file_log: str, on_fit: Optional[Callable[[Any, str], Any]] = None,
        phase_log: Optional[str] = None, **fit_kwargs: Any,
    ) -> Dict[str, Any]:
        return _fit(config, server=server, server_kwargs=server_kwargs, file_log=file_log, on_fit=on_fit,
                    phase_log=phase_log, **fit_kwargs)


def run_v0(
    output_dir: str,
    *,
    steps: int = 2,
    prompts: int = 4,
    n: int = 4,
    agent: str = "single",
    validate: bool = True,
    on_ray_init: Optional[Callable[[], Any]] = None,
    runtime_env: Optional[dict] = None,
    agent_workers: int = 2,
    num_cpus: int = DEFAULT_NUM_CPUS,
    server: str = "standin",
    latency_s: float = 0.05,
    adv_estimator: str = "grpo",
    model_dir: Optional[str] = None,
    overrides: Sequence[str] = (),
    trainer_in_actor: bool = False,
    keep_ray: bool = False,
    log_to_driver: bool = False,
    agent_name: Optional[str] = None,
    agent_loop_config_path: Optional[str] = None,
    on_fit: Optional[Callable[[Any, str], Any]] = None,
    trainer_class: str = "RayPPOTrainer",
) -> Dict[str, Any]:
    """Run verl's v0 ``RayPPOTrainer.fit`` on CPU and return a summary dict.

    Args:
        output_dir: where data, tool config, metrics (``metrics.jsonl``), rollout / validation
            dumps, the tool-call log and ``summary.json`` go (cleared first).
        steps, prompts, n: training steps, prompts per step (``train_batch_size``), samples per
            prompt (``rollout.n``); each step runs ``prompts * n`` trajectories.
        agent: ``"single"`` (``SingleTurnAgentLoop``) or ``"tool"`` (``ToolAgentLoop`` + calculator).
        validate: one validation pass, at the last step (``test_freq=steps``).
        on_ray_init: called with no arguments once Ray is up, in this process, before any
            verl object is built.
        runtime_env: merged into ``ray.init``'s runtime env when this call starts Ray (e.g.
            ``{"worker_process_setup_hook": "pkg.mod:fn", "env_vars": {...}}``); ignored, with
            the summary saying so, when Ray is already running (the caller's cluster is used).
        agent_workers: ``rollout.agent.num_workers``.
        server: ``"standin"`` (:class:`LLMServerStandIn`) or ``"sglang"`` (verl's real
            ``SGLangHttpServer.generate`` over a stand-in engine).
        latency_s: simulated engine latency per request.
        adv_estimator: ``grpo`` (default), ``gae`` (adds the critic stand-in) or any other
            critic-free estimator of verl's, e.g. ``remax`` (fit adds one greedy baseline row
            per prompt, ``__do_sample__=False``, to the same generate_sequences call).
        model_dir: stand-in model directory (default: the user cache, built on first use).
        overrides: extra Hydra overrides, applied last.
        trainer_in_actor: host the trainer in a Ray actor (like verl's TaskRunner) instead of here.
        keep_ray: leave a cluster this call started running.
        agent_name: run this registered agent loop instead of ``agent``'s (the data rows'
            ``agent_name`` and ``rollout.agent.default_agent_loop``); the prompts stay
            ``agent``'s. For a custom loop give ``agent_loop_config_path`` too, and make its
            module importable in Ray workers (``runtime_env={"env_vars": {"PYTHONPATH": ...}}``).
        agent_loop_config_path: ``rollout.agent.agent_loop_config_path`` (a YAML list of
            ``{name, _target_}``, loaded by verl's ``AgentLoopWorker``).
        on_fit: called where the trainer lives as ``on_fit(trainer, "start")`` right before
            ``fit()`` and ``on_fit(trainer, "end")`` right after it (actors still alive); the
            second call's return value is ``summary["on_fit"]``. Must pickle by reference
            (a module-level function) when ``trainer_in_actor``.
        trainer_class: ``RayPPOTrainer`` or verl's experimental ``SeparateRayPPOTrainer``
            (disaggregated layout: its own ``fit`` / ``fit_step`` / ``_fit_*`` step).
    """
    t_start = time.time()
    if trainer_class not in TRAINER_CLASSES:
        raise ValueError(f"trainer_class must be one of {TRAINER_CLASSES}, got {trainer_class!r}")
    if agent not in ("single", "tool"):
        raise ValueError(f"agent must be 'single' or 'tool', got {agent!r}")
    out = prepare_output_dir(output_dir)
    phase_log = os.path.join(out, PHASES_FILE)
    note_phase(phase_log, "preparing the stand-in model, the data and verl's config")

    t = time.time()
    model_dir, train_path, val_path, tool_config_path, _tool_log = prepare_inputs(
        out, agent=agent, prompts=prompts, steps=steps, model_dir=model_dir, agent_name=agent_name
    )
    overrides_all = harness_overrides(
        model_dir=model_dir, train_files=train_path, val_files=val_path, output_dir=out, steps=steps,
        prompts=prompts, n=n, agent=agent, validate=validate, agent_workers=agent_workers,
        tool_config_path=tool_config_path, adv_estimator=adv_estimator, agent_name=agent_name,
        agent_loop_config_path=agent_loop_config_path,
    ) + list(overrides)
    config = build_config(overrides_all)
    prepare_s = time.time() - t

    fit_result, started_ray, ray_init_s = start_ray_and_fit(
        label="run_v0", config=config, fit=_fit, runner_cls=TaskRunnerStandIn, runtime_env=runtime_env,
        on_ray_init=on_ray_init, num_cpus=num_cpus, log_to_driver=log_to_driver, keep_ray=keep_ray,
        trainer_in_actor=trainer_in_actor, file_log=os.path.join(out, "metrics.jsonl"), server=server,
        server_kwargs={"latency_s": latency_s}, on_fit=on_fit, phase_log=phase_log,
        fit_kwargs={"trainer_class": trainer_class},
    )

    summary = summarize(out, fit_result, agent=agent, steps=steps, prompts=prompts, n=n)
    summary["timings"].update({"prepare_s": prepare_s, "ray_init_s": ray_init_s, "total_s": time.time() - t_start})
    summary["ray"] = {"started_by_harness": started_ray, "runtime_env_applied": started_ray or not runtime_env}
    summary["config"] = {
        "agent": agent, "steps": steps, "prompts": prompts, "n": n, "validate": validate,
        "agent_workers": agent_workers, "server": server, "adv_estimator": adv_estimator,
        "trainer_in_actor": trainer_in_actor, "model_dir": model_dir, "overrides": overrides_all,
        "agent_name": agent_name, "agent_loop_config_path": agent_loop_config_path, "trainer_class": trainer_class,
    }
    summary["on_fit"] = fit_result.get("on_fit")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------
def summarize(out: str, fit_result: Dict[str, Any], *, agent: str, steps: int, prompts: int, n: int) -> Dict[str, Any]:
    """Read verl's outputs (file logger, rollout/validation dumps) and the tool log into a summary."""
    metric_rows = _read_jsonl(os.path.join(out, "metrics.jsonl"))
    train_rows = [r for r in metric_rows if "training/global_step" in r["data"]]
    keep = (
        "critic/score/mean", "critic/score/min", "critic/score/max", "response_length/mean",
        "response_length/max", "num_turns/mean", "num_turns/min", "num_turns/max", "actor/pg_loss",
        "actor/kl_loss", "actor/entropy", "timing_s/step", "timing_s/gen", "critic/advantages/max",
    )
    metrics_per_step = {
        int(r["step"]): {k: v for k, v in r["data"].items() if k in keep or k.startswith(("val-core/", "val-aux/"))}
        for r in train_rows
    }
    trajectories: Dict[int, int] = {}
    scores: Dict[int, Dict[str, Any]] = {}
    tool_call_texts: Dict[int, int] = {}
    for path in sorted(glob.glob(os.path.join(out, "rollout", "*.jsonl"))):
        step = int(os.path.splitext(os.path.basename(path))[0])
        rows = _read_jsonl(path)
        trajectories[step] = len(rows)
        values = [float(r["score"]) for r in rows]
        scores[step] = {
            "mean": sum(values) / len(values) if values else None,
            "distinct": sorted(set(values)),
            "nonzero": sum(1 for v in values if v),
        }
        tool_call_texts[step] = sum(1 for r in rows if "<tool_call>" in r["output"] and "<tool_response>" in r["output"])
    val_rows: List[dict] = []
    for path in sorted(glob.glob(os.path.join(out, "validation", "*.jsonl"))):
        val_rows += _read_jsonl(path)
    val_metrics = {k: v for r in train_rows for k, v in r["data"].items() if k.startswith("val-core/")}
    tool_calls = _read_jsonl(os.path.join(out, "tool_calls.jsonl"))
    server_stats = fit_result.get("server_stats", [])
    return {
        "agent": agent,
        "steps_requested": steps,
        "steps_run": len(train_rows),
        "global_steps": [int(r["step"]) for r in train_rows],
        "expected_trajectories_per_step": prompts * n,
        "trajectories_per_step": trajectories,
        "scores_per_step": scores,
        "metrics_per_step": metrics_per_step,
        "validation": {
            "ran": bool(val_rows) or bool(val_metrics),
            "passes": len(glob.glob(os.path.join(out, "validation", "*.jsonl"))),
            "trajectories": len(val_rows),
            "metrics": val_metrics,
        },
        "tool": {
            "calls": len(tool_calls),
            "ok_calls": sum(1 for c in tool_calls if c.get("ok")),
            "worker_pids": sorted({c["pid"] for c in tool_calls}),
            "trajectories_with_tool_roundtrip": tool_call_texts,
        },
        "server": {
            "requests": sum(s.get("requests", 0) for s in server_stats),
            "tool_call_outputs": sum(s.get("tool_call_outputs", 0) for s in server_stats),
            "second_turn_requests": sum(s.get("tool_response_prompts", 0) for s in server_stats),
            "per_server": server_stats,
        },
        "worker_group_calls": fit_result.get("worker_group_calls", {}),
        "critic_calls": fit_result.get("critic_calls", {}),
        "weight_versions": fit_result.get("weight_versions", []),
        "timings": dict(fit_result.get("timings", {})),
        "paths": {
            "output_dir": out,
            "metrics": os.path.join(out, "metrics.jsonl"),
            "rollout_dumps": os.path.join(out, "rollout"),
            "validation_dumps": os.path.join(out, "validation"),
            "tool_calls": os.path.join(out, "tool_calls.jsonl"),
            "summary": os.path.join(out, "summary.json"),
        },
    }


def format_summary(summary: Dict[str, Any]) -> str:
    t = summary["timings"]
    lines = [
        f"agent={summary['agent']} steps run={summary['steps_run']}/{summary['steps_requested']} "
        f"global_steps={summary['global_steps']}",
        f"trajectories per step={summary['trajectories_per_step']} (expected {summary['expected_trajectories_per_step']})",
        "mean score per step=" + json.dumps({k: v["mean"] for k, v in summary["scores_per_step"].items()}),
        f"validation: ran={summary['validation']['ran']} passes={summary['validation']['passes']} "
        f"trajectories={summary['validation']['trajectories']} metrics={summary['validation']['metrics']}",
        f"llm requests={summary['server']['requests']} tool-call outputs={summary['server']['tool_call_outputs']} "
        f"second-turn requests={summary['server']['second_turn_requests']} tool executions={summary['tool']['calls']}",
        "wall time: " + ", ".join(f"{k}={v:.1f}s" for k, v in t.items()),
        f"outputs in {summary['paths']['output_dir']}",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m otel_verl.demo.harness",
        description="Run verl's real v0 PPO loop on CPU with stand-ins for the GPU parts.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--agent", choices=("single", "tool"), default="single")
    parser.add_argument("--no-validate", action="store_true")
    parser.add_argument("--agent-workers", type=int, default=2)
    parser.add_argument("--server", choices=SERVER_KINDS, default="standin")
    parser.add_argument("--adv-estimator", default="grpo")
    parser.add_argument("--latency", type=float, default=0.05, help="simulated engine latency per request (s)")
    parser.add_argument("--agent-name", default=None, help="registered agent loop to run (rows' agent_name)")
    parser.add_argument("--agent-loop-config-path", default=None, help="YAML of custom agent loops")
    parser.add_argument("--trainer-in-actor", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="stream Ray worker logs")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value)")
    args = parser.parse_args(argv)
    summary = run_v0(
        args.out, steps=args.steps, prompts=args.prompts, n=args.n, agent=args.agent,
        validate=not args.no_validate, agent_workers=args.agent_workers, server=args.server,
        adv_estimator=args.adv_estimator, latency_s=args.latency, overrides=args.overrides,
        trainer_in_actor=args.trainer_in_actor, log_to_driver=args.verbose, agent_name=args.agent_name,
        agent_loop_config_path=args.agent_loop_config_path,
    )
    print("=" * 80)
    print(format_summary(summary))
    ok = summary["steps_run"] == args.steps and all(
        v == summary["expected_trajectories_per_step"] for v in summary["trajectories_per_step"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
