"""The import graph of otel_verl (outside demo/): no cycle, the instrumentation never
reaches the configurator, and otel_verl's accelerators (``otel_verl.accelerated``) reach
neither.

Every ``import`` / ``from ... import`` of an otel_verl module counts, at module level or
inside a function (an import moved into a function to dodge a cycle is still an edge),
and so does ``importlib.import_module("otel_verl...")`` / ``__import__`` with a literal
name. Importing ``a.b`` also runs ``a/__init__.py``; that implicit edge to the parent
package is left out: a package that re-exports its submodules would otherwise be in a
cycle with each of them.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

import otel_verl

PACKAGE_DIR = os.path.dirname(os.path.abspath(otel_verl.__file__))
LEFT_OUT = ("otel_verl.demo",)  # stand-ins and demo drivers, not the library

# The configurator: builds providers, processors, the export process, switches tracing on.
CONFIGURATOR = ("otel_verl.bootstrap", "otel_verl.activation")
# The instrumentation: wrappers around verl and the events API they report to.
INSTRUMENTATION = ("otel_verl.instrumentation", "otel_verl.events")

Edge = Tuple[str, str, str]  # (importer, imported, "path:line")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[: -len(".py")]
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> Dict[str, str]:
    out = {}
    for root, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                module = _module_name(path)
                if not _within(module, LEFT_OUT):
                    out[module] = path
    return out


def _within(module: str, packages: Tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _is_package(path: str) -> bool:
    return os.path.basename(path) == "__init__.py"


def _resolve(name: str, modules: Set[str]) -> Optional[str]:
    """The deepest otel_verl module ``name`` names (``a.b.func`` -> ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.AST, module: str, is_package: bool, modules: Set[str]) -> Set[str]:
    """The otel_verl modules an import node loads (``from x import y``: ``x.y`` when y is
    a submodule, else ``x``)."""
    names: List[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            names = [node.args[0].value]
    return {target for target in (_resolve(name, modules) for name in names) if target and target != module}


def import_graph() -> List[Edge]:
    sources = _sources()
    modules = set(sources)
    edges: List[Edge] = []
    for module, path in sorted(sources.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            where = f"{os.path.relpath(path, os.path.dirname(PACKAGE_DIR))}:{getattr(node, 'lineno', 0)}"
            edges += [(module, target, where) for target in sorted(_targets(node, module, _is_package(path), modules))]
    return edges


def _cycles(edges: List[Edge]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph: Dict[str, Set[str]] = {}
    for src, dst, _ in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _describe(component: List[str], edges: List[Edge]) -> str:
    """One cycle through the component's first module, edge by edge."""
    inside = [edge for edge in edges if edge[0] in component and edge[1] in component]
    start = component[0]
    reached = _reachable(start, inside)
    back = next(edge for edge in inside if edge[1] == start and (edge[0] == start or edge[0] in reached))
    path = _path(start, back[0], reached) if back[0] != start else ""
    hops = [hop for hop in path.split("; ") if hop] + [f"{back[0]} -> {back[1]} ({back[2]})"]
    return f"cycle among {len(component)} modules ({', '.join(component)}):\n  " + "\n  ".join(hops)


def _reachable(start: str, edges: List[Edge]) -> Dict[str, Edge]:
    """Every module ``start`` imports, directly or not, with the edge that first reached it."""
    by_src: Dict[str, List[Edge]] = {}
    for edge in edges:
        by_src.setdefault(edge[0], []).append(edge)
    seen: Dict[str, Edge] = {}
    todo = [start]
    while todo:
        for edge in by_src.get(todo.pop(), []):
            if edge[1] not in seen and edge[1] != start:
                seen[edge[1]] = edge
                todo.append(edge[1])
    return seen


def _path(start: str, goal: str, reached: Dict[str, Edge]) -> str:
    hops = []
    node = goal
    while node != start:
        src, dst, where = reached[node]
        hops.append(f"{src} -> {dst} ({where})")
        node = src
    return "; ".join(reversed(hops))


def test_the_graph_sees_module_and_function_level_imports():
    """The scan itself: known edges of both kinds are found, the parent-package edge is not."""
    edges = {(src, dst) for src, dst, _ in import_graph()}
    assert ("otel_verl", "otel_verl.bootstrap") in edges  # module level, `from x import name`
    assert ("otel_verl.bootstrap", "otel_verl.offload.forwarder") in edges  # inside a function
    assert ("otel_verl.carriers", "otel_verl.settings") in edges  # `from otel_verl import module`, in a function
    assert ("otel_verl.instrumentation.agent_loop", "otel_verl.instrumentation.hooks") in edges
    assert not any(dst == "otel_verl.instrumentation" for src, dst in edges if src.startswith("otel_verl.instrumentation."))
    assert not any(_within(src, LEFT_OUT) for src, _ in edges)


def test_cycles_are_found_and_described():
    edges = [("a", "b", "a.py:1"), ("b", "c", "b.py:2"), ("c", "a", "c.py:3"), ("c", "d", "c.py:4")]
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _describe(["a", "b", "c"], edges).endswith("a -> b (a.py:1)\n  b -> c (b.py:2)\n  c -> a (c.py:3)")
    assert _path("a", "d", _reachable("a", edges)) == "a -> b (a.py:1); b -> c (b.py:2); c -> d (c.py:4)"


def test_no_import_cycle():
    edges = import_graph()
    cycles = _cycles(edges)
    assert not cycles, "\n".join(_describe(c, edges) for c in cycles)


def _paths_into(sources: Tuple[str, ...], goals: Tuple[str, ...], edges: List[Edge]) -> List[str]:
    """Every import path from a module within ``sources`` to one within ``goals``."""
    found = []
    for start in sorted({src for src, _, _ in edges if _within(src, sources)}):
        reached = _reachable(start, edges)
        found += [_path(start, goal, reached) for goal in sorted(reached) if _within(goal, goals)]
    return found


def _importers(packages: Tuple[str, ...], edges: List[Edge]) -> Set[str]:
    return {src for src, _, _ in edges if _within(src, packages)}


def test_the_instrumentation_never_imports_the_configurator():
    edges = import_graph()
    assert {"otel_verl.instrumentation.hooks", "otel_verl.events.worker"} <= _importers(INSTRUMENTATION, edges)
    found = _paths_into(INSTRUMENTATION, CONFIGURATOR, edges)
    assert not found, "\n".join(found)


def test_carriers_never_import_the_configurator():
    """Unpickling a carrier imports carriers.py: only the function a carrier names (see
    carriers.restore_with) may bring in the configurator."""
    reached = _reachable("otel_verl.carriers", import_graph())
    found = [_path("otel_verl.carriers", goal, reached) for goal in CONFIGURATOR if goal in reached]
    assert not found, "\n".join(found)


TOOLS = ("otel_verl.tools",)  # doctor, report, replay and their helpers: never in a training process
STORE_ENGINE = ("chdb", "clickhouse_connect")  # the span store's engine and client: the report's alone
LEGACY = ("otel_verl.legacy",)


def test_the_legacy_outputs_have_one_way_in():
    """Only the outputs module makes the legacy outputs: no wrapper, no part of the events
    API or of the export process and no other output imports the legacy layer, directly
    or not, and it imports none of them."""
    edges = import_graph()
    into = [(src, dst, where) for src, dst, where in edges if _within(dst, LEGACY) and not _within(src, LEGACY)]
    assert OUTPUTS in {src for src, _, _ in into}
    others = [f"{src} -> {dst} ({where})" for src, dst, where in into
              if not (src == OUTPUTS and dst == "otel_verl.legacy") and not _within(src, TOOLS)]
    assert not others, "\n".join(others)
    out = [f"{src} -> {dst} ({where})" for src, dst, where in edges if _within(src, LEGACY)
           and _within(dst, INSTRUMENTATION + CONFIGURATOR + ("otel_verl.offload", OUTPUTS))]
    assert not out, "\n".join(out)


def test_the_instrumentation_reaches_no_legacy_module():
    """The events API and the wrappers know spans and their payload's data
    (otel_verl.rollout_data), never a legacy format."""
    edges = import_graph()
    assert "otel_verl.rollout_data" in {dst for src, dst, _ in edges if _within(src, INSTRUMENTATION)}
    found = _paths_into(INSTRUMENTATION, LEGACY, edges)
    assert not found, "\n".join(found)


OUTPUTS = "otel_verl.outputs"  # makes every output, in a traced process and in an export process
BELOW_THE_CONFIGURATOR = ("otel_verl.offload", "otel_verl.exporters", "otel_verl.legacy")


def test_the_outputs_and_the_export_process_never_reach_the_configurator():
    edges = import_graph()
    below = BELOW_THE_CONFIGURATOR + (OUTPUTS,)
    assert {"otel_verl.offload.host", "otel_verl.legacy.sample_csv"} <= _importers(below, edges)
    found = _paths_into(below, CONFIGURATOR, edges)
    assert not found, "\n".join(found)


def test_only_the_configurator_and_the_export_process_make_the_outputs():
    importers = {src for src, dst, _ in import_graph() if dst == OUTPUTS and not _within(src, TOOLS)}
    assert importers == {"otel_verl.bootstrap", "otel_verl.offload.host"}


def test_the_export_process_knows_no_legacy_type():
    """The export process runs the outputs it is given; the wire carries payloads opaque."""
    edges = import_graph()
    found = [f"{src} -> {dst} ({where})" for src, dst, where in edges
             if _within(src, ("otel_verl.offload",)) and _within(dst, LEGACY)]
    assert not found, "\n".join(found)


ACCELERATED = ("otel_verl.accelerated",)


def test_the_accelerators_import_no_configurator_legacy_output_events_or_instrumentation():
    """otel_verl's stand-ins for parts of the SDK are parts of outputs only: nothing they
    reach, directly or not, is the configurator, a legacy output, the events API or a wrapper
    of verl."""
    edges = import_graph()
    assert {"otel_verl.accelerated.otlp_exporter", "otel_verl.accelerated.batch"} <= _importers(ACCELERATED, edges)
    found = _paths_into(ACCELERATED, CONFIGURATOR + LEGACY + INSTRUMENTATION, edges)
    assert not found, "\n".join(found)


def test_a_span_crosses_to_the_export_process_as_its_record():
    """No span type of the wire's own: the export process's messages carry the record's one
    tuple form (otel_verl.record), and no module defines or imports a snapshot of a span."""
    from otel_verl.offload import wire

    assert not [name for name in vars(wire) if name.endswith("Snapshot")]
    found = []
    for module, path in _sources().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Snapshot"):
                found.append(f"{module}:{node.lineno} defines {node.name}")
            elif isinstance(node, ast.ImportFrom):
                found += [f"{module}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name.endswith("Snapshot")]
            elif isinstance(node, ast.Attribute) and node.attr.endswith("Snapshot"):
                found.append(f"{module}:{node.lineno} reads {node.attr}")
    assert not found, "\n".join(found)


def test_the_runtime_never_imports_a_tool():
    edges = import_graph()
    starts = sorted({src for src, _, _ in edges if not _within(src, TOOLS)})
    assert "otel_verl.bootstrap" in starts and "otel_verl.offload.host" in starts
    found = []
    for start in starts:
        reached = _reachable(start, edges)
        found += [_path(start, goal, reached) for goal in sorted(reached) if _within(goal, TOOLS)]
    assert not found, "\n".join(found)


def test_a_traced_process_and_its_export_process_load_no_tool_module(tmp_path):
    """As a rollout worker runs: outputs in the process and, offloaded, in its export process
    (whose modules it reports at exit), every output on."""
    import subprocess
    import sys
    import textwrap

    import fault_workload as w

    code = textwrap.dedent("""
        import sys
        import otel_verl, fault_workload as w
        assert otel_verl.configure()
        w.emit(1, w.new_uids(2), 2)
        otel_verl.shutdown()
        print("MODULES", " ".join(sorted(m for m in sys.modules if m.startswith(("otel_verl", "chdb", "clickhouse_connect")))))
    """)
    host_modules = tmp_path / "host_modules.txt"
    # the export process inherits PYTHONPATH: a sitecustomize there writes its modules at exit
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, sys

        def write_modules():
            spec = getattr(sys.modules.get("__main__"), "__spec__", None)
            if spec is not None and spec.name == "otel_verl.offload.host":
                with open({str(host_modules)!r}, "w") as f:
                    f.write(" ".join(sorted(m for m in sys.modules
                                            if m.startswith(("otel_verl", "chdb", "clickhouse_connect")))))

        atexit.register(write_modules)
    """))
    for offload in ("0", "1"):
        env = w.clean_env({"VERL_TRACE_DIR": str(tmp_path / f"trace{offload}"), "OTEL_VERL_OFFLOAD": offload,
                           "OTEL_VERL_OTLP_FILE": "1"})
        env["PYTHONPATH"] = f"{probe}{os.pathsep}{env['PYTHONPATH']}"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [line] = [x for x in proc.stdout.splitlines() if x.startswith("MODULES ")]
        loaded = line.split()[1:]
        assert "otel_verl.legacy.trajectory_jsonl" in loaded or offload == "1"
        assert not [m for m in loaded if _within(m, TOOLS + STORE_ENGINE + ("otel_verl.demo",))], loaded
    loaded = host_modules.read_text().split()
    assert "otel_verl.legacy.trajectory_jsonl" in loaded  # the export process wrote the outputs
    assert not [m for m in loaded if _within(m, TOOLS + STORE_ENGINE + ("otel_verl.demo",))], loaded
