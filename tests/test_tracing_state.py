"""The run's tracing state is one object: two of them, each with its own provider, live in
one process side by side, and a forked child starts with none of its parent's open spans."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from otel_verl import events, semconv as sc
from otel_verl.semconv import Stage


@pytest.fixture
def two_states(make_pipeline):
    """Two pipelines (providers with an exporter each) and the tracing state of each;
    the second is the installed one."""
    first = make_pipeline()
    first_state = events.state()
    second = make_pipeline()
    second_state = events.state()
    assert first_state is not second_state and first_state.provider is not second_state.provider
    yield (first, first_state), (second, second_state)
    with first_state.activated():  # the pipeline closes only the installed state's spans
        events.end_open_samples()


def _uids(pipeline):
    return {s.attributes.get(sc.UID) for s in pipeline.spans() if sc.UID in s.attributes}


def test_each_state_reports_to_its_own_provider_from_interleaved_tasks(two_states):
    (first, first_state), (second, second_state) = two_states

    async def sample(state, uid):
        with state.activated():
            events.samples_created([uid], step=1, trainer="RayPPOTrainer")
            with events.trajectory(uid, "0", step=1, agent_name="tool_agent"):
                await asyncio.sleep(0)  # the other task runs here, in its own state
                with events.llm_call([1, 2], model="m") as turn:
                    await asyncio.sleep(0)
                    turn.finish([3])
            events.samples_finished([uid], "trained")

    async def both():
        await asyncio.gather(*(sample(state, f"{name}-{i}") for i in range(3)
                               for name, state in (("a", first_state), ("b", second_state))))

    asyncio.run(both())
    assert _uids(first) == {"a-0", "a-1", "a-2"}
    assert _uids(second) == {"b-0", "b-1", "b-2"}
    names = sorted(s.name for s in first.spans())
    assert names == sorted(s.name for s in second.spans()) and sc.SPAN_SAMPLE in names


def test_open_spans_belong_to_the_state_that_opened_them(two_states):
    (first, first_state), (second, second_state) = two_states
    opened, done = threading.Event(), threading.Event()

    def trainer_of_first():
        with first_state.activated():
            events.samples_created(["a"], step=7, trainer="RayPPOTrainer")
            events.step_begin(7, trainer="RayPPOTrainer")
            with events.step_stage(Stage.GENERATION):
                opened.set()
                done.wait(10)
            events.step_end()

    thread = threading.Thread(target=trainer_of_first)
    thread.start()
    try:
        assert opened.wait(10)
        events.step_begin(2, trainer="RayPPOTrainer")  # the installed (second) state, meanwhile
        assert events.current_step() == 2 and events.open_sample_count() == 0
        with first_state.activated():
            assert events.current_step() == 7 and events.open_sample_count() == 1
    finally:
        done.set()
        thread.join()
    events.step_end()
    steps = {s.attributes[sc.GLOBAL_STEP] for p in (first, second) for s in p.spans() if s.name == sc.SPAN_STEP}
    assert steps == {7, 2}
    first_steps = [s for s in first.spans() if s.name == sc.SPAN_STEP]
    stage = [s for s in first.spans() if s.name == sc.step_stage_span_name(Stage.GENERATION.value)]
    assert [s.attributes[sc.GLOBAL_STEP] for s in first_steps] == [7]
    assert stage[0].parent.span_id == first_steps[0].context.span_id


def test_prompt_tasks_are_kept_per_state(two_states):
    (first, first_state), (second, _) = two_states
    with first_state.activated():
        events.prompt_task_started("p", step=1, agent_name="tool_agent")
    assert events.open_prompt_task_count() == 0 and events.prompt_task_parent("p") is None
    with first_state.activated():
        assert events.open_prompt_task_count() == 1 and events.prompt_task_parent("p") is not None
        events.prompt_task_finished("p")
    assert [s.name for s in first.spans()] == [sc.SPAN_PROMPT_TASK] and not second.spans()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_none_of_its_parents_open_spans(make_pipeline):
    pipeline = make_pipeline()
    events.samples_created(["u"], step=3, trainer="RayPPOTrainer")
    events.step_begin(3, trainer="RayPPOTrainer")
    events.prompt_task_started("p", step=3, agent_name="tool_agent")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, never return into pytest
        try:
            seen = (events.open_sample_count(), events.current_step(), events.open_prompt_task_count())
            events.step_begin(4, trainer="RayPPOTrainer")  # and its own spans still work
            seen += (events.current_step(),)
            os.write(write_end, repr(seen).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        child = reader.read()
    os.waitpid(pid, 0)
    assert child == repr((0, None, 0, 4))
    assert (events.open_sample_count(), events.current_step(), events.open_prompt_task_count()) == (1, 3, 1)
    events.step_end()
