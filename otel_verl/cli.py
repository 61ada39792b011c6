"""The ``otel-verl`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Tuple

import click

from otel_verl import settings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """OpenTelemetry tracing for verl."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--trace-dir", type=click.Path(file_okay=False), help="Write legacy files and OTLP-JSON here (VERL_TRACE_DIR).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(trace_dir: str | None, command: Tuple[str, ...]) -> None:
    """Run COMMAND (e.g. python -m verl.trainer.main_ppo ...) with tracing on in every Ray process.

    Put the command after `--`. Its exit code is passed through.
    """
    env = launch_env(os.environ, trace_dir)
    try:
        settings.load(env)
    except settings.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if not settings.load(env).enabled:
        click.echo("otel-verl: nothing to export to: set --trace-dir, VERL_TRACE_DIR or OTEL_EXPORTER_OTLP_ENDPOINT", err=True)
    try:
        completed = subprocess.run(list(command), env=env)
    except FileNotFoundError:
        raise click.UsageError(f"command not found: {command[0]}") from None
    sys.exit(completed.returncode if completed.returncode >= 0 else 128 - completed.returncode)


def launch_env(base: "os._Environ[str] | dict", trace_dir: str | None = None) -> dict:
    """The environment ``otel-verl run`` gives its command."""
    import uuid

    env = dict(base)
    if trace_dir:
        env[settings.TRACE_DIR] = os.path.abspath(trace_dir)
    env.setdefault(settings.RUN_ID, uuid.uuid4().hex)
    site_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitecustomize")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, env.get("PYTHONPATH", "")) if p)
    return env


@main.command()
@click.option("--trace-dir", type=click.Path(file_okay=False), required=True, help="Where every output goes.")
@click.option("--steps", type=click.IntRange(1, 1000), default=2, show_default=True)
@click.option("--prompts", type=click.IntRange(1, 4096), default=4, show_default=True, help="Prompts per step.")
@click.option("--n", "n", type=click.IntRange(1, 64), default=4, show_default=True, help="Trajectories per prompt (rollout.n).")
@click.option("--agent", type=click.Choice(["single", "tool"]), default="tool", show_default=True)
def demo(trace_dir: str, steps: int, prompts: int, n: int, agent: str) -> None:
    """Run a traced CPU demo: real verl (v0 trainer, agent loops, reward) on a local Ray
    cluster with stand-ins for the GPU parts; writes every output to TRACE_DIR."""
    from otel_verl.demo.traced import describe, run_demo

    summary = run_demo(trace_dir, steps=steps, prompts=prompts, n=n, agent=agent)
    click.echo(describe(summary))


@main.command()
def overrides() -> None:
    """Print the Hydra overrides that switch tracing on for verl.trainer.main_ppo."""
    from otel_verl.activation import hydra_overrides

    for line in hydra_overrides():
        click.echo(line)


if __name__ == "__main__":
    main()
