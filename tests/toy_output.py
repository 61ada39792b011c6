"""A toy output for tests: an :class:`otel_verl.outputs.Output` named by
``OTEL_VERL_OUTPUTS=toy_output:ToyOutput`` (``tests/`` on ``PYTHONPATH``). It reads the
starts and ends of tool spans, which no built-in output reads at their start, and writes
one line per call to ``{trace_dir}/toy-{pid}.jsonl``, the pid of the process that ran it."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, Optional

from otel_verl.payload import payload_of
from otel_verl.semconv import Subject


class ToyOutput:
    on_start_subjects = frozenset({Subject.TOOL})
    on_end_subjects = frozenset({Subject.TOOL})
    finish_order = 0
    writes_files = True

    def __init__(self, settings: Any) -> None:
        os.makedirs(settings.trace_dir, exist_ok=True)
        self.path = os.path.join(settings.trace_dir, f"toy-{os.getpid()}.jsonl")
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self._write("start", span)

    def on_end(self, span: Any) -> None:
        self._write("end", span)

    def _write(self, event: str, span: Any) -> None:
        payload = payload_of(span)
        line = {"event": event, "name": span.name, "subject": payload.subject.value if payload else None,
                "ended": span.end_time is not None}
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        pass

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        return lambda timeout_s=None: True  # written at once

    def pending(self) -> Dict[str, int]:
        return {}
