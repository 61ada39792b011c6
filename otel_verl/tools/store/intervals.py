"""SQL expressions over arrays of (start_ns, end_ns) intervals, for the report's queries."""

from __future__ import annotations


def union_ns(intervals: str) -> str:
    """The nanoseconds covered by an array of (start, end) intervals."""
    return (f"arrayFold((acc, x) -> (acc.1 + greatest(toInt64(0), x.2 - greatest(x.1, acc.2)), greatest(acc.2, x.2)), "
            f"arraySort(x -> x.1, {intervals}), (toInt64(0), toInt64(0))).1")


def clipped(intervals: str, lo: str, hi: str) -> str:
    """The parts of the intervals within [lo, hi]."""
    return (f"arrayMap(x -> (greatest(x.1, {lo}), least(x.2, {hi})), "
            f"arrayFilter(x -> x.2 > {lo} AND x.1 < {hi}, {intervals}))")


def merged(intervals: str) -> str:
    """The intervals as disjoint ones, in order, empty ones left out."""
    return ("arrayFold((acc, x) -> if(notEmpty(acc) AND x.1 <= acc[-1].2, "
            "arrayPushBack(arrayPopBack(acc), (acc[-1].1, greatest(acc[-1].2, x.2))), arrayPushBack(acc, x)), "
            f"arraySort(arrayFilter(x -> x.2 > x.1, {intervals})), CAST([], 'Array(Tuple(Int64, Int64))'))")
