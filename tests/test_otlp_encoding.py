"""otel_verl's OTLP encoders against the SDK's: the same bytes for every span they write.

Differential: randomized SDK ``ReadableSpan``s (seeded, several hundred a run, every
field the encoding has) are converted with ``from_readable``; our protobuf bytes must equal
``encode_spans([r.to_readable() ...]).SerializeToString()`` of the installed SDK, our JSON
the SDK's encoding through ``MessageToDict`` (hex ids). Then what the SDK would refuse or
write differently: lone surrogates (repaired, counted, compared against the SDK on the
repaired text), values only the SDK's encoder writes (the batch goes through it), batches
cut into requests, and the caches' bounds.
"""

from __future__ import annotations

import json
import math
import random
from importlib.metadata import version
from typing import Any, Callable, Dict, List

import pytest
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otel_verl import health
from otel_verl.accelerated import otlp_encoding
from otel_verl.accelerated.otlp_encoding import (
    JsonEncoder,
    ProtobufEncoder,
    encode_json,
    encode_request,
    records_of,
    repair_text,
    size_bound,
    well_formed_record,
)
from otel_verl.exporters.otlp_json_file import resource_spans_via_sdk
from otel_verl.record import SpanRecord

SDK_ENCODES_SCOPES = tuple(int(part) for part in version("opentelemetry-sdk").split(".")[:2]) >= (1, 31)
SEEDS = range(40)  # ~15 spans a batch: ~600 spans a run
INT64 = 1 << 63

PIECES = ["a", "Z", "0", "verl.", " ", "_", "\"", "\\", "/", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "世界", "😀",
          "\u2028", "\ufffd"]


# --------------------------------------------------------------------------- random spans


