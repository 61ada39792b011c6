"""Golden tests of the progress log (LEGACY_FORMATS.md section 2, SPANS.md table).

Driven through the real events API; lines are compared as the progress panel reads them:
raw stdout lines and raw lines of ``{trace_dir}/progress/{YYYYMMDD-HH}.log``.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import threading
import time
import types

import pytest

from otel_verl import events, health
from otel_verl.legacy.progress_log import ProgressLogProcessor
from otel_verl.semconv import Layout, Stage

DISAGG = Layout.DISAGGREGATED.value
T0 = 1_787_215_029.0  # the progress clock (seconds)


class SpanClock:
    """Replaces the SDK's span clock, so stage durations (gen throughput) are exact."""

    def __init__(self) -> None:
        self.now_ns = int(T0 * 1e9)

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


@pytest.fixture
def span_clock(monkeypatch):
    fake = SpanClock()
    monkeypatch.setattr("opentelemetry.sdk.trace.time_ns", fake)
    # otel_verl's clock: its wall and monotonic readings both the fake's (no jump)
    monkeypatch.setattr("otel_verl.clock.time", types.SimpleNamespace(time_ns=fake, monotonic_ns=fake))
    return fake


@pytest.fixture
def progress(make_pipeline, tmp_path):
    """``progress(trace_dir=True, **kwargs) -> (processor, stdout buffer)``."""

    def factory(trace_dir=True, **kwargs):
        out = io.StringIO()
        kwargs.setdefault("discovery_path", str(tmp_path / "discovery.txt"))
        kwargs.setdefault("clock", lambda: T0)
        directory = str(tmp_path / "trace") if trace_dir is True else trace_dir
        proc = ProgressLogProcessor(directory, stdout=out, **kwargs)
        make_pipeline([proc])
        return proc, out

    return factory


def hour_file(proc: ProgressLogProcessor, when: float = T0) -> str:
    return os.path.join(proc.directory, time.strftime("%Y%m%d-%H", time.localtime(when)) + ".log")


def file_lines(proc: ProgressLogProcessor, when: float = T0) -> list:
    assert proc.force_flush()
    with open(hour_file(proc, when), "rb") as f:
        data = f.read()
    assert data.endswith(b"\n")
    return data.decode("utf-8").split("\n")[:-1]


# --------------------------------------------------------------------------- fit, banner


def test_fit_lines(progress):
    proc, out = progress()
    events.fit_started(trainer="RayPPOTrainer", total_training_steps=435, train_batch_size=1024, rollout_n=16,
                       ppo_mini_batch_size=256, ppo_epochs=2)
    expected = [
        "Total training steps: 435",
        "'train_batch_size': 1024,",
        "'rollout_n': 16,",
        "'ppo_mini_batch_size': 256,",
        "'num_minibatches': 128,",  # 2 * (1024 * 16 // 256)
        "'total_training_steps': 435",
    ]
    assert out.getvalue().splitlines() == expected
    assert file_lines(proc) == expected


def test_step_banners(progress):
    _, out = progress()
    with events.step(7, trainer="RayPPOTrainer", epoch=1, consumed_batches=3):
        pass
    with events.step(8, trainer="SeparateRayPPOTrainer", layout=DISAGG):
        pass
    assert out.getvalue().splitlines() == [
        "==================== Epoch 1, consumed 3 batches, Step 7 ====================",
        "==================== Step 8 ====================",
    ]


# --------------------------------------------------------------------------- step sequences


