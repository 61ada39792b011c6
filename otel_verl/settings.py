"""Configuration from the environment, read in one place.

Standard ``OTEL_*`` variables are read by the OpenTelemetry SDK itself (exporter
endpoint, protocol, headers, timeout, sampler, batch sizes, span limits); this module
reads the switches that are otel_verl's own.

Bad values are the user's input. The core switches (``OTEL_VERL_ENABLED``,
``OTEL_SDK_DISABLED``) raise :class:`ConfigError` with a message naming the variable:
tracing stays off rather than guess. The optional features (content capture, validation
tracing, flow lines, output choices, sizes and timeouts) raise only where the user types
them (``otel-verl run``/``doctor`` load with ``strict=True``); inside a traced process a
bad value falls back to that feature's default with one warning per process, and
tracing as a whole goes on. So does an ``OTEL_VERL_*`` name that is none of
otel_verl's (a misspelt setting is ignored): refused where the user types it, a warning
naming the closest known name elsewhere.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from otel_verl import semconv as sc
from otel_verl.semconv import Role

logger = logging.getLogger("otel_verl")

TRACE_DIR = "VERL_TRACE_DIR"  # the legacy switch: files under this directory
FORCE = "OTEL_VERL_ENABLED"  # 1: trace even with no trace dir and no endpoint; 0: never
RUN_ID = "OTEL_VERL_RUN_ID"
RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"  # the SDK's; read by every OpenTelemetry SDK in the process
ROLE = "OTEL_VERL_ROLE"
FLOW_STDOUT = "OTEL_VERL_FLOW_STDOUT"
TRACE_VALIDATION = "OTEL_VERL_TRACE_VALIDATION"
JSONL_MAX_MB = "OTEL_VERL_JSONL_MAX_MB"
MAX_OPEN_SAMPLES = "OTEL_VERL_MAX_OPEN_SAMPLES"
MAX_QUEUE_MB = "OTEL_VERL_MAX_QUEUE_MB"  # each queue between the traced code and a file or endpoint
JSONL_MAX_TEXT_CHARS = "OTEL_VERL_JSONL_MAX_TEXT_CHARS"
OTLP_FILE = "OTEL_VERL_OTLP_FILE"  # 1/0: force the embedded OTLP-JSON files on/off
ACCELERATED = "OTEL_VERL_ACCELERATED"  # true (default): otel_verl.accelerated; false: the SDK's own parts
DEPRECATED_OTLP_EXPORTER = "OTEL_VERL_OTLP_EXPORTER"  # read as ACCELERATED: sdk is false, otel_verl true
OUTPUTS = "OTEL_VERL_OUTPUTS"  # more outputs: module:Class names, comma-separated (otel_verl.outputs.Output)
OFFLOAD = "OTEL_VERL_OFFLOAD"  # 1/0: outputs written by an export process (otel_verl.offload) in every process / none; default: rollout workers and the trainer
SHUTDOWN_TIMEOUT_S = "OTEL_VERL_SHUTDOWN_TIMEOUT_S"  # seconds a flush or shutdown may take, all outputs together
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SDK_DISABLED = "OTEL_SDK_DISABLED"
TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"

OWN_PREFIX = "OTEL_VERL_"
# otel_verl's variables that the tracing does not read, known so that a misspelt setting is
# told from them: those of its tools and demo, of the backends it ships
# (docker-compose.yml, collector-config/) and of its development scripts and tests.
OTHER_VARIABLES = (
    "OTEL_VERL_WHEEL_CACHE",  # doctor's sglang/vLLM wheels (tools/engine_wheels.py)
    "OTEL_VERL_CLICKHOUSE",  # report / query: a ClickHouse server's URL (tools/store/)
    "OTEL_VERL_DEMO_CACHE", "OTEL_VERL_DEMO_PROBE_DIR",  # the demo's tiny model, its probe
    "OTEL_VERL_REPLAY_GLOB",  # collector-config/otelcol-replay.yaml
    *(f"OTEL_VERL_{port}_PORT" for port in ("OTLP_GRPC", "OTLP_HTTP", "OTELCOL_METRICS", "JAEGER_UI", "TEMPO",
                                            "PROMETHEUS", "GRAFANA", "CLICKHOUSE_HTTP", "CLICKHOUSE_OTLP_GRPC",
                                            "CLICKHOUSE_OTLP_HTTP")),  # docker-compose.yml
    "OTEL_VERL_BIN_CACHE", "OTEL_VERL_BUILD_BINARIES", "OTEL_VERL_BUILD_TIMEOUT", "OTEL_VERL_SRC_CACHE",
    "OTEL_VERL_GO_BUILD_FLAGS", "OTEL_VERL_MLFLOW_VENV", "OTEL_VERL_TEST_MLFLOW",  # scripts/, tests/
    "OTEL_VERL_BUILD_LOCKED", "OTEL_VERL_TEST_WORKERS",  # scripts/, tests/
)

# Variables a worker process needs to trace like the driver does.
FORWARDED_PREFIXES = ("OTEL_", "OTEL_VERL_")
FORWARDED_NAMES = (TRACE_DIR, "DLC_JOB_ID")


# Kubernetes sends SIGKILL 30 s after SIGTERM; the process itself may need the rest.
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# Each queue (a writer's lines, a batch processor's spans, a rollout worker's spans on their
# way to its export process) holds at most this much: tens of MB a process however long a
# collector or a disk stalls, and room for a rollout worker's burst (1024 trajectories of 4
# turns ending at once overflowed 32 MB while the export process caught up:
# benchmarks/bench_worker_wrappers.py).
DEFAULT_MAX_QUEUE_MB = 64
DEFAULT_JSONL_MAX_TEXT_CHARS = 1 << 20


class ConfigError(ValueError):
    """A configuration value given by the user is invalid."""


class UnknownSetting(ConfigError):
    """An ``OTEL_VERL_*`` variable that is none of otel_verl's (:func:`known_names`)."""

    def __init__(self, name: str, closest: Optional[str]) -> None:
        self.name, self.closest = name, closest
        super().__init__(f"{name} is not a setting of otel_verl" + (f"; did you mean {closest}?" if closest else ""))


