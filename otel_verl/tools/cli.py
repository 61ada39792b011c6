"""The ``otel-verl`` command."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any, Callable, Dict, List, Tuple

import click

from otel_verl import settings
from otel_verl.semconv import Role


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """OpenTelemetry tracing for verl."""


_SGLANG_TIMING_HELP = ("Add the Hydra override that makes verl's sglang servers report per-request timing "
                       "(the trajectory JSONL's sglang_* fields, the report's queue/prefill/decode split).")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--trace-dir", type=click.Path(file_okay=False), help="Write legacy files and OTLP-JSON here (VERL_TRACE_DIR).")
@click.option("--sglang-timing/--no-sglang-timing", default=True, show_default=True,
              help=_SGLANG_TIMING_HELP + " Only to a verl.trainer.main_ppo command whose rollout engine is sglang "
                   "or not given on its command line, and that does not set sglang's metrics itself.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(trace_dir: str | None, sglang_timing: bool, command: Tuple[str, ...]) -> None:
    """Run COMMAND (e.g. python -m verl.trainer.main_ppo ...) with tracing on in every Ray process.

    Put the command after `--`. Its exit code is passed through.
    """
    env = launch_env(os.environ, trace_dir)
    try:
        settings.load(env, strict=True)  # typed by the user here: say what is wrong before the run
    except settings.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if not settings.load(env).enabled:
        click.echo("otel-verl: nothing to export to: set --trace-dir, VERL_TRACE_DIR or OTEL_EXPORTER_OTLP_ENDPOINT", err=True)
    command = tuple(command) + tuple(_sglang_timing_overrides(command) if sglang_timing else ())
    try:
        completed = subprocess.run(list(command), env=env)
    except FileNotFoundError:
        raise click.UsageError(f"command not found: {command[0]}") from None
    sys.exit(completed.returncode if completed.returncode >= 0 else 128 - completed.returncode)


def _sglang_timing_overrides(command: Tuple[str, ...]) -> list:
    from otel_verl.tools.verl_config import run_overrides

    added = run_overrides(command)
    if added:
        click.echo(f"otel-verl: adding {' '.join(added)} (sglang per-request timing; --no-sglang-timing leaves it out)",
                   err=True)
    return added


def launch_env(base: "os._Environ[str] | dict", trace_dir: str | None = None) -> dict:
    """The environment ``otel-verl run`` gives its command."""
    import uuid

    env = dict(base)
    if trace_dir:
        env[settings.TRACE_DIR] = os.path.abspath(trace_dir)
    env.setdefault(settings.RUN_ID, uuid.uuid4().hex)
    site_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_sitecustomize")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, env.get("PYTHONPATH", "")) if p)
    return env


@main.command()
@click.option("--trace-dir", type=click.Path(file_okay=False), required=True, help="Where every output goes.")
@click.option("--steps", type=click.IntRange(1, 1000), default=2, show_default=True)
@click.option("--prompts", type=click.IntRange(1, 4096), default=4, show_default=True, help="Prompts per step.")
@click.option("--n", "n", type=click.IntRange(1, 64), default=4, show_default=True, help="Trajectories per prompt (rollout.n).")
@click.option("--agent", type=click.Choice(["single", "tool"]), default="tool", show_default=True)
@click.option("--trainer", type=click.Choice(["v0", "v1", "separation"]), default="v0", show_default=True,
              help="verl's RayPPOTrainer (v0), the TransferQueue trainer of verl.trainer.main_ppo (v1) or the "
                   "experimental disaggregated SeparateRayPPOTrainer (separation).")
@click.option("--mode", type=click.Choice(["sync", "colocate_async", "separate_async"]), default="sync",
              show_default=True, help="v1 trainer mode (trainer.v1.trainer_mode).")
def demo(trace_dir: str, steps: int, prompts: int, n: int, agent: str, trainer: str, mode: str) -> None:
    """Run a traced CPU demo: real verl (trainer, agent loops, reward) on a local Ray
    cluster with stand-ins for the GPU parts; writes every output to TRACE_DIR."""
    from otel_verl.demo.traced import describe, run_demo

    if trainer == "v1" and mode == "separate_async" and prompts % 2:
        raise click.BadParameter("separate_async trains each step in 2 mini-batches: use an even --prompts", param_hint="--prompts")
    extra = {"mode": mode} if trainer == "v1" else {}
    summary = run_demo(trace_dir, steps=steps, prompts=prompts, n=n, agent=agent, trainer=trainer, **extra)
    click.echo(describe(summary))


@main.command()
@click.option("--sglang-timing/--no-sglang-timing", default=True, show_default=True,
              help=_SGLANG_TIMING_HELP + " verl's other rollout engines ignore it.")
def overrides(sglang_timing: bool) -> None:
    """Print the Hydra overrides that switch tracing on for verl.trainer.main_ppo."""
    from otel_verl.activation import hydra_overrides
    from otel_verl.server_timing import ENABLE_METRICS_OVERRIDE

    for line in hydra_overrides() + ([ENABLE_METRICS_OVERRIDE] if sglang_timing else []):
        click.echo(line)
    secrets = settings.secret_names()
    if secrets:
        click.echo(f"otel-verl: {', '.join(secrets)} left out (credentials: verl prints its config, Ray logs "
                   "its runtime env): Ray's workers inherit them from the environment that starts Ray (this "
                   "shell for a local ray.init, `ray start` on a cluster)", err=True)


def _print_rich(draw) -> None:
    """Print what ``draw(console)`` renders: straight to a terminal; elsewhere (pipes,
    files, tests) wide and without rich's trailing padding."""
    from rich.console import Console

    if sys.stdout.isatty():
        draw(Console(highlight=False))
        return
    console = Console(width=200, highlight=False, no_color=True)
    with console.capture() as capture:
        draw(console)
    click.echo("\n".join(line.rstrip() for line in capture.get().splitlines()))


