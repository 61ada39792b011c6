"""The trajectory JSONL: one line per finished training trajectory of a rollout worker.

Reads the ``TrajectoryData`` the events API attaches to each TRAJECTORY span (turn token
ids, server timing meta, observations, the worker's tokenizer) and writes the line the
legacy trajectory browser ingests. The format (key order, every timing rule, the
template-overhead quirk) is section 3 of ``docs/LEGACY_FORMATS.md``.

``on_end`` runs on the agent loop's event loop, so it only queues the finished
``TrajectoryData``: making the line (decoding, re-encoding observations, ``json.dumps``)
happens on a decode thread, choosing the file and writing on the writer thread, which
waits at most ``decode_timeout_s`` for a line. A line whose tokenizer did not answer by
then is written as without a tokenizer, and counted
(``failures[trajectory_jsonl.decode_timeout]``): a tokenizer that hangs holds back one
line, not the file.

Not written, like the seed: validation trajectories (``verl.validate``) and trajectories
whose run raised. Without a tokenizer (``TrajectoryData.codec`` or its ``decode`` / ``encode``
``None``) the texts are null, and ``template_overhead_tokens`` counts 0 observation
tokens (for tool turns it then includes the observation's tokens).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from opentelemetry.sdk.trace import ReadableSpan

from otel_verl import forks, health, semconv as sc, server_timing as st, settings
from otel_verl.exporters._writer import (DEFAULT_MAX_PENDING_BYTES, BackgroundWriter, WriterProcessor, output_pid,
                                        write_discovery_file)
from otel_verl.ids import sample_index
from otel_verl.payload import payload_of
from otel_verl.rollout_data import TrajectoryData, TurnData, completion_tokens, prompt_tokens, token_list
from otel_verl.semconv import Subject
from otel_verl.server_timing import number

DISCOVERY_PATH = "/tmp/verl_trace_trajectory_path.txt"
_OUTPUT = "trajectory_jsonl"
# Each text of a line (a completion, an observation, a prompt, an agent metric's text) is
# cut at this many characters, counted: a 50 MB tool observation would otherwise make a
# line of 50 MB, its decode several times that in the writer's memory.
MAX_TEXT_CHARS = settings.DEFAULT_JSONL_MAX_TEXT_CHARS
ID_BYTES = 6  # a token id in a line: its decoded text and its share of the JSON around it
# A line's tokenizer work (a fast tokenizer's takes milliseconds) is waited for this long.
DECODE_TIMEOUT_S = 5.0


class TrajectoryJsonlProcessor(WriterProcessor):
    """Writes ``{trace_dir}/trajectory/trajectory_{pid}_{YYYYmmdd_HHMMSS}_{mmm}.jsonl``."""

    on_start_subjects: frozenset = frozenset()  # the spans it reads
    on_end_subjects = frozenset({Subject.TRAJECTORY})

    def __init__(
        self,
        trace_dir: str,
        *,
        max_file_bytes: int = 100 * 1024 * 1024,
        discovery_path: Optional[str] = DISCOVERY_PATH,
        clock: Callable[[], float] = time.time,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        max_text_chars: int = MAX_TEXT_CHARS,
        decode_timeout_s: float = DECODE_TIMEOUT_S,
    ) -> None:
        self.directory = os.path.join(trace_dir, "trajectory")
        self.writer = BackgroundWriter(_OUTPUT, max_pending_bytes, render=self._render)
        self.max_text_chars = max_text_chars
        self.decode = DecodeThreads(decode_timeout_s)
        self._files = _TrajectoryFiles(self.directory, max_file_bytes, discovery_path, clock)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            payload = payload_of(span)
            if payload is None or payload.subject is not Subject.TRAJECTORY or not isinstance(payload.data, TrajectoryData):
                return
            if span.attributes.get(sc.VALIDATE) or not span.status.is_ok:
                return
            # The data is complete once its span ended; nothing changes it afterwards.
            data = payload.data
            codec = data.codec
            if codec is None or (codec.decode is None and codec.encode is None):
                self.writer.submit(data, 1, line_bytes(data, self.max_text_chars))
                return
            line = _Line(data, self.max_text_chars)
            self.decode.start(line)  # made meanwhile: the writer waits for it no longer than it must
            if not self.writer.submit(line, 1, line_bytes(data, self.max_text_chars)):
                self.decode.forget(line)
        except Exception as exc:  # never raise into the agent loop
            health.record_failure(f"{_OUTPUT}.on_end", exc)

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        super().shutdown(timeout_millis)
        self.decode.close()

    def _render(self, job: Any) -> Tuple[str, str]:
        # on the writer thread; the file is picked last: rotation needs the line's size
        text = self._line(job) + "\n"
        # its size as written: a lone surrogate takes U+FFFD's 3 bytes there. Not utf8():
        # the writer repairs and counts the line, once
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return self._files.path_for(size), text

    def _line(self, job: Any) -> str:
        if isinstance(job, TrajectoryData):  # no tokenizer
            return trajectory_line(job, self.max_text_chars)
        made = self.decode.result(job)
        if made is None:
            health.record_failures(f"{_OUTPUT}.decode_timeout", 1, f"(the tokenizer did not answer within "
                                   f"{self.decode.timeout_s:g} s: the line is written as without a tokenizer)")
            made = _line_and_repairs(job.data, self.max_text_chars, None)
        line, repairs = made
        _count_repairs(repairs, self.max_text_chars)
        return line


class _Line:
    """A line whose tokenizer work a decode thread does: its data, then its text and repairs."""

    __slots__ = ("data", "max_text_chars", "made", "error", "done", "abandoned", "thread")

    def __init__(self, data: TrajectoryData, max_text_chars: int) -> None:
        self.data, self.max_text_chars = data, max_text_chars
        self.made: Optional[Tuple[str, Counter]] = None
        self.error: Optional[Exception] = None
        self.done = self.abandoned = False
        self.thread: Optional[_DecodeThread] = None  # the one it was handed to

    def make(self) -> None:
        try:
            self.made = _line_and_repairs(self.data, self.max_text_chars, self.data.codec)
        except Exception as exc:  # raised on the writer thread, which counts it
            self.error = exc


class DecodeThreads:
    """Makes lines on a thread of their own, in the order handed over; the writer waits at
    most ``timeout_s`` for each. A thread that has not finished a line by then is stuck:
    replaced for the lines behind it, once. While the thread it replaced is stuck too, the
    lines behind are written without waiting, until one of them returns (and serves
    again). A tokenizer that never answers thus holds two threads, not one a line."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._start_empty()
        forks.in_child(self._start_empty)

    def _start_empty(self) -> None:
        self._cond = threading.Condition()  # guards the threads' queues and the lines' states
        self._current: Optional[_DecodeThread] = None
        self._replaced: Optional[_DecodeThread] = None  # stuck when it was replaced

    def start(self, line: _Line) -> None:
        """Hands ``line`` to the decode thread (any thread; no tokenizer call under the lock)."""
        with self._cond:
            if self._current is None:
                try:
                    self._current = _DecodeThread(self._cond)
                except RuntimeError as exc:  # no thread to be had: the line is written without its texts
                    health.record_failure(f"{_OUTPUT}.decode_thread", exc)
                    return
            line.thread = self._current
            self._current.queue.append(line)
            self._cond.notify_all()

    def result(self, line: _Line) -> Optional[Tuple[str, Counter]]:
        """The line made (raised as it raised), waited for at most ``timeout_s``; ``None``
        when it was not made in time (it is then never made)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not line.done:
                thread = line.thread
                left = deadline - time.monotonic()
                if thread is None or left <= 0 or (thread.stuck and thread.running is not line):
                    line.abandoned = True  # its thread skips it
                    if thread is not None and thread.running is not None and not thread.stuck:
                        self._replace(thread)
                    return None
                self._cond.wait(left)
        if line.error is not None:
            raise line.error
        return line.made

    def forget(self, line: _Line) -> None:
        """``line`` will not be written: not made."""
        with self._cond:
            line.abandoned = True

    def _replace(self, thread: "_DecodeThread") -> None:
        # with the lock held: ``thread`` has run one line past its deadline
        thread.stuck = True
        if self._replaced is not None and self._replaced.running is not None:
            return  # the one replaced before is stuck still: no third thread
        thread.retired = True  # it ends once its line returns
        self._replaced = thread
        if self._current is thread:
            self._current = None
        if thread.queue:
            try:
                self._current = self._current or _DecodeThread(self._cond)
            except RuntimeError as exc:  # the lines behind are written without their texts
                health.record_failure(f"{_OUTPUT}.decode_thread", exc)
                for waiting in thread.queue:
                    waiting.thread = None
                thread.queue.clear()
                return
            for waiting in thread.queue:
                waiting.thread = self._current
            self._current.queue.extend(thread.queue)
            thread.queue.clear()
        self._cond.notify_all()

    def close(self) -> None:
        """The threads end (a stuck one once its line returns)."""
        with self._cond:
            for thread in (self._current, self._replaced):
                if thread is not None:
                    thread.retired = True
                    thread.queue.clear()
            self._current = self._replaced = None
            self._cond.notify_all()


class _DecodeThread:
    """A thread making the lines handed to it, one at a time, under its owner's lock."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.queue: Deque[_Line] = deque()
        self.running: Optional[_Line] = None
        self.stuck = False  # past a line's deadline in the line it runs
        self.retired = False
        threading.Thread(target=self._loop, name="otel-verl-trajectory-decode", daemon=True).start()

    def _loop(self) -> None:
        cond = self.cond
        while True:
            with cond:
                while not self.queue and not self.retired:
                    cond.wait()
                if not self.queue:
                    return
                line = self.queue.popleft()
                if line.abandoned:
                    continue
                self.running = line
            line.make()
            with cond:
                self.running = None
                self.stuck = False
                line.done = True
                cond.notify_all()


