"""Golden tests of the sample-flow CSV (LEGACY_FORMATS.md section 1, SPANS.md table).

Driven through the real events API; files are read back the way the SLS collector does:
the csv module with the column names supplied from outside (the file has no header).
"""

from __future__ import annotations

import csv
import os
import shutil
import socket
import types

import pytest

from otel_verl import events, health
from otel_verl.exporters._writer import one_line
from otel_verl.legacy.sample_csv import Rows, SampleCsvProcessor, render_rows
from otel_verl.semconv import Stage

CSV_HEADERS = ["job_id", "cat", "sample_id", "sample_status", "timestamp", "content"]
T0_NS = 1_787_215_029_010_123_456  # -> 1787215029010 ms
T0_MS = "1787215029010"


class FakeClock:
    """Replaces the SDK's span clock: span start/end times become what the test says."""

    def __init__(self, now_ns: int = T0_NS) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr("opentelemetry.sdk.trace.time_ns", fake)
    # otel_verl's clock: its wall and monotonic readings both the fake's (no jump)
    monkeypatch.setattr("otel_verl.clock.time", types.SimpleNamespace(time_ns=fake, monotonic_ns=fake))
    monkeypatch.setattr("otel_verl.events._core._now_ns", fake)
    return fake


@pytest.fixture(params=[False, True], ids=["slim_spans", "sdk_spans"])
def csv_proc(make_pipeline, tmp_path, monkeypatch, request):
    """``csv_proc(**kwargs) -> (processor, pipeline)``, discovery file kept in tmp_path;
    every test runs with the events API on SlimSpans and on the SDK's spans."""
    monkeypatch.delenv("DLC_JOB_ID", raising=False)

    def factory(env=None, **kwargs):
        kwargs.setdefault("discovery_path", str(tmp_path / "discovery.txt"))
        proc = SampleCsvProcessor(str(tmp_path / "trace"), **kwargs)
        return proc, make_pipeline([proc], env=env, sdk_spans=request.param)

    return factory


def read_rows(proc: SampleCsvProcessor) -> list:
    assert proc.force_flush()
    if not os.path.exists(proc.path):
        return []
    with open(proc.path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, fieldnames=CSV_HEADERS))


def contents(proc) -> list:
    return [(r["sample_id"], r["sample_status"], r["content"]) for r in read_rows(proc)]


# --------------------------------------------------------------------------- columns


def test_file_location_columns_and_raw_bytes(csv_proc, clock, tmp_path):
    proc, _ = csv_proc()
    events.samples_created(["u1"], step=3, trainer="RayPPOTrainer")
    assert proc.force_flush()

    path = tmp_path / "trace" / "sample" / f"{socket.gethostname()}-pid{os.getpid()}.csv"
    assert proc.path == str(path)
    raw = path.read_bytes()
    assert raw == (
        b"ENV_NOTFOUND_DLC_JOB_ID,sample,u1/sample,RUNNING,1787215029010,"
        b"from=DataLoader|to=RayPPOTrainer|stage=DATA_PREPROCESS|global_step=3|detail=uid_generated\r\n"
    )
    assert (tmp_path / "discovery.txt").read_text() == str(tmp_path / "trace" / "sample")


def test_appends_to_existing_file_without_header(csv_proc, clock):
    proc, _ = csv_proc()
    events.samples_created(["u1"], step=1, trainer="RayPPOTrainer")
    proc.force_flush()
    proc.writer.close()  # a second writer (a restarted processor) appends to the same file
    second, _ = csv_proc()
    events.samples_created(["u2"], step=1, trainer="RayPPOTrainer")
    rows = read_rows(second)
    assert [r["sample_id"] for r in rows] == ["u1/sample", "u2/sample"]
    with open(second.path, "rb") as f:
        data = f.read()
    assert data.count(b"\r\n") == 2 and not data.startswith(b"job_id")


def test_job_id_is_read_when_the_processor_is_created(csv_proc, clock, monkeypatch):
    monkeypatch.setenv("DLC_JOB_ID", "dlc-42")
    proc, _ = csv_proc()
    monkeypatch.setenv("DLC_JOB_ID", "changed-later")
    events.samples_created(["u1"], step=1, trainer="RayPPOTrainer")
    assert [(r["job_id"], r["cat"]) for r in read_rows(proc)] == [("dlc-42", "sample")]


