"""SlimTracer / SlimSpan: the API's Span, handed to a provider's processors as the SDK's
span would be, with the provider's sampler, ids and resource, and the span limits."""

from __future__ import annotations

import time
from typing import Any, List

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_verl import health
from otel_verl.semconv import INSTRUMENTATION_NAME
from otel_verl.slim_span import SlimSpan, SlimTracer


class Starts(SpanProcessor):
    """What ``on_start`` saw."""

    def __init__(self) -> None:
        self.seen: List[Any] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.seen.append((type(span), span.name, dict(span.attributes), span.parent is not None, span.kind))


class Pipeline:
    """A provider and a SlimTracer of it feeding the same processors, so that a span the
    SDK starts and one the SlimTracer starts can be compared."""

    def __init__(self, sampler: Any = None, limits: Any = None) -> None:
        self.starts, self.exporter = Starts(), InMemorySpanExporter()
        processors = SynchronousMultiSpanProcessor()
        processors.add_span_processor(self.starts)
        processors.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider = TracerProvider(resource=Resource.create({"service.name": "t"}), sampler=sampler,
                                       active_span_processor=processors)
        self.sdk = self.provider.get_tracer(INSTRUMENTATION_NAME)
        self.slim = SlimTracer(self.provider, processors, limits)

    def ended(self) -> List[Any]:
        return list(self.exporter.get_finished_spans())


def _scenario(tracer: Any) -> None:
    parent = tracer.start_span("parent", kind=SpanKind.SERVER, attributes={"a": 1})
    ctx = trace.set_span_in_context(parent)
    linked = SpanContext(7, 8, True, TraceFlags(TraceFlags.SAMPLED))
    child = tracer.start_span("child", context=ctx, kind=SpanKind.CLIENT, links=[Link(linked, {"l": "x"})],
                              attributes={"s": "text", "f": 0.5, "b": True, "seq": ["x", "y"], "n": (1, 2)})
    child.set_attribute("late", 3)
    child.set_attributes({"later": "v"})
    child.add_event("ev", {"k": "v"}, timestamp=123)
    child.update_name("child renamed")
    child.set_status(Status(StatusCode.ERROR, "bad"))
    child.end(end_time=time.time_ns() + 1000)
    parent.end()


def _comparable(span: Any) -> tuple:
    return (span.name, span.kind, dict(span.attributes), [(e.name, dict(e.attributes), e.timestamp) for e in span.events],
            [(link.context, dict(link.attributes)) for link in span.links], span.status.status_code,
            span.status.description, span.resource, span.instrumentation_scope.name,
            span.parent is not None, span.context.trace_flags)


def test_processors_get_what_an_sdk_span_gives_them():
    pipeline = Pipeline()
    _scenario(pipeline.sdk)
    _scenario(pipeline.slim)
    sdk, slim = pipeline.ended()[:2], pipeline.ended()[2:]
    assert [_comparable(s) for s in slim] == [_comparable(s) for s in sdk]
    child, parent = slim
    assert child.parent.span_id == parent.context.span_id and child.context.trace_id == parent.context.trace_id
    assert child.start_time <= child.end_time
    # on_start saw a SlimSpan with its name, start attributes and parent, as it sees the SDK's
    starts = pipeline.starts.seen
    assert [s[1:] for s in starts[2:]] == [s[1:] for s in starts[:2]]
    assert starts[2][0] is SlimSpan


