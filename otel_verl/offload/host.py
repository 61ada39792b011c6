"""The export process: ``python -m otel_verl.offload.host REPLY_FD``.

Started by :class:`~otel_verl.offload.forwarder.OffloadSpanProcessor`. Reads frames from
stdin (:mod:`otel_verl.offload.wire`), rebuilds each span and hands it to the same span
processors the served process would have run itself (``bootstrap.output_processors``:
the legacy files, OTLP, the embedded OTLP-JSON files), with the served process's
resource and its pid in the file names. Its stdout and stderr are the served process's
(progress lines and warnings land where they would have). At the end of stdin (the
served process shut its outputs down, or died) it flushes and shuts every output down,
answers with its final counters and exits.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, BinaryIO, Optional

from otel_verl import health
from otel_verl.offload import wire

logger = logging.getLogger("otel_verl")

FINAL = -1  # the reply sent at exit


class Host:
    def __init__(self, config: wire.HostConfig) -> None:
        from otel_verl import bootstrap
        from otel_verl.exporters import _writer
        from otel_verl.sampling import IsolatingSpanProcessor

        _writer.name_outputs_after(config.pid)
        self.rebuild = wire.Rebuilder(config)
        self.processor = IsolatingSpanProcessor()
        for processor in bootstrap.output_processors(config.settings):
            self.processor.add_span_processor(processor)

    def handle(self, message: Any, reply: BinaryIO) -> None:
        what = message[0]
        if what == "spans":
            on_start, on_end, rebuild = self.processor.on_start, self.processor.on_end, self.rebuild.span
            for snapshot in message[1]:
                try:
                    when, span = rebuild(snapshot)
                except Exception as exc:
                    health.record_failure("offload.rebuild", exc)
                    continue
                if when == wire.END:
                    on_end(span)
                else:
                    on_start(span, None)
        elif what == "codec":
            _, codec_id, pickled = message
            try:
                self.rebuild.codecs[codec_id] = wire.pickle.loads(pickled)
            except Exception as exc:  # the JSONL has no texts for this tokenizer's trajectories
                health.record_failure("offload.tokenizer", exc)
        elif what == "forget_codec":
            self.rebuild.codecs.pop(message[1], None)
        elif what == "flush":
            ok = self.processor.force_flush()
            wire.write_frame(reply, (message[1], bool(ok), health.snapshot()))

    def close(self, reply: BinaryIO) -> None:
        self.processor.shutdown()
        wire.write_frame(reply, (FINAL, True, health.snapshot()))


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"otel_verl export process {os.getpid()} (for {os.getppid()}): %(message)s",
    )
    reply = os.fdopen(int(argv[0]), "wb")
    source = sys.stdin.buffer
    first = wire.read_frame(source)
    if first is None or first[0] != "config":
        logger.error("no configuration received; exiting")
        return 2
    host = Host(first[1])
    while True:
        try:
            message = wire.read_frame(source)
        except Exception as exc:  # a torn frame: the served process died mid-write
            health.record_failure("offload.read", exc)
            message = None
        if message is None:
            break
        try:
            host.handle(message, reply)
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
