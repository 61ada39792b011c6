"""The traced process's side: a span processor that hands every span to the export process.

``on_start`` / ``on_end`` only queue the span with its payload (a start also with a copy
of its attributes: the caller goes on setting more). A sender thread wakes every 50 ms,
or when a batch is full, turns what is queued into snapshots (:mod:`otel_verl.offload.wire`),
pickles them by batches of 512 and writes the frames to the export process's stdin. A
reply thread reads the export process's answers: its :class:`~wire.Hello` (the wire
versions must match before a span is written), its flush answers and health counters.
Nothing here waits on the export process except :meth:`force_flush` and
:meth:`shutdown`, which are asked to.

Losses are counted in spans (a span's end; a start alone is not a span), never silent:
spans beyond ``max_pending`` queued (the export process cannot keep up), spans never sent
because the export process could not start, speaks another wire version or died, and
whatever the export process itself counted (its counters come back with every flush
answer and at its exit).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import Any, Dict, FrozenSet, List, Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_verl import health
from otel_verl.offload import wire
from otel_verl.payload import payload_of
from otel_verl.semconv import Subject

logger = logging.getLogger("otel_verl")

OUTPUT = "offload"  # the health counters' name for spans the export process never got
STARTED, ENDED, FLUSH = "started", "ended", "flush"  # what a queue entry is
MAX_CODECS = 16  # tokenizers both ends keep (an agent loop may make a decode function per trajectory)


class OffloadSpanProcessor(SpanProcessor):
    """Runs the given outputs in a child process ("the export process") fed with this
    process's spans; see the module docs.

    ``start_subjects``: the payload subjects whose start an output reads; other spans go once,
    when they end (OTLP reads ends only)."""

    def __init__(
        self,
        config: wire.HostConfig,
        *,
        max_pending: int = 1 << 16,
        batch_interval_s: float = 0.05,
        max_batch: int = 512,
        start_timeout_s: float = 60.0,
        start_subjects: FrozenSet[Subject] = frozenset(Subject),
    ) -> None:
        self.start_subjects = frozenset(start_subjects)
        self.config = config
        self.max_pending = max_pending
        self.batch_interval_s = batch_interval_s
        self.max_batch = max_batch
        self.start_timeout_s = start_timeout_s
        self._start()
        _live.add(self)

    # ------------------------------------------------------------------ span processor (any thread)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        payload = payload_of(span)
        if payload is not None and payload.subject in self.start_subjects:
            self._queue((STARTED, span, payload, wire.copied(span.attributes)))

    def on_end(self, span: Any) -> None:
        self._queue((ENDED, span, payload_of(span), None))

    def _queue(self, entry: tuple) -> None:
        pending = self._pending
        if self._alive and len(pending) < self.max_pending:
            pending.append(entry)
            if len(pending) >= self.max_batch and not self._wake.is_set():
                self._wake.set()
            return
        if self._forked:  # the first span of a forked child that traces: its own export process
            self._forked = False
            self._start()
            if self._alive:
                self._pending.append(entry)
                return
        spans = entry[0] == ENDED
        if self._alive:
            self._lost(spans, "the export process is not keeping up")
        else:  # (and whatever was queued as it died)
            self._lost(spans + self._drop_pending(), self._why_dead)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Everything queued so far written and exported by the export process."""
        if not self._alive:
            return False
        with self._replies:
            self._flush_seq += 1
            seq = self._flush_seq
        self._pending.append((FLUSH, seq))
        self._wake.set()
        deadline = time.monotonic() + timeout_millis / 1000.0
        with self._replies:
            while self._answered < seq and self._alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._replies.wait(left)
            return self._answered >= seq and self._flushed_ok

    def shutdown(self) -> None:
        """Send what is queued, let the export process finish its outputs, wait for it."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._sender.is_alive():
            self._sender.join(self.start_timeout_s)
        process = self._process
        if process is not None:
            try:
                process.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                process.wait(self.start_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                self._dead("the export process did not finish in time")
        if self._replier.is_alive():
            self._replier.join(5.0)
        self._dead(self._why_dead or "the span processor was shut down")  # later spans are counted too
        _live.discard(self)

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        self._pending: deque = deque()  # (STARTED/ENDED, span, payload, start attributes) or (FLUSH, seq)
        self._wake = threading.Event()
        self._replies = threading.Condition()
        self._ready = threading.Event()  # the export process's Hello came (or it is dead)
        self._flush_seq = self._answered = 0
        self._flushed_ok = True
        self._closing = self._forked = False
        self._alive = True
        self._why_dead = ""
        self._process: Optional[subprocess.Popen] = None
        self._codecs: "OrderedDict[Any, int]" = OrderedDict()  # (decode, encode) -> id, most recent last
        self._next_codec_id = 0
        self._new_codecs: List[wire.Codec] = []  # to send before the batch that names them
        self._forgotten_codecs: List[wire.ForgetCodec] = []  # to send after it
        self._host_counts: Dict[str, Dict[str, int]] = {"failures": {}, "dropped": {}}
        self._sender = threading.Thread(target=self._send_loop, name="otel-verl-offload", daemon=True)
        self._replier = threading.Thread(target=self._reply_loop, name="otel-verl-offload-replies", daemon=True)
        try:
            reply_read, reply_write = os.pipe()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "otel_verl.offload.host", str(reply_write)],
                stdin=subprocess.PIPE, pass_fds=(reply_write,), close_fds=True,
            )
            os.close(reply_write)
            self._reply_pipe = os.fdopen(reply_read, "rb")
            wire.write_frame(self._process.stdin, wire.Hello(wire.VERSION))
            wire.write_frame(self._process.stdin, wire.Config(self.config))
        except Exception as exc:
            health.record_failure("offload.start", exc)
            self._dead(f"the export process could not start ({type(exc).__name__}: {exc})")
            return
        self._sender.start()
        self._replier.start()

    # ------------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        if not self._ready.wait(self.start_timeout_s) and self._alive:
            self._dead("the export process did not answer")
        while self._alive:
            self._wake.wait(self.batch_interval_s)
            self._wake.clear()
            closing = self._closing
            self._send_pending()
            if closing:
                self._send_pending()  # what came meanwhile
                return

    def _send_pending(self) -> None:
        """What is queued now, as frames (spans queued meanwhile wait for the next wake-up:
        taking them too, the sender would write a frame every few spans)."""
        pending = self._pending
        left = len(pending)
        while left > 0 and self._alive:
            batch: List[wire.SpanSnapshot] = []
            flush = None
            while left > 0 and len(batch) < self.max_batch:
                entry = pending.popleft()
                left -= 1
                if entry[0] == FLUSH:
                    flush = entry[1]
                    break  # what was queued after it goes after the Flush
                try:
                    _, span, payload, start_attributes = entry
                    batch.append(wire.snapshot(span, payload, self._codec_id, start_attributes))
                except Exception as exc:
                    health.record_failure("offload.snapshot", exc)
                    self._lost(entry[0] == ENDED, "a span could not be read")
            self._send_batch(batch, flush)

    def _send_batch(self, batch: List[wire.SpanSnapshot], flush: Optional[int]) -> None:
        frames = [(wire.frame(codec), 0) for codec in self._new_codecs]  # (bytes, span ends in them)
        self._new_codecs = []
        if batch:
            frames.append(self._spans_frame(batch))
        frames += [(wire.frame(forget), 0) for forget in self._forgotten_codecs]
        self._forgotten_codecs = []
        if flush is not None:
            frames.append((wire.frame(wire.Flush(flush)), 0))
        for i, (data, _) in enumerate(frames):
            if not (self._alive and self._write(data)):
                self._lost(sum(spans for _, spans in frames[i:]), self._why_dead)
                return

    def _spans_frame(self, batch: List[wire.SpanSnapshot]) -> tuple:
        """The frame of ``batch`` and how many span ends it carries."""
        try:
            return wire.frame(wire.Spans(batch)), _ends(batch)
        except Exception as exc:  # a payload that does not pickle: the rest of the batch still goes
            health.record_failure("offload.send", exc)
            sent = [snapshot for snapshot in batch if _pickles(snapshot)]
            self._lost(_ends(batch) - _ends(sent), "a span could not be pickled")
            return wire.frame(wire.Spans(sent)), _ends(sent)

    def _write(self, data: bytes) -> bool:
        try:
            self._process.stdin.write(data)  # type: ignore[union-attr]
            self._process.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError) as exc:  # a dead export process (EPIPE)
            self._dead(f"the export process is gone ({type(exc).__name__}: {exc})")
            return False
        return True

    def _codec_id(self, decode: Any, encode: Any) -> int:
        key = (decode, encode)  # bound methods compare equal for the same tokenizer
        codecs = self._codecs
        codec_id = codecs.get(key)
        if codec_id is not None:
            codecs.move_to_end(key)
            return codec_id
        codec_id = self._next_codec_id
        self._next_codec_id += 1
        try:
            self._new_codecs.append(wire.Codec(codec_id, wire.dumps_codec(key)))
        except Exception as exc:
            # The trajectory JSONL then has no texts for this tokenizer's trajectories.
            health.record_failure("offload.tokenizer", exc)
            codec_id = wire.UNSENDABLE_CODEC
        codecs[key] = codec_id
        if len(codecs) > MAX_CODECS:
            _, old_id = codecs.popitem(last=False)
            if old_id != wire.UNSENDABLE_CODEC:
                self._forgotten_codecs.append(wire.ForgetCodec(old_id))
        return codec_id

    # ------------------------------------------------------------------ reply thread

    def _reply_loop(self) -> None:
        hello = self._read_reply()
        if not isinstance(hello, wire.Hello) or hello.version != wire.VERSION:
            if hello is not None:
                why = f"the export process speaks wire version {hello.version}, this process {wire.VERSION}" \
                    if isinstance(hello, wire.Hello) else f"the export process answered {hello!r}"
                health.record_failure("offload.version", WireVersionError(why))
                self._dead(why)
            else:
                self._dead("the export process exited")
            self._ready.set()
            return
        self._ready.set()
        while True:
            reply = self._read_reply()
            if reply is None:  # the export process has exited
                if not self._closing:
                    self._dead("the export process exited")
                with self._replies:
                    self._replies.notify_all()
                return
            self._merge_counts(reply.counts)
            with self._replies:
                self._answered = max(self._answered, reply.seq)
                self._flushed_ok = reply.ok
                self._replies.notify_all()

    def _read_reply(self) -> Any:
        try:
            return wire.read_frame(self._reply_pipe)
        except Exception as exc:
            health.record_failure("offload.replies", exc)
            return None

    def _merge_counts(self, counts: Dict[str, Dict[str, int]]) -> None:
        """The export process's own losses and failures, counted here too (once)."""
        seen = self._host_counts
        for name, count in counts.get("dropped", {}).items():
            health.record_dropped(name, count - seen["dropped"].get(name, 0), "counted in the export process")
        for name, count in counts.get("failures", {}).items():
            health.record_failures(name, count - seen["failures"].get(name, 0), "in the export process")
        self._host_counts = counts

    # ------------------------------------------------------------------ losses

    def _dead(self, why: str) -> None:
        if self._alive:
            self._alive = False
            self._why_dead = why
        self._ready.set()
        with self._replies:
            self._replies.notify_all()
        self._lost(self._drop_pending(), why)

    def _drop_pending(self) -> int:
        """Empties the queue; how many spans (ends) were in it."""
        pending, spans = self._pending, 0
        while pending:
            try:
                spans += pending.popleft()[0] == ENDED
            except IndexError:  # another thread emptied it meanwhile
                break
        return spans

    def _lost(self, count: int, why: str) -> None:
        health.record_dropped(OUTPUT, count, why)

    def _after_fork_in_child(self) -> None:
        # The parent's export process and threads are the parent's. A forked child that
        # traces gets its own when its first span comes (most forked children never do).
        self._pending = deque()
        self._process = None
        self._alive, self._forked, self._why_dead = False, True, "forked child"


class WireVersionError(Exception):
    """The export process speaks another wire version (otel_verl changed in place?)."""


def _ends(snapshots: List[wire.SpanSnapshot]) -> int:
    return sum(snapshot.end_time is not None for snapshot in snapshots)


def _pickles(snapshot: wire.SpanSnapshot) -> bool:
    try:
        wire.frame(snapshot)
    except Exception:
        return False
    return True


_live: "weakref.WeakSet[OffloadSpanProcessor]" = weakref.WeakSet()


def _restart_in_child() -> None:
    for processor in list(_live):
        try:
            processor._after_fork_in_child()
        except Exception as exc:
            health.record_failure("offload.fork", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restart_in_child)
