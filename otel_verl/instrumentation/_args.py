"""Reading a wrapped call's arguments by name, however verl passed them."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Tuple


@functools.lru_cache(maxsize=1024)
def _parameter_names(func: Callable[..., Any]) -> Tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)  # slow: once per function


def _split(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...]) -> Tuple[Any, Tuple[str, ...], Tuple[Any, ...]]:
    """``(self, names of the parameters args fills, args without self)``."""
    func = getattr(wrapped, "__func__", None)
    if func is not None:  # a bound method: self is bound already
        return wrapped.__self__, _parameter_names(func)[1:], args
    # a function, or wrapt's binding of one to ``instance``
    names = _parameter_names(getattr(wrapped, "__wrapped__", wrapped))
    if names[:1] != ("self",):
        return instance, names, args
    if instance is None and args:  # a method called through a plain function wrapper
        return args[0], names[1:], args[1:]
    return instance, names[1:], args


def arguments(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
    """``(self, {parameter name: value})`` of a call a wrapt wrapper sees (self is None
    for a plain function); parameters left to their defaults are absent."""
    instance, names, args = _split(wrapped, instance, args)
    values = dict(zip(names, args))
    values.update(kwargs)
    return instance, values


def with_argument(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                  name: str, value: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` with the argument ``name`` set to ``value``, where the caller passed it."""
    if name not in kwargs:
        _, names, rest = _split(wrapped, instance, args)
        if name in names[:len(rest)]:
            index = len(args) - len(rest) + names.index(name)
            return args[:index] + (value,) + args[index + 1:], kwargs
    return args, {**kwargs, name: value}
