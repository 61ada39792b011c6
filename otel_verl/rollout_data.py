"""What a rollout's spans carry beyond their attributes, as their payload's data
(:mod:`otel_verl.payload`): off OTLP, read by the outputs that want it.

A trajectory's turns keep their token ids as arrays (thousands per trajectory: too costly
as span attributes), and a later turn only the prompt ids after the previous turn's
completion (the template and observation tokens the turn added); the engine's timing of
each request; the tokenizer's :class:`~otel_verl.text_codec.TextCodec` (outputs decode
off the event loop); when the agent run returned and when the reward was scored. A
rollout's dispatch keeps which trajectories went to which worker.

A trajectory and its turns are :class:`~otel_verl.payload.PayloadData`: they say what
crosses to an export process (``sent``) and take back what was sent once for many
(``received``: a tokenizer), so that the wire format needs no knowledge of these types.
What an output makes of them (its rows, their order, its defaults) is the output's own.
"""

from __future__ import annotations

import collections.abc
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from otel_verl.text_codec import TextCodec

IDS_TYPECODE = "I"  # C unsigned int: every tokenizer's ids fit


@dataclass
class TurnData:
    """One LLM generate call of a trajectory (one that raised leaves its trajectory's turns)."""

    prompt_ids: Sequence[int]  # an array or a PromptTail (see kept_prompt)
    start_ts: float
    # len(prompt_ids) when the call started: agent loops extend their prompt list in
    # place after each turn (ToolAgentLoop: ``prompt_ids += response_ids``).
    prompt_token_count: Optional[int] = None
    end_ts: float = 0.0
    completion_ids: Sequence[int] = ()
    completion_token_count: Optional[int] = None  # the server's count when it gave one
    finish_reason: Optional[str] = None  # why the engine stopped (None: it said nothing)
    server_meta: Mapping[str, float] = field(default_factory=dict)  # the engine's timing keys (sglang/vLLM)
    observation_text: Optional[str] = None
    observation_start_ts: Optional[float] = None
    observation_end_ts: Optional[float] = None

    def sent(self, at_end: bool) -> Tuple[None, None]:
        """Nothing crosses with its LLM call's span: its trajectory's end carries it, complete."""
        return None, None

    def received(self, shared: Any) -> None:
        """(nothing is named: see :meth:`sent`)"""


def prompt_tokens(turn: TurnData) -> int:
    """The turn's prompt length as the outputs count it (at the call, else the ids')."""
    count = turn.prompt_token_count
    return count if count is not None else _length(turn.prompt_ids)


def completion_tokens(turn: TurnData) -> int:
    """The turn's completion length as the outputs count it (the server's, else the ids')."""
    count = turn.completion_token_count
    return count if count is not None else _length(turn.completion_ids)


def _length(ids: Any) -> int:
    return len(ids) if ids is not None else 0  # not `ids or ()`: ids may be a numpy array


def kept_ids(ids: Any) -> Sequence[int]:
    """Token ids as a turn keeps them until its trajectory ends: an unsigned-int array.

    A live list of ints is walked id by id at every young collection of the cyclic GC;
    an array holds no objects to visit, and pickles as one copy. Ids that are no such
    ints stay a list."""
    if type(ids) is array and ids.typecode == IDS_TYPECODE:
        return ids
    try:
        return array(IDS_TYPECODE, ids)
    except (TypeError, ValueError, OverflowError):
        return list(ids)


def token_list(ids: Any) -> Any:
    """Kept ids as a tokenizer's ``decode`` takes them (a list; other sequences as they are)."""
    if type(ids) is PromptTail:
        ids = ids[:]  # UnsentTokens unless it was kept whole
    return ids.tolist() if type(ids) is array else ids


def kept_prompt(prompt_ids: Sequence[int], previous: Optional[TurnData]) -> Sequence[int]:
    """What the outputs read of a turn's prompt, taken at the call: all of the first
    turn's; of a later one the ids after the previous turn's completion (the template
    and observation tokens this turn added). Whole prompts would hold a
    trajectory's turns squared in ids. The previous turn counts only once it has
    returned (a custom loop may have calls overlap)."""
    start = 0
    if previous is not None and previous.end_ts:
        start = min(prompt_tokens(previous) + completion_tokens(previous), len(prompt_ids))
    if not start:
        return kept_ids(prompt_ids)
    return PromptTail(start, kept_ids(prompt_ids[start:]))


