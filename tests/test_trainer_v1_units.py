"""Units of the v1 trainer instrumentation: TransferQueue key parsing, worker chunking,
carriers reaching the prompt task, the prompt-task span tree and the sample outcomes of
eviction, clearing and the end of fit. The whole v1 flow on verl's real trainer is
tested in test_demo_v1.py."""

from __future__ import annotations

import pickle

import pytest

from otel_verl import carriers, events
from otel_verl import semconv as sc
from otel_verl.instrumentation import _trainer, trainer_v1
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Outcome

U1 = "6f1c6c3e-6f7b-4d43-9d1c-5a1b2c3d4e5f"
U2 = "0b8f4a52-2a4b-4f0e-8d8e-1c2b3a4d5e6f"


def test_ids_from_keys_parse_uid_session_index_and_skip_padding():
    keys = [f"{U1}_0_0", f"{U1}_3_1", "pad-uid_0_0", "not-a-trajectory-key", "a_b_c"]
    tags = [{}, {}, {"is_padding": True}, {}, {}]
    uids, trajs = trainer_v1.ids_from_keys(keys, tags)
    assert uids == [U1, U1, "not-a-trajectory-key", "a_b_c"]
    assert trajs == ["0", "3", "N/A", "N/A"]


@pytest.mark.verl
@pytest.mark.parametrize("n, workers", [(8, 2), (7, 3), (5, 8), (1, 1), (0, 2)])
def test_chunk_worker_indices_match_tensordict_chunk(n, workers):
    import torch
    from tensordict import TensorDict

    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    expected = []
    if n:
        for k, chunk in enumerate(td.chunk(workers)):
            expected += [k] * len(chunk)
    assert _trainer.chunk_worker_indices(n, workers) == expected


