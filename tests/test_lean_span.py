"""Lean spans (otel_verl.lean_span) against the SDK's own spans: the same ids, parent,
sampling, attributes, status, events and processor calls; the SDK's validation for code
other than the events API; the SDK's span wherever a lean one would not be equivalent.
Also the pieces that keep the rollout worker's per-trajectory cost down: processor
routing by record kind, text hand-offs to the writer, the carrier context cache, the
tokenizer's text decoder, and the worker's ``with`` blocks ending their span whatever
fails before."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from otel_verl import carriers, lean_span
from otel_verl.record import SpanRecord, record_of, start_span
from otel_verl.sampling import IsolatingSpanProcessor, record_dropped_samples
from otel_verl.semconv import Kind


class Recorder(SpanProcessor):
    """Every on_start / on_end call, with the record on_start could read."""

    def __init__(self) -> None:
        self.calls = []

    def on_start(self, span, parent_context=None):
        record = record_of(span)
        self.calls.append(("start", span.name, record.kind if record else None))

    def on_end(self, span):
        self.calls.append(("end", span.name, dict(span.attributes)))


def _provider(sampler=None, limits=None, processors=()):
    exporter = InMemorySpanExporter()
    kwargs = {"resource": Resource.create({"service.name": "verl"}), "sampler": sampler or record_dropped_samples(ALWAYS_ON)}
    if limits is not None:
        kwargs["span_limits"] = limits
    provider = TracerProvider(**kwargs)
    for p in processors:
        provider.add_span_processor(p)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, provider.get_tracer("otel_verl", "1.0"), exporter


def _remote_parent(sampled=True, extra_flags=0, trace_state=None):
    flags = TraceFlags((TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT) | extra_flags)
    ctx = SpanContext(0xABC, 0xDEF, True, flags, trace_state)
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def _fields(span):
    return (span.name, span.kind, dict(span.attributes), span.status.status_code, span.status.description,
            span.resource, span.instrumentation_scope, [(e.name, dict(e.attributes)) for e in span.events],
            [link.context for link in span.links], span.parent.span_id if span.parent else None,
            span.context.trace_id, span.context.trace_flags, span.context.is_remote)


def test_a_lean_span_exports_what_the_sdk_span_exports():
    provider, tracer, exporter = _provider()
    assert lean_span.supports(tracer)
    link = Link(SpanContext(0x1, 0x2, False, TraceFlags(1)))

    def run(start):
        span = start()
        span.add_event("retry", {"n": 1})
        span.set_status(StatusCode.ERROR, "boom")
        span.set_attribute("after", 2)
        span.end()
        return span

    lean = run(lambda: lean_span.starter(tracer).start("chat m", SpanRecord(Kind.LLM_CALL), context=_remote_parent(),
                                       kind=SpanKind.CLIENT, attributes={"a": "x", "n": 3}, links=[link]))
    sdk = run(lambda: tracer.start_span("chat m", context=_remote_parent(), kind=SpanKind.CLIENT,
                                        attributes={"a": "x", "n": 3}, links=[link]))
    assert isinstance(lean, lean_span.LeanSpan) and not isinstance(sdk, lean_span.LeanSpan)
    got = exporter.get_finished_spans()
    assert len(got) == 2
    assert _fields(got[0]) == _fields(got[1])
    assert got[0].start_time <= got[0].end_time
    provider.shutdown()


def test_a_lean_span_sets_every_field_the_sdks_readable_span_sets():
    # LeanSpan sets ReadableSpan's fields itself (cheaper than its keyword call), or has
    # the SDK's initial value as a class attribute: an SDK that adds one must not leave
    # lean spans without it.
    from opentelemetry.sdk.trace import ReadableSpan

    provider, tracer, _ = _provider()
    lean = lean_span.starter(tracer).start("chat m", SpanRecord(Kind.LLM_CALL), attributes={"a": "x"})
    sdk_span = ReadableSpan("x")
    sdk_fields = set(vars(sdk_span))
    assert sdk_fields and sdk_fields <= set(vars(lean)) | set(vars(lean_span.LeanSpan))
    for field in sdk_fields - set(vars(lean)):
        assert getattr(lean, field) == getattr(sdk_span, field) or field == "_status", field
    assert lean.resource is tracer.resource and lean.instrumentation_scope is tracer._instrumentation_scope
    assert lean.end_time is None and list(lean.events) == [] and lean.status.status_code is StatusCode.UNSET
    lean.end()
    provider.shutdown()


def test_the_record_is_readable_from_on_start_and_each_span_ends_once(caplog):
    recorder = Recorder()
    provider, tracer, exporter = _provider(processors=[recorder])
    span = start_span(tracer, "invoke_agent a", Kind.TRAJECTORY, None, context=_remote_parent(), attributes={"k": 1})
    child = start_span(tracer, "chat m", Kind.LLM_CALL, None, context=trace.set_span_in_context(span))
    assert child.parent.span_id == span.get_span_context().span_id
    child.end()
    lean_span.set_trusted(span, "verl.num_turns", 1)
    span.end()
    span.end()  # a second end changes nothing
    with caplog.at_level(logging.WARNING, logger="otel_verl"):
        span.set_attribute("late", 1)
    lean_span.set_trusted(span, "late", 1)
    assert recorder.calls == [
        ("start", "invoke_agent a", Kind.TRAJECTORY),
        ("start", "chat m", Kind.LLM_CALL),
        ("end", "chat m", {}),
        ("end", "invoke_agent a", {"k": 1, "verl.num_turns": 1}),
    ]
    assert "ended span" in caplog.text
    assert [s.name for s in exporter.get_finished_spans()] == ["chat m", "invoke_agent a"]
    provider.shutdown()


def test_attributes_from_other_code_are_validated_like_on_an_sdk_span():
    provider, tracer, exporter = _provider(limits=SpanLimits(max_span_attributes=64))

    def run(span):
        span.set_attribute("object", object())  # not an attribute value
        span.set_attribute("none", None)
        span.set_attribute("list", [1, 2])  # kept as a tuple
        span.set_attributes({"x": True, "mixed": [1, "x"], "map": {"a": 1}})
        for i in range(70):  # the count limit holds for every setter
            lean_span.set_trusted(span, f"t{i}", i)
        span.end()

    run(lean_span.starter(tracer).start("s", SpanRecord(Kind.TOOL), attributes={"ours": "kept"}))
    run(tracer.start_span("s", attributes={"ours": "kept"}))
    finished = exporter.get_finished_spans()
    lean, sdk = (dict(s.attributes) for s in finished)
    assert lean == sdk  # the same values kept, converted and evicted (oldest first at the limit)
    assert len(lean) == 64 and lean["t69"] == 69
    assert finished[0].dropped_attributes == finished[1].dropped_attributes > 0
    provider.shutdown()


def test_trusted_attributes_set_together_keep_the_count_limit_like_one_by_one():
    provider, tracer, exporter = _provider(limits=SpanLimits(max_span_attributes=64))
    for name in ("one_by_one", "together"):
        span = lean_span.starter(tracer).start(name, SpanRecord(Kind.LLM_CALL), attributes={f"s{i}": i for i in range(60)})
        more = {f"m{i}": i for i in range(8)}  # past the limit: the oldest are evicted
        if name == "together":
            lean_span.set_trusted_many(span, more)
        else:
            for key, value in more.items():
                lean_span.set_trusted(span, key, value)
        span.end()
        lean_span.set_trusted_many(span, {"late": 1})  # ignored once ended
    one, together = exporter.get_finished_spans()
    assert dict(one.attributes) == dict(together.attributes) and len(together.attributes) == 64
    assert together.dropped_attributes == one.dropped_attributes == 4 and "late" not in together.attributes
    span = lean_span.starter(tracer).start("roomy", SpanRecord(Kind.LLM_CALL), attributes={"a": 1})
    lean_span.set_trusted_many(span, {"b": 2, "c": ("stop",)})
    assert dict(span.attributes) == {"a": 1, "b": 2, "c": ("stop",)} and span.dropped_attributes == 0
    span.end()
    provider.shutdown()


def test_attributes_are_a_read_only_view_that_follows_every_setter():
    provider, tracer, _ = _provider()
    span = lean_span.starter(tracer).start("s", SpanRecord(Kind.TOOL), attributes={"a": 1})
    view = span.attributes
    with pytest.raises(TypeError):
        view["a"] = 2  # read-only, as the SDK's ReadableSpan.attributes
    lean_span.set_trusted(span, "b", 2)
    assert dict(view) == {"a": 1, "b": 2} and span.attributes is view  # made once, live
    assert span.dropped_attributes == 0
    span.set_attribute("c", [1, 2])  # other code: the SDK's validated mapping from now on
    assert dict(span.attributes) == {"a": 1, "b": 2, "c": (1, 2)}
    span.end()
    provider.shutdown()


def test_limits_that_cut_values_or_a_non_sdk_tracer_get_the_tracers_own_spans():
    provider, tracer, _ = _provider(limits=SpanLimits(max_attribute_length=8))
    assert not lean_span.supports(tracer)
    span = start_span(tracer, "s", Kind.TOOL, None, attributes={"text": "0123456789abc"})
    assert not isinstance(span, lean_span.LeanSpan)
    span.end()
    assert not lean_span.supports(trace.NoOpTracer())
    assert not isinstance(start_span(trace.NoOpTracer(), "s", Kind.TOOL), lean_span.LeanSpan)
    provider.shutdown()


class DropChat(Sampler):
    """A sampler that decides by span name (it must be asked for every span)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        decision = Decision.DROP if name.startswith("chat") else Decision.RECORD_AND_SAMPLE
        return SamplingResult(decision, attributes)

    def get_description(self):
        return "DropChat"


