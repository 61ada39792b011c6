"""otel_verl's own failures and losses: counted, readable, reported as they go.

Tracing never raises into training. Whatever goes wrong inside otel_verl (a wrapper, a
processor, a writer that cannot keep up, a full disk) is counted here under a name and
logged the first time per name; while more is counted, the totals so far are logged again
at most every ``REPORT_INTERVAL_S``, so a loss shows in a long run's log before its end.
Nothing is dropped without a counter saying so. Notes count something that works but not
as configured for a full picture (a server that does not report its timing): logged once
per name, with the way to fix it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Dict, TypeVar

from otel_verl import forks

logger = logging.getLogger("otel_verl")

_lock = threading.Lock()
_failures: Counter = Counter()  # where -> how many exceptions otel_verl swallowed
_dropped: Counter = Counter()  # output -> how many rows/lines/spans were not written
_notes: Counter = Counter()  # what -> how many times a configuration note applied
_served: Dict[str, Dict[str, int]] = {}  # an export process: its traced process's own counters
_reported: set = set()
REPORT_INTERVAL_S = 300.0
_last_totals_at = time.monotonic()

F = TypeVar("F", bound=Callable[..., Any])


def _count(counter: Counter, name: str, count: int, report_key: str) -> bool:
    """Add ``count`` to ``counter[name]``; True the first time ``report_key`` is counted."""
    global _last_totals_at
    now = time.monotonic()
    with _lock:
        counter[name] += count
        first = report_key not in _reported
        _reported.add(report_key)
        due = not first and now - _last_totals_at >= REPORT_INTERVAL_S
        if due or first:
            _last_totals_at = now
        totals = (dict(_dropped), dict(_failures)) if due else None
    if totals is not None:
        logger.warning("otel_verl: losses so far: dropped=%s failures=%s", *totals)
    return first


def record_failure(where: str, exc: BaseException) -> None:
    """Count an exception otel_verl swallowed; log it the first time ``where`` fails."""
    if _count(_failures, where, 1, where):
        logger.warning("otel_verl: %s failed (%s: %s); tracing goes on, further failures here are counted only",
                       where, type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.DEBUG))


def record_failures(where: str, count: int, context: str) -> None:
    """``count`` failures counted elsewhere (another process of ours); logged the first time."""
    if count > 0 and _count(_failures, where, count, where):
        logger.warning("otel_verl: %s failed %d time(s) %s; tracing goes on, further failures here are counted only",
                       where, count, context)


def record_dropped(output: str, count: int, reason: str) -> None:
    """Count ``count`` items of ``output`` that could not be written; log the first loss."""
    if count > 0 and _count(_dropped, output, count, f"dropped:{output}"):
        logger.warning("otel_verl: %s could not write %d item(s): %s; losses are counted (otel_verl.health.snapshot())",
                       output, count, reason)


def record_note(name: str, message: str) -> None:
    """Count one occurrence of the configuration note ``name``; log ``message`` the first
    time (no periodic totals: a note is no loss)."""
    with _lock:
        _notes[name] += 1
        first = _notes[name] == 1
    if first:
        logger.warning("otel_verl: %s (counted as %s in otel_verl.health.notes())", message, name)


def guarded(default: Any = None) -> Callable[[F], F]:
    """Decorator for events-API functions: an exception becomes a counted failure."""

    def decorate(fn: F) -> F:
        where = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                record_failure(where, exc)
                return default

        return wrapper  # type: ignore[return-value]

    return decorate


def snapshot() -> Dict[str, Dict[str, int]]:
    """Loss counters so far: ``{"failures": {...}, "dropped": {...}}``."""
    with _lock:
        return {"failures": dict(_failures), "dropped": dict(_dropped)}


def record_served(counts: Dict[str, Dict[str, int]]) -> None:
    """In an export process: the traced process's own counters as of its latest flush
    (they are logged there, so only :func:`totals` reads them here)."""
    global _served
    with _lock:
        _served = {kind: dict(counts.get(kind, {})) for kind in ("failures", "dropped")}


def totals() -> Dict[str, Dict[str, int]]:
    """:func:`snapshot` plus, in an export process, its traced process's own counters:
    everything lost of that process's telemetry, for the metrics."""
    with _lock:
        out = {"failures": Counter(_failures), "dropped": Counter(_dropped)}
        for kind, counts in _served.items():
            out[kind].update(counts)
    return {kind: dict(counts) for kind, counts in out.items()}


def notes() -> Dict[str, int]:
    """Configuration notes so far: name -> how many times it applied."""
    with _lock:
        return dict(_notes)


def reset() -> None:
    """Forget all counters (tests, and a forked child starting afresh)."""
    global _served
    with _lock:
        _failures.clear()
        _dropped.clear()
        _notes.clear()
        _reported.clear()
        _served = {}


@forks.in_child
def _reinit_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork time


forks.count_failures_with(record_failure)
