"""Trajectory JSONL: the legacy line, byte for byte, driven through the real events API.

Contract: LEGACY_FORMATS.md §3 (key orders, timing rules, the template-overhead slice).
Time is a controllable clock patched into ``otel_verl.clock`` so lines are exact.
"""

from __future__ import annotations

import fractions
import glob
import json
import os
import re
import threading
import time
import types
from typing import Any, Dict, List

import numpy as np
import pytest

from otel_verl import events, health
from otel_verl.legacy import trajectory_jsonl as tj
from otel_verl.legacy.trajectory_jsonl import TrajectoryJsonlProcessor

UID = "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5"
T0 = 1787215072.0  # all test times are binary-exact (multiples of 1/8 s)

REST_KEYS = [
    "request_id", "n_samples", "global_step", "created_at_ts", "completed_at_ts", "total_time_ms",
    "turns", "initial_prompt_text", "agent_metrics",
]
TURN_KEYS = [
    "turn_index", "prompt_token_count", "completion_text", "completion_token_count", "finish_reason",
    "observation_text", "start_ts", "end_ts", "observation_start_ts", "observation_end_ts",
    "turn_total_time_ms", "completion_time_ms", "observation_time_ms", "sglang_time_ms",
    "sglang_queue_time_ms", "sglang_ttft_ms", "sglang_prefill_ms", "sglang_decode_time_ms",
    "template_overhead_tokens", "template_overhead_text",
]


# --------------------------------------------------------------------------- helpers


class CharTokenizer:
    """A tokenizer stand-in: one token per character, chat-template markers as special
    tokens; ids are assigned on first sight, so any text (emoji included) encodes."""

    SPECIAL = ("<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.pieces: List[str] = list(self.SPECIAL)
        self.index = {p: i for i, p in enumerate(self.pieces)}
        self.threads: List[str] = []  # where decode/encode ran

    def _id(self, piece: str) -> int:
        if piece not in self.index:
            self.index[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.index[piece]

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        self.threads.append(threading.current_thread().name)
        return self.ids(text)

    def ids(self, text: str) -> List[int]:
        """encode, for the test building its prompts (not recorded)."""
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in self.SPECIAL if text.startswith(s, i)), None)
            piece = special or text[i]
            ids.append(self._id(piece))
            i += len(piece)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.threads.append(threading.current_thread().name)
        pieces = (self.pieces[i] for i in ids)
        return "".join(p for p in pieces if not (skip_special_tokens and p in self.SPECIAL))


class BpeTokenizer:
    """A real byte-level BPE (``tokenizers``), trained in memory on the test texts, behind
    the Hugging Face ``encode``/``decode`` signatures the processor calls."""

    def __init__(self, corpus: List[str]) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        self.tk = Tokenizer(models.BPE())
        self.tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(CharTokenizer.SPECIAL),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        self.tk.train_from_iterator(corpus, trainer)
        self.threads: List[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        self.threads.append(threading.current_thread().name)
        return self.ids(text)

    def ids(self, text: str) -> List[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.threads.append(threading.current_thread().name)
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)


class Clock:
    """The time otel_verl reads (its wall and monotonic clocks alike), set by the test
    before each event."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def time_ns(self) -> int:
        return int(fractions.Fraction(self.now) * 10**9)  # exact: the lines' times come back as set


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("otel_verl.clock.time", types.SimpleNamespace(time_ns=c.time_ns, monotonic_ns=c.time_ns))
    return c


@pytest.fixture(params=[False, True], ids=["slim_spans", "sdk_spans"])
def traj_dir(tmp_path, make_pipeline, request):
    """(processor, trace_dir, pipeline): a pipeline with only the JSONL processor, the
    events API on SlimSpans or on the SDK's spans."""
    proc = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=str(tmp_path / "discovery.txt"))
    pipeline = make_pipeline([proc], sdk_spans=request.param)
    return proc, tmp_path, pipeline


def read_lines(trace_dir) -> List[str]:
    d = os.path.join(str(trace_dir), "trajectory")
    if not os.path.isdir(d):
        return []
    out = []
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), encoding="utf-8") as f:
            out.extend(f.read().splitlines())
    return out


def read_trajectories(trace_dir) -> List[Dict[str, Any]]:
    """The consumer's view: each line's top-level object with ``raw_message`` decoded."""
    out = []
    for line in read_lines(trace_dir):
        top = json.loads(line)
        out.append({**top, "raw_message": json.loads(top["raw_message"])})
    return out


