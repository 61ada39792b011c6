"""Stand-in for verl's LLM server actors (``SGLangHttpServer`` / ``vLLMHttpServer``) on CPU.

sglang and vLLM cannot serve on a CPU-only machine, so the harness replaces exactly one
thing on the rollout side: the engine behind the server actor. Everything in front of it is
verl's own code: ``AgentLoopWorker`` -> ``LLMServerClient.generate`` -> the
``GlobalRequestLoadBalancer`` actor made by ``get_router_handle`` -> ``server.generate.remote``.

:class:`LLMServerStandIn` is a plain class that the harness turns into a Ray actor with
``ray.remote(LLMServerStandIn)``, as verl does with ``ray.remote(SGLangHttpServer)``. Its
``generate`` has the same parameters, in the same order, as verl 0.9.1's
``SGLangHttpServer.generate`` (``prompt_ids, sampling_params, request_id, image_data=None,
video_data=None, bootstrap_host=None, bootstrap_port=None, bootstrap_room=None``), which is
what ``LLMServerClient.generate`` calls (by keyword) when ``rollout.name == "sglang"``. Ray
checks remote-call kwargs against this signature, so a caller that adds a kwarg fails here
as it would against the real server. It returns verl's ``TokenOutput`` with
``extra_fields={"global_steps": ...}``, exactly the keys the real sglang server returns.

Engine timing, the way a tracing wrapper reads it
-------------------------------------------------
verl's ``SGLangHttpServer.generate`` awaits
``self.tokenizer_manager.generate_request(obj, None).__anext__()`` and keeps only
``finish_reason`` and log-probs from the result's ``meta_info``; sglang's per-request
timing is dropped and never reaches ``TokenOutput.extra_fields``. The stand-in keeps that
structure, and answers with the timing keys sglang 0.5.12 (the version verl 0.9.1 pins)
reports:

* ``LLMServerStandIn.tokenizer_manager`` is a :class:`TokenizerManagerStandIn`, whose
  ``generate_request(obj, request=None)`` is an async generator yielding the sglang-shaped
  dict ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": ...},
  "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", ...,
  ["output_token_logprobs"]}}``. A wrapper around ``TokenizerManagerStandIn.generate_request``
  sees the same thing a wrapper around sglang's ``TokenizerManager.generate_request`` would.
* Like sglang, it reports only ``e2e_latency`` unless its server runs with
  ``enable_metrics``; then it adds ``request_received_ts``, ``api_server_dispatch_finish_ts``,
  ``forward_entry_time``, ``prefill_finished_time``, ``queue_time``,
  ``response_sent_to_client_ts`` and ``request_finished_ts`` (no ``prefill_finished_ts`` nor
  ``prefill_launch_latency``: 0.5.12 reports neither). The servers here take the switch
  from the rollout config as verl's ``SGLangHttpServer.launch_server`` does
  (:func:`sglang_enable_metrics`): ``engine_kwargs.sglang.enable_metrics``, or
  ``prometheus.enable``, or verl's RL-Insight logging.
* In addition the server records the last ``meta_info`` per request id (bounded):
  ``LLMServerStandIn.engine_meta_info(request_id)`` (a local method, also callable as a
  Ray actor method) returns it; ``engine_meta_info_all()`` returns all recorded ones.

Neither goes into ``TokenOutput.extra_fields``: verl turns every extra field into a
non-tensor batch column, so adding keys there would change what the trainer sees.

Generated text (deterministic, a scripted policy)
-------------------------------------------------
The stand-in decodes the prompt with the stand-in tokenizer and answers the last question
(two numbers, see :mod:`otel_verl.demo.data`):

* if the prompt lists tools (hermes ``<tools>`` block) and holds no ``<tool_response>`` yet,
  the response is a hermes tool call
  ``<tool_call>\\n{"name": "calculator", "arguments": {"a": A, "b": B}}\\n</tool_call>``;
* otherwise a final answer ending ``#### <number>``, where the number is the last tool
  result when there is one, else ``A + B``.

With ``temperature == 0`` (verl's validation default) every request gets the correct
answer. With sampling, the k-th request that carries the same prompt ids gets variant
``k % 4``: correct, wrong (off by one), correct, no ``####`` (scores 1, 0, 1, 0 under verl's
gsm8k reward), so each GRPO group of 4 has a non-zero spread. The multiset of answers per
group is deterministic; which sample gets which depends on arrival order. Every response
ends with ``<|im_end|>`` (finish reason ``stop``) unless ``max_new_tokens`` cuts it
(``length``). Log-probs, when requested, are deterministic functions of the token ids.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from verl.workers.rollout.replica import TokenOutput

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
NUM_VARIANTS = 4

_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)
_INT_RE = re.compile(r"-?\d+")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a GenerateReqInput-like object or a dict."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _model_path(model_config: Any) -> str:
    if isinstance(model_config, str):
        return model_config
    for key in ("local_path", "path"):
        value = model_config.get(key) if isinstance(model_config, dict) or hasattr(model_config, "get") else None
        value = value if value is not None else getattr(model_config, key, None)
        if value:
            return str(value)
    raise ValueError(f"cannot find a model path in {type(model_config).__name__}")


def _cfg(config: Any, name: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


class ScriptedPolicyStandIn:
    """Deterministic text "policy" for the stand-in engines (see the module docstring)."""

    def __init__(self) -> None:
        self._seen: Dict[Tuple[int, ...], int] = {}

    def variant(self, prompt_ids: List[int], temperature: float) -> int:
        if not temperature:
            return 0
        key = tuple(prompt_ids)
        k = self._seen.get(key, 0)
        self._seen[key] = k + 1
        if len(self._seen) > 100_000:  # bounded memory for long runs
            self._seen.clear()
        return k % NUM_VARIANTS

    @staticmethod
    def respond(prompt_text: str, variant: int = 0) -> Tuple[str, str]:
        """``(kind, text)`` for a rendered ChatML prompt; kind is "tool_call" or "answer"."""
        blocks = prompt_text.split(IM_START)
        question = ""
        for block in reversed(blocks):
            if block.startswith("user") and "<tool_response>" not in block:
                question = block[len("user") :].replace(IM_END, "")
                break
        numbers = [int(x) for x in _INT_RE.findall(question)][:2]
        tool_results = _TOOL_RESPONSE_RE.findall(prompt_text)
        if "<tools>" in prompt_text and '"calculator"' in prompt_text and not tool_results and len(numbers) == 2:
            a, b = numbers
            call = json.dumps({"name": "calculator", "arguments": {"a": a, "b": b}})
            return "tool_call", f"I will add {a} and {b} with the calculator.\n<tool_call>\n{call}\n</tool_call>"
        answer: Optional[str] = None
        if tool_results:
            found = _NUMBER_RE.findall(tool_results[-1])
            answer = found[-1] if found else None
        if answer is None and len(numbers) == 2:
            answer = str(numbers[0] + numbers[1])
        if answer is None:
            return "answer", "I cannot find two numbers to add."
        source = "The calculator says the total is" if tool_results else "Adding the two numbers gives"
        v = variant % NUM_VARIANTS
        if v == 1:
            try:
                wrong = str(int(answer) + 1)
            except ValueError:
                wrong = answer + "1"
            return "answer", f"{source} {wrong}.\n#### {wrong}"
        if v == 3:
            return "answer", f"{source} {answer}, I think."
        if v == 2:
            return "answer", f"So the answer is {answer}.\n#### {answer}"
        return "answer", f"{source} {answer}.\n#### {answer}"


def _continuation(prompt_text: str, reply: str) -> str:
    """What is left of ``reply`` after the partial reply the prompt ends with: a request
    aborted mid-decode (a weight sync) is resumed with its tokens so far appended to
    the prompt, and the engine goes on from there (a fresh reply would make the
    response a broken tool call followed by a whole one)."""
    tail = prompt_text.rsplit(IM_START, 1)[-1]
    if not tail.startswith("assistant\n") or IM_END in tail:
        return reply  # a new turn
    partial = tail[len("assistant\n"):]
    return reply[len(partial):] if partial and reply.startswith(partial) else reply


def sglang_enable_metrics(config: Any) -> bool:
    """Whether verl 0.9.1's ``SGLangHttpServer.launch_server`` would start sglang with
    ``enable_metrics`` for this rollout config: ``engine_kwargs.sglang`` passes it through,
    ``prometheus.enable`` or RL-Insight logging turns it on."""
    engine_kwargs = _cfg(_cfg(config, "engine_kwargs", {}), "sglang", {})
    enabled = bool(_cfg(engine_kwargs, "enable_metrics", False))
    if bool(_cfg(_cfg(config, "prometheus", None), "enable", False)):
        enabled = True
    try:
        from verl.utils.tracking import RLInsightLogger

        enabled = enabled or bool(RLInsightLogger.enabled())
    except Exception:  # a verl without RL-Insight: that switch does not exist
        pass
    return enabled


def _timing_meta(enable_metrics: bool, received: float, finished: float, *, dispatched: Optional[float] = None,
                 forward_entry: Optional[float] = None, prefill_finished: Optional[float] = None) -> Dict[str, Any]:
    """The timing keys of a finished request's ``meta_info`` as sglang 0.5.12 writes them:
    ``e2e_latency`` always, the rest only with ``enable_metrics`` (wall-clock seconds)."""
    meta: Dict[str, Any] = {"e2e_latency": finished - received}
    if not enable_metrics:
        return meta
    meta["request_received_ts"] = received
    if dispatched is not None:
        meta["api_server_dispatch_finish_ts"] = dispatched
    meta["response_sent_to_client_ts"] = finished
    meta["request_finished_ts"] = finished
    if forward_entry is not None:
        meta["forward_entry_time"] = forward_entry
        meta["queue_time"] = forward_entry - (dispatched if dispatched is not None else received)
    if prefill_finished is not None:
        meta["prefill_finished_time"] = prefill_finished
    return meta


def _aborted_output(rid: Any, output_ids: List[int], received_ts: float, enable_metrics: bool,
                    **stages: Optional[float]) -> Dict[str, Any]:
    """An aborted request's output; ``stages`` (``_timing_meta``'s keywords) are the
    timestamps of the stages it went through before the abort."""
    meta_info = {
        "id": rid,
        "finish_reason": {"type": "abort"},
        "prompt_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        **_timing_meta(enable_metrics, received_ts, time.time(), **stages),
    }
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta_info}


class TokenizerManagerStandIn:
    """Stand-in for sglang's ``TokenizerManager`` (the engine front-end the server awaits).

    ``generate_request(obj, request=None)`` is an async generator, as in sglang; ``obj`` may be
    sglang's ``GenerateReqInput`` (or the stand-in of it) or a dict with ``rid``,
    ``input_ids``, ``sampling_params`` and ``return_logprob``. It yields one final output.
    The memory-occupation methods track the released tags; generating while the weights are
    released raises, as a real engine would produce garbage or fail then. ``enable_metrics``
    is sglang's server argument: without it, ``meta_info`` holds no timing but ``e2e_latency``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        latency_s: float = 0.05,
        per_token_latency_s: float = 0.0005,
        policy: Optional[ScriptedPolicyStandIn] = None,
        enable_metrics: bool = False,
        preempt_every: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.enable_metrics = bool(enable_metrics)
        self.latency_s = float(latency_s)
        self.per_token_latency_s = float(per_token_latency_s)
        # every k-th request is interrupted halfway through its decode and comes back
        # aborted with its tokens so far, as a weight sync's abort does (0: never)
        self.preempt_every = int(preempt_every)
        self._started = 0
        self.policy = policy or ScriptedPolicyStandIn()
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        self.released_tags: set = set()
        self.paused = False
        self.server_status = "Up"
        self.stats: Dict[str, int] = {
            "requests": 0,
            "tool_call_outputs": 0,
            "answer_outputs": 0,
            "tool_response_prompts": 0,
            "completion_tokens": 0,
            "flush_cache": 0,
            "pauses": 0,
            "aborted": 0,
            "rejected": 0,
        }
        self._inflight = 0
        self._abort_epoch = 0
        self._resume: Optional[asyncio.Event] = None
        # set by the server's abort_all_requests(reject_request=True): requests arriving while
        # paused come back at once as aborted (the client retries on another replica)
        self.reject_while_paused = False

    def _logprob(self, token_id: int, position: int) -> float:
        return -0.05 - 0.9 * (0.5 + 0.5 * math.sin(0.7 * token_id + 0.3 * position)) ** 2

    async def generate_request(self, obj: Any, request: Any = None):
        received_ts = time.time()
        # sglang parks requests that arrive while generation is paused until continue_generation
        while self.paused:
            if self.reject_while_paused:
                self.stats["rejected"] += 1
                yield _aborted_output(_field(obj, "rid"), [], received_ts, self.enable_metrics)
                return
            await self._resume_event().wait()
        if "weights" in self.released_tags:
            raise RuntimeError("generate_request while the engine's weights are released (sleeping)")
        rid = _field(obj, "rid")
        input_ids = list(_field(obj, "input_ids") or [])
        sampling_params = dict(_field(obj, "sampling_params") or {})
        return_logprob = bool(_field(obj, "return_logprob", False))
        max_new_tokens = sampling_params.get("max_new_tokens")
        dispatched_ts = time.time()  # handed to the scheduler

        # queueing: requests beyond a small "batch" wait a little, like a busy scheduler
        self._inflight += 1
        try:
            queue_time = 0.001 * max(0, self._inflight - 8)
            if queue_time:
                await asyncio.sleep(queue_time)
            prefill_launch_ts = time.time()
            prompt_text = self.tokenizer.decode(input_ids)
            kind, text = self.policy.respond(prompt_text, self.policy.variant(input_ids, sampling_params.get("temperature", 1.0)))
            text = _continuation(prompt_text, text)
            output_ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.im_end_id]
            finish_reason: Dict[str, Any] = {"type": "stop", "matched": self.im_end_id}
            if max_new_tokens is not None and len(output_ids) > int(max_new_tokens):
                output_ids = output_ids[: int(max_new_tokens)]
                finish_reason = {"type": "length", "length": int(max_new_tokens)}
            prefill_s = self.latency_s * 0.3
            decode_s = self.latency_s * 0.7 + self.per_token_latency_s * len(output_ids)
            abort_epoch = self._abort_epoch
            self._started += 1
            preempted = self.preempt_every > 0 and self._started % self.preempt_every == 0
            await asyncio.sleep(prefill_s)
            prefill_finished_ts = time.time()
            if preempted:
                await asyncio.sleep(decode_s / 2)
            if preempted or await self._sleep_unless_aborted(decode_s, abort_epoch):
                # pause_generation(mode="abort") (or a preemption) hit this request mid-decode:
                # return the tokens "decoded" so far with finish reason abort, as sglang does
                # for partial rollout
                done = int(len(output_ids) * min(1.0, (time.time() - prefill_finished_ts) / max(decode_s, 1e-6)))
                self.stats["aborted"] += 1
                out = _aborted_output(rid, output_ids[:done], received_ts, self.enable_metrics, dispatched=dispatched_ts,
                                      forward_entry=prefill_launch_ts, prefill_finished=prefill_finished_ts)
                if return_logprob:
                    out["meta_info"]["output_token_logprobs"] = [
                        (self._logprob(t, i), t, None) for i, t in enumerate(output_ids[:done])
                    ]
                yield out
                return
        finally:
            self._inflight -= 1
        finished_ts = time.time()

        self.stats["requests"] += 1
        self.stats["completion_tokens"] += len(output_ids)
        self.stats["tool_call_outputs" if kind == "tool_call" else "answer_outputs"] += 1
        if "<tool_response>" in prompt_text:
            self.stats["tool_response_prompts"] += 1

        meta_info: Dict[str, Any] = {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            **_timing_meta(self.enable_metrics, received_ts, finished_ts, dispatched=dispatched_ts,
                           forward_entry=prefill_launch_ts, prefill_finished=prefill_finished_ts),
        }
        if return_logprob:
            meta_info["output_token_logprobs"] = [
                (self._logprob(t, i), t, None) for i, t in enumerate(output_ids)
            ]
        yield {"text": self.tokenizer.decode(output_ids), "output_ids": output_ids, "meta_info": meta_info}

    async def release_memory_occupation(self, obj: Any = None, request: Any = None) -> None:
        self.released_tags.update(_field(obj, "tags", None) or ["kv_cache", "weights"])

    async def resume_memory_occupation(self, obj: Any = None, request: Any = None) -> None:
        self.released_tags.difference_update(_field(obj, "tags", None) or ["kv_cache", "weights"])

    async def flush_cache(self) -> None:
        self.stats["flush_cache"] += 1

    def _resume_event(self) -> asyncio.Event:
        if self._resume is None:
            self._resume = asyncio.Event()
        return self._resume

    async def _sleep_unless_aborted(self, seconds: float, epoch: int) -> bool:
        """Sleep ``seconds``; True (early) if an abort happened since ``epoch``."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self._abort_epoch != epoch:
                return True
            await asyncio.sleep(min(0.01, max(0.0, deadline - time.time())))
        return self._abort_epoch != epoch

    async def pause_generation(self, obj: Any = None) -> None:
        """sglang semantics: mode "abort" aborts in-flight requests (they return partial output
        with finish reason ``abort``); new requests wait until ``continue_generation``."""
        self.paused = True
        self._resume_event().clear()
        if (_field(obj, "mode", None) or "abort") == "abort":
            self._abort_epoch += 1
            self.stats["pauses"] += 1

    async def continue_generation(self, obj: Any = None) -> None:
        self.paused = False
        self.reject_while_paused = False
        self._resume_event().set()

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class LLMServerStandIn:
    """Stand-in for ``SGLangHttpServer`` / ``vLLMHttpServer`` (make it an actor with ``ray.remote``).

    Constructor arguments follow ``SGLangHttpServer`` where they matter (``config`` is the
    rollout config, ``model_config`` the model config or a path); the engine is a
    :class:`TokenizerManagerStandIn` built on the stand-in tokenizer. See the module
    docstring for the generated text and for where the engine timing can be read.
    """

    def __init__(
        self,
        config: Any = None,
        model_config: Any = None,
        rollout_mode: Any = None,
        replica_rank: int = 0,
        node_rank: int = 0,
        *,
        latency_s: float = 0.05,
        per_token_latency_s: float = 0.0005,
        meta_info_history: int = 4096,
        server_port: Optional[int] = None,
        preempt_every: int = 0,
    ) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.prompt_length = int(_cfg(config, "prompt_length", 512))
        self.response_length = int(_cfg(config, "response_length", 512))
        self.max_model_len = int(_cfg(config, "max_model_len", self.prompt_length + self.response_length))
        self.free_cache_engine = bool(_cfg(config, "free_cache_engine", True))
        self.tokenizer = AutoTokenizer.from_pretrained(_model_path(model_config))
        self.tokenizer_manager = TokenizerManagerStandIn(
            self.tokenizer, latency_s=latency_s, per_token_latency_s=per_token_latency_s,
            enable_metrics=sglang_enable_metrics(config), preempt_every=preempt_every,
        )
        # model weights version, set through set_global_steps when weights are "updated"
        self.global_steps: Optional[int] = None
        self.global_steps_history: List[Optional[int]] = []
        self.sleep_count = 0
        self.wake_count = 0
        self._meta_info: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
        self._meta_info_history = int(meta_info_history)
        self._server_address = "127.0.0.1"
        self._server_port = int(server_port if server_port is not None else 30000 + int(replica_rank))

    # ---- the request path -------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Any,
        sampling_params: Dict[str, Any],
        request_id: str,
        image_data: Optional[List[Any]] = None,
        video_data: Optional[List[Any]] = None,
        bootstrap_host: Optional[str] = None,
        bootstrap_port: Optional[int] = None,
        bootstrap_room: Optional[int] = None,
    ) -> TokenOutput:
        prompt_ids = [int(t) for t in prompt_ids]
        sampling_params = dict(sampling_params)
        # Same max_new_tokens rule as SGLangHttpServer.generate.
        max_possible_tokens = self.max_model_len - len(prompt_ids) - 1
        if max_possible_tokens < 0:
            raise ValueError(
                f"Prompt length ({len(prompt_ids)}) exceeds the model's maximum context length ({self.max_model_len})."
            )
        if "max_new_tokens" in sampling_params:
            max_new_tokens = sampling_params.pop("max_new_tokens")
        elif "max_tokens" in sampling_params:
            max_new_tokens = sampling_params.pop("max_tokens")
        else:
            max_new_tokens = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        sampling_params["max_new_tokens"] = max(0, min(int(max_new_tokens), max_possible_tokens))
        return_logprob = bool(sampling_params.pop("logprobs", False))

        request = {
            "rid": request_id,
            "input_ids": prompt_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "image_data": image_data,
            "video_data": video_data,
        }
        output = await self.tokenizer_manager.generate_request(request, None).__anext__()
        meta_info = output.get("meta_info", {})
        self._remember(request_id, meta_info)
        finish_reason = meta_info.get("finish_reason")
        token_ids = list(output.get("output_ids", []))
        log_probs = None
        if return_logprob:
            log_probs = [float(lp) for lp, _, _ in meta_info.get("output_token_logprobs") or []]
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason=finish_reason["type"] if finish_reason else None,
            extra_fields={"global_steps": self.global_steps},
        )

    def _remember(self, request_id: str, meta_info: Dict[str, Any]) -> None:
        record = {k: v for k, v in meta_info.items() if k != "output_token_logprobs"}
        self._meta_info[str(request_id)] = record
        while len(self._meta_info) > self._meta_info_history:
            self._meta_info.popitem(last=False)

    def engine_meta_info(self, request_id: str) -> Optional[Dict[str, Any]]:
        """The sglang-style ``meta_info`` (timing included) the engine returned for ``request_id``."""
        return self._meta_info.get(str(request_id))

    def engine_meta_info_all(self) -> Dict[str, Dict[str, Any]]:
        return dict(self._meta_info)

    # ---- lifecycle, as SGLangHttpServer exposes it -------------------------------------------
    async def set_global_steps(self, global_steps: int) -> None:
        """Set the model weights version (verl's ServerAdapter does this after a weight sync)."""
        self.global_steps = global_steps
        self.global_steps_history.append(global_steps)

    async def sleep(self) -> None:
        if self.node_rank != 0 or not self.free_cache_engine:
            return
        self.sleep_count += 1
        await self.tokenizer_manager.release_memory_occupation({"tags": ["kv_cache", "weights"]})

    async def wake_up(self) -> None:
        if self.node_rank != 0:
            return
        self.wake_count += 1
        await self.tokenizer_manager.resume_memory_occupation({"tags": ["kv_cache", "weights"]})
        await self.tokenizer_manager.flush_cache()

    async def release_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        await self.tokenizer_manager.release_memory_occupation({"tags": tags})

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        if tags is None or "kv_cache" in tags:
            self.wake_count += 1
        await self.tokenizer_manager.resume_memory_occupation({"tags": tags})

    async def clear_kv_cache(self) -> None:
        await self.tokenizer_manager.flush_cache()

    async def release_kv_cache(self) -> None:
        await self.tokenizer_manager.release_memory_occupation({"tags": ["kv_cache"]})

    async def resume_kv_cache(self) -> None:
        await self.tokenizer_manager.resume_memory_occupation({"tags": ["kv_cache"]})
        await self.tokenizer_manager.flush_cache()

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self.tokenizer_manager.pause_generation({"mode": "abort"})
        self.tokenizer_manager.reject_while_paused = bool(reject_request)

    async def resume_generation(self) -> None:
        await self.tokenizer_manager.continue_generation({})

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def get_server_address(self) -> Tuple[str, int]:
        return self._server_address, self._server_port

    def get_stats(self) -> Dict[str, Any]:
        return {
            **self.tokenizer_manager.stats,
            "pid": os.getpid(),
            "server_class": type(self).__name__,
            "replica_rank": self.replica_rank,
            "global_steps": self.global_steps,
            "global_steps_history": list(self.global_steps_history),
            "sleep_count": self.sleep_count,
            "wake_count": self.wake_count,
            "asleep": "weights" in self.tokenizer_manager.released_tags,
            "meta_info_recorded": len(self._meta_info),
        }


def start_llm_server_standins(
    config: Any,
    *,
    num_servers: int = 1,
    latency_s: float = 0.05,
    per_token_latency_s: float = 0.0005,
) -> Tuple[Any, List[Any]]:
    """Start ``num_servers`` :class:`LLMServerStandIn` actors behind verl's own load balancer.

    For driving verl's agent loop without the trainer (``ray.remote(AgentLoopWorker)``).
    ``config`` is the full trainer config (``actor_rollout_ref.rollout`` / ``.model`` are read).
    Returns ``(client, server_handles)``: ``client`` is verl's ``LLMServerClient`` on the
    ``GlobalRequestLoadBalancer`` made by ``get_router_handle(servers={address: handle})``.
    The caller owns the actors (``ray.kill`` them, and ``client._load_balancer``, when done).
    """
    import ray

    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    handles = [
        ray.remote(LLMServerStandIn)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(rollout, model, None, rank, 0, latency_s=latency_s, per_token_latency_s=per_token_latency_s)
        for rank in range(num_servers)
    ]
    addresses = ray.get([h.get_server_address.remote() for h in handles])
    servers = {f"{host}:{port}": handle for (host, port), handle in zip(addresses, handles)}
    load_balancer = get_router_handle(servers=servers)
    return LLMServerClient(config, load_balancer_handle=load_balancer), handles
