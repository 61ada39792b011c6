"""otel_verl.tools.hookcheck: the hook table checked on packages' source, never imported.

Synthetic sources pin down the lookup rules (imports, base classes, ``**kwargs``);
then the real thing: verl's installed source for every verl hook, and the released
sglang and vLLM wheels, verl 0.9's pinned versions and the newest on the registry. Each
real check is also run on a doctored copy of the file with a hooked parameter renamed,
which it must report. Wheels are downloaded once into the wheel cache
(``~/.cache/otel_verl/wheels``); without a registry those tests skip, saying why.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap
import types
import zipfile
from typing import Dict, Optional, Tuple

import pytest

from otel_verl.tools import engine_wheels, hookcheck
from otel_verl.tools.hookcheck import DirectoryTree, SourceTree, check_hook, check_hooks, hook_specs


def _write(root, files: Dict[str, str]) -> str:
    for rel, text in files.items():
        path = os.path.join(str(root), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


class Doctored(SourceTree):
    """``base`` with one module's text replaced."""

    def __init__(self, base: SourceTree, module: str, text: str) -> None:
        self.base, self.module, self.text = base, module, text
        self.label = f"doctored {base.label}"

    def packages(self):
        return self.base.packages()

    def read(self, module: str) -> Optional[Tuple[str, str]]:
        if module == self.module:
            return f"<doctored {module}>", self.text
        return self.base.read(module)


def rename_parameter(text: str, def_line: int, param: str, new: str) -> str:
    """``text`` with ``param`` renamed (a whole-word text replace) in the signature of the
    ``def`` at ``def_line``: the check must see it gone."""
    node = next(n for n in ast.walk(ast.parse(text))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno == def_line)
    lines = text.splitlines(keepends=True)
    start = def_line - 1  # the def itself: decorators are above it
    end = node.body[0].lineno - 1  # the signature ends before the body (a docstring included)
    signature = "".join(lines[start:end])
    renamed = re.sub(rf"\b{re.escape(param)}\b", new, signature)
    assert renamed != signature, f"{param} not in the signature at line {def_line}"
    return "".join(lines[:start]) + renamed + "".join(lines[end:])


def assert_rename_reported(tree: SourceTree, module: str, target: str, params: Tuple[str, ...]) -> None:
    """Rename each hooked parameter of ``target`` in a copy of its source: the check
    reports exactly that parameter (a ``**kwargs`` that could still carry it included)."""
    real = check_hook(module, target, params, [tree])
    assert real.state == hookcheck.FOUND, real
    path, line = real.where.rsplit(":", 1)
    defining = _module_at(tree, path)
    text = tree.read(defining)[1]
    for param in params:
        doctored = Doctored(tree, defining, rename_parameter(text, int(line), param, f"{param}_renamed"))
        result = check_hook(module, target, params, [doctored])
        assert result.state == hookcheck.MISSING_PARAMETER, result
        assert result.missing == (param,)
        assert f"no parameter {param}" in result.detail


def _module_at(tree: SourceTree, path: str) -> str:
    """The module whose source in ``tree`` is the file ``path``."""
    root = getattr(tree, "extract_dir", None) or getattr(tree, "root")
    rel = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


# --------------------------------------------------------------------------- lookup rules


SYNTHETIC = {
    "pkg/__init__.py": "from .api import *\n",
    "pkg/api.py": "from pkg.impl.core import run_batch as run\n__all__ = ['run']\n",
    "pkg/impl/__init__.py": "",
    "pkg/impl/core.py": (
        "import pkg.impl.base as base_mod\n"
        "from .base import Base\n"
        "def run_batch(batch, *, step=0):\n    pass\n"
        "class Server(Base):\n"
        "    async def generate(self, prompt_ids, sampling_params, /, request_id=None):\n        pass\n"
        "class Other(base_mod.Base):\n    pass\n"
        "class Loose(Unknown):\n    pass\n"
        "try:\n    from fast import kernel\nexcept ImportError:\n"
        "    def kernel(x, **kwargs):\n        pass\n"
        "handler = run_batch\n"
    ),
    "pkg/impl/base.py": "class Base:\n    def step(self, batch, metrics):\n        pass\n",
}