def test_contract_example_colocated_step(progress, span_clock):
    """LEGACY_FORMATS.md section 2, "Example colocated step", line for line."""
    proc, out = progress()
    uid = "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5"
    with events.step(1, trainer="RayPPOTrainer", epoch=0, consumed_batches=0):
        with events.step_stage(Stage.GENERATION) as generation:
            span_clock.advance(100.0)
            generation.response_tokens(482_351)  # / 100 s = 4823.51 token/s
        # the rollout worker's line (another process in a real run)
        with events.trajectory(uid, "0", step=1, agent_name="single_turn_agent") as traj:
            with events.reward() as reward:
                reward.score(1)
        for stage in (Stage.REWARD, Stage.OLD_LOG_PROB, Stage.REF_LOG_PROB, Stage.ADVANTAGE, Stage.UPDATE_ACTOR,
                      Stage.SYNC_PARAMS):
            with events.step_stage(stage):
                pass
    expected = """\
==================== Epoch 0, consumed 0 batches, Step 1 ====================
Step 1 rollout started
start generation
end generation
Step 1 rollout finished
gen throughput (token/s): 4823.51
Task 92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5/0 is completed, score=1.0 status=Finished
start compute reward
end compute reward
start compute log prob
end compute log prob
start compute ref log prob
end compute ref log prob
start compute adv
end compute adv
Step 1 train started
start update actor
end update actor
Step 1 train finished
start sync params
end sync params
"""
    assert traj is not None
    assert out.getvalue() == expected
    assert file_lines(proc) == expected.splitlines()


def test_all_stage_labels_and_silent_stages(progress):
    _, out = progress(trace_dir=None)
    with events.step(2, trainer="RayPPOTrainer", epoch=0, consumed_batches=1):
        for stage in (Stage.VALUES, Stage.UPDATE_CRITIC, Stage.SAVE_CHECKPOINT, Stage.EVAL, Stage.RECORD_METRICS,
                      Stage.SAMPLE, Stage.FILTER):
            with events.step_stage(stage):
                pass
    assert out.getvalue().splitlines()[1:] == [
        "start compute values",
        "end compute values",
        "start save checkpoint",
        "end save checkpoint",
        "start eval",
        "end eval",
        "start record metrics",
        "end record metrics",
    ]


def test_disaggregated_separation_trainer_step(progress, span_clock):
    _, out = progress()
    trainer = "SeparateRayPPOTrainer"
    with events.step_stage(Stage.FETCH_BATCH, step=3, trainer=trainer, layout=DISAGG):  # before the banner
        # while the trainer waits for its batch, only the "try to load" line is out
        assert out.getvalue().splitlines() == ["Trainer: try to load global batch@3, chunk[0/0] from replay_queue"]
    with events.step(3, trainer=trainer, layout=DISAGG):
        with events.step_stage(Stage.GENERATION, layout=DISAGG) as generation:
            span_clock.advance(2.0)
            generation.response_tokens(1001)
        for stage in (Stage.REWARD, Stage.ADVANTAGE, Stage.UPDATE_ACTOR, Stage.SYNC_PARAMS):
            with events.step_stage(stage, layout=DISAGG):
                pass
    assert out.getvalue().splitlines() == [
        "Trainer: try to load global batch@3, chunk[0/0] from replay_queue",
        "Trainer: successfully load global batch@3, chunk[0/0] from replay_queue",
        "==================== Step 3 ====================",
        "Step 3 rollout started",
        "Step 3 rollout finished",
        "gen throughput (token/s): 500.50",
        "disagg: start compute reward",
        "disagg: end compute reward",
        "disagg: start compute adv",
        "disagg: end compute adv",
        "Step 3 train started",
        "disagg: start update actor",
        "disagg: end update actor",
        "Step 3 train finished",
        "disagg: start sync params",
        "disagg: end sync params",
    ]


def test_a_fetch_that_finds_the_epoch_used_up_writes_only_its_try_line(progress):
    _, out = progress()
    fetch = events.stage_begin(Stage.FETCH_BATCH, step=4, trainer="SeparateRayPPOTrainer", layout=DISAGG)
    fetch.exhausted()
    fetch.end()
    with events.step_stage(Stage.FETCH_BATCH, step=4, trainer="SeparateRayPPOTrainer", layout=DISAGG):
        pass  # the next epoch's first fetch
    assert out.getvalue().splitlines() == [
        "Trainer: try to load global batch@4, chunk[0/0] from replay_queue",
        "Trainer: try to load global batch@4, chunk[0/0] from replay_queue",
        "Trainer: successfully load global batch@4, chunk[0/0] from replay_queue",
    ]