def test_timestamps_are_integer_ms_of_span_start_and_end(csv_proc, clock):
    proc, _ = csv_proc()
    with events.trajectory("u1", "0", step=1, agent_name="single_turn_agent"):
        with events.agent_run("SingleTurnAgentLoop"):
            clock.now_ns = T0_NS + 5_000_000_000
            with events.llm_call([1, 2]) as turn:
                clock.now_ns = T0_NS + 7_250_999_999
                turn.finish([3])
    stamps = [(r["content"].rsplit("=", 1)[-1], r["timestamp"]) for r in read_rows(proc)]
    assert stamps == [
        ("agent_task_started", T0_MS),
        ("sending_generate_request", "1787215034010"),
        ("received_generate_response", "1787215036261"),
        ("agent_run_completed", "1787215036261"),
    ]


def test_sample_id_digit_rule(csv_proc, clock):
    proc, _ = csv_proc()
    events.sample_stage_done(Stage.ADVANTAGE, ["u1"] * 4, ["0", "12", "N/A", "x7"], step=2, start_ns=T0_NS,
                             trainer="RayPPOTrainer")
    with events.step_stage(Stage.SYNC_PARAMS, step=2):
        pass
    assert [r["sample_id"] for r in read_rows(proc)] == ["u1/0", "u1/12", "u1/sample", "u1/sample", "*/sample"]


def test_complete_only_for_update_and_filter_v0_routes(csv_proc, clock):
    proc, _ = csv_proc()
    for stage in (Stage.REWARD, Stage.OLD_LOG_PROB, Stage.REF_LOG_PROB, Stage.ADVANTAGE, Stage.UPDATE_ACTOR,
                  Stage.FILTER, Stage.UPDATE_CRITIC, Stage.VALUES):
        events.sample_stage_done(stage, ["u1"], ["0"], step=5, start_ns=T0_NS, trainer="RayPPOTrainer")
    assert contents(proc) == [
        ("u1/0", "RUNNING", "from=RayPPOTrainer|to=RewardManager|stage=TRAIN_REWARD|global_step=5|detail=reward_extracted"),
        ("u1/0", "RUNNING", "from=ActorRolloutRefWorker|to=RayPPOTrainer|stage=TRAIN_LOGPROB|global_step=5|detail=old_log_prob_computed"),
        ("u1/0", "RUNNING", "from=RefPolicyWorker|to=RayPPOTrainer|stage=TRAIN_REF_LOGPROB|global_step=5|detail=ref_log_prob_computed"),
        ("u1/0", "RUNNING", "from=RayPPOTrainer|to=RayPPOTrainer|stage=TRAIN_ADVANTAGE|global_step=5|detail=advantage_computed"),
        ("u1/0", "COMPLETE", "from=ActorRolloutRefWorker|to=RayPPOTrainer|stage=TRAIN_UPDATE|global_step=5|detail=actor_parameters_updated"),
        ("u1/0", "COMPLETE", "from=RayPPOTrainer|to=RayPPOTrainer|stage=FILTER_TRAJECTORIES|global_step=5|detail=trajectories_filtered"),
    ]  # update_critic and values write no rows


def test_v1_trainer_stage_routes(csv_proc, clock):
    proc, _ = csv_proc()
    for stage in (Stage.SAMPLE, Stage.REWARD, Stage.OLD_LOG_PROB, Stage.REF_LOG_PROB, Stage.ADVANTAGE,
                  Stage.UPDATE_ACTOR):
        events.sample_stage_done(stage, ["u1"], ["1"], step=2, start_ns=T0_NS, trainer="PPOTrainerV1")
    assert [c for _, _, c in contents(proc)] == [
        "from=ReplayBuffer|to=PPOTrainerV1|stage=TRAIN_SAMPLE|global_step=2|detail=sampled_from_replay_buffer",
        "from=PPOTrainerV1|to=RewardLoopManager|stage=TRAIN_REWARD|global_step=2|detail=reward_extracted",
        "from=ActorRolloutWorker|to=PPOTrainerV1|stage=TRAIN_LOGPROB|global_step=2|detail=old_log_prob_computed",
        "from=RefPolicyWorker|to=PPOTrainerV1|stage=TRAIN_REF_LOGPROB|global_step=2|detail=ref_log_prob_computed",
        "from=PPOTrainerV1|to=PPOTrainerV1|stage=TRAIN_ADVANTAGE|global_step=2|detail=advantage_computed",
        "from=ActorRolloutWorker|to=PPOTrainerV1|stage=TRAIN_UPDATE|global_step=2|detail=actor_parameters_updated",
    ]


