"""The span metrics aggregated here and handed to the SDK's metric exporters.

The SDK's instruments spend 7-12 µs a record (they clean and hash the attributes of every
measurement, then offer it to an exemplar reservoir), and a single-turn trajectory makes
nine records. The span metrics need much less: a few instruments created once, attributes
otel_verl builds itself, cumulative temporality, explicit buckets, trace-based exemplars.
:class:`Aggregation` does that much (the ``create_*`` methods of a ``Meter`` and the
``record``/``add`` of its instruments, so the recorders of :mod:`otel_verl.exporters.metrics`
serve both; a record's ``context`` is what :func:`sampled_span` made of the span), and
builds the SDK's public data model (``MetricsData``) at each collection;
:class:`PeriodicExport` hands that to the exporters every ``OTEL_METRIC_EXPORT_INTERVAL``.
The data points equal the SDK's for the same records (``tests/test_metrics.py``). Whatever
the environment asks that this does not do (delta temporality, exponential histograms,
another exemplar filter: :func:`unsupported`) goes through the SDK's ``MeterProvider``.
"""

from __future__ import annotations

import math
import os
import threading
from bisect import bisect_left
from time import time_ns
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from opentelemetry.metrics import CallbackOptions
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_verl import forks, health
from otel_verl.deadline import Deadline

# What the SDK does with the same settings, and this module does too (the default of each)
_SUPPORTED = {
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "cumulative",
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "explicit_bucket_histogram",
    "OTEL_METRICS_EXEMPLAR_FILTER": "trace_based",
}
EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"
EXPORT_TIMEOUT = "OTEL_METRIC_EXPORT_TIMEOUT"
DEFAULT_EXPORT_INTERVAL_MS = 60_000  # the SDK's defaults
DEFAULT_EXPORT_TIMEOUT_MS = 30_000
# The SDK's default cardinality limit: past this many attribute sets, a new one records into
# one overflow series (a model picks tool names)
CARDINALITY_LIMIT = 2000
_OVERFLOW = frozenset({("otel.metric.overflow", True)})
_NONE: frozenset = frozenset()  # no attributes
_CUMULATIVE = AggregationTemporality.CUMULATIVE


def unsupported(env: Optional[Dict[str, str]] = None) -> List[str]:
    """The variables set to something only the SDK's ``MeterProvider`` does."""
    env = os.environ if env is None else env
    return [f"{name}={env[name]}" for name, value in _SUPPORTED.items()
            if env.get(name, "").strip() and env[name].strip().lower() != value]


class Aggregation:
    """The instruments of one meter (``scope``) of one ``resource``; :meth:`collect` builds
    their cumulative data points."""

    def __init__(self, resource: Any, scope: InstrumentationScope) -> None:
        self.resource = resource
        self.scope = scope
        self._lock = threading.Lock()
        self._instruments: List[Any] = []

    # ------------------------------------------------------------------ as a Meter

    def create_histogram(self, name: str, unit: str = "", description: str = "",
                         explicit_bucket_boundaries_advisory: Optional[Sequence[float]] = None) -> "_Histogram":
        return self._add(_Histogram(name, unit, description, self._lock,
                                    tuple(explicit_bucket_boundaries_advisory or ())))

    def create_counter(self, name: str, unit: str = "", description: str = "") -> "_Counter":
        return self._add(_Counter(name, unit, description, self._lock))

    def create_observable_counter(self, name: str, callbacks: Iterable[Callable[[CallbackOptions], Iterable[Any]]],
                                  unit: str = "", description: str = "") -> "_ObservableCounter":
        return self._add(_ObservableCounter(name, unit, description, list(callbacks)))

    def _add(self, instrument: Any) -> Any:
        self._instruments.append(instrument)
        return instrument

    # ------------------------------------------------------------------ collection

    def collect(self) -> Optional[MetricsData]:
        """Every instrument's points as of now (``None``: nothing recorded yet)."""
        now = time_ns()
        metrics = []
        for instrument in self._instruments:
            try:
                metric = instrument.metric(now)
            except Exception as exc:  # an observable's callback: the others still go out
                health.record_failure("metrics.collect", exc)
                continue
            if metric is not None:
                metrics.append(metric)
        if not metrics:
            return None
        return MetricsData(resource_metrics=[ResourceMetrics(
            resource=self.resource,
            scope_metrics=[ScopeMetrics(scope=self.scope, metrics=metrics, schema_url=self.scope.schema_url)],
            schema_url=self.resource.schema_url)])