class Gen:
    """Random span data. ``surrogates``: some texts carry a lone surrogate; ``fix`` is
    applied to every text when building (identity, or the repair the encoder does)."""

    def __init__(self, seed: int, surrogates: bool = False) -> None:
        self.rng = random.Random(seed)
        self.surrogates = surrogates

    def text(self, long: bool = True) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:
            return ""
        if long and roll > 0.97:
            length = rng.choice([126, 127, 128, 200, 20000])  # the varint length boundaries
        else:
            length = rng.randint(1, 20)
        out = "".join(rng.choice(PIECES) for _ in range(length))
        if self.surrogates and rng.random() < 0.3:
            at = rng.randint(0, len(out))
            out = out[:at] + rng.choice(["\ud800", "\udfff", "\ud83d"]) + out[at:]
        return out

    def key(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:  # keys repeat across spans, as the semantic conventions'
            return rng.choice(["verl.uid", "gen_ai.request.model", "k", "é", "verl.global_step", "x" * 130])
        return self.text(long=False) or "k"

    def scalar(self, kind: str) -> Any:
        rng = self.rng
        if kind == "str":
            return self.text()
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "int":
            return rng.choice([0, 1, 127, 128, 16383, 16384, -1, -128, INT64 - 1, -INT64,
                               rng.randint(-INT64, INT64 - 1), rng.randint(0, 1 << 20)])
        if kind == "float":
            return rng.choice([0.0, -0.0, 1.0, 0.5, math.nan, math.inf, -math.inf, 1e300, 5e-324, 1.7e9,
                               rng.uniform(-1e6, 1e6)])
        return bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 20)))

    def value(self, depth: int = 0, cleaned: bool = False) -> Any:
        """An attribute value; ``cleaned``: what the SDK's attribute cleaning keeps on
        every version (primitives, homogeneous tuples)."""
        rng = self.rng
        kinds = ["str", "bool", "int", "float"] + ([] if cleaned else ["bytes"])
        roll = rng.random()
        if roll < 0.6 or depth >= 2:
            return self.scalar(rng.choice(kinds))
        if roll < 0.85 or cleaned:
            kind = rng.choice(kinds)
            values = [self.scalar(kind) for _ in range(rng.choice([0, 1, 2, 5]))]
            return tuple(values) if cleaned or rng.random() < 0.5 else values
        if roll < 0.93:  # heterogeneous and nested arrays, as raw spans may carry
            values = [self.value(depth + 1) for _ in range(rng.randint(0, 3))]
            return tuple(values) if rng.random() < 0.5 else values
        return {rng.choice([self.key(), "", 3, 4.5]): self.value(depth + 1) for _ in range(rng.randint(0, 3))}

    def attributes(self, cleaned: bool = False) -> Dict[str, Any]:
        out = {}
        for _ in range(self.rng.choice([0, 1, 3, 12])):
            key = self.key()
            if not cleaned and self.rng.random() < 0.03:
                key = ""  # an empty key: the SDK writes no key field
            out[key] = self.value(cleaned=cleaned)
        return out

    def maybe_bounded(self, fix: Callable) -> Any:
        """Attributes, some over a limit: the SDK's container with its dropped count."""
        if self.rng.random() < 0.2:
            raw = fix(self.attributes(cleaned=True))
            bounded = BoundedAttributes(attributes={k: v for k, v in raw.items() if k}, immutable=True)
            bounded.dropped = self.rng.randint(1, 300)  # as a span limit leaves it
            return bounded
        return fix(self.attributes())

    def trace_state(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return None
        if roll < 0.7:
            return TraceState()
        return TraceState([(f"k{i}", rng.choice(["v", "1.2", "a-b_c"])) for i in range(rng.randint(1, 3))]
                          + ([("vendor@tenant", "x")] if rng.random() < 0.3 else []))

    def context(self, trace_id: int = 0) -> SpanContext:
        rng = self.rng
        return SpanContext(trace_id or rng.randint(1, (1 << 128) - 1), rng.randint(1, (1 << 64) - 1),
                           is_remote=rng.random() < 0.5, trace_flags=TraceFlags(rng.choice([0, 1])),
                           trace_state=self.trace_state())

    def span(self, pools: "Pools", fix: Callable) -> ReadableSpan:
        rng = self.rng
        context = self.context()
        context = SpanContext(context.trace_id, context.span_id, False, context.trace_flags, context.trace_state)
        parent = None if rng.random() < 0.3 else SpanContext(context.trace_id, rng.randint(1, (1 << 64) - 1),
                                                             rng.random() < 0.5)
        events = [Event(fix(self.text()), self.maybe_bounded(fix), rng.choice([0, rng.randint(1, 1 << 62)]))
                  for _ in range(rng.choice([0, 0, 1, 3]))]
        links = [Link(self.context(), self.maybe_bounded(fix)) for _ in range(rng.choice([0, 0, 1, 2]))]
        code = rng.choice(list(StatusCode))
        description = fix(self.text()) if code is StatusCode.ERROR and rng.random() < 0.7 else None
        return ReadableSpan(
            name=fix(self.text()), context=context, parent=parent, resource=rng.choice(pools.resources),
            attributes=self.maybe_bounded(fix), events=_dropping(events, rng.choice([0, 0, 2])),
            links=_dropping(links, rng.choice([0, 0, 1])), kind=rng.choice(list(SpanKind)),
            status=Status(code, description), instrumentation_scope=rng.choice(pools.scopes),
            start_time=rng.choice([None, 0, rng.randint(1, 1 << 63)]),
            end_time=rng.choice([None, 0, rng.randint(1, 1 << 63)]),
        )


def _dropping(items: List[Any], dropped: int) -> Any:
    if not dropped:
        return items
    bounded = BoundedList.from_seq(None, items)
    bounded.dropped = dropped
    return bounded


class Pools:
    """Resources and scopes the spans of a batch choose from: several, some equal in
    value but distinct objects (the SDK groups those together)."""

    def __init__(self, fix: Callable = lambda text: text, scope_details: bool = True,
                 surrogates: bool = False) -> None:
        odd = fix("verl é \ud800" if surrogates else "verl é")
        self.resources = [
            Resource({"service.name": "verl-trainer", "verl.role": "trainer", "process.pid": 7, "ok": True}),
            Resource({"service.name": "verl-trainer", "verl.role": "trainer", "process.pid": 7, "ok": True}),
            Resource({"verl.role": "trainer", "service.name": "verl-trainer", "ok": True, "process.pid": 7}),
            Resource({"service.name": odd, "ratio": 0.5, "ids": (1, 2)}, schema_url="https://opentelemetry.io/s/1"),
            Resource({}),
        ]
        self.scopes = [
            None,
            InstrumentationScope("otel_verl", "0.1.0"),
            InstrumentationScope("otel_verl", "0.1.0"),
            InstrumentationScope("other.scope"),
            InstrumentationScope("", None),
        ]
        if scope_details:
            self.scopes += [
                InstrumentationScope("scoped", "1.0", "https://opentelemetry.io/schemas/1.21.0",
                                     {"scope.attr": odd, "n": 2}),
                InstrumentationScope("scoped", "1.0", "https://opentelemetry.io/schemas/1.21.0", {"scope.attr": "y"}),
            ]


def batch(seed: int, *, surrogates: bool = False, scope_details: bool = True):
    """``(spans as built, the same spans with their texts repaired)``."""
    out = []
    for fix in (lambda value: value, _repaired):
        gen = Gen(seed, surrogates)
        pools = Pools(fix, scope_details, surrogates)
        out.append([gen.span(pools, fix) for _ in range(gen.rng.randint(1, 30))])
    return out


def _repaired(value: Any) -> Any:
    """``value`` with every text in it repaired (a deep copy of containers)."""
    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, tuple):
        return tuple(_repaired(v) for v in value)
    if isinstance(value, list):
        return [_repaired(v) for v in value]
    if isinstance(value, dict):
        return {_repaired(k): _repaired(v) for k, v in value.items()}
    return value


