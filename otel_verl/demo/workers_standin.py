"""CPU stand-ins for the GPU side of verl's v0 trainer, and the rollout replica stand-in.

``RayPPOTrainer.fit`` (verl/trainer/ppo/ray_trainer.py) drives GPU worker groups through a
handful of methods. On a CPU-only machine those worker groups (FSDP/Megatron
``ActorRolloutRefWorker`` / ``TrainingWorker`` actors) cannot start, so the harness hands the
trainer objects with the same methods that compute correctly shaped outputs with torch on
CPU. Only these are stand-ins; the trainer's own code around them (``_compute_old_log_prob``,
``_compute_ref_log_prob``, ``_compute_values``, ``_update_actor``, ``_update_critic``,
padding <-> no-padding conversion, ``compute_advantage``, metrics) is verl's, unchanged.

* :class:`ActorRolloutRefWorkerGroupStandIn` stands for the ``RayWorkerGroup`` of
  ``ActorRolloutRefWorker`` (verl/workers/engine_workers.py): ``init_model``,
  ``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``, ``update_weights``,
  ``save_checkpoint`` / ``load_checkpoint``, ``start_profile`` / ``stop_profile`` and the
  dispatch-info query ``_query_dispatch_info`` that ``RayPPOTrainer._balance_batch`` uses.
  Log-probs and entropies are deterministic pseudo-random values (a seeded
  ``torch.Generator``) laid out as the jagged (no-padding) tensors the real worker returns;
  ``update_actor`` computes a PPO-clip loss, clip fraction, KL and KL loss from the batch's
  advantages and log-probs (a simulated policy step, no model), reported like the real
  worker (``actor/pg_loss``, ``grad_norm``, ``lr``, ``mfu``, ...).
  ``update_weights(global_steps, mode="naive")`` is what verl's real
  ``CheckpointEngineManager.update_weights`` calls for the default ``naive`` backend; like
  the real hybrid worker's ServerAdapter it resumes the rollout server's weights, sets its
  ``global_steps`` and resumes its KV cache (here on the bound :class:`LLMServerStandIn`
  actors), so verl's checkpoint manager itself stays real.
* :class:`CriticWorkerGroupStandIn` stands for the critic ``TrainingWorker`` group
  (``reset``, ``set_loss_fn``, ``infer_batch``, ``train_mini_batch``; the last two return a
  future-like object with ``.get()`` as the real non-blocking methods do). Used only with
  ``adv_estimator=gae``.
* :class:`RolloutReplicaStandIn` is a real ``RolloutReplica`` subclass (verl's own
  ``init_hybrid``, ``sleep``, ``wake_up``, ... stay) whose ``launch_servers`` starts an
  :class:`LLMServerStandIn` actor instead of an sglang/vLLM server.
* :class:`LLMServerManagerStandIn` is verl's ``LLMServerManager`` with
  ``rollout_replica_class`` set to the replica stand-in (the attribute verl leaves open "for
  recipe to change"); replica creation, the ``GlobalRequestLoadBalancer`` made by
  ``get_router_handle`` and ``get_client()`` (``LLMServerClient``) are verl's.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
import zlib
from typing import Any, Dict, List, Optional

import ray
import torch

from verl.utils import tensordict_utils as tu
from verl.workers.rollout.llm_server import LLMServerManager
from verl.workers.rollout.replica import RolloutReplica

from otel_verl.demo.llm_server_standin import LLMServerStandIn


class _ResolvedFuture:
    """What the real non-blocking worker-group methods return: ``.get()`` gives the output."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def get(self) -> Any:
        return self._value


