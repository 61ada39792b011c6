"""Reading a verl launch (Hydra overrides, a launch script, a YAML config) for whether its
sglang servers report per-request timing, and the override ``otel-verl run`` adds."""

from __future__ import annotations

import os

import pytest

from otel_verl.tools import verl_config as vc
from otel_verl.server_timing import ENABLE_METRICS_KEY, ENABLE_METRICS_OVERRIDE, PROMETHEUS_ENABLE_KEY

NAME = vc.ROLLOUT_NAME_KEY
LOG_STATS = vc.DISABLE_LOG_STATS_KEY


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_overrides_last_one_wins_and_other_tokens_are_skipped():
    values = vc.parse_overrides([
        "python3", "-m", "verl.trainer.main_ppo", f"{NAME}=vllm", "trainer.n_gpus_per_node=8",
        f"{NAME}='sglang'", f"+{PROMETHEUS_ENABLE_KEY}=True", f"++{ENABLE_METRICS_KEY}=false", f"{LOG_STATS}=False",
    ])
    assert values == {NAME: "sglang", PROMETHEUS_ENABLE_KEY: True, ENABLE_METRICS_KEY: False, LOG_STATS: False}
    assert vc.parse_overrides([f"{NAME}=sglang", f"~{NAME}"]) == {}  # deleted: verl's default again
    assert vc.parse_overrides([f"{NAME}=$ENGINE"])[NAME] is vc.UNKNOWN


@pytest.mark.parametrize("values, state", [
    ({NAME: "sglang"}, vc.OFF),
    ({}, vc.OFF),  # engine not given: sglang assumed
    ({NAME: "sglang", ENABLE_METRICS_KEY: True}, vc.ON),
    ({ENABLE_METRICS_KEY: True}, vc.ON),
    ({NAME: "sglang", PROMETHEUS_ENABLE_KEY: True, LOG_STATS: False}, vc.ON),
    ({NAME: "sglang", PROMETHEUS_ENABLE_KEY: True}, vc.REFUSED),  # verl: needs disable_log_stats=False
    ({NAME: "sglang", ENABLE_METRICS_KEY: True, PROMETHEUS_ENABLE_KEY: True, LOG_STATS: True}, vc.REFUSED),
    ({NAME: "sglang", ENABLE_METRICS_KEY: False}, vc.OFF),
    ({NAME: "sglang", ENABLE_METRICS_KEY: vc.UNKNOWN}, vc.UNDECIDED),
    ({NAME: "vllm"}, vc.NOT_SGLANG),
    ({NAME: "vllm", PROMETHEUS_ENABLE_KEY: True}, vc.NOT_SGLANG),
])
def test_sglang_timing_states(values, state):
    got, detail, fix = vc.sglang_timing(values)
    assert got == state, detail
    assert bool(fix) == (state in (vc.OFF, vc.REFUSED))
    if state == vc.OFF:
        assert ENABLE_METRICS_OVERRIDE in fix


def test_read_an_overrides_file_a_launch_script_and_inline_overrides(tmp_path):
    listing = _write(tmp_path / "overrides.txt", f"# the run's overrides\n{NAME}=sglang\n\ntrainer.total_epochs=2\n")
    assert vc.read([listing]) == {NAME: "sglang"}
    script = _write(tmp_path / "run.sh", (
        "#!/bin/bash\nset -x\nENGINE=sglang\n"
        "python3 -m verl.trainer.main_ppo \\\n"
        f"    {NAME}=sglang \\\n"
        f"    {PROMETHEUS_ENABLE_KEY}=True {LOG_STATS}=False \\\n"
        "    trainer.logger='[\"console\",\"wandb\"]' $@\n"))
    assert vc.read([script]) == {NAME: "sglang", PROMETHEUS_ENABLE_KEY: True, LOG_STATS: False}
    # a later source wins; inline overrides, several in one value
    assert vc.read([listing, f"{NAME}=vllm {ENABLE_METRICS_KEY}=true"]) == {NAME: "vllm", ENABLE_METRICS_KEY: True}


