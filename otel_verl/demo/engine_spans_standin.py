"""Stand-in for sglang's and vLLM's own request spans (the engines' tracing, on CPU).

Real engines trace a request themselves when their tracing is switched on, under the
W3C context the caller hands them: sglang under ``GenerateReqInput.external_trace_header``
(server args ``enable_trace``, ``otlp_traces_endpoint``), vLLM under ``AsyncLLM.generate``'s
``trace_headers`` (engine arg ``otlp_traces_endpoint``). Neither engine runs on a CPU-only
machine, so this module emits spans shaped as theirs are, from the stand-in engines'
timings, to an OTLP endpoint, with the engine's own resource (built as the engines build
it: ``Resource.create``, which adds ``OTEL_RESOURCE_ATTRIBUTES``, where the Ray runtime env
puts ``verl.run_id``). Shapes as the engines' sources write them (sglang
0.5.12 ``sglang/srt/observability/trace.py`` and ``req_time_stats.py``; vLLM 0.24.0
``vllm/tracing/otel.py`` and ``vllm/v1/engine/output_processor.py``):

sglang (service.name ``sglang``, tracer ``sglang server``), one request, unified mode::

    " Req {rid[:8]}"                          rid, module=sglang::request, gen_ai.* at finish
    ├─ "Tokenizer(host:{id8} | pid:{pid})"    host_id, pid, thread_label
    │  ├─ tokenize
    │  └─ api_server_dispatch                 (links to the previous slice)
    └─ "Scheduler [TP 0]  [PP 0] (host:{id8} | pid:{pid})"   tp_rank, pp_rank, ...
       ├─ request_process                     (each slice links to the one before it)
       ├─ prefill_waiting
       ├─ prefill_forward
       └─ decode_forward
          └─ decode_loop x n                  decode_ct (one per decode step; at most
                                              MAX_DECODE_LOOP_SPANS here)

vLLM (resource ``vllm.instrumenting_module_name=vllm.llm_engine``, ``vllm.process_id``;
service.name from ``OTEL_SERVICE_NAME``, else the SDK's ``unknown_service:<executable>``; tracer
``vllm.tracing.otel``): one SERVER span ``llm_request`` from arrival to the end of the
request, with ``gen_ai.latency.*``, ``gen_ai.usage.prompt_tokens`` /
``completion_tokens``, ``gen_ai.request.*``.

Unlike the engines, which install their TracerProvider as the process's global one, each
stand-in tracer has a provider of its own, so it never changes the tracing of the process
that hosts it. Spans leave as each ends (a SimpleSpanProcessor, where sglang batches
them every 500 ms): the demo's server actors are killed at the end of a run, before a
last batch would go out.

:class:`TracingTokenizerManagerStandIn` is the sglang engine front-end of the demo with
these spans; :func:`tokenizer_manager_for` picks it when the rollout config says
``engine_kwargs.sglang.enable_trace``. :class:`AsyncLLMStandIn` stands for vLLM's
``AsyncLLM`` (its ``generate`` signature, ``trace_headers`` included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import types
import uuid
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_verl.demo.llm_server_standin import TokenizerManagerStandIn, _cfg, _field

SGLANG_SERVICE_NAME = "sglang"  # process_tracing_init(endpoint, "sglang")
SGLANG_TRACER_NAME = "sglang server"
SGLANG_DEFAULT_ENDPOINT = "localhost:4317"  # ServerArgs.otlp_traces_endpoint
VLLM_INSTRUMENTING_MODULE = "vllm.llm_engine"  # init_tracer("vllm.llm_engine", endpoint)
VLLM_TRACER_NAME = "vllm.tracing.otel"  # manual_instrument_otel: trace.get_tracer(__name__)
VLLM_REQUEST_SPAN = "llm_request"
MAX_DECODE_LOOP_SPANS = 8  # sglang writes one per decode step; a stand-in needs only a few

_propagator = TraceContextTextMapPropagator()
logger = logging.getLogger(__name__)


def _otlp_exporter(endpoint: str) -> SpanExporter:
    """The exporter both engines build: gRPC (insecure) unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    says ``http/protobuf``."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "grpc":
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (grpc or http/protobuf)")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, insecure=True)