@pytest.mark.parametrize("inner, parent_sampled, child_sampled", [
    (ParentBased(ALWAYS_ON), False, False),
    (ParentBased(ALWAYS_ON), True, True),
    (ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON), False, True),
    (TraceIdRatioBased(1.0), True, True),
    (TraceIdRatioBased(1.0), False, True),
    (DropChat(), True, False),
])
def test_sampling_decisions_match_the_sdk(inner, parent_sampled, child_sampled):
    """Lean spans under a remote parent (a carrier) and a local one get the SDK's flags
    and trace state, whether the sampler is asked or known to follow the parent."""
    sampler = record_dropped_samples(inner)
    assert sampler.follows_local_parent is not isinstance(inner, DropChat)
    assert sampler.follows_remote_parent is (isinstance(inner, ParentBased) and inner._remote_parent_not_sampled is ALWAYS_OFF)
    provider, tracer, _ = _provider(sampler=sampler)
    flags = []
    for make in (lambda name, ctx: lean_span.starter(tracer).start(name, SpanRecord(Kind.TOOL), context=ctx),
                 lambda name, ctx: tracer.start_span(name, context=ctx)):
        # a vendor's trace state goes on; a flag bit the SDK does not know does not
        parent = make("invoke_agent a", _remote_parent(parent_sampled, 0x80, TraceState([("vendor", "v1")])))
        child = make("chat m", trace.set_span_in_context(parent))
        assert child.is_recording()  # RecordDroppedSamples: dropped spans are still recorded
        assert child.get_span_context().trace_flags.sampled is child_sampled
        assert child.get_span_context().trace_id == parent.get_span_context().trace_id
        flags.append((parent.get_span_context().trace_flags, child.get_span_context().trace_flags,
                      parent.get_span_context().trace_state, child.get_span_context().trace_state))
        child.end()
        parent.end()
    assert flags[0] == flags[1]  # lean == SDK
    provider.shutdown()