@pytest.fixture()
def synthetic(tmp_path):
    return [DirectoryTree(_write(tmp_path, SYNTHETIC), label="synthetic")]


@pytest.mark.parametrize("module, target, params", [
    ("pkg.impl.core", "Server.generate", ("prompt_ids", "sampling_params", "request_id")),  # positional-only too
    ("pkg.impl.core", "Server.step", ("batch", "metrics")),  # inherited from an imported base
    ("pkg.impl.core", "Other.step", ("batch",)),  # base named through a module alias
    ("pkg.impl.core", "run_batch", ("batch", "step")),  # keyword-only too
    ("pkg", "run", ("batch",)),  # star import of a re-export under another name
    ("pkg.impl.core", "kernel", ("x",)),  # the fallback def in except
])
def test_found(synthetic, module, target, params):
    result = check_hook(module, target, params, synthetic)
    assert result.state == hookcheck.FOUND, result
    assert result.ok and result.where.split(":")[0].endswith(".py")


@pytest.mark.parametrize("module, target, params, state, detail", [
    ("pkg.impl.core", "Server.generate", ("prompt_ids", "priority"), hookcheck.MISSING_PARAMETER, "no parameter priority"),
    ("pkg.impl.core", "Server.abort", (), hookcheck.MISSING_METHOD, "Server has no method abort"),
    ("pkg.impl.core", "Client.generate", (), hookcheck.MISSING_TARGET, "no class Client"),
    ("pkg.impl.core", "compute", (), hookcheck.MISSING_TARGET, "no function compute"),
    ("pkg.impl.gone", "Server.generate", (), hookcheck.MISSING_MODULE, "no module pkg.impl.gone"),
    ("other.module", "Server.generate", (), hookcheck.UNAVAILABLE, "other not available"),
    ("pkg.impl.core", "Loose.step", (), hookcheck.UNVERIFIED, "may come from Unknown"),
    ("pkg.impl.core", "handler", ("batch",), hookcheck.UNVERIFIED, "bound by a Assign"),
])
def test_not_found(synthetic, module, target, params, state, detail):
    result = check_hook(module, target, params, synthetic)
    assert result.state == state, result
    assert detail in result.detail
    assert result.ok is (state == hookcheck.UNVERIFIED)


def test_parameter_left_to_kwargs_is_missing(synthetic):
    """At run time **kwargs would let the hook install, but the wrapper would read None."""
    result = check_hook("pkg.impl.core", "kernel", ("x", "flag"), synthetic)
    assert result.state == hookcheck.MISSING_PARAMETER and result.missing == ("flag",)
    assert result.detail == "kernel has no parameter flag (only its **kwargs could carry it)"


def test_wheel_members_are_kept_unpacked(tmp_path):
    wheel = tmp_path / "demo_pkg-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo_pkg/__init__.py", "")
        z.writestr("demo_pkg/server.py", "class Server:\n    def generate(self, obj, request=None):\n        pass\n")
        z.writestr("demo_pkg-1.2.3.dist-info/METADATA", "Name: demo-pkg\n")
    tree = engine_wheels.source_tree(str(wheel))
    assert (tree.dist, tree.version, tree.label) == ("demo-pkg", "1.2.3", "demo-pkg 1.2.3 (wheel)")
    assert tree.packages() == {"demo_pkg"}
    assert check_hook("demo_pkg.server", "Server.generate", ("obj",), [tree]).state == hookcheck.FOUND
    kept = tmp_path / "src" / wheel.name[: -len(".whl")] / "demo_pkg" / "server.py"
    assert kept.is_file()
    kept.write_text("class Server:\n    def generate(self, request):\n        pass\n")  # read from the cache now
    again = engine_wheels.source_tree(str(wheel))
    assert check_hook("demo_pkg.server", "Server.generate", ("obj",), [again]).missing == ("obj",)


def test_open_source_takes_a_package_directory(synthetic, tmp_path):
    tree = hookcheck.open_source(str(tmp_path / "pkg"))
    assert tree.packages() == {"pkg"} and tree.label == f"source at {tmp_path / 'pkg'}"
    assert check_hook("pkg.impl.core", "Server.step", ("batch",), [tree]).state == hookcheck.FOUND


