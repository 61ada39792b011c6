"""sglang's per-request timing in ``meta_info``: which keys hold it, how to read them, how to
switch them on.

sglang's ``TokenizerManager`` always reports ``e2e_latency`` for a finished request. The rest
of the timing comes only when the server runs with ``enable_metrics``, and its key names
changed over sglang's releases:

==========================  =================================  ==========================
what                        sglang 0.5.12 / 0.5.23             older sglang (the seed's)
==========================  =================================  ==========================
request received            ``request_received_ts``            ``request_received_ts``
prefill finished            ``prefill_finished_time``          ``prefill_finished_ts``
time to first token         ``first_token_latency`` (0.5.23)   -
queueing                    ``queue_time``                     ``queue_time``
prefill duration            -                                  ``prefill_launch_latency``
==========================  =================================  ==========================

verl's ``SGLangHttpServer`` passes ``enable_metrics`` to sglang when the rollout config has
``engine_kwargs.sglang.enable_metrics`` (what :data:`ENABLE_METRICS_OVERRIDE` sets: sglang's
metrics only) or ``prometheus.enable`` (which also makes verl rewrite and reload a
Prometheus configuration, and needs ``disable_log_stats=False``). The old names stay
readable for servers that still report them.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

E2E_LATENCY = "e2e_latency"
QUEUE_TIME = "queue_time"
REQUEST_RECEIVED_TS = "request_received_ts"
PREFILL_FINISHED_TS = "prefill_finished_ts"  # older sglang
PREFILL_FINISHED_TIME = "prefill_finished_time"  # sglang 0.5.12+
FIRST_TOKEN_LATENCY = "first_token_latency"  # sglang 0.5.23+
PREFILL_LAUNCH_LATENCY = "prefill_launch_latency"  # older sglang

# Timestamps a time to first token is measured to from REQUEST_RECEIVED_TS, preferred first.
_PREFILL_FINISHED_KEYS = (PREFILL_FINISHED_TS, PREFILL_FINISHED_TIME)
# Keys that come only with enable_metrics: one of them says the timing is there.
METRICS_ONLY_KEYS = (QUEUE_TIME, REQUEST_RECEIVED_TS, *_PREFILL_FINISHED_KEYS, FIRST_TOKEN_LATENCY,
                     PREFILL_LAUNCH_LATENCY)

ENABLE_METRICS_KEY = "actor_rollout_ref.rollout.engine_kwargs.sglang.enable_metrics"
# ``++``: the key is absent from verl's config (``engine_kwargs.sglang: {}``), and a user's
# YAML may already set it.
ENABLE_METRICS_OVERRIDE = f"++{ENABLE_METRICS_KEY}=True"
PROMETHEUS_ENABLE_KEY = "actor_rollout_ref.rollout.prometheus.enable"
DISABLE_LOG_STATS_KEY = "actor_rollout_ref.rollout.disable_log_stats"  # verl refuses prometheus without it off

TIMING_MISSING = "sglang.per_request_timing_missing"  # the health note's name
TIMING_MISSING_MESSAGE = (
    "sglang per-request timing missing: the sglang server runs without enable_metrics and reports only "
    "e2e_latency, so the trajectory JSONL's sglang_queue_time_ms / sglang_ttft_ms are null and the report "
    f"has no queue/prefill/decode split; enable it with the Hydra override {ENABLE_METRICS_OVERRIDE} "
    f"(`otel-verl run` adds it to verl.trainer.main_ppo), or {PROMETHEUS_ENABLE_KEY}=True with "
    f"{DISABLE_LOG_STATS_KEY}=False"
)


def number(value: Any) -> Any:
    """A meta value as a number (ints and floats kept as they are), or ``None``."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)  # numpy scalars, numeric strings
    except (TypeError, ValueError):
        return None


def ttft_s(meta: Mapping[str, Any]) -> Any:
    """Seconds from the request's arrival to its first token (its queueing included):
    ``prefill_finished_ts`` or ``prefill_finished_time`` minus ``request_received_ts``,
    else ``first_token_latency``; ``None`` when the server reported none of them."""
    received = number(meta.get(REQUEST_RECEIVED_TS))
    if received is not None:
        for key in _PREFILL_FINISHED_KEYS:
            prefilled = number(meta.get(key))
            if prefilled is not None:
                return prefilled - received
    return number(meta.get(FIRST_TOKEN_LATENCY))


class Split(NamedTuple):
    """The server's view of one request, in seconds: ``queue`` waiting to be scheduled,
    ``prefill`` from then to its first token, ``decode`` the rest; they add up to ``e2e``.
    All but ``e2e`` are ``None`` for a server that reported only that (sglang without its
    metrics)."""

    e2e: float
    queue: Optional[float]
    prefill: Optional[float]
    decode: Optional[float]


def split(meta: Mapping[str, Any]) -> Optional[Split]:
    """The queue / prefill / decode split of a request's meta (``None``: no e2e_latency),
    one rule for the metrics and the report (``meta.get`` is all it reads). Prefill is the time to first token less the
    queue, so the three parts add up to the request's time; an older sglang's
    ``prefill_launch_latency`` (the prefill's launch alone, leaving tokenizing and transfer
    out) stands in only when there is no time to first token."""
    e2e = number(meta.get(E2E_LATENCY))
    if e2e is None:
        return None
    if timing_missing(meta):
        return Split(float(e2e), None, None, None)
    queue = float(number(meta.get(QUEUE_TIME)) or 0.0)
    ttft = ttft_s(meta)
    if ttft is not None:
        prefill = max(0.0, ttft - queue)
    else:
        prefill = float(number(meta.get(PREFILL_LAUNCH_LATENCY)) or 0.0)
    return Split(float(e2e), queue, prefill, max(0.0, e2e - queue - prefill))


def timing_missing(meta: Mapping[str, Any]) -> bool:
    """True for the meta of a server that answered (``e2e_latency``) without its metrics on."""
    return number(meta.get(E2E_LATENCY)) is not None and all(number(meta.get(k)) is None for k in METRICS_ONLY_KEYS)
