"""CPU stand-ins for the GPU side of verl's v1 trainer (``verl/trainer/ppo/v1``).

In v1 the trainer hands its worker groups a ``KVBatchMeta`` (TransferQueue keys + tags), not
data: verl's ``@register`` decorator wraps every worker method in
``verl.utils.transferqueue_utils.tqbridge``, which reads the fields from TransferQueue, calls
the method with a ``TensorDict`` and writes tensor outputs back to TransferQueue, returning a
``KVBatchMeta``. The stand-ins here keep that: their methods are wrapped in verl's real
``tqbridge`` (in the trainer's process instead of a GPU worker's), and compute what
:class:`~otel_verl.demo.workers_standin.ActorRolloutRefWorkerGroupStandIn` computes for v0.

* :class:`ActorRolloutRefWorkerGroupV1StandIn` stands for the actor/rollout/ref
  ``RayWorkerGroup`` of ``ActorRolloutRefWorker`` (sync, colocate_async) or of
  ``DetachActorWorker`` (separate_async: adds ``save_model_to_cpu`` /
  ``restore_model_from_cpu`` / ``clear_cpu_model``). It also records, for each
  ``update_actor``, which TransferQueue keys (and their tags) were trained in which trainer
  step, so the harness summary can show what the trainer consumed.
* :class:`CheckpointEngineStandIn` is registered in verl's ``CheckpointEngineRegistry`` as
  backend ``"standin"`` (loaded by verl itself through
  ``rollout.checkpoint_engine.custom_backend_module``); it stands for the NCCL/NIXL engines
  that separate_async requires (``backend != "naive"``).
* :class:`CheckpointEngineManagerStandIn` is verl's ``CheckpointEngineManager`` whose
  ``update_weights`` for a non-naive backend keeps verl's replica-side sequence (abort,
  release kv cache, ..., resume kv cache, resume generation) but replaces the GPU process
  group + NCCL broadcast (steps 2, 4-6) by setting the weight version on the standalone
  stand-in servers.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import ray

from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineRegistry, ColocatedCheckpointEngine
from verl.utils.ray_utils import auto_await
from verl.utils.transferqueue_utils import tqbridge

from otel_verl.demo.workers_standin import ActorRolloutRefWorkerGroupStandIn

STANDIN_CHECKPOINT_BACKEND = "standin"


class ActorRolloutRefWorkerGroupV1StandIn(ActorRolloutRefWorkerGroupStandIn):
    """CPU stand-in for the v1 actor/rollout/ref worker group (see the module docstring)."""

    def __init__(self, config: Any, world_size: int = 1, *, step_getter: Optional[Callable[[], int]] = None, **kw: Any):
        super().__init__(config, world_size, **kw)
        self.step_getter = step_getter
        self.trained: List[Dict[str, Any]] = []
        self.cpu_models: Dict[int, Optional[int]] = {}

    # verl's tqbridge: KVBatchMeta in -> TensorDict from TransferQueue -> outputs back to TQ
    @tqbridge()
    def compute_log_prob(self, data: Any) -> Any:
        return ActorRolloutRefWorkerGroupStandIn.compute_log_prob(self, data)

    @tqbridge()
    def compute_ref_log_prob(self, data: Any) -> Any:
        return ActorRolloutRefWorkerGroupStandIn.compute_ref_log_prob(self, data)

    @tqbridge()
    def _update_actor_td(self, data: Any) -> Any:
        # TransferQueue hands per-token fields over as jagged (nested) tensors; the simulated
        # PPO step works on padded ones (zero padding, masked by response_mask)
        for key in ("response_mask", "advantages", "old_log_probs", "ref_log_prob"):
            if key in data.keys() and getattr(data[key], "is_nested", False):
                data[key] = data[key].to_padded_tensor(0.0)
        return ActorRolloutRefWorkerGroupStandIn.update_actor(self, data)

    def update_actor(self, batch: Any) -> Any:
        tags = list(getattr(batch, "tags", []) or [])
        self.trained.append(
            {
                "step": self.step_getter() if self.step_getter else None,
                "keys": list(getattr(batch, "keys", []) or []),
                "tags": [
                    {k: t.get(k) for k in ("global_steps", "min_global_steps", "max_global_steps", "is_padding")}
                    for t in tags
                ],
            }
        )
        return self._update_actor_td(batch)

    def update_weights(self, global_steps: Optional[int] = None, mode: str = "auto") -> List[Any]:
        if mode == "naive":  # colocated (hybrid) replicas: resume + set version on the bound servers
            return super().update_weights(global_steps=global_steps, mode=mode)
        # non-naive: the actor side of an NCCL-style sync; receivers are handled by the manager
        self._count("update_weights")
        self.weight_versions.append(global_steps)
        return []

    # DetachActorWorker (separate_async, Decoupled PPO with parameter_sync_step > 1)
    def save_model_to_cpu(self, n: int) -> None:
        self._count("save_model_to_cpu")
        self.cpu_models[int(n)] = self.calls.get("update_actor", 0)

    def restore_model_from_cpu(self, n: int) -> None:
        self._count("restore_model_from_cpu")

    def clear_cpu_model(self, n: int) -> None:
        self._count("clear_cpu_model")
        self.cpu_models.pop(int(n), None)


@CheckpointEngineRegistry.register(STANDIN_CHECKPOINT_BACKEND)
class CheckpointEngineStandIn(ColocatedCheckpointEngine):
    """Stands for a GPU-to-GPU checkpoint engine (``nccl``, ``nixl``, ...); never moves tensors."""


class CheckpointEngineManagerStandIn(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager``; non-naive ``update_weights`` without a GPU process group."""

    @auto_await
    async def update_weights(self, global_steps: int = None):
        if self.backend == "naive":
            return await CheckpointEngineManager.update_weights.__wrapped__(self, global_steps)
        await self.abort_replicas()  # 1. verl: abort and save unfinished requests (partial rollout)
        await self.release_kv_cache_replicas()  # 3.
        # 2., 4.-6. (stand-in): GPU process group + weight broadcast -> new version on the servers
        self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
        servers = [s for replica in self.replicas for s in replica.servers]
        await _gather([s.set_global_steps.remote(global_steps) for s in servers])
        await self.resume_kv_cache_replicas()  # 7.
        await self.resume_generation_replicas()  # 8.
        return {}


async def _gather(refs: List[Any]) -> List[Any]:
    import asyncio

    return list(await asyncio.gather(*refs)) if refs else []


__all__ = [
    "ActorRolloutRefWorkerGroupV1StandIn",
    "CheckpointEngineManagerStandIn",
    "CheckpointEngineStandIn",
    "STANDIN_CHECKPOINT_BACKEND",
    "ray",
]
