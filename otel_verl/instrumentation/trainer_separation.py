"""verl's separation trainer (``verl/experimental/separation``): ``SeparateRayPPOTrainer``.

It is a ``RayPPOTrainer`` whose step is split into ``_fit_*`` methods, trained and
rolled out on separate resources (the disaggregated layout: ``disagg: `` progress
lines, ``Step N`` banners). Everything it inherits (``_get_gen_batch``,
``_compute_old_log_prob``, ``_update_actor``, ``_validate``, ...) and
``AgentLoopManager.generate_sequences`` are traced by :mod:`trainer_v0`; this module adds
what it defines itself: its own ``fit`` and ``fit_step`` (the replay-queue fetch lines),
and the module globals it imported by name (``marked_timer``, ``extract_reward``,
``compute_advantage``, ``compute_data_metrics``).
"""

from __future__ import annotations

from otel_verl import events
from otel_verl.instrumentation import _trainer, trainer_v0
from otel_verl.instrumentation.hooks import Hook
from otel_verl.semconv import Layout, Stage

SEPARATION = "verl.experimental.separation.ray_trainer"
COMPONENT = "trainer_separation"


def _fit_step(wrapped, instance, args, kwargs):
    # fit's loop has just taken the step's batch from the dataloader (the replay queue of
    # the disaggregated layout): the fetch lines, before the step's banner.
    if _trainer.current.active:
        fetch = events.stage_begin(Stage.FETCH_BATCH, step=_trainer.current.global_step(), trainer=_trainer.current.name,
                                   layout=_trainer.current.layout)
        fetch.end()
    return wrapped(*args, **kwargs)


HOOKS = [
    Hook(SEPARATION, "SeparateRayPPOTrainer.fit",
         _trainer.fit_wrapper(trainer_v0.TRAINER, trainer_v0._worker_actors, layout_of=lambda _: Layout.DISAGGREGATED.value),
         (), COMPONENT),
    Hook(SEPARATION, "SeparateRayPPOTrainer.fit_step", _fit_step, ("batch_dict",), COMPONENT),
    Hook(SEPARATION, "marked_timer", _trainer.marked_timer_wrapper(_trainer.STAGE_BY_TIMER), ("name",), COMPONENT),
    Hook(SEPARATION, "compute_data_metrics", _trainer.begin_record_metrics, ("batch",), COMPONENT),
    Hook(SEPARATION, "extract_reward", trainer_v0._batch_stage(Stage.REWARD, "batch"), ("batch",), COMPONENT),
    Hook(SEPARATION, "compute_advantage", trainer_v0._batch_stage(Stage.ADVANTAGE, "data"), ("data",), COMPONENT),
]