def known_names() -> frozenset:
    """Every ``OTEL_VERL_*`` name otel_verl knows: the settings, each defined once as a
    constant of this module (a new one is known by being defined), and
    :data:`OTHER_VARIABLES`."""
    own = re.compile(re.escape(OWN_PREFIX) + r"[A-Z0-9_]+")
    constants = (value for value in globals().values() if isinstance(value, str) and own.fullmatch(value))
    return frozenset((*constants, *OTHER_VARIABLES))


def unknown_settings(env: Optional[Mapping[str, str]] = None) -> list:
    """An :class:`UnknownSetting` for each variable of ``env`` named ``OTEL_VERL_*`` (in
    any case) that otel_verl does not know, with the closest known name where one is close."""
    env = os.environ if env is None else env
    known = known_names()
    by_suffix = {name[len(OWN_PREFIX):]: name for name in known}
    by_suffix["TRACE_DIR"] = TRACE_DIR  # the legacy switch, the one without the prefix
    unknown = []
    for name in sorted(env):
        if name.upper().startswith(OWN_PREFIX) and name not in known:
            close = difflib.get_close_matches(name.upper()[len(OWN_PREFIX):], by_suffix, n=1, cutoff=0.75)
            unknown.append(UnknownSetting(name, by_suffix[close[0]] if close else None))
    return unknown


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# opentelemetry-util-genai's content capturing modes. otel_verl emits no GenAI log events,
# so only the span modes put content anywhere: EVENT_ONLY captures nothing.
_CONTENT_ON_SPANS = {"span_only", "span_and_event"}
_CONTENT_NOWHERE = {"no_content", "event_only"}


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _capture_content(env: Mapping[str, str], name: str, default: bool) -> bool:
    """Whether message content goes on spans: a 1/0-style flag or a util-genai mode."""
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE or value in _CONTENT_ON_SPANS:
        return True
    if value in _FALSE or value in _CONTENT_NOWHERE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected true/false or one of NO_CONTENT, SPAN_ONLY, "
                      "EVENT_ONLY, SPAN_AND_EVENT")


_ACCELERATED_BY_OTLP_EXPORTER = {"otel_verl": True, "sdk": False}


