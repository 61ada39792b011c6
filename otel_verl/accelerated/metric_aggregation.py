"""The span metrics aggregated here and handed to the SDK's metric exporters.

The SDK's instruments spend 7-12 µs a record (they clean and hash the attributes of every
measurement, then offer it to an exemplar reservoir), and a single-turn trajectory makes
nine records. The span metrics need much less: a few instruments created once, attributes
otel_verl builds itself, cumulative temporality, explicit buckets, trace-based exemplars.
:class:`Aggregation` does that much (the ``create_*`` methods of a ``Meter`` and the
``record``/``add`` of its instruments, so the recorders of :mod:`otel_verl.exporters.metrics`
serve both; a record's ``context`` is what :func:`sampled_span` made of the span), and
builds the SDK's public data model (``MetricsData``) at each collection;
:class:`PeriodicExport` hands that to the exporters every ``OTEL_METRIC_EXPORT_INTERVAL``
and soon after otel_verl's loss counters change, each exporter on a thread of its own.
The data points equal the SDK's for the same records (``tests/test_metrics.py``). Whatever
the environment asks that this does not do (delta temporality, exponential histograms,
another exemplar filter: :func:`unsupported`) goes through the SDK's ``MeterProvider``.
"""

from __future__ import annotations

import math
import os
import threading
import time
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
# otel_verl's loss counters are looked at this often (as the loss file is written), and a
# change collected unless a collection came less than LOSSES_SPACING_S before: a run that
# loses spans for hours adds a line (a few kB) to its metric file every 5 s, not every second
LOSSES_CHECK_S = 1.0
LOSSES_SPACING_S = 5.0


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
    """Collects ``aggregation`` every ``OTEL_METRIC_EXPORT_INTERVAL`` ms, and within about
    ``losses_check_s`` of a change of otel_verl's loss counters (:mod:`otel_verl.health`;
    at most every ``losses_spacing_s`` while they go on changing), on a thread of its own,
    and hands each collection to each of ``exporters``, each on a thread of its own
    (:class:`_Lane`): an OTLP exporter waiting out a collector's retries delays no file,
    the last collection's included. The points are cumulative, so an exporter still busy
    with an older collection skips to the newest."""

    def __init__(self, aggregation: Aggregation, exporters: Sequence[Any],
                 env: Optional[Dict[str, str]] = None, *, losses_check_s: float = LOSSES_CHECK_S,
                 losses_spacing_s: float = LOSSES_SPACING_S) -> None:
        env = os.environ if env is None else env
        self.aggregation = aggregation
        self.exporters = list(exporters)
        self.interval_s = _milliseconds(env, EXPORT_INTERVAL, DEFAULT_EXPORT_INTERVAL_MS) / 1000
        self.timeout_ms = _milliseconds(env, EXPORT_TIMEOUT, DEFAULT_EXPORT_TIMEOUT_MS)
        self.losses_check_s = losses_check_s
        self.losses_spacing_s = losses_spacing_s
        self.lanes = [_Lane(exporter) for exporter in self.exporters]
        self._collect_lock = threading.Lock()  # one collection at a time, numbered in order
        self._collections = 0
        # the loss counters as of the latest collection (none yet: a loss counted collects)
        self._losses_collected: Any = {"failures": {}, "dropped": {}}
        self._collected_at = -math.inf  # time.monotonic() of the latest collection
        self._stop = threading.Event()
        self._start_thread()
        forks.in_child(self._after_fork_in_child)

    def _start_thread(self) -> None:
        threading.Thread(target=self._loop, name="otel-verl-metrics", daemon=True).start()

    def _loop(self) -> None:
        due = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, min(self.losses_check_s, due - time.monotonic()))):
            now = time.monotonic()
            if now >= due:
                due = now + self.interval_s
                self._hand_over(self.timeout_ms)
            elif now - self._collected_at >= self.losses_spacing_s and health.totals() != self._losses_collected:
                self._hand_over(self.timeout_ms)

    def _hand_over(self, timeout_millis: float) -> int:
        """Collects now and hands the collection to every lane; its number (0: nothing
        recorded yet)."""
        with self._collect_lock:
            # read before the collection: a loss counted meanwhile makes the next one
            self._losses_collected = health.totals()
            self._collected_at = time.monotonic()
            data = self.aggregation.collect()
            if data is None:
                return 0
            self._collections += 1
            for lane in self.lanes:
                lane.offer(self._collections, data, timeout_millis)
            return self._collections

    def export(self, timeout_millis: float) -> bool:
        """Collects now and hands the collection to every exporter; whether every one of
        them exported it within ``timeout_millis``. An exporter that refuses it logs why
        (as the SDK's reader does, this is no failed flush: the next collection holds the
        same cumulative points); one that raises is counted."""
        deadline = Deadline(timeout_millis / 1000)
        collection = self._hand_over(timeout_millis)
        waited = [lane.wait(collection, deadline) for lane in self.lanes]
        return all(waited)

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        return self.export(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000) -> bool:
        """The last collection, then every exporter shut down, within ``timeout_millis``."""
        deadline = Deadline(timeout_millis / 1000)
        self._stop.set()
        forks.forget(self._after_fork_in_child)
        exported = self.export(timeout_millis)
        for lane in self.lanes:
            lane.close()
            try:
                lane.exporter.shutdown(timeout_millis=deadline.left_ms())
            except Exception as exc:
                health.record_failure("metrics.shutdown", exc)
        return exported

    def _after_fork_in_child(self) -> None:
        self._collect_lock = threading.Lock()
        for lane in self.lanes:
            lane.after_fork_in_child()
        if not self._stop.is_set():
            self._start_thread()


class _Lane:
    """One exporter and the thread that exports to it the newest collection handed over."""

    def __init__(self, exporter: Any) -> None:
        self.exporter = exporter
        self._ready = threading.Condition()
        self._next: Optional[Tuple[int, MetricsData, float]] = None  # (number, collection, timeout ms)
        self._done = 0  # the number of the newest collection exported (or refused)
        self._closed = False
        self._ended = False  # the thread returned: nothing handed over is exported any more
        self._start_thread()

    def _start_thread(self) -> None:
        threading.Thread(target=self._run, name="otel-verl-metrics-export", daemon=True).start()

    def offer(self, number: int, data: MetricsData, timeout_millis: float) -> None:
        with self._ready:
            self._next = (number, data, timeout_millis)
            self._ready.notify_all()

    def wait(self, number: int, deadline: Deadline) -> bool:
        """Whether collection ``number`` (or a newer one) is exported by ``deadline``."""
        with self._ready:
            self._ready.wait_for(lambda: self._done >= number or self._ended, deadline.left_s())
            return self._done >= number

    def close(self) -> None:
        """The thread ends once it exported what it was handed."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next is not None or self._closed)
                if self._next is None:
                    self._ended = True
                    self._ready.notify_all()
                    return
                (number, data, timeout_millis), self._next = self._next, None
            try:
                self.exporter.export(data, timeout_millis=timeout_millis)
            except Exception as exc:
                health.record_failure("metrics.export", exc)
            with self._ready:
                self._done = number
                self._ready.notify_all()

    def after_fork_in_child(self) -> None:
        self._ready = threading.Condition()  # another thread may have held it at fork time
        self._next = None  # the parent's collection: the child collects its own
        if not self._closed:
            self._start_thread()


def _milliseconds(env: Dict[str, str], name: str, default: int) -> float:
    try:
        value = float(env.get(name) or default)
    except ValueError:
        return default
    return value if value > 0 else default
