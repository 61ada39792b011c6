"""Reading a wrapped call's arguments by name, whatever way verl passed them."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Tuple


@functools.lru_cache(maxsize=256)
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


@functools.lru_cache(maxsize=1024)
def _param_names(func: Callable[..., Any]) -> Tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def bound(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
    """``(self, {name: value})`` of a call seen by a wrapt wrapper.

    Handles both a bound method (``instance`` set) and a plain function wrapper around
    an unbound method (re-decorated ``@auto_await`` targets: ``self`` is ``args[0]``).
    """
    target = getattr(wrapped, "__wrapped__", wrapped)
    # Cache on the plain function: a bound method is a new object per instance (an agent
    # loop is created per trajectory), so keying on it missed the cache every call and
    # ran inspect.signature (~100 us) per wrapped call.
    func = getattr(target, "__func__", None)
    if func is not None:  # a bound method: its first parameter is bound already
        params = _param_names(func)[1:]
        if instance is None:
            instance = getattr(target, "__self__", None)
    else:
        params = _param_names(target)
        if instance is None and params and params[0] == "self":
            instance, args = args[0], args[1:]
        if params and params[0] == "self":
            params = params[1:]
    values = dict(zip(params, args))
    values.update(kwargs)
    return instance, values


@functools.lru_cache(maxsize=1024)
def _positions(func: Callable[..., Any]) -> Tuple[Dict[str, int], bool]:
    """``({name: index among the positional parameters}, first parameter is self)``."""
    positional = [
        p.name for p in inspect.signature(func).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return {name: i for i, name in enumerate(positional)}, bool(positional) and positional[0] == "self"


_MISSING = object()


def arg(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str,
        default: Any = None) -> Any:
    """One argument of a wrapped call by name, as :func:`bound` would find it, without
    binding the others: the rollout worker's wrappers read one or two arguments of calls
    made several times a trajectory (a keyword argument costs a dict lookup)."""
    value = kwargs.get(name, _MISSING)
    if value is not _MISSING:
        return value
    index = _index(wrapped, instance, name)
    return args[index] if 0 <= index < len(args) else default


class ArgReader:
    """Reads the arguments ``names`` of a wrapped function's calls, as :func:`arg` finds
    each (``None`` for one not passed), in one call: the names of the positional
    parameters are looked up once per wrapped function, not per call (the LLM client
    reads three arguments of every turn)."""

    __slots__ = ("names", "_learned")

    def __init__(self, names: Tuple[str, ...]) -> None:
        self.names = names
        # ((function, unbound?), names of the parameters args holds): one object
        self._learned: Tuple[Any, Tuple[str, ...]] = (None, ())

    def read(self, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """The arguments, in the order of ``names``. (Hot call sites call this method
        by name: calling the reader itself goes through a slot wrapper, a few times
        dearer.)"""
        if not args:  # all by keyword
            return tuple(map(kwargs.get, self.names))
        key = (getattr(wrapped, "__func__", wrapped), instance is None)  # a bound method's function
        learned = self._learned
        if learned[0] != key:
            learned = self._learned = (key, _positional_names(wrapped, instance))
        values = dict(zip(learned[1], args))
        values.update(kwargs)
        return tuple(map(values.get, self.names))

    def with_self(self, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Tuple[Any, Tuple[Any, ...]]:
        """``(self of the call, the arguments)``: self as :func:`bound` finds it."""
        values = self.read(wrapped, instance, args, kwargs)
        if instance is None:
            target = getattr(wrapped, "__wrapped__", wrapped)
            instance = getattr(target, "__self__", None)
            if instance is None and args and _positions(target)[1]:
                instance = args[0]  # an unbound method through a plain function wrapper
        return instance, values

    __call__ = read


def _positional_names(wrapped: Callable[..., Any], instance: Any) -> Tuple[str, ...]:
    """The parameters a wrapped call's positional ``args`` fill, in order (see :func:`_index`)."""
    target = getattr(wrapped, "__wrapped__", wrapped)
    func = getattr(target, "__func__", None)
    positions, has_self = _positions(func if func is not None else target)
    names = tuple(positions)  # in parameter order
    if has_self and (func is not None or instance is not None):
        names = names[1:]  # self is bound, or came as the instance: not in args
    return names


def _index(wrapped: Callable[..., Any], instance: Any, name: str) -> int:
    """Where ``name`` is in a wrapped call's positional ``args`` (-1: not a positional parameter)."""
    target = getattr(wrapped, "__wrapped__", wrapped)
    func = getattr(target, "__func__", None)
    if func is not None:  # a bound method: self is not in args
        positions, has_self = _positions(func)
        return positions.get(name, -1) - 1 if has_self else positions.get(name, -1)
    positions, has_self = _positions(target)
    index = positions.get(name, -1)
    if has_self and instance is not None and index >= 0:
        index -= 1  # self came as the instance, not in args
    return index


def self_and_args(instance: Any, args: Tuple[Any, ...]) -> Tuple[Any, Tuple[Any, ...]]:
    """``self`` and the remaining positional args (see :func:`bound`)."""
    if instance is None and args:
        return args[0], args[1:]
    return instance, args


def replaced(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str, value: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` with the argument ``name`` set to ``value``, wherever it was passed."""
    if name in kwargs:
        return args, {**kwargs, name: value}
    target = getattr(wrapped, "__wrapped__", wrapped)
    params = [p for p in _signature(target).parameters]
    offset = 1 if (instance is None and params and params[0] == "self") else 0
    if params and params[0] == "self":
        params = params[1:]
    if name in params:
        index = params.index(name) + offset
        if index < len(args):
            return args[:index] + (value,) + args[index + 1:], kwargs
    return args, {**kwargs, name: value}
