"""otel_verl uses OpenTelemetry's public API only: no name starting with ``_`` is imported
from, read from or written to an ``opentelemetry`` module or object.

An AST scan of every module of the package. What counts as an OpenTelemetry object:
anything reached from a name imported from ``opentelemetry`` (a module, class, function
or constant), and the objects the SDK hands to our code, which we cannot tell apart by
their type in an AST. So, for an attribute whose name starts with one underscore, the
object must be ``self`` / ``cls`` / ``super()`` or a module or class of otel_verl's own;
``getattr``/``setattr``/``hasattr``/``delattr`` with such a literal name are refused
whatever their object.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List, Set

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "otel_verl"


# Private names of objects that are not OpenTelemetry's, by module: a new entry says whose
# object it is. (verl's, Ray's, transformers' and our own private names are their owners'
# business and checked elsewhere: hooks skip what drifted.)
NOT_OPENTELEMETRY = {
    "otel_verl/activation.py": {"_otel_verl_patched"},  # our mark on ray.init
    "otel_verl/bootstrap.py": {"_otel_verl_follows"},  # our mark on ray.init
    "otel_verl/accelerated/batch.py": {"_after_fork_in_child"},  # a BatchExportProcessor's
    "otel_verl/exporters/loss_file.py": {"_after_fork_in_child"},  # a LossFileProcessor's
    "otel_verl/exporters/_writer.py": {"_after_fork_in_child"},  # a BackgroundWriter's
    "otel_verl/offload/forwarder.py": {"_after_fork_in_child"},  # an OffloadSpanProcessor's
    "otel_verl/offload/host.py": {"_exit"},  # os._exit: the export process's exit, bounded
    "otel_verl/text_codec.py": {"_tokenizer", "_encode_plus", "_decode"},  # transformers'
    "otel_verl/instrumentation/agent_loop.py": {"_agent_loop_registry"},  # verl's
    "otel_verl/demo/harness_v1.py": {"_enable_hybrid_replicas"},  # verl's
    "otel_verl/demo/sglang_standin.py": {  # verl's SGLangHttpServer fields the stand-in fills
        "_disaggregation_role", "_disaggregation_bootstrap_port", "_pd_decode_peers", "_pd_bootstrap_host",
        "_server_address", "_server_port", "_master_address", "_master_port", "_master_sock",
    },
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Scan(ast.NodeVisitor):
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.problems: List[str] = []
        self.otel_names: Set[str] = set()  # names bound to something of opentelemetry
        self.own_names: Set[str] = set()  # names bound to otel_verl modules, or defined here

    def flag(self, node: ast.AST, what: str, name: str = "") -> None:
        if name in NOT_OPENTELEMETRY.get(str(self.path.relative_to(PACKAGE.parent)), ()):
            return
        self.problems.append(f"{self.path.relative_to(PACKAGE.parent)}:{node.lineno}: {what}")

    # -- imports -------------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            if alias.name.split(".")[0] == "opentelemetry":
                if any(_private(part) for part in alias.name.split(".")):
                    self.flag(node, f"import {alias.name}")
                self.otel_names.add(bound)
            elif alias.name.split(".")[0] == "otel_verl":
                self.own_names.add(bound)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] == "opentelemetry":
            if any(_private(part) for part in module.split(".")):
                self.flag(node, f"from {module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    self.flag(node, f"from {module} import {alias.name}")
                self.otel_names.add(alias.asname or alias.name)
        elif node.level or module.split(".")[0] == "otel_verl":
            for alias in node.names:
                self.own_names.add(alias.asname or alias.name)

    # -- definitions of our own ----------------------------------------------------------

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.own_names.add(node.name)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.own_names.add(node.name)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    # -- uses ------------------------------------------------------------------------------

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr) and not self._ours(node.value):
            self.flag(node, f"{ast.unparse(node)}", node.attr)
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.otel_names and _private(node.attr):
            self.problems.append(f"{self.path.name}:{node.lineno}: {ast.unparse(node)} (an opentelemetry name)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            self.flag(node, f"{func.id}(..., {node.args[1].value!r})", node.args[1].value)
        self.generic_visit(node)

    def _ours(self, value: ast.AST) -> bool:
        if isinstance(value, ast.Name):
            return value.id in ("self", "cls") or value.id in self.own_names
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            return True
        return False


def _scan(path: pathlib.Path) -> List[str]:
    tree = ast.parse(path.read_text(), str(path))
    scan = _Scan(path)
    # names defined or imported anywhere in the module count as ours before any use
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scan.visit(node)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            scan.own_names.add(node.name)
    scan.problems.clear()
    scan.visit(tree)
    return scan.problems


def test_the_package_uses_no_private_opentelemetry_name():
    problems = [problem for path in sorted(PACKAGE.rglob("*.py")) for problem in _scan(path)]
    assert not problems, "private names used:\n" + "\n".join(problems)


@pytest.mark.parametrize("source", [
    "from opentelemetry.sdk.trace.sampling import _get_from_env_or_default",
    "import opentelemetry.sdk._logs",
    "from opentelemetry import context\ncontext._RUNTIME_CONTEXT",
    "def f(span):\n    return span._attributes",
    "def f(tracer):\n    return getattr(tracer, '_span_limits', None)",
    "def f(span, g):\n    span._readable_span = g",
])
def test_the_scan_finds_each_kind_of_use(tmp_path, source):
    path = PACKAGE / "_probe_not_a_module.py"
    problems = _Scan(path)
    tree = ast.parse(source)
    problems.visit(tree)
    assert problems.problems, source


def test_the_scan_lets_our_own_private_names_be():
    source = ("from otel_verl.events import _core\n"
              "class A:\n    def f(self):\n        return self._x, _core._installed, super()._y\n")
    scan = _Scan(PACKAGE / "_probe_not_a_module.py")
    scan.visit(ast.parse(source))
    assert scan.problems == []