def sdk_bytes(records: List[SpanRecord]) -> bytes:
    return encode_spans([record.to_readable() for record in records]).SerializeToString()


def sdk_json(records: List[SpanRecord]) -> bytes:
    traces = resource_spans_via_sdk([record.to_readable() for record in records])
    return json.dumps(traces, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def span_messages(data: bytes) -> List[Any]:
    request = ExportTraceServiceRequest.FromString(data)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


# --------------------------------------------------------------------------- differential


@pytest.fixture(scope="module")
def protobuf_encoder():
    return ProtobufEncoder()  # one for every batch: warm caches must write what cold ones do


@pytest.mark.parametrize("seed", SEEDS)
def test_protobuf_bytes_equal_the_sdk_encoders(seed, protobuf_encoder):
    spans, _ = batch(seed)
    records = records_of(spans)
    expected = sdk_bytes(records)
    assert protobuf_encoder.encode(records) == expected
    assert encode_request(records) == expected  # a cold encoder too
    assert protobuf_encoder.sdk_batches == 0  # written by us, not handed to the SDK
    assert health.snapshot()["failures"] == {}


@pytest.mark.parametrize("seed", SEEDS)
def test_json_equals_the_sdk_encoding_through_message_to_dict(seed):
    # the 1.30 SDK leaves scope attributes out; our JSON (the Collector's file format) keeps them
    spans, _ = batch(seed, scope_details=SDK_ENCODES_SCOPES)
    records = records_of(spans)
    encoder = JsonEncoder()
    expected = sdk_json(records)
    assert encoder.encode(records) == expected
    assert encoder.encode(records) == expected  # again, from the caches
    assert health.snapshot()["failures"] == {}


def test_the_random_batches_cover_what_the_encoding_has():
    """The differential is only as good as its inputs: every field and kind shows up."""
    seen: Dict[str, int] = {}

    def saw(what: str, yes: Any = True) -> None:
        if yes:
            seen[what] = seen.get(what, 0) + 1

    def walk(value: Any) -> None:
        saw(type(value).__name__)
        if isinstance(value, (list, tuple)):
            saw("empty sequence", not value)
            for v in value:
                walk(v)
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        if isinstance(value, str):
            saw("non-ASCII", not value.isascii())
            saw("long text", len(value.encode("utf-8", "surrogatepass")) >= 128)
        if isinstance(value, float):
            saw("nan", math.isnan(value))
        if isinstance(value, int) and not isinstance(value, bool):
            saw("negative int", value < 0)

    total = 0
    for seed in SEEDS:
        spans, _ = batch(seed)
        total += len(spans)
        saw("resources", len({id(s.resource) for s in spans}) > 1)
        saw("scopes", len({id(s.instrumentation_scope) for s in spans}) > 1)
        for span in spans:
            saw(f"kind {span.kind.name}")
            saw(f"status {span.status.status_code.name}")
            saw("status message", span.status.description)
            saw("trace state", span.context.trace_state)
            saw("remote parent", span.parent is not None and span.parent.is_remote)
            saw("local parent", span.parent is not None and not span.parent.is_remote)
            saw("root", span.parent is None)
            saw("dropped attributes", span.dropped_attributes)
            saw("dropped events", span.dropped_events)
            saw("dropped links", span.dropped_links)
            saw("no start time", not span.start_time)
            for event in span.events:
                saw("event")
                saw("event dropped attributes", event.dropped_attributes)
            for link in span.links:
                saw("link")
                saw("remote link", link.context.is_remote)
                saw("link dropped attributes", link.dropped_attributes)
            for key, value in (span.attributes or {}).items():
                saw("empty key", key == "")
                walk(value)
    assert total >= 300
    wanted = {"resources", "scopes", "status message", "trace state", "remote parent", "local parent", "root",
              "dropped attributes", "dropped events", "dropped links", "no start time", "event",
              "event dropped attributes", "link", "remote link", "link dropped attributes", "empty key",
              "str", "bool", "int", "float", "bytes", "list", "tuple", "dict", "empty sequence", "non-ASCII",
              "long text", "nan", "negative int"}
    wanted |= {f"kind {kind.name}" for kind in SpanKind} | {f"status {code.name}" for code in StatusCode}
    assert wanted <= set(seen), wanted - set(seen)


# --------------------------------------------------------------------------- repaired text


@pytest.mark.parametrize("seed", range(10))
def test_lone_surrogates_are_written_as_u_fffd_and_counted(seed):
    spans, repaired = batch(seed, surrogates=True, scope_details=SDK_ENCODES_SCOPES)
    records = records_of(spans)
    assert ProtobufEncoder().encode(records) == sdk_bytes(records_of(repaired))
    assert JsonEncoder().encode(records) == sdk_json(records_of(repaired))


def test_each_repaired_text_is_counted_once_per_batch_written():
    record = SpanRecord("chat \ud800", 1, 2, start_time=1, end_time=2, resource=Resource({}),
                        attributes={"k\udfff": "v", "ok": "a\ud83d b", "list": ("\ud800",)})
    fixed = SpanRecord("chat \ufffd", 1, 2, start_time=1, end_time=2, resource=Resource({}),
                       attributes={"k\ufffd": "v", "ok": "a\ufffd b", "list": ("\ufffd",)})
    encoder = ProtobufEncoder()
    assert encoder.encode([record]) == sdk_bytes([fixed])
    assert health.snapshot()["failures"] == {"otlp.lone_surrogate": 4}
    assert encoder.encode([record, record]) == sdk_bytes([fixed, fixed])
    assert health.snapshot()["failures"] == {"otlp.lone_surrogate": 12}  # repaired texts are never cached
    assert JsonEncoder("otlp_json_file").encode([record]) == sdk_json([fixed])
    assert health.snapshot()["failures"] == {"otlp.lone_surrogate": 12, "otlp_json_file.lone_surrogate": 4}


# --------------------------------------------------------------------------- the SDK's encoder for the rest


@pytest.mark.parametrize("odd", [object(), None, 1 << 64, -INT64 - 1, ("a", None), {"m": object()}],
                         ids=["object", "None", "uint64", "below-int64", "None-in-array", "object-in-map"])
def test_a_value_we_do_not_write_sends_the_batch_through_the_sdk_encoder(odd):
    spans, _ = batch(3)
    records = records_of(spans)
    records[0].attributes["odd"] = odd
    encoder = ProtobufEncoder()
    assert encoder.encode(records) == sdk_bytes(records)  # the SDK writes or skips it, as it does
    assert encoder.sdk_batches == 1
    assert len(span_messages(encoder.encode(records))) == len(records)  # nothing dropped


def test_text_is_repaired_for_the_sdk_encoder_too():
    record = SpanRecord("chat \ud800", 1, 2, resource=Resource({"r": "\udfff"}), attributes={"a": "x\ud83d", "odd": None},
                        scope=InstrumentationScope("s\ud800"), status_code=StatusCode.ERROR, status_message="\ud800")
    fixed = SpanRecord("chat \ufffd", 1, 2, resource=Resource({"r": "\ufffd"}), attributes={"a": "x\ufffd", "odd": None},
                       scope=InstrumentationScope("s\ufffd"), status_code=StatusCode.ERROR, status_message="\ufffd")
    encoder = ProtobufEncoder()
    assert encoder.encode([record]) == sdk_bytes([fixed]) and encoder.sdk_batches == 1


def test_json_leaves_out_an_attribute_it_cannot_write_and_counts_it():
    record = SpanRecord("s", 1, 2, resource=Resource({}), attributes={"a": 1, "obj": object(), "big": 1 << 70})
    assert json.loads(encode_json([record]))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] == [
        {"key": "a", "value": {"intValue": "1"}}]
    assert health.snapshot()["failures"] == {"otlp.attribute": 2}