def test_the_providers_sampler_and_ids_decide():
    pipeline = Pipeline(sampler=ParentBased(ALWAYS_OFF))
    span = pipeline.slim.start_span("dropped")
    assert not span.is_recording() and not span.get_span_context().trace_flags.sampled
    span.set_attribute("x", 1)
    span.end()
    assert pipeline.ended() == [] and pipeline.starts.seen == []
    # a sampled remote parent is followed: same trace, recorded
    remote = SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED))
    child = pipeline.slim.start_span("child", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    child.end()
    (ended,) = pipeline.ended()
    assert ended.context.trace_id == 0xABC and ended.parent.span_id == 0xDEF


def test_a_span_ends_once_and_changes_nothing_after():
    pipeline = Pipeline()
    span = pipeline.slim.start_span("once")
    span.end()
    span.set_attribute("after", 1)
    span.add_event("after")
    span.set_status(StatusCode.ERROR)
    span.end()
    (ended,) = pipeline.ended()
    assert dict(ended.attributes) == {} and ended.events == () and ended.status.status_code is StatusCode.UNSET
    assert not span.is_recording()


def test_values_are_kept_as_otlp_carries_them():
    pipeline = Pipeline()
    span = pipeline.slim.start_span("values", attributes={"list": [1, 2], "obj": object.__class__, "none": None})
    span.end()
    (ended,) = pipeline.ended()
    assert ended.attributes["list"] == (1, 2)
    assert ended.attributes["obj"] == str(type)  # other types as their text, as the SDK does
    assert "none" not in ended.attributes


def test_sequences_of_text_are_cut_and_repaired_item_by_item():
    pipeline = Pipeline(limits=SpanLimits(max_span_attribute_length=4))
    span = pipeline.slim.start_span("texts", attributes={
        "plain": ("0", "15", "abcd"),  # short ASCII: kept as they are
        "long": ["abcdefgh", "ab"],
        "lone": ("\ud800x", "é"),
        "mixed": ("a", 1),
    })
    span.end()
    (ended,) = pipeline.ended()
    assert ended.attributes["plain"] == ("0", "15", "abcd")
    assert ended.attributes["long"] == ("abcd", "ab")
    assert ended.attributes["lone"] == ("\ufffdx", "é")
    assert ended.attributes["mixed"] == ("a", 1)


def test_span_limits_apply_and_what_they_drop_is_counted():
    pipeline = Pipeline(limits=SpanLimits(max_span_attributes=2, max_span_attribute_length=4, max_events=1))
    span = pipeline.slim.start_span("limited", attributes={"a": "abcdefgh", "b": 2})
    span.set_attribute("c", 3)
    span.set_attribute("b", 5)  # an existing key is still set
    span.add_event("one")
    span.add_event("two")
    span.end()
    (ended,) = pipeline.ended()
    assert dict(ended.attributes) == {"a": "abcd", "b": 5}
    assert [e.name for e in ended.events] == ["one"]
    dropped = health.snapshot()["dropped"]
    assert dropped == {"span_attributes": 1, "span_events": 1}


def test_status_ok_is_final():
    pipeline = Pipeline()
    span = pipeline.slim.start_span("ok")
    span.set_status(StatusCode.OK)
    span.set_status(Status(StatusCode.ERROR, "late"))
    span.end()
    assert pipeline.ended()[0].status.status_code is StatusCode.OK


def test_start_as_current_span_records_what_the_block_raises():
    pipeline = Pipeline()
    with pytest.raises(ValueError):
        with pipeline.slim.start_as_current_span("block") as span:
            assert trace.get_current_span() is span
            raise ValueError("boom")
    (ended,) = pipeline.ended()
    assert ended.status.status_code is StatusCode.ERROR and ended.status.description == "ValueError: boom"
    (event,) = ended.events
    assert event.name == "exception" and event.attributes["exception.type"] == "ValueError"
    assert "boom" in event.attributes["exception.stacktrace"]


def test_start_as_current_span_takes_start_spans_options_and_end_on_exit():
    pipeline = Pipeline()
    with pytest.raises(ValueError):
        with pipeline.slim.start_as_current_span("quiet", None, SpanKind.CLIENT, {"a": 1},
                                                 record_exception=False, set_status_on_exception=False):
            raise ValueError("hush")
    (quiet,) = pipeline.ended()
    assert quiet.kind is SpanKind.CLIENT and dict(quiet.attributes) == {"a": 1}
    assert quiet.events == () and quiet.status.status_code is StatusCode.UNSET
    with pipeline.slim.start_as_current_span("open", end_on_exit=False) as span:
        pass
    assert span.is_recording() and len(pipeline.ended()) == 1
    span.end()
    assert len(pipeline.ended()) == 2


def test_a_span_ends_as_the_one_record_every_output_reads():
    """The processors get the span's SpanRecord: otel_verl's OTLP encoders take it as it
    is, and the SDK's encoder (a user's exporter on otel_verl's provider) writes the same
    bytes for it as for the SDK's own span."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from otel_verl.accelerated.otlp_encoding import ProtobufEncoder, records_of
    from otel_verl.record import SpanRecord

    pipeline = Pipeline()
    _scenario(pipeline.sdk)
    _scenario(pipeline.slim)
    sdk, slim = pipeline.ended()[:2], pipeline.ended()[2:]
    assert all(type(span) is SpanRecord for span in slim)
    assert all(a is b for a, b in zip(records_of(slim), slim))
    for ours, theirs in zip(slim, sdk):
        # the same span but for its ids, times and scope version
        ours.scope = theirs.instrumentation_scope
        ours.trace_id, ours.span_id, ours.start_time, ours.end_time = (
            theirs.context.trace_id, theirs.context.span_id, theirs.start_time, theirs.end_time)
        ours.parent_id = theirs.parent.span_id if theirs.parent is not None else 0
        ours.events = tuple(e._replace(timestamp=t.timestamp) for e, t in zip(ours.events, theirs.events))
        ours._context = None
        assert encode_spans([ours]).SerializeToString() == encode_spans([theirs]).SerializeToString()
        assert ProtobufEncoder().encode([ours]) == encode_spans([theirs]).SerializeToString()