@pytest.mark.parametrize("max_events, max_links", [(2, 1), (2, 3), (0, 0)])
def test_events_and_links_past_the_limits_are_kept_and_counted_as_the_sdk_does(max_events, max_links):
    provider, tracer, exporter = _provider(limits=SpanLimits(max_events=max_events, max_links=max_links))
    links = [Link(SpanContext(0x1, i, False, TraceFlags(1))) for i in (1, 2, 3)]
    links.insert(1, Link(SpanContext(0, 0, False, TraceFlags(0))))  # invalid: not a link at all

    def run(span):
        for i in range(3):
            span.add_event(f"e{i}")
        span.add_link(SpanContext(0x1, 4, False, TraceFlags(1)))
        span.add_link(SpanContext(0, 0, False, TraceFlags(0)))  # invalid
        span.end()

    run(lean_span.starter(tracer).start("s", SpanRecord(Kind.TOOL), links=links))
    run(tracer.start_span("s", links=links))
    lean, sdk = exporter.get_finished_spans()
    assert [e.name for e in lean.events] == [e.name for e in sdk.events] == ["e0", "e1", "e2"][3 - max_events:]
    assert [link.context.span_id for link in lean.links] == [link.context.span_id for link in sdk.links]
    assert [link.context.span_id for link in lean.links] == [1, 2, 3, 4][4 - max_links:]
    assert (lean.dropped_events, lean.dropped_links) == (sdk.dropped_events, sdk.dropped_links) == (
        3 - max_events, 4 - max_links)
    provider.shutdown()


