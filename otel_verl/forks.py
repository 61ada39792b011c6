"""The process's one after-fork hook: what a forked child remakes.

A fork copies the parent's memory but only the thread that forked: a lock another thread
held stays held for ever in the child, and the writer threads, queues and export
processes are the parent's. A module hands :func:`in_child` a function that remakes its
state; an object that owns threads hands it a method of its own, held weakly (an object
dropped is forgotten). They run in the order given: a module's locks before the objects
that take them. This module imports nothing of otel_verl: :mod:`otel_verl.health`, which
it would count failures with, depends on it.
"""

from __future__ import annotations

import os
import types
import weakref
from typing import Any, Callable, List, Optional

Remake = Callable[[], None]

_remakes: List[Any] = []  # functions, and weak references to methods
_count_failure: Optional[Callable[[str, BaseException], None]] = None


def in_child(remake: Remake) -> Remake:
    """Calls ``remake()`` in every child forked from now on (a method: while its object
    lives); returns it, so that it can decorate a function."""
    _remakes[:] = [r for r in _remakes if not (isinstance(r, weakref.WeakMethod) and r() is None)]
    _remakes.append(weakref.WeakMethod(remake) if isinstance(remake, types.MethodType) else remake)
    return remake


def forget(remake: Remake) -> None:
    """A remake no longer wanted (its object shut down)."""
    _remakes[:] = [r for r in _remakes if _resolve(r) != remake]


def count_failures_with(record: Callable[[str, BaseException], None]) -> None:
    """What counts a remake that raised (``record(where, exc)``)."""
    global _count_failure
    _count_failure = record


def _resolve(entry: Any) -> Optional[Remake]:
    return entry() if isinstance(entry, weakref.WeakMethod) else entry


def _after_fork_in_child() -> None:
    for entry in list(_remakes):
        remake = _resolve(entry)
        if remake is None:
            continue
        try:
            remake()
        except Exception as exc:  # the child goes on; its tracing counts what it could not remake
            if _count_failure is not None:
                _count_failure("fork", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
