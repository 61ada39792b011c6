"""Pieces shared by the CPU harnesses (:mod:`otel_verl.demo.harness` for verl's v0 trainer,
:mod:`otel_verl.demo.harness_v1` for the v1 trainer): the Hydra config built from the installed
verl, the local Ray cluster, the LLM-server stand-in choice and small helpers. No tracing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

DEFAULT_NUM_CPUS = 2
PROMPT_LENGTH = 512
RESPONSE_LENGTH = 128
VAL_SIZE = 4
PROJECT_NAME = "otel_verl_demo"
SERVER_KINDS = ("standin", "sglang")
PHASES_FILE = "phases.jsonl"  # what the harness is doing (otel_verl.demo.progress)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
def verl_config_dir() -> str:
    import verl.trainer

    return os.path.join(os.path.dirname(os.path.abspath(verl.trainer.__file__)), "config")


def _quoted(path: str) -> str:
    """A path as one Hydra override value: a path with spaces or quotes is quoted."""
    from otel_verl.activation import hydra_quote

    return hydra_quote(path)


def harness_overrides(
    *,
    model_dir: str,
    train_files: str,
    val_files: str,
    output_dir: str,
    steps: int,
    prompts: int,
    n: int,
    agent: str,
    validate: bool,
    agent_workers: int,
    tool_config_path: Optional[str],
    adv_estimator: str = "grpo",
    experiment_name: str = "cpu_harness",
    agent_name: Optional[str] = None,
    agent_loop_config_path: Optional[str] = None,
    use_v1: bool = False,
    ppo_mini_batch_prompts: Optional[int] = None,
) -> List[str]:
    """Hydra overrides that turn verl's ``ppo_trainer`` config into the CPU harness config.

    ``use_v1`` selects verl's v1 trainer (``trainer.use_v1``); the v1 harness adds its own
    ``trainer.v1.*`` / ``transfer_queue.*`` overrides. ``ppo_mini_batch_prompts`` sets
    ``actor.ppo_mini_batch_size`` (default: ``prompts``, one mini-batch per step).
    """
    micro = max(1, min(4, prompts * n))
    overrides = [
        f"algorithm.adv_estimator={adv_estimator}",
        f"data.train_files={_quoted(train_files)}",
        f"data.val_files={_quoted(val_files)}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={PROMPT_LENGTH}",
        f"data.max_response_length={RESPONSE_LENGTH}",
        "data.dataloader_num_workers=0",
        "data.filter_overlong_prompts=False",
        "data.seed=0",
        f"actor_rollout_ref.model.path={_quoted(model_dir)}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ppo_mini_batch_prompts or prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        # The stand-in servers mirror SGLangHttpServer.generate; with name=sglang LLMServerClient
        # calls them exactly as it calls the real one.
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        f"actor_rollout_ref.rollout.agent.num_workers={agent_workers}",
        "actor_rollout_ref.rollout.agent.default_agent_loop="
        + (agent_name or ("tool_agent" if agent == "tool" else "single_turn_agent")),
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "reward.num_workers=1",
        f"trainer.use_v1={bool(use_v1)}",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1000",
        "trainer.logger=[console,file]",
        f"trainer.project_name={PROJECT_NAME}",
        f"trainer.experiment_name={experiment_name}",
        "trainer.val_before_train=False",
        f"trainer.test_freq={steps if validate else -1}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.balance_batch=True",
        f"trainer.default_local_dir={_quoted(os.path.join(output_dir, 'checkpoints'))}",
        f"trainer.rollout_data_dir={_quoted(os.path.join(output_dir, 'rollout'))}",
        f"trainer.validation_data_dir={_quoted(os.path.join(output_dir, 'validation'))}",
    ]
    if adv_estimator == "gae":  # the critic (a stand-in too) reads the same stand-in model
        overrides += [
            f"critic.model.path={_quoted(model_dir)}",
            f"critic.model.tokenizer_path={_quoted(model_dir)}",
            f"critic.ppo_micro_batch_size_per_gpu={micro}",
        ]
    if agent_loop_config_path:  # custom agent loops (verl loads them in AgentLoopWorker.__init__)
        overrides.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path={_quoted(agent_loop_config_path)}")
    if agent == "tool":
        overrides += [
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={_quoted(tool_config_path)}",
        ]
    return overrides


def build_config(overrides: Sequence[str]):
    """``compose(config_name="ppo_trainer")`` from the installed verl with ``overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


# ---------------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------------
def ray_runtime_env(config: Any = None, extra: Optional[dict] = None) -> dict:
    """verl's ``get_ppo_ray_runtime_env`` merged with ``extra`` (``env_vars`` merged key by key)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    env = get_ppo_ray_runtime_env(config)
    env.setdefault("env_vars", {})
    env["env_vars"].setdefault("RAY_AUTH_MODE", "disabled")
    for key, value in (extra or {}).items():
        if key == "env_vars":
            env["env_vars"].update({k: str(v) for k, v in (value or {}).items()})
        else:
            env[key] = value
    return env


def init_ray(
    *, num_cpus: int = DEFAULT_NUM_CPUS, runtime_env: Optional[dict] = None, log_to_driver: bool = False, **kwargs: Any
) -> bool:
    """Start a local Ray cluster for the harness unless one is running; True if this call started it."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 token auth would write ~/.ray/auth_token
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        runtime_env=ray_runtime_env(None, runtime_env),
        **kwargs,
    )
    return True


