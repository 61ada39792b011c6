"""W3C context inside the data verl passes: headers, contexts, pickling, the carriers'
places (dict keys, kwargs, request ids)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from otel_verl import carriers

TRACE_ID, SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331


def _span(flags: int = TraceFlags.SAMPLED, state: TraceState = None) -> NonRecordingSpan:
    return NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, False, TraceFlags(flags), state))


def test_headers_are_the_w3c_traceparent_and_tracestate():
    headers = carriers.headers_of(_span(state=TraceState([("vendor", "x")])))
    assert headers == {"traceparent": f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01", "tracestate": "vendor=x"}
    assert carriers.headers_of(trace.INVALID_SPAN) == {}


def test_every_carrier_form_gives_the_same_remote_parent():
    headers = carriers.headers_of(_span())
    forms = [carriers.TraceCarrier(headers), headers, headers["traceparent"]]
    for form in forms:
        parent = trace.get_current_span(carriers.context_from(form)).get_span_context()
        assert (parent.trace_id, parent.span_id, parent.is_remote, parent.trace_flags.sampled) == (
            TRACE_ID, SPAN_ID, True, True)
    assert carriers.context_from({"traceparent": "garbage"}) is None
    assert carriers.context_from(42) is None


def test_a_carrier_pickles_with_its_row_and_is_kept_for_its_uid_where_it_arrives():
    carrier = carriers.TraceCarrier.from_span(_span()).with_row({"uid": "u-7", "traj_uid": "3"})
    back = pickle.loads(pickle.dumps(carrier))
    assert back == carrier and back.row == {"uid": "u-7", "traj_uid": "3"}
    assert carriers.take_arrived("u-7") == carrier
    assert carriers.take_arrived("u-7") is None  # taken once


def test_a_carrier_is_found_by_a_long_uid_as_the_sender_named_it_cut():
    """The trainer names a row's uid as the events API writes it (``id_str``: an id over
    256 characters cut); the worker asks by the uid verl hands it."""
    from otel_verl.ids import id_str

    uid = "p" * 1000
    carrier = carriers.TraceCarrier.from_span(_span()).with_row({"uid": id_str(uid)})
    assert pickle.loads(pickle.dumps(carrier)) == carrier
    assert carriers.take_arrived(uid) == carrier


def test_a_carrier_names_the_run_that_sent_it_and_an_older_one_names_none(monkeypatch):
    monkeypatch.setenv("OTEL_VERL_RUN_ID", "run-1")
    carrier = carriers.TraceCarrier.from_span(_span())
    assert carrier.run_id == "run-1" and carrier.with_row({"uid": "u-1"}).run_id == "run-1"
    older = carriers.restore(carrier.headers, {"VERL_TRACE_DIR": "/t", "OTEL_VERL_RUN_ID": "run-1"})
    assert older.run_id is None and older.headers == carrier.headers


def test_unpickling_a_carrier_imports_no_configurator():
    # pickled by a process that only instruments (otel_verl.activation never imported there)
    made = "import pickle, sys; from otel_verl import carriers; sys.stdout.buffer.write(pickle.dumps(" \
           f"carriers.TraceCarrier({carriers.headers_of(_span())!r})))"
    data = subprocess.run([sys.executable, "-c", made], capture_output=True, check=True).stdout
    code = textwrap.dedent(f"""
        import pickle, sys
        carrier = pickle.loads({data!r})
        assert carrier.headers["traceparent"].startswith("00-")
        print(sorted(m for m in sys.modules if m in ("otel_verl.activation", "otel_verl.bootstrap")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dict_and_kwargs_carriers_are_removed_before_verl_sees_the_data():
    carrier = carriers.TraceCarrier(carriers.headers_of(_span()))
    original = {"temperature": 1.0}
    with_carrier = carriers.inject_dict(original, carrier)
    assert original == {"temperature": 1.0}  # never modified: callers reuse it
    assert carriers.pop_dict(with_carrier) is carrier and with_carrier == original
    kwargs = {carriers.COLUMN: carrier, "raw_prompt": "hi"}
    assert carriers.pop_kwargs(kwargs) is carrier and kwargs == {"raw_prompt": "hi"}


def test_a_request_id_carries_the_turn_and_gives_it_back():
    headers = carriers.headers_of(_span())
    tagged = carriers.tag_request_id("req-1", headers)
    assert tagged != "req-1" and carriers.tag_request_id(tagged, headers) == tagged  # tagged once
    assert carriers.untag_request_id(tagged) == ("req-1", {"traceparent": headers["traceparent"]})
    assert carriers.untag_request_id("req-2") == ("req-2", None)
