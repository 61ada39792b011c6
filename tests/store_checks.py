"""What the span store's tests share: floats rounded for equality with the in-memory report
(the engine sums in another order)."""

from __future__ import annotations

import math


def rounded(value):
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value