class RankStandIn:
    """Stands for one worker actor handle of a GPU worker group (``worker_group.workers[i]``).

    ``RolloutReplica.init_hybrid`` slices these out of the worker group, like real worker
    handles; :class:`RolloutReplicaStandIn` binds its server to them, standing for the
    ServerAdapter inside a real hybrid worker that finds its rollout server by name.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rollout_servers: List[Any] = []

    def bind_rollout_server(self, handle: Any) -> None:
        self.rollout_servers.append(handle)

    def __repr__(self) -> str:
        return f"RankStandIn(rank={self.rank})"


def _cfg_get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def _positions(offsets: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.arange(int(n)) for n in offsets.diff().tolist()]) if len(offsets) > 1 else torch.zeros(0)


class ActorRolloutRefWorkerGroupStandIn:
    """CPU stand-in for the actor/rollout/ref ``RayWorkerGroup`` (see the module docstring)."""

    def __init__(self, config: Any, world_size: int = 1, *, seed: int = 0, compute_delay_s: float = 0.0) -> None:
        self.config = config
        self.world_size = int(world_size)
        self.workers = [RankStandIn(rank) for rank in range(self.world_size)]
        self._dispatch_info: Dict[str, List[int]] = {}
        self.seed = int(seed)
        self.compute_delay_s = float(compute_delay_s)
        self.calls: Dict[str, int] = {}
        self.weight_versions: List[Optional[int]] = []
        self.checkpoints: List[str] = []
        self._lr = float(_cfg_get(config, "actor_rollout_ref.actor.optim.lr", 1e-6))
        self._clip = float(_cfg_get(config, "actor_rollout_ref.actor.clip_ratio", 0.2) or 0.2)
        self._kl_coef = float(_cfg_get(config, "actor_rollout_ref.actor.kl_loss_coef", 0.001) or 0.0)
        self._use_kl_loss = bool(_cfg_get(config, "actor_rollout_ref.actor.use_kl_loss", False))

    # ---- bookkeeping ----------------------------------------------------------------------
    def _count(self, name: str) -> int:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.compute_delay_s:
            time.sleep(self.compute_delay_s)
        return self.calls[name]

    def _generator(self, name: str, call: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode()) * 101 + call) % (2**63 - 1))
        return g

    def _query_dispatch_info(self, mesh_name: str) -> List[int]:
        """dp rank of each rank for ``mesh_name`` (all ranks data-parallel here)."""
        return list(range(self.world_size))

    # ---- RayWorkerGroup / ActorRolloutRefWorker surface --------------------------------------
    def init_model(self) -> None:
        self._count("init_model")

    def _pseudo_log_probs(self, data: Any, name: str):
        input_ids = data["input_ids"]
        offsets = input_ids.offsets()
        values = input_ids.values()
        g = self._generator(name, self._count(name))
        noise = torch.randn(values.shape[0], generator=g)
        log_probs = -torch.nn.functional.softplus(noise - 1.0)  # in (-inf, 0), mostly small
        entropy = 0.5 + torch.rand(values.shape[0], generator=g)
        return (
            torch.nested.nested_tensor_from_jagged(log_probs.float(), offsets=offsets),
            torch.nested.nested_tensor_from_jagged(entropy.float(), offsets=offsets),
        )

    def compute_log_prob(self, data: Any) -> Any:
        """Old log-probs (and entropy) per token, as jagged tensors aligned with ``input_ids``."""
        log_probs, entropy = self._pseudo_log_probs(data, "compute_log_prob")
        tensors: Dict[str, Any] = {"log_probs": log_probs}
        if tu.get_non_tensor_data(data, "calculate_entropy", False):
            tensors["entropy"] = entropy
        return tu.get_tensordict(tensors, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def compute_ref_log_prob(self, data: Any) -> Any:
        log_probs, _ = self._pseudo_log_probs(data, "compute_ref_log_prob")
        return tu.get_tensordict({"log_probs": log_probs}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def update_actor(self, data: Any) -> Any:
        """A simulated PPO-clip step: loss terms from the batch, metrics shaped like the real worker's."""
        call = self._count("update_actor")
        g = self._generator("update_actor", call)
        mask = data["response_mask"].float()
        adv = data["advantages"].float()
        old = data["old_log_probs"].float()
        new = old + 0.01 * torch.randn(old.shape, generator=g)
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1.0 - self._clip, 1.0 + self._clip)
        losses = torch.maximum(-adv * ratio, -adv * clipped)
        denom = mask.sum().clamp(min=1.0)

        def mmean(x: torch.Tensor) -> float:
            return float((x * mask).sum() / denom)

        mini_batch_size = int(tu.get_non_tensor_data(data, "mini_batch_size", mask.shape[0]) or mask.shape[0])
        epochs = int(tu.get_non_tensor_data(data, "epochs", 1) or 1)
        num_updates = max(1, mask.shape[0] // max(1, mini_batch_size)) * epochs
        pg_loss = mmean(losses)
        metrics: Dict[str, Any] = {
            "actor/pg_loss": [pg_loss] * num_updates,
            "actor/pg_clipfrac": [mmean((clipped != ratio).float())] * num_updates,
            "actor/ppo_kl": [mmean(old - new)] * num_updates,
            "actor/pg_clipfrac_lower": [0.0] * num_updates,
            "loss": pg_loss,
            "grad_norm": float(adv.abs().mean()) + 0.1,
            "lr": self._lr,
            "mfu": 0.0,
            "perf/max_memory_allocated_gb": 0.0,
            "perf/max_memory_reserved_gb": 0.0,
            "perf/cpu_memory_used_gb": 0.0,
        }
        if self._use_kl_loss and "ref_log_prob" in data.keys():
            ref = data["ref_log_prob"].float()
            metrics["kl_loss"] = [mmean(torch.exp(ref - new) - (ref - new) - 1.0)] * num_updates
            metrics["kl_coef"] = self._kl_coef
        return tu.get_tensordict({}, non_tensor_dict={"metrics": metrics})

    def update_weights(self, global_steps: Optional[int] = None, mode: str = "auto") -> List[Any]:
        """Weight sync trainer -> rollout, as the hybrid worker's ServerAdapter does it.

        Returns the Ray object refs of the last stage, like the real non-blocking ONE_TO_ALL call.
        """
        self._count("update_weights")
        self.weight_versions.append(global_steps)
        servers = [s for w in self.workers for s in w.rollout_servers]
        ray.get([s.resume_memory_occupation.remote(["weights"]) for s in servers])
        ray.get([s.set_global_steps.remote(global_steps) for s in servers])
        return [s.resume_memory_occupation.remote(["kv_cache"]) for s in servers]

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None) -> None:
        self._count("save_checkpoint")
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, "STANDIN_CHECKPOINT.json"), "w") as f:
            json.dump({"global_step": global_step, "standin": type(self).__name__}, f)
        self.checkpoints.append(local_path)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False) -> None:
        self._count("load_checkpoint")

    def start_profile(self, **kwargs: Any) -> None:
        self._count("start_profile")

    def stop_profile(self, **kwargs: Any) -> None:
        self._count("stop_profile")

    def execute_checkpoint_engine(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "the CPU harness supports only checkpoint_engine.backend=naive (in-process weight sync)"
        )


