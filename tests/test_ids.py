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
