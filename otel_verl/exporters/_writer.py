"""Appending whole lines to files from a background thread, without blocking the caller.

Every legacy output shares this writer. The caller (a span processor running on the
training thread or the agent loop's event loop) hands over either a *render* callable
(formatting then happens on the writer thread: a batch stage's 16k rows) or ready text
(``submit_text``: a few lines), with the number of lines it stands for; file I/O always
happens on the writer thread.

Guarantees:
- ``submit`` / ``submit_text`` never block and never raise. When more than ``max_pending_lines`` are
  waiting, the new job is refused and its lines are counted as dropped.
- Files only ever hold whole lines: each file's text is written with ``O_APPEND`` in as
  few ``write`` calls as possible; a write that fails part-way (disk full, file-size
  limit) is cut back to the last whole line when no other process appended meanwhile,
  and the lines it carried are counted as dropped.
- Several processes may append to one file (O_APPEND: the kernel places each write at
  the current end); lines are never interleaved inside a ``write`` call.
- ``flush()`` waits until everything accepted so far is written or counted.

Cost: a writer thread woken for every line costs a thread switch (and a GIL hand-over)
per line, more than the line itself when events trickle in one by one, as in a rollout
worker awaiting its LLM calls. So, once woken, the thread lingers up to ``linger_s``
(default :data:`LINGER_S`) for more lines and writes them together; ``flush()``,
``close()`` and a queue past half its bound end the wait at once.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

from otel_verl import health

Render = Callable[[], Iterable[Tuple[str, str]]]  # -> (path, text made of whole lines)

LINGER_S = 0.05  # how long a woken writer thread waits for more lines (see the module docs)
_FILE_MODE = 0o644  # ordinary permissions: never world-writable
_DIR_MODE = 0o755

_live_writers: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()
_output_pid = 0  # see name_outputs_after


def name_outputs_after(pid: int) -> None:
    """Name this process's output files after ``pid``: the export process
    (:mod:`otel_verl.offload`) writes the files of the process whose spans it gets."""
    global _output_pid
    _output_pid = int(pid)


def output_pid() -> int:
    """The pid output file names carry (this process's, unless told otherwise)."""
    return _output_pid or os.getpid()


def _start_afresh_in_child() -> None:
    for writer in list(_live_writers):
        writer._after_fork_in_child()


class BackgroundWriter:
    def __init__(self, output: str, max_pending_lines: int = 1 << 20, linger_s: float = LINGER_S) -> None:
        self.output = output
        self.max_pending_lines = max_pending_lines
        self.linger_s = linger_s
        self._flushing = 0  # callers waiting in flush(): the writer must not linger
        self.written_lines = 0
        self.dropped_lines = 0
        self._jobs: Deque[Tuple[Any, int]] = deque()  # (render or (path, text), lines)
        self._pending_lines = 0
        # A plain lock under the condition: the callers' hot path takes it with C-level
        # enter/exit (a Condition's own are Python calls); nothing re-enters it.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._fds: Dict[str, int] = {}
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._dirs_made: set = set()
        _live_writers.add(self)

    # ------------------------------------------------------------------ caller side

    def submit(self, render: Render, n_lines: int) -> bool:
        """Queue ``render`` (run later on the writer thread). ``False`` when refused."""
        return self._queue(render, n_lines)

    def submit_text(self, path: str, text: str, n_lines: int) -> bool:
        """Queue ``text`` (whole lines) for ``path``. For a few lines formatted on the
        caller's thread: with the GIL, formatting them on the writer thread would save no
        CPU, and the objects they come from would outlive the young GC generations."""
        return self._queue((path, text), n_lines)

    def _queue(self, job: Any, n_lines: int) -> bool:
        with self._lock:
            if self._closed or self._pending_lines + n_lines > self.max_pending_lines:
                refused = True
            else:
                refused = False
                self._jobs.append((job, n_lines))
                self._pending_lines += n_lines
                # Wake the thread for the first line of a batch only (it lingers for the
                # rest), or when the queue fills up. Only the first line of a batch checks
                # that the thread runs (and clears idle): the thread only ever ends on
                # close(), and a forked child starts with no thread.
                if len(self._jobs) == 1:
                    self._idle.clear()
                    self._ensure_thread()
                    self._cond.notify()
                elif self._pending_lines * 2 > self.max_pending_lines:
                    self._cond.notify()
        if refused:
            self._count_dropped(n_lines, "writer closed" if self._closed else "writer queue full (disk too slow?)")
            return False
        return True

    def flush(self, timeout: Optional[float] = 30.0) -> bool:
        """Wait until every accepted job is written or counted."""
        if self._thread is None or not self._thread.is_alive():
            self._drain()  # no thread (fork, or never started): write inline
            return True
        with self._cond:
            self._flushing += 1
            self._cond.notify()
        try:
            return self._idle.wait(timeout)
        finally:
            with self._cond:
                self._flushing -= 1

    def close(self, timeout: Optional[float] = 30.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._close_fds()

    def _after_fork_in_child(self) -> None:
        """A forked child starts empty: the jobs queued before the fork are the parent's
        (its writer thread writes them; rendering them here would duplicate lines in the
        child's files), and the lock may have been held by that thread at fork time."""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._flushing = 0
        self._jobs = deque()
        self._pending_lines = 0
        self._idle = threading.Event()
        self._idle.set()
        self._thread = None
        self._pid = os.getpid()
        self._close_fds()

    # ------------------------------------------------------------------ writer thread

    def _ensure_thread(self) -> None:
        # called with self._cond held
        if os.getpid() != self._pid:  # forked child: the parent's thread and fds are not ours
            self._pid = os.getpid()
            self._fds = {}
            self._thread = None
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=f"otel-verl-{self.output}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._idle.set()
                    self._cond.wait()
                if self._closed and not self._jobs:
                    self._idle.set()
                    return
                self._linger()
            self._drain()

    def _linger(self) -> None:
        # called with self._cond held: wait for more lines unless someone needs them now
        deadline = time.monotonic() + self.linger_s
        while not (self._closed or self._flushing or self._pending_lines * 2 > self.max_pending_lines):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _drain(self) -> None:
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
        if not jobs:
            self._idle.set()
            return
        by_path: Dict[str, List[str]] = {}
        lines_by_path: Dict[str, int] = {}
        for render, n_lines in jobs:
            try:
                chunks = [render] if type(render) is tuple else list(render())
            except Exception as exc:
                health.record_failure(f"{self.output}.render", exc)
                self._count_dropped(n_lines, "could not format")
                continue
            share = n_lines // max(1, len(chunks)) if chunks else 0
            for i, (path, text) in enumerate(chunks):
                by_path.setdefault(path, []).append(text)
                count = share + (n_lines - share * len(chunks) if i == 0 else 0)
                lines_by_path[path] = lines_by_path.get(path, 0) + count
        for path, texts in by_path.items():
            self._append(path, "".join(texts), lines_by_path[path])
        with self._cond:
            self._pending_lines -= sum(n for _, n in jobs)
            if not self._jobs:
                self._idle.set()

    def _append(self, path: str, text: str, n_lines: int) -> None:
        data = text.encode("utf-8")
        fd = -1
        try:
            fd = self._fd(path)
            before = os.fstat(fd).st_size
            written = 0
            try:
                while written < len(data):
                    n = os.write(fd, data[written:])
                    if n <= 0:
                        raise OSError(errno.EIO, "short write")
                    written += n
            except OSError:
                if written:
                    self._cut_back(fd, before, written)
                raise
            self.written_lines += n_lines
        except OSError as exc:
            if fd >= 0:
                self._forget_fd(path)
            self._count_dropped(n_lines, f"{path}: {exc.strerror or exc}")

    @staticmethod
    def _cut_back(fd: int, before: int, written: int) -> None:
        """Remove a torn tail, unless another process appended after us meanwhile."""
        try:
            if os.fstat(fd).st_size == before + written:
                os.ftruncate(fd, before)
        except OSError:
            pass

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            directory = os.path.dirname(path)
            if directory and directory not in self._dirs_made:
                make_dirs(directory)
                self._dirs_made.add(directory)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
            self._fds[path] = fd
            if len(self._fds) > 16:  # hourly/rotated files: keep only recent ones open
                oldest = next(iter(self._fds))
                if oldest != path:
                    self._forget_fd(oldest)
        return fd

    def _forget_fd(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _close_fds(self) -> None:
        for path in list(self._fds):
            self._forget_fd(path)

    def count_unformatted(self, n_lines: int) -> None:
        """Lines the caller could not format for ``submit_text``: lost, so counted."""
        self._count_dropped(n_lines, "could not format")

    def _count_dropped(self, n_lines: int, reason: str) -> None:
        self.dropped_lines += n_lines
        health.record_dropped(self.output, n_lines, reason)


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` with ordinary permissions at every level it
    creates: makedirs gives intermediate levels mode 0o777, so under a umask of 0 they
    would be world-writable."""
    if not path or os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        make_dirs(parent)
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_afresh_in_child)
