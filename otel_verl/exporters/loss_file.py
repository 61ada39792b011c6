"""Each process's loss and failure counters, as a file beside its outputs.

Metrics carry the counters too, but only as often as they are collected and only where
metrics go; a process killed between collections takes its last counts with it, and a
rollout worker's counts of its last seconds reached only its log. :class:`LossFileProcessor`
keeps ``{trace_dir}/losses/losses-{host}-pid{pid}-start{ticks}.json`` current: rewritten (a
new file renamed over the old one, so a reader never sees half of it) at most every
``interval_s`` while the counters change, and final when the outputs shut down, after
every other output counted its losses (``finish_order``); a flush writes it after the
other outputs' flushes too, so that it says what they still hold after them. Written
final, it stays final, and a count that comes later (an export that returns after the
deadline) is written into it within ``interval_s``, for ``AFTER_FINAL_S``. In an export
process the file is the served process's (its pid), with that process's own counters as
of its last message and what the export process counted, so it survives the served
process.

``ticks`` is when the process started (``/proc/{pid}/stat``, clock ticks since boot), read
alike by the process and its export process: a later process given the same pid (a
restarted container) writes a file of its own. Where there is no ``/proc`` the name ends
at the pid.
``otel-verl report`` sums the files of a run.

A file holds ``{"pid", "host", "resource", "final", "time_unix_nano", "dropped",
"failures", "notes", "pending"}``; ``final`` says whether the process shut its outputs
down, ``pending`` what its outputs still held, neither written nor counted (spans an
endpoint that does not answer has not refused yet, lines on their way to the disk): a
process killed after its last write took at most those with it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

from opentelemetry.sdk.trace import SpanProcessor

from otel_verl import forks, health, semconv as sc
from otel_verl.exporters._writer import FILE_MODE, make_dirs, output_pid

DIRECTORY = "losses"
# After the final write the file is kept current this much longer: what returns after the
# shutdown's deadline (an export, a write) gives up within its own timeout, and may count.
AFTER_FINAL_S = 60.0
_RESOURCE_KEYS = (sc.RUN_ID, sc.ROLE, sc.SERVICE_NAME, sc.SERVICE_INSTANCE_ID)


class LossFileProcessor(SpanProcessor):
    """Writes this process's counters to its file in ``{trace_dir}/losses/``; reads no spans."""

    on_start_subjects: frozenset = frozenset()
    on_end_subjects: frozenset = frozenset()
    finish_order = 2  # last: after the outputs counted what they lost, and after the metrics
    writes_files = True  # a flush of the export process writes it (offload.host)

    def __init__(self, trace_dir: str, resource_attributes: Optional[Dict[str, Any]] = None, *,
                 outputs: Sequence[Any] = (), interval_s: float = 1.0) -> None:
        self.directory = os.path.join(trace_dir, DIRECTORY)
        # the outputs whose pending() (output name -> items held) the file says
        self.outputs = [output for output in outputs if callable(getattr(output, "pending", None))]
        self.resource = {key: resource_attributes[key] for key in _RESOURCE_KEYS
                         if resource_attributes and key in resource_attributes}
        self.interval_s = interval_s
        self._host = socket.gethostname()
        self._written: Any = None  # the counters last written
        self._final = False  # written final: later writes keep it so
        # pid -> file name, read while the process runs (an export process may outlive it)
        self._names: Dict[int, str] = {}
        self._lock = threading.Lock()
        _ = self.path
        self._start_thread()
        forks.in_child(self._after_fork_in_child)

    def _start_thread(self) -> None:
        threading.Thread(target=self._loop, name="otel-verl-loss-file", daemon=True).start()

    @property
    def path(self) -> str:
        pid = output_pid()
        name = self._names.get(pid)
        if name is None:
            name = self._names[pid] = file_name(self._host, pid)
        return os.path.join(self.directory, name)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.write(final=False)

    def pending(self) -> Dict[str, int]:
        return {}  # what it holds is rewritten each second

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        """Writes when waited for: after the outputs of lower ``finish_order``."""
        return lambda timeout_s=None: self.write(final=False)

    def shutdown(self) -> None:
        self.write(final=True)

    def write(self, final: bool) -> bool:
        """Writes the counters when they changed since the last write (or ``final``). After
        the final write every write is final (a flush's, the thread's): the outputs are
        shut down, and a count they make later belongs in the file as it is."""
        with self._lock:
            final = final or self._final
            # read under the lock: a write that read them earlier never lands after a later one
            counts = health.totals()
            notes = health.notes()
            pending = {} if final else self._pending()
            if (counts, notes, pending) == self._written and (self._final or not final):
                return True
            try:
                make_dirs(self.directory)
                path = self.path
                temporary = f"{path}.{os.getpid()}.tmp"
                text = json.dumps({"pid": output_pid(), "host": self._host, "resource": self.resource, "final": final,
                                   "time_unix_nano": time.time_ns(), **counts, "notes": notes,
                                   "pending": pending}, sort_keys=True)
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
                os.replace(temporary, path)
            except OSError:  # the files' own writers count what the disk refused
                return False
            self._written = (counts, notes, pending)
            self._final = final
        return True

    def _pending(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for output in self.outputs:
            try:
                for name, n in output.pending().items():
                    if n:
                        out[name] = out.get(name, 0) + n
            except Exception as exc:
                health.record_failure("loss_file.pending", exc)
        return out

    def _loop(self) -> None:
        final_at = None
        while final_at is None or time.monotonic() - final_at < AFTER_FINAL_S:
            time.sleep(self.interval_s)
            self.write(final=False)
            if final_at is None and self._final:
                final_at = time.monotonic()

    def _after_fork_in_child(self) -> None:
        self._written = None  # the child's counters start afresh, in a file of its own
        self._lock = threading.Lock()
        self._start_thread()


def file_name(host: str, pid: int) -> str:
    """The loss file's name for process ``pid`` on ``host``: its pid and start time."""
    start = process_start_ticks(pid)
    return f"losses-{host}-pid{pid}.json" if start is None else f"losses-{host}-pid{pid}-start{start}.json"


def process_start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started, in clock ticks since boot (``/proc/{pid}/stat``'s
    22nd field); ``None`` without ``/proc`` or without that process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the command name (field 2) may hold spaces and parentheses: fields after its last ")"
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None

