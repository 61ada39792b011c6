"""Carrying W3C trace context across Ray process boundaries inside verl's own data.

verl's calls cannot take new keyword arguments (Ray checks remote-call kwargs against
the method's signature on the caller side), so context rides inside data verl already
passes: a ``non_tensor_batch`` column or ``meta_info`` entry of a DataProto, a field of
a v1 TensorDict, or a reserved key of a dict argument. Every ``inject_*`` has a
``pop_*`` twin that the receiving side calls *before* verl or user code sees the data,
so no carrier leaks into reward managers, TransferQueue or ``extra_fields`` (the reward
DataProto brings the reward span's carrier to the reward actor, which pops it).

A carrier value is a :class:`TraceCarrier`: the context and the id of the run that
sent it, no settings (carriers travel inside data that may outlive the run, e.g. in
TransferQueue). A configurator may name the function that unpickles the carriers a
process sends (:func:`restore_with`): otel_verl's names one that first switches tracing
on, from the receiving process's own settings, in a process of the same run where it is
off (see :mod:`otel_verl.activation`), so a Ray worker whose runtime env lost the job's
setup hook still starts tracing on the first traced data. This module imports no
configurator.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_verl import forks, health
from otel_verl.ids import id_str
from otel_verl.settings import RUN_ID

COLUMN = "otel_traceparent"  # DataProto non_tensor_batch column / TensorDict field / row kwarg
META_KEY = "otel_traceparent"  # DataProto meta_info key (one carrier for the whole batch)
DICT_KEY = "__otel_tp"  # reserved key inside an existing dict argument (e.g. sampling_params)

_propagator = TraceContextTextMapPropagator()


class TraceCarrier:
    """W3C ``traceparent``/``tracestate`` of one span and the id of the run that sent it
    (``None``: unknown), picklable across Ray calls."""

    __slots__ = ("headers", "run_id", "row")

    def __init__(
        self,
        headers: Dict[str, str],
        run_id: Optional[str] = None,
        row: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.headers = headers
        self.run_id = run_id
        self.row = row  # per-row facts the receiver needs (traj_uid, worker index)

    @classmethod
    def from_span(cls, span: Any, row: Optional[Mapping[str, Any]] = None) -> "TraceCarrier":
        return cls(headers_of(span), _this_run_id(), row)

    def with_row(self, row: Mapping[str, Any]) -> "TraceCarrier":
        """The same context (shared headers object: pickled once) with per-row facts."""
        return TraceCarrier(self.headers, self.run_id, row)

    def __reduce__(self):  # noqa: D105 - pickled by reference to the restoring function
        return (_restorer, (self.headers, self.run_id, self.row))

    def __repr__(self) -> str:
        return f"TraceCarrier({self.headers.get('traceparent')})"

    def __eq__(self, other: object) -> bool:  # numpy/DataProto concat compares columns
        return isinstance(other, TraceCarrier) and other.headers == self.headers and other.row == self.row

    def __hash__(self) -> int:
        return hash(self.headers.get("traceparent"))


def restore(headers: Dict[str, str], run_id: Any, row: Optional[Mapping[str, Any]] = None) -> TraceCarrier:
    """The carrier as unpickled; a row's carrier is kept for its uid (:func:`take_arrived`).

    Carriers of an older format hold the sender's settings where the run id is now: they
    name no run."""
    carrier = TraceCarrier(headers, run_id if isinstance(run_id, str) else None, row)
    if row and row.get("uid") is not None:
        _note_arrival(str(row["uid"]), carrier)
    return carrier


_restorer: Callable[..., TraceCarrier] = restore


def restore_with(restorer: Callable[..., TraceCarrier]) -> None:
    """Carriers pickled in this process from now on are unpickled by ``restorer(headers,
    run_id, row)``, which returns :func:`restore`'s carrier. Pickle names
    it by module path: a module-level function, whose module the receiving process
    imports to unpickle the carrier."""
    global _restorer
    _restorer = restorer


# v1 rows reach the worker inside a TensorDict chunk, and verl starts each prompt's task
# (which marks it "running" in TransferQueue) before any hooked call sees the row: a
# carrier that names its uid is kept here on arrival for the prompt-task hook. Bounded.
ARRIVED_LIMIT = 65536
_arrived: "OrderedDict[str, TraceCarrier]" = OrderedDict()
_arrived_lock = threading.Lock()


def _note_arrival(uid: str, carrier: TraceCarrier) -> None:
    with _arrived_lock:
        _arrived[uid] = carrier
        while len(_arrived) > ARRIVED_LIMIT:
            _arrived.popitem(last=False)


@forks.in_child
def _new_arrivals_lock_in_child() -> None:
    global _arrived_lock
    _arrived_lock = threading.Lock()  # another thread may have held it at fork time


def take_arrived(uid: Any) -> Optional[TraceCarrier]:
    """The carrier that arrived in this process for ``uid`` (removed), or ``None``.
    Carriers name their uid as the events API writes it (``id_str``: a long one cut)."""
    key = id_str(uid)
    with _arrived_lock:
        return _arrived.pop(key, None)


_run_id: Optional[str] = None


def _this_run_id() -> Optional[str]:
    """``OTEL_VERL_RUN_ID``, which the configurator sets where it traces; kept as one
    string object while it does not change, so a pickled batch stores it once."""
    global _run_id
    value = os.environ.get(RUN_ID) or None
    if value != _run_id:
        _run_id = value
    return _run_id


def headers_of(span: Any) -> Dict[str, str]:
    """The W3C headers of ``span`` (``traceparent``, ``tracestate``); empty when it has no
    valid context."""
    headers: Dict[str, str] = {}
    _propagator.inject(headers, context=trace.set_span_in_context(span))
    return headers


def context_from(carrier: Any) -> Optional[otel_context.Context]:
    """A parent context from a TraceCarrier, a header dict, a bare traceparent string or
    a Context (returned as is);
    ``None`` when it holds no valid context."""
    if isinstance(carrier, otel_context.Context):
        return carrier
    if isinstance(carrier, TraceCarrier):
        headers: Mapping[str, str] = carrier.headers
    elif isinstance(carrier, Mapping):
        headers = carrier
    elif isinstance(carrier, str):
        headers = {"traceparent": carrier}
    else:
        return None
    # a header dict comes from the caller (an HTTP request's headers, a custom loop's
    # kwargs): what is no text carries no context, and the propagator would raise on it
    headers = {key: value for key, value in headers.items() if type(key) is str and isinstance(value, str)}
    try:
        ctx = _propagator.extract(headers)
    except Exception as exc:
        health.record_failure("carriers.extract", exc)
        return None
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# --------------------------------------------------------------------------- DataProto


def inject_column(data: Any, values: Sequence[Any]) -> None:
    """Per-row carriers as an object column of ``data.non_tensor_batch``."""
    import numpy as np

    column = np.empty(len(values), dtype=object)
    column[:] = list(values)
    data.non_tensor_batch[COLUMN] = column


def pop_column(data: Any) -> Optional[Any]:
    batch = getattr(data, "non_tensor_batch", None)
    return batch.pop(COLUMN, None) if batch is not None else None


def inject_meta(data: Any, carrier: TraceCarrier) -> None:
    data.meta_info[META_KEY] = carrier


def pop_meta(data: Any) -> Optional[TraceCarrier]:
    meta = getattr(data, "meta_info", None)
    return meta.pop(META_KEY, None) if meta is not None else None


# --------------------------------------------------------------------------- TensorDict (v1)


def inject_tensordict(td: Any, values: Sequence[Any]) -> None:
    """Per-row carriers as a non-tensor field of a v1 TensorDict batch."""
    from tensordict import NonTensorStack

    td[COLUMN] = NonTensorStack(*values)


def pop_tensordict(td: Any) -> Optional[List[Any]]:
    try:
        keys = td.keys()
    except Exception:
        return None
    if COLUMN not in keys:
        return None
    value = td.get(COLUMN)
    del td[COLUMN]
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else [value]


# --------------------------------------------------------------------------- dicts / kwargs


def inject_dict(mapping: Mapping[str, Any], carrier: Any) -> Dict[str, Any]:
    """A copy of ``mapping`` with the carrier under the reserved key (callers often reuse
    the original dict across calls, so it is never modified)."""
    out = dict(mapping)
    out[DICT_KEY] = carrier
    return out


def pop_dict(mapping: MutableMapping[str, Any]) -> Optional[Any]:
    return mapping.pop(DICT_KEY, None) if isinstance(mapping, MutableMapping) else None


def pop_kwargs(kwargs: MutableMapping[str, Any]) -> Optional[Any]:
    """Remove the per-row carrier verl turned into a keyword argument."""
    return kwargs.pop(COLUMN, None)


# --------------------------------------------------------------------------- request ids

# Worker → LLM server: the server's generate() takes no **kwargs and both engines reject
# unknown sampling parameters, so the turn's context rides as a suffix of the request id.
# An instrumented server strips it before the engine sees the id; an uninstrumented one
# just uses a longer (still unique) id.
REQUEST_ID_TAG = ".otel."


def tag_request_id(request_id: str, headers: Mapping[str, str]) -> str:
    traceparent = headers.get("traceparent")
    if not traceparent or REQUEST_ID_TAG in request_id:
        return request_id
    return f"{request_id}{REQUEST_ID_TAG}{traceparent}"


def untag_request_id(request_id: Any) -> "tuple[Any, Optional[Dict[str, str]]]":
    """``(original id, headers)``; headers is ``None`` for an untagged id."""
    if not isinstance(request_id, str) or REQUEST_ID_TAG not in request_id:
        return request_id, None
    original, _, traceparent = request_id.rpartition(REQUEST_ID_TAG)
    return original, {"traceparent": traceparent}


# LLM server → worker: per-request engine timing, in the response's extra_fields under a
# reserved key that the worker pops before verl copies extra_fields into its batch.
SERVER_META_KEY = "__otel_llm"
