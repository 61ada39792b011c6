"""Wall-clock timestamps whose differences are true durations.

A span's timestamps are epoch time (the OTLP and legacy formats want them so), but two
readings of the system clock taken around a jump (NTP stepping it, a container restored
from a checkpoint) differ by the jump: a two-hour step back made a trajectory's
``total_time_ms`` negative. As the Go and Java SDKs do, a timestamp after the first is the
first's epoch time plus what the monotonic clock says passed since.

Every reading goes through this module's ``time``: tests replace that one name.
"""

from __future__ import annotations

import time


def offset_ns() -> int:
    """The epoch time now minus the monotonic time now: ``time.monotonic_ns() + offset``
    reads epoch time that advances only with the monotonic clock."""
    return time.time_ns() - time.monotonic_ns()


def monotonic_ns() -> int:
    """The monotonic clock's reading, for :func:`epoch_ns_since`."""
    return time.monotonic_ns()


def anchored_ns(offset: int) -> int:
    """Epoch nanoseconds now, on the timeline of ``offset`` (of :func:`offset_ns`)."""
    return time.monotonic_ns() + offset


def epoch_ns_since(monotonic_start_ns: int) -> int:
    """The epoch time of the monotonic reading ``monotonic_start_ns``, on the system clock
    as it reads now (a start timestamp taken at the end: the duration to now is true)."""
    return time.time_ns() - (time.monotonic_ns() - monotonic_start_ns)


class AnchoredClock:
    """Epoch time anchored once, then advanced by the monotonic clock: every reading of
    one clock is on one timeline, so their differences are durations."""

    __slots__ = ("offset_ns",)

    def __init__(self) -> None:
        self.offset_ns = offset_ns()

    def now_ns(self) -> int:
        return anchored_ns(self.offset_ns)

    def now(self) -> float:
        """Epoch seconds."""
        return anchored_ns(self.offset_ns) / 1_000_000_000  # int / int: rounded once