def test_open_source_rejects_other_files(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("")
    with pytest.raises(ValueError, match="neither a directory nor a .whl"):
        hookcheck.open_source(str(other))


def test_pinned_versions_come_from_the_extras(monkeypatch):
    from importlib import metadata

    requires = ["torch", "sglang==0.5.12; extra == 'sglang'", "vllm<0.25,>=0.20; extra == 'vllm'",
                "vllm==0.24.0; extra == 'vllm'"]
    monkeypatch.setattr(metadata, "requires", lambda dist: requires)
    assert engine_wheels.pinned_versions() == {"sglang": "0.5.12", "vllm": "0.24.0"}


def test_cached_wheel_found_by_name_and_version(tmp_path):
    (tmp_path / "sglang-0.5.12-cp311-cp311-manylinux_2_34_x86_64.whl").write_bytes(b"")
    assert engine_wheels.cached_wheel("sglang", "0.5.12", str(tmp_path)).endswith("manylinux_2_34_x86_64.whl")
    assert engine_wheels.cached_wheel("sglang", "0.5.1", str(tmp_path)) is None
    assert engine_wheels.cached_wheels(str(tmp_path)) == [str(tmp_path / "sglang-0.5.12-cp311-cp311-manylinux_2_34_x86_64.whl")]


def test_no_registry_is_reported_not_raised_raw(tmp_path, monkeypatch):
    """Without a registry pip fails: the caller gets RegistryUnavailable with pip's reason
    (the tests below skip with it), and nothing is left in the cache."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    with pytest.raises(engine_wheels.RegistryUnavailable, match="pip index versions sglang: "):
        engine_wheels.newest_version("sglang")
    with pytest.raises(engine_wheels.RegistryUnavailable, match=r"pip download sglang==0\.5\.12: .*sglang==0\.5\.12"):
        engine_wheels.fetch("sglang", "0.5.12", str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []


# --------------------------------------------------------------------------- the hook table


def test_every_hook_declares_what_its_wrapper_reads():
    """The declarations the checks read are the hook table itself."""
    from otel_verl.instrumentation import all_hooks

    specs = hook_specs()
    assert specs == [(h.module, h.target, tuple(h.params)) for h in all_hooks()]
    assert all(isinstance(p, str) and p.isidentifier() for _, _, params in specs for p in params)
    assert hook_specs({"sglang"}) == [s for s in specs if s[0].startswith("sglang.")]


def names_read(func, package: str = "otel_verl", seen=None) -> set:
    """The parameter names a wrapt wrapper reads by literal name: ``.get`` / ``[...]`` /
    ``.pop`` on what :func:`~otel_verl.instrumentation._args.arguments` returned or on the
    call's kwargs, and :func:`~otel_verl.instrumentation._args.with_argument`'s name; in
    the wrapper and the functions of ``package`` its closure holds (a factory's string
    arguments count as literals)."""
    seen = set() if seen is None else seen
    if not isinstance(func, types.FunctionType) or func in seen or not func.__module__.startswith(package):
        return set()
    seen.add(func)
    cells = dict(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    read = set().union(*(names_read(cell, package, seen) for cell in cells.values()))
    if func.__name__ == "<lambda>":
        return read
    node = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), func

    def is_arguments_call(n):
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "arguments"

    call_kwargs = node.args.args[3].arg if len(node.args.args) >= 4 else None
    holders = {call_kwargs}  # names holding the {parameter: value} dict
    for n in ast.walk(node):
        if isinstance(n, ast.Assign) and is_arguments_call(n.value) and isinstance(n.targets[0], ast.Tuple):
            second = n.targets[0].elts[1]
            holders.add(second.id if isinstance(second, ast.Name) else None)

    def holds_values(n):
        return (isinstance(n, ast.Name) and n.id in holders) or (isinstance(n, ast.Subscript) and is_arguments_call(n.value))

    def literal(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return n.value
        return cells.get(n.id) if isinstance(n, ast.Name) and isinstance(cells.get(n.id), str) else None

    for n in ast.walk(node):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "pop")
                and holds_values(n.func.value) and n.args):
            read.add(literal(n.args[0]))
        elif isinstance(n, ast.Subscript) and holds_values(n.value) and not is_arguments_call(n.value):
            read.add(literal(n.slice))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "with_argument" and len(n.args) >= 5:
            read.add(literal(n.args[4]))
    return read - {None}


def test_wrappers_read_only_declared_parameters():
    """A wrapper that starts reading a parameter its hook does not declare would not be
    checked (at run time or on source): the declarations are the one list."""
    from otel_verl.instrumentation import all_hooks

    undeclared = {h.name: sorted(names_read(h.wrapper) - set(h.params)) for h in all_hooks()}
    assert not {k: v for k, v in undeclared.items() if v}
    assert sum(len(names_read(h.wrapper)) for h in all_hooks()) >= 30  # the reader sees the reads


def test_names_read_finds_each_kind_of_read():
    from otel_verl.instrumentation._args import arguments, with_argument

    def factory(column):
        def wrapper(wrapped, instance, args, kwargs):
            _, values = arguments(wrapped, instance, args, kwargs)
            values.get("request_id"), values["prompt_ids"], kwargs.get("name"), values.get(column)
            obj = arguments(wrapped, instance, args, kwargs)[1].get("obj")
            return with_argument(wrapped, instance, args, kwargs, "priority", obj)
        return wrapper

    assert names_read(factory("batch"), package=__name__) == {"request_id", "prompt_ids", "name", "batch", "obj", "priority"}


KEY_READER = """
from otel_verl_keys_stand_in import names

RECEIVED = "received_ts"
ALTERNATIVES = ("done_ts", "done_time")


def helper(stats, factor):
    for key in ALTERNATIVES:
        if stats.get(key) is not None:
            return stats[key] * factor
    return stats.get(names.FALLBACK)


def timings(meta):
    return {"total": meta.get("e2e"), "received": meta[RECEIVED], "done": helper(meta, 2),
            "other": dict(meta=1).get("not_a_meta_key")}
"""


def test_keys_read_follow_constants_loops_and_helpers(tmp_path, monkeypatch):
    _write(tmp_path, {"otel_verl_keys_stand_in/__init__.py": "",
                      "otel_verl_keys_stand_in/names.py": "FALLBACK = 'first_token'\n",
                      "otel_verl_keys_stand_in/reader.py": KEY_READER})
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    reader = importlib.import_module("otel_verl_keys_stand_in.reader")
    keys = []
    hookcheck._keys_read(reader.timings, None, keys, set())
    assert sorted(keys) == ["done_time", "done_ts", "e2e", "first_token", "received_ts"]


def test_server_meta_keys_are_read_from_the_exporter():
    from otel_verl.legacy import trajectory_jsonl

    keys = hookcheck.server_meta_keys()
    assert "e2e_latency" in keys and len(set(keys)) == len(keys)
    # the keys found are all the timings need: with them every field is filled, without none
    assert all(v is not None for v in trajectory_jsonl._server_timings({k: 2.0 + i for i, k in enumerate(keys)}).values())
    assert all(v is None for v in trajectory_jsonl._server_timings({}).values())


# --------------------------------------------------------------------------- verl's installed source


def _installed_trees():
    trees = hookcheck.installed_trees(m.split(".", 1)[0] for m, _, _ in hook_specs())
    if not any("verl" in t.packages() for t in trees):
        pytest.skip("verl is not installed")
    return trees


def _verl_specs():
    return [s for s in hook_specs() if s[0].split(".", 1)[0] in ("verl", "transfer_queue")]


@pytest.mark.verl
def test_every_verl_hook_matches_the_installed_source():
    trees = _installed_trees()
    results = check_hooks(_verl_specs(), trees)
    assert len(results) >= 40
    wrong = [r for r in results if r.state != hookcheck.FOUND]
    assert not wrong, "\n".join(f"{r.hook}: {r.state} {r.detail}" for r in wrong)


@pytest.mark.verl
@pytest.mark.parametrize("spec", [s for s in _verl_specs() if s[2]], ids=lambda s: f"{s[0]}:{s[1]}")
def test_renamed_verl_parameter_is_reported(spec):
    trees = _installed_trees()
    module, target, params = spec
    tree = next(t for t in trees if module.split(".", 1)[0] in t.packages())
    assert_rename_reported(tree, module, target, params)


@pytest.mark.verl
def test_removed_verl_method_is_reported():
    trees = _installed_trees()
    tree = next(t for t in trees if "verl" in t.packages())
    module = "verl.workers.rollout.llm_server"
    text = tree.read(module)[1]
    doctored = Doctored(tree, module, re.sub(r"\bdef _vllm_request_id\b", "def _engine_request_id", text))
    result = check_hook(module, "LLMServerClient._vllm_request_id", ("request_id",), [doctored])
    assert result.state == hookcheck.MISSING_METHOD and "has no method _vllm_request_id" in result.detail


# --------------------------------------------------------------------------- sglang and vLLM wheels


_newest: Dict[str, str] = {}


def engine_tree(engine: str, which: str) -> SourceTree:
    """The source of ``engine``'s wheel: the version verl pins, or the newest released."""
    if which == "pinned":
        version = engine_wheels.pinned_versions().get(engine)
        if version is None:
            pytest.skip(f"the installed verl pins no {engine} version (verl not installed?)")
    else:
        if engine not in _newest:
            try:
                _newest[engine] = engine_wheels.newest_version(engine)
            except engine_wheels.RegistryUnavailable as exc:
                pytest.skip(f"package registry unreachable: {exc}")
        version = _newest[engine]
    try:
        wheel = engine_wheels.fetch(engine, version)
    except engine_wheels.RegistryUnavailable as exc:
        pytest.skip(f"{engine} {version} not cached and the registry is unreachable: {exc}")
    return engine_wheels.source_tree(wheel)


# pinned sglang: a few seconds cold (8 MB); the others: lookup plus 40-280 MB, so e2e
ENGINE_VERSIONS = [
    pytest.param("sglang", "pinned", marks=pytest.mark.verl, id="sglang-pinned"),
    pytest.param("sglang", "newest", marks=pytest.mark.e2e, id="sglang-newest"),
    pytest.param("vllm", "pinned", marks=[pytest.mark.verl, pytest.mark.e2e], id="vllm-pinned"),
    pytest.param("vllm", "newest", marks=pytest.mark.e2e, id="vllm-newest"),
]
SGLANG_VERSIONS = [p for p in ENGINE_VERSIONS if p.values[0] == "sglang"]
VLLM_VERSIONS = [p for p in ENGINE_VERSIONS if p.values[0] == "vllm"]


@pytest.mark.parametrize("engine, which", ENGINE_VERSIONS)
def test_engine_hooks_match_the_released_source(engine, which):
    specs = hook_specs({engine})
    if not specs:
        pytest.skip(f"no hook targets {engine}")
    tree = engine_tree(engine, which)
    for result in check_hooks(specs, [tree]):
        assert result.state == hookcheck.FOUND, result
    for module, target, params in specs:
        if params:
            assert_rename_reported(tree, module, target, params)


@pytest.mark.parametrize("engine, which", SGLANG_VERSIONS)
def test_sglang_tokenizer_manager_hook(engine, which):
    """The one engine-level hook today, named here so the test fails if it leaves the table."""
    tree = engine_tree(engine, which)
    (spec,) = [s for s in hook_specs({"sglang"}) if s[1] == "TokenizerManager.generate_request"]
    assert "obj" in spec[2]
    assert check_hooks([spec], [tree])[0].state == hookcheck.FOUND
    assert_rename_reported(tree, *spec)


@pytest.mark.parametrize("engine, which", VLLM_VERSIONS)
def test_vllm_engine_generate_takes_trace_headers(engine, which):
    """vLLM's engine entry point takes the W3C headers its own request span joins
    (``AsyncLLM.generate(..., trace_headers=...)``), read from the released source."""
    tree = engine_tree(engine, which)
    params = ("prompt", "sampling_params", "request_id", "trace_headers")
    result = check_hook("vllm.v1.engine.async_llm", "AsyncLLM.generate", params, [tree])
    assert result.state == hookcheck.FOUND and not result.detail, result
    assert_rename_reported(tree, "vllm.v1.engine.async_llm", "AsyncLLM.generate", params)


@pytest.mark.parametrize("engine, which", SGLANG_VERSIONS)
def test_meta_keys_check_sees_a_removed_key(engine, which):
    tree = engine_tree(engine, which)
    (module,) = [m for m in hookcheck.SGLANG_META_MODULES if "req_time_stats" in m]
    real = hookcheck.check_meta_keys(tree, ("e2e_latency", "queue_time", "prefill_finished_time"))
    assert real.absent == () and not real.missing_modules, real
    doctored = Doctored(tree, module, tree.read(module)[1].replace('"prefill_finished_time"', '"prefill_done_time"'))
    assert "prefill_finished_time" not in hookcheck.string_literals(tree, (hookcheck.SGLANG_META_MODULES[0],))[0]
    result = hookcheck.check_meta_keys(doctored, ("e2e_latency", "queue_time", "prefill_finished_time"))
    assert result.absent == ("prefill_finished_time",)


@pytest.mark.e2e
def test_today_s_sglang_fills_the_trajectory_timings():
    """With the keys verl's pinned sglang and the newest write, every sglang_* timing of
    the trajectory file is filled, but the prefill duration: no sglang 0.5 reports one."""
    for param in SGLANG_VERSIONS:
        if param.values[1] == "pinned" and not engine_wheels.pinned_versions():
            continue  # verl not installed: the newest only
        result = hookcheck.check_meta_keys(engine_tree(*param.values))
        assert set(result.null_fields) <= {"sglang_prefill_ms"}, result


# --------------------------------------------------------------------------- doctor

CLEAN_ENV = {var: None for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
                                    "OTEL_VERL_ENABLED", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_EXPORTER")}


def _without_live_checks(monkeypatch, cli):
    """The installed versions and live hooks are test_cli's business; here doctor's exit
    code reflects the engine sources only, with or without verl installed."""
    monkeypatch.setattr(cli, "_version_checks", lambda: [])
    monkeypatch.setattr(cli, "_hook_checks", lambda: [])


def test_doctor_reports_engine_sources(tmp_path, monkeypatch):
    """``doctor --engine-source DIR``: each sglang hook and the meta keys on that source,
    a renamed parameter as a warning naming it."""
    from click.testing import CliRunner

    from otel_verl.tools import cli

    _without_live_checks(monkeypatch, cli)
    generate = "class TokenizerManager:\n    async def generate_request(self, {param}, request=None):\n        yield {{}}\n"
    keys = hookcheck.server_meta_keys()
    stats = "def convert_to_output_meta_info():\n    return {{{}}}\n"
    files = {"sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/managers/__init__.py": "",
             "sglang/srt/observability/__init__.py": ""}
    good = _write(tmp_path / "good", {**files, "sglang/srt/managers/tokenizer_manager.py": generate.format(param="obj"),
                                      "sglang/srt/observability/req_time_stats.py": stats.format(", ".join(f"{k!r}: 1" for k in keys))})
    written = [k for k in keys if k != "e2e_latency"]  # the only source of sglang_time_ms
    bad = _write(tmp_path / "bad", {**files, "sglang/srt/managers/tokenizer_manager.py": generate.format(param="req"),
                                    "sglang/srt/observability/req_time_stats.py": stats.format(", ".join(f"{k!r}: 1" for k in written))})
    env = {**CLEAN_ENV, "VERL_TRACE_DIR": str(tmp_path / "trace"), "COLUMNS": "400"}
    result = CliRunner(env=env).invoke(cli.main, ["doctor", "--engine-source", good, "--engine-source", bad],
                                       catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    tables = {}  # title -> rows
    for line in lines:
        if line.startswith("engine sources: "):
            title = line
            tables[title] = []
        elif line.strip() and tables and not line.startswith(("hook ", "─", "warning", "  fix", "doctor")):
            tables[title].append(line)
    good_rows, bad_rows = tables[f"engine sources: source at {good}"], tables[f"engine sources: source at {bad}"]
    hook = "sglang.srt.managers.tokenizer_manager:TokenizerManager.generate_request"
    assert good_rows[0].split()[:4] == [hook, "ok", "parameters", "found"], good_rows
    assert bad_rows[0].split()[:4] == [hook, "warn", "missing", "parameter:"], bad_rows
    assert f"warning: {hook}: missing parameter: TokenizerManager.generate_request has no parameter obj" in lines
    assert f"  fix: the wrapper would be skipped with source at {bad}: report the drift" in lines
    meta = "meta_info keys the trajectory timings read".split()
    assert good_rows[1].split()[:len(meta) + 1] == meta + ["ok"] and "never" not in " ".join(good_rows)
    assert bad_rows[1].split()[:len(meta) + 1] == meta + ["info"]
    bad_text = " ".join(" ".join(row.split()) for row in bad_rows)
    assert f"writes {', '.join(written)}; never writes e2e_latency; so the trajectory file's sglang_time_ms" in bad_text


def test_doctor_no_hooks_reads_only_the_sources_given(tmp_path, monkeypatch):
    """``--no-hooks`` (the quick check) leaves out the wheel cache, not an explicit source."""
    from click.testing import CliRunner

    from otel_verl.tools import cli

    _without_live_checks(monkeypatch, cli)
    monkeypatch.setattr(cli, "_hook_checks", lambda: pytest.fail("--no-hooks imported verl"))
    source = _write(tmp_path / "src", {"vllm/__init__.py": ""})
    env = {**CLEAN_ENV, "VERL_TRACE_DIR": str(tmp_path / "trace"), engine_wheels.CACHE_ENV: str(tmp_path / "empty")}
    quick = CliRunner(env=env).invoke(cli.main, ["doctor", "--no-hooks"], catch_exceptions=False)
    assert quick.exit_code == 0 and "engine sources" not in quick.output
    given = CliRunner(env=env).invoke(cli.main, ["doctor", "--no-hooks", "--engine-source", source], catch_exceptions=False)
    assert given.exit_code == 0 and f"engine sources: source at {source}" in given.output.splitlines()


def test_doctor_without_engine_sources_says_where_it_looked(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from otel_verl.tools import cli

    _without_live_checks(monkeypatch, cli)
    env = {**CLEAN_ENV, "VERL_TRACE_DIR": str(tmp_path / "trace"), "COLUMNS": "250",
           engine_wheels.CACHE_ENV: str(tmp_path / "empty")}
    result = CliRunner(env=env).invoke(cli.main, ["doctor"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"no engine wheels in {tmp_path / 'empty'}" in result.output


def test_doctor_rejects_a_file_that_is_no_source(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from otel_verl.tools import cli

    monkeypatch.setattr(cli, "_hook_checks", lambda: [])
    other = tmp_path / "sglang.tar.gz"
    other.write_bytes(b"")
    result = CliRunner().invoke(cli.main, ["doctor", "--engine-source", str(other)])
    assert result.exit_code == 2 and "neither a directory nor a .whl file" in result.output


@pytest.mark.verl
def test_doctor_on_a_doctored_copy_of_sglang(tmp_path, monkeypatch):
    """The real tokenizer_manager.py of verl's pinned sglang, copied into a source tree
    with the hooked parameter renamed by a text replace: doctor names it."""
    from click.testing import CliRunner

    from otel_verl.tools import cli

    monkeypatch.setattr(cli, "_hook_checks", lambda: [])
    real = engine_tree("sglang", "pinned")
    (module, target, params) = next(s for s in hook_specs({"sglang"}) if s[1] == "TokenizerManager.generate_request")
    found = check_hook(module, target, params, [real])
    text = rename_parameter(real.read(module)[1], int(found.where.rsplit(":", 1)[1]), "obj", "request_obj")
    root = tmp_path / "src"
    parts = module.split(".")
    _write(root, {**{"/".join(parts[:i]) + "/__init__.py": "" for i in range(1, len(parts))},
                  "/".join(parts) + ".py": text})
    env = {**CLEAN_ENV, "VERL_TRACE_DIR": str(tmp_path / "trace")}
    result = CliRunner(env=env).invoke(cli.main, ["doctor", "--engine-source", str(root)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"engine sources: source at {root}" in result.output.splitlines()
    assert f"warning: {module}:{target}: missing parameter: {target} has no parameter obj" in result.output.splitlines()