def run_single_turn(clock, tok, *, traj_uid="3", prompt="<|im_start|>user\nHé 世界<|im_end|>\n<|im_start|>assistant\n",
                    completion="Réponse 🙂<|im_end|>", server_meta=None, output_tokens=None, validate=False,
                    metrics=None, score=1.0, stop_reason="stop"):
    clock.now = T0
    with events.trajectory(UID, traj_uid, step=3, agent_name="single_turn_agent", n_samples=4,
                           decode=tok.decode if tok else None, encode=tok.encode if tok else None,
                           validate=validate):
        with events.agent_run("SingleTurnAgentLoop"):
            clock.now = T0 + 0.125
            with events.llm_call(tok.ids(prompt) if tok else [1, 2, 3], model="qwen") as turn:
                clock.now = T0 + 1.375
                turn.finish(tok.ids(completion) if tok else [4, 5], stop_reason=stop_reason,
                            output_tokens=output_tokens, server_meta=server_meta)
        clock.now = T0 + 1.4375
        events.agent_metrics(metrics if metrics is not None else
                             {"generate_sequences": 1.25, "tool_calls": 0.0, "num_preempted": -1})
        with events.reward() as reward:
            if score is not None:
                reward.score(score)
        clock.now = T0 + 1.5


# --------------------------------------------------------------------------- golden line


GOLDEN_SINGLE_TURN = (
    '{"prompt_uid": "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5", "sample_index": 3, "raw_message": '
    '"{\\"request_id\\": \\"3\\", \\"n_samples\\": 4, \\"global_step\\": 3, '
    '\\"created_at_ts\\": 1787215072.0, \\"completed_at_ts\\": 1787215073.5, \\"total_time_ms\\": 1500.0, '
    '\\"turns\\": [{\\"turn_index\\": 0, \\"prompt_token_count\\": 24, '
    '\\"completion_text\\": \\"Réponse 🙂<|im_end|>\\", \\"completion_token_count\\": 10, '
    '\\"finish_reason\\": \\"stop\\", \\"observation_text\\": null, '
    '\\"start_ts\\": 1787215072.125, \\"end_ts\\": 1787215073.375, '
    '\\"observation_start_ts\\": null, \\"observation_end_ts\\": null, '
    '\\"turn_total_time_ms\\": 1250.0, \\"completion_time_ms\\": 1250.0, \\"observation_time_ms\\": null, '
    '\\"sglang_time_ms\\": 1000.0, \\"sglang_queue_time_ms\\": null, \\"sglang_ttft_ms\\": null, '
    '\\"sglang_prefill_ms\\": null, \\"sglang_decode_time_ms\\": 1000.0, '
    '\\"template_overhead_tokens\\": null, \\"template_overhead_text\\": null}], '
    '\\"initial_prompt_text\\": \\"<|im_start|>user\\\\nHé 世界<|im_end|>\\\\n<|im_start|>assistant\\\\n\\", '
    '\\"agent_metrics\\": {\\"generate_sequences\\": 1.25, \\"tool_calls\\": 0.0, \\"num_preempted\\": -1, '
    '\\"reward_score\\": 1.0}}"}'
)


def test_single_turn_line_is_byte_exact_with_non_ascii_kept_raw(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), server_meta={"e2e_latency": 1.0})
    assert proc.force_flush()
    assert read_lines(trace_dir) == [GOLDEN_SINGLE_TURN]
    raw = open(os.path.join(proc.directory, os.listdir(proc.directory)[0]), "rb").read()
    assert "世界".encode("utf-8") in raw and raw.endswith(b"}\n")  # UTF-8, not \u escapes


