"""The traced process's side: a span processor that hands every span to the export process.

``on_start`` / ``on_end`` only queue the span with its payload (a start also with a copy
of its attributes: the caller goes on setting more). A sender thread wakes every 50 ms,
or when a batch is full, packs what is queued (each span's record in its plain-tuple form,
:func:`otel_verl.offload.wire.pack`), pickles them by batches of 512 and writes the frames
to the export process's stdin. A reply thread per export process reads its answers: its
:class:`~wire.Hello` (the wire versions must match before a span is written), its flush
answers and health counters.
Nothing here waits on the export process except :meth:`force_flush` and
:meth:`shutdown`, each within its own time bound.

The sender supervises the export process. At least every second while spans flow it
sends a :class:`~wire.Flush`, whose answer acknowledges every span sent before it (the
export process answers once its outputs have written them). When the export process
dies (its reply pipe ends, a write fails, or a poll finds it gone) the spans it had not
acknowledged are counted lost, and another export process takes over what is queued. Past
``max_restarts_per_minute`` restarts, or on another wire version, this process writes its
outputs itself (``in_process_outputs``), as without offloading, or, not given them,
counts every later span lost.

Losses are counted in spans (a span's end; a start alone is not a span), never silent:
spans beyond ``max_pending`` queued (the export process cannot keep up), spans an export
process died with unacknowledged (a span it wrote in its last second may be counted too),
spans never sent because no export process could run, and whatever the export process
itself counted (its counters come back with every flush answer and at its exit). Should
this process die (SIGKILL: Ray ends its actors so), the export process, which outlives it
(:mod:`otel_verl.offload.host`), writes what it was sent and counts the span ends queued
here and never sent: every end queued sets a :class:`~wire.SharedCount` it reads.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from opentelemetry.sdk.trace import SpanProcessor

from otel_verl import forks, health
from otel_verl.accelerated.batch import span_bytes
from otel_verl.exporters._writer import DEFAULT_MAX_PENDING_BYTES
from otel_verl.offload import wire
from otel_verl.payload import payload_of
from otel_verl.sampling import IsolatingSpanProcessor
from otel_verl.semconv import Subject

logger = logging.getLogger("otel_verl")

OUTPUT = wire.OFFLOAD_OUTPUT
STARTED, ENDED, FLUSH = "started", "ended", "flush"  # what a queue entry is
MAX_SHARED = 16  # shared objects both ends keep (an agent loop may hand over a decode function per trajectory)
CHECKPOINT_INTERVAL_S = 1.0  # how often what was sent is acknowledged (a death may count a span written since)
MAX_RESTARTS_PER_MINUTE = 3
SHUTDOWN_TIMEOUT_S = 60.0  # the export process's outputs get this long to finish at shutdown
GRACE_S = 1.0  # for a killed export process to go, and its last answers to be read
KILL_RESERVE_S = 0.6  # of a shutdown's deadline, to kill an export process that hangs and count its losses
ANSWER_RESERVE_S = 0.2  # of what is left when the export process closes: for its last answer and its exit


class OffloadSpanProcessor(SpanProcessor):
    """Runs the given outputs in a child process ("the export process") fed with this
    process's spans; see the module docs.

    ``start_subjects``: the payload subjects whose start an output reads (``None``: every
    span's); other spans go once, when they end (OTLP reads ends only). ``end_subjects``:
    those whose end an output reads (``None``: every span's, as OTLP does); the others'
    spans are neither sent nor, where nothing else needs them, made. ``in_process_outputs``: makes the span processors
    this process runs itself once no export process can (``outputs.build``)."""

    def __init__(
        self,
        config: wire.HostConfig,
        *,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        batch_interval_s: float = 0.05,
        max_batch: int = 512,
        start_timeout_s: float = 60.0,
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
        max_restarts_per_minute: int = MAX_RESTARTS_PER_MINUTE,
        start_subjects: Optional[FrozenSet[Subject]] = frozenset(Subject),
        end_subjects: Optional[FrozenSet[Subject]] = None,
        in_process_outputs: Optional[Callable[[], Iterable[SpanProcessor]]] = None,
    ) -> None:
        # (IsolatingSpanProcessor hands it no other start or end)
        self.on_start_subjects = start_subjects
        self.on_end_subjects = end_subjects
        self.config = config
        self.max_pending_bytes = max_pending_bytes
        self.batch_interval_s = batch_interval_s
        self.max_batch = max_batch
        self.start_timeout_s = start_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.max_restarts_per_minute = max_restarts_per_minute
        self.in_process_outputs = in_process_outputs
        self._in_process: Optional[SpanProcessor] = None  # the outputs, once written here
        self._start()
        forks.in_child(self._after_fork_in_child)

    # ------------------------------------------------------------------ span processor (any thread)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        in_process = self._in_process
        if in_process is not None:
            in_process.on_start(span, parent_context)
            return
        payload = payload_of(span)
        subjects = self.on_start_subjects
        if subjects is None or payload is not None and payload.subject in subjects:
            self._queue(STARTED, span, payload, wire.copied(span.attributes))

    def on_end(self, span: Any) -> None:
        in_process = self._in_process
        if in_process is not None:
            in_process.on_end(span)
            return
        self._queue(ENDED, span, payload_of(span), None)

    def _queue(self, kind: str, span: Any, payload: Any, start_attributes: Any) -> None:
        size = entry_bytes(span, payload)
        with self._queue_lock:
            accepted = self._accepting and self._pending_bytes + size <= self.max_pending_bytes
            if accepted:
                self._pending.append((kind, span, payload, start_attributes, size))
                self._pending_bytes += size
                if kind is ENDED:
                    self._queued_ends += 1
                    if self._queued_count is not None:  # for the export process, should this process die
                        self._queued_count.cell[0] = self._queued_ends
                if len(self._pending) >= self.max_batch and not self._wake.is_set():
                    self._wake.set()
                return
        if self._forked:  # the first span of a forked child that traces: its own export process
            self._forked = False
            self._start()
            if self._accepting:
                self._queue(kind, span, payload, start_attributes)
                return
        spans = kind is ENDED
        if self._accepting:
            self._lost(spans, "the export process is not keeping up (OTEL_VERL_MAX_QUEUE_MB)")
        else:  # (and whatever was queued as it stopped)
            self._lost(spans + self._drop_pending(), self._why_stopped)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Everything queued so far written and exported, within ``timeout_millis``."""
        deadline = time.monotonic() + timeout_millis / 1000.0
        with self._replies:
            in_process = self._in_process
            if in_process is None:
                if not self._accepting:
                    return False
                self._flush_seq += 1
                seq = self._flush_seq
                self._flush_results[seq] = None
        if in_process is not None:
            return in_process.force_flush(timeout_millis)
        with self._queue_lock:
            self._pending.append((FLUSH, seq, timeout_millis, None, 0))
        self._wake.set()
        with self._replies:
            try:
                while self._flush_results[seq] is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._replies.wait(left)
                return bool(self._flush_results[seq])
            finally:
                del self._flush_results[seq]

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        """Send what is queued, let the export process finish its outputs and wait for it,
        at most ``shutdown_timeout_s`` and ``timeout_millis`` (then it is killed; what it had
        not acknowledged is counted lost)."""
        with self._lifecycle:
            if self._closing:
                return
            self._closing = True
        timeout_s = self.shutdown_timeout_s
        if timeout_millis is not None:
            timeout_s = min(timeout_s, timeout_millis / 1000.0)
        # the last moments are for killing an export process that hangs and counting its losses
        deadline = time.monotonic() + max(0.0, timeout_s - KILL_RESERVE_S)
        self._deadline = deadline  # the export process's Close says how much of it is left
        self._wake.set()
        if self._sender.is_alive():
            self._sender.join(_left(deadline))
        child = self._child
        if child is not None:
            why = ""
            if self._sender.is_alive():  # still writing to an export process that does not read
                child.kill()
                why = "the export process did not read its spans in time"
                self._sender.join(GRACE_S)
            child.close_input()
            try:
                child.process.wait(_left(deadline))
            except subprocess.TimeoutExpired:
                why = "the export process did not finish in time"
            self._bury(child, why, grace_s=KILL_RESERVE_S / 3)
        if self._in_process is not None:
            self._in_process.shutdown()
        self._stop(self._why_stopped or "the span processor was shut down")  # later spans are counted too
        if child is not None and not child.finished and self._in_process is None:
            self._write_loss_file()
        forks.forget(self._after_fork_in_child)

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        # (STARTED/ENDED, span, payload, start attributes, bytes) or (FLUSH, seq, timeout ms, None, 0)
        self._pending: deque = deque()
        self._queue_lock = threading.Lock()  # guards the queue's bytes and its count of ends
        self._pending_bytes = 0  # what the queue holds, estimated (entry_bytes)
        self._queued_ends = 0  # span ends ever queued: the export process counts those it never got
        self._wake = threading.Event()
        self._replies = threading.Condition()  # guards flush results, acknowledgements, relayed counts
        self._lifecycle = threading.Lock()  # no export process starts once shutdown began
        self._flush_seq = 0
        self._flush_results: Dict[int, Optional[bool]] = {}  # force_flush calls waiting: seq -> answer
        self._closing = self._forked = False
        self._deadline = float("inf")  # (time.monotonic) the shutdown's, once it began
        self._accepting = True
        self._why_stopped = ""
        self._restarts: deque = deque()  # when each restart of the last minute happened
        self._child: Optional[ExportProcess] = None
        self._queued_count: Optional[wire.SharedCount] = None
        try:
            self._queued_count = wire.SharedCount.create()
        except Exception as exc:  # an export process then counts only what it was told of
            health.record_failure("offload.queued_count", exc)
        self._forget_shared()
        self._sender = threading.Thread(target=self._send_loop, name="otel-verl-offload", daemon=True)
        try:
            self._child = self._spawn()
        except Exception as exc:
            health.record_failure("offload.start", exc)
            self._fall_back(f"the export process could not start ({type(exc).__name__}: {exc})")
            return
        self._sender.start()

    def _spawn(self) -> "ExportProcess":
        reply_read, reply_write = os.pipe()
        with self._queue_lock:  # what is queued now goes to this export process, and all later
            sent_before = self._queued_ends - sum(entry[0] is ENDED for entry in self._pending)
        command = [sys.executable, "-m", "otel_verl.offload.host", str(reply_write), "--detach",
                   "--served-pid", str(os.getpid()), "--queued-base", str(sent_before)]
        fds = [reply_write]
        if self._queued_count is not None:
            command += ["--queued-fd", str(self._queued_count.fd)]
            fds.append(self._queued_count.fd)
        try:
            # The process started forks the export process and exits (--detach): no child
            # of this process, which Ray kills with its worker, and in a session of its own,
            # out of reach of signals to this process's group (Ray stopping a worker,
            # Ctrl-C). It ends when its stdin does, or this process, within its own deadline.
            launcher = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=fds, close_fds=True,
                                        start_new_session=True)
        except BaseException:
            os.close(reply_read)
            raise
        finally:
            os.close(reply_write)
        process = DetachedProcess(launcher)
        child = ExportProcess(process, os.fdopen(reply_read, "rb"))
        threading.Thread(target=self._read_replies, args=(child,), name="otel-verl-offload-replies",
                         daemon=True).start()
        try:
            wire.write_frame(process.stdin, wire.Hello(wire.VERSION))
            wire.write_frame(process.stdin, wire.Config(self.config))
        except (OSError, ValueError):
            pass  # it died at once: its replies end, which says so
        except BaseException:
            child.kill()
            raise
        return child

    def _forget_shared(self) -> None:
        """A new export process knows no shared object yet."""
        self._shared: "OrderedDict[Any, int]" = OrderedDict()  # object -> id, most recent last
        self._next_shared_id = 0
        self._new_shared: List[wire.Shared] = []  # to send before the batch that names them
        self._forgotten_shared: List[wire.ForgetShared] = []  # to send after it

    # ------------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        if not self._answered_hello(self._child) and not self._replace_dead_child():
            return
        while True:
            self._wake.wait(self.batch_interval_s)
            self._wake.clear()
            closing = self._closing
            if self._child.gone() and not self._replace_dead_child():
                return
            self._send_pending()
            if closing:
                self._send_pending()  # what came meanwhile
                self._send_close()
                return
            self._checkpoint_if_due()

    def _send_pending(self) -> None:
        """What is queued now, as frames (spans queued meanwhile wait for the next wake-up:
        taking them too, the sender would write a frame every few spans)."""
        pending = self._pending
        left = len(pending)
        while left > 0 and not self._child.write_failed:
            batch: List[tuple] = []  # packed spans
            flush = None
            taken = 0
            while left > 0 and len(batch) < self.max_batch:
                try:
                    kind, span, payload, start_attributes, size = pending.popleft()
                except IndexError:  # emptied by a shutdown that stopped waiting for this thread
                    break
                left -= 1
                taken += size
                if kind is FLUSH:
                    flush = (span, payload)  # its seq and timeout
                    break  # what was queued after it goes after the Flush
                try:
                    batch.append(wire.pack(span, payload, self._shared_id, start_attributes))
                except Exception as exc:
                    health.record_failure("offload.pack", exc)
                    self._lost(kind is ENDED, "a span could not be read")
            with self._queue_lock:
                self._pending_bytes -= taken
                queued = self._queued_ends
            self._send_batch(batch, flush, queued)

    def _send_batch(self, batch: List[tuple], flush: Optional[Tuple[int, Optional[int]]],
                    queued: int) -> None:
        """Sends ``batch`` and then, given ``(seq, timeout_ms)``, a Flush."""
        child = self._child
        frames = [wire.frame(shared) for shared in self._new_shared]
        self._new_shared = []
        ends = 0
        if batch:
            spans, ends = self._spans_frame(batch, queued)
            frames.append(spans)
        frames += [wire.frame(forget) for forget in self._forgotten_shared]
        self._forgotten_shared = []
        if flush is not None:
            seq, timeout_ms = flush
            frames.append(wire.frame(wire.Flush(seq, self._own_counts(), timeout_ms)))
        with self._replies:  # counted before the answer that acknowledges them can come
            child.ends_sent += ends
            if flush is not None:
                child.checkpoints.append((seq, child.ends_sent))
                child.last_checkpoint = (time.monotonic(), child.ends_sent)
        for data in frames:
            if not child.write(data):
                self._wake.set()  # its death counts what it was sent
                return

    def _spans_frame(self, batch: List[tuple], queued: int) -> Tuple[bytes, int]:
        """The frame of ``batch`` (packed spans) and how many span ends it carries."""
        try:
            return wire.frame(wire.Spans(batch, queued)), wire.ends(batch)
        except Exception as exc:  # a payload that does not pickle: the rest of the batch still goes
            health.record_failure("offload.send", exc)
            sent = [packed for packed in batch if _pickles(packed)]
            self._lost(wire.ends(batch) - wire.ends(sent), "a span could not be pickled")
            return wire.frame(wire.Spans(sent, queued)), wire.ends(sent)

    def _send_close(self) -> None:
        """Tells the export process this process sent all it will (with its final counts and
        the time left to finish its outputs: sending may have taken some of the deadline):
        an end of its input without it means this process died with spans still queued."""
        with self._queue_lock:
            queued = self._queued_ends
        counts = self._own_counts()
        timeout_ms = int(max(0.0, _left(self._deadline) - ANSWER_RESERVE_S) * 1000)
        self._child.write(wire.frame(wire.Close(queued, counts, timeout_ms)))

    def _checkpoint_if_due(self) -> None:
        """A Flush now and then: its answer acknowledges every span sent before it."""
        child = self._child
        when, ends = child.last_checkpoint
        if child.ends_sent > ends and time.monotonic() - when >= CHECKPOINT_INTERVAL_S:
            with self._replies:
                self._flush_seq += 1
                seq = self._flush_seq
            with self._queue_lock:
                queued = self._queued_ends
            self._send_batch([], (seq, None), queued)

    def _shared_id(self, shared: Any) -> int:
        """The id ``shared`` goes by, sent once (objects that compare equal share one: a
        tokenizer's bound methods do)."""
        known = self._shared
        shared_id = known.get(shared)
        if shared_id is not None:
            known.move_to_end(shared)
            return shared_id
        shared_id = self._next_shared_id
        self._next_shared_id += 1
        try:
            self._new_shared.append(wire.Shared(shared_id, wire.dumps_shared(shared)))
        except Exception as exc:
            # The data naming it goes without it (the trajectory JSONL: without texts).
            health.record_failure("offload.shared", exc)
            shared_id = wire.UNSENDABLE
        known[shared] = shared_id
        if len(known) > MAX_SHARED:
            _, old_id = known.popitem(last=False)
            if old_id != wire.UNSENDABLE:
                self._forgotten_shared.append(wire.ForgetShared(old_id))
        return shared_id

    # ------------------------------------------------------------------ supervision (sender thread)

    def _answered_hello(self, child: "ExportProcess") -> bool:
        child.hello.wait(self.start_timeout_s)
        return child.speaks_our_version

    def _replace_dead_child(self) -> bool:
        """The export process is gone: count what it had not acknowledged, start another
        for what is queued. False: none will run (stopped, or the outputs run here now)."""
        dead = self._child
        why = self._bury(dead)
        while True:
            if self._closing:
                self._stop(why)
                return False
            if dead.refusal:  # another otel_verl in place: a new export process would refuse too
                self._fall_back(why)
                return False
            if not self._may_restart():
                self._fall_back(f"the export process keeps dying ({why}; restarted {len(self._restarts)} "
                                f"time(s) within the last minute)")
                return False
            logger.warning("otel_verl: %s; starting another export process", why)
            try:
                child = self._spawn()
            except Exception as exc:
                health.record_failure("offload.start", exc)
                why = f"the export process could not start ({type(exc).__name__}: {exc})"
                continue
            with self._lifecycle:
                if not self._closing:
                    self._child = child
            if self._child is not child:  # shutdown began meanwhile
                child.kill()
                self._stop(why)
                return False
            self._forget_shared()
            if self._answered_hello(child):
                return True
            dead = child
            why = self._bury(dead)

    def _bury(self, child: "ExportProcess", why: str = "", grace_s: float = GRACE_S) -> str:
        """Counts once the spans ``child`` had not acknowledged; why it is gone."""
        exiting = child.replies_ended.is_set() or child.write_failed
        try:
            child.process.wait(grace_s if exiting else 0)
        except subprocess.TimeoutExpired:
            pass
        why = why or child.why_gone()
        child.kill()  # (it did not answer, or stopped reading: it may still run)
        try:
            child.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        child.replies_ended.wait(grace_s)  # its last answers acknowledge spans
        child.close_input()
        with self._replies:
            lost, child.ends_acknowledged = child.ends_sent - child.ends_acknowledged, child.ends_sent
        self._lost(lost, why)
        self._fail_waiting_flushes()
        return why

    def _may_restart(self) -> bool:
        now, recent = time.monotonic(), self._restarts
        while recent and now - recent[0] > 60.0:
            recent.popleft()
        if len(recent) >= self.max_restarts_per_minute:
            return False
        recent.append(now)
        return True

    def _fall_back(self, why: str) -> None:
        """No export process will run: this process writes its outputs itself from now on,
        or, without them, counts every later span lost."""
        outputs = None
        if self.in_process_outputs is not None:
            try:
                outputs = IsolatingSpanProcessor()  # as the export process runs them
                for processor in self.in_process_outputs():
                    outputs.add_span_processor(processor)
            except Exception as exc:
                health.record_failure("offload.in_process", exc)
                outputs = None
        if outputs is None:
            logger.warning("otel_verl: %s; this process's outputs are counted lost from now on", why)
            self._stop(why)
            return
        with self._replies:
            self._in_process = outputs
        logger.warning("otel_verl: %s; this process writes its outputs itself from now on", why)
        self._lost(self._drop_pending(), why)  # their starts went elsewhere, their payloads are unbound
        self._fail_waiting_flushes()

    def _write_loss_file(self) -> None:
        """The export process did not finish its outputs (killed, or dead): the loss file it
        kept for this process holds this process's counts as of its last message at best,
        none of the spans counted lost since. Written here, final, with every count this
        process knows (those the export process relayed included)."""
        trace_dir = getattr(self.config.settings, "trace_dir", None)
        if not trace_dir:
            return
        try:
            from otel_verl.exporters.loss_file import LossFileProcessor

            LossFileProcessor(trace_dir, self.config.resource_attributes).shutdown()
        except Exception as exc:
            health.record_failure("offload.loss_file", exc)

    # ------------------------------------------------------------------ reply threads

    def _read_replies(self, child: "ExportProcess") -> None:
        hello = child.read()
        if isinstance(hello, wire.Detached):
            child.process.attach(hello.pid)
            hello = child.read()
        if isinstance(hello, wire.Hello) and hello.version == wire.VERSION:
            child.speaks_our_version = True
        elif hello is not None:
            child.refusal = f"the export process speaks wire version {hello.version}, this process " \
                f"{wire.VERSION}" if isinstance(hello, wire.Hello) else f"the export process answered {hello!r}"
            health.record_failure("offload.version", WireVersionError(child.refusal))
        child.hello.set()
        while child.speaks_our_version:
            reply = child.read()
            if reply is None:  # the export process has exited
                break
            self._merge_counts(child, reply.counts)
            with self._replies:
                child.acknowledge(reply.seq, reply.written)
                if self._flush_results.get(reply.seq, False) is None:
                    self._flush_results[reply.seq] = reply.flushed
                self._replies.notify_all()
        child.replies.close()
        child.replies_ended.set()
        self._wake.set()  # the sender notices a death now, not at its next wake-up

    def _merge_counts(self, child: "ExportProcess", counts: Dict[str, Dict[str, int]]) -> None:
        """The export process's own losses and failures, counted here too (once)."""
        seen = child.counts_seen
        merges = (("dropped", health.record_dropped, "counted in the export process"),
                  ("failures", health.record_failures, "in the export process"))
        with self._replies:  # with the relayed counts at once: a Flush's own counts never go down
            for kind, record, context in merges:
                for name, count in counts.get(kind, {}).items():
                    added = count - seen[kind].get(name, 0)
                    if added > 0:
                        record(name, added, context)
        child.counts_seen = counts

    def _own_counts(self) -> Dict[str, Dict[str, int]]:
        """This process's health counters less those its export process relayed to it: the
        ones it reports for this process (those of export processes gone before it included)."""
        with self._replies:
            counts = health.snapshot()
            seen = self._child.counts_seen if self._child is not None else {}
            return {kind: {name: n - seen.get(kind, {}).get(name, 0) for name, n in counts[kind].items()
                           if n > seen.get(kind, {}).get(name, 0)} for kind in counts}

    # ------------------------------------------------------------------ losses

    def _stop(self, why: str) -> None:
        """Nothing more goes to an export process: what is queued and every later span is counted."""
        if self._accepting:
            self._accepting = False
            self._why_stopped = why
        self._lost(self._drop_pending(), why)
        self._fail_waiting_flushes()

    def _fail_waiting_flushes(self) -> None:
        """A flush whose spans may have been lost answers False."""
        with self._replies:
            for seq, answer in self._flush_results.items():
                if answer is None:
                    self._flush_results[seq] = False
            self._replies.notify_all()

    def _drop_pending(self) -> int:
        """Empties the queue; how many spans (ends) were in it."""
        with self._queue_lock:
            spans = sum(entry[0] is ENDED for entry in self._pending)
            self._pending.clear()
            self._pending_bytes = 0
        return spans

    def _lost(self, count: int, why: str) -> None:
        health.record_dropped(OUTPUT, count, why)

    def _after_fork_in_child(self) -> None:
        # The parent's export process and threads are the parent's. A forked child that
        # traces gets its own when its first span comes (most forked children never do).
        self._pending = deque()
        self._queue_lock = threading.Lock()
        self._pending_bytes = self._queued_ends = 0
        self._wake, self._replies, self._lifecycle = threading.Event(), threading.Condition(), threading.Lock()
        self._flush_results = {}
        self._child = None
        self._accepting, self._forked, self._why_stopped = False, True, "forked child"
        self.config = dataclasses.replace(self.config, pid=os.getpid())  # its export process writes this child's files


class ExportProcess:
    """One export process: its pipes, and the span ends it was sent and acknowledged."""

    def __init__(self, process: "DetachedProcess", replies: Any) -> None:
        self.process = process
        self.replies = replies
        self.hello = threading.Event()  # its Hello came, or its replies ended without one
        self.speaks_our_version = False
        self.refusal = ""  # why its Hello was refused
        self.replies_ended = threading.Event()
        self.write_failed = False
        self.finished = False  # its final answer came: its outputs, loss file included, were shut down
        # guarded by the processor's reply lock:
        self.ends_sent = 0  # span ends written (or being written) to it
        self.ends_acknowledged = 0  # of those, the ones before its last answered Flush
        self.checkpoints: deque = deque()  # (Flush seq, ends_sent then), not answered yet
        self.last_checkpoint = (time.monotonic(), 0)  # (when, ends_sent then)
        self.counts_seen: Dict[str, Dict[str, int]] = {"failures": {}, "dropped": {}}

    def gone(self) -> bool:
        return self.write_failed or self.replies_ended.is_set() or self.process.poll() is not None

    def write(self, data: bytes) -> bool:
        try:
            self.process.stdin.write(data)  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError):  # a dead export process (EPIPE)
            self.write_failed = True
            return False
        return True

    def read(self) -> Any:
        try:
            return wire.read_frame(self.replies)
        except Exception as exc:
            health.record_failure("offload.replies", exc)
            return None

    def acknowledge(self, seq: int, ok: bool) -> None:
        """The answer to Flush ``seq``: with ``ok``, every span sent before it is written
        (or counted there; ``FINAL``: every span it was sent)."""
        if seq == wire.FINAL:
            self.ends_acknowledged = self.ends_sent
            self.finished = True
            return
        while self.checkpoints and self.checkpoints[0][0] <= seq:
            checkpoint, ends = self.checkpoints.popleft()
            if ok and checkpoint == seq:
                self.ends_acknowledged = max(self.ends_acknowledged, ends)

    def close_input(self) -> None:
        try:
            self.process.stdin.close()  # type: ignore[union-attr]
        except (OSError, ValueError):
            pass

    def kill(self) -> None:
        try:
            self.process.kill()
        except OSError:
            pass

    def why_gone(self) -> str:
        if self.refusal:
            return self.refusal
        status = self.process.poll()
        if status is None:
            return "the export process stopped answering"
        if self.process.pid is None:
            return f"the export process could not start (exit status {status})"
        return "the export process exited" if self.finished else "the export process died"