class CriticWorkerGroupStandIn:
    """CPU stand-in for the critic ``TrainingWorker`` group (used with ``adv_estimator=gae``)."""

    def __init__(self, config: Any, world_size: int = 1, *, seed: int = 1) -> None:
        self.config = config
        self.world_size = int(world_size)
        self.workers = [RankStandIn(rank) for rank in range(self.world_size)]
        self._dispatch_info: Dict[str, List[int]] = {}
        self.calls: Dict[str, int] = {}
        self.loss_fn = None
        self.seed = int(seed)
        self._lr = float(_cfg_get(config, "critic.optim.lr", 1e-5))

    def _count(self, name: str) -> int:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.calls[name]

    def _query_dispatch_info(self, mesh_name: str) -> List[int]:
        return list(range(self.world_size))

    def reset(self) -> None:
        self._count("reset")

    def set_loss_fn(self, loss_fn: Any) -> None:
        self._count("set_loss_fn")
        self.loss_fn = loss_fn

    def infer_batch(self, data: Any) -> _ResolvedFuture:
        call = self._count("infer_batch")
        input_ids = data["input_ids"]
        g = torch.Generator()
        g.manual_seed(self.seed * 7919 + call)
        values = 0.1 * torch.randn(input_ids.values().shape[0], generator=g)
        nested = torch.nested.nested_tensor_from_jagged(values.float(), offsets=input_ids.offsets())
        return _ResolvedFuture(tu.get_tensordict({"values": nested}, non_tensor_dict={"metrics": {"mfu": 0.0}}))

    def train_mini_batch(self, data: Any) -> _ResolvedFuture:
        self._count("train_mini_batch")
        mask = data["response_mask"].float()
        denom = mask.sum().clamp(min=1.0)
        returns, values = data["returns"].float(), data["values"].float()
        vf_loss = float((((values - returns) ** 2) * mask).sum() / denom) * 0.5
        metrics = {
            "critic/vf_loss": [vf_loss],
            "critic/vf_clipfrac": [0.0],
            "critic/vpred_mean": [float((values * mask).sum() / denom)],
            "grad_norm": 0.1,
            "lr": self._lr,
            "mfu": 0.0,
        }
        return _ResolvedFuture(tu.get_tensordict({}, non_tensor_dict={"metrics": metrics}))

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None) -> None:
        self._count("save_checkpoint")
        os.makedirs(local_path, exist_ok=True)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False) -> None:
        self._count("load_checkpoint")

    def start_profile(self, **kwargs: Any) -> None:
        self._count("start_profile")

    def stop_profile(self, **kwargs: Any) -> None:
        self._count("stop_profile")


