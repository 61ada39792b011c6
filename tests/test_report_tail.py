"""The tail of each step in ``otel-verl report`` (critical path, replicas, waiting,
staleness), on synthetic runs whose answers are known exactly (``otlp_runs``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from otel_verl.tools.cli import main
from store_checks import report_of

from otlp_runs import REPLICA_A, REPLICA_B, STRAGGLER, Run, async_run, straggler_run

exact = lambda value: pytest.approx(value, abs=1e-9)  # noqa: E731  (times are whole nanoseconds)


def _report(run: Run, tmp_path) -> dict:
    return report_of([run.write(str(tmp_path / run.run_id))])


def _row(report: dict, step: int) -> dict:
    [row] = [r for r in report["tail"]["steps"] if r["step"] == step]
    return row


def test_the_critical_path_is_the_straggler_with_its_replica_and_split(tmp_path):
    report = _report(straggler_run(), tmp_path)
    row = _row(report, 1)
    assert row["rollout_window"]["wall_s"] == exact(10.0) and row["rollout_window"]["trajectories"] == 4
    path = row["critical_path"]
    assert (path["uid"], path["traj_uid"]) == STRAGGLER
    assert path["replica"] == REPLICA_B and path["replicas"] == [REPLICA_B]
    assert path["started_s"] == exact(0.0) and path["duration_s"] == exact(10.0)
    server = path["llm_server_s"]
    # server: e2e 8 = queue 1 + prefill (ttft 3 - queue) 2 + decode 5; client = the chat's 9 s - 8
    assert (server["queue"], server["prefill"], server["decode"]) == (exact(1.0), exact(2.0), exact(5.0))
    assert server["client_overhead"] == exact(1.0)
    assert (path["tool_s"], path["reward_s"], path["other_s"]) == (exact(0.2), exact(0.2), exact(0.6))
    # the split is the slowest-trajectories one: the straggler heads that list too
    slowest = report["slowest_trajectories"][0]
    assert {key: path[key] for key in slowest} == slowest

    # step 2: u3/1 and u4/0 end together; the longer one set the window's end
    path = _row(report, 2)["critical_path"]
    assert (path["uid"], path["traj_uid"], path["replica"]) == ("u3-2", "1", REPLICA_A)
    assert path["duration_s"] == exact(1.5)


def test_busiest_and_idlest_replica_by_the_union_of_their_requests(tmp_path):
    report = _report(straggler_run(), tmp_path)
    assert report["tail"]["replicas"] == [REPLICA_A, REPLICA_B]
    load = _row(report, 1)["replicas"]
    # B: [1.2, 2.5] and [2, 10] overlap, 8.8 s busy (their sum would be 9.3); A: [1.2, 1.8] and [1.3, 2.0]
    assert (load["busiest"]["replica"], load["busiest"]["busy_s"], load["busiest"]["requests"]) == (REPLICA_B, exact(8.8), 2)
    assert (load["idlest"]["replica"], load["idlest"]["busy_s"], load["idlest"]["requests"]) == (REPLICA_A, exact(0.8), 2)
    assert load["busiest"]["busy_fraction"] == exact(0.88)
    # step 2: B served nothing and is still ranked, with 0
    load = _row(report, 2)["replicas"]
    assert (load["busiest"]["replica"], load["busiest"]["busy_s"], load["busiest"]["requests"]) == (REPLICA_A, exact(1.2), 4)
    assert (load["idlest"]["replica"], load["idlest"]["busy_s"], load["idlest"]["requests"]) == (REPLICA_B, 0.0, 0)


def test_sync_waits_are_the_rollout_and_the_training(tmp_path):
    report = _report(straggler_run(), tmp_path)
    # step 1 [0, 20]: the trainer waits through generation [0, 12]; trajectories run in [1, 11] only
    assert _row(report, 1)["waiting"] == {"step_s": exact(20.0), "training_s": exact(12.0), "rollout_s": exact(10.0)}
    # step 2 [20, 30]: generation [20, 23]; trajectories in [21, 22.5]
    assert _row(report, 2)["waiting"] == {"step_s": exact(10.0), "training_s": exact(3.0), "rollout_s": exact(8.5)}


def test_async_waits_come_from_the_overlap(tmp_path):
    report = _report(async_run(), tmp_path)
    assert report["shape"] == {"trainer": "PPOTrainerV1", "layout": "disaggregated", "mode": "async",
                               "prompts": 2, "n": 1, "steps": 1}
    wait = _row(report, 1)["waiting"]
    # the trainer waits before its first stage [0, 1] and in both fetch_batch stages [1, 3], [6, 7]:
    # not in [9.5, 10], after its last stage
    assert wait["training_s"] == exact(4.0)
    # the rollouter runs in [0, 8] and [9.5, 10]: a4 stays open through the sync, but its
    # turn was aborted at 8.0 and resumed at 9.6
    assert wait["rollout_s"] == exact(1.5)
    # replicas named by verl.llm.server_id; in step 1's window [-2, 8] (a1 and a2, which step 1
    # trained) gpu-1 serves a2's attempt and a4's first one: [2.7, 7.8] u [5.2, 8.0]
    load = _row(report, 1)["replicas"]
    assert (load["busiest"]["replica"], load["busiest"]["busy_s"], load["busiest"]["requests"]) == ("gpu-1", exact(5.3), 2)
    assert (load["idlest"]["replica"], load["idlest"]["busy_s"], load["idlest"]["requests"]) == ("gpu-0", exact(4.6), 1)


def test_async_steps_tail_the_trajectories_they_trained(tmp_path):
    """Step 1 trained a1 and a2, which step 0's weights generated; a4 (generated in step 1)
    is step 2's by its root's verl.trained_step; a3, never trained, gated no step."""
    report = _report(async_run(), tmp_path)
    row = _row(report, 1)
    assert row["rollout_window"]["trajectories"] == 2 and row["rollout_window"]["generation_steps"] == [0]
    assert row["rollout_window"]["wall_s"] == exact(10.0)
    path = row["critical_path"]
    assert (path["uid"], path["generation_step"], path["replica"]) == ("a2", 0, "gpu-1")
    row = _row(report, 2)
    assert (row["critical_path"]["uid"], row["critical_path"]["generation_step"]) == ("a4", 1)
    assert row["waiting"] is None  # the run ends before step 2's span
    assert [r["step"] for r in report["tail"]["steps"]] == [1, 2] and report["tail"]["untrained"] == 1
    result = CliRunner().invoke(main, ["report", str(tmp_path / "async-run")])
    assert result.exit_code == 0, result.output
    [line] = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["1"] and "a2/0" in line]
    assert line[:4] == ["1", "10.000", "a2/0", "0"]
    assert "1 trajectories trained in no step" in result.stdout


def test_a_trajectory_belongs_to_the_step_whose_sample_stage_lists_it(tmp_path):
    """One prompt's two trajectories trained in different steps: each is its own step's,
    by the verl.traj_uids of the sample-stage spans."""
    run = Run("split", trainer="PPOTrainerV1", layout="disaggregated")
    run.step(2, 10, 20, [("fetch_batch", 10, 12), ("update_actor", 12, 20)])
    run.step(3, 20, 30, [("fetch_batch", 20, 22), ("update_actor", 22, 30)])
    root = run.sample("p", 0, 29, trained_in=2, traj_uids=["0"])
    run.sample_stage(root, "update_actor", 3, 28, 29, traj_uids=["1"])
    run.trajectory(root, "0", 1, 1, 5)
    run.trajectory(root, "1", 1, 2, 9)
    report = _report(run, tmp_path)
    assert report["shape"]["mode"] == "async"
    paths = {r["step"]: (r["critical_path"]["traj_uid"], r["critical_path"]["generation_step"]) for r in report["tail"]["steps"]}
    assert paths == {2: ("0", 1), 3: ("1", 1)}


def test_the_staleness_histogram_per_trained_step(tmp_path):
    staleness = _report(async_run(), tmp_path)["tail"]["staleness"]
    assert staleness["lineage"] and staleness["note"] is None
    assert staleness["per_step"] == [  # a3's root has no lineage: left out
        {"trained_step": 1, "samples": 2, "histogram": [{"staleness": 1, "samples": 2}]},
        {"trained_step": 2, "samples": 1, "histogram": [{"staleness": 2, "samples": 1}]},
    ]
    staleness = _report(straggler_run(), tmp_path)["tail"]["staleness"]
    assert [(r["trained_step"], [(h["staleness"], h["samples"]) for h in r["histogram"]]) for r in staleness["per_step"]] == [
        (1, [(0, 2)]), (2, [(0, 1), (1, 1)])]


def test_without_lineage_the_report_says_so(tmp_path):
    run = straggler_run(lineage=False)
    staleness = _report(run, tmp_path)["tail"]["staleness"]
    assert staleness == {"lineage": False, "note": "no lineage in these spans", "per_step": []}
    result = CliRunner().invoke(main, ["report", str(tmp_path / run.run_id)])
    assert result.exit_code == 0, result.output
    assert "Staleness: no lineage in these spans" in result.stdout


def test_the_tail_in_text_and_json(tmp_path):
    path = straggler_run().write(str(tmp_path / "run"))
    result = CliRunner().invoke(main, ["report", path])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()

    def table(title: str) -> list:
        start = next(i for i, line in enumerate(lines) if line.startswith(title))
        end = next((i for i in range(start + 3, len(lines)) if not lines[i].strip()), len(lines))
        return [line.split() for line in lines[start + 3:end]]

    assert table("Critical path per step") == [
        ["1", "10.000", "u2/1", "1", "0.000", "10.000", REPLICA_B, "1.000", "2.000", "5.000", "1.000", "0.200", "0.200",
         "0.600"],
        ["2", "1.500", "u3-2/1", "2", "0.000", "1.500", REPLICA_A, "0.100", "0.200", "0.300", "0.400", "0.000", "0.000",
         "0.500"],
    ]
    assert table("LLM server replicas per step (2 in the run)") == [
        ["1", REPLICA_B, "8.800", "2", REPLICA_A, "0.800", "2"],
        ["2", REPLICA_A, "1.200", "4", REPLICA_B, "0.000", "0"],
    ]
    assert table("Waiting per step") == [["1", "20.000", "12.000", "10.000"], ["2", "10.000", "3.000", "8.500"]]
    assert table("Staleness of the trained samples") == [["1", "2", "2", "0"], ["2", "2", "1", "1"]]

    as_json = CliRunner().invoke(main, ["report", path, "--json"])
    assert json.loads(as_json.stdout)["tail"] == json.loads(json.dumps(report_of([path])["tail"]))


def test_a_run_without_server_spans_or_ids_names_no_replica(tmp_path):
    run = Run("bare")
    run.step(1, 0, 5, [("generation", 0, 3), ("update_actor", 3, 5)])
    run.step(2, 5, 8, [("update_actor", 6, 8)])  # trained on what step 1 left: no rollout of its own
    root = run.sample("b1", 0, 5, trained_in=1)
    run.trajectory(root, "0", 1, 0.5, 2.5, [{"at": (0.6, 2.4)}])
    report = _report(run, tmp_path)
    assert report["tail"]["replicas"] == []
    row = _row(report, 1)
    assert row["replicas"] is None and row["critical_path"]["replica"] is None
    row = _row(report, 2)
    assert row["critical_path"] is None and row["rollout_window"] is None
    assert row["waiting"] == {"step_s": exact(3.0), "training_s": exact(1.0), "rollout_s": exact(3.0)}
    result = CliRunner().invoke(main, ["report", str(tmp_path / "bare")])
    assert result.exit_code == 0 and "LLM server replicas: none named in these spans" in result.stdout
    assert ["2", "-", "no", "trajectories", *["-"] * 11] in [line.split() for line in result.stdout.splitlines()]


def test_a_resumed_turns_requests_are_its_attempts_server_spans(tmp_path):
    """verl's resuming client: the server spans hang under the turn's attempts, each
    one request of the replica that served it; the turn is no request of its own."""
    from otel_verl import semconv as sc
    from otlp_runs import WORKER, server_resource, timing

    run = Run("resumed", trainer="PPOTrainerV1")
    run.step(1, 0, 10, [("generation", 0, 6), ("update_actor", 6, 9)])
    root = run.sample("r1", 0, 9, trained_in=1)
    traj = run.trajectory(root, "0", 1, 1, 5)
    chat = run.span("chat tiny", 1.1, 4.9, {sc.UID: "r1", sc.TRAJ_UID: "0", sc.GLOBAL_STEP: 1,
                                           sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT}, parent=traj, resource=WORKER)
    for lo, hi, actor in ((1.2, 2.0, "replica-a"), (3.0, 4.8, "replica-b")):
        attempt = run.span(sc.SPAN_LLM_ATTEMPT, lo, hi, {sc.UID: "r1"}, parent=chat, resource=WORKER)
        run.span(sc.SPAN_LLM_SERVER, lo + 0.1, hi - 0.1, {sc.llm_server_meta_attribute(k): v
                                                          for k, v in timing(hi - lo - 0.2, 0.0, 0.1).items()},
                 parent=attempt, resource=server_resource(actor))
    row = _row(_report(run, tmp_path), 1)
    per = {r["replica"]: (r["busy_s"], r["requests"]) for r in row["replicas"]["per_replica"]}
    assert per == {"replica-a": (exact(0.6), 1), "replica-b": (exact(1.6), 1)}
    assert row["critical_path"]["replica"] == "replica-b" and row["critical_path"]["replicas"] == ["replica-a", "replica-b"]
    # paused between the attempts [2.0, 3.0]: the rollout side waits 10 - (5 - 1 - 1)
    assert row["waiting"]["rollout_s"] == exact(7.0)