def test_tuples_holding_lists_and_maps_are_written_by_us():
    record = SpanRecord("s", 1, 2, resource=Resource({}),
                        attributes={"nested": ({"a": (1, "x")}, [2.5, b"\x00"], ("y",)), "strs": ("a", "b")})
    encoder = ProtobufEncoder()
    for _ in range(2):  # the second time from the caches
        assert encoder.encode([record]) == sdk_bytes([record])
        assert JsonEncoder().encode([record]) == sdk_json([record])
    assert encoder.sdk_batches == 0 and health.snapshot()["failures"] == {}


def test_a_non_str_attribute_key_goes_through_the_sdk_encoder():
    record = SpanRecord("s", 1, 2, resource=Resource({}), attributes={"a": 1, 5: "x"})
    encoder = ProtobufEncoder()
    assert encoder.encode([record]) == sdk_bytes([record])
    assert encoder.sdk_batches == 1


# --------------------------------------------------------------------------- requests under a size


@pytest.mark.parametrize("seed", range(12))
def test_a_batch_cut_into_requests_keeps_order_and_the_bound(seed):
    spans, _ = batch(seed, scope_details=SDK_ENCODES_SCOPES)
    records = records_of(spans) * 3  # several groups, again and again
    bound = 3000
    for encoder, reference in ((ProtobufEncoder(), sdk_bytes), (JsonEncoder(), sdk_json)):
        requests = list(encoder.requests(records, bound))
        assert sum(count for _, count in requests) == len(records)
        start = 0
        for body, count in requests:
            assert body == reference(records[start:start + count])  # each request encodes its spans
            assert len(body) <= bound or count == 1
            if start + count < len(records):  # full: with the next span it would pass the bound
                assert len(reference(records[start:start + count + 1])) > bound - 64
            start += count