def test_exceptions_become_events_and_ok_is_final():
    provider, tracer, exporter = _provider()
    span = lean_span.starter(tracer).start("s", SpanRecord(Kind.TOOL))
    try:
        raise ValueError("no")
    except ValueError as exc:
        span.record_exception(exc)
    span.set_status(trace.Status(StatusCode.OK))
    span.set_status(StatusCode.ERROR, "late")
    span.update_name("renamed")
    span.end()
    [got] = exporter.get_finished_spans()
    assert got.name == "renamed" and got.status.status_code is StatusCode.OK
    [event] = got.events
    assert event.name == "exception" and event.attributes["exception.type"] == "ValueError"
    assert "ValueError: no" in event.attributes["exception.stacktrace"]
    provider.shutdown()


# --------------------------------------------------------------------------- routing by kind


class Counting(SpanProcessor):
    def __init__(self, starts=None, ends=None) -> None:
        if starts is not None:
            self.on_start_kinds = starts
        if ends is not None:
            self.on_end_kinds = ends
        self.seen = []

    def on_start(self, span, parent_context=None):
        self.seen.append(("start", span.name))

    def on_end(self, span):
        self.seen.append(("end", span.name))


def test_processors_see_only_the_kinds_they_ask_for():
    only_trajectories = Counting(starts=frozenset(), ends=frozenset({Kind.TRAJECTORY}))
    everything = Counting()
    processor = IsolatingSpanProcessor()
    provider = TracerProvider(active_span_processor=processor)
    provider.add_span_processor(only_trajectories)
    provider.add_span_processor(everything)
    tracer = provider.get_tracer("otel_verl")
    traj = start_span(tracer, "traj", Kind.TRAJECTORY)
    start_span(tracer, "chat", Kind.LLM_CALL, context=trace.set_span_in_context(traj)).end()
    traj.end()
    tracer.start_span("foreign").end()  # no record: only processors that want every span
    assert only_trajectories.seen == [("end", "traj")]
    assert everything.seen == [("start", "traj"), ("start", "chat"), ("end", "chat"), ("end", "traj"),
                               ("start", "foreign"), ("end", "foreign")]
    provider.shutdown()


def test_a_sole_processor_of_every_ending_span_is_isolated_too(monkeypatch):
    """One processor that reads every ending span (a rollout worker's export process) is
    called without the per-span kind lookup; its exception is still counted, not raised."""
    from otel_verl import health

    monkeypatch.setattr(health, "_failures", health.Counter())

    class RaisingAtEnd(Counting):
        def on_end(self, span):
            super().on_end(span)
            raise RuntimeError("on_end")

    sole = RaisingAtEnd()
    processor = IsolatingSpanProcessor()
    provider = TracerProvider(active_span_processor=processor)
    provider.add_span_processor(sole)
    assert processor._sole_on_end is sole
    tracer = provider.get_tracer("otel_verl")
    start_span(tracer, "chat", Kind.LLM_CALL).end()
    tracer.start_span("foreign").end()
    assert sole.seen == [("start", "chat"), ("end", "chat"), ("start", "foreign"), ("end", "foreign")]
    assert health.snapshot()["failures"] == {"span_processor.RaisingAtEnd.on_end": 2}
    provider.add_span_processor(Counting(ends=frozenset({Kind.TRAJECTORY})))  # a second route: no sole one
    assert processor._sole_on_end is None
    provider.shutdown()