class DetachedProcess:
    """An export process as :class:`subprocess.Popen` would show it (``pid``, ``stdin``,
    ``poll``, ``wait``, ``kill``), though it is no child of this process: ``launcher``, the
    process started, forks it and exits, and its pid comes on the reply pipe
    (:meth:`attach`). Watched by a pidfd where Linux has them (no pid reuse to fear), else
    by its pid. Its exit status is not this process's to know: :meth:`poll` says
    :data:`EXITED` once it is gone."""

    EXITED = 0

    def __init__(self, launcher: subprocess.Popen) -> None:
        self.launcher = launcher
        self.stdin = launcher.stdin
        self.pid: Optional[int] = None
        self._pidfd: Optional[int] = None
        self._gone = False
        self._kill_when_known = False
        self._lock = threading.Lock()

    def attach(self, pid: int) -> None:
        """The export process's pid, as its launcher said."""
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone = True
            except OSError:
                pass
        with self._lock:
            self.pid, self._pidfd, kill = pid, pidfd, self._kill_when_known
        try:
            self.launcher.wait(GRACE_S)  # it exits as it sent the pid; reaped
        except subprocess.TimeoutExpired:
            pass
        if kill:
            self.kill()

    def poll(self) -> Optional[int]:
        if self.pid is None:
            status = self.launcher.poll()
            return status or None  # 0: it started the export process, whose pid is on its way
        if not self._gone:
            if self._pidfd is not None:
                self._gone = readable(self._pidfd, 0)
            else:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self._gone = True
                except OSError:
                    pass
        return self.EXITED if self._gone else None

    def __del__(self) -> None:
        if self._pidfd is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.poll()
            if status is not None:
                return status
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.launcher.args, timeout)
            if self._pidfd is not None:
                readable(self._pidfd, left)
            else:
                time.sleep(0.01 if left is None else min(0.01, left))

    def kill(self) -> None:
        with self._lock:
            pid, pidfd = self.pid, self._pidfd
            if pid is None:  # killed once its launcher says who it is
                self._kill_when_known = True
        if pid is None:
            try:
                self.launcher.kill()
            except OSError:
                pass
            return
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            elif not self._gone:
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass


class WireVersionError(Exception):
    """The export process speaks another wire version (otel_verl changed in place?)."""


def _pickles(packed: tuple) -> bool:
    try:
        wire.frame(packed)
    except Exception:
        return False
    return True


def entry_bytes(span: Any, payload: Any) -> int:
    """The memory a queued span holds: its own (:func:`span_bytes`) and its payload's data,
    which may say (``approx_bytes()``: a trajectory's token ids and texts)."""
    size = span_bytes(span)
    if payload is not None:
        approx = getattr(payload.data, "approx_bytes", None)
        if approx is not None:
            size += approx()
    return size


def readable(fd: int, timeout_s: Optional[float]) -> bool:
    """Whether ``fd`` is readable within ``timeout_s`` (``None``: waits). poll(), not
    select(): select() refuses a descriptor from 1024 on, as a process with many sockets
    (a Ray worker) gets."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))))


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())

