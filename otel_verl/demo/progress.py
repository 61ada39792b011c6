"""What the demo is doing, told as it happens: a line per phase and per training step, and a
heartbeat line whenever a phase has been silent for a while.

The harness runs its trainer in a Ray actor, so it tells its phases through a file
(:func:`note_phase`, one JSON line each, also from the driver); :class:`ProgressReporter`
runs in the driver, tails that file and the trainer's metrics file (verl's file logger
writes one line per finished step) and prints. No tracing, no verl.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO, Any, List, Optional

HEARTBEAT_S = 10.0  # the brief says at most ~15 s of silence; one poll's delay on top stays under it
POLL_S = 0.5
# file times come from the kernel's coarse clock (a few ms behind time.time()): a file
# written just after the reporter started can look older than its start
MTIME_SLACK_S = 1.0


def note_phase(path: Optional[str], text: str) -> None:
    """Append one phase line to ``path`` (no-op without a path). Never raises: a progress
    line is worth less than the run."""
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), "phase": text}) + "\n")
    except OSError:
        pass


def _read_lines(path: str, since: float) -> List[str]:
    """The lines of ``path`` when it was written after ``since`` (a file a previous run left
    is not this run's), else none."""
    try:
        if os.stat(path).st_mtime < since - MTIME_SLACK_S:
            return []
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line for line in f if line.endswith("\n")]  # a line still being written waits
    except OSError:
        return []


def _finished_steps(metric_lines: List[str]) -> int:
    """How many training steps verl's file logger logged (a step's line has
    ``training/global_step`` in its data)."""
    steps = 0
    for line in metric_lines:
        try:
            steps += "training/global_step" in json.loads(line).get("data", {})
        except (ValueError, AttributeError, TypeError):
            continue
    return steps


class ProgressReporter:
    """Prints ``[demo  12s] text`` lines to ``stream`` (stderr) from a daemon thread: the
    phases in ``phase_path``, ``step k of n done`` per line of ``metrics_path``, and
    ``... still <phase>`` after ``heartbeat_s`` of silence. Use as a context manager."""

    def __init__(self, phase_path: str, metrics_path: str, *, total_steps: int, stream: Optional[IO[str]] = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.phase_path = phase_path
        self.metrics_path = metrics_path
        self.total_steps = total_steps
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self._start = time.time()
        self._last_print = self._start
        self._phase = "starting"
        self._phase_since = self._start
        self._phases_seen = 0
        self._steps_seen = 0
        self._training = False  # steps are told once training began, in order with the phases
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "ProgressReporter":
        self._thread = threading.Thread(target=self._run, name="otel-verl-demo-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Print what is left to print, then end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._poll()

    def phase(self, text: str) -> None:
        """A phase of the driver's own (the harness's phases come through the file)."""
        with self._lock:
            self._phase, self._phase_since = text, time.time()
            self._print(text)

    def _print(self, text: str) -> None:
        now = time.time()
        self._last_print = now
        stream = self.stream or sys.stderr
        try:
            stream.write(f"[demo {now - self._start:4.0f}s] {text}\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the run goes on
            pass

    def _poll(self) -> None:
        with self._lock:
            phases = _read_lines(self.phase_path, self._start)
            steps = _finished_steps(_read_lines(self.metrics_path, self._start))
            for line in phases[self._phases_seen:]:
                try:
                    text = str(json.loads(line)["phase"])
                except (ValueError, KeyError, TypeError):
                    continue
                if self._training:  # the steps that finished before this phase began
                    self._print_steps(steps)
                self._phase, self._phase_since = text, time.time()
                self._print(text)
                self._training = self._training or text.startswith("training")
            self._phases_seen = max(self._phases_seen, len(phases))
            self._print_steps(steps)
            now = time.time()
            if now - self._last_print >= self.heartbeat_s:
                self._print(f"... still {self._phase} ({now - self._phase_since:.0f}s)")

    def _print_steps(self, steps: int) -> None:
        for step in range(self._steps_seen + 1, steps + 1):
            done = f"step {step} of {self.total_steps} done"
            if step < self.total_steps:
                self._phase, self._phase_since = f"training: step {step + 1} of {self.total_steps}", time.time()
                done += f"; {self._phase}"
            self._print(done)
        self._steps_seen = max(self._steps_seen, steps)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._poll()
            except Exception:  # the reporter never takes the run down
                pass