def test_global_step_omitted_when_unknown(csv_proc, clock):
    proc, _ = csv_proc()
    events.sample_stage_done(Stage.ADVANTAGE, ["u1"], ["0"], step=-1, start_ns=T0_NS, trainer="RayPPOTrainer")
    with events.step_stage(Stage.SYNC_PARAMS):  # outside any step: no verl.global_step
        pass
    with events.step_stage(Stage.SYNC_PARAMS, step=0):  # step 0 is a known step
        pass
    assert [c for _, _, c in contents(proc)] == [
        "from=RayPPOTrainer|to=RayPPOTrainer|stage=TRAIN_ADVANTAGE|detail=advantage_computed",
        "from=CheckpointEngineManager|to=RolloutReplica|stage=SYNC_PARAMS|detail=weights_synced_global_step=-1",
        "from=CheckpointEngineManager|to=RolloutReplica|stage=SYNC_PARAMS|global_step=0|detail=weights_synced_global_step=0",
    ]


def test_content_omits_empty_detail():
    rows = Rows("u", ("0",), "A", "B", "S", 3, "", T0_NS)
    assert rows.content() == "from=A|to=B|stage=S|global_step=3"
    assert Rows("u", ("0",), "A", "B", "S", None, "", T0_NS).content() == "from=A|to=B|stage=S"


@pytest.mark.parametrize("job_id", ["dlc-1", 'job,"x"'])
@pytest.mark.parametrize("uid", ["92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5", "a,b", 'q"uote', "line\nbreak", "cr\r", ""])
def test_rendering_equals_csv_writer(job_id, uid):
    """render_rows puts rows together from quoted cells; the bytes must be csv.writer's
    (of the cells with their control characters escaped)."""
    import io

    groups = [
        Rows(uid, ["0", "17", "N/A", "*", "x,y", "²"], "A", "B", "TRAIN_UPDATE", 4, 'tool_executed_name=a,"b"', T0_NS),
        Rows(uid, ("N/A",), "DataLoader", "T", "DATA_PREPROCESS", None, "", T0_NS + 1),
        Rows(uid, ("3",), "SingleTurnAgentLoop", "RolloutReplica", "LLM_GENERATE", None, "sending_generate_request",
             T0_NS + 2),
        Rows(uid, ["12"], "Tool", "ToolAgentLoop", "AGENT_TOOL", None, 'tool_executed_name=a,"b"', T0_NS + 3),
        Rows(uid, (7,), "AgentLoopWorker", "AgentLoop(x)", "AGENT_LOOP", 2, "agent_task_started", T0_NS + 4),
    ]
    expected = io.StringIO()
    writer = csv.writer(expected)
    for rows in groups:
        status = "COMPLETE" if rows.stage == "TRAIN_UPDATE" else "RUNNING"
        for traj in rows.trajs:
            sid = f"{uid}/{traj}" if str(traj).isdigit() else f"{uid}/sample"
            writer.writerow([one_line(job_id), "sample", one_line(sid), status, rows.ts_ns // 1_000_000,
                             one_line(rows.content())])
    assert render_rows(job_id, groups) == expected.getvalue()