def test_key_orders_match_the_contract(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    run_multi_turn_tool(clock, tok)
    run_single_turn(clock, tok)
    proc.force_flush()
    trajectories = read_trajectories(trace_dir)
    assert len(trajectories) == 2
    for t in trajectories:
        assert list(t) == ["prompt_uid", "sample_index", "raw_message"]
        assert list(t["raw_message"]) == REST_KEYS
        for turn in t["raw_message"]["turns"]:
            assert list(turn) == TURN_KEYS


# --------------------------------------------------------------------------- multi-turn tool trajectory

PROMPT0 = "<|im_start|>system\nTu es utile.<|im_end|>\n<|im_start|>user\n2×21 ?<|im_end|>\n<|im_start|>assistant\n"
COMPLETION0 = '<tool_call>{"name": "calc"}</tool_call><|im_end|>'
OBSERVATION = "résultat = 42 ✓"
TOOL_PREFIX = "\n<|im_start|>user\n<tool_response>\n"
TOOL_SUFFIX = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
COMPLETION1 = "La réponse est 42.<|im_end|>"


def run_multi_turn_tool(clock, tok, *, mutate_in_place=False):
    """ToolAgentLoop-shaped: generate, tool, generate. Turn 1's prompt is turn 0's
    prompt + completion + chat template around the tool response."""
    clock.now = T0
    with events.trajectory(UID, "1", step=5, agent_name="tool_agent", n_samples=2,
                           decode=tok.decode if tok else None, encode=tok.encode if tok else None):
        with events.agent_run("ToolAgentLoop"):
            prompt = list(tok.ids(PROMPT0))
            completion0 = tok.ids(COMPLETION0)
            clock.now = T0 + 0.25
            with events.llm_call(prompt) as turn:
                clock.now = T0 + 1.0
                turn.finish(completion0, stop_reason="tool_calls",
                            server_meta={"e2e_latency": 0.625, "queue_time": 0.125,  # sglang 0.5.12, metrics on
                                         "request_received_ts": T0 + 0.25, "forward_entry_time": T0 + 0.375,
                                         "prefill_finished_time": T0 + 0.375, "request_finished_ts": T0 + 0.875})
            clock.now = T0 + 1.125
            with events.tool_call("calc"):
                clock.now = T0 + 1.5
            events.observation([OBSERVATION])
            tail = completion0 + tok.ids(TOOL_PREFIX) + tok.ids(OBSERVATION) + tok.ids(TOOL_SUFFIX)
            if mutate_in_place:
                prompt += tail  # what ToolAgentLoop does to agent_data.prompt_ids
                prompt1 = prompt
            else:
                prompt1 = prompt + tail
            clock.now = T0 + 1.625
            with events.llm_call(prompt1) as turn:
                clock.now = T0 + 2.0
                turn.finish(tok.ids(COMPLETION1), stop_reason="stop")
        with events.reward() as reward:
            reward.score(0.5)
        clock.now = T0 + 2.25
    return prompt1


@pytest.fixture(params=["chars", pytest.param("bpe", marks=pytest.mark.verl)])
def tokenizer(request):
    if request.param == "chars":
        return CharTokenizer()
    pytest.importorskip("tokenizers")
    return BpeTokenizer([PROMPT0, COMPLETION0, OBSERVATION, TOOL_PREFIX, TOOL_SUFFIX, COMPLETION1] * 20)


def test_multi_turn_tool_trajectory(clock, traj_dir, tokenizer):
    proc, trace_dir, _ = traj_dir
    tok = tokenizer
    prompt1 = run_multi_turn_tool(clock, tok)
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert t["prompt_uid"] == UID and t["sample_index"] == 1
    rest = t["raw_message"]
    assert rest["request_id"] == "1" and rest["n_samples"] == 2 and rest["global_step"] == 5
    assert rest["total_time_ms"] == 2250.0
    assert rest["initial_prompt_text"] == PROMPT0
    assert rest["agent_metrics"] == {"reward_score": 0.5}
    turn0, turn1 = rest["turns"]

    n_prompt0, n_completion0 = len(tok.encode(PROMPT0)), len(tok.encode(COMPLETION0))
    assert turn0["turn_index"] == 0 and turn1["turn_index"] == 1
    assert turn0["prompt_token_count"] == n_prompt0
    assert turn0["completion_text"] == COMPLETION0
    assert turn0["completion_token_count"] == n_completion0
    assert turn0["finish_reason"] == "tool_calls"
    # observation: starts when the generate call returned, ends when the messages were added
    assert turn0["observation_text"] == OBSERVATION
    assert (turn0["end_ts"], turn0["observation_start_ts"], turn0["observation_end_ts"]) == (T0 + 1.0, T0 + 1.0, T0 + 1.5)
    assert turn0["completion_time_ms"] == 750.0
    assert turn0["observation_time_ms"] == 500.0
    assert turn0["turn_total_time_ms"] == 1250.0
    assert (turn0["sglang_time_ms"], turn0["sglang_queue_time_ms"], turn0["sglang_ttft_ms"],
            turn0["sglang_prefill_ms"], turn0["sglang_decode_time_ms"]) == (625.0, 125.0, 125.0, None, 375.0)
    assert turn0["template_overhead_tokens"] is None and turn0["template_overhead_text"] is None

    # turn 1: the template tokens between the turns...
    n_prefix, n_obs, n_suffix = (len(tok.encode(s)) for s in (TOOL_PREFIX, OBSERVATION, TOOL_SUFFIX))
    assert turn1["prompt_token_count"] == len(prompt1) == n_prompt0 + n_completion0 + n_prefix + n_obs + n_suffix
    assert turn1["template_overhead_tokens"] == n_prefix + n_suffix
    # ...and the slice quirk: the text starts right after the previous completion, so it
    # covers the prefix and then the tool text, not prefix + suffix.
    start = n_prompt0 + n_completion0
    expected = tok.decode(prompt1[start : start + n_prefix + n_suffix])
    assert turn1["template_overhead_text"] == expected
    assert expected.startswith(TOOL_PREFIX + "r")
    if isinstance(tok, CharTokenizer):
        assert expected.startswith(TOOL_PREFIX + "résultat")
    assert expected != TOOL_PREFIX + TOOL_SUFFIX
    # the last turn has no observation: total = completion time
    assert turn1["observation_text"] is None and turn1["observation_time_ms"] is None
    assert turn1["turn_total_time_ms"] == turn1["completion_time_ms"] == 375.0
    assert turn1["sglang_time_ms"] is None and turn1["sglang_decode_time_ms"] is None


def test_prompt_list_extended_in_place_keeps_each_turns_count(clock, traj_dir):
    """ToolAgentLoop extends one prompt list in place: counts are taken at call time and
    initial_prompt_text is the first turn's prompt, not the whole conversation."""
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    prompt = run_multi_turn_tool(clock, tok, mutate_in_place=True)
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    turn0, turn1 = t["raw_message"]["turns"]
    assert turn0["prompt_token_count"] == len(tok.encode(PROMPT0))
    assert turn1["prompt_token_count"] == len(prompt)
    assert t["raw_message"]["initial_prompt_text"] == tok.decode(prompt[: turn0["prompt_token_count"]])
    assert t["raw_message"]["initial_prompt_text"] == PROMPT0


def test_a_turn_record_holds_none_of_the_agent_loops_id_lists(clock, traj_dir):
    """The events API keeps a turn's ids as arrays (the cyclic GC visits no id in them),
    and of a later prompt only the ids after the previous completion (what the JSONL reads)."""
    import gc
    from array import array

    from otel_verl.rollout_data import PromptTail, TurnData, UnsentTokens

    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    prompt0, completion0 = tok.ids(PROMPT0), tok.ids(COMPLETION0)
    prompt1 = prompt0 + completion0 + tok.ids(TOOL_PREFIX + OBSERVATION + TOOL_SUFFIX)
    with events.trajectory(UID, "0", step=1, agent_name="tool_agent", decode=tok.decode, encode=tok.encode):
        for prompt, completion in ((prompt0, completion0), (prompt1, tok.ids(COMPLETION1))):
            with events.llm_call(prompt) as turn:
                turn.finish(completion, stop_reason="stop")
        records = events.current_trajectory().turns
        for ids in (prompt0, completion0, prompt1):
            assert not [r for r in gc.get_referrers(ids) if isinstance(r, (TurnData, PromptTail))]
        first, second = (record.prompt_ids for record in records)
        assert type(first) is array and type(second) is PromptTail  # a whole prompt is kept as its array
        for kept in (first, second.tokens, *(record.completion_ids for record in records)):
            assert type(kept) is array
            assert not [x for x in gc.get_referents(kept) if isinstance(x, int)]  # no id for the GC to visit
        assert list(first) == prompt0
        end0 = len(prompt0) + len(completion0)
        assert (second.start, list(second.tokens), len(second)) == (end0, prompt1[end0:], len(prompt1))
        with pytest.raises(UnsentTokens):
            second[end0 - 1]
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    turn0, turn1 = t["raw_message"]["turns"]
    assert t["raw_message"]["initial_prompt_text"] == PROMPT0
    assert (turn0["completion_text"], turn1["completion_text"]) == (COMPLETION0, COMPLETION1)
    assert turn1["template_overhead_text"] == TOOL_PREFIX + OBSERVATION + TOOL_SUFFIX


def test_a_call_made_before_the_previous_one_returned_keeps_its_whole_prompt(clock, traj_dir):
    """Overlapping calls (a custom loop's): where the previous completion ends is not
    known yet, so the later call keeps its whole prompt and the JSONL still reads it."""
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    prompt0, completion0 = tok.ids(PROMPT0), tok.ids(COMPLETION0)
    prompt1 = prompt0 + completion0 + tok.ids(TOOL_SUFFIX)
    with events.trajectory(UID, "0", step=1, agent_name="a", decode=tok.decode, encode=tok.encode):
        with events.llm_call(prompt0) as first:
            with events.llm_call(prompt1) as second:
                second.finish(tok.ids(COMPLETION1), stop_reason="stop")
            first.finish(completion0, stop_reason="stop")
        assert list(events.current_trajectory().turns[1].prompt_ids) == prompt1  # whole
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    turn0, turn1 = t["raw_message"]["turns"]
    assert turn1["template_overhead_text"] == TOOL_SUFFIX
    assert (turn0["completion_text"], turn1["completion_text"]) == (COMPLETION0, COMPLETION1)


def test_observation_messages_are_joined_with_newlines(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    with events.trajectory(UID, "0", step=1, agent_name="a", decode=tok.decode, encode=tok.encode):
        with events.llm_call([1, 2]) as turn:
            turn.finish([3])
        events.observation(["first", "second"])
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert t["raw_message"]["turns"][0]["observation_text"] == "first\nsecond"


def test_without_a_tokenizer_texts_are_null_and_overhead_counts_observation_tokens(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()  # used only to build ids; the trajectory gets no decode/encode
    with events.trajectory(UID, "0", step=1, agent_name="a"):
        p0 = tok.encode(PROMPT0)
        with events.llm_call(p0) as turn:
            turn.finish(tok.encode(COMPLETION0))
        events.observation([OBSERVATION])
        p1 = p0 + tok.encode(COMPLETION0) + tok.encode(TOOL_PREFIX + OBSERVATION + TOOL_SUFFIX)
        with events.llm_call(p1) as turn:
            turn.finish([1])
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    rest = t["raw_message"]
    assert rest["initial_prompt_text"] is None
    turn0, turn1 = rest["turns"]
    assert turn0["completion_text"] is None and turn1["template_overhead_text"] is None
    assert turn0["observation_text"] == OBSERVATION
    assert turn1["template_overhead_tokens"] == len(tok.encode(TOOL_PREFIX + OBSERVATION + TOOL_SUFFIX))


def test_decode_failure_gives_empty_completion_and_counts(clock, traj_dir):
    proc, trace_dir, _ = traj_dir

    def broken_decode(ids, skip_special_tokens=False):
        raise RuntimeError("tokenizer gone")

    with events.trajectory(UID, "0", step=1, agent_name="a", decode=broken_decode):
        with events.llm_call([1, 2]) as turn:
            turn.finish([3], stop_reason="stop")
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert t["raw_message"]["turns"][0]["completion_text"] == ""  # as the seed's agent loops
    assert t["raw_message"]["initial_prompt_text"] is None
    assert health.snapshot()["failures"].get("trajectory_jsonl.decode", 0) >= 2


# --------------------------------------------------------------------------- server timings


def test_null_server_timings(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), server_meta=None)
    proc.force_flush()
    turn = read_trajectories(trace_dir)[0]["raw_message"]["turns"][0]
    for key in ("sglang_time_ms", "sglang_queue_time_ms", "sglang_ttft_ms", "sglang_prefill_ms", "sglang_decode_time_ms"):
        assert turn[key] is None, key


SGLANG_0_5_12 = {  # a finished request's meta_info timing with enable_metrics (wall-clock seconds)
    "e2e_latency": 1.5, "request_received_ts": 100.0, "api_server_dispatch_finish_ts": 100.125,
    "forward_entry_time": 100.25, "prefill_finished_time": 100.5, "queue_time": 0.125,
    "response_sent_to_client_ts": 101.5, "request_finished_ts": 101.5,
}
SGLANG_0_5_23 = {**SGLANG_0_5_12, "first_token_latency": 0.625, "decode_throughput": 40.0}


@pytest.mark.parametrize(
    "meta, expected",
    [
        # sglang 0.5.12 with metrics: ttft = prefill_finished_time - request_received_ts,
        # no prefill duration key, decode = total - queue - ttft
        (SGLANG_0_5_12, (1500.0, 125.0, 500.0, None, 875.0)),
        # sglang 0.5.23: the timestamps still win over first_token_latency
        (SGLANG_0_5_23, (1500.0, 125.0, 500.0, None, 875.0)),
        # first_token_latency alone gives the ttft
        ({"e2e_latency": 1.0, "queue_time": 0.25, "first_token_latency": 0.5}, (1000.0, 250.0, 500.0, None, 250.0)),
        # sglang without metrics: only the total; missing parts count 0 in the decode time
        ({"e2e_latency": 0.75}, (750.0, None, None, None, 750.0)),
        # an older sglang's keys (the seed's): e2e*1000, queue*1000, (prefill_finished_ts -
        # received)*1000, launch*1000
        ({"e2e_latency": 1.5, "queue_time": 0.25, "request_received_ts": 100.0, "prefill_finished_ts": 100.5,
          "prefill_launch_latency": 0.125}, (1500.0, 250.0, 500.0, 125.0, 750.0)),
        # prefill_finished_ts wins over prefill_finished_time when a server reports both
        ({"e2e_latency": 1.5, "request_received_ts": 100.0, "prefill_finished_ts": 100.25,
          "prefill_finished_time": 100.5}, (1500.0, None, 250.0, None, 1250.0)),
        # one timestamp of the ttft pair missing: no ttft
        ({"e2e_latency": 1.0, "request_received_ts": 100.0, "queue_time": 0.25}, (1000.0, 250.0, None, None, 750.0)),
        ({"e2e_latency": 1.0, "prefill_finished_time": 100.5, "queue_time": 0.25}, (1000.0, 250.0, None, None, 750.0)),
        # no total: no decode time, even with the other parts
        ({"queue_time": 0.25, "prefill_launch_latency": 0.125}, (None, 250.0, None, 125.0, None)),
    ],
    ids=["sglang-0.5.12", "sglang-0.5.23", "first-token-latency", "e2e-only", "older-sglang",
         "both-prefill-keys", "no-prefill-timestamp", "no-received-timestamp", "no-total"],
)
def test_server_timing_formulas(clock, traj_dir, meta, expected):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), server_meta=meta)
    proc.force_flush()
    turn = read_trajectories(trace_dir)[0]["raw_message"]["turns"][0]
    got = tuple(turn[k] for k in ("sglang_time_ms", "sglang_queue_time_ms", "sglang_ttft_ms",
                                  "sglang_prefill_ms", "sglang_decode_time_ms"))
    assert got == expected


