"""LLM server side: a server span per generate call, engine timing handed back to the turn.

Runs in the SGLangHttpServer / vLLMHttpServer actor. The turn's context arrives as a
suffix of the request id (see :mod:`otel_verl.carriers`): stripped here before the
engine sees the id. sglang's per-request ``meta_info`` (e2e_latency, queue_time, ...;
every key optional, names vary by version) is read from ``TokenizerManager.generate_request``
and returned to the worker in ``extra_fields`` for the turn's data. The turn's context
also goes to the engine, so that the engine's own request spans (when its tracing is on)
nest under the turn: as ``external_trace_header`` on sglang's ``GenerateReqInput``, and as
``trace_headers`` of vLLM's ``AsyncLLM.generate`` (verl's ``vLLMHttpServer.generate`` passes
none). Both engines install their own global TracerProvider in this process; otel_verl
keeps its own (see ``otel_verl.configure``).
"""

from __future__ import annotations

from typing import List

from otel_verl import carriers, events, health
from otel_verl.instrumentation._args import arguments, with_argument
from otel_verl.instrumentation.hooks import Hook
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Role

SGLANG_SERVER = "verl.workers.rollout.sglang_rollout.async_sglang_server"
VLLM_SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server"
SGLANG_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"
VLLM_ASYNC_LLM = "vllm.v1.engine.async_llm"
COMPONENT = "llm_server"


def _server_generate(tracing: Tracing, provider: str):
    async def wrapper(wrapped, instance, args, kwargs):
        call = None
        try:
            _, values = arguments(wrapped, instance, args, kwargs)
            original, headers = carriers.untag_request_id(values.get("request_id"))
            if headers is not None:  # an untagged id comes from an untraced caller: not ours
                args, kwargs = with_argument(wrapped, instance, args, kwargs, "request_id", original)
                tracing.active(Role.LLM_SERVER)
                call = events.llm_server_call(headers, request_id=str(original), provider=provider)
        except Exception as exc:
            health.record_failure("llm_server.generate", exc)
        if call is None:
            return await wrapped(*args, **kwargs)
        with call as server:
            output = await wrapped(*args, **kwargs)
            _hand_back(output, server)
            return output

    return wrapper


@health.guarded(default=None)
def _hand_back(output, server) -> None:
    extra = getattr(output, "extra_fields", None)
    if isinstance(extra, dict):
        extra[carriers.SERVER_META_KEY] = dict(server.meta)


async def _generate_request(wrapped, instance, args, kwargs):
    """sglang ``TokenizerManager.generate_request(obj, request=None)``, an async generator."""
    server = events.current_server_call()
    if server is not None:
        try:
            obj = arguments(wrapped, instance, args, kwargs)[1].get("obj")
            if server.headers and getattr(obj, "external_trace_header", "absent") is None:
                obj.external_trace_header = dict(server.headers)
        except Exception as exc:
            health.record_failure("llm_server.external_trace_header", exc)
    async for out in wrapped(*args, **kwargs):
        if server is not None and isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
            server.record_meta(out["meta_info"])
        yield out


def _engine_generate(wrapped, instance, args, kwargs):
    """vLLM ``AsyncLLM.generate(prompt, sampling_params, request_id, *, trace_headers=None, ...)``.

    A plain function around an async generator function: calling it only builds the
    generator, so the turn's headers are read here, inside the server call, and the
    generator verl iterates (and closes) is vLLM's own.
    """
    server = events.current_server_call()
    if server is not None and server.headers:
        try:
            if _tracing_on(instance) and arguments(wrapped, instance, args, kwargs)[1].get("trace_headers") is None:
                args, kwargs = with_argument(wrapped, instance, args, kwargs, "trace_headers", dict(server.headers))
        except Exception as exc:
            health.record_failure("llm_server.trace_headers", exc)
    return wrapped(*args, **kwargs)


def _tracing_on(engine) -> bool:
    """False only where vLLM says its tracing is off (no ``otlp_traces_endpoint``): headers
    would then ride with every request to the engine core for nothing."""
    config = getattr(engine, "observability_config", None)
    return getattr(config, "otlp_traces_endpoint", "unknown") is not None


def hooks(tracing: Tracing) -> List[Hook]:
    generate_params = ("prompt_ids", "sampling_params", "request_id")
    return [
        Hook(SGLANG_SERVER, "SGLangHttpServer.generate", _server_generate(tracing, "sglang"), generate_params, COMPONENT),
        Hook(VLLM_SERVER, "vLLMHttpServer.generate", _server_generate(tracing, "vllm"), generate_params, COMPONENT),
        Hook(SGLANG_TOKENIZER_MANAGER, "TokenizerManager.generate_request", _generate_request, ("obj",), COMPONENT),
        # installed only where the engine's generate takes trace_headers
        Hook(VLLM_ASYNC_LLM, "AsyncLLM.generate", _engine_generate, ("trace_headers",), COMPONENT),
    ]