def test_v1_separate_async_fetch_inside_the_rollout_window(progress, span_clock):
    _, out = progress()
    with events.step(5, trainer="PPOTrainerV1", layout=DISAGG):
        # v1 separate_async: the rollout window is a replay-queue fetch; no throughput line
        with events.step_stage(Stage.GENERATION, layout=DISAGG) as generation:
            with events.step_stage(Stage.FETCH_BATCH, layout=DISAGG):  # trainer inherited from the step
                span_clock.advance(1.0)
            generation.response_tokens(4096)
    assert out.getvalue().splitlines() == [
        "==================== Step 5 ====================",
        "Step 5 rollout started",
        "Trainer: try to load global batch@5, chunk[0/0] from replay_queue",
        "Trainer: successfully load global batch@5, chunk[0/0] from replay_queue",
        "Step 5 rollout finished",
    ]


def test_gen_throughput_needs_response_tokens(progress):
    _, out = progress()
    with events.step_stage(Stage.GENERATION, step=1):
        pass
    assert out.getvalue().splitlines() == ["Step 1 rollout started", "start generation", "end generation",
                                           "Step 1 rollout finished"]


def test_failed_stage_writes_no_end_lines(progress):
    _, out = progress()
    with pytest.raises(ValueError):
        with events.step_stage(Stage.REWARD, step=1):
            raise ValueError("reward model down")
    assert out.getvalue().splitlines() == ["start compute reward"]


# --------------------------------------------------------------------------- task completed


def _finished_trajectory(uid, traj, score=None, **kwargs):
    with events.trajectory(uid, traj, step=1, agent_name="single_turn_agent", **kwargs):
        if score is not None:
            with events.reward() as reward:
                reward.score(score)


def test_task_completed_lines(progress):
    proc, out = progress()
    _finished_trajectory("u1", "3", score=1)
    _finished_trajectory("u1", "4", score=-0.25)
    _finished_trajectory("u2", "0")  # no reward: 0.0
    _finished_trajectory("val", "0", score=1.0, validate=True)  # validation: nothing
    expected = [
        "Task u1/3 is completed, score=1.0 status=Finished",
        "Task u1/4 is completed, score=-0.25 status=Finished",
        "Task u2/0 is completed, score=0.0 status=Finished",
    ]
    assert out.getvalue().splitlines() == expected
    assert file_lines(proc) == expected


def test_a_progress_line_is_one_line_whatever_its_text_holds(progress):
    proc, out = progress()
    _finished_trajectory("u1\nTask forged/0 is completed, score=9.0 status=Finished", "3", score=1)
    expected = ["Task u1\\nTask forged/0 is completed, score=9.0 status=Finished/3 is completed, score=1.0 "
                "status=Finished"]
    assert out.getvalue().splitlines() == expected
    assert file_lines(proc) == expected


def test_task_completed_needs_a_trace_dir(progress):
    proc, out = progress(trace_dir=None)
    _finished_trajectory("u1", "3", score=1)
    with events.step_stage(Stage.REWARD, step=1):
        pass
    assert out.getvalue().splitlines() == ["start compute reward", "end compute reward"]
    assert proc.directory is None and proc.writer is None and proc.force_flush()


# --------------------------------------------------------------------------- files


def test_hour_rollover_and_discovery_file(progress, tmp_path):
    now = [T0]
    proc, _ = progress(clock=lambda: now[0])
    discovery = tmp_path / "discovery.txt"
    assert not discovery.exists()  # written at the first file write, not at creation
    with events.step_stage(Stage.REWARD, step=1):  # start line at T0, end line an hour later
        now[0] = T0 + 3600.0
    with events.step_stage(Stage.ADVANTAGE, step=1):
        pass
    assert file_lines(proc, T0) == ["start compute reward"]
    assert file_lines(proc, T0 + 3600.0) == ["end compute reward", "start compute adv", "end compute adv"]
    assert hour_file(proc, T0) != hour_file(proc, T0 + 3600.0)
    assert discovery.read_text() == proc.directory


