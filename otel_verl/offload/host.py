"""The export process: ``python -m otel_verl.offload.host REPLY_FD``.

Started by :class:`~otel_verl.offload.forwarder.OffloadSpanProcessor`. Reads messages
from stdin (:mod:`otel_verl.offload.wire`), rebuilds each span as a
:class:`~otel_verl.record.SpanRecord` carrying its payload and hands it to the span
processors the served process would have run itself (``bootstrap.output_processors``:
the legacy files, OTLP, the embedded OTLP-JSON files, metrics, the loss file), with the
served process's resource and its pid in the file names. Its stdout and stderr are the
served process's (progress lines and warnings land where they would have).

Every output queues what it gets and writes or sends it from a thread of its own, so
this process never stops reading: a collector that is slow, refusing or down delays no
file. A Flush is answered from another thread once the file outputs have written (or
counted) everything before it, which tells the served process what it may count as
written should this process die; OTLP is not waited for, its losses are its own,
counted here.

At the end of stdin it shuts every output down within its deadline, answers with its
final counters and exits. An end of stdin without the served process's Close means that
process died: the span ends it had queued and never sent are counted lost here, and the
outputs are finished all the same. Signals to the served process's group do not reach
this process (its own session), and it ignores SIGTERM and SIGINT: it ends when its
input does.
"""

from __future__ import annotations

import functools
import gc
import io
import logging
import os
import pickle
import queue
import signal
import sys
import threading
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional

from otel_verl import health
from otel_verl.offload import wire

logger = logging.getLogger("otel_verl")

REFUSED = 2  # the exit status when the first messages are not this wire version's


class Host:
    """Runs ``processors`` (by default the outputs of ``config.settings``) on the spans
    of the served process, answering its flushes on ``reply`` (none: the answers go nowhere)."""

    def __init__(self, config: wire.HostConfig, processors: Optional[Iterable[Any]] = None,
                 reply: Optional[BinaryIO] = None) -> None:
        from otel_verl.sampling import IsolatingSpanProcessor, finish_order

        if processors is None:
            from otel_verl import bootstrap

            processors = bootstrap.output_processors(config.settings, config.resource_attributes)
        processors = list(processors)
        self.rebuilder = wire.Rebuilder(config)
        # as the served process's provider calls them, within the share of the end's deadline
        # the served process gave this process (its settings' shutdown_timeout_s)
        self.processor = IsolatingSpanProcessor(config.settings.shutdown_timeout_s)
        for processor in processors:
            self.processor.add_span_processor(processor)
        # what a Flush waits for, in turn: the outputs that write files here (not OTLP, not
        # metrics), the loss file last
        self.file_outputs = sorted((p for p in processors if getattr(p, "writes_files", False)), key=finish_order)
        self.replies = Replies(reply if reply is not None else io.BytesIO())
        self.shared: Dict[int, Any] = {}  # what payloads name, by id (see wire.Shared)
        self.received_ends = 0
        self.queued_ends = 0  # as the served process last said
        self.closed = False  # the served process sent its Close
        self.close_timeout_ms: Optional[int] = None  # what its Close left for the outputs to finish

    def handle(self, message: Any) -> None:
        if isinstance(message, wire.Spans):
            for snapshot in message.spans:
                self.export(snapshot)
                self.received_ends += snapshot.end_time is not None
            self.queued_ends = message.queued
        elif isinstance(message, wire.Shared):
            try:
                self.shared[message.shared_id] = pickle.loads(message.pickled)
            except Exception as exc:  # the data naming it goes without it
                health.record_failure("offload.shared", exc)
        elif isinstance(message, wire.ForgetShared):
            self.shared.pop(message.shared_id, None)
        elif isinstance(message, wire.Flush):
            health.record_served(message.counts)
            flush = None
            if message.timeout_ms is not None:  # the served process's force_flush: every output
                flush = functools.partial(self.processor.force_flush, message.timeout_ms)
            self.replies.answer_when(message.seq, [output.checkpoint() for output in self.file_outputs], flush)
        elif isinstance(message, wire.Close):
            health.record_served(message.counts)
            self.queued_ends = message.queued
            self.closed = True
            self.close_timeout_ms = message.timeout_ms
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")

    def export(self, snapshot: wire.SpanSnapshot) -> None:
        """One span's start or end to the processors, as a record carrying its payload
        (as the served process's spans carry theirs)."""
        try:
            span = self.rebuilder.span(snapshot)  # carrying its payload
            if snapshot.shared is not None:  # e.g. a trajectory's tokenizer
                span.payload.data.received(self.shared.get(snapshot.shared))
        except Exception as exc:
            health.record_failure("offload.rebuild", exc)
            return
        if snapshot.end_time is None:
            self.processor.on_start(span, None)
        else:
            self.processor.on_end(span)

    def close(self) -> None:
        """The end of the input: what the served process queued and never sent is counted
        (it died), every output shut down, the final counters answered."""
        if not self.closed:
            health.record_dropped(wire.OFFLOAD_OUTPUT, self.queued_ends - self.received_ends,
                                  "queued in the traced process when it ended without closing its export process")
        timeout_s = self.processor.timeout_s
        if self.close_timeout_ms is not None:
            timeout_s = min(timeout_s, self.close_timeout_ms / 1000.0)
        self.processor.shutdown(timeout_millis=int(timeout_s * 1000))
        self.replies.close()


