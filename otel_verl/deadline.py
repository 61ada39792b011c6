"""One deadline shared by the steps of a flush or a shutdown.

The SDK's span processors and exporters do not always keep the timeout they are given
(the SDK's ``BatchSpanProcessor.force_flush``, a user's or otel_verl's with
``OTEL_VERL_ACCELERATED=false``, exports its whole queue whatever the timeout, one
export timeout per batch). :class:`Call` runs such a call on a daemon thread and waits
for it only until the deadline: a call that is late goes on in the background, where it
holds neither the caller nor the process's exit.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List


class Deadline:
    """The moment ``seconds`` from now."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + max(0.0, seconds)

    def left_s(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def left_ms(self) -> int:
        return int(self.left_s() * 1000)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


class Late(Exception):
    """A call did not return by its deadline (it goes on in the background)."""


class Call:
    """``fn(*args)`` started at once on a daemon thread of its own."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.name = f"otel-verl-{getattr(fn, '__qualname__', 'call')}"
        self._outcome: List[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._outcome.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller of result()
            self._outcome.append((False, exc))

    def result(self, deadline: Deadline) -> Any:
        """What the call returned (or raised) if it returns by ``deadline``, else :class:`Late`."""
        self._thread.join(deadline.left_s())
        if not self._outcome:
            raise Late(f"{self.name} did not return by its deadline")
        returned, value = self._outcome[0]
        if not returned:
            raise value
        return value