class EngineTracerStandIn:
    """A tracer with an engine's resource, exporting to ``endpoint`` (or to ``exporter``)."""

    def __init__(self, resource: Resource, tracer_name: str, *, endpoint: Optional[str] = None,
                 exporter: Optional[SpanExporter] = None) -> None:
        if exporter is None and not endpoint:
            raise ValueError("an engine tracer needs an OTLP endpoint or an exporter")
        self.provider = TracerProvider(resource=resource)
        # sent as each span ends: the demo's server actors are killed when the run ends,
        # before a batch processor's last batch would go out
        self.provider.add_span_processor(SimpleSpanProcessor(exporter or _otlp_exporter(str(endpoint))))
        self.tracer = self.provider.get_tracer(tracer_name)

    @classmethod
    def sglang(cls, endpoint: Optional[str] = None, *, exporter: Optional[SpanExporter] = None) -> "EngineTracerStandIn":
        return cls(Resource.create({SERVICE_NAME: SGLANG_SERVICE_NAME}), SGLANG_TRACER_NAME,
                   endpoint=endpoint or SGLANG_DEFAULT_ENDPOINT, exporter=exporter)

    @classmethod
    def vllm(cls, endpoint: Optional[str] = None, *, exporter: Optional[SpanExporter] = None) -> "EngineTracerStandIn":
        resource = Resource.create({"vllm.instrumenting_module_name": VLLM_INSTRUMENTING_MODULE,
                                    "vllm.process_id": str(os.getpid())})
        return cls(resource, VLLM_TRACER_NAME, endpoint=endpoint, exporter=exporter)

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _host_id() -> str:
    try:
        with open("/etc/machine-id") as f:
            return f.read().strip()
    except OSError:
        return uuid.UUID(int=uuid.getnode()).hex


def sglang_request_spans(
    tracer: EngineTracerStandIn,
    *,
    rid: str,
    external_trace_header: Optional[Mapping[str, str]],
    received: float,
    prefill_started: float,
    prefill_finished: float,
    finished: float,
    queue_time: float = 0.0,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    sampling_params: Optional[Mapping[str, Any]] = None,
    model: str = "",
    finish_reason: Optional[str] = None,
) -> None:
    """One sglang request's spans (times: wall-clock seconds), as sglang 0.5.12 writes them."""
    t = tracer.tracer
    pid, host = threading.get_native_id(), _host_id()
    rid = str(rid)
    short_rid = rid.split("_")[-1]
    parent = _propagator.extract(dict(external_trace_header or {}))
    root = t.start_span(f" Req {short_rid[:8]}", context=parent, start_time=_ns(received),
                        attributes={"rid": short_rid, "module": "sglang::request"})
    root_ctx = trace.set_span_in_context(root)

    def thread_span(label: str, start: float, ranks: Mapping[str, int]):
        name = label + "".join(f" [{key[:2].upper()} {value}] " for key, value in ranks.items())
        span = t.start_span(f"{name}(host:{host[:8]} | pid:{pid})", context=root_ctx, start_time=_ns(start))
        span.set_attributes({**ranks, "host_id": host, "pid": pid, "thread_label": label})
        return span

    previous: List[Any] = []

    def slice_span(parent_span, name: str, start: float, end: float, attrs: Optional[Dict[str, Any]] = None,
                   first_level: bool = True):
        links = [Link(previous[-1].get_span_context())] if first_level and previous else None
        span = t.start_span(name, context=trace.set_span_in_context(parent_span), start_time=_ns(start), links=links)
        if attrs:
            span.set_attributes(attrs)
        if first_level:
            previous.append(span)
        return span

    # Tokenizer thread (the process hosting verl's server actor)
    tokenized = received + max(0.0, min(0.0005, (prefill_started - received) / 4))
    dispatched = tokenized + max(0.0, min(0.0005, (prefill_started - tokenized) / 4))
    tokenizer = thread_span("Tokenizer", received, {})
    slice_span(tokenizer, "tokenize", received, tokenized).end(end_time=_ns(tokenized))
    slice_span(tokenizer, "api_server_dispatch", tokenized, dispatched).end(end_time=_ns(dispatched))
    tokenizer.end(end_time=_ns(dispatched))

    # Scheduler thread (a scheduler process; TP 0, PP 0, no DP)
    waiting = max(dispatched, prefill_started - max(0.0, queue_time))
    scheduler = thread_span("Scheduler", dispatched, {"tp_rank": 0, "pp_rank": 0})
    slice_span(scheduler, "request_process", dispatched, waiting).end(end_time=_ns(waiting))
    slice_span(scheduler, "prefill_waiting", waiting, prefill_started).end(end_time=_ns(prefill_started))
    slice_span(scheduler, "prefill_forward", prefill_started, prefill_finished).end(end_time=_ns(prefill_finished))
    decode = slice_span(scheduler, "decode_forward", prefill_finished, finished)
    steps = max(1, min(int(completion_tokens), MAX_DECODE_LOOP_SPANS))
    step_s = (finished - prefill_finished) / steps
    for ct in range(steps):
        start = prefill_finished + ct * step_s
        slice_span(decode, "decode_loop", start, start + step_s, {"decode_ct": ct}, first_level=False).end(
            end_time=_ns(start + step_s))
    decode.end(end_time=_ns(finished))
    scheduler.end(end_time=_ns(finished))

    # TokenizerManager.convert_to_span_attrs, set on the root when the request finishes
    params = dict(sampling_params or {})
    attrs: Dict[str, Any] = {
        "gen_ai.usage.completion_tokens": int(completion_tokens),
        "gen_ai.usage.prompt_tokens": int(prompt_tokens),
        "gen_ai.usage.cached_tokens": int(cached_tokens),
        "gen_ai.request.id": rid,
        "gen_ai.response.model": model,
        "gen_ai.latency.time_to_first_token": prefill_finished - received,
        "gen_ai.latency.e2e": finished - received,
        "gen_ai.latency.time_in_model_decode": finished - prefill_finished,
        "gen_ai.latency.time_in_model_inference": finished - dispatched,
        "gen_ai.latency.time_in_model_prefill": prefill_finished - dispatched,
    }
    for key, name in (("max_new_tokens", "max_tokens"), ("top_p", "top_p"), ("temperature", "temperature"),
                      ("top_k", "top_k"), ("n", "n")):
        if params.get(key):
            attrs[f"gen_ai.request.{name}"] = params[key]
    if finish_reason:
        attrs["gen_ai.response.finish_reasons"] = json.dumps([finish_reason])
    root.set_attributes(attrs)
    root.end(end_time=_ns(finished))