def test_negative_decode_time_is_clamped_to_integer_zero(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), server_meta={
        "e2e_latency": 0.5, "queue_time": 0.25, "request_received_ts": 10.0, "prefill_finished_ts": 10.5})
    proc.force_flush()
    raw = json.loads(read_lines(trace_dir)[0])["raw_message"]
    assert '"sglang_decode_time_ms": 0, ' in raw  # max(0, ...) as the seed: int 0, not 0.0


def test_completion_count_prefers_the_servers(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), output_tokens=7)
    proc.force_flush()
    assert read_trajectories(trace_dir)[0]["raw_message"]["turns"][0]["completion_token_count"] == 7


@pytest.mark.parametrize("stop_reason", [None, ""])
def test_a_turn_without_a_stop_reason_writes_an_empty_finish_reason(clock, traj_dir, stop_reason):
    """The seed's rule, kept by the JSONL alone: a turn the engine gave no reason is written with ""."""
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), stop_reason=stop_reason)
    proc.force_flush()
    assert read_trajectories(trace_dir)[0]["raw_message"]["turns"][0]["finish_reason"] == ""


# --------------------------------------------------------------------------- what is (not) written


def test_validation_and_failed_trajectories_are_not_written(clock, tmp_path, make_pipeline):
    proc = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=None)
    pipeline = make_pipeline([proc], env={"OTEL_VERL_ENABLED": "1", "OTEL_VERL_TRACE_VALIDATION": "1"})
    tok = CharTokenizer()
    run_single_turn(clock, tok, traj_uid="0", validate=True)
    with pytest.raises(RuntimeError):
        with events.trajectory(UID, "1", step=3, agent_name="a", decode=tok.decode):
            with events.llm_call([1]) as turn:
                turn.finish([2])
            raise RuntimeError("agent loop failed")
    run_single_turn(clock, tok, traj_uid="2")
    proc.force_flush()
    assert [t["raw_message"]["request_id"] for t in read_trajectories(tmp_path)] == ["2"]
    validate_spans = [s for s in pipeline.spans() if s.attributes.get("verl.validate")]
    assert validate_spans  # traced (switch on), but never a legacy line


