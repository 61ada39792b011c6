"""LLM turns, captured at verl's LLM client so every agent loop gets turn spans.

``LLMServerClient.generate`` is what SingleTurnAgentLoop, ToolAgentLoop and custom agent
loops call for each turn (in the rollout worker). The async trainers' client,
``FullyAsyncLLMServerClient.generate``, resumes an interrupted request by calling the
plain client again: both are wrapped, and the inner calls are attempts of the outer
turn. The turn's (or attempt's) context goes to the server as a suffix of the
engine request id (:func:`otel_verl.carriers.tag_request_id`); the server's timing comes
back in ``extra_fields`` and is popped here, beside verl's own ``global_steps``: the
weight version that served the request.
"""

from __future__ import annotations

import os
from typing import Any, List

from otel_verl import carriers, events, health
from otel_verl.instrumentation._args import arguments
from otel_verl.instrumentation.hooks import Hook
from otel_verl.instrumentation.tracing import Tracing
from otel_verl.semconv import Role

LLM_SERVER = "verl.workers.rollout.llm_server"
COMPONENT = "llm_client"
CACHE_ATTR = "_otel_verl_model_provider"  # (config, (model, provider)) on the client


def _model_and_provider(client: Any) -> "tuple[str | None, str]":
    # Read once per client and config: verl's config is an OmegaConf DictConfig, whose
    # lookups are slow enough to cost more than the rest of a turn's tracing.
    config = getattr(client, "config", None)
    cached = getattr(client, CACHE_ATTR, None)
    if cached is not None and cached[0] is config:
        return cached[1]
    try:
        rollout_ref = config.actor_rollout_ref
        path = str(rollout_ref.model.path).rstrip("/")
        result = (os.path.basename(path) or None, str(rollout_ref.rollout.name or "verl"))
    except Exception:
        return None, "verl"
    try:
        setattr(client, CACHE_ATTR, (config, result))
    except Exception:  # a client that takes no attributes: read it every time
        pass
    return result


def _turn(tracing: Tracing, resumes: bool):
    """The wrapper of a client's generate; ``resumes``: the client calls the plain
    client again for an aborted request, and those calls are attempts of this turn."""

    def wrapper(wrapped, instance, args, kwargs):
        if not tracing.active(Role.AGENT_LOOP_WORKER):  # off here: verl's own coroutine, no layer of ours
            return wrapped(*args, **kwargs)
        return _traced_generate(wrapped, instance, args, kwargs, resumes)

    return wrapper


async def _traced_generate(wrapped, instance, args, kwargs, resumes: bool):
    try:
        _, values = arguments(wrapped, instance, args, kwargs)
        params = values.get("sampling_params") or {}
        prompt_ids, request_id = values.get("prompt_ids"), values.get("request_id")
        model, provider = _model_and_provider(instance)
        call = events.llm_call(
            prompt_ids or (),
            model=model,
            provider=provider,
            request_id=str(request_id),
            max_tokens=params.get("max_tokens", params.get("max_new_tokens")),
            temperature=params.get("temperature"),
            top_p=params.get("top_p"),
            resumes=resumes,
        )
    except Exception as exc:
        health.record_failure("llm_client.generate", exc)
        output = await wrapped(*args, **kwargs)
        _pop_server_meta(output)
        return output
    with call as turn:
        output = await wrapped(*args, **kwargs)
        server_meta = _pop_server_meta(output)  # our server wrapper's own dict: ours to change
        output_tokens = server_meta.pop("completion_tokens", None) if isinstance(server_meta, dict) else None
        extra = getattr(output, "extra_fields", None)
        turn.finish(
            getattr(output, "token_ids", ()) or (),
            stop_reason=getattr(output, "stop_reason", None),
            output_tokens=output_tokens,
            server_meta=server_meta,
            # the weights that served it: the server's global_steps (verl sets it per request)
            weight_version=extra.get("global_steps") if isinstance(extra, dict) else None,
        )
        return output


def _pop_server_meta(output: Any) -> "dict | None":
    """The server's timing our server wrapper put into ``output``, taken out of verl's data."""
    extra = getattr(output, "extra_fields", None)
    return extra.pop(carriers.SERVER_META_KEY, None) if isinstance(extra, dict) else None


def _engine_request_id(wrapped, instance, args, kwargs):
    request_id = wrapped(*args, **kwargs)
    if not events.enabled():
        return request_id
    try:
        turn = events.current_turn()
        if turn is not None and turn.span is not None:
            return carriers.tag_request_id(request_id, turn.carrier())
    except Exception as exc:
        health.record_failure("llm_client.request_id", exc)
    return request_id


def hooks(tracing: Tracing) -> List[Hook]:
    generate_params = ("request_id", "prompt_ids", "sampling_params")
    return [
        Hook(LLM_SERVER, "LLMServerClient.generate", _turn(tracing, resumes=False), generate_params, COMPONENT),
        Hook(LLM_SERVER, "FullyAsyncLLMServerClient.generate", _turn(tracing, resumes=True), generate_params, COMPONENT),
        Hook(LLM_SERVER, "LLMServerClient._vllm_request_id", _engine_request_id, ("request_id",), COMPONENT),
    ]