def test_a_sole_processor_of_starting_spans_gets_the_kinds_it_asks_for(monkeypatch):
    """One processor that reads starts of some kinds (a rollout worker's export process:
    the kinds its outputs write rows for) gets those, without the loop over routes; its
    exception is counted, not raised."""
    from otel_verl import health

    monkeypatch.setattr(health, "_failures", health.Counter())

    class RaisingAtStart(Counting):
        def on_start(self, span, parent_context=None):
            super().on_start(span, parent_context)
            raise RuntimeError("on_start")

    sole = RaisingAtStart(starts=frozenset({Kind.LLM_CALL}))
    processor = IsolatingSpanProcessor()
    provider = TracerProvider(active_span_processor=processor)
    provider.add_span_processor(sole)
    assert processor._sole_on_start is sole
    tracer = provider.get_tracer("otel_verl")
    start_span(tracer, "chat", Kind.LLM_CALL).end()
    start_span(tracer, "tool", Kind.TOOL).end()
    tracer.start_span("foreign").end()  # no record: not a kind it asked for
    assert sole.seen == [("start", "chat"), ("end", "chat"), ("end", "tool"), ("end", "foreign")]
    assert health.snapshot()["failures"] == {"span_processor.RaisingAtStart.on_start": 1}
    provider.add_span_processor(Counting(starts=frozenset({Kind.TOOL})))  # a second route: no sole one
    assert processor._sole_on_start is None
    provider.shutdown()


@pytest.mark.parametrize("direct", [True, False], ids=["default runtime context", "another runtime context"])
def test_the_current_span_is_read_and_set_as_the_api_does(direct, monkeypatch):
    """otel_verl.current_span on the default runtime context's ContextVar, or through the
    API for any other: what trace.get_current_span and attach / detach would give."""
    from otel_verl import current_span

    if not direct:
        monkeypatch.setattr(current_span, "_VAR", None)
    assert current_span._VAR is not None or not direct  # the SDK's default is the direct path
    outer, inner = (NonRecordingSpan(SpanContext(7, n, False)) for n in (1, 2))
    assert current_span.get() is trace.get_current_span() is trace.INVALID_SPAN
    token = otel_context.attach(otel_context.set_value("other key", "kept"))
    first = current_span.make_current(outer)
    second = current_span.make_current(inner)
    assert current_span.get() is trace.get_current_span() is inner
    assert otel_context.get_value("other key") == "kept"  # the rest of the context stays
    current_span.restore(second)
    assert current_span.get() is trace.get_current_span() is outer
    current_span.restore(first)
    otel_context.detach(token)
    assert current_span.get() is trace.INVALID_SPAN
    not_a_span = otel_context.attach(otel_context.set_value(trace._SPAN_KEY, "not a span"))
    assert current_span.get() is trace.get_current_span() is trace.INVALID_SPAN
    otel_context.detach(not_a_span)
    given = trace.set_span_in_context(inner)
    assert current_span.of(given) is trace.get_current_span(given) is inner
    assert current_span.of(otel_context.Context()) is trace.INVALID_SPAN
    assert current_span.of(None) is trace.get_current_span()
    # a key of our own set with the span (one context, one token), or alone
    key = current_span.create_key("otel_verl.test")
    with_key = current_span.make_current(outer, key, "value")
    assert current_span.get() is trace.get_current_span() is outer
    assert current_span.value(key) == otel_context.get_value(key) == "value"
    key_only = current_span.make_current(None, key, "other")
    assert current_span.get() is outer and current_span.value(key) == "other"
    current_span.restore(key_only)
    current_span.restore(with_key)
    assert current_span.value(key) is None and current_span.get() is trace.INVALID_SPAN


# --------------------------------------------------------------------------- hand-offs and caches