def test_validation_untraced_by_default_writes_nothing(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), validate=True)
    proc.force_flush()
    assert read_lines(trace_dir) == []


def test_a_failed_generate_call_is_not_a_turn(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    with events.trajectory(UID, "0", step=1, agent_name="a", decode=tok.decode):
        try:
            with events.llm_call([1, 2]):
                raise TimeoutError("server aborted")
        except TimeoutError:
            pass  # the agent loop retries
        with events.llm_call([1, 2]) as turn:
            turn.finish([3], stop_reason="stop")
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert [turn["turn_index"] for turn in t["raw_message"]["turns"]] == [0]


def test_numpy_ids_and_meta_values_are_handled(clock, traj_dir):
    np = pytest.importorskip("numpy")
    proc, trace_dir, _ = traj_dir
    tok = CharTokenizer()
    with events.trajectory(np.array(["u-1"]), np.int64(2), step=1, agent_name="a", n_samples=np.int64(4),
                           decode=tok.decode, encode=tok.encode):
        with events.llm_call(np.array(tok.ids("<|im_start|>hi"))) as turn:
            turn.finish(np.array(tok.ids("yo")), stop_reason="stop",
                        server_meta={"e2e_latency": np.float32(0.5), "queue_time": np.float64(0.25)})
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert (t["prompt_uid"], t["sample_index"]) == ("u-1", 2)
    rest = t["raw_message"]
    assert rest["n_samples"] == 4 and rest["initial_prompt_text"] == "<|im_start|>hi"
    turn = rest["turns"][0]
    assert (turn["prompt_token_count"], turn["completion_text"], turn["completion_token_count"]) == (3, "yo", 2)
    assert (turn["sglang_time_ms"], turn["sglang_queue_time_ms"], turn["sglang_decode_time_ms"]) == (500.0, 250.0, 250.0)


def test_non_numeric_traj_uid_has_null_sample_index(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), traj_uid="session-a")
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert t["sample_index"] is None and t["raw_message"]["request_id"] == "session-a"


