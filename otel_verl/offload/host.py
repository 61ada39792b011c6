"""The export process: ``python -m otel_verl.offload.host REPLY_FD``.

Started by :class:`~otel_verl.offload.forwarder.OffloadSpanProcessor`. Reads messages
from stdin (:mod:`otel_verl.offload.wire`), rebuilds each span as a ``ReadableSpan``,
makes its payload readable (:func:`otel_verl.payload.bind`) and hands it to the span
processors the served process would have run itself (``bootstrap.output_processors``:
the legacy files, OTLP, the embedded OTLP-JSON files), with the served process's resource
and its pid in the file names. Its stdout and stderr are the served process's (progress
lines and warnings land where they would have). It answers a Flush once its outputs
have written everything before it, which tells the served process what it may count as
written should this process die. At the end of stdin (the served process shut its
outputs down, or died) it flushes and shuts every output down, answers with its final
counters and exits.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import sys
from typing import Any, BinaryIO, Dict, Iterable, Optional, Tuple

from otel_verl import health, payload
from otel_verl.offload import wire

logger = logging.getLogger("otel_verl")

REFUSED = 2  # the exit status when the first messages are not this wire version's


class Host:
    """Runs ``processors`` (by default the outputs of ``config.settings``) on the spans
    of the served process."""

    def __init__(self, config: wire.HostConfig, processors: Optional[Iterable[Any]] = None) -> None:
        from otel_verl.sampling import IsolatingSpanProcessor

        if processors is None:
            from otel_verl import bootstrap

            processors = bootstrap.output_processors(config.settings)
        self.rebuilder = wire.Rebuilder(config)
        # as the served process's provider calls them, within the share of the end's deadline
        # the served process gave this process (its settings' shutdown_timeout_s)
        self.processor = IsolatingSpanProcessor(config.settings.shutdown_timeout_s)
        for processor in processors:
            self.processor.add_span_processor(processor)
        self.codecs: Dict[int, Tuple[Any, Any]] = {}

    def handle(self, message: Any, reply: BinaryIO) -> None:
        if isinstance(message, wire.Spans):
            for snapshot in message.spans:
                self.export(snapshot)
        elif isinstance(message, wire.Codec):
            try:
                self.codecs[message.codec_id] = pickle.loads(message.functions)
            except Exception as exc:  # the JSONL has no texts for this tokenizer's trajectories
                health.record_failure("offload.tokenizer", exc)
        elif isinstance(message, wire.ForgetCodec):
            self.codecs.pop(message.codec_id, None)
        elif isinstance(message, wire.Flush):
            health.record_served(message.counts)
            ok = self.processor.force_flush()
            wire.write_frame(reply, wire.Flushed(message.seq, bool(ok), health.snapshot()))
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")

    def export(self, snapshot: wire.SpanSnapshot) -> None:
        """One span's start or end to the processors. Its payload is readable from its
        start to its end, as in the served process."""
        try:
            span = self.rebuilder.span(snapshot)
            data = snapshot.payload
            if snapshot.codec is not None:  # a trajectory's tokenizer
                data.data.decode, data.data.encode = self.codecs.get(snapshot.codec, (None, None))
        except Exception as exc:
            health.record_failure("offload.rebuild", exc)
            return
        if data is not None:
            payload.bind(span, data)
        if snapshot.end_time is None:
            self.processor.on_start(span, None)
        else:
            try:
                self.processor.on_end(span)
            finally:
                payload.unbind(span)

    def close(self, reply: BinaryIO) -> None:
        self.processor.shutdown()
        wire.write_frame(reply, wire.Flushed(wire.FINAL, True, health.snapshot()))


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
    host = Host(config.config)
    _keep_out_of_full_collections()
    while True:
        body = wire.read_body(source)
        if body is None:  # the end of stdin (or of a frame torn by the served process's death)
            break
        try:
            modules = len(sys.modules)
            host.handle(pickle.loads(body), reply)
            # A tokenizer's library came with it: frozen too. Only then, as an agent loop
            # may send a tokenizer per trajectory, and frozen cycles are never collected.
            if len(sys.modules) > modules:
                _keep_out_of_full_collections()
        except BrokenPipeError:
            break
        except Exception as exc:
            health.record_failure("offload.handle", exc)
    try:
        host.close(reply)
    except BrokenPipeError:  # the served process is gone: its counters are in our log
        pass
    counts = health.snapshot()
    if counts["dropped"] or counts["failures"]:
        logger.warning("at exit: dropped=%s failures=%s", counts["dropped"], counts["failures"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