# --------------------------------------------------------------------------- doctor

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
# The components a run may lack, with where their hooks are needed; every other one's are required.
OPTIONAL_COMPONENTS = {
    "llm_server": "needed only where this LLM server runs",
    "trainer_separation": "needed only with verl's experimental disaggregated trainer",
    "reward_loop": "needed only where verl's reward loop workers run",
}
VERL_FIX = "install otel-verl[verl] where training runs: pip install 'otel-verl[verl]'"
_STATE_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", INFO: "dim"}


@dataclasses.dataclass
class _Check:
    area: str  # versions, settings, output, hooks: one table each
    name: str
    state: str  # OK, WARN, FAIL, INFO
    detail: str = ""
    fix: str = ""  # one line, for WARN and FAIL
    component: str = ""  # hooks: the instrumentation module that owns the hook
    cause: str = ""  # checks failing for one cause are one problem: hooks whose module one error keeps out

    def __post_init__(self) -> None:
        # an endpoint's password never reaches the screen (settings.redacted)
        self.detail, self.fix = settings.redacted(self.detail), settings.redacted(self.fix)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _verl_here() -> bool:
    """Whether this Python can import verl (the hooks can be checked here)."""
    import importlib.util

    return importlib.util.find_spec("verl") is not None


def _version_checks() -> list:
    from packaging.requirements import Requirement

    from otel_verl.instrumentation import all_hooks
    from otel_verl.instrumentation.package import _instruments
    from otel_verl.version import __version__

    checks = [_Check("versions", "otel-verl", OK, __version__), _Check("versions", "python", INFO, sys.version.split()[0])]
    verl_req = Requirement(_instruments[0])
    verl = _version("verl")
    if verl is None and not _verl_here():  # one problem, not one per hook
        checks.append(_Check("versions", "verl", FAIL, f"not installed here: {len(all_hooks())} hooks cannot be checked",
                             VERL_FIX))
    elif verl is None:
        checks.append(_Check("versions", "verl", FAIL, "not installed", f"pip install 'otel-verl[verl]' (verl {verl_req.specifier})"))
    elif not verl_req.specifier.contains(verl, prereleases=True):
        checks.append(_Check("versions", "verl", FAIL, f"{verl} is outside the supported range {verl_req.specifier}",
                             f"install a supported verl: pip install 'verl{verl_req.specifier}'"))
    else:
        checks.append(_Check("versions", "verl", OK, f"{verl} (supported: {verl_req.specifier})"))
    ray = _version("ray")
    if ray:
        checks.append(_Check("versions", "ray", OK, ray))
    elif _verl_here():
        checks.append(_Check("versions", "ray", FAIL, "not installed", "pip install ray (verl runs on Ray)"))
    else:  # verl's own problem above
        checks.append(_Check("versions", "ray", INFO, "not installed (comes with otel-verl[verl])"))
    api, sdk = _version("opentelemetry-api"), _version("opentelemetry-sdk")
    for dist in ("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
                 "opentelemetry-exporter-otlp-proto-http"):
        found = _version(dist)
        checks.append(_Check("versions", dist, OK if found else WARN, found or "not installed",
                             "" if found else f"pip install {dist}"))
    if api and sdk and api != sdk:
        checks.append(_Check("versions", "opentelemetry api/sdk", WARN, f"api {api} != sdk {sdk}",
                             "install matching versions: pip install -U opentelemetry-api opentelemetry-sdk"))
    return checks


