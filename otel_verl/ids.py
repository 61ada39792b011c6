"""Sample identity: normalising ids that arrive from verl and deriving trace ids from uids.

One trace per prompt uid: the trace id is a pure function of the uid, so every process
(trainer, AgentLoopWorker, reward worker, LLM server) puts spans into the same trace and
ratio sampling on the trace id agrees everywhere without coordination.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, AnyStr, Iterable, List

from otel_verl import health

_MAX_ID_CHARS = 256  # longer ids are cut: they become attribute values and CSV cells
# A longer id is told apart by its length and samples of it: hashing the whole of a
# 50 MB uid cost ~90 ms on the caller's thread (the training loop, the agent loops' loop).
_MAX_HASHED_CHARS = 1 << 16
_SAMPLE_CHARS = 1 << 14  # of its head, its tail and (spread evenly) its middle
_MASK_64 = (1 << 64) - 1


def id_str(value: Any) -> str:
    """Turn whatever verl hands us as an id into a plain ``str``.

    Accepts str, bytes, ints, numpy scalars and 0-d/1-element arrays, TensorDict
    ``NonTensorData`` (``.data``) and None (``"None"``, never an exception).
    """
    if isinstance(value, str):
        s = value
    else:
        if type(value).__name__ == "NonTensorData":  # tensordict wraps the value in .data
            value = value.data
        item = getattr(value, "item", None)  # numpy scalar / 1-element array
        if item is not None and getattr(value, "size", 1) == 1:
            try:
                value = item()
            except (TypeError, ValueError):
                pass
        if isinstance(value, (bytes, bytearray)):
            s = _bounded_sample(bytes(value)).decode("utf-8", "replace")
        else:
            s = str(value)
    return well_formed(s if len(s) <= _MAX_ID_CHARS else bounded_id(s))


def bounded_id(s: str) -> str:
    """A long id cut to ``_MAX_ID_CHARS`` that stays apart from every other: its head,
    then ``~`` and a hash of the whole id (two uids that share their first 256
    characters are two samples); of an id over ``_MAX_HASHED_CHARS``, a hash of its
    length and samples of it (counted: two such ids alike in those are one sample)."""
    digest = hashlib.blake2b(_bounded_sample(s).encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{s[:_MAX_ID_CHARS - len(digest) - 1]}~{digest}"


def _bounded_sample(s: AnyStr) -> AnyStr:
    """``s`` itself up to ``_MAX_HASHED_CHARS``; else its head, an even sample of its
    middle, its tail and its length, at a cost that does not grow with ``s``."""
    if len(s) <= _MAX_HASHED_CHARS:
        return s
    health.record_failures("ids.long_id", 1, f"(an id of {len(s)} characters or bytes: cut, and told apart "
                                             f"from others by its length and {3 * _SAMPLE_CHARS} of them)")
    head, tail = s[:_SAMPLE_CHARS], s[-_SAMPLE_CHARS:]
    middle = s[_SAMPLE_CHARS:-_SAMPLE_CHARS:max((len(s) - 2 * _SAMPLE_CHARS) // _SAMPLE_CHARS, 1)]
    length = str(len(s))
    return head + middle + tail + (length if isinstance(s, str) else length.encode("ascii"))


def well_formed(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (``json.loads('"\\ud800"')`` makes
    one, and a model picks tool names) becomes U+FFFD, counted. OTLP's protobuf and every
    file output would otherwise refuse the whole batch or line around it."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        health.record_failures("text.lone_surrogate", 1, "(written as U+FFFD)")
        return repair_text(text)


def repair_text(text: str) -> str:
    """``text`` with each lone surrogate as U+FFFD, as a decoder shows bytes it cannot read
    (uncounted: the caller counts where it writes)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def id_list(values: Any) -> List[str]:
    """Normalise an id array (list, tuple, numpy array, NonTensorStack, scalar) to ``list[str]``."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)):
        return [id_str(values)]
    data = getattr(values, "tolist", None)
    if data is not None:
        try:
            values = data()
        except (TypeError, ValueError):
            pass
    if not isinstance(values, Iterable) or isinstance(values, (str, bytes)):
        return [id_str(values)]
    values = list(values)
    # The common case (a uid column of short ASCII str) without a call per element:
    # batch stages pass 16k ids at a time. isascii takes constant time, and an ASCII id
    # holds no lone surrogate (see well_formed).
    if all(type(v) is str and len(v) <= _MAX_ID_CHARS and v.isascii() for v in values):
        return values
    return [id_str(v) for v in values]


def trace_id_for_uid(uid: str) -> int:
    """128-bit trace id of a sample: the UUID's own bits, else a stable hash of the string."""
    try:
        value = uuid.UUID(uid).int
    except (ValueError, AttributeError, TypeError):
        value = 0
    if value == 0:
        digest = hashlib.blake2b(uid.encode("utf-8", "replace"), digest_size=16).digest()
        value = int.from_bytes(digest, "big")
    return value or 1


def root_span_id_for_uid(uid: str) -> int:
    """64-bit span id of a sample's root span, derived like the trace id.

    Lets a process with no carrier still parent its spans to the sample root; an
    explicit carrier (the exact parent) always wins.
    """
    digest = hashlib.blake2b(("root:" + uid).encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _MASK_64 or 1


def sample_index(traj_uid: str) -> int | None:
    """``int(traj_uid)`` for over-sampling indices, ``None`` for anything else."""
    try:
        return int(traj_uid)
    except (TypeError, ValueError):
        return None