def test_a_carrier_naming_its_uid_registers_on_arrival():
    carrier = carriers.TraceCarrier({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, None, {"uid": U1, "worker": 1})
    arrived = pickle.loads(pickle.dumps(carrier))
    assert carriers.take_arrived(U1) == arrived
    assert carriers.take_arrived(U1) is None  # taken once
    plain = carriers.TraceCarrier(carrier.headers, None, {"traj_uid": "0", "worker": 0})  # a v0 row
    pickle.loads(pickle.dumps(plain))
    assert carriers.take_arrived("0") is None


def _by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_sessions_nest_under_the_prompt_task_under_the_rollout(make_pipeline):
    pipeline = make_pipeline()
    events.samples_created([U1], step=2, trainer=trainer_v1.TRAINER)
    row_carriers = events.rollout_dispatched([U1], ["N/A"], [1], step=2, trainer=trainer_v1.TRAINER, variant="v1")
    arrived = pickle.loads(pickle.dumps(row_carriers[0].with_row({**row_carriers[0].row, "uid": U1, "step": 2})))
    events.prompt_task_started(U1, step=2, agent_name="tool_agent", parent=carriers.take_arrived(U1) or arrived)
    for session in range(2):
        with events.trajectory(U1, session, step=2, agent_name="tool_agent", trainer_api="v1",
                               parent=events.prompt_task_parent(U1)):
            pass
    events.prompt_task_finished(U1, failed=True)
    events.rollout_returned([U1])
    events.samples_finished([U1], Outcome.TRAINED)

    spans = pipeline.spans()
    rollout = _by_name(spans, sc.SPAN_ROLLOUT)[0]
    task = _by_name(spans, sc.SPAN_PROMPT_TASK)[0]
    sessions = _by_name(spans, sc.agent_span_name("tool_agent"))
    assert task.parent.span_id == rollout.context.span_id
    assert [s.parent.span_id for s in sessions] == [task.context.span_id] * 2
    assert {s.context.trace_id for s in spans} == {task.context.trace_id}
    assert task.status.status_code.name == "ERROR"
    assert events.open_prompt_task_count() == 0


def test_open_prompt_tasks_are_bounded(make_pipeline):
    pipeline = make_pipeline(env={"OTEL_VERL_ENABLED": "1", "OTEL_VERL_MAX_OPEN_SAMPLES": "3"})
    for i in range(5):
        events.prompt_task_started(f"uid-{i}", step=1, agent_name="a")
    assert events.open_prompt_task_count() == 3
    ended = _by_name(pipeline.spans(), sc.SPAN_PROMPT_TASK)
    assert [s.attributes[sc.UID] for s in ended] == ["uid-0", "uid-1"]
    assert {s.attributes[sc.SAMPLE_OUTCOME] for s in ended} == {Outcome.OPEN_LIMIT.value}


def _outcomes(pipeline):
    return {s.attributes[sc.UID]: (s.attributes.get(sc.SAMPLE_OUTCOME), s.attributes.get(sc.SAMPLE_OUTCOME + ".detail"))
            for s in _by_name(pipeline.spans(), sc.SPAN_SAMPLE)}


class _TraceeTrainer:
    global_steps = 4
    trainer_mode = "colocate_async"


@pytest.fixture
def v1_trainer():
    traced = _trainer.TracedTrainer(Tracing())
    traced.bind(_TraceeTrainer(), trainer_v1.TRAINER)
    return traced


def test_evicted_filtered_cleared_and_never_consumed_samples_say_so(make_pipeline, v1_trainer):
    pipeline = make_pipeline()
    uids = [f"u{i}" for i in range(6)]
    events.samples_created(uids, step=3, trainer=trainer_v1.TRAINER)

    def evict(global_steps, partition_id, eviction_reasons):
        return set(), 0, 0, {}

    reasons = ({"u0"}, {"u1", "u0"}, {"u2"}, {})
    trainer_v1._evict_terminal_groups(evict, None, (4, "train", reasons), {})

    def kv_clear(keys, partition_id):
        return None

    clear = trainer_v1._kv_clear(v1_trainer)
    clear(kv_clear, None, (), {"keys": ["u3", "u4_0_0", "u4_1_0"], "partition_id": "train"})
    clear(kv_clear, None, (), {"keys": ["u5_0_0"], "partition_id": "val"})  # validation: ignored
    events.end_unconsumed_samples(Outcome.NOT_CONSUMED)  # what fit's end does

    assert _outcomes(pipeline) == {
        "u0": ("evicted", "stale"),
        "u1": ("filtered", "filter_groups"),
        "u2": ("evicted", "rollout_failure"),
        "u3": ("never_consumed", None),  # a bare prompt key is not a trajectory: untouched
        "u4": ("cleared_untrained", None),
        "u5": ("never_consumed", None),
    }


@pytest.mark.verl
def test_batch_stage_reports_trajectories_of_the_kv_batch(make_pipeline, v1_trainer):
    from transfer_queue.metadata import KVBatchMeta

    pipeline = make_pipeline()
    events.samples_created([U1, U2], step=3, trainer=trainer_v1.TRAINER)
    batch = KVBatchMeta(keys=[f"{U1}_0_0", f"{U1}_1_0", f"{U2}_0_0", "pad_0_0"],
                        tags=[{}, {}, {}, {"is_padding": True}], partition_id="train")

    def update_actor(batch, metrics):
        return batch

    wrapper = trainer_v1._batch_stage(v1_trainer, sc.Stage.UPDATE_ACTOR, finishes=True)
    assert wrapper(update_actor, None, (batch, {}), {}) is batch
    stage_spans = _by_name(pipeline.spans(), sc.sample_stage_span_name(sc.Stage.UPDATE_ACTOR.value))
    assert {s.attributes[sc.UID]: tuple(s.attributes[sc.TRAJ_UIDS]) for s in stage_spans} == {U1: ("0", "1"), U2: ("0",)}
    assert {s.attributes[sc.GLOBAL_STEP] for s in stage_spans} == {4}
    assert _outcomes(pipeline) == {U1: ("trained", None), U2: ("trained", None)}


@pytest.mark.verl
def test_every_v1_and_separation_hook_installs_on_verl_0_9_1():
    """Each target exists in the installed verl / TransferQueue with the parameters its
    wrapper reads (a renamed one would be skipped with a warning, see test_version_drift)."""
    import importlib

    pytest.importorskip("transfer_queue")
    from otel_verl.instrumentation import agent_loop_tq, hooks, trainer_separation

    traced = _trainer.TracedTrainer(Tracing())
    table = [*trainer_v1.hooks(traced), *agent_loop_tq.hooks(traced.tracing), *trainer_separation.hooks(traced)]
    try:
        hooks.install_all(table)
        for module in {h.module for h in table}:
            importlib.import_module(module)
        status = hooks.status()
        assert {h.name: status[h.name][0] for h in table} == {h.name: hooks.INSTALLED for h in table}
    finally:
        hooks.uninstall_all()
