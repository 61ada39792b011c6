"""The process's one after-fork hook: what a forked child remakes.

A fork copies the parent's memory but only the thread that forked: a lock another thread
held stays held for ever in the child, and the writer threads, queues and export
processes are the parent's. A module hands :func:`in_child` a function that remakes its
state; an object that owns threads hands it a method of its own, held weakly (an object
dropped is forgotten). They run in the order given: a module's locks before the objects
that take them. This module imports nothing of otel_verl: :mod:`otel_verl.health`, which
it would count failures with, depends on it.

A child forked by :mod:`multiprocessing` (its ``fork`` start method: a ``Process``, a
``Pool``'s or a ``ProcessPoolExecutor``'s workers) ends by ``os._exit`` once its target
returned: ``atexit`` never runs there, only multiprocessing's own finalizers.
:func:`at_multiprocessing_exit` runs a function among them.
"""

from __future__ import annotations

import functools
import os
import sys
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


def at_multiprocessing_exit(finish: Callable[[], None], priority: int) -> None:
    """Called in a forked child (from a remake): should multiprocessing have forked it,
    ``finish()`` runs as it ends, among its finalizers (``multiprocessing.util.Finalize``;
    a lower ``priority`` runs later). A child forked otherwise never runs it."""
    util = sys.modules.get("multiprocessing.util")
    if util is None:  # multiprocessing forks only once it is loaded
        return
    # Its child clears the finalizers it inherited, then runs these after-fork functions:
    # a finalizer registered now would be gone by then.
    util.register_after_fork(finish, functools.partial(_finalize_at_exit, priority=priority))


def _finalize_at_exit(finish: Callable[[], None], priority: int) -> None:
    import multiprocessing.util

    multiprocessing.util.Finalize(None, finish, exitpriority=priority)


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
