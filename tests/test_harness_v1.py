"""The v1 CPU harness runs verl's real v1 trainer (TransferQueue, ReplayBuffer, AgentLoopManagerTQ)
for each trainer mode, stand-ins only for GPUs. Each mode runs in a child interpreter with its own
Ray cluster and TransferQueue. No tracing is involved.

What is checked comes from real verl behaviour (``CHECKS``, per mode; the traced demo runs of
test_demo_v1.py must pass them too, here the sync mode runs untraced): the steps ran, each step trained prompts * n
trajectories read from TransferQueue (keys ``{uid}_{session_id}_0``, n sessions per prompt uid),
verl's rule-based gsm8k reward scored them, the weights were synced once per step, and in the
async modes step 2 trains trajectories of prompts submitted in step 1 (warm-up batch) while step
2's own prompts are still generating.
"""

from __future__ import annotations

import pytest

from demo_process import run_in_child

pytestmark = [pytest.mark.verl, pytest.mark.e2e, pytest.mark.filterwarnings("ignore")]

STEPS, PROMPTS, N = 2, 4, 4


def _run(tmp_path, mode, **kw):
    args = {"output_dir": str(tmp_path / mode), "mode": mode, "steps": STEPS, "prompts": PROMPTS, "n": N}
    args.update(kw)
    return run_in_child("harness_v1", args, str(tmp_path / f"child-{mode}"))


def check_common(summary, mode):
    """What every v1 harness run must show (also asserted on the traced demo runs)."""
    assert summary["mode"] == mode
    assert summary["steps_run"] == STEPS and summary["global_steps"] == [1, 2]
    # every step trained prompts * n trajectories (no padding), read from TransferQueue by verl's tqbridge
    assert summary["trajectories_per_step"] == {str(s): PROMPTS * N for s in (1, 2)}
    assert summary["dumped_trajectories_per_step"] == {str(s): PROMPTS * N for s in (1, 2)}
    all_keys = set()
    for step in ("1", "2"):
        trained = summary["trained_per_step"][step]
        assert trained["padding"] == 0
        keys = trained["keys"]
        assert len(set(keys)) == PROMPTS * N
        # key format {uid}_{session_id}_{index}: n sessions per prompt uid, one output each
        parts = [k.rsplit("_", 2) for k in keys]
        assert {p[2] for p in parts} == {"0"}
        assert len(trained["prompt_uids"]) == PROMPTS
        for uid in trained["prompt_uids"]:
            assert sorted(int(p[1]) for p in parts if p[0] == uid) == list(range(N))
        # the rollout dump (verl's _log_rollout_data) lists the same keys
        assert sorted(summary["dumped_keys_per_step"][step]) == sorted(keys)
        all_keys |= set(keys)
        # verl's gsm8k reward over the stand-in's answers: mixed 0/1 scores
        assert summary["scores_per_step"][step]["distinct"] == [0.0, 1.0]
        assert summary["metrics_per_step"][step]["response_length/mean"] > 0
    assert len(all_keys) == STEPS * PROMPTS * N  # nothing trained twice
    calls = summary["worker_group_calls"]
    assert calls["compute_log_prob"] == calls["compute_ref_log_prob"] == calls["update_actor"]


def check_sync(summary):
    check_common(summary, "sync")
    assert "PPOTrainerSync" in summary["trainer_classes"]
    assert summary["worker_group_calls"]["update_actor"] == STEPS
    assert summary["weight_versions"] == [0, 1, 2]  # on_init_end + on_step_end of each step
    for step in ("1", "2"):
        trained = summary["trained_per_step"][step]
        # sync: each step trains exactly the prompts it submitted
        assert trained["from_earlier_steps"] == 0
        assert set(trained["prompt_global_steps"]) == {int(step)}
    assert summary["server"]["aborted"] == 0


def check_colocate_async(summary):
    check_common(summary, "colocate_async")
    assert "PPOTrainerColocateAsync" in summary["trainer_classes"]
    assert summary["worker_group_calls"]["update_actor"] == STEPS
    # on_train_begin submits a warm-up batch: step 1 trains step-1 prompts, step 2 trains the
    # remaining step-1 prompts (generated while step 1 trained) - a real off-policy step. A
    # step-1 prompt whose requests the pause turned away (the engine rejects while paused)
    # retries after it, and a step-2 prompt may finish first and share step 2's batch.
    assert set(summary["trained_per_step"]["1"]["prompt_global_steps"]) == {1}
    assert N <= summary["trained_per_step"]["2"]["from_earlier_steps"] <= PROMPTS * N
    # on_sample_end paused (aborted) the replicas each step
    assert summary["server"]["pauses"] >= STEPS


def check_separate_async(summary):
    check_common(summary, "separate_async")
    assert "PPOTrainerSeparateAsync" in summary["trainer_classes"]
    psync = summary["config"]["parameter_sync_step"]
    # parameter_sync_step local updates per step (Decoupled PPO: pi_old saved/restored on CPU)
    calls = summary["worker_group_calls"]
    assert calls["update_actor"] == STEPS * psync
    assert summary["trained_per_step"]["1"]["updates"] == psync
    assert calls["save_model_to_cpu"] == STEPS * psync and calls["restore_model_from_cpu"] == 2 * STEPS * (psync - 1)
    # step 2 trains prompts step 1 produced (all of them, unless a request the stand-in
    # interrupted was still being resumed: verl waits a second before each resume)
    assert 0 < summary["trained_per_step"]["2"]["from_earlier_steps"] <= PROMPTS * N
    # standalone replica generated; the hybrid one left the balancer at step 1 (switch_to_trainer)
    kinds = {s["kind"]: s for s in summary["server"]["per_server"]}
    assert set(kinds) == {"hybrid", "standalone"}
    assert kinds["standalone"]["requests"] > 0
    assert kinds["standalone"]["global_steps"] == STEPS  # stand-in NCCL sync set the version
    assert "timing_s/switch_to_trainer" in summary["metrics_per_step"]["1"]


CHECKS = {"sync": check_sync, "colocate_async": check_colocate_async, "separate_async": check_separate_async}


@pytest.mark.timeout(900)
def test_v1_sync_untraced(tmp_path):
    """The harness alone, no tracing anywhere (the traced runs of every mode, with these
    same checks, are in test_demo_v1.py)."""
    summary = _run(tmp_path, "sync")
    check_sync(summary)
    # single-turn agent: one server request per trajectory
    assert summary["server"]["requests"] == STEPS * PROMPTS * N