def test_a_row_is_one_line_whatever_its_text_holds(csv_proc, clock):
    """A uid or a model's tool name with line breaks cannot forge a row for a reader that
    takes one record per line."""
    proc, _ = csv_proc()
    forged = "u1\nENV,sample,x/0,COMPLETE,1,from=A"
    with events.trajectory(forged, "0", step=1, agent_name="tool_agent"):
        with events.agent_run("ToolAgentLoop"):
            with events.tool_call("calc\r\n\x1b[2Jnext\u2028"):
                pass
    assert proc.force_flush()
    with open(proc.path, "rb") as f:
        lines = f.read().split(b"\r\n")
    assert lines[-1] == b"" and len(lines) - 1 == len(read_rows(proc)) == 3
    for line in lines[:-1]:  # each line read alone is one whole record, none of them forged
        (record,) = csv.reader([line.decode("utf-8")])
        assert len(record) == 6 and record[3] == "RUNNING"
    rows = read_rows(proc)
    assert {r["sample_id"] for r in rows} == {"u1\\nENV,sample,x/0,COMPLETE,1,from=A/0"}
    assert rows[1]["content"].endswith("detail=tool_executed_name=calc\\r\\n\\x1b[2Jnext\\u2028")


def test_detail_with_comma_and_quote_is_csv_quoted(csv_proc, clock, tmp_path):
    proc, _ = csv_proc()
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent"):
        with events.agent_run("ToolAgentLoop"):
            with events.tool_call('a,"b"'):
                pass
    rows = read_rows(proc)
    assert rows[1]["content"] == 'from=Tool|to=ToolAgentLoop|stage=AGENT_TOOL|detail=tool_executed_name=a,"b"'
    raw = open(proc.path, "rb").read().split(b"\r\n")[1]
    assert raw.endswith(b',"from=Tool|to=ToolAgentLoop|stage=AGENT_TOOL|detail=tool_executed_name=a,""b"""')


# --------------------------------------------------------------------------- golden flows


def test_trainer_v0_flow_and_batch_fan_out_order(csv_proc, clock):
    proc, _ = csv_proc()
    events.samples_created(["u1", "u2"], step=1, trainer="RayPPOTrainer")
    # u2's trajectories are split across two worker chunks
    events.rollout_dispatched(["u1", "u1", "u2", "u2", "u2"], ["0", "1", "0", "1", "2"], [0, 0, 0, 1, 1], step=1,
                              trainer="RayPPOTrainer")
    events.rollout_returned(["u1", "u2"])
    # an interleaved batch: one span per uid, trajectories in batch order
    events.sample_stage_done(Stage.UPDATE_ACTOR, ["u1", "u2", "u1", "u2", "u2"], ["0", "0", "1", "1", "2"], step=1,
                             start_ns=T0_NS, trainer="RayPPOTrainer")
    pre = "from=RayPPOTrainer|to=RayPPOTrainer|stage=DATA_PREPROCESS|global_step=1|detail=traj_uid_generated_by_repeat"
    dispatch = "from=AgentLoopManager|to=AgentLoopWorker_{}|stage=DATA_DISPATCH|global_step=1|detail=dispatched_to_agent_loop_worker"
    update = "from=ActorRolloutRefWorker|to=RayPPOTrainer|stage=TRAIN_UPDATE|global_step=1|detail=actor_parameters_updated"
    uid_row = "from=DataLoader|to=RayPPOTrainer|stage=DATA_PREPROCESS|global_step=1|detail=uid_generated"
    assert contents(proc) == [
        ("u1/sample", "RUNNING", uid_row),
        ("u2/sample", "RUNNING", uid_row),
        ("u1/0", "RUNNING", pre),
        ("u1/1", "RUNNING", pre),
        ("u1/0", "RUNNING", dispatch.format(0)),
        ("u1/1", "RUNNING", dispatch.format(0)),
        ("u2/0", "RUNNING", pre),
        ("u2/1", "RUNNING", pre),
        ("u2/2", "RUNNING", pre),
        ("u2/0", "RUNNING", dispatch.format(0)),
        ("u2/1", "RUNNING", dispatch.format(1)),
        ("u2/2", "RUNNING", dispatch.format(1)),
        ("u1/0", "COMPLETE", update),
        ("u1/1", "COMPLETE", update),
        ("u2/0", "COMPLETE", update),
        ("u2/1", "COMPLETE", update),
        ("u2/2", "COMPLETE", update),
    ]