def _accelerated(env: Mapping[str, str], name: str, default: bool) -> bool:
    """Whether otel_verl's accelerators (:mod:`otel_verl.accelerated`) stand in for the SDK's
    parts: ``name`` as a 1/0-style flag (blank is unset: the default is on), else the
    deprecated ``OTEL_VERL_OTLP_EXPORTER`` (``sdk``: false, ``otel_verl``: true), read with
    one warning."""
    raw = env.get(name)
    if raw is not None and raw.strip():
        if env.get(DEPRECATED_OTLP_EXPORTER) is not None:
            _warn_once(DEPRECATED_OTLP_EXPORTER, env[DEPRECATED_OTLP_EXPORTER],
                       f"otel_verl: {DEPRECATED_OTLP_EXPORTER} is deprecated and ignored: {name} is set")
        return _flag(env, name, default)
    old = env.get(DEPRECATED_OTLP_EXPORTER)
    if old is None or not old.strip():
        return default
    accelerated = _ACCELERATED_BY_OTLP_EXPORTER.get(old.strip().lower())
    if accelerated is None:
        raise ConfigError(f"{DEPRECATED_OTLP_EXPORTER}={old!r}: expected one of "
                          f"{', '.join(_ACCELERATED_BY_OTLP_EXPORTER)}")
    _warn_once(DEPRECATED_OTLP_EXPORTER, old, f"otel_verl: {DEPRECATED_OTLP_EXPORTER}={old.strip()} is deprecated; "
               f"read as {name}={str(accelerated).lower()}")
    return accelerated


_OUTPUT_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _output_names(env: Mapping[str, str], name: str, default: Tuple[str, ...]) -> Tuple[str, ...]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    names = tuple(item.strip() for item in raw.split(",") if item.strip())
    bad = [item for item in names if not _OUTPUT_NAME.match(item)]
    if bad:
        raise ConfigError(f"{name}={raw!r}: expected module:Class names, comma-separated (not {bad[0]!r})")
    return names


OTLP_PROTOCOLS = ("grpc", "http/protobuf", "http/json")


def otlp_protocol(signal: str, env: Optional[Mapping[str, str]] = None, endpoint: Optional[str] = None) -> str:
    """The OTLP protocol of ``signal`` (``TRACES``, ``METRICS``): its own variable, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` (another value than :data:`OTLP_PROTOCOLS` raises
    :class:`ConfigError`, naming the variable); neither set, guessed from ``endpoint`` (else
    the signal's or the general endpoint variable): port 4318 or a ``/v1/`` path is what an
    OTLP/HTTP receiver serves, anything else gets gRPC, the SDK's default."""
    env = os.environ if env is None else env
    for variable in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = env.get(variable) or ""
        protocol = raw.strip().lower()
        if protocol not in ("", *OTLP_PROTOCOLS):
            raise ConfigError(f"{variable}={raw!r}: expected one of {', '.join(OTLP_PROTOCOLS)}")
        if protocol:
            return protocol
    if endpoint is None:
        endpoint = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or env.get(OTLP_ENDPOINT) or ""
    return "http/protobuf" if (":4318" in endpoint or "/v1/" in endpoint) else "grpc"


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    return _positive(env, name, default, int, "a positive integer")


def _positive_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return _positive(env, name, default, float, "a positive number of seconds")


def _positive(env: Mapping[str, str], name: str, default: Any, parse: Any, expected: str) -> Any:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected {expected}") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise ConfigError(f"{name}={raw!r}: expected {expected}")
    return value


_OFFLOADING_ROLES = frozenset({Role.AGENT_LOOP_WORKER.value, Role.TRAINER.value})  # see Settings.offloads