class SampledSpan(tuple):
    """(trace id, span id) of a sampled span: a record's ``context``, naming the span its
    exemplar points to (the trace-based exemplar filter), worked out once for all the
    records of one span."""

    __slots__ = ()


def sampled_span(span_context: Any) -> Optional[SampledSpan]:
    """A span's records' ``context`` for the trace-based exemplar filter: the span's ids when
    it is sampled, else ``None`` (no exemplar)."""
    if not span_context.trace_flags.sampled:
        return None
    return SampledSpan((span_context.trace_id, span_context.span_id))


def _exemplar(offered: Tuple[float, int, Tuple[int, int], Optional[Dict[str, Any]]]) -> Exemplar:
    value, time_unix_nano, (trace_id, span_id), attributes = offered
    # the measurement's attributes beyond the point's (none here: every attribute makes the point)
    return Exemplar({} if attributes else None, value, time_unix_nano, span_id, trace_id)


class _Stream:
    __slots__ = ("attributes", "start", "exemplars")

    def __init__(self, attributes: Dict[str, Any]) -> None:
        self.attributes = attributes
        self.start = time_ns()
        self.exemplars: Dict[int, Any] = {}  # bucket -> (value, time, ids, attributes): the last offered


class _HistogramStream(_Stream):
    __slots__ = ("count", "sum", "total", "min", "max", "buckets")

    def __init__(self, attributes: Dict[str, Any], size: int) -> None:
        super().__init__(attributes)
        self.count = 0
        # the sum since the last collection, and before it: summed as the SDK sums, to the bit
        self.sum = 0
        self.total = 0
        self.min = math.inf
        self.max = -math.inf
        self.buckets = [0] * size


class _Instrument:
    def __init__(self, name: str, unit: str, description: str, lock: threading.Lock) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self._lock = lock
        self._streams: Dict[frozenset, Any] = {}

    def _new_stream(self, key: frozenset, attributes: Optional[Dict[str, Any]],
                    make: Callable[[Dict[str, Any]], Any]) -> Any:
        """The stream of an attribute set not seen before (under the lock)."""
        if len(self._streams) >= CARDINALITY_LIMIT:
            key, attributes = _OVERFLOW, dict(_OVERFLOW)
            stream = self._streams.get(key)
            if stream is not None:
                return stream
        stream = self._streams[key] = make(dict(attributes) if attributes else {})
        return stream


class _Histogram(_Instrument):
    def __init__(self, name: str, unit: str, description: str, lock: threading.Lock,
                 boundaries: Tuple[float, ...]) -> None:
        super().__init__(name, unit, description, lock)
        self.boundaries = boundaries
        self._make = lambda attributes: _HistogramStream(attributes, len(boundaries) + 1)

    def record(self, amount: float, attributes: Optional[Dict[str, Any]] = None,
               context: Optional[SampledSpan] = None) -> None:
        bucket = bisect_left(self.boundaries, amount)
        key = frozenset(attributes.items()) if attributes else _NONE
        with self._lock:
            stream = self._streams.get(key) or self._new_stream(key, attributes, self._make)
            stream.count += 1
            stream.sum += amount
            if amount < stream.min:
                stream.min = amount
            if amount > stream.max:
                stream.max = amount
            stream.buckets[bucket] += 1
            if context is not None:
                stream.exemplars[bucket] = (amount, time_ns(), context, attributes)

    def metric(self, now: int) -> Optional[Metric]:
        with self._lock:
            for stream in self._streams.values():
                stream.total, stream.sum = stream.sum + stream.total, 0
            points = [HistogramDataPoint(
                attributes=s.attributes, start_time_unix_nano=s.start, time_unix_nano=now, count=s.count, sum=s.total,
                bucket_counts=tuple(s.buckets), explicit_bounds=self.boundaries, min=s.min, max=s.max,
                exemplars=[_exemplar(e) for e in s.exemplars.values()]) for s in self._streams.values()]
            for stream in self._streams.values():
                stream.exemplars = {}  # each collection's exemplars are of its own interval
        if not points:
            return None
        return Metric(name=self.name, description=self.description, unit=self.unit,
                      data=Histogram(data_points=points, aggregation_temporality=_CUMULATIVE))


class _CounterStream(_Stream):
    __slots__ = ("value",)

    def __init__(self, attributes: Dict[str, Any]) -> None:
        super().__init__(attributes)
        self.value = 0