def vllm_request_span(
    tracer: EngineTracerStandIn,
    *,
    request_id: str,
    trace_headers: Optional[Mapping[str, str]],
    arrival: float,
    scheduled: float,
    first_token: float,
    last_token: float,
    prompt_tokens: int,
    completion_tokens: int,
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    n: Optional[int] = None,
) -> None:
    """vLLM's ``llm_request`` span (``OutputProcessor.do_tracing``): from arrival, ended now."""
    attrs: Dict[str, Any] = {
        "gen_ai.latency.time_to_first_token": first_token - arrival,
        "gen_ai.latency.e2e": time.time() - arrival,
        "gen_ai.latency.time_in_queue": scheduled - arrival,
        "gen_ai.usage.prompt_tokens": int(prompt_tokens),
        "gen_ai.usage.completion_tokens": int(completion_tokens),
        "gen_ai.latency.time_in_model_prefill": first_token - scheduled,
        "gen_ai.latency.time_in_model_decode": last_token - first_token,
        "gen_ai.latency.time_in_model_inference": last_token - scheduled,
        "gen_ai.request.id": str(request_id),
    }
    for name, value in (("top_p", top_p), ("max_tokens", max_tokens), ("temperature", temperature), ("n", n)):
        if value:
            attrs[f"gen_ai.request.{name}"] = value
    context = _propagator.extract(dict(trace_headers)) if trace_headers else None
    span = tracer.tracer.start_span(VLLM_REQUEST_SPAN, context=context, kind=SpanKind.SERVER,
                                    start_time=_ns(arrival), attributes=attrs)
    span.end()


# --------------------------------------------------------------------------- sglang front-end


def sglang_trace_settings(rollout_config: Any) -> Optional[str]:
    """The OTLP endpoint when ``engine_kwargs.sglang.enable_trace`` is on, else None."""
    engine_kwargs = _cfg(rollout_config, "engine_kwargs", {}) or {}
    sglang_kwargs = _cfg(engine_kwargs, "sglang", {}) or {}
    if not _cfg(sglang_kwargs, "enable_trace", False):
        return None
    return str(_cfg(sglang_kwargs, "otlp_traces_endpoint", SGLANG_DEFAULT_ENDPOINT))