def test_read_yaml_configs(tmp_path):
    config = _write(tmp_path / "config.yaml", (
        "actor_rollout_ref:\n  rollout:\n    name: sglang\n    disable_log_stats: true\n"
        "    prometheus:\n      enable: false\n    engine_kwargs:\n      sglang:\n        enable_metrics: true\n"))
    assert vc.read([config]) == {NAME: "sglang", LOG_STATS: True, PROMETHEUS_ENABLE_KEY: False,
                                 ENABLE_METRICS_KEY: True}
    interpolated = _write(tmp_path / "mine.yml", "actor_rollout_ref:\n  rollout:\n    name: ${oc.env:ENGINE}\n")
    assert vc.read([interpolated]) == {NAME: vc.UNKNOWN}
    hydra_list = _write(tmp_path / "overrides.yaml", f"- {NAME}=sglang\n- {ENABLE_METRICS_OVERRIDE}\n")
    assert vc.read([hydra_list]) == {NAME: "sglang", ENABLE_METRICS_KEY: True}


@pytest.mark.parametrize("make, needle", [
    (lambda d: str(d / "missing.yaml"), "no such file, and not a Hydra override"),
    (lambda d: "just-a-word", "no such file, and not a Hydra override"),
    (lambda d: _write(d / "bad.yaml", "actor_rollout_ref: [unclosed\n"), "not valid YAML"),
    (lambda d: _write(d / "scalar.yaml", "42\n"), "neither a verl config"),
    (lambda d: _write(d / "notes.txt", "nothing to see here\n"), "no Hydra override (key=value) in it"),
    (lambda d: _write(d / "quote.sh", "python -m verl.trainer.main_ppo a='b\n"), "cannot split into overrides"),
    (lambda d: str(d), "cannot read it"),  # a directory
])
def test_an_unreadable_config_says_which_and_why(tmp_path, make, needle):
    source = make(tmp_path)
    with pytest.raises(vc.ConfigError) as raised:
        vc.read([source])
    assert needle in str(raised.value) and os.path.basename(source) in str(raised.value)


def test_run_adds_the_override_to_a_main_ppo_command_with_sglang_or_no_engine():
    base = ["python3", "-m", "verl.trainer.main_ppo", "trainer.n_gpus_per_node=8"]
    assert vc.run_overrides(base) == [ENABLE_METRICS_OVERRIDE]
    assert vc.run_overrides(base + [f"{NAME}=sglang"]) == [ENABLE_METRICS_OVERRIDE]
    assert vc.run_overrides(["python", "/src/verl/verl/trainer/main_ppo.py", f"{NAME}=sglang"]) == [ENABLE_METRICS_OVERRIDE]
    assert vc.run_overrides(base + [f"{NAME}=vllm"]) == []  # another engine
    assert vc.run_overrides(base + [f"+{ENABLE_METRICS_KEY}=False"]) == []  # the user's choice stands
    assert vc.run_overrides(base + [f"{PROMETHEUS_ENABLE_KEY}=True"]) == []  # on already
    assert vc.run_overrides(["bash", "run_qwen.sh"]) == []  # not verl's Hydra entry point: left alone
    assert vc.run_overrides(["python", "-m", "verl.trainer.main_generation", f"{NAME}=sglang"]) == []


@pytest.mark.verl
def test_the_override_composes_with_verls_config_and_switches_sglang_metrics_on():
    """With verl's own ppo_trainer config: the key composes, and verl's SGLangHttpServer rule
    (which the stand-in mirrors) then starts sglang with enable_metrics."""
    from otel_verl.demo.common import build_config
    from otel_verl.demo.llm_server_standin import sglang_enable_metrics
    from verl.utils.config import omega_conf_to_dataclass

    for overrides, on in (([ENABLE_METRICS_OVERRIDE], True), ([], False)):
        config = build_config([f"{NAME}=sglang", *overrides])
        rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
        assert sglang_enable_metrics(rollout) is on
        assert vc.sglang_timing(vc.parse_overrides([f"{NAME}=sglang", *overrides]))[0] == (vc.ON if on else vc.OFF)