class UnsentTokens(LookupError):
    """Prompt ids that were not kept (no output reads them)."""


class PromptTail(collections.abc.Sequence):
    """A turn's prompt of which only the ids from ``start`` on were kept: as long as the
    prompt was; reading an id before ``start`` raises :class:`UnsentTokens` (not
    IndexError, which would end an iteration as if the prompt were empty)."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: Sequence[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:
        return self.start + len(self.tokens)

    def __getitem__(self, index: Any) -> Any:
        start = self.start
        if isinstance(index, slice):
            begin, stop, step = index.indices(len(self))
            if begin < start and begin < stop or step != 1:
                raise UnsentTokens(f"prompt ids [{begin}:{stop}:{step}] (only [{start}:] were kept)")
            return self.tokens[begin - start:stop - start]
        position = index + len(self) if index < 0 else index
        if position < 0 or position >= len(self):
            raise IndexError("prompt index out of range")
        if position < start:
            raise UnsentTokens(f"prompt id {index} (only [{start}:] were kept)")
        return self.tokens[position - start]

    def __repr__(self) -> str:
        return f"PromptTail(start={self.start}, tokens={self.tokens!r})"


@dataclass
class TrajectoryData:
    """Everything the rollout worker knows about one (uid, traj_uid) run."""

    uid: str
    traj_uid: str
    global_step: int
    n_samples: Optional[int]
    agent_name: str
    created_at: float
    trainer_api: str = "v0"  # "v0" (AgentLoopWorker) or "v1" (AgentLoopWorkerTQ)
    completed_at: float = 0.0
    turns: List[TurnData] = field(default_factory=list)
    agent_metrics: Dict[str, Any] = field(default_factory=dict)
    reward_score: Optional[float] = None
    # The agent loop's run() (no span of its own: attributes on the trajectory span):
    # its class, and when it returned (ns; 0: it did not return, or never ran).
    agent_loop_class: Optional[str] = None
    run_completed_ns: int = 0
    # (end ns, score) of a reward span that ended scored
    reward_scored: Optional[Tuple[int, float]] = None
    # The worker's tokenizer: outputs decode texts off the event loop, so only a reference
    # is kept here.
    codec: Optional[TextCodec] = None

    def approx_bytes(self) -> int:
        """About the memory its turns hold (kept token ids, texts), for the bounded queues
        it waits in."""
        return 512 + sum(_turn_bytes(turn) for turn in self.turns)

    def sent(self, at_end: bool) -> Tuple["TrajectoryData", Optional[TextCodec]]:
        """What crosses to an export process: at the start the trajectory without its
        turns; at its end the whole, the turns being complete then, with the tokenizer
        sent once for all trajectories that name it."""
        if not at_end:
            return self._copy(turns=[], agent_metrics={}, codec=None), None
        return self._copy(turns=list(self.turns), agent_metrics=dict(self.agent_metrics), codec=None), self.codec

    def _copy(self, **changes: Any) -> "TrajectoryData":
        # dataclasses.replace runs __init__ field by field: about 2 µs a copy, this 0.5
        copy = object.__new__(TrajectoryData)
        copy.__dict__.update(self.__dict__, **changes)
        return copy

    def received(self, codec: Optional[TextCodec]) -> None:
        self.codec = codec


ID_BYTES = 8  # a kept id: 4 in an array, more in a list


def _turn_bytes(turn: TurnData) -> int:
    size = 256 + ID_BYTES * (_held(turn.prompt_ids) + _held(turn.completion_ids))
    return size + len(turn.observation_text) if turn.observation_text else size


def _held(ids: Any) -> int:
    if type(ids) is PromptTail:
        ids = ids.tokens
    return len(ids) if ids is not None else 0


@dataclass
class RolloutData:
    """The trajectories of one uid as dispatched to the agent loop workers (batch order)."""

    traj_uids: List[str]
    worker_indices: List[int]
    variant: str = "v0"