class TracingTokenizerManagerStandIn(TokenizerManagerStandIn):
    """:class:`TokenizerManagerStandIn` that, like sglang with ``enable_trace``, writes the
    request's spans under ``obj.external_trace_header`` when the request carries one."""

    def __init__(self, tokenizer: Any, *, tracer: EngineTracerStandIn, model: str = "", **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.engine_tracer = tracer
        self.model = model

    async def generate_request(self, obj: Any, request: Any = None):
        received = time.time()
        async for out in super().generate_request(obj, request):
            # read after the base method ran: that is where a hook around sglang's
            # TokenizerManager.generate_request (otel_verl's) sets the header
            headers = _field(obj, "external_trace_header")
            if headers:
                try:
                    self._trace(obj, headers, out, received)
                except Exception:  # as in a real engine, its tracing never fails the request
                    logger.warning("engine span stand-in: could not write a request's spans", exc_info=True)
            yield out

    def _trace(self, obj: Any, headers: Mapping[str, str], out: Any, received: float) -> None:
        meta = out.get("meta_info") or {} if isinstance(out, dict) else {}
        finished = time.time()
        prefill_finished = _first_number(meta, ("prefill_finished_time", "prefill_finished_ts")) or finished
        queue_time = _first_number(meta, ("queue_time",)) or 0.0
        prefill_started = min(prefill_finished, received + queue_time + 0.001)
        reason = meta.get("finish_reason")
        sglang_request_spans(
            self.engine_tracer,
            rid=str(_field(obj, "rid")),
            external_trace_header=headers,
            received=received,
            prefill_started=prefill_started,
            prefill_finished=max(prefill_finished, prefill_started),
            finished=finished,
            queue_time=queue_time,
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            completion_tokens=int(meta.get("completion_tokens") or 0),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            sampling_params=_field(obj, "sampling_params") or {},
            model=self.model,
            finish_reason=reason.get("type") if isinstance(reason, dict) else None,
        )


def _first_number(meta: Mapping[str, Any], keys: Sequence[str]) -> Optional[float]:
    for key in keys:
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def tokenizer_manager_for(rollout_config: Any, tokenizer: Any, *, model: str = "", **kwargs: Any) -> TokenizerManagerStandIn:
    """The demo's sglang front-end: with engine spans when the rollout config switches
    sglang's tracing on (``engine_kwargs.sglang.enable_trace``), as the real server would."""
    endpoint = sglang_trace_settings(rollout_config)
    if endpoint is None:
        return TokenizerManagerStandIn(tokenizer, **kwargs)
    return TracingTokenizerManagerStandIn(tokenizer, tracer=EngineTracerStandIn.sglang(endpoint), model=model, **kwargs)


# --------------------------------------------------------------------------- vLLM engine


class RequestOutputStandIn:
    """The fields of vLLM's ``RequestOutput`` that verl reads."""

    def __init__(self, request_id: str, prompt_token_ids: List[int], token_ids: List[int], finished: bool) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [_CompletionStandIn(token_ids)]
        self.finished = finished
        self.num_cached_tokens = 0


class _CompletionStandIn:
    def __init__(self, token_ids: List[int]) -> None:
        self.token_ids = token_ids
        self.logprobs = None
        self.finish_reason = "length"
        self.stop_reason = None
        self.routed_experts = None


class AsyncLLMStandIn:
    """Stand-in for vLLM's ``AsyncLLM``: ``generate`` has vLLM 0.24.0's signature and, with
    ``otlp_traces_endpoint`` set (``observability_config.otlp_traces_endpoint``, as vLLM keeps
    it), writes ``llm_request`` under ``trace_headers`` (to ``exporter`` when given). It
    echoes ``max_tokens`` tokens; ``received_trace_headers`` lists what each call got."""

    def __init__(self, otlp_traces_endpoint: Optional[str] = None, *, exporter: Optional[SpanExporter] = None,
                 latency_s: float = 0.01) -> None:
        self.observability_config = types.SimpleNamespace(otlp_traces_endpoint=otlp_traces_endpoint)
        self.engine_tracer = (EngineTracerStandIn.vllm(otlp_traces_endpoint, exporter=exporter)
                              if otlp_traces_endpoint else None)
        self.latency_s = float(latency_s)
        self.received_trace_headers: List[Optional[Dict[str, str]]] = []

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        prompt_text: Optional[str] = None,
        lora_request: Any = None,
        tokenization_kwargs: Optional[Dict[str, Any]] = None,
        trace_headers: Optional[Mapping[str, str]] = None,
        priority: int = 0,
        data_parallel_rank: Optional[int] = None,
        reasoning_ended: Optional[bool] = None,
        reasoning_parser_kwargs: Optional[Dict[str, Any]] = None,
    ) -> AsyncIterator[RequestOutputStandIn]:
        arrival = time.time()
        self.received_trace_headers.append(dict(trace_headers) if trace_headers is not None else None)
        prompt_ids = list(_field(prompt, "prompt_token_ids") or [])
        max_tokens = int(_field(sampling_params, "max_tokens") or 4)
        scheduled = time.time()
        await asyncio.sleep(self.latency_s / 2)
        first_token = time.time()
        await asyncio.sleep(self.latency_s / 2)
        token_ids = [(t + 1) % 1000 for t in (prompt_ids or [0])][:max_tokens]
        last_token = time.time()
        if self.engine_tracer is not None and trace_headers:
            try:
                vllm_request_span(
                    self.engine_tracer, request_id=request_id, trace_headers=trace_headers, arrival=arrival,
                    scheduled=scheduled, first_token=first_token, last_token=last_token,
                    prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids), max_tokens=max_tokens,
                    temperature=_field(sampling_params, "temperature"), top_p=_field(sampling_params, "top_p"),
                )
            except Exception:  # as in a real engine, its tracing never fails the request
                logger.warning("engine span stand-in: could not write a request's span", exc_info=True)
        yield RequestOutputStandIn(request_id, prompt_ids, token_ids, finished=True)