def test_metrics_that_json_cannot_encode_are_stringified_not_lost(clock, traj_dir):
    proc, trace_dir, _ = traj_dir

    class Odd:
        def __str__(self):
            return "odd"

    run_single_turn(clock, CharTokenizer(), metrics={"weird": Odd()}, score=None)
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert t["raw_message"]["agent_metrics"] == {"weird": "odd", "reward_score": 0.0}


def test_agent_metrics_always_carry_reward_score(clock, traj_dir):
    """0.0 for a trajectory nobody scored (the seed's metrics default), the trajectory's
    score otherwise, even over a reward_score the agent loop's own metrics report."""
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), traj_uid="0", metrics={}, score=None)
    run_single_turn(clock, CharTokenizer(), traj_uid="1", metrics={"reward_score": 0.0, "tool_calls": 0.0}, score=0.75)
    proc.force_flush()
    by_index = {t["sample_index"]: t["raw_message"]["agent_metrics"] for t in read_trajectories(trace_dir)}
    assert by_index == {0: {"reward_score": 0.0}, 1: {"reward_score": 0.75, "tool_calls": 0.0}}


def test_nan_and_infinity_are_written_as_null_and_counted(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), server_meta={"e2e_latency": float("inf")},
                    metrics={"nan": float("nan"), "arr": np.array([1.0, np.nan]), "ok": 0.5})
    proc.force_flush()
    with open(glob.glob(os.path.join(str(trace_dir), "trajectory", "*.jsonl"))[0], encoding="utf-8") as f:
        line = f.read()
    outer = json.loads(line)
    json.loads(outer["raw_message"], parse_constant=pytest.fail)  # no NaN / Infinity tokens
    [t] = read_trajectories(trace_dir)
    assert t["raw_message"]["agent_metrics"] == {"nan": None, "arr": [1.0, None], "ok": 0.5, "reward_score": 1.0}
    assert t["raw_message"]["turns"][0]["sglang_time_ms"] is None
    assert health.snapshot()["failures"] == {"trajectory_jsonl.non_finite": 1}