@dataclass(frozen=True)
class Settings:
    trace_dir: Optional[str]
    otlp_endpoint: Optional[str]
    forced: Optional[bool]  # None: decide from trace dir / endpoint
    flow_stdout: bool
    trace_validation: bool
    capture_content: bool
    jsonl_max_bytes: int
    max_open_samples: int
    max_queue_bytes: int
    otlp_file: Optional[bool]
    sdk_disabled: bool
    offload: Optional[bool] = None  # None: decided by role
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # one flush or shutdown, every output together
    jsonl_max_text_chars: int = DEFAULT_JSONL_MAX_TEXT_CHARS  # each text of a trajectory JSONL line is cut there
    outputs: Tuple[str, ...] = ()  # more outputs, as module:Class names (otel_verl.outputs)
    accelerated: bool = True  # otel_verl's OTLP exporter, batch processor and metric aggregation, or the SDK's

    def offloads(self, role: str) -> bool:
        """Whether a process of ``role`` writes its outputs from an export process
        (:mod:`otel_verl.offload`). By default the two whose outputs cost per sample:
        a rollout worker, whose event loop runs every agent loop of the worker (the
        outputs' formatting, encoding and sending would take that loop's CPU and GIL
        per trajectory), and the trainer, whose training loop would share the GIL with
        the writing of a batch stage's row per trajectory (its process then spends less
        than half the CPU a step on tracing: ``docs/PERFORMANCE.md``).
        Elsewhere the spans are few and the extra process (its start-up, its memory) is
        not worth it. ``OTEL_VERL_OFFLOAD`` set wins for every role."""
        if self.offload is not None:
            return self.offload
        return role in _OFFLOADING_ROLES

    @property
    def enabled(self) -> bool:
        if self.sdk_disabled or self.forced is False:
            return False
        return bool(self.forced or self.trace_dir or self.otlp_endpoint)

    @property
    def write_otlp_files(self) -> bool:
        """The embedded default: a trace dir and no endpoint gives ``{trace_dir}/otlp/``."""
        if not self.trace_dir:
            return False
        if self.otlp_file is not None:
            return self.otlp_file
        return not self.otlp_endpoint


_warned: set = set()  # (variable, value) pairs already warned about in this process
_warned_lock = threading.Lock()


class _Optional:
    """Reads optional-feature variables: a bad value raises when ``strict``, else it gives
    the default and one warning per process (per variable and value)."""

    def __init__(self, env: Mapping[str, str], strict: bool) -> None:
        self.env = env
        self.strict = strict

    def __call__(self, parse: Any, name: str, default: Any, *, shown: str = "") -> Any:
        """``parse(env, name, default)``; on a bad value ``default``, named ``shown`` in
        the warning when its repr would not say what it means."""
        try:
            return parse(self.env, name, default)
        except ConfigError as exc:
            if self.strict:
                raise
            _warn_once(name, self.env.get(name), f"otel_verl: {exc}; using the default ({shown or repr(default)}), "
                       "tracing goes on")
            return default


def _warn_once(name: str, raw: Any, message: str) -> None:
    with _warned_lock:
        if (name, raw) in _warned:
            return
        _warned.add((name, raw))
    logger.warning("%s", message)


def load(env: Optional[Mapping[str, str]] = None, trace_dir: Optional[str] = None, *,
         strict: bool = False) -> Settings:
    """Read the settings; ``trace_dir`` given in code wins over ``VERL_TRACE_DIR``.

    Bad core switches always raise :class:`ConfigError`; bad optional-feature values
    and unknown ``OTEL_VERL_*`` names (:class:`UnknownSetting`) raise only with ``strict``
    (the CLI, where the user typed them), else they fall back to their default (or are
    ignored) with one warning."""
    env = os.environ if env is None else env
    for unknown in unknown_settings(env):
        if strict:
            raise unknown
        _warn_once(unknown.name, None, f"otel_verl: {unknown}; ignored, tracing goes on")
    optional = _Optional(env, strict)
    exporter = env.get(TRACES_EXPORTER, "").strip().lower()
    endpoint = env.get(OTLP_TRACES_ENDPOINT) or env.get(OTLP_ENDPOINT) or None
    if exporter == "none":
        endpoint = None
    forced_raw = env.get(FORCE)
    return Settings(
        trace_dir=trace_dir or env.get(TRACE_DIR) or None,
        otlp_endpoint=endpoint,
        forced=None if forced_raw is None else _flag(env, FORCE, False),
        flow_stdout=optional(_flag, FLOW_STDOUT, False, shown="off"),
        trace_validation=optional(_flag, TRACE_VALIDATION, False, shown="off"),
        capture_content=optional(_capture_content, CAPTURE_CONTENT, False, shown="no content"),
        jsonl_max_bytes=optional(_positive_int, JSONL_MAX_MB, 100) * 1024 * 1024,
        max_open_samples=optional(_positive_int, MAX_OPEN_SAMPLES, 1 << 16),
        max_queue_bytes=optional(_positive_int, MAX_QUEUE_MB, DEFAULT_MAX_QUEUE_MB) << 20,
        jsonl_max_text_chars=optional(_positive_int, JSONL_MAX_TEXT_CHARS, DEFAULT_JSONL_MAX_TEXT_CHARS),
        otlp_file=optional(_tristate, OTLP_FILE, None, shown="on when no endpoint is set"),
        sdk_disabled=_flag(env, SDK_DISABLED, False),
        offload=optional(_tristate, OFFLOAD, None, shown="rollout workers and the trainer"),
        shutdown_timeout_s=optional(_positive_seconds, SHUTDOWN_TIMEOUT_S, DEFAULT_SHUTDOWN_TIMEOUT_S),
        outputs=optional(_output_names, OUTPUTS, ()),
        accelerated=optional(_accelerated, ACCELERATED, True, shown="true"),
    )