def _hook_checks() -> list:
    """Install every hook in this process, import the verl modules they target, read
    :func:`hooks.status`. Import noise (verl's warnings) is swallowed. A hook whose
    module cannot be imported here (it imports sglang or vLLM) is checked on the
    installed source instead (:mod:`otel_verl.tools.hookcheck`)."""
    import contextlib
    import importlib
    import io
    import warnings

    from otel_verl.tools import hookcheck
    from otel_verl.instrumentation import all_hooks, hooks

    targets = all_hooks()
    if not _verl_here():  # every hook is verl's or runs in its processes: one line, the problem is verl's
        return [_Check("hooks", "not checked", INFO, f"verl is not installed here ({len(targets)} hooks)")]
    specs = [(h.module, h.target, h.params) for h in targets]
    sources = hookcheck.check_hooks(specs, hookcheck.installed_trees(m.split(".", 1)[0] for m, _, _ in specs))
    source_of = {r.hook: r for r in sources}
    hooks.install_all(targets)
    import_errors: dict = {}
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for module in dict.fromkeys(h.module for h in targets):
            try:
                importlib.import_module(module)
            except (Exception, SystemExit) as exc:  # any import failure is a finding, not a crash
                import_errors[module] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    status = hooks.status()
    checks = []
    for hook in targets:
        state, reason = status.get(hook.name, (hooks.PENDING, ""))
        needed_where = OPTIONAL_COMPONENTS.get(hook.component)
        check = _Check("hooks", hook.name, OK, "installs", component=hook.component)
        if state == hooks.INSTALLED:
            pass
        elif hook.module in import_errors:
            source = source_of[hook.name]
            check.detail = f"not importable here: {import_errors[hook.module]}; source: {_source_detail(source)}"
            if needed_where is None:
                check.state, check.fix = FAIL, "install verl with what its agent loop imports: pip install 'otel-verl[verl]'"
                check.cause = f"not importable here: {import_errors[hook.module]}"
            elif source.ok or source.state == hookcheck.UNAVAILABLE:
                check.state = INFO
                check.detail += f" ({needed_where})"
            else:
                check.state, check.fix = WARN, "use a verl in the supported range (see versions above) or report the drift"
        elif state == hooks.SKIPPED:
            check.state, check.detail = (WARN if needed_where else FAIL), f"skipped: {reason}"
            check.fix = "use a verl in the supported range (see versions above) or report the drift"
        else:
            check.state, check.detail = WARN, f"{state}: {reason}"
        checks.append(check)
    return checks


def _source_detail(result, with_source: bool = True) -> str:
    """A :class:`hookcheck.HookSource` in words."""
    from otel_verl.tools import hookcheck

    if result.state == hookcheck.UNAVAILABLE:
        return f"{result.detail} (see engine sources)"
    text = "parameters found" if result.state == hookcheck.FOUND else result.state
    text += f": {result.detail}" if result.detail else ""
    return f"{text} ({result.source})" if with_source else text


def _engine_source_checks(paths: Tuple[str, ...], fetch: bool) -> list:
    """The hooks into sglang and vLLM, checked on their source: the wheels or directories
    in ``paths``, else the wheel cache (filled first when ``fetch``: verl's pinned versions
    and the newest). For sglang also: which of the ``meta_info`` keys the trajectory
    file's timings read it writes."""
    from otel_verl.tools import engine_wheels, hookcheck
    from otel_verl.instrumentation import all_hooks

    checks = []
    if fetch:
        checks += _fetch_engine_wheels()
    try:
        trees = [hookcheck.open_source(p) for p in paths] if paths else [
            engine_wheels.source_tree(w) for w in engine_wheels.cached_wheels()]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--engine-source") from exc
    if not trees:
        return checks + [_Check("engine sources", "sglang, vllm", INFO, f"no engine wheels in {engine_wheels.cache_dir()}")]
    hooks_by_package: dict = {}
    for hook in all_hooks():
        hooks_by_package.setdefault(hook.module.split(".", 1)[0], []).append(hook)
    for tree in trees:
        area = f"engine sources: {tree.label}"  # one table per source
        packages = sorted(p for p in tree.packages() if p in hooks_by_package)
        if not packages:
            checks.append(_Check(area, ", ".join(sorted(tree.packages())) or "-", INFO, "no hook targets this package"))
            continue
        hooks_here = [h for p in packages for h in hooks_by_package[p]]
        for hook, result in zip(hooks_here, hookcheck.check_hooks([(h.module, h.target, h.params) for h in hooks_here], [tree])):
            state = OK if result.state == hookcheck.FOUND else INFO if result.ok else WARN
            checks.append(_Check(area, hook.name, state, _source_detail(result, with_source=False),
                                 "" if result.ok else f"the wrapper would be skipped with {tree.label}: report the drift"))
        if "sglang" in tree.packages():
            # Keys it never writes are normal (the exporter also reads other versions'
            # names); a timing field it leaves null is worth knowing, but nothing to fix here.
            meta = hookcheck.check_meta_keys(tree)
            detail = f"writes {', '.join(meta.written) or 'none'}"
            if meta.absent:
                detail += f"; never writes {', '.join(meta.absent)}"
            if meta.null_fields:
                detail += f"; so the trajectory file's {', '.join(meta.null_fields)} stay null"
            checks.append(_Check(area, "meta_info keys the trajectory timings read", INFO if meta.null_fields else OK, detail))
    return checks


def _fetch_engine_wheels() -> list:
    from otel_verl.tools import engine_wheels

    checks = []
    pinned = engine_wheels.pinned_versions()
    for engine in engine_wheels.ENGINES:
        versions = [pinned[engine]] if engine in pinned else []
        try:
            versions.append(engine_wheels.newest_version(engine))
            for version in dict.fromkeys(versions):
                engine_wheels.fetch(engine, version)
        except engine_wheels.RegistryUnavailable as exc:
            checks.append(_Check("engine sources", f"fetch {engine}", WARN, str(exc),
                                 "check the network / pip's index settings, or pass --engine-source WHEEL_OR_DIR"))
    return checks