def test_rollout_worker_v0_flow(csv_proc, clock):
    proc, _ = csv_proc()
    with events.trajectory("u1", "3", step=4, agent_name="tool_agent", worker_index=1):
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call([1, 2, 3], model="qwen") as turn:
                turn.finish([4])
            with events.tool_call("calculator"):
                pass
        with events.reward() as reward:
            reward.score(1)
    assert contents(proc) == [
        ("u1/3", "RUNNING", "from=AgentLoopWorker|to=AgentLoop(tool_agent)|stage=AGENT_LOOP|global_step=4|detail=agent_task_started"),
        ("u1/3", "RUNNING", "from=ToolAgentLoop|to=RolloutReplica|stage=LLM_GENERATE|detail=sending_generate_request"),
        ("u1/3", "RUNNING", "from=RolloutReplica|to=ToolAgentLoop|stage=LLM_GENERATE|detail=received_generate_response"),
        ("u1/3", "RUNNING", "from=Tool|to=ToolAgentLoop|stage=AGENT_TOOL|detail=tool_executed_name=calculator"),
        ("u1/3", "RUNNING", "from=AgentLoop(tool_agent)|to=AgentLoopWorker|stage=AGENT_LOOP|global_step=4|detail=agent_run_completed"),
        ("u1/3", "RUNNING", "from=RewardLoopWorker|to=AgentLoopWorker|stage=ROLLOUT_REWARD|detail=reward_score_computed_score=1.0"),
    ]


def test_reward_without_score_writes_no_row(csv_proc, clock):
    proc, _ = csv_proc()
    with events.trajectory("u1", "0", step=1, agent_name="single_turn_agent"):
        with events.reward():
            pass
    assert [c.rsplit("=", 1)[-1] for _, _, c in contents(proc)] == ["agent_task_started"]


def test_v1_trainer_and_worker_flow(csv_proc, clock):
    proc, pipeline = csv_proc()
    events.rollout_dispatched(["u1", "u1"], ["N/A", "N/A"], [2, 2], step=7, trainer="PPOTrainerV1", variant="v1")
    events.prompt_task_started("u1", step=7, agent_name="single_turn_agent", worker_index=2)
    with events.trajectory("u1", "1", step=7, agent_name="single_turn_agent", trainer_api="v1", n_samples=4,
                           parent=events.prompt_task_parent("u1")):
        with events.agent_run("SingleTurnAgentLoop"):
            pass
    events.prompt_task_finished("u1")
    assert [c for _, _, c in contents(proc)] == [
        "from=PPOTrainerV1|to=AgentLoopManagerTQ|stage=DATA_DISPATCH|global_step=7|detail=dispatched_to_agent_loop_manager",
        "from=AgentLoopManagerTQ|to=AgentLoopWorkerTQ_2|stage=DATA_DISPATCH|global_step=7|detail=dispatched_to_agent_loop_worker",
        "from=AgentLoopWorkerTQ|to=AgentLoop(single_turn_agent)|stage=AGENT_LOOP|global_step=7|detail=agent_task_started",
        "from=AgentLoopWorkerTQ|to=AgentLoopWorkerTQ|stage=AGENT_LOOP|global_step=7|detail=session_started_session_id=1_rollout_n=4",
        "from=AgentLoop(single_turn_agent)|to=AgentLoopWorker|stage=AGENT_LOOP|global_step=7|detail=agent_run_completed",
    ]
    assert [r["sample_id"] for r in read_rows(proc)][:3] == ["u1/sample"] * 3


def test_start_row_is_written_before_the_span_ends(csv_proc, clock):
    proc, _ = csv_proc()
    with events.trajectory("u1", "0", step=1, agent_name="single_turn_agent"):
        with events.agent_run("SingleTurnAgentLoop"):
            with events.llm_call([1]):
                details = [c.rsplit("=", 1)[-1] for _, _, c in contents(proc)]
                assert details == ["agent_task_started", "sending_generate_request"]


def test_failed_llm_call_writes_no_response_row(csv_proc, clock):
    proc, _ = csv_proc()
    with pytest.raises(RuntimeError):
        with events.trajectory("u1", "0", step=1, agent_name="single_turn_agent"):
            with events.agent_run("SingleTurnAgentLoop"):
                with events.llm_call([1]):
                    raise RuntimeError("server down")
    details = [c.rsplit("=", 1)[-1] for _, _, c in contents(proc)]
    assert details == ["agent_task_started", "sending_generate_request"]


