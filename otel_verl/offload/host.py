"""The export process: ``python -m otel_verl.offload.host REPLY_FD``.

Started by :class:`~otel_verl.offload.forwarder.OffloadSpanProcessor`. Reads messages
from stdin (:mod:`otel_verl.offload.wire`), rebuilds each span as a
:class:`~otel_verl.record.SpanRecord` carrying its payload and hands it to the span
processors the served process would have run itself (``outputs.build``:
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
process died: the span ends it had queued and never sent are counted lost here (the
:class:`~otel_verl.offload.wire.SharedCount` says how many it had queued, up to its last
span), and the outputs are finished all the same. When the served process is gone, its
input ends once it holds nothing more (a child that process forked may keep the pipe open).

Started with ``--detach`` (as the served process starts it), it outlives the served
process: the process started forks it and exits, so that it is no child of the served
process (Ray's workers SIGKILL their children as they exit, ``ray.kill`` and a job's end
included), in a session of its own (Ray's per-worker process-group cleanup and signals to
the served process's group do not reach it). Only where the served process is a child
subreaper (Ray's ``RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper``) does
it become that process's child again, and die with it, which it logs. It ignores SIGTERM,
SIGINT, SIGHUP and SIGPIPE (a reader gone is an ``OSError`` it survives): it ends when
its input does, and then exits at most ``EXIT_GRACE_S`` after its outputs' deadline,
whatever their threads do.
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import logging
import os
import pickle
import queue
import select
import signal
import sys
import threading
import time
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional

from otel_verl import health
from otel_verl.offload import wire

logger = logging.getLogger("otel_verl")

REFUSED = 2  # the exit status when the first messages are not this wire version's
WATCH_S = 0.5  # how often the served process is looked for where no pidfd says it ended
READ_BYTES = 1 << 18  # what one read of the input takes at most
EXIT_GRACE_S = 2.0  # for the interpreter's own exit, once the outputs are shut down


class Host:
    """Runs ``processors`` (by default the outputs of ``config.settings``) on the spans
    of the served process, answering its flushes on ``reply`` (none: the answers go nowhere)."""

    def __init__(self, config: wire.HostConfig, processors: Optional[Iterable[Any]] = None,
                 reply: Optional[BinaryIO] = None, *, queued_base: int = 0,
                 queued_count: Optional[wire.SharedCount] = None) -> None:
        from otel_verl.sampling import IsolatingSpanProcessor, finish_order

        if processors is None:
            from otel_verl import outputs

            processors = outputs.build(config.settings, config.resource_attributes)
        processors = list(processors)
        self.shared: Dict[int, Any] = {}  # what payloads name, by id (see wire.Shared)
        self.rebuilder = wire.Rebuilder(config, self.shared)
        # as the served process's provider calls them, within the share of the end's deadline
        # the served process gave this process (its settings' shutdown_timeout_s)
        self.processor = IsolatingSpanProcessor(config.settings.shutdown_timeout_s)
        for processor in processors:
            self.processor.add_span_processor(processor)
        # what a Flush waits for, in turn: the outputs that write files here (not OTLP, not
        # metrics), the loss file last
        self.file_outputs = sorted((p for p in processors if getattr(p, "writes_files", False)), key=finish_order)
        self.replies = Replies(reply if reply is not None else io.BytesIO())
        self.received_ends = 0
        self.queued_ends = 0  # as the served process last said
        # span ends it had queued before this process started (sent to one before it) and,
        # current to its last span, how many it queued in all
        self.queued_base, self.queued_count = queued_base, queued_count
        self.closed = False  # the served process sent its Close
        self.close_timeout_ms: Optional[int] = None  # what its Close left for the outputs to finish

    def handle(self, message: Any) -> None:
        if isinstance(message, wire.Spans):
            for packed in message.spans:
                self.export(packed)
            self.received_ends += wire.ends(message.spans)
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

    def export(self, packed: tuple) -> None:
        """One span's start or end (packed, see wire.pack) to the processors, as its record
        carrying its payload (as the served process's records carry theirs)."""
        try:
            record = self.rebuilder.record(packed)
        except Exception as exc:
            health.record_failure("offload.rebuild", exc)
            return
        if record.end_time is None:
            self.processor.on_start(record, None)
        else:
            self.processor.on_end(record)

    def close(self) -> None:
        """The end of the input: what the served process queued and never sent is counted
        (it died), every output shut down, the final counters answered."""
        if not self.closed:
            queued = self.queued_ends
            if self.queued_count is not None:
                queued = max(queued, self.queued_count.value)
            health.record_dropped(wire.OFFLOAD_OUTPUT, queued - self.queued_base - self.received_ends,
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
        with self._lock:
            if self.out.closed:
                return False
            try:
                wire.write_frame(self.out, message)
            except (OSError, ValueError):  # the served process is gone: its counters are in our log
                _close_quietly(self.out)  # (what a torn write left buffered is never flushed)
                return False
        return True

    def close(self) -> None:
        """Answers the last Flush with the final counters (``FINAL`` acknowledges all)."""
        self._waiting.put(None)
        self.write(wire.Flushed(wire.FINAL, True, True, health.snapshot()))
        with self._lock:
            _close_quietly(self.out)

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


class Input:
    """The served process's messages (stdin), read as :func:`wire.read_body` reads a file.
    Given the served process's pid, it ends when that process is gone and the pipe holds
    nothing more, though a process that process forked may still hold the pipe open."""

    def __init__(self, fd: int, served_pid: Optional[int] = None) -> None:
        self.fd = fd
        self.served_pid = served_pid
        self._buffer = memoryview(b"")
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._pidfd: Optional[int] = None  # readable once the served process ended
        self._served_gone = False
        if served_pid is not None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(served_pid)
                self._poll.register(self._pidfd, select.POLLIN)
            except ProcessLookupError:
                self._served_gone = True
            except OSError:  # no pidfd here (Linux < 5.3): looked for every WATCH_S
                pass

    def read(self, size: int) -> bytes:
        """At most ``size`` bytes, at least one; none at the end."""
        if not self._buffer:
            self._buffer = memoryview(self._fill())
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return bytes(data)

    def _fill(self) -> bytes:
        while True:
            if self._served_gone:
                timeout_ms: Optional[int] = 0  # what it wrote before it went is in the pipe already
            elif self.served_pid is not None and self._pidfd is None:
                timeout_ms = int(WATCH_S * 1000)
            else:
                timeout_ms = None
            ready = {fd for fd, _ in self._poll.poll(timeout_ms)}
            if self.fd in ready:
                return os.read(self.fd, READ_BYTES)  # b"": the end of the pipe
            if self._served_gone:
                return b""
            if self._pidfd is not None:
                self._served_gone = self._pidfd in ready
            elif self.served_pid is not None:
                self._served_gone = not _alive(self.served_pid)


def _alive(pid: Optional[int]) -> bool:
    try:
        os.kill(pid, 0)  # type: ignore[arg-type]
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _detach(reply_fd: int) -> None:
    """Forks: the parent (the process the served process started) sends the child's pid on
    the reply pipe and exits; the child, the export process, goes on once it did, as the
    child of no process of Ray's (see the module docs)."""
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(started_read)
        try:
            os.write(reply_fd, wire.frame(wire.Detached(pid)))  # one write: under PIPE_BUF
        except OSError:
            pass  # the served process is gone: the export process still writes what it sent
        os._exit(0)
    os.close(started_write)
    launcher = os.getppid()
    os.read(started_read, 1)  # the end, once the parent exited: its Detached was first
    os.close(started_read)
    deadline = time.monotonic() + 1.0
    while os.getppid() == launcher and time.monotonic() < deadline:  # reparenting follows the exit
        time.sleep(0.001)


def _close_quietly(stream: Any) -> None:
    try:
        stream.close()
    except (OSError, ValueError):
        pass


def _arguments(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m otel_verl.offload.host")
    parser.add_argument("reply_fd", type=int)
    parser.add_argument("--detach", action="store_true", help="outlive the served process (see the module docs)")
    parser.add_argument("--served-pid", type=int, help="the input ends once this process is gone")
    parser.add_argument("--queued-fd", type=int, help="a SharedCount of the span ends the served process queued")
    parser.add_argument("--queued-base", type=int, default=0, help="of those, the ones sent to an export process before")
    return parser.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):  # it ends with its input
        signal.signal(signum, signal.SIG_IGN)
    args = _arguments(sys.argv[1:] if argv is None else argv)
    if args.detach:
        _detach(args.reply_fd)
    served = args.served_pid if args.served_pid is not None else os.getppid()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"otel_verl export process {os.getpid()} (for {served}): %(message)s",
    )
    if args.detach and os.getppid() == args.served_pid:
        logger.warning("the traced process reaps its orphans (a child subreaper, as Ray's "
                       "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper makes it): this export "
                       "process dies with it, and with it what it had not written yet")
    reply = os.fdopen(args.reply_fd, "wb")
    source = Input(sys.stdin.fileno(), args.served_pid)
    try:
        hello = wire.read_frame(source)
    except Exception as exc:  # a frame of another wire version may not even unpickle
        hello = exc
    try:
        wire.write_frame(reply, wire.Hello(wire.VERSION))
    except OSError:
        _close_quietly(reply)  # the served process is gone: what it sent is still written
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
    queued_count = None
    if args.queued_fd is not None:
        try:
            queued_count = wire.SharedCount(args.queued_fd)
        except (OSError, ValueError) as exc:
            health.record_failure("offload.queued_count", exc)
    host = Host(config.config, reply=reply, queued_base=args.queued_base, queued_count=queued_count)
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


def _exit(status: int) -> None:
    """Exits as a process does, but at most ``EXIT_GRACE_S`` later: every output was shut
    down within the deadline, and what still runs at exit (a thread or an at-exit
    shutdown waiting on a collector that does not answer) must not keep this process,
    which no one waits for, alive. A reader of stdout or stderr that is gone costs
    nothing (no exit status of its own)."""
    watchdog = threading.Timer(EXIT_GRACE_S, os._exit, (status,))
    watchdog.daemon = True  # (runs through the interpreter's exit, as a daemon thread does)
    watchdog.start()
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except (OSError, ValueError):
            setattr(sys, name, open(os.devnull, "w"))
    sys.exit(status)


if __name__ == "__main__":
    _exit(main())