def _trace_dir_check(trace_dir: str | None) -> _Check:
    import tempfile

    if not trace_dir:
        return _Check("output", "trace dir", INFO, "not set (no legacy files, no OTLP-JSON files)")
    path = os.path.abspath(trace_dir)
    probe = path
    while not os.path.exists(probe):  # the first run creates it: its nearest existing ancestor must take it
        probe = os.path.dirname(probe)
    fix = f"choose a writable directory: VERL_TRACE_DIR=/writable/path (or fix the permissions of {probe})"
    if not os.path.isdir(probe):
        return _Check("output", "trace dir", FAIL, f"{path}: {probe} is not a directory", fix)
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".otel-verl-doctor-"):
            pass
    except OSError as exc:
        return _Check("output", "trace dir", FAIL, f"{path}: cannot create a file in {probe} ({exc.strerror or exc})", fix)
    where = "writable" if probe == path else f"will be created (in writable {probe})"
    return _Check("output", "trace dir", OK, f"{path}: {where}")


def _endpoint_check(endpoint: str | None, timeout: float) -> _Check:
    import socket
    import urllib.parse

    if not endpoint:
        return _Check("output", "OTLP endpoint", INFO, "not set (spans go to {trace_dir}/otlp/ files when a trace dir is set)")
    raw = endpoint if "://" in endpoint else "http://" + endpoint
    fix = f"start the collector at {endpoint} or fix/unset OTEL_EXPORTER_OTLP_ENDPOINT (unset: spans go to {{trace_dir}}/otlp/)"
    try:
        parsed = urllib.parse.urlsplit(raw)
        host, port = parsed.hostname, parsed.port
    except ValueError as exc:
        return _Check("output", "OTLP endpoint", FAIL, f"{endpoint}: not a URL ({exc})", "set OTEL_EXPORTER_OTLP_ENDPOINT=http://host:4317")
    if not host:
        return _Check("output", "OTLP endpoint", FAIL, f"{endpoint}: no host", "set OTEL_EXPORTER_OTLP_ENDPOINT=http://host:4317")
    if port is None:
        protocol = settings.otlp_protocol("TRACES", endpoint=raw)
        port = 443 if parsed.scheme == "https" else (4318 if protocol.startswith("http") else 4317)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        return _Check("output", "OTLP endpoint", FAIL, f"{host}:{port} unreachable ({exc.strerror or exc})", fix)
    return _Check("output", "OTLP endpoint", OK, f"{host}:{port} accepts connections")


def _settings_checks(env: dict) -> tuple:
    """``(checks, settings or None)``: otel_verl's variables and the OTLP protocol."""
    unknown = settings.unknown_settings(env)
    checks = [_Check("settings", "environment", FAIL, str(u), f"rename it to {u.closest}" if u.closest else f"unset {u.name}")
              for u in unknown]  # each named; the rest is still checked
    env = {k: v for k, v in env.items() if k not in {u.name for u in unknown}}
    try:
        cfg = settings.load(env, strict=True)
    except settings.ConfigError as exc:
        var = str(exc).split("=", 1)[0]
        return checks + [_Check("settings", "environment", FAIL, str(exc), f"set {var} to a valid value or unset it")], None
    if cfg.otlp_endpoint:
        from otel_verl import outputs

        try:
            outputs.otlp_exporter(cfg).shutdown()  # the exporter a run would build
        except settings.ConfigError as exc:
            var = str(exc).split("=", 1)[0]
            checks.append(_Check("settings", "OTLP protocol", FAIL, str(exc),
                                 f"set {var} to one of {', '.join(settings.OTLP_PROTOCOLS)}, or unset it"))
        except Exception as exc:  # noqa: BLE001 - a broken exporter install is a finding
            checks.append(_Check("settings", "OTLP exporter", FAIL, f"{type(exc).__name__}: {exc}",
                                 "pip install -U opentelemetry-exporter-otlp"))
    if cfg.enabled:
        outputs = [o for o, on in (("legacy files", cfg.trace_dir), ("OTLP-JSON files", cfg.write_otlp_files),
                                   ("OTLP", cfg.otlp_endpoint)) if on]
        checks.append(_Check("settings", "tracing", OK, "on: " + ", ".join(outputs or ["in-process only (OTEL_VERL_ENABLED=1)"])))
        from otel_verl import outputs as outputs_mod

        try:
            metrics = outputs_mod.metrics_outputs(cfg)
            checks.append(_Check("settings", "metrics", OK, "to: " + ", ".join(metrics) if metrics
                                 else "off (OTEL_METRICS_EXPORTER=none, or no endpoint and no OTLP-JSON files)"))
        except ValueError as exc:
            checks.append(_Check("settings", "metrics", FAIL, str(exc), "set OTEL_METRICS_EXPORTER to otlp, console or none"))
        offloading = [role.value for role in Role if cfg.offloads(role.value)]
        checks.append(_Check("settings", "export process", OK,
                             f"outputs written by an export process in: {', '.join(offloading)}" if offloading
                             else "none: every process writes its own outputs (OTEL_VERL_OFFLOAD=0)"))
    elif cfg.sdk_disabled or cfg.forced is False:
        checks.append(_Check("settings", "tracing", WARN, "forced off (OTEL_SDK_DISABLED / OTEL_VERL_ENABLED=0)",
                             "unset OTEL_SDK_DISABLED and OTEL_VERL_ENABLED to trace"))
    else:
        checks.append(_Check("settings", "tracing", WARN, "off: nothing to export to",
                             "set VERL_TRACE_DIR or OTEL_EXPORTER_OTLP_ENDPOINT, or launch with otel-verl run --trace-dir DIR"))
    return checks, cfg