# --------------------------------------------------------------------------- validation


def _validation_rollout(validate_uid: str) -> None:
    events.samples_created([validate_uid], step=1, trainer="RayPPOTrainer", validate=True)
    with events.trajectory(validate_uid, "0", step=1, agent_name="tool_agent", validate=True):
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call([1]) as turn:
                turn.finish([2])
            with events.tool_call("calculator"):
                pass
        with events.reward() as reward:
            reward.score(0.5)


def test_validation_writes_no_rows(csv_proc, clock):
    proc, pipeline = csv_proc()
    _validation_rollout("val-1")
    with events.validating():
        events.sample_stage_done(Stage.REWARD, ["val-1"], ["0"], step=1, start_ns=T0_NS, trainer="RayPPOTrainer")
    assert read_rows(proc) == []
    assert pipeline.spans() == ()  # not traced at all by default


def test_traced_validation_still_writes_no_worker_rows(csv_proc, clock):
    proc, pipeline = csv_proc(env={"OTEL_VERL_ENABLED": "1", "OTEL_VERL_TRACE_VALIDATION": "1"})
    with events.trajectory("val-1", "0", step=1, agent_name="tool_agent", validate=True):
        with events.agent_run("ToolAgentLoop"):
            with events.llm_call([1]) as turn:
                turn.finish([2])
            with events.tool_call("calculator"):
                pass
        with events.reward() as reward:
            reward.score(0.5)
    with events.trajectory("u1", "0", step=1, agent_name="tool_agent"):  # a training one still writes
        pass
    assert len(pipeline.spans()) == 5  # the agent run is no span
    assert [r["sample_id"] for r in read_rows(proc)] == ["u1/0"]


# --------------------------------------------------------------------------- stdout, losses


def test_flow_trace_stdout_is_opt_in(csv_proc, clock, capsys):
    import io
    import time

    proc, _ = csv_proc()
    events.samples_created(["u1"], step=2, trainer="RayPPOTrainer")
    read_rows(proc)
    assert capsys.readouterr().out == ""
    proc.writer.close()

    out = io.StringIO()
    proc, _ = csv_proc(flow_stdout=True, stdout=out)
    events.samples_created(["u2"], step=2, trainer="RayPPOTrainer")
    events.sample_stage_done(Stage.ADVANTAGE, ["u2"], ["N/A"], step=-1, start_ns=T0_NS, trainer="RayPPOTrainer")
    read_rows(proc)
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0_NS / 1e9))
    assert out.getvalue().splitlines() == [
        f"[FLOW_TRACE] {iso} | uid=u2 | traj_uid=N/A | from=DataLoader | to=RayPPOTrainer | stage=DATA_PREPROCESS"
        " | global_step=2 | detail=uid_generated",
        f"[FLOW_TRACE] {iso} | uid=u2 | traj_uid=N/A | from=RayPPOTrainer | to=RayPPOTrainer | stage=TRAIN_ADVANTAGE"
        " | detail=advantage_computed",
    ]


def test_refused_rows_are_counted_not_silent(csv_proc, clock, monkeypatch):
    import threading

    from otel_verl.exporters import _writer

    writing, release, real_append = threading.Event(), threading.Event(), _writer.append_whole

    def slow_append(fd, data):
        writing.set()
        release.wait(10)
        real_append(fd, data)

    monkeypatch.setattr(_writer, "append_whole", slow_append)
    from otel_verl.legacy.sample_csv import ROW_BYTES

    proc, _ = csv_proc(max_pending_bytes=8 * ROW_BYTES)
    for step in (1, 2):  # the first stage's rows are still being written when the second's come
        events.sample_stage_done(Stage.ADVANTAGE, ["u1"] * 16, [str(i) for i in range(16)], step=step,
                                 start_ns=T0_NS, trainer="RayPPOTrainer")
        writing.wait(5)
    release.set()
    proc.force_flush()
    assert len(read_rows(proc)) == 16  # a job over the whole bound is taken when it waits alone
    assert proc.writer.dropped_lines == 16
    assert health.snapshot()["dropped"] == {"sample_csv": 16}