def test_text_jobs_and_render_jobs_share_the_writer(tmp_path):
    from otel_verl.exporters._writer import BackgroundWriter

    writer = BackgroundWriter("test")
    path = str(tmp_path / "out" / "f.log")
    assert writer.submit_text(path, "a\n", 1)
    assert writer.submit(lambda: [(path, "b\nc\n")], 2)
    assert writer.submit_text(path, "d\n", 1)
    assert writer.flush(10)
    assert open(path).read() == "a\nb\nc\nd\n"
    assert writer.written_lines == 4 and writer.dropped_lines == 0
    writer.close()
    assert not writer.submit_text(path, "e\n", 1) and writer.dropped_lines == 1


def test_carrier_contexts_are_parsed_once_per_header_pair():
    headers = {"traceparent": "00-0000000000000000000000000000abcd-00000000000000ef-01"}
    first = carriers.context_from(dict(headers))
    assert carriers.context_from(dict(headers)) is first
    ctx = trace.get_current_span(first).get_span_context()
    assert (ctx.trace_id, ctx.span_id, ctx.is_remote, ctx.trace_flags.sampled) == (0xABCD, 0xEF, True, True)
    with_state = carriers.context_from({**headers, "tracestate": "k=v"})
    assert with_state is not first
    assert trace.get_current_span(with_state).get_span_context().trace_state.get("k") == "v"
    assert carriers.context_from({"traceparent": "00-bad"}) is None
    assert carriers.context_from({**headers, "baggage": "a=b"}) is first  # the trace context is the pair
    assert isinstance(carriers.context_from(headers), otel_context.Context)


def test_a_spans_headers_are_what_the_w3c_propagator_injects():
    from opentelemetry.trace import INVALID_SPAN, TraceState
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    def injected(span):
        headers = {}
        TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
        return headers

    spans = [NonRecordingSpan(SpanContext(0xABCD, 0xEF, False, TraceFlags(flags), state))
             for flags in (0, 1, 3) for state in (None, TraceState([("k", "v"), ("vendor", "x1")]))]
    spans += [INVALID_SPAN, NonRecordingSpan(SpanContext(2**128 - 1, 2**64 - 1, True, TraceFlags(1)))]
    for span in spans:
        assert carriers.headers_of(span) == injected(span)
    assert carriers.headers_of(spans[3])["tracestate"] == "k=v,vendor=x1"


@pytest.mark.verl
def test_the_text_decoder_gives_what_tokenizer_decode_gives():
    import numpy as np
    from transformers import AutoTokenizer

    from otel_verl.demo.tiny_model import ensure_tiny_model
    from otel_verl.instrumentation._tokenizer import text_decoder

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    decode = text_decoder(tokenizer)
    assert decode is not tokenizer.decode and text_decoder(tokenizer) is decode  # chosen once
    ids = tokenizer.encode("Hello, world! 12 + 30 = 42", add_special_tokens=False)
    for sample in (ids, ids[:3], [], np.array(ids), tuple(ids)):
        for skip in (False, True):
            assert decode(sample, skip_special_tokens=skip) == tokenizer.decode(sample, skip_special_tokens=skip)
    assert text_decoder(None) is None

    tokenizer.clean_up_tokenization_spaces = True  # a clean-up to do: decode is used as it is
    tokenizer.__dict__.pop("_otel_verl_text_decoder", None)
    assert text_decoder(tokenizer) == tokenizer.decode