class RolloutReplicaStandIn(RolloutReplica):
    """verl ``RolloutReplica`` whose ``launch_servers`` starts an :class:`LLMServerStandIn` actor.

    ``server_cls`` may be any class with ``LLMServerStandIn``'s constructor and methods (the
    harness also uses ``otel_verl.demo.sglang_standin.SGLangHttpServerStandIn``).
    """

    def __init__(self, *args: Any, server_cls: Any = None, server_kwargs: Optional[dict] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.server_cls = server_cls or LLMServerStandIn
        self.server_kwargs = dict(server_kwargs or {})

    async def init_standalone(self) -> None:
        """Standalone replica (v1 ``separate_async``): verl would create a GPU resource pool and a
        rollout worker group; here the "workers" are :class:`RankStandIn` handles."""
        from verl.workers.rollout.replica import RolloutMode

        self.rollout_mode = RolloutMode.STANDALONE
        self.workers = [RankStandIn(rank) for rank in range(self.world_size)]
        await self.launch_servers()

    async def launch_servers(self) -> None:
        name = f"llm_server_standin_{self.replica_rank}_{uuid.uuid4().hex[:8]}"
        server = (
            ray.remote(self.server_cls)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
                node_rank=0,
                **self.server_kwargs,
            )
        )
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"
        for worker in self.workers:
            if hasattr(worker, "bind_rollout_server"):
                worker.bind_rollout_server(server)


class LLMServerManagerStandIn(LLMServerManager):
    """verl's ``LLMServerManager`` with the replica class set to :class:`RolloutReplicaStandIn`."""

    def __init__(self, *args: Any, server_cls: Any = None, server_kwargs: Optional[dict] = None, **kwargs: Any):
        # LLMServerManager.__init__ only picks a replica class if none is set ("for recipe to change").
        self.rollout_replica_class = functools.partial(
            RolloutReplicaStandIn, server_cls=server_cls, server_kwargs=server_kwargs
        )
        super().__init__(*args, **kwargs)