def _set_agent_name(paths: Sequence[str], agent_name: str) -> None:
    """Point every row of these parquet files at the registered agent loop ``agent_name``."""
    import pandas as pd

    for path in paths:
        frame = pd.read_parquet(path)
        frame["agent_name"] = agent_name
        frame.to_parquet(path)


def start_ray_and_fit(
    *,
    label: str,
    config: Any,
    fit: Callable[..., Dict[str, Any]],
    runner_cls: type,
    runtime_env: Optional[dict],
    on_ray_init: Optional[Callable[[], Any]],
    num_cpus: int,
    log_to_driver: bool,
    keep_ray: bool,
    trainer_in_actor: bool,
    file_log: str,
    server: str,
    server_kwargs: Dict[str, Any],
    on_fit: Optional[Callable[..., Any]],
    phase_log: Optional[str] = None,
    fit_kwargs: Optional[Dict[str, Any]] = None,
) -> Tuple[Dict[str, Any], bool, float]:
    """Start (or join) the local Ray cluster, then run ``fit`` here or, like verl's
    TaskRunner, inside a ``runner_cls`` actor. Returns (fit result, whether this call
    started Ray, seconds ``ray.init`` took). ``phase_log``: where the phases go
    (:func:`otel_verl.demo.progress.note_phase`), from here and from ``fit``."""
    import ray

    from otel_verl.demo.progress import note_phase

    note_phase(phase_log, f"starting a local Ray cluster ({num_cpus} CPUs)")
    t = time.time()
    started_ray = init_ray(num_cpus=num_cpus, runtime_env=runtime_env, log_to_driver=log_to_driver)
    ray_init_s = time.time() - t
    if runtime_env and not started_ray:
        import warnings

        warnings.warn(f"Ray was already running: {label}'s runtime_env is not applied (the cluster's own is used)")
    if on_ray_init is not None:
        on_ray_init()
    try:
        if trainer_in_actor:
            note_phase(phase_log, f"starting the trainer's actor, as verl's TaskRunner (Ray took {ray_init_s:.0f}s)")
            runner = ray.remote(runner_cls).options(num_cpus=0).remote()
            try:
                fit_result = ray.get(runner.run.remote(config, server, server_kwargs, file_log, on_fit, phase_log,
                                                       **(fit_kwargs or {})))
            finally:
                _kill([runner])
        else:
            fit_result = fit(config, server=server, server_kwargs=server_kwargs, file_log=file_log, on_fit=on_fit,
                             phase_log=phase_log, **(fit_kwargs or {}))
    finally:
        if started_ray and not keep_ray:
            note_phase(phase_log, "shutting the local Ray cluster down")
            ray.shutdown()
    return fit_result, started_ray, ray_init_s


def _kill(handles: Sequence[Any], wait_names: Sequence[str] = (), timeout_s: float = 30.0) -> None:
    """Kill actors; wait until the named ones are gone so a next run on the same cluster can reuse the names."""
    import ray

    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass
    deadline = time.time() + timeout_s
    for name in wait_names:
        while time.time() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            time.sleep(0.1)


def _server_choice(server: str):
    if server == "standin":
        from otel_verl.demo.llm_server_standin import LLMServerStandIn

        return LLMServerStandIn
    if server == "sglang":
        from otel_verl.demo.sglang_standin import sglang_server_standin_class

        return sglang_server_standin_class()
    raise ValueError(f"server must be one of {SERVER_KINDS}, got {server!r}")


def _read_jsonl(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]



def prepare_output_dir(out: str) -> str:
    """Create ``out`` and remove what a previous harness run left in it (dumps, logs, summary)."""
    out = os.path.abspath(out)
    for sub in ("rollout", "validation", "checkpoints"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    for name in ("metrics.jsonl", "tool_calls.jsonl", "summary.json", PHASES_FILE):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    return out


def prepare_inputs(
    out: str, *, agent: str, prompts: int, steps: int, model_dir: Optional[str], agent_name: Optional[str]
) -> Tuple[str, str, str, Optional[str], str]:
    """Stand-in model, local parquet data and (for ``agent="tool"``) the tool config.

    Returns ``(model_dir, train_path, val_path, tool_config_path, tool_log)``.
    """
    from otel_verl.demo.data import write_dataset
    from otel_verl.demo.tiny_model import ensure_tiny_model
    from otel_verl.demo.tools import write_tool_config

    if agent not in ("single", "tool"):
        raise ValueError(f"agent must be 'single' or 'tool', got {agent!r}")
    model_dir = ensure_tiny_model(model_dir)
    train_path, val_path = write_dataset(
        os.path.join(out, "data"), agent=agent, train_size=max(16, prompts * steps), val_size=VAL_SIZE
    )
    if agent_name:
        _set_agent_name((train_path, val_path), agent_name)
    tool_log = os.path.join(out, "tool_calls.jsonl")
    tool_config_path = write_tool_config(os.path.join(out, "tools"), call_log=tool_log) if agent == "tool" else None
    return model_dir, train_path, val_path, tool_config_path, tool_log