def _tristate(env: Mapping[str, str], name: str, default: Optional[bool]) -> Optional[bool]:
    """A 1/0-style flag whose absence (``default``, ``None``) leaves the choice to otel_verl."""
    return default if env.get(name) is None else _flag(env, name, False)


# Names of variables that hold credentials: OTLP exporter headers carry auth tokens; keys,
# tokens and passwords of any tool the job forwards.
_SECRET_SUFFIXES = ("_HEADERS", "_KEY", "_TOKEN", "_PASSWORD", "_SECRET", "_CREDENTIALS")
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<password>[^/@\s]*)@")


def is_secret(name: str, value: Optional[str] = None) -> bool:
    """Whether a variable holds credentials (a secret's name, or a URL with a password
    in its value): never in Ray's runtime env (Ray logs it), a config verl prints, or the
    CLI's output."""
    return name.upper().endswith(_SECRET_SUFFIXES) or (value is not None and _URL_PASSWORD.search(value) is not None)


def redacted(text: str) -> str:
    """``text`` with the password of every URL in it written as ``***``."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


def forwarded_env(env: Optional[Mapping[str, str]] = None) -> dict:
    """The variables to copy into every Ray worker's runtime env: otel_verl's and the
    standard ``OTEL_*`` ones, secrets left out (:func:`is_secret`). Those reach the
    workers from the environment Ray's processes inherit (the shell that starts Ray)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items()
            if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and not is_secret(k, v)}


def secret_names(env: Optional[Mapping[str, str]] = None) -> list:
    """The variables :func:`forwarded_env` leaves out because they hold credentials."""
    env = os.environ if env is None else env
    return sorted(k for k, v in env.items()
                  if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and is_secret(k, v))


def with_run_resource(env_vars: Mapping[str, str]) -> dict:
    """``env_vars`` with the run id (``OTEL_VERL_RUN_ID``, where set) added to
    ``OTEL_RESOURCE_ATTRIBUTES`` as ``verl.run_id``. The LLM engines (sglang, vLLM) build
    their own tracing resource from that variable, so their spans land in the run's files
    too. A ``verl.run_id`` already there wins."""
    out = dict(env_vars)
    if out.get(RUN_ID):
        out[RESOURCE_ATTRIBUTES] = _with_resource_attribute(out.get(RESOURCE_ATTRIBUTES, ""), sc.RUN_ID, out[RUN_ID])
    return out


def _with_resource_attribute(attributes: str, key: str, value: str) -> str:
    """``attributes`` (the comma-separated ``key=value`` list of OTEL_RESOURCE_ATTRIBUTES,
    values percent-encoded) with ``key=value`` added unless it names ``key`` already."""
    if any(item.split("=", 1)[0].strip() == key for item in attributes.split(",")):
        return attributes
    item = f"{key}={urllib.parse.quote(value, safe='')}"
    return f"{attributes},{item}" if attributes.strip() else item