class _TrajectoryFiles:
    """Which file the next line goes to; used on the writer thread only.

    Like the seed, a new file starts when the current one has reached the size limit
    (checked before each line, so a file may end one line past it). Sizes are counted
    here rather than stat'ed: the file is this process's own.
    """

    def __init__(self, directory: str, max_bytes: int, discovery_path: Optional[str], clock: Callable[[], float]) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.discovery_path = discovery_path
        self.clock = clock
        self.path: Optional[str] = None
        self.size = 0
        self._pid = 0
        self._last_ms = -1

    def path_for(self, n_bytes: int) -> str:
        pid = output_pid()
        if self.path is None or self.size >= self.max_bytes or pid != self._pid:
            self._start_file(pid)
        self.size += n_bytes
        return self.path  # type: ignore[return-value]

    def _start_file(self, pid: int) -> None:
        if self.path is None:
            # Announced with the first file, not at start: every traced process has this
            # processor, but only rollout workers (where the seed's store lived) write.
            write_discovery_file(self.discovery_path, self.directory)
        # Two files started within one millisecond would share a name: a new name is
        # always at least 1 ms after the previous one.
        ms = max(int(self.clock() * 1000), self._last_ms + 1)
        self._last_ms = ms
        stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(ms // 1000))
        self.path = os.path.join(self.directory, f"trajectory_{pid}_{stamp}_{ms % 1000:03d}.jsonl")
        self.size = 0
        self._pid = pid


# --------------------------------------------------------------------------- the line

_Decode = Optional[Callable[..., str]]
_Encode = Optional[Callable[..., List[int]]]


def _first_prompt(turn: TurnData) -> Sequence[int]:
    count = turn.prompt_token_count
    return turn.prompt_ids[:count] if count is not None else turn.prompt_ids


def trajectory_line(data: TrajectoryData, max_text_chars: int = MAX_TEXT_CHARS) -> str:
    """The JSONL line (without newline) for one finished trajectory, each text cut at
    ``max_text_chars``."""
    line, repairs = _line_and_repairs(data, max_text_chars, data.codec)
    _count_repairs(repairs, max_text_chars)
    return line


def _count_repairs(repairs: Counter, max_text_chars: int) -> None:
    if repairs["text_cut"]:
        health.record_failures(f"{_OUTPUT}.text_cut", repairs["text_cut"], f"(a text cut at {max_text_chars} characters)")
    if repairs["non_finite"]:
        health.record_failures(f"{_OUTPUT}.non_finite", 1, "(a NaN or infinity written as null)")


def _line_and_repairs(data: TrajectoryData, max_text_chars: int, codec: Any) -> Tuple[str, Counter]:
    """The line made with ``codec`` (``None``: as without a tokenizer), and what was
    repaired in it: counted by the caller once the line is the one written (a line whose
    tokenizer was too late is made again without it)."""
    decode, encode = codec if codec is not None else (None, None)
    repairs: Counter = Counter()
    texts = _Texts(decode, encode, max_text_chars, repairs)
    turns = data.turns
    # The contract's "first turn's prompt": ToolAgentLoop extends one prompt list in place,
    # so cut it back to the length it had when turn 0 was sent.
    initial_prompt_text = texts.decode(_first_prompt(turns[0])) if turns else None
    # Key order is the contract (the seed's dataclass field order minus dropped fields).
    rest = {
        "request_id": str(data.traj_uid),
        "n_samples": data.n_samples,
        "global_step": data.global_step,
        "created_at_ts": data.created_at,
        "completed_at_ts": data.completed_at,
        "total_time_ms": (data.completed_at - data.created_at) * 1000,
        "turns": _turn_dicts(turns, texts),
        "initial_prompt_text": initial_prompt_text,
        "agent_metrics": texts.cut_all(_agent_metrics(data)),
    }
    outer = {"prompt_uid": data.uid, "sample_index": sample_index(data.traj_uid),
             "raw_message": _json(rest, repairs)}
    return json.dumps(outer, ensure_ascii=False), repairs


def line_bytes(data: TrajectoryData, max_text_chars: int = MAX_TEXT_CHARS) -> int:
    """About the bytes of the trajectory's line, for the writer's queue bound."""
    size = 1024
    for turn in data.turns:
        size += 512 + ID_BYTES * (min(len(turn.prompt_ids), max_text_chars) +
                                  min(len(turn.completion_ids), max_text_chars))
        if turn.observation_text:
            size += min(len(turn.observation_text), max_text_chars)
    return size


class _Texts:
    """The texts of one line: decoded with the trajectory's tokenizer, each cut at
    ``max_chars`` (``repairs["text_cut"]``)."""

    def __init__(self, decode: _Decode, encode: _Encode, max_chars: int, repairs: Counter) -> None:
        self._decode, self._encode, self.max_chars = decode, encode, max_chars
        self.decodes = decode is not None
        self.repairs = repairs

    def cut(self, text: Optional[str]) -> Optional[str]:
        if text is None or len(text) <= self.max_chars:
            return text
        self._count_cut()
        return text[: self.max_chars]

    def _count_cut(self) -> None:
        self.repairs["text_cut"] += 1

    def cut_all(self, value: Any) -> Any:
        """``value`` (agent metrics) with every text in it cut."""
        if isinstance(value, str):
            return self.cut(value)
        if isinstance(value, dict):
            return {key: self.cut_all(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.cut_all(item) for item in value]
        return value

    def decode(self, ids: Any) -> Optional[str]:
        if self._decode is None or ids is None:
            return None
        try:
            ids = token_list(ids)
            if len(ids) <= self.max_chars:
                return self.cut(self._decode(ids, skip_special_tokens=False))
            # a token is a character of text or more, nearly always: the ids past the bound
            # are not decoded at all
            self._count_cut()
            return self._decode(ids[: self.max_chars], skip_special_tokens=False)[: self.max_chars]
        except Exception as exc:  # UnsentTokens too: a prompt id that was not kept
            health.record_failure(f"{_OUTPUT}.decode", exc)
            return None

    def token_count(self, text: Optional[str]) -> int:
        """The tokens of an observation; one longer than ``max_chars`` is encoded by pieces
        of that size (its count may then differ by a few tokens at the seams)."""
        if self._encode is None or not text:
            return 0
        try:
            step = self.max_chars
            return sum(len(self._encode(text[i:i + step], add_special_tokens=False))
                       for i in range(0, len(text), step))
        except Exception as exc:
            health.record_failure(f"{_OUTPUT}.encode", exc)
            return 0


def _agent_metrics(data: TrajectoryData) -> Dict[str, Any]:
    """The agent loop's metrics plus the trajectory's ``reward_score``, always present
    (``0.0`` when the trajectory was not scored, as the seed's metrics model defaulted)."""
    metrics = dict(data.agent_metrics or {})
    if data.reward_score is not None:
        metrics["reward_score"] = data.reward_score
    else:
        metrics.setdefault("reward_score", 0.0)
    return metrics


def _turn_dicts(turns: Sequence[TurnData], texts: _Texts) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    prev_prompt = prev_completion = prev_observation_tokens = 0
    for i, turn in enumerate(turns):
        prompt_count, completion_count = prompt_tokens(turn), completion_tokens(turn)
        completion_ms = (turn.end_ts - turn.start_ts) * 1000 if turn.end_ts else 0.0
        observation_ms = (
            (turn.observation_end_ts - turn.observation_start_ts) * 1000
            if turn.observation_start_ts is not None and turn.observation_end_ts is not None
            else None
        )
        overhead_tokens = overhead_text = None
        if i >= 1:
            overhead_tokens = prompt_count - prev_prompt - prev_completion - prev_observation_tokens
            if overhead_tokens > 0:
                # The contract's quirk: the slice starts right after the previous
                # completion, i.e. before (not after) the previous turn's observation.
                start = prev_prompt + prev_completion
                overhead_text = texts.decode(turn.prompt_ids[start : start + overhead_tokens])
        completion_text = texts.decode(turn.completion_ids)
        if completion_text is None and texts.decodes:
            completion_text = ""  # the seed's agent loops wrote "" when decoding failed
        server = _server_timings(turn.server_meta)
        out.append(
            {
                "turn_index": i,
                "prompt_token_count": prompt_count,
                "completion_text": completion_text,
                "completion_token_count": completion_count,
                "finish_reason": turn.finish_reason or "",
                "observation_text": texts.cut(turn.observation_text),
                "start_ts": turn.start_ts,
                "end_ts": turn.end_ts,
                "observation_start_ts": turn.observation_start_ts,
                "observation_end_ts": turn.observation_end_ts,
                "turn_total_time_ms": completion_ms + (observation_ms or 0.0),
                "completion_time_ms": completion_ms,
                "observation_time_ms": observation_ms,
                **server,
                "template_overhead_tokens": overhead_tokens,
                "template_overhead_text": overhead_text,
            }
        )
        prev_prompt, prev_completion = prompt_count, completion_count
        # Only a following turn needs them: the last turn's observation is never encoded.
        if i + 1 < len(turns):
            prev_observation_tokens = texts.token_count(turn.observation_text)
    return out


def _server_timings(meta: Dict[str, Any]) -> Dict[str, Any]:
    """sglang's per-request meta in milliseconds; absent -> null. Only ``e2e_latency`` is
    always there; the rest needs the server's ``enable_metrics`` (:mod:`otel_verl.server_timing`
    says which keys each sglang version reports)."""
    e2e = number(meta.get(st.E2E_LATENCY))
    queue = number(meta.get(st.QUEUE_TIME))
    ttft = st.ttft_s(meta)
    launch = number(meta.get(st.PREFILL_LAUNCH_LATENCY))
    total_ms = e2e * 1000 if e2e is not None else None
    queue_ms = queue * 1000 if queue is not None else None
    ttft_ms = ttft * 1000 if ttft is not None else None
    decode_ms = None
    if total_ms is not None:
        # max(0, ...) as in the seed: an int 0 when clamped
        decode_ms = max(0, total_ms - (queue_ms or 0) - (ttft_ms or 0))
    return {
        "sglang_time_ms": total_ms,
        "sglang_queue_time_ms": queue_ms,
        "sglang_ttft_ms": ttft_ms,
        "sglang_prefill_ms": launch * 1000 if launch is not None else None,
        "sglang_decode_time_ms": decode_ms,
    }


def _json(value: Any, repairs: Counter) -> str:
    """``value`` as JSON text, NaN and infinities (which JSON has not) as null
    (``repairs["non_finite"]``)."""
    try:
        return json.dumps(value, ensure_ascii=False, default=_jsonable, allow_nan=False)
    except ValueError:
        repairs["non_finite"] += 1
        return json.dumps(_finite(value), ensure_ascii=False, default=_jsonable, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    if value is None or isinstance(value, (str, int)):
        return value
    return _finite(_jsonable(value))  # numpy values and arrays may hold NaN too


def _jsonable(value: Any) -> Any:
    """json.dumps fallback for agent metrics: numpy scalars/arrays, else their str."""
    to_list = getattr(value, "tolist", None)
    if callable(to_list):
        return to_list()
    return str(value)