def test_unwritable_directory_is_counted_and_never_raises(make_pipeline, tmp_path, clock):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: makedirs below it fails even as root")
    proc = SampleCsvProcessor(str(blocker / "trace"), discovery_path=str(blocker / "x" / "discovery.txt"))
    make_pipeline([proc])
    events.samples_created(["u1", "u2"], step=1, trainer="RayPPOTrainer")
    assert proc.force_flush()
    assert proc.writer.dropped_lines == 2 and proc.writer.written_lines == 0
    assert health.snapshot()["dropped"] == {"sample_csv": 2}


def test_rows_after_the_trace_dir_is_deleted_go_to_a_new_file_at_its_path(csv_proc, clock, tmp_path):
    proc, _ = csv_proc()
    events.samples_created(["u1"], step=1, trainer="RayPPOTrainer")
    assert proc.force_flush()
    shutil.rmtree(tmp_path / "trace")  # a cleanup job, mid-run
    events.sample_stage_done(Stage.ADVANTAGE, ["u1"] * 4, [str(i) for i in range(4)], step=1, start_ns=T0_NS,
                             trainer="RayPPOTrainer")
    assert [r["sample_id"] for r in read_rows(proc)] == ["u1/0", "u1/1", "u1/2", "u1/3"]
    assert proc.writer.written_lines + proc.writer.dropped_lines == 5
    assert health.snapshot()["dropped"] == {}


def test_rows_after_the_file_is_renamed_go_to_a_new_file_at_its_path(csv_proc, clock):
    proc, _ = csv_proc()
    proc.writer.reopen_check_s = 0.0  # look at the path before every write
    events.samples_created(["u1"], step=1, trainer="RayPPOTrainer")
    assert proc.force_flush()
    os.rename(proc.path, proc.path + ".1")  # a log shipper, mid-run
    events.sample_stage_done(Stage.ADVANTAGE, ["u1"] * 4, [str(i) for i in range(4)], step=1, start_ns=T0_NS,
                             trainer="RayPPOTrainer")
    assert [r["sample_id"] for r in read_rows(proc)] == ["u1/0", "u1/1", "u1/2", "u1/3"]
    with open(proc.path + ".1", newline="") as f:
        assert [r[2] for r in csv.reader(f)] == ["u1/sample"]
    assert proc.writer.written_lines + proc.writer.dropped_lines == 5
    assert health.snapshot()["dropped"] == {}


def test_shutdown_flushes_everything_accepted(csv_proc, clock):
    proc, _ = csv_proc()
    for step in range(50):
        events.sample_stage_done(Stage.ADVANTAGE, ["u1"] * 16, [str(i) for i in range(16)], step=step,
                                 start_ns=T0_NS, trainer="RayPPOTrainer")
    proc.shutdown()
    with open(proc.path, newline="") as f:
        assert len(list(csv.reader(f))) == 800
    assert proc.writer.written_lines == 800


def test_forked_child_writes_its_own_file(csv_proc, clock):
    proc, _ = csv_proc()
    events.samples_created(["parent"], step=1, trainer="RayPPOTrainer")  # maybe still queued at fork
    pid = os.fork()
    if pid == 0:  # child: write one row, flush, leave without pytest's teardown
        code = 1
        try:
            events.samples_created(["child"], step=1, trainer="RayPPOTrainer")
            code = 0 if proc.force_flush(10_000) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_path = proc.path.replace(f"-pid{os.getpid()}.csv", f"-pid{pid}.csv")
    with open(child_path, newline="") as f:
        assert [r[2] for r in csv.reader(f)] == ["child/sample"]
    assert [r["sample_id"] for r in read_rows(proc)] == ["parent/sample"]  # written once, by the parent


def test_rows_that_cannot_be_formatted_are_counted(csv_proc, clock, monkeypatch):
    proc, _ = csv_proc()

    def broken(*args, **kwargs):
        raise RuntimeError("no format")

    monkeypatch.setattr("otel_verl.legacy.sample_csv.render_rows", broken)
    with events.trajectory("u1", "0", step=1, agent_name="single_turn_agent"):  # one row
        pass
    assert proc.force_flush()
    assert proc.writer.dropped_lines == 1
    assert health.snapshot()["dropped"] and health.snapshot()["failures"]
