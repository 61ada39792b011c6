"""Whether a verl launch makes its sglang servers report per-request timing, read from its
Hydra overrides or its YAML config; and the override ``otel-verl run`` adds for it.

Only the few keys that decide it are read (:data:`KEYS`); the config is not composed, so
no verl is needed. What it reads:

- Hydra overrides: a list (``key=value``, ``+key=value``, ``++key=value``, ``~key``; the
  last one of a key wins), a file of them (one or more per line, ``#`` comments, shell
  quoting; a launch script works too: what is no override is skipped), or Hydra's
  ``.hydra/overrides.yaml`` (a YAML list of them).
- A YAML verl config (``.yaml``/``.yml``/``.json``): a mapping, e.g. Hydra's
  ``.hydra/config.yaml`` of a run or a config of one's own.

A value that is a shell variable or a Hydra interpolation (``$...``) is unknown.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any, Dict, Iterable, List, Sequence, Tuple

from otel_verl.server_timing import (
    DISABLE_LOG_STATS_KEY,
    ENABLE_METRICS_KEY,
    ENABLE_METRICS_OVERRIDE,
    PROMETHEUS_ENABLE_KEY,
)

ROLLOUT_NAME_KEY = "actor_rollout_ref.rollout.name"
KEYS = (ROLLOUT_NAME_KEY, ENABLE_METRICS_KEY, PROMETHEUS_ENABLE_KEY, DISABLE_LOG_STATS_KEY)
YAML_SUFFIXES = (".yaml", ".yml", ".json")
MAIN_PPO = "verl.trainer.main_ppo"

UNKNOWN = object()  # a value this reading cannot know ($VAR, ${...})
_OVERRIDE = re.compile(r"(\+\+|\+|~)?([A-Za-z_][\w.\-/]*)(@[\w.]*)?(=(.*))?", re.S)
_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")

# sglang_timing states
ON, OFF, NOT_SGLANG, UNDECIDED, REFUSED = "on", "off", "not sglang", "undecided", "refused"


class ConfigError(ValueError):
    """A config that cannot be read; the message names it and says why."""


Values = Dict[str, Any]  # key of KEYS -> its value (str, bool, None, UNKNOWN); absent: not set


def _scalar(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if "$" in text:
        return UNKNOWN
    if text.lower() in ("", "null", "none"):
        return None
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    return text


def parse_overrides(tokens: Iterable[str]) -> Values:
    """The values :data:`KEYS` get from these Hydra overrides; other tokens are skipped."""
    found: Values = {}
    for token in tokens:
        match = _OVERRIDE.fullmatch(token.strip())
        if not match:
            continue
        prefix, key, _, assignment, value = match.groups()
        if key not in KEYS:
            continue
        if prefix == "~":
            found.pop(key, None)  # deleted: verl's default again
        elif assignment is not None:
            found[key] = _scalar(value)
    return found


def _from_mapping(data: Dict[str, Any]) -> Values:
    found: Values = {}
    for key in KEYS:
        node: Any = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            found[key] = _scalar(node)
    return found


def _override_tokens(text: str) -> List[str]:
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"cannot split into overrides ({exc})") from None
    return [t for t in tokens if "=" in t and _OVERRIDE.fullmatch(t)]


def _read_file(path: str) -> Values:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if path.lower().endswith(YAML_SUFFIXES):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading a YAML config needs PyYAML (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
        if isinstance(data, dict):
            return _from_mapping(data)
        if isinstance(data, list) and all(isinstance(item, str) for item in data):
            return parse_overrides(data)  # Hydra's .hydra/overrides.yaml
        raise ConfigError(f"{path}: neither a verl config (a YAML mapping) nor a list of Hydra overrides")
    try:
        tokens = _override_tokens(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not tokens:
        raise ConfigError(f"{path}: no Hydra override (key=value) in it")
    return parse_overrides(tokens)


def read(sources: Sequence[str]) -> Values:
    """The values of :data:`KEYS` from ``sources``, in order (a later one wins): each a file
    (see the module docs) or Hydra overrides given inline (``key=value``, several separated
    by spaces). Raises :class:`ConfigError` for a source that cannot be read."""
    found: Values = {}
    for source in sources:
        if os.path.exists(source):
            found.update(_read_file(source))
            continue
        try:
            tokens = shlex.split(source)
        except ValueError as exc:
            raise ConfigError(f"{source!r}: cannot split into overrides ({exc})") from None
        bad = [t for t in tokens if not (_OVERRIDE.fullmatch(t) and ("=" in t or t.startswith("~")))]
        if not tokens or bad:
            raise ConfigError(f"{source!r}: no such file, and not a Hydra override (key=value)")
        found.update(parse_overrides(tokens))
    return found


def _describe(value: Any) -> str:
    return "unknown" if value is UNKNOWN else str(value)


def sglang_timing(values: Values) -> Tuple[str, str, str]:
    """``(state, detail, fix)``: whether verl starts its sglang servers with
    ``enable_metrics`` (which the per-request timing needs) under these values. A rollout
    engine that is not given counts as sglang: the timing question is open then."""
    engine = values.get(ROLLOUT_NAME_KEY)
    if isinstance(engine, str) and engine != "sglang":
        return NOT_SGLANG, f"rollout engine {engine}: no sglang server to report it", ""
    metrics = values.get(ENABLE_METRICS_KEY)
    prometheus = values.get(PROMETHEUS_ENABLE_KEY)
    log_stats_off = values.get(DISABLE_LOG_STATS_KEY, True)  # verl's default: True
    if prometheus is True and log_stats_off is not False:
        return (REFUSED, f"{PROMETHEUS_ENABLE_KEY}=True needs {DISABLE_LOG_STATS_KEY}=False: verl refuses to start "
                f"its rollout servers otherwise",
                f"add {DISABLE_LOG_STATS_KEY}=False, or use {ENABLE_METRICS_OVERRIDE} instead of prometheus")
    if metrics is True or prometheus is True:
        switch = ENABLE_METRICS_KEY if metrics is True else PROMETHEUS_ENABLE_KEY
        return ON, f"sglang reports per-request timing ({switch}=True)", ""
    if metrics is UNKNOWN or prometheus is UNKNOWN:
        return (UNDECIDED, f"depends on a variable: {ENABLE_METRICS_KEY}={_describe(metrics)}, "
                f"{PROMETHEUS_ENABLE_KEY}={_describe(prometheus)}", "")
    return (OFF, "sglang will report only e2e_latency: the trajectory JSONL's sglang_queue_time_ms and "
            "sglang_ttft_ms stay null, the report has no queue/prefill/decode split",
            f"add the Hydra override {ENABLE_METRICS_OVERRIDE} (otel-verl run adds it to {MAIN_PPO})")


def runs_main_ppo(command: Sequence[str]) -> bool:
    """Whether ``command`` starts verl's Hydra entry point ``verl.trainer.main_ppo``
    (``python -m verl.trainer.main_ppo ...`` or its script path)."""
    args = list(command)
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args) and args[i + 1] == MAIN_PPO:
            return True
        if arg.replace(os.sep, "/").endswith("verl/trainer/main_ppo.py"):
            return True
    return False


def run_overrides(command: Sequence[str]) -> List[str]:
    """The overrides ``otel-verl run`` appends to ``command``: :data:`ENABLE_METRICS_OVERRIDE`
    when it runs ``verl.trainer.main_ppo`` with a rollout engine that is sglang or not given
    on the command line (a config file may set it; verl's other engines ignore the key),
    unless the command sets sglang's metrics itself (the user's choice stands)."""
    if not runs_main_ppo(command):
        return []
    values = parse_overrides(arg for arg in command if not arg.startswith("-"))
    engine = values.get(ROLLOUT_NAME_KEY)
    if isinstance(engine, str) and engine != "sglang":
        return []
    if ENABLE_METRICS_KEY in values or values.get(PROMETHEUS_ENABLE_KEY) is True:
        return []
    return [ENABLE_METRICS_OVERRIDE]

