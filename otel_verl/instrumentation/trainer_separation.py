"""verl's separation trainer (``verl/experimental/separation``): ``SeparateRayPPOTrainer``.

It is a ``RayPPOTrainer`` whose step is split into ``_fit_*`` methods, trained and
rolled out on separate resources (the disaggregated layout: ``disagg: `` progress
lines, ``Step N`` banners). Everything it inherits (``_get_gen_batch``,
``_compute_old_log_prob``, ``_update_actor``, ``_validate``, ...) and
``AgentLoopManager.generate_sequences`` are traced by :mod:`trainer_v0`; this module adds
what it defines itself: its own ``fit`` and the module globals it imported by name
(``marked_timer``, ``extract_reward``, ``compute_advantage``, ``compute_data_metrics``).

``fit`` takes each step's batch with ``for batch_dict in self.train_dataloader`` (the
replay queue of the disaggregated layout). That loop is the only place the wait for a
batch is visible, so during ``fit`` the trainer's ``train_dataloader`` is a thin view
whose iteration makes each ``next()`` a ``fetch_batch`` stage: "try to load" when the
fetch starts, "successfully load" when it returned a batch; a fetch that finds the epoch
used up ends with no batch.
"""

from __future__ import annotations

from typing import Any, Iterator, List

from otel_verl import events, health
from otel_verl.instrumentation import _trainer, trainer_v0
from otel_verl.instrumentation.hooks import Hook
from otel_verl.semconv import Layout, Stage

SEPARATION = "verl.experimental.separation.ray_trainer"
COMPONENT = "trainer_separation"


class _FetchTracedLoader:
    """The trainer's train dataloader while ``fit`` runs: the same loader (length, state,
    every attribute), but iterating it reports each fetch as a ``fetch_batch`` stage."""

    def __init__(self, loader: Any, trainer: Any, traced: _trainer.TracedTrainer) -> None:
        self._otel_loader = loader
        self._otel_trainer = trainer
        self._otel_traced = traced

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self._otel_loader)
        while True:
            fetch = self._begin_fetch()
            try:
                batch = next(batches)
            except StopIteration:
                fetch.exhausted()
                fetch.end()
                return
            except BaseException as exc:
                fetch.end(exc)
                raise
            fetch.end()
            yield batch

    def __len__(self) -> int:
        return len(self._otel_loader)

    def __getattr__(self, name: str) -> Any:  # only for names this view does not define
        if name.startswith("_otel_"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._otel_loader, name)

    def _begin_fetch(self) -> events.StageHandle:
        traced = self._otel_traced
        if traced.instance is not self._otel_trainer or events.is_validating():
            return events.StageHandle(None)  # not traced: a handle that does nothing
        return events.stage_begin(Stage.FETCH_BATCH, step=traced.global_step(), trainer=traced.name,
                                  layout=traced.layout)


def _fit(traced: _trainer.TracedTrainer):
    traced_fit = _trainer.fit_wrapper(traced, trainer_v0.TRAINER, trainer_v0._worker_actors,
                                      layout_of=lambda _: Layout.DISAGGREGATED.value)

    def wrapper(wrapped, instance, args, kwargs):
        loader = getattr(instance, "train_dataloader", None)
        view = None
        if loader is not None and not isinstance(loader, _FetchTracedLoader):
            try:
                view = _FetchTracedLoader(loader, instance, traced)
                instance.train_dataloader = view
            except Exception as exc:
                health.record_failure(f"{COMPONENT}.fit", exc)
                view = None
        try:
            return traced_fit(wrapped, instance, args, kwargs)
        finally:
            if view is not None and getattr(instance, "train_dataloader", None) is view:
                instance.train_dataloader = loader  # fit is over: verl's own loader again

    return wrapper


def hooks(traced: _trainer.TracedTrainer) -> List[Hook]:
    return [
        Hook(SEPARATION, "SeparateRayPPOTrainer.fit", _fit(traced), (), COMPONENT),
        Hook(SEPARATION, "marked_timer", _trainer.marked_timer_wrapper(traced), ("name",), COMPONENT),
        Hook(SEPARATION, "compute_data_metrics", _trainer.record_metrics_wrapper(traced), ("batch",), COMPONENT),
        Hook(SEPARATION, "extract_reward", trainer_v0._batch_stage(traced, Stage.REWARD, "batch"), ("batch",), COMPONENT),
        Hook(SEPARATION, "compute_advantage", trainer_v0._batch_stage(traced, Stage.ADVANTAGE, "data"), ("data",),
             COMPONENT),
    ]