@pytest.mark.parametrize("seed", range(10))
def test_the_size_bound_of_the_sdk_encoder_fallback_bounds_each_span(seed):
    for record in records_of(batch(seed, surrogates=True)[0]):
        (span,) = span_messages(sdk_bytes([well_formed_record(record)]))
        assert span.ByteSize() + 6 <= size_bound(record), record.name  # with its own tag and length
    big = SpanRecord("chat", 1, 2, attributes={"gen_ai.input.messages": "w\u00f6rd " * 1600})
    (span,) = span_messages(sdk_bytes([big]))
    assert size_bound(big) <= 1.02 * span.ByteSize()  # close where it matters


def test_requests_are_full_not_a_span_each():
    records = records_of(batch(5)[0]) * 20
    whole = len(ProtobufEncoder().encode(records))
    requests = list(ProtobufEncoder().requests(records, whole // 4))
    assert 4 <= len(requests) <= 6


def test_the_sdk_encoder_fallback_cuts_requests_too():
    records = records_of(batch(7)[0]) * 10
    records[0].attributes["odd"] = object()
    bound = 4000
    requests = list(ProtobufEncoder().requests(records, bound))
    assert sum(count for _, count in requests) == len(records) and len(requests) > 1
    start = 0
    for body, count in requests:
        assert body == sdk_bytes(records[start:start + count])
        assert len(body) <= bound or count == 1
        start += count


# --------------------------------------------------------------------------- caches


def test_caches_stay_bounded_and_write_the_same_bytes(monkeypatch):
    bounds = {"MAX_CACHED_KEYS": 8, "MAX_CACHED_NAMES": 4, "MAX_CACHED_VALUES": 4, "MAX_CACHED_INTS": 16,
              "MAX_CACHED_RESOURCES": 2, "MAX_CACHED_SCOPES": 2}
    for name, bound in bounds.items():
        monkeypatch.setattr(otlp_encoding, name, bound)
    encoder, json_encoder = ProtobufEncoder(), JsonEncoder()
    for seed in range(8):
        records = records_of(batch(seed, scope_details=SDK_ENCODES_SCOPES)[0])
        for i, record in enumerate(records):
            record.attributes.update({f"key{seed}.{i}.{j}": f"value{j}" for j in range(20)})
            record.attributes.update({f"int{j}": seed * 1000 + j for j in range(20)})
        assert encoder.encode(records) == sdk_bytes(records)
        assert json_encoder.encode(records) == sdk_json(records)
    for sizes in (encoder.cache_sizes(), json_encoder.cache_sizes()):
        assert sizes["keys"] <= 8 and sizes["resources"] <= 2 and sizes["scopes"] <= 2
        assert sizes["names"] <= 4 and sizes["ints"] <= 16
        assert sizes["values per key"] <= 4


def test_a_resource_object_that_died_does_not_lend_its_bytes_to_a_new_one():
    encoder = ProtobufEncoder()
    for i in range(200):  # new objects, often at the address of the last one
        record = SpanRecord("s", 1, 2, resource=Resource({"i": i}), scope=InstrumentationScope(f"scope{i}"))
        assert encoder.encode([record]) == sdk_bytes([record])


def test_records_from_readable_spans_and_records_encode_alike():
    spans, _ = batch(11)
    records = records_of(spans)
    assert encode_request(records) == encode_spans(spans).SerializeToString()
    assert all(a is b for a, b in zip(records_of(records), records))  # records are taken as they are


def test_an_empty_batch():
    assert encode_request([]) == encode_spans([]).SerializeToString() == b""
    assert json.loads(encode_json([])) == {"resourceSpans": []}