class Replies:
    """The reply pipe: a Flush's answer is written from a thread of its own once the outputs
    it waits for have written everything before it, in the order the Flushes came."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self._lock = threading.Lock()
        self._waiting: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._answer, name="otel-verl-offload-answers", daemon=True)
        self._thread.start()

    def answer_when(self, seq: int, waits: List[Callable[[Optional[float]], bool]],
                    flush: Optional[Callable[[], bool]] = None) -> None:
        """Answers Flush ``seq`` once every wait returned, and ``flush()`` too if given."""
        self._waiting.put((seq, waits, flush))

    def write(self, message: Any) -> bool:
        try:
            with self._lock:
                wire.write_frame(self.out, message)
        except (OSError, ValueError):  # the served process is gone: its counters are in our log
            return False
        return True

    def close(self) -> None:
        """Answers the last Flush with the final counters (``FINAL`` acknowledges all)."""
        self._waiting.put(None)
        self.write(wire.Flushed(wire.FINAL, True, True, health.snapshot()))

    def _answer(self) -> None:
        while True:
            item = self._waiting.get()
            if item is None:
                return
            seq, waits, flush = item
            for wait in waits:
                try:
                    wait(None)
                except Exception as exc:
                    health.record_failure("offload.flush", exc)
            flushed = True
            if flush is not None:
                try:
                    flushed = bool(flush())
                except Exception as exc:
                    health.record_failure("offload.flush", exc)
                    flushed = False
            if not self.write(wire.Flushed(seq, True, flushed, health.snapshot())):
                return


def _keep_out_of_full_collections() -> None:
    """Most of this process's heap is what it imported (the SDK, its exporters, a
    tokenizer's library), kept until it exits: frozen, so that the cyclic GC's full
    collections walk only the spans and lines in flight."""
    gc.freeze()


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"otel_verl export process {os.getpid()} (for {os.getppid()}): %(message)s",
    )
    for signum in (signal.SIGTERM, signal.SIGINT):  # this process ends with its input
        signal.signal(signum, signal.SIG_IGN)
    reply = os.fdopen(int(argv[0]), "wb")
    source = sys.stdin.buffer
    try:
        hello = wire.read_frame(source)
    except Exception as exc:  # a frame of another wire version may not even unpickle
        hello = exc
    wire.write_frame(reply, wire.Hello(wire.VERSION))
    if not isinstance(hello, wire.Hello) or hello.version != wire.VERSION:
        said = f"wire version {hello.version}" if isinstance(hello, wire.Hello) else f"{hello!r}"
        logger.error("refused: the traced process speaks %s, this export process wire version %d "
                     "(both must run the same otel_verl); exiting", said, wire.VERSION)
        return REFUSED
    config = wire.read_frame(source)
    if not isinstance(config, wire.Config):
        logger.error("no configuration received (%r); exiting", config)
        return REFUSED
    from otel_verl.exporters import _writer

    _writer.name_outputs_after(config.config.pid)  # the served process's files
    host = Host(config.config, reply=reply)
    _keep_out_of_full_collections()
    while True:
        body = wire.read_body(source)
        if body is None:  # the end of stdin (or of a frame torn by the served process's death)
            break
        try:
            modules = len(sys.modules)
            host.handle(pickle.loads(body))
            # A library came with a shared object (a tokenizer's): frozen too. Only then,
            # as an agent loop may send one per trajectory, and frozen cycles are never collected.
            if len(sys.modules) > modules:
                _keep_out_of_full_collections()
        except Exception as exc:
            health.record_failure("offload.handle", exc)
    host.close()
    counts = health.totals()
    if counts["dropped"] or counts["failures"]:
        logger.warning("at exit: dropped=%s failures=%s", counts["dropped"], counts["failures"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