def _verl_config_checks(sources: Tuple[str, ...]) -> list:
    """What the verl launch in ``sources`` (``--config``) means for the traced outputs.
    An unreadable source is a usage error."""
    from otel_verl.tools import verl_config

    try:
        values = verl_config.read(sources)
    except verl_config.ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from None
    engine = values.get(verl_config.ROLLOUT_NAME_KEY)
    engine_text = engine if isinstance(engine, str) else ("unknown (a variable)" if engine is verl_config.UNKNOWN
                                                          else "not set there (sglang assumed)")
    state, detail, fix = verl_config.sglang_timing(values)
    check_state = {verl_config.ON: OK, verl_config.OFF: WARN, verl_config.REFUSED: WARN}.get(state, INFO)
    return [_Check("verl config", "rollout engine", INFO, engine_text),
            _Check("verl config", "sglang timing", check_state, detail, fix)]


def _one_line(area: str, checks: list) -> bool:
    """Whether an area is said in one line, not a table: nothing could be checked there
    (verl, or the engine wheels, not here)."""
    return area.startswith(("hooks", "engine sources")) and len(checks) == 1 and checks[0].state == INFO


def _by_cause(problems: list) -> list:
    """``problems`` with those of one cause (and fix) as one: a missing package is one problem, not one per hook."""
    groups: dict = {}
    for c in problems:
        groups.setdefault((c.cause, c.fix) if c.cause else id(c), []).append(c)
    return [group[0] if len(group) == 1 else
            _Check(group[0].area, f"{len(group)} hooks", FAIL, group[0].cause, group[0].fix, cause=group[0].cause)
            for group in groups.values()]