@pytest.mark.verl
def test_the_tokenizer_functions_reach_the_export_process_as_the_backend_alone(tmp_path):
    """Unpickled in a process without transformers (the export process), the decode and
    encode functions give what the tokenizer's own give, and load neither transformers
    nor torch."""
    import json
    import pickle
    import subprocess
    import sys

    import numpy as np
    from transformers import AutoTokenizer

    from otel_verl.demo.tiny_model import ensure_tiny_model
    from otel_verl.instrumentation._tokenizer import BackendEncode, text_decoder, text_encoder
    from otel_verl.offload import wire

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    encode = text_encoder(tokenizer)
    assert isinstance(encode, BackendEncode) and text_encoder(tokenizer) is encode  # chosen once
    texts = ["Hello, world! 12 + 30 = 42", "", "  spaced   out\n\ttabs", "w\u00f6rd \u6f22\u5b57 \U0001f600",
             f"{tokenizer.eos_token} inside {tokenizer.eos_token}"]
    assert encode(texts[0], add_special_tokens=False) == tokenizer.encode(texts[0], add_special_tokens=False)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    (tmp_path / "codec.pkl").write_bytes(wire.dumps_codec((text_decoder(tokenizer), encode)))
    probe = (
        "import json, pickle, sys\n"
        f"decode, encode = pickle.loads(open({str(tmp_path / 'codec.pkl')!r}, 'rb').read())\n"
        f"texts, ids = json.loads({json.dumps(json.dumps([texts, ids]))})\n"
        "out = {'encoded': [encode(t, add_special_tokens=False) for t in texts],\n"
        "       'decoded': [[decode(i, skip_special_tokens=s) for s in (False, True)] for i in ids],\n"
        "       'loaded': sorted(m for m in ('transformers', 'torch') if m in sys.modules)}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["loaded"] == []
    assert out["encoded"] == ids
    assert out["decoded"] == [[tokenizer.decode(i, skip_special_tokens=s) for s in (False, True)] for i in ids]
    backend_only = pickle.loads(pickle.dumps(text_decoder(tokenizer)))
    assert backend_only(np.array(ids[0])) == tokenizer.decode(ids[0])  # not only plain lists


def test_a_scope_that_fails_before_its_end_still_ends_the_span(make_pipeline, monkeypatch):
    from otel_verl import events, health
    from otel_verl.events import worker

    pipeline = make_pipeline()

    def broken(self, error):
        raise RuntimeError("bookkeeping failed")

    monkeypatch.setattr(worker._TrajectoryScope, "_ending", broken)
    with events.trajectory("u1", "0", step=1, agent_name="a"):
        pass
    assert [s.name for s in pipeline.spans()] == ["invoke_agent a"]
    assert "events.span_ending" in str(health.snapshot()["failures"])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_gets_fresh_locks_for_span_ends_and_carrier_arrivals():
    """A lock another thread held at fork time is never released in the child: the child
    must not take the parent's (it would hang on its first span end / carrier lookup)."""
    import os
    import signal

    provider, tracer, _ = _provider()
    with lean_span._END_LOCK, carriers._arrived_lock:  # held (by this thread) at fork time
        pid = os.fork()
        if pid == 0:  # child: must not block; leave without pytest's teardown
            signal.alarm(10)
            code = 1
            try:
                span = lean_span.starter(tracer).start("s", SpanRecord(Kind.TOOL), attributes={})
                span.end()
                carriers.take_arrived("u")
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    provider.shutdown()


def test_a_tracer_keeps_its_starter_and_nothing_keeps_the_tracer():
    """One Starter per tracer, kept on the tracer: a provider nobody uses any more is
    freed (a cache keyed by tracer would hold every tracer through its starter)."""
    import gc
    import weakref

    provider, tracer, _ = _provider()
    made = lean_span.starter(tracer)
    assert made is not None and lean_span.starter(tracer) is made
    assert lean_span.starter(provider.get_tracer("another")) is not made
    provider.shutdown()
    gone = weakref.ref(tracer)
    del tracer, made, provider
    gc.collect()
    assert gone() is None


def test_a_disabled_tracer_starts_no_lean_span_until_enabled_again():
    """The SDK's tracer config (replaced when a provider is reconfigured) is followed by
    every start, as ``tracer.start_span`` does."""
    from opentelemetry.sdk.trace import _TracerConfig

    _, tracer, exporter = _provider()
    start = lean_span.starter(tracer).start
    tracer._set_tracer_config(_TracerConfig(is_enabled=False))
    off = start("s", SpanRecord(Kind.TOOL), context=_remote_parent())
    assert type(off) is NonRecordingSpan and not off.is_recording()
    assert off.get_span_context().span_id == 0xDEF  # the parent's, as the SDK gives it
    tracer._set_tracer_config(_TracerConfig(is_enabled=True))
    on = start("s", SpanRecord(Kind.TOOL))
    assert type(on) is lean_span.LeanSpan
    on.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["s"]
