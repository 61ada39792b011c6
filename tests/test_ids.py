"""uid → trace id: stable across processes, valid, for UUID and other uids; id normalisation."""

import subprocess
import sys
import uuid

import numpy as np
import pytest

from otel_verl.ids import id_list, id_str, root_span_id_for_uid, sample_index, trace_id_for_uid


def test_uuid_uid_gives_its_own_128_bits():
    uid = str(uuid.uuid4())
    assert trace_id_for_uid(uid) == uuid.UUID(uid).int


@pytest.mark.parametrize("uid", ["prompt-17", "", "x" * 10_000, "日本語", "00000000-0000-0000-0000-000000000000"])
def test_other_uids_hash_to_valid_ids(uid):
    tid = trace_id_for_uid(uid)
    assert 0 < tid < 1 << 128
    assert 0 < root_span_id_for_uid(uid) < 1 << 64
    assert tid == trace_id_for_uid(uid)


def test_distinct_uids_give_distinct_ids():
    uids = [f"prompt-{i}" for i in range(2000)]
    assert len({trace_id_for_uid(u) for u in uids}) == len(uids)
    assert len({root_span_id_for_uid(u) for u in uids}) == len(uids)


def test_ids_are_stable_across_processes():
    uids = [str(uuid.uuid4()), "prompt-17", "a/b c"]
    code = (
        "import sys; from otel_verl.ids import trace_id_for_uid, root_span_id_for_uid\n"
        "for u in sys.argv[1:]: print(trace_id_for_uid(u), root_span_id_for_uid(u))"
    )
    out = subprocess.run([sys.executable, "-c", code, *uids], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}).stdout.split("\n")
    for uid, line in zip(uids, out):
        assert line == f"{trace_id_for_uid(uid)} {root_span_id_for_uid(uid)}"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("abc", "abc"),
        (None, "None"),
        (np.int64(3), "3"),
        (np.array(["u1"], dtype=object), "u1"),
        (np.str_("u2"), "u2"),
        (b"raw", "raw"),
        (7, "7"),
    ],
)
def test_id_str_normalises_what_verl_hands_over(value, expected):
    assert id_str(value) == expected


@pytest.mark.verl
def test_id_str_unwraps_tensordicts_non_tensor_data():
    from tensordict import NonTensorData

    assert id_str(NonTensorData("wrapped")) == "wrapped"


def test_id_str_bounds_very_long_ids():
    assert len(id_str("u" * 100_000)) == 256


def test_id_list_accepts_arrays_lists_and_scalars():
    assert id_list(np.array(["a", "b"], dtype=object)) == ["a", "b"]
    assert id_list(np.arange(3)) == ["0", "1", "2"]
    assert id_list("solo") == ["solo"]
    assert id_list(None) == []
    assert id_list([None, np.int32(1)]) == ["None", "1"]


def test_sample_index():
    assert sample_index("3") == 3
    assert sample_index("N/A") is None
    assert sample_index("baseline") is None


def test_id_list_writes_lone_surrogates_as_replacement_characters():
    import json

    odd = json.loads('"u\\ud800"')
    assert id_list(["plain", odd]) == ["plain", "u\ufffd"]


def test_a_long_ids_cut_and_hash_are_those_every_process_of_a_run_derives():
    """The trace id derivation is a contract across processes (docs/SPANS.md): an id up
    to 65,536 characters keeps its head and a hash of the whole of it."""
    import hashlib

    for uid in ("x" * 300, "日本" * 20_000):
        digest = hashlib.blake2b(uid.encode("utf-8"), digest_size=8).hexdigest()
        assert id_str(uid) == f"{uid[:239]}~{digest}"


def test_huge_ids_stay_apart_and_are_counted():
    from otel_verl import health

    size = 50 * 1024 * 1024
    base = "u" * size
    variants = [base, base + "u", "v" + base[1:], base[:-1] + "v"]  # its length, head and tail
    cut = [id_str(uid) for uid in variants]
    assert all(len(c) == 256 and c.startswith("u" * 200) == (uid[0] == "u") for c, uid in zip(cut, variants))
    assert len(set(cut)) == len(variants)
    assert id_str(base) == cut[0]  # the same in every call
    assert id_str(base.encode()).startswith("u" * 200)  # bytes: decoded no more than their samples
    assert health.snapshot()["failures"] == {"ids.long_id": len(variants) + 2}  # one per id cut so


def test_a_50_mb_uid_costs_the_caller_a_bounded_time_and_its_spans_come_out(make_pipeline):
    """Hashing the whole of a 50 MB uid cost ~90 ms at every events-API call that names it
    (the training loop's, the agent loops' event loop): now a bound, whatever its size."""
    import time

    from otel_verl import carriers, events, health

    pipeline = make_pipeline()
    uid = "u" * (50 * 1024 * 1024)

    def calls() -> float:
        fresh = uid[:-1] + "v"  # a new object: no cached hash
        started = time.perf_counter()
        events.samples_created([fresh], step=1, trainer="RayPPOTrainer")
        with events.trajectory(fresh, "0", step=1, agent_name="tool_agent", provider="sglang"):
            pass
        carriers.take_arrived(fresh)
        events.prompt_task_started(fresh, step=1, agent_name="tool_agent")
        events.prompt_task_finished(fresh)
        events.samples_finished([fresh], "trained")
        return time.perf_counter() - started

    best = min(calls() for _ in range(3))
    assert best < 0.05, f"{best * 1e3:.0f} ms for 6 calls (hashing the whole uid: ~90 ms a call)"
    names = sorted(span.name for span in pipeline.spans())
    assert len(names) == 9 and health.snapshot()["failures"]["ids.long_id"] > 0
    cut = id_str(uid[:-1] + "v")
    assert {span.attributes.get("verl.uid") for span in pipeline.spans()} == {cut}
