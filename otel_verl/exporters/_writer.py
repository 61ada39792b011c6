"""Appending whole lines to files from a background thread, without blocking the caller.

Every legacy output writes through a :class:`BackgroundWriter`. The caller (a span
processor on the training thread or the agent loop's event loop) queues a *job*, the
data of some lines, and the number of lines it stands for; the writer thread renders it
with the output's *render* function, which gives the file and the text, and appends the
text to the file. A job is data, not a callable: a closure or a partial per job is more
objects for the cyclic GC to visit while the job waits, and a backlog of them reaches
its oldest generation and brings on full collections of the traced process's heap.

Guarantees:
- ``submit`` never blocks and never raises. When the jobs waiting would hold more than
  ``max_pending_bytes`` (the caller's estimate of a job's text), a new job is refused and
  its lines are counted as dropped.
- Files only ever hold whole lines. A file's text is appended with ``O_APPEND`` (several
  processes may share a file: the kernel puts each write at the current end); a write
  that fails part-way (disk full, file-size limit) is cut back to the last whole line
  when no other process appended meanwhile, and its lines are counted as dropped.
- ``flush()`` waits until everything accepted so far is written or counted;
  ``checkpoint()`` gives that wait without starting it (the export process answers its
  traced process's flushes with it while it goes on reading spans).
- Files follow their paths, as ``logging.handlers.WatchedFileHandler`` does: a file that
  was deleted (a cleanup job) is created again, directory included, before the next
  write; one that was renamed or replaced (logrotate, a log shipper) within about
  ``reopen_check_s``, and the lines written meanwhile are in the renamed file.

When events trickle in one by one (a rollout worker awaiting its LLM calls), waking the
thread for each line costs a thread switch per line, more than the line itself. So a
woken thread lingers up to ``linger_s`` for more lines and writes them together;
``flush()``, ``checkpoint()``, ``close()`` and a queue past half its bound end the wait
at once.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from opentelemetry.sdk.trace import SpanProcessor

from otel_verl import forks, health, settings
from otel_verl.ids import repair_text

Render = Callable[[Any], Tuple[str, str]]  # job -> (path, text made of whole lines)

LINGER_S = 0.05
MAX_OPEN_FILES = 16  # hourly and rotated files: only recent ones stay open
REOPEN_CHECK_S = 1.0  # how often a path is looked up to see whether its file was moved
# What a queued job holds besides its text: its tuples, the text's object header (a progress
# line of 84 characters holds about 400 bytes)
JOB_BYTES = 320
FILE_MODE = 0o644  # ordinary permissions: never world-writable
DEFAULT_MAX_PENDING_BYTES = settings.DEFAULT_MAX_QUEUE_MB << 20
DIR_MODE = 0o755

_output_pid = 0  # see name_outputs_after


def name_outputs_after(pid: int) -> None:
    """Name this process's output files after ``pid``: the export process
    (:mod:`otel_verl.offload`) writes the files of the process whose spans it gets."""
    global _output_pid
    _output_pid = int(pid)


def output_pid() -> int:
    """The pid output file names carry (this process's, unless told otherwise)."""
    return _output_pid or os.getpid()


def written_at_once(timeout_s: Optional[float] = None) -> bool:
    """The checkpoint wait of an output that writes before it returns."""
    return True


def close_timeout_s(timeout_millis: Optional[int]) -> float:
    """A span processor's shutdown timeout as :meth:`BackgroundWriter.close` takes it."""
    return 30.0 if timeout_millis is None else max(0.0, timeout_millis / 1000.0)


class BackgroundWriter:
    """Appends the text of queued jobs to files, on a thread of its own."""

    def __init__(self, output: str, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, linger_s: float = LINGER_S,
                 reopen_check_s: float = REOPEN_CHECK_S, render: Optional[Render] = None) -> None:
        self.output = output  # the name drops and failures are counted under
        self.render: Render = render or _as_written  # called on the writer thread
        self.max_pending_bytes = max_pending_bytes
        self.linger_s = linger_s
        self.reopen_check_s = reopen_check_s
        self.written_lines = 0
        self.dropped_lines = 0
        self._closed = False
        self._files: Dict[str, OpenFile] = {}  # by path, oldest first
        self._start_empty()
        forks.in_child(self._after_fork_in_child)

    def _start_empty(self) -> None:
        self._cond = threading.Condition()
        self._jobs: Deque[Tuple[Any, int, int]] = deque()  # (job, lines, bytes)
        self._pending_bytes = 0
        self._accepted = 0  # jobs accepted so far
        self._finished = 0  # of them written or counted
        self._wanted = 0  # jobs a flush or checkpoint waits for: the thread must not linger
        self._writing = 0  # lines the thread is writing now
        self._queued_lines = 0  # lines of the jobs waiting (what the loss file reads each second)
        self._writing_counted = False  # close() counted them as lost: a late failure is not counted again
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ caller side

    def submit(self, job: Any, n_lines: int, n_bytes: int) -> bool:
        """Queue ``job`` (rendered on the writer thread), whose text is about ``n_bytes``.
        ``False`` when refused. A job larger than the whole bound is taken when nothing
        else waits or is being written: it could never be written otherwise."""
        n_bytes += JOB_BYTES
        with self._cond:
            refused = self._closed or (self._pending_bytes > 0 and self._pending_bytes + n_bytes > self.max_pending_bytes)
            if not refused:
                self._jobs.append((job, n_lines, n_bytes))
                self._pending_bytes += n_bytes
                self._queued_lines += n_lines
                self._accepted += 1
                if len(self._jobs) == 1:
                    # The thread is idle, or writing the jobs it took and will look again.
                    # Once woken it lingers for the jobs that follow: only the first wakes it.
                    self._start_thread()
                    self._cond.notify()
                elif self._pending_bytes * 2 > self.max_pending_bytes:
                    self._cond.notify()
        if refused:
            self._count_dropped(n_lines, "writer closed" if self._closed else "writer queue full (disk too slow?)")
        return not refused

    def pending_lines(self) -> int:
        with self._cond:
            return self._writing + self._queued_lines

    def write(self, path: str, text: str, n_lines: int) -> bool:
        """Queue ``text`` (whole lines) for ``path`` (a writer that renders jobs as given)."""
        return self.submit((path, text), n_lines, len(text))

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        """Every job accepted so far, written or counted: returns a wait for that
        (``wait(timeout_s)`` -> whether it happened in time), asking for it now."""
        with self._cond:
            mark = self._accepted
            if self._finished < mark:
                self._wanted = max(self._wanted, mark)
                if self._thread is None or not self._thread.is_alive():
                    self._start_thread()
                self._cond.notify_all()

        def wait(timeout_s: Optional[float] = None) -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: self._finished >= mark, timeout_s)

        return wait

    def flush(self, timeout: Optional[float] = 30.0) -> bool:
        """Wait until every accepted job is written or counted."""
        return self.checkpoint()(timeout)

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Write what is queued within ``timeout``; what is not written by then (queued,
        or in a write that does not return: a disk that does not drain) is counted, not
        left to die with the process."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            late = self._writing + sum(n_lines for _, n_lines, _ in self._jobs)
            self._writing_counted = self._writing > 0  # the write that hangs: counted here, not again
            self._finished += len(self._jobs)
            self._jobs.clear()
            self._queued_lines = 0
            self._pending_bytes = 0
            self._cond.notify_all()
        self._count_dropped(late, "not written by the shutdown deadline")
        self._close_fds()

    def _after_fork_in_child(self) -> None:
        """A forked child starts empty: the jobs queued before the fork are the parent's
        (its thread writes them; writing them here too would duplicate lines), and the
        lock may have been held by that thread at the fork."""
        self._start_empty()
        self._close_fds()

    # ------------------------------------------------------------------ writer thread

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=f"otel-verl-{self.output}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed and not self._jobs:
                    return
                self._linger()
            self._drain()

    def _linger(self) -> None:
        # with self._cond held: wait for more lines unless someone needs them now
        deadline = time.monotonic() + self.linger_s
        while not (self._closed or self._wanted > self._finished or self._pending_bytes * 2 > self.max_pending_bytes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _drain(self) -> None:
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
            self._writing, self._queued_lines = self._queued_lines, 0
        texts: Dict[str, List[str]] = {}
        lines: Dict[str, int] = {}
        render = self.render
        for job, n_lines, _ in jobs:
            try:
                path, text = render(job)
            except Exception as exc:
                health.record_failure(f"{self.output}.render", exc)
                self._count_dropped(n_lines, "could not format")
                continue
            texts.setdefault(path, []).append(text)
            lines[path] = lines.get(path, 0) + n_lines
        for path, parts in texts.items():
            self._append(path, "".join(parts), lines[path])
        with self._cond:
            self._writing = 0
            self._pending_bytes -= sum(n_bytes for _, _, n_bytes in jobs)
            self._finished += len(jobs)
            self._cond.notify_all()

    def _append(self, path: str, text: str, n_lines: int) -> None:
        # Whatever the lines hold, they are written or counted, and the thread goes on.
        try:
            append_whole(self._fd(path), self._utf8(text))
            self.written_lines += n_lines
        except OSError as exc:
            self._forget_fd(path)
            if not self._writing_counted:
                self._count_dropped(n_lines, f"{path}: {exc.strerror or exc}")
        except Exception as exc:
            health.record_failure(f"{self.output}.write", exc)
            if not self._writing_counted:
                self._count_dropped(n_lines, f"{path}: {type(exc).__name__}")

    def _utf8(self, text: str) -> bytes:
        return utf8(text, self.output)

    def _fd(self, path: str) -> int:
        file = self._files.get(path)
        if file is not None and not file.still_at(path, self.reopen_check_s):
            self._forget_fd(path)
            file = None
        if file is None:
            make_dirs(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            file = self._files[path] = OpenFile(fd)
            if len(self._files) > MAX_OPEN_FILES:
                self._forget_fd(next(iter(self._files)))
        return file.fd

    def _forget_fd(self, path: str) -> None:
        file = self._files.pop(path, None)
        if file is not None:
            try:
                os.close(file.fd)
            except OSError:
                pass

    def _close_fds(self) -> None:
        for path in list(self._files):
            self._forget_fd(path)

    def _count_dropped(self, n_lines: int, reason: str) -> None:
        self.dropped_lines += n_lines
        health.record_dropped(self.output, n_lines, reason)


class WriterProcessor(SpanProcessor):
    """A span processor whose lines a :class:`BackgroundWriter` (``self.writer``; ``None``:
    it writes no file) writes: its flush, checkpoint and shutdown are the writer's."""

    writes_files = True  # a flush of the export process waits for it (offload.host)
    finish_order = 0
    writer: Optional["BackgroundWriter"] = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.writer.flush(timeout_millis / 1000.0) if self.writer is not None else True

    def pending(self) -> Dict[str, int]:
        """Lines queued or being written, neither written nor counted yet."""
        return {self.writer.output: self.writer.pending_lines()} if self.writer is not None else {}

    def checkpoint(self) -> Callable[[Optional[float]], bool]:
        return self.writer.checkpoint() if self.writer is not None else written_at_once

    def shutdown(self, timeout_millis: Optional[int] = None) -> None:
        if self.writer is not None:
            self.writer.close(close_timeout_s(timeout_millis))


def _as_written(job: Tuple[str, str]) -> Tuple[str, str]:
    return job


def utf8(text: str, output: str) -> bytes:
    """``text`` as UTF-8. A lone surrogate (``json.loads`` makes one of ``"\\ud800"``, and
    a model picks tool names) is written as U+FFFD, as a decoder would show the bytes it
    cannot read, and counted as ``failures[{output}.lone_surrogate]``."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        health.record_failures(f"{output}.lone_surrogate", 1, "(written as U+FFFD)")
        return repair_text(text).encode("utf-8")


# Characters that end a line for some reader (log shippers read one record per line)
# or that a terminal acts on.
_CONTROL = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with its control characters and line separators written as Python
    escapes (``\\n``, ``\\x1b``, ``\\u2028``), so that a record is always one line
    whatever a uid or a model's tool name holds."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


class OpenFile:
    """A file held open for appending, and which file it is: a path that names another
    file (or none) was moved or deleted, and is opened again."""

    __slots__ = ("fd", "dev", "ino", "checked_at")

    def __init__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.fd = fd
        self.dev, self.ino = st.st_dev, st.st_ino
        self.checked_at = time.monotonic()  # of the last look at the path

    def still_at(self, path: str, reopen_check_s: float) -> bool:
        """Whether ``path`` still names this file. Called before every write: a deleted
        file (what is written to it is lost) is seen at once by its link count; the path
        itself is looked up only every ``reopen_check_s`` (a renamed or replaced file)."""
        if os.fstat(self.fd).st_nlink == 0:
            return False
        now = time.monotonic()
        if now - self.checked_at < reopen_check_s:
            return True
        self.checked_at = now
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # cannot tell (no permission to look): keep writing where we are
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` (whole lines) to ``fd`` (opened with O_APPEND), or raise OSError.
    A write that fails part-way (disk full, file-size limit) is cut back, so that the
    file ends with a whole line, unless another process appended after it meanwhile."""
    before = os.fstat(fd).st_size
    written = 0
    try:
        while written < len(data):
            n = os.write(fd, data[written:])
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            written += n
    except OSError:
        try:
            if written and os.fstat(fd).st_size == before + written:
                os.ftruncate(fd, before)
        except OSError:
            pass
        raise


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
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def write_discovery_file(path: Optional[str], directory: str) -> None:
    """Node-local pointer for tools looking for our files; best effort. Created 0o644
    whatever the umask (never world-writable), and never through a symlink planted in a
    shared /tmp."""
    if not path:
        return
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path, flags, FILE_MODE), "w", encoding="utf-8") as f:
            f.write(directory)
    except OSError:
        pass

