"""The separation trainer's replay-queue fetch lines, from verl's real
``SeparateRayPPOTrainer.fit`` loop (no Ray: the trainer's workers, checkpointing and
step are stand-ins set on the instance; the step itself is tested in test_demo_cases.py)."""

from __future__ import annotations

import io

import pytest

from otel_verl.legacy.progress_log import ProgressLogProcessor

pytestmark = pytest.mark.verl


def _fetch(step, ok=True):
    verb = "successfully load" if ok else "try to load"
    return f"Trainer: {verb} global batch@{step}, chunk[0/0] from replay_queue"


class _Loader:
    """A train dataloader stand-in: records what the progress log held while each fetch
    waited, and keeps a state verl saves with its checkpoints."""

    def __init__(self, batches, out):
        self.batches, self.out = batches, out
        self.seen_while_waiting = []

    def __iter__(self):
        for batch in self.batches:
            self.seen_while_waiting.append(self.out.getvalue().splitlines()[-1:])
            yield batch
        self.seen_while_waiting.append(self.out.getvalue().splitlines()[-1:])

    def __len__(self):
        return len(self.batches)

    def state_dict(self):
        return {"batches": len(self.batches)}


def _trainer(loader, total_epochs):
    from omegaconf import OmegaConf
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer

    trainer = object.__new__(SeparateRayPPOTrainer)
    trainer.config = OmegaConf.create({
        "trainer": {"project_name": "p", "experiment_name": "e", "logger": [], "total_epochs": total_epochs,
                    "val_before_train": False},
        "global_profiler": {"steps": None},
        "data": {"train_batch_size": 2},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2, "ppo_epochs": 1}},
    })
    trainer.train_dataloader = loader
    trainer.total_training_steps = len(loader) * total_epochs
    trainer._load_checkpoint = lambda: None
    trainer.checkpoint_manager = type("CheckpointStandIn", (), {"update_weights": lambda self, step: None})()
    trainer.steps_seen = []

    def fit_step(batch_dict):  # verl's step bookkeeping, without the step
        trainer.steps_seen.append((trainer.global_steps, batch_dict, len(trainer.train_dataloader),
                                   trainer.train_dataloader.state_dict()))
        trainer.is_last_step = trainer.global_steps >= trainer.total_training_steps
        trainer.global_steps += 1

    trainer.fit_step = fit_step
    return trainer


@pytest.fixture
def hooked_separation(make_pipeline):
    import importlib

    from otel_verl.instrumentation import _trainer, hooks, trainer_separation
    from otel_verl.instrumentation.tracing import Tracing

    out = io.StringIO()
    pipeline = make_pipeline([ProgressLogProcessor(None, stdout=out)])
    hooks.install_all(trainer_separation.hooks(_trainer.TracedTrainer(Tracing())))
    try:
        importlib.import_module(trainer_separation.SEPARATION)  # wrapped on import
        assert hooks.status()[f"{trainer_separation.SEPARATION}:SeparateRayPPOTrainer.fit"][0] == hooks.INSTALLED
        yield out, pipeline
    finally:
        hooks.uninstall_all()


def test_try_to_load_is_written_before_the_wait_and_at_each_epoch_end(hooked_separation):
    out, _ = hooked_separation
    loader = _Loader(["b1", "b2"], out)
    trainer = _trainer(loader, total_epochs=2)
    trainer.fit()

    fetch_lines = [line for line in out.getvalue().splitlines() if line.startswith("Trainer: ")]
    assert fetch_lines == [
        _fetch(1, ok=False), _fetch(1),
        _fetch(2, ok=False), _fetch(2),
        _fetch(3, ok=False),  # epoch 0 used up: no batch, no "successfully" line
        _fetch(3, ok=False), _fetch(3),
        _fetch(4, ok=False), _fetch(4),
    ]
    # while the loader waited, the last line out was the fetch's own "try to load"
    assert loader.seen_while_waiting == [[_fetch(1, ok=False)], [_fetch(2, ok=False)], [_fetch(3, ok=False)],
                                         [_fetch(3, ok=False)], [_fetch(4, ok=False)]]
    # verl's loop saw its batches, length and loader state through the view; after fit,
    # the trainer holds its own loader again
    assert trainer.steps_seen == [(1, "b1", 2, {"batches": 2}), (2, "b2", 2, {"batches": 2}),
                                  (3, "b1", 2, {"batches": 2}), (4, "b2", 2, {"batches": 2})]
    assert trainer.train_dataloader is loader


def test_a_failing_fetch_ends_its_stage_with_the_error(hooked_separation):
    from otel_verl import semconv as sc

    out, pipeline = hooked_separation

    class BrokenLoader(_Loader):
        def __iter__(self):
            raise OSError("replay queue gone")
            yield  # noqa: unreachable - a generator

    trainer = _trainer(BrokenLoader(["b1"], out), total_epochs=1)
    with pytest.raises(OSError, match="replay queue gone"):
        trainer.fit()
    assert [line for line in out.getvalue().splitlines() if line.startswith("Trainer: ")] == [_fetch(1, ok=False)]
    [fetch] = [s for s in pipeline.spans() if s.name == sc.step_stage_span_name(sc.Stage.FETCH_BATCH.value)]
    assert fetch.status.status_code.name == "ERROR" and fetch.attributes[sc.LAYOUT] == "disaggregated"
    assert type(trainer.train_dataloader) is BrokenLoader  # verl's own loader again
