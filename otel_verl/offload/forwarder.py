"""The traced process's side: a span processor that hands every span to the export process.

On the calling thread (a rollout worker's event loop) ``on_start`` / ``on_end`` append
the span to a deque; the span that fills a batch (512) has the batch snapshotted
(:mod:`otel_verl.offload.wire`) and pickled there, into frames a sender thread writes to
the export process's stdin. The sender also takes what is pending every 50 ms and at a
flush. A reply thread reads the export process's flush answers and health counters.
Nothing here waits on the export process except :meth:`force_flush` and
:meth:`shutdown`, which are asked to: a slow export process leaves frames unwritten,
then spans pending, and beyond ``max_pending`` they are counted as lost.

Losses are counted, never silent: spans beyond ``max_pending`` waiting (the export
process cannot keep up), spans that were never sent because the export process could
not start or died, and whatever the export process itself counted (its counters come
back with every flush answer and at its exit).
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
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from opentelemetry.sdk.trace import SpanProcessor

from otel_verl import health
from otel_verl.offload import wire
from otel_verl.semconv import Kind

logger = logging.getLogger("otel_verl")

OUTPUT = "offload"  # the health counters' name for spans the export process never got
# what an entry of the span deque is followed by: a started span, an ended span, a flush's number
_STARTED, _ENDED, _FLUSH = object(), object(), object()
HOST_ENV = "OTEL_VERL_OFFLOAD_HOST"  # set in the export process (it must not trace itself)


class OffloadSpanProcessor(SpanProcessor):
    """Runs the given outputs in a child process ("the export process") fed with this
    process's spans; see the module docs."""

    on_end_kinds = None  # every span: OTLP exports spans of other tracers on this provider too

    def __init__(
        self,
        config: wire.HostConfig,
        *,
        max_pending: int = 1 << 16,
        batch_interval_s: float = 0.05,
        max_batch: int = 512,
        start_timeout_s: float = 60.0,
        start_kinds: FrozenSet[Kind] = frozenset(Kind),
    ) -> None:
        # the kinds whose start the export process's outputs read (bootstrap.output_start_kinds):
        # any other span goes once, whole, when it ends
        self.on_start_kinds = frozenset(start_kinds)
        self._config = config
        self._max_entries = 2 * max_pending  # two deque entries a span (see on_start)
        self._interval = batch_interval_s
        self._max_batch = max_batch
        self._batch_entries = 2 * max_batch
        self._start_timeout = start_timeout_s
        self._start()
        _live.add(self)

    # ------------------------------------------------------------------ span processor (any thread)

    # The deque holds (what, item) as two entries, not a tuple: a tuple per start and end
    # would live until the sender takes it, and the cyclic GC runs more often the more
    # young objects are alive (each young collection walks the agent loop's live lists).

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pending = self._pending
        if len(pending) < self._max_entries and self._alive:
            pending.extend((_STARTED, span))  # one C call: the pair is never split
        else:
            self._refused(_STARTED, span)

    def on_end(self, span: Any) -> None:
        pending = self._pending
        if len(pending) < self._max_entries and self._alive:
            pending.extend((_ENDED, span))
            if len(pending) >= self._batch_entries:
                self._batch_full()
        else:
            self._refused(_ENDED, span)

    def _batch_full(self) -> None:
        # A full batch is snapshotted and pickled here, on the thread that ended its last
        # span, while its spans are still in this core's caches; the sender thread only
        # writes the frames. Taken by the sender thread, the same work cost ~20 us more a
        # trajectory (every span's objects read and their reference counts changed from
        # another core, a GIL hand-over per wake-up). Never waits: the sender may hold
        # the batch lock, or the frames not written yet may be many (a slow export
        # process); the sender then takes the batch at its next wake-up.
        if len(self._outbox) < _MAX_UNWRITTEN_FRAMES and self._batch_lock.acquire(False):
            try:
                self._take_pending()
            except Exception as exc:
                health.record_failure("offload.batch", exc)
            finally:
                self._batch_lock.release()
            self._wake.set()
        elif not self._wake.is_set():  # (is_set() first: set() takes the event's lock)
            self._wake.set()

    def _refused(self, what: object, span: Any) -> None:
        if self._forked:  # first span of a forked child that traces: its own export process
            self._forked = False
            self._start()
            if self._alive:
                self._pending.extend((what, span))
                return
        self._lost(1, "the export process is not keeping up" if self._alive else self._why_dead)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Everything handed over so far written and exported by the export process."""
        if not self._alive:
            return False
        with self._replies:
            self._flush_seq += 1
            seq = self._flush_seq
        self._pending.extend((_FLUSH, seq))
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
        """Send what is pending, let the export process finish its outputs, wait for it."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._sender.is_alive():
            self._sender.join(self._start_timeout)
        process = self._process
        if process is not None:
            try:
                process.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                process.wait(self._start_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                self._lost(len(self._pending), "the export process did not finish in time")
        if self._replier.is_alive():
            self._replier.join(5.0)
        _live.discard(self)

    # ------------------------------------------------------------------ start, sender, replies

    def _start(self) -> None:
        self._pending: deque = deque()
        self._outbox: deque = deque()  # (frame bytes, spans in it) for the sender thread to write
        self._batch_lock = threading.Lock()  # the pending spans' taker, the snapshots, the codecs
        self._wake = threading.Event()
        self._replies = threading.Condition()
        self._flush_seq = self._answered = 0
        self._flushed_ok = True
        self._closing = self._forked = False
        self._alive = True
        self._why_dead = ""
        self._process: Optional[subprocess.Popen] = None
        self._codecs: "OrderedDict[Any, int]" = OrderedDict()  # (decode, encode) -> id, most recent last
        self._next_codec_id = 0
        self._unsent_codecs: List[Tuple[int, bytes]] = []  # sent before the batch that names them
        self._forgotten_codecs: List[int] = []  # sent after the batch (its trajectories may name them)
        self._host_counts: Dict[str, Dict[str, int]] = {"failures": {}, "dropped": {}}
        self._snapshots = wire.Snapshotter(self._codec_id)
        self._pid = os.getpid()
        try:
            reply_read, reply_write = os.pipe()
            env = dict(os.environ)
            env[HOST_ENV] = "1"
            self._process = subprocess.Popen(
                [sys.executable, "-m", "otel_verl.offload.host", str(reply_write)],
                stdin=subprocess.PIPE, pass_fds=(reply_write,), env=env, close_fds=True,
            )
            os.close(reply_write)
            _widen_pipe(self._process.stdin.fileno())
            self._reply_pipe = os.fdopen(reply_read, "rb")
            wire.write_frame(self._process.stdin, ("config", self._config))
        except Exception as exc:
            health.record_failure("offload.start", exc)
            self._dead(f"the export process could not start ({type(exc).__name__}: {exc})")
        self._sender = threading.Thread(target=self._send_loop, name="otel-verl-offload", daemon=True)
        self._replier = threading.Thread(target=self._reply_loop, name="otel-verl-offload-replies", daemon=True)
        if self._process is not None:
            self._sender.start()
            self._replier.start()

    def _send_loop(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            closing = self._closing
            self._write_frames()
            self._take_pending_locked()
            self._write_frames()
            if closing or not self._alive:
                while self._pending and self._alive:  # whatever came meanwhile
                    self._take_pending_locked()
                    self._write_frames()
                return

    def _take_pending_locked(self) -> None:
        with self._batch_lock:
            try:
                self._take_pending()
            except Exception as exc:  # the sender thread goes on
                health.record_failure("offload.batch", exc)

    def _take_pending(self) -> None:
        """What is pending now, as frames for the sender thread to write (the batch lock
        held). The spans added meanwhile wait for the next full batch or wake-up:
        drained until empty, the sender made a frame every few spans, as each write let
        the agent loop's thread add a few more."""
        pending, snapshots = self._pending, self._snapshots
        popleft = pending.popleft
        left = len(pending) // 2  # (only this lock's holder takes entries; _dead() takes it too)
        while left > 0 and self._alive:
            batch, flushes = [], []
            while left > 0 and len(batch) < self._max_batch:
                what, item = popleft(), popleft()
                left -= 1
                if what is _FLUSH:
                    flushes.append(item)
                    break  # spans queued after a flush marker go in the next frame
                try:
                    batch.append(snapshots.start(item) if what is _STARTED else snapshots.end(item))
                except Exception as exc:
                    health.record_failure("offload.snapshot", exc)
            self._encode(batch, flushes)

    def _encode(self, batch: List[tuple], flushes: List[int]) -> None:
        """A batch's frames, in the order the export process reads them, queued for the
        sender thread: ``(bytes, spans in them)``."""
        frames = [(wire.frame(("codec",) + codec), 0) for codec in self._unsent_codecs]  # (bytes already)
        self._unsent_codecs = []
        if batch:
            try:
                frames.append((wire.frame(("spans", batch)), len(batch)))
            except Exception as exc:  # an unpicklable value: the flushes still go
                health.record_failure("offload.send", exc)
                self._lost(len(batch), "a batch could not be sent")
        frames += [(wire.frame(("forget_codec", codec_id)), 0) for codec_id in self._forgotten_codecs]
        self._forgotten_codecs = []
        frames += [(wire.frame(("flush", seq)), 0) for seq in flushes]
        self._outbox.extend(frames)

    def _write_frames(self) -> None:
        """The queued frames into the export process's stdin (the sender thread only)."""
        outbox = self._outbox
        stdin = self._process.stdin  # type: ignore[union-attr]
        while outbox and self._alive:
            data, spans = outbox[0]
            try:
                stdin.write(data)
                stdin.flush()
            except (OSError, ValueError) as exc:  # a dead export process (EPIPE)
                self._dead(f"the export process is gone ({type(exc).__name__}: {exc})")
                return
            outbox.popleft()

    def _codec_id(self, decode: Any, encode: Any) -> int:
        key = (decode, encode)  # bound methods compare equal for the same tokenizer
        codecs = self._codecs
        try:
            codec_id = codecs[key]
        except KeyError:
            pass
        else:
            codecs.move_to_end(key)
            return codec_id
        codec_id = self._next_codec_id
        self._next_codec_id += 1
        try:
            self._unsent_codecs.append((codec_id, wire.dumps_codec(key)))
        except Exception as exc:
            # The trajectory JSONL then has no texts for this tokenizer's trajectories.
            health.record_failure("offload.tokenizer", exc)
            codec_id = wire.UNSENDABLE_CODEC
        codecs[key] = codec_id
        # A worker has one tokenizer; an agent loop that makes a decode function per
        # trajectory (a closure) must not pile them up here or in the export process.
        if len(codecs) > _MAX_CODECS:
            _, old_id = codecs.popitem(last=False)
            if old_id != wire.UNSENDABLE_CODEC:
                self._forgotten_codecs.append(old_id)
        return codec_id

    def _reply_loop(self) -> None:
        while True:
            try:
                reply = wire.read_frame(self._reply_pipe)
            except Exception as exc:
                health.record_failure("offload.replies", exc)
                reply = None
            if reply is None:  # the export process has exited
                if not self._closing:
                    self._dead("the export process exited")
                with self._replies:
                    self._replies.notify_all()
                return
            seq, ok, counts = reply
            self._merge_counts(counts)
            with self._replies:
                self._answered = max(self._answered, seq)
                self._flushed_ok = ok
                self._replies.notify_all()

    def _merge_counts(self, counts: Dict[str, Dict[str, int]]) -> None:
        """The export process's own losses and failures, counted here too (once)."""
        seen = self._host_counts
        for name, count in counts.get("dropped", {}).items():
            health.record_dropped(name, count - seen["dropped"].get(name, 0), "counted in the export process")
        for name, count in counts.get("failures", {}).items():
            health.record_failures(name, count - seen["failures"].get(name, 0), "in the export process")
        self._host_counts = counts

    def _dead(self, why: str) -> None:
        self._alive = False
        self._why_dead = why
        with self._batch_lock:  # (no caller holds it) a batch being taken finishes first: its frames are counted
            pending = self._pending
            entries = list(pending)
            pending.clear()
            lost = sum(1 for entry in entries if entry is _STARTED or entry is _ENDED)
            outbox = self._outbox
            while outbox:
                lost += outbox.popleft()[1]
        self._lost(lost, why)

    def _lost(self, count: int, why: str) -> None:
        health.record_dropped(OUTPUT, count, why)

    def _after_fork_in_child(self) -> None:
        # The parent's export process and threads are the parent's. A forked child that
        # traces gets its own when its first span comes (most forked children never do).
        self._pending = deque()
        self._outbox = deque()
        self._batch_lock = threading.Lock()  # another thread may have held it at fork time
        self._process = None
        self._alive, self._forked, self._why_dead = False, True, "forked child"


def _widen_pipe(fd: int) -> None:
    """A batch is a few hundred KB: with Linux's default 64 KB pipe the sender would
    sleep and wake (and the export process read) several times a batch."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except (ImportError, OSError):
        pass  # a smaller pipe only costs more wake-ups


_MAX_CODECS = 16
_MAX_UNWRITTEN_FRAMES = 4  # beyond, a full batch waits as spans (bounded by max_pending), not as bytes
_PIPE_BYTES = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size
_live: "weakref.WeakSet[OffloadSpanProcessor]" = weakref.WeakSet()


def _restart_in_child() -> None:
    for processor in list(_live):
        try:
            processor._after_fork_in_child()
        except Exception as exc:
            health.record_failure("offload.fork", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restart_in_child)