class _Counter(_Instrument):
    def add(self, amount: int, attributes: Optional[Dict[str, Any]] = None,
            context: Optional[SampledSpan] = None) -> None:
        key = frozenset(attributes.items()) if attributes else _NONE
        with self._lock:
            stream = self._streams.get(key) or self._new_stream(key, attributes, _CounterStream)
            stream.value += amount
            if context is not None:
                stream.exemplars[0] = (amount, time_ns(), context, attributes)

    def metric(self, now: int) -> Optional[Metric]:
        with self._lock:
            points = [NumberDataPoint(attributes=s.attributes, start_time_unix_nano=s.start, time_unix_nano=now,
                                      value=s.value, exemplars=[_exemplar(e) for e in s.exemplars.values()])
                      for s in self._streams.values()]
            for stream in self._streams.values():
                stream.exemplars = {}
        return _sum(self, points)


class _ObservableCounter:
    def __init__(self, name: str, unit: str, description: str,
                 callbacks: List[Callable[[CallbackOptions], Iterable[Any]]]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.callbacks = callbacks
        self._starts: Dict[frozenset, int] = {}  # an attribute set's first observation

    def metric(self, now: int) -> Optional[Metric]:
        points = []
        for callback in self.callbacks:
            for observation in callback(CallbackOptions()):
                attributes = dict(observation.attributes or {})
                start = self._starts.setdefault(frozenset(attributes.items()), now)
                points.append(NumberDataPoint(attributes=attributes, start_time_unix_nano=start, time_unix_nano=now,
                                              value=observation.value))
        return _sum(self, points)


def _sum(instrument: Any, points: List[NumberDataPoint]) -> Optional[Metric]:
    if not points:
        return None
    return Metric(name=instrument.name, description=instrument.description, unit=instrument.unit,
                  data=Sum(data_points=points, aggregation_temporality=_CUMULATIVE, is_monotonic=True))


class PeriodicExport:
    """Collects ``aggregation`` every ``OTEL_METRIC_EXPORT_INTERVAL`` ms on a thread of its
    own and hands it to each of ``exporters`` in turn, within ``OTEL_METRIC_EXPORT_TIMEOUT``
    ms, as the SDK's ``PeriodicExportingMetricReader`` does for each of its exporters."""

    def __init__(self, aggregation: Aggregation, exporters: Sequence[Any],
                 env: Optional[Dict[str, str]] = None) -> None:
        env = os.environ if env is None else env
        self.aggregation = aggregation
        self.exporters = list(exporters)
        self.interval_s = _milliseconds(env, EXPORT_INTERVAL, DEFAULT_EXPORT_INTERVAL_MS) / 1000
        self.timeout_ms = _milliseconds(env, EXPORT_TIMEOUT, DEFAULT_EXPORT_TIMEOUT_MS)
        self._export_lock = threading.Lock()  # one collection and export at a time
        self._stop = threading.Event()
        self._start_thread()
        forks.in_child(self._after_fork_in_child)

    def _start_thread(self) -> None:
        threading.Thread(target=self._loop, name="otel-verl-metrics", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export(self.timeout_ms)

    def export(self, timeout_millis: float) -> bool:
        """Collects now and hands the collection to every exporter; whether that took less
        than ``timeout_millis``. An exporter that refuses it logs why (as the SDK's reader
        does, this is no failed flush: the next collection holds the same cumulative
        points); one that raises is counted."""
        deadline = Deadline(timeout_millis / 1000)
        with self._export_lock:
            data = self.aggregation.collect()
            for exporter in self.exporters if data is not None else ():
                try:
                    exporter.export(data, timeout_millis=deadline.left_ms())
                except Exception as exc:
                    health.record_failure("metrics.export", exc)
        return not deadline.passed

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        return self.export(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000) -> bool:
        """The last collection, then every exporter shut down, within ``timeout_millis``."""
        deadline = Deadline(timeout_millis / 1000)
        self._stop.set()
        forks.forget(self._after_fork_in_child)
        exported = self.export(timeout_millis)
        for exporter in self.exporters:
            try:
                exporter.shutdown(timeout_millis=deadline.left_ms())
            except Exception as exc:
                health.record_failure("metrics.shutdown", exc)
        return exported

    def _after_fork_in_child(self) -> None:
        self._export_lock = threading.Lock()
        if not self._stop.is_set():
            self._start_thread()


def _milliseconds(env: Dict[str, str], name: str, default: int) -> float:
    try:
        value = float(env.get(name) or default)
    except ValueError:
        return default
    return value if value > 0 else default