# --------------------------------------------------------------------------- threads, files


def test_formatting_happens_on_the_writer_thread_and_decoding_on_its_decode_thread(clock, traj_dir, monkeypatch):
    proc, trace_dir, _ = traj_dir
    paths_threads: List[str] = []
    real_path_for = tj._TrajectoryFiles.path_for

    def recording_path_for(files, n_bytes):
        paths_threads.append(threading.current_thread().name)
        return real_path_for(files, n_bytes)

    monkeypatch.setattr(tj._TrajectoryFiles, "path_for", recording_path_for)
    tok = CharTokenizer()
    run_multi_turn_tool(clock, tok)
    run_single_turn(clock, tok)
    proc.force_flush()
    assert len(read_lines(trace_dir)) == 2
    assert tok.threads and set(tok.threads) == {"otel-verl-trajectory-decode"}  # decode and encode
    assert paths_threads and set(paths_threads) == {"otel-verl-trajectory_jsonl"}


# --------------------------------------------------------------------------- a tokenizer that hangs


class HangingTokenizer(CharTokenizer):
    """A tokenizer whose decode and encode return only once ``release`` is set (one stuck
    on a lock, or on a remote service)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.release.wait(120)
        return super().decode(ids, skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        self.release.wait(120)
        return super().encode(text, add_special_tokens)


@pytest.fixture
def short_decode(tmp_path, make_pipeline):
    """(processor waiting 0.5 s for a line's tokenizer, trace dir, the hanging tokenizers' release)."""
    proc = TrajectoryJsonlProcessor(str(tmp_path), discovery_path=None, decode_timeout_s=0.5)
    make_pipeline([proc])
    release = threading.Event()
    yield proc, tmp_path, release
    release.set()


def _decode_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "otel-verl-trajectory-decode"}


def test_a_hung_decode_holds_back_its_own_line_only_written_as_without_a_tokenizer(clock, short_decode):
    proc, trace_dir, release = short_decode
    tok = CharTokenizer()
    run_single_turn(clock, tok, traj_uid="0")
    run_multi_turn_tool(clock, HangingTokenizer(release))  # traj_uid "1"
    for i in range(2, 6):
        run_single_turn(clock, tok, traj_uid=str(i))
    assert proc.writer.flush(30)  # its tokenizer hangs 120 s: no line waited for it
    lines = {t["raw_message"]["request_id"]: t["raw_message"] for t in read_trajectories(trace_dir)}
    assert sorted(lines) == [str(i) for i in range(6)]
    assert health.snapshot()["failures"] == {"trajectory_jsonl.decode_timeout": 1}
    assert all(lines[i]["turns"][0]["completion_text"] == "Réponse 🙂<|im_end|>" for i in "02345")
    hung = lines["1"]
    assert hung["initial_prompt_text"] is None
    assert [turn["completion_text"] for turn in hung["turns"]] == [None, None]
    assert hung["turns"][0]["observation_text"] == OBSERVATION
    # as without a tokenizer: the observation counts 0 tokens in the overhead, which has no text
    assert hung["turns"][1]["template_overhead_tokens"] == len(CharTokenizer().ids(TOOL_PREFIX + OBSERVATION + TOOL_SUFFIX))
    assert hung["turns"][1]["template_overhead_text"] is None


def test_a_tokenizer_that_never_answers_holds_two_threads_not_one_a_line(clock, short_decode):
    proc, trace_dir, release = short_decode
    before = _decode_threads()
    tok = HangingTokenizer(release)
    for i in range(8):
        run_single_turn(clock, tok, traj_uid=str(i))
    assert proc.writer.flush(30)
    lines = read_trajectories(trace_dir)
    assert len(lines) == 8 and all(t["raw_message"]["turns"][0]["completion_text"] is None for t in lines)
    assert health.snapshot()["failures"] == {"trajectory_jsonl.decode_timeout": 8}
    assert len(_decode_threads() - before) <= 2
    release.set()  # it answers at last: a thread serves again, the other ends
    deadline = time.monotonic() + 30
    while len(_decode_threads() - before) > 1 or proc.decode._current.running is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run_single_turn(clock, tok, traj_uid="8")
    assert proc.writer.flush(30)
    assert read_trajectories(trace_dir)[-1]["raw_message"]["turns"][0]["completion_text"] == "Réponse 🙂<|im_end|>"
    # the late answers, discarded, counted nothing
    assert health.snapshot()["failures"] == {"trajectory_jsonl.decode_timeout": 8}


def test_discovery_file_names_the_trajectory_directory(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer())
    proc.force_flush()
    with open(trace_dir / "discovery.txt") as f:
        assert f.read() == os.path.join(str(trace_dir), "trajectory")


def test_file_name_and_rotation_keep_every_line_whole(clock, tmp_path, make_pipeline):
    fixed = 1787215072.25  # a constant clock: rotated names must still be unique
    proc = TrajectoryJsonlProcessor(str(tmp_path), max_file_bytes=3000, discovery_path=None, clock=lambda: fixed)
    make_pipeline([proc])
    tok = CharTokenizer()
    for i in range(30):
        run_single_turn(clock, tok, traj_uid=str(i))
    proc.force_flush()
    names = sorted(os.listdir(proc.directory))
    assert len(names) > 3
    stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(fixed))
    pattern = re.compile(rf"trajectory_{os.getpid()}_{stamp}_(\d{{3}})\.jsonl")
    assert all(pattern.fullmatch(n) for n in names), names
    assert [int(pattern.fullmatch(n).group(1)) for n in names] == list(range(250, 250 + len(names)))
    ids = []
    for k, name in enumerate(names):
        data = open(os.path.join(proc.directory, name), "rb").read()
        assert data.endswith(b"\n")
        lines = data.decode("utf-8").splitlines()
        ids += [json.loads(json.loads(line)["raw_message"])["request_id"] for line in lines]
        if k < len(names) - 1:  # a file is left once it has reached the limit, not before
            assert len(data) >= 3000 and len(data) - len(lines[-1].encode()) - 1 < 3000
    assert ids == [str(i) for i in range(30)]


def test_unwritable_directory_counts_drops_and_never_raises(clock, tmp_path, make_pipeline):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = TrajectoryJsonlProcessor(str(blocker), discovery_path=None)
    make_pipeline([proc])
    run_single_turn(clock, CharTokenizer())
    proc.force_flush()
    assert proc.writer.dropped_lines == 1
    assert health.snapshot()["dropped"].get("trajectory_jsonl") == 1


# --------------------------------------------------------------------------- the consumer's view

# The contract's example line, completed: the shape a consumer parses.
CONTRACT_EXAMPLE = {
    "prompt_uid": "92ee95cb-f14d-4a51-92a5-9a2a0f88d1d5",
    "sample_index": 3,
    "raw_message": {
        "request_id": "3", "n_samples": 4, "global_step": 3,
        "created_at_ts": 1787215072.088314, "completed_at_ts": 1787215073.420837, "total_time_ms": 1332.52,
        "turns": [{
            "turn_index": 0, "prompt_token_count": 87, "completion_text": "To determine how much Joanie...",
            "completion_token_count": 512, "finish_reason": "length", "observation_text": None,
            "start_ts": 1787215072.1198363, "end_ts": 1787215073.321284,
            "observation_start_ts": None, "observation_end_ts": None,
            "turn_total_time_ms": 1201.45, "completion_time_ms": 1201.45, "observation_time_ms": None,
            "sglang_time_ms": 1111.64, "sglang_queue_time_ms": None, "sglang_ttft_ms": None,
            "sglang_prefill_ms": None, "sglang_decode_time_ms": 1111.64,
            "template_overhead_tokens": None, "template_overhead_text": None,
        }],
        "initial_prompt_text": "<|im_start|>system\nYou are Qwen...",
        "agent_metrics": {"generate_sequences": 1.201, "tool_calls": 0.0, "compute_score": 0.0547, "num_preempted": -1,
                          "reward_score": 0.0},
    },
}


def _shape(value: Any) -> Any:
    """Keys (in order) and JSON types, recursively; numbers are one type."""
    if isinstance(value, dict):
        return [(k, _shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def test_a_reader_sees_the_contract_example_shape(clock, traj_dir):
    proc, trace_dir, _ = traj_dir
    run_single_turn(clock, CharTokenizer(), server_meta={"e2e_latency": 1.0}, score=None,
                    metrics={"generate_sequences": 1.25, "tool_calls": 0.0, "compute_score": 0.0625, "num_preempted": -1})
    proc.force_flush()
    [t] = read_trajectories(trace_dir)
    assert _shape(t) == _shape(CONTRACT_EXAMPLE)