def test_many_threads_append_whole_lines(progress):
    proc, _ = progress()
    n_threads, n_steps = 8, 100

    def run(worker: int) -> None:
        for step in range(n_steps):
            with events.step(worker * 1000 + step, trainer="SeparateRayPPOTrainer", layout=DISAGG):
                pass

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = file_lines(proc)
    expected = {f"==================== Step {w * 1000 + s} ====================" for w in range(n_threads)
                for s in range(n_steps)}
    assert len(lines) == n_threads * n_steps and set(lines) == expected


def _append_from_process(trace_dir: str, worker: int, n_lines: int) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import Pipeline

    health.reset()
    proc = ProgressLogProcessor(trace_dir, stdout=io.StringIO(), clock=lambda: T0, discovery_path=None)
    pipeline = Pipeline([proc])
    for i in range(n_lines):
        with events.step(worker * 100_000 + i, trainer="SeparateRayPPOTrainer", layout=DISAGG):
            pass
    pipeline.close()  # shuts the processor down: flushes its writer
    sys.exit(0 if proc.writer.written_lines == n_lines else 1)


def test_several_processes_append_to_one_file(tmp_path):
    trace_dir = str(tmp_path / "trace")
    n_procs, n_lines = 4, 300
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_from_process, args=(trace_dir, w, n_lines)) for w in range(n_procs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    path = os.path.join(trace_dir, "progress", time.strftime("%Y%m%d-%H", time.localtime(T0)) + ".log")
    with open(path, "rb") as f:
        lines = f.read().decode().split("\n")
    assert lines[-1] == ""
    expected = {f"==================== Step {w * 100_000 + i} ====================" for w in range(n_procs)
                for i in range(n_lines)}
    assert len(lines) - 1 == n_procs * n_lines and set(lines[:-1]) == expected


def test_unwritable_directory_keeps_stdout_and_counts(progress, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: makedirs below it fails even as root")
    proc, out = progress(trace_dir=str(blocker / "trace"), discovery_path=str(blocker / "discovery.txt"))
    with events.step_stage(Stage.REWARD, step=1):
        pass
    assert out.getvalue().splitlines() == ["start compute reward", "end compute reward"]
    assert proc.force_flush()
    assert proc.writer.dropped_lines == 2 and proc.writer.written_lines == 0
    assert health.snapshot()["dropped"] == {"progress_log": 2}


def test_full_disk_is_counted_and_never_raises(progress):
    proc, out = progress()
    os.makedirs(proc.directory)
    os.symlink("/dev/full", hour_file(proc))  # every write: ENOSPC
    with events.step_stage(Stage.REWARD, step=1):
        pass
    events.fit_started(trainer="RayPPOTrainer", total_training_steps=1, train_batch_size=1, rollout_n=1,
                       ppo_mini_batch_size=1)
    assert proc.force_flush()
    assert len(out.getvalue().splitlines()) == 8
    assert proc.writer.dropped_lines == 8 and proc.writer.written_lines == 0
    assert health.snapshot()["dropped"] == {"progress_log": 8}
    assert health.snapshot()["failures"] == {}


def test_shutdown_flushes_everything_accepted(progress):
    proc, _ = progress()
    for step in range(500):
        with events.step(step, trainer="SeparateRayPPOTrainer", layout=DISAGG):
            pass
    proc.shutdown()
    with open(hour_file(proc), "rb") as f:
        assert f.read().count(b"\n") == 500
    assert proc.writer.written_lines == 500


def test_stdout_failure_does_not_reach_the_caller(make_pipeline, tmp_path):
    out = io.StringIO()
    out.close()
    proc = ProgressLogProcessor(str(tmp_path / "trace"), stdout=out, clock=lambda: T0, discovery_path=None)
    make_pipeline([proc])
    with events.step_stage(Stage.REWARD, step=1):
        pass
    assert file_lines(proc) == ["start compute reward", "end compute reward"]
    assert health.snapshot()["failures"] == {"progress_log.stdout": 2}