def _print_area(console, area: str, checks: list) -> None:
    from collections import Counter

    from rich import box
    from rich.markup import escape
    from rich.table import Table

    if _one_line(area, checks):
        console.print(f"{area}: {checks[0].name}: {checks[0].detail}", markup=False)
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    title = area
    if area == "hooks":
        states = Counter(c.state for c in checks)
        title = (f"hooks: {states[OK]} install, {states[FAIL] + states[WARN]} skipped or failing, "
                 f"{states[INFO]} not importable here")
        table.add_column("component", no_wrap=True)
    table.add_column("hook" if area.startswith(("hooks", "engine sources")) else "check", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("detail")
    for c in checks:
        cells = [c.component] if area == "hooks" else []
        table.add_row(*cells, escape(c.name), f"[{_STATE_STYLE[c.state]}]{c.state}[/]", escape(c.detail))
    console.print(title, style="bold", markup=False)
    console.print(table)
    console.print()


@main.command()
@click.option("--trace-dir", type=click.Path(file_okay=False), help="Check this trace dir (default: VERL_TRACE_DIR).")
@click.option("--timeout", type=click.FloatRange(0.1, 60), default=2.0, show_default=True, help="Seconds to wait for the OTLP endpoint.")
@click.option("--no-hooks", is_flag=True,
              help="Skip importing verl and installing the hooks, and the cached engine wheels (a quick configuration check).")
@click.option("--config", "configs", multiple=True, metavar="CONFIG",
              help="The verl launch to check (repeatable, a later one wins): a YAML verl config, a file of Hydra "
                   "overrides (or the launch script), or overrides given here (key=value). Warns when sglang "
                   "will not report per-request timing.")
@click.option("--engine-source", "engine_sources", multiple=True, type=click.Path(exists=True),
              help="Check the sglang/vLLM hooks on this wheel or source directory (repeatable; default: the cached wheels).")
@click.option("--fetch-engines", is_flag=True,
              help="First download verl's pinned sglang and vLLM wheels and the newest ones into the cache (network).")
def doctor(trace_dir: str | None, timeout: float, no_hooks: bool, configs: Tuple[str, ...],
           engine_sources: Tuple[str, ...], fetch_engines: bool) -> None:
    """Check this environment: versions, which hooks install on this verl, the settings,
    the trace dir and the OTLP endpoint; the sglang and vLLM hooks on those engines'
    source (wheels); with --config, a verl launch. Exits 1 when something required is
    wrong."""
    config_checks = _verl_config_checks(configs) if configs else []
    env = dict(os.environ)
    if trace_dir:
        env[settings.TRACE_DIR] = trace_dir
    checks = _version_checks()
    setting_checks, cfg = _settings_checks(env)
    checks += setting_checks
    checks.append(_trace_dir_check(cfg.trace_dir if cfg else (trace_dir or env.get(settings.TRACE_DIR))))
    endpoint = cfg.otlp_endpoint if cfg else (env.get(settings.OTLP_TRACES_ENDPOINT) or env.get(settings.OTLP_ENDPOINT))
    checks.append(_endpoint_check(endpoint, timeout))
    checks += config_checks
    if not no_hooks:
        checks += _hook_checks()
    if not no_hooks or engine_sources or fetch_engines:  # source only: no verl import
        checks += _engine_source_checks(engine_sources, fetch_engines)

    def draw(console) -> None:
        after_line = False  # a table prints a blank line after itself, a one-line area does not
        for area in dict.fromkeys(c.area for c in checks):
            in_area = [c for c in checks if c.area == area]
            if after_line and not _one_line(area, in_area):
                console.print()
            _print_area(console, area, in_area)
            after_line = _one_line(area, in_area)
        if after_line:
            console.print()

    _print_rich(draw)
    problems = _by_cause([c for c in checks if c.state == FAIL])
    warnings_ = [c for c in checks if c.state == WARN and c.fix]
    for c in problems + warnings_:
        click.echo(f"{'problem' if c.state == FAIL else 'warning'}: {c.name}: {c.detail}\n  fix: {c.fix}")
    if problems:
        click.echo(f"doctor: {len(problems)} problem(s)")
        sys.exit(1)
    click.echo("doctor: no problems" + (f" ({len(warnings_)} warning(s))" if warnings_ else ""))


# --------------------------------------------------------------------------- report


@main.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--png", type=click.Path(dir_okay=False), help="Draw the timeline (one row per step) into this PNG.")
@click.option("--top", type=click.IntRange(0, 1000), default=5, show_default=True, help="Slowest trajectories to list.")
@click.option("--perfetto", "perfetto_path", type=click.Path(dir_okay=False),
              help="Also write the run (or the steps --steps selects) as a Perfetto trace (open it in "
                   "ui.perfetto.dev) into this file.")
@click.option("--compare", is_flag=True,
              help="Compare two runs, PATHS = A B (or --run A --run B of one store): steps, stages and rollout "
                   "latency side by side with B/A (--png: as a figure).")
@click.option("--steps", "step_range", metavar="A-B", help="Only steps A to B (or one step A).")
@click.option("--clickhouse", metavar="URL", envvar="OTEL_VERL_CLICKHOUSE",
              help="Report from a ClickHouse server's span store (the Collector's clickhouse exporter fills it) "
                   "[env: OTEL_VERL_CLICKHOUSE].")
@click.option("--run", "run_ids", metavar="ID", multiple=True,
              help="The run (verl.run_id) of a store that holds several; twice with --compare.")
def report(paths: Tuple[str, ...], as_json: bool, png: str | None, top: int, perfetto_path: str | None,
           compare: bool, step_range: str | None, clickhouse: str | None, run_ids: Tuple[str, ...]) -> None:
    """Where a run's time went: stage durations per step, rollout latency percentiles,
    the slowest trajectories split into LLM / tools / reward, the tail of each step
    (critical path, replicas, waiting, staleness), samples that never finished, losses.
    PATHS: a trace dir, or OTLP-JSON files / directories (otel_verl's or the Collector
    file exporter's); with --compare two runs, A and B. The report is SQL on the span
    store (docs/STORE.md): chDB beside the run, loaded with what its files gained since the
    last report, or a ClickHouse server (--clickhouse)."""
    from otel_verl.tools.report import InputError
    from otel_verl.tools.store import report as store_report

    if not paths and not clickhouse:
        raise click.UsageError("Missing argument 'PATHS...' (or --clickhouse URL).")
    two_runs = len(run_ids) == 2 and len(paths) <= 1  # two runs of one store
    if compare and not (len(paths) == 2 and len(run_ids) <= 1 or two_runs):
        raise click.ClickException(f"--compare takes two runs, A and B (got {len(paths)} path(s)): "
                                   "otel-verl report --compare A B, or --compare --run A --run B of one store")
    if len(run_ids) > (2 if compare else 1):
        raise click.ClickException("--run: one run (two with --compare)")
    if perfetto_path and compare:
        raise click.ClickException("--perfetto writes one run: give it without --compare")
    try:
        steps = store_report.parse_steps(step_range) if step_range else None
    except ValueError as exc:
        raise click.BadParameter(str(exc).partition(": ")[2], param_hint="--steps") from None
    if png:  # before reading the run, which may take a while
        from otel_verl.tools.report.timeline import MatplotlibMissing, require_matplotlib

        try:
            require_matplotlib()
        except MatplotlibMissing as exc:
            raise click.ClickException(f"--png: {exc}") from None
    if perfetto_path:
        from otel_verl.tools.report.perfetto import PerfettoMissing, require_perfetto

        try:
            require_perfetto()
        except PerfettoMissing as exc:
            raise click.ClickException(f"--perfetto: {exc}") from None

    from otel_verl.tools.report import compare as comparison

    sections = {"sections": comparison.SECTIONS} if compare else {}

    def build(paths_: Tuple[str, ...], run_id: str | None) -> Dict[str, Any]:
        store, load, inputs = _store(paths_, clickhouse, warn=False)
        with store:
            try:
                data = store_report.read(store, list(paths_) or [settings.redacted(clickhouse or "")], inputs=inputs,
                                         load=load, run_id=run_id, steps=steps, top=top,
                                         timeline=bool(png) and not compare,
                                         unfinished_limit=None if as_json else 20, **sections)
                if perfetto_path:
                    run = data["runs"][0] if data["runs"] else None
                    # a whole embedded store is its files' spans, those of no run included
                    data["perfetto"] = _write_perfetto(store, run if steps or inputs is None else None, steps,
                                                       perfetto_path)
            except click.ClickException:
                raise
            except (InputError, OSError) as exc:
                raise click.ClickException(str(exc)) from None
            except Exception as exc:  # malformed data past the loader's checks: one line, no traceback
                raise click.ClickException(
                    f"cannot report on {', '.join(paths_) or 'the store'}: {type(exc).__name__}: {exc}") from None
            if load is not None:  # an error without spans names the first such line instead
                _warn_rejected(store)
        _warn_inputs(data["inputs"])
        return data

    if compare:
        # chDB holds one store a process: A's is closed before B's opens
        sides = [build(paths, run) for run in run_ids] if two_runs else \
            [build((path,), run_ids[0] if run_ids else None) for path in paths]
        _print_comparison(comparison.compare(*sides), as_json, png)
        return
    data = build(paths, run_ids[0] if run_ids else None)
    from otel_verl.tools.report.text import render

    _print_report(data, as_json, png, render, data["perfetto"].pop("lines") if perfetto_path else [])


def _print_report(data: Dict[str, Any], as_json: bool, png: str | None, render: Callable[..., None],
                  lines: List[str]) -> None:
    """The report as JSON or text (``render``), its timeline drawn into ``png`` first, then
    ``lines`` (what else was written)."""
    import json

    if png:
        from otel_verl.tools.report.timeline import draw

        data["png"] = _draw_png(png, lambda: draw(data, png))
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    _print_rich(lambda console: render(data, console))
    if png:
        click.echo(f"timeline: {_shown(png)}")
    for line in lines:
        click.echo(_shown(line))


def _write_perfetto(store: Any, run: str | None, steps: Tuple[int, int] | None, path: str) -> Dict[str, Any]:
    """The spans of ``run`` (``None``: all; of ``steps`` when selected), read from their rows
    only, written to ``path`` as a Perfetto trace: what it holds, and its ``lines``."""
    from otel_verl.tools.report import InputError, perfetto
    from otel_verl.tools.store import spans

    selected = spans.of_steps(store, run, steps) if steps else spans.of_run(store, run)
    if not selected:
        where = "the run" if not steps else f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"
        raise InputError(f"--perfetto: no spans of {where} in the store")
    try:
        written = perfetto.write_spans(selected, path)
    except perfetto.OutputError as exc:
        raise click.ClickException(str(exc)) from None
    return {**written.as_dict(), "lines": written.lines()}


def _warn_inputs(inputs: Dict[str, Any]) -> None:
    """One line on stderr for each file the report skipped or repaired."""
    for t in inputs["truncated_files"]:
        _warn_truncated(t["path"], t["bytes"])
    for skipped in inputs["skipped_files"]:
        _warn_skipped(skipped["path"], skipped["what"])
    for repaired in inputs["repaired_files"]:
        _warn_repaired(repaired["path"], repaired["characters"])


def _warn_truncated(path: str, size: int) -> None:
    click.echo(f"warning: {_shown(path)} ends with a truncated line ({size} bytes; still being written?): skipped",
               err=True)


def _warn_skipped(path: str, what: str) -> None:
    click.echo(f"warning: {_shown(path)} is {what}, not a file: skipped", err=True)


def _warn_repaired(path: str, characters: int) -> None:
    click.echo(f"warning: {_shown(path)}: {characters} character(s) not well-formed UTF-8 (lone surrogates, bytes "
               "that are not UTF-8): read as U+FFFD", err=True)


def _shown(text: str) -> str:
    """``text`` as any terminal can print it: a file name that is not UTF-8 comes as lone
    surrogates (Python's surrogateescape), which a UTF-8 stdout refuses."""
    from otel_verl.ids import repair_text

    return text if text.isascii() else repair_text(text)


def _draw_png(png: str, draw: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    try:
        return {"path": png, **draw()}
    except OSError as exc:
        raise click.ClickException(f"{png}: cannot write the PNG ({exc.strerror or exc})") from None


def _print_comparison(data: Dict[str, Any], as_json: bool, png: str | None) -> None:
    import json

    from otel_verl.tools.report import compare

    if png:
        data["png"] = _draw_png(png, lambda: compare.draw(data, png))
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    from otel_verl.tools.report.text import render_comparison

    _print_rich(lambda console: render_comparison(data, console))
    if png:
        click.echo(f"comparison: {_shown(png)}")


# --------------------------------------------------------------------------- query


@main.command()
@click.argument("args", nargs=-1, required=True, metavar="[PATHS]... SQL")
@click.option("--clickhouse", metavar="URL", envvar="OTEL_VERL_CLICKHOUSE",
              help="A ClickHouse server's store (http://user:password@host:8123/database) instead of a trace dir's "
                   "[env: OTEL_VERL_CLICKHOUSE].")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
def query(args: Tuple[str, ...], clickhouse: str | None, fmt: str) -> None:
    """Run SQL on the span store's views (steps, stages, trajectories, llm_turns, tool_calls,
    samples, ...; docs/STORE.md lists them). PATHS: a trace dir or OTLP-JSON files, loaded
    into a chDB store beside the run (only what they gained since the last load); or
    --clickhouse URL. The SQL may read, not write."""
    from otel_verl.tools.store import query as queries
    from otel_verl.tools.store.report import inputs_section

    *paths, sql = args
    store, load, inputs = _store(tuple(paths), clickhouse)
    with store:
        if inputs is not None:
            _warn_inputs(inputs_section(store, list(paths), inputs, load, None))
        try:
            names, rows = queries.run(store, sql)
        except Exception as exc:  # the engine's message: the user's SQL is wrong
            raise click.ClickException(f"query: {_first_line(exc)}") from None
    if fmt == "csv":
        click.echo(queries.as_csv(names, rows), nl=False)
    elif fmt == "json":
        click.echo(queries.as_json(names, rows))
    else:
        _print_rich(lambda console: queries.render_table(names, rows, console))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if "DB::Exception" in line:  # the engine's own words, without the driver's wrapping
            return line[line.index("DB::Exception") + len("DB::Exception: "):].strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _store(paths: Tuple[str, ...], clickhouse: str | None, warn: bool = True) -> Tuple[Any, Any, Any]:
    """The store to read, its load and inputs (:func:`otel_verl.tools.store.store.open_store`),
    with (``warn``) a warning on stderr for each line of the inputs it could not read as spans."""
    from otel_verl.tools.report import InputError
    from otel_verl.tools.store.store import open_store

    if not paths and not clickhouse:
        raise click.ClickException("give a trace dir (or OTLP-JSON files) or --clickhouse URL")
    try:
        store, load, inputs = open_store(paths, clickhouse)
    except InputError as exc:
        raise click.ClickException(str(exc)) from None
    if warn and load is not None:
        _warn_rejected(store)
    return store, load, inputs


def _warn_rejected(store: Any) -> None:
    """One line on stderr for each line of the inputs the store could not read as spans."""
    from otel_verl.tools.store.store import rejected_lines

    total, rejected = rejected_lines(store, SHOWN_REJECTED_LINES)
    for path, line, why in rejected:
        click.echo(f"warning: {_shown(path)}:{line}: {why}: skipped", err=True)
    if total > len(rejected):
        click.echo(f"warning: {total - len(rejected)} more line(s) that are no OTLP span data: skipped", err=True)


SHOWN_REJECTED_LINES = 20


# --------------------------------------------------------------------------- replay


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--endpoint", required=True, help="OTLP/HTTP base URL (e.g. http://localhost:4318); /v1/traces is added.")
@click.option("--protocol", type=click.Choice(["json", "protobuf"]), default="json", show_default=True)
@click.option("--header", "headers", multiple=True, metavar="KEY=VALUE", help="Extra HTTP header (repeatable).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds for the whole replay, retries included; what is left then is not sent (exit 1).")
@click.option("--retries", type=click.IntRange(0, 100), default=5, show_default=True,
              help="Retries per line on 5xx/429/lost connections, with backoff, within --timeout.")
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr (default: a bar on a terminal, else a line every few seconds and per file).")
def replay(files: Tuple[str, ...], endpoint: str, protocol: str, headers: Tuple[str, ...], timeout: float,
           retries: int, progress: bool | None) -> None:
    """Send OTLP-JSON FILES (or trace dirs / directories of them) to a collector, Jaeger or
    Tempo over OTLP/HTTP. Stops at once when the endpoint refuses the connection before any
    line was sent. Exits 1 naming the lines that could not be sent."""
    from otel_verl.tools.replay import replay as run_replay
    from otel_verl.tools.report import InputError

    header_map = {}
    for item in headers:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--header")
        header_map[key.strip()] = value.strip()
    try:
        result = run_replay(list(files), endpoint, protocol=protocol, headers=header_map, timeout=timeout,
                            retries=retries, progress=progress)
    except (InputError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for path, size in result.truncated:
        _warn_truncated(path, size)
    for path, what in result.skipped:
        _warn_skipped(path, what)
    for path, characters in result.repaired:
        _warn_repaired(path, characters)
    for error in result.errors:
        click.echo(f"error: {_shown(error)}", err=True)
    click.echo(
        f"replay: sent {result.spans_sent} of {result.spans} spans ({result.lines_sent} of {result.lines} lines, "
        f"{result.files} files) to {result.url}; retries: {result.retries}; truncated: {len(result.truncated)}"
    )
    if result.lines_failed:
        why = f"{result.stopped}; " if result.stopped else ""
        raise click.ClickException(
            f"{result.lines_failed} of {result.lines} lines ({result.spans_failed} spans) could not be sent to "
            f"{result.url}: {why}not sent: {_shown(result.unsent_text())}"
        )
    if result.spans_rejected:
        raise click.ClickException(f"the receiver rejected {result.spans_rejected} span(s) (partial success)")


if __name__ == "__main__":
    main()
