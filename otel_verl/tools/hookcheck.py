"""Checking the hooks against a package's source, without importing the package.

The instrumentation's hook table (:func:`otel_verl.instrumentation.all_hooks`) names each
wrap target (module, ``Class.method`` or function) and the parameters its wrapper reads.
At run time :mod:`otel_verl.instrumentation.hooks` checks them on the imported objects,
but sglang and vLLM cannot be imported on a machine without a GPU, and verl's server
modules import them. This module reads the source with :mod:`ast` instead: from a
directory (site-packages, an unpacked tree) or a wheel (members read on demand and kept
unpacked in a cache). It follows what Python's lookup would: names imported from another
module, methods inherited from base classes, definitions under ``if``/``try``.

It also checks which of the ``meta_info`` keys the trajectory file's server timings read
a sglang writes (string literals in the modules that build ``meta_info``), and so which
of those timings stay null with it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import tempfile
import textwrap
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

FOUND = "found"
MISSING_MODULE = "missing module"
MISSING_TARGET = "missing target"  # class or function
MISSING_METHOD = "missing method"
MISSING_PARAMETER = "missing parameter"
UNVERIFIED = "unverified"  # found, but what it is cannot be read from the source
UNAVAILABLE = "package not available"

# Where sglang builds a finished request's meta_info: the tokenizer manager, and the
# request time stats it converts to output keys (sglang >= 0.5).
SGLANG_META_MODULES = (
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.observability.req_time_stats",
)


# --------------------------------------------------------------------------- source trees


class SourceTree:
    """Python source of one or more top-level packages, read by module name."""

    label = "source"

    def packages(self) -> Set[str]:
        raise NotImplementedError

    def read(self, module: str) -> Optional[Tuple[str, str]]:
        """``(path, text)`` of ``module``'s source, ``None`` when it has none here."""
        raise NotImplementedError


def _module_paths(module: str) -> Tuple[str, str]:
    base = module.replace(".", "/")
    return base + ".py", base + "/__init__.py"


class DirectoryTree(SourceTree):
    """Packages under a directory laid out as on ``sys.path`` (site-packages, a checkout)."""

    def __init__(self, root: str, label: str = "") -> None:
        self.root = os.path.abspath(root)
        self.label = label or f"source at {self.root}"
        self._packages: Optional[Set[str]] = None

    def packages(self) -> Set[str]:
        if self._packages is None:
            try:
                names = os.listdir(self.root)
            except OSError:
                names = []
            self._packages = {n for n in names if n.isidentifier() and os.path.isfile(os.path.join(self.root, n, "__init__.py"))}
        return self._packages

    def read(self, module: str) -> Optional[Tuple[str, str]]:
        for rel in _module_paths(module):
            path = os.path.join(self.root, rel)
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    return path, f.read()
        return None


class WheelTree(SourceTree):
    """The Python files of a wheel. A member read once is kept unpacked under
    ``extract_dir``, so later checks need not open the (large) wheel again."""

    def __init__(self, wheel: str, extract_dir: Optional[str] = None) -> None:
        self.wheel = os.path.abspath(wheel)
        name, version = wheel_name_version(self.wheel)
        self.dist, self.version = name, version
        self.label = f"{name} {version} (wheel)"
        self.extract_dir = extract_dir
        self._names: Optional[Set[str]] = None

    def _members(self) -> Set[str]:
        if self._names is None:
            with zipfile.ZipFile(self.wheel) as z:
                self._names = set(z.namelist())
        return self._names

    def packages(self) -> Set[str]:
        return {n.split("/", 1)[0] for n in self._members() if n.endswith("/__init__.py") and n.count("/") == 1}

    def read(self, module: str) -> Optional[Tuple[str, str]]:
        for rel in _module_paths(module):
            if self.extract_dir:
                cached = os.path.join(self.extract_dir, rel)
                if os.path.isfile(cached):
                    with open(cached, encoding="utf-8", errors="replace") as f:
                        return cached, f.read()
        members = self._members()
        for rel in _module_paths(module):
            if rel in members:
                with zipfile.ZipFile(self.wheel) as z:
                    data = z.read(rel)
                path = self._keep(rel, data) if self.extract_dir else f"{self.wheel}!{rel}"
                return path, data.decode("utf-8", errors="replace")
        return None

    def _keep(self, rel: str, data: bytes) -> str:
        path = os.path.join(self.extract_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent check reads the old or the whole file
        return path


def wheel_name_version(path: str) -> Tuple[str, str]:
    """``(distribution, version)`` from a wheel's file name (PEP 427)."""
    parts = os.path.basename(path).split("-")
    if len(parts) < 5 or not path.endswith(".whl"):
        raise ValueError(f"not a wheel file name: {os.path.basename(path)}")
    return parts[0].replace("_", "-").lower(), parts[1]


def installed_tree(package: str) -> Optional[DirectoryTree]:
    """Where ``package`` (a top-level name) is installed, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    location = list(spec.submodule_search_locations)[0]
    return DirectoryTree(os.path.dirname(location), label=f"installed {package}")


def installed_trees(packages: Iterable[str]) -> List[SourceTree]:
    """:func:`installed_tree` of each of ``packages`` that is installed."""
    return [t for t in (installed_tree(p) for p in dict.fromkeys(packages)) if t is not None]


def open_source(path: str, extract_dir: Optional[str] = None) -> SourceTree:
    """A wheel file or a directory (holding packages, or a package itself) as a
    :class:`SourceTree` (``ValueError`` otherwise)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "__init__.py")):  # a package: its parent is the root
            return DirectoryTree(os.path.dirname(os.path.abspath(path)), label=f"source at {os.path.abspath(path)}")
        return DirectoryTree(path)
    if os.path.isfile(path) and path.endswith(".whl"):
        return WheelTree(path, extract_dir)
    raise ValueError(f"{path}: neither a directory nor a .whl file")


# --------------------------------------------------------------------------- reading definitions


@dataclass(frozen=True)
class Definition:
    module: str
    path: str
    node: ast.AST  # FunctionDef, AsyncFunctionDef or ClassDef; another node: defined, unreadable

    @property
    def where(self) -> str:
        return f"{self.path}:{getattr(self.node, 'lineno', 0)}"


class _Resolver:
    """Finds definitions in a set of trees, following imports and base classes."""

    def __init__(self, trees: Sequence[SourceTree]) -> None:
        self.trees = list(trees)
        self._parsed: Dict[str, Optional[Tuple[str, ast.Module, bool]]] = {}

    def tree_for(self, module: str) -> Optional[SourceTree]:
        top = module.split(".", 1)[0]
        for tree in self.trees:
            if top in tree.packages():
                return tree
        return None

    def parsed(self, module: str) -> Optional[Tuple[str, ast.Module, bool]]:
        """``(path, tree, is_package)`` of ``module``, ``None`` when no tree has it."""
        if module not in self._parsed:
            tree = self.tree_for(module)
            found = tree.read(module) if tree else None
            result = None
            if found is not None:
                path, text = found
                try:
                    result = (path, ast.parse(text, filename=path), os.path.basename(path) == "__init__.py")
                except SyntaxError:
                    result = None
            self._parsed[module] = result
        return self._parsed[module]

    def lookup(self, module: str, name: str, depth: int = 0) -> Optional[Definition]:
        """The module-level binding ``name`` of ``module``, through ``from x import name``."""
        parsed = self.parsed(module)
        if parsed is None or depth > 10:
            return None
        path, tree, is_package = parsed
        found: Optional[Definition] = None
        star_sources: List[str] = []
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = Definition(module, path, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        star_sources.append(_absolute(module, is_package, node))
                    elif (alias.asname or alias.name) == name:
                        source = _absolute(module, is_package, node)
                        target = self.lookup(source, alias.name, depth + 1) or self._submodule(f"{source}.{alias.name}")
                        found = target or Definition(module, path, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = Definition(module, path, node)
        for source in reversed(star_sources):  # from x import *: the last one binding name wins
            if found is None:
                found = self.lookup(source, name, depth + 1)
        if found is None and is_package:
            found = self._submodule(f"{module}.{name}")
        return found

    def _submodule(self, module: str) -> Optional[Definition]:
        parsed = self.parsed(module)
        return Definition(module, parsed[0], parsed[1]) if parsed else None

    def member(self, cls: Definition, name: str, depth: int = 0) -> Tuple[Optional[Definition], List[str]]:
        """``(definition of cls.name, bases that could not be read)``, through the MRO's
        readable part (depth first, as a first approximation of the C3 order)."""
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        for stmt in _top_level(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Definition(cls.module, cls.path, stmt), []
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return Definition(cls.module, cls.path, stmt), []
        unread: List[str] = []
        if depth > 10:
            return None, unread
        for base in node.bases:
            base_def = self._base(cls.module, base)
            if base_def is None or not isinstance(base_def.node, ast.ClassDef):
                text = ast.unparse(base)
                if text not in ("object", "Generic") and not text.startswith(("Generic[", "ABC", "abc.")):
                    unread.append(text)
                continue
            found, more = self.member(base_def, name, depth + 1)
            if found is not None:
                return found, []
            unread += more
        return None, unread

    def _base(self, module: str, base: ast.expr) -> Optional[Definition]:
        if isinstance(base, ast.Subscript):  # Base[T]
            base = base.value
        if isinstance(base, ast.Name):
            return self.lookup(module, base.id)
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):  # mod.Base
            imported = self._imported_module(module, base.value.id)
            return self.lookup(imported, base.attr) if imported else None
        return None

    def _imported_module(self, module: str, alias: str) -> Optional[str]:
        parsed = self.parsed(module)
        if parsed is None:
            return None
        _, tree, is_package = parsed
        for node in _top_level(tree.body):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname == alias or (a.asname is None and a.name == alias):
                        return a.name
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == alias:
                        return f"{_absolute(module, is_package, node)}.{a.name}"
        return None


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, including those under if/try (version and
    optional-import branches), in source order."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)
        else:
            yield node


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def parameters(node: ast.AST) -> Tuple[Set[str], bool]:
    """``(parameter names, takes **kwargs)`` of a function definition."""
    args = node.args  # type: ignore[attr-defined]
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    return names, args.kwarg is not None


# --------------------------------------------------------------------------- checking hooks


@dataclass(frozen=True)
class HookSource:
    """What the source says about one hook."""

    hook: str  # the hook's name, ``module:target``
    source: str  # the tree's label
    state: str  # FOUND, MISSING_*, UNVERIFIED or UNAVAILABLE
    detail: str = ""
    missing: Tuple[str, ...] = ()  # MISSING_PARAMETER: the parameters the target lacks
    where: str = ""  # path:line of the definition read

    @property
    def ok(self) -> bool:
        return self.state in (FOUND, UNVERIFIED)


def check_hook(module: str, target: str, params: Sequence[str], trees: Sequence[SourceTree],
               resolver: Optional[_Resolver] = None) -> HookSource:
    """Check one wrap target (``module``, ``Class.method`` or ``function``) and the
    parameters its wrapper reads: the target exists and names each of them (positional,
    keyword or keyword-only)."""
    name = f"{module}:{target}"
    resolver = resolver or _Resolver(trees)
    tree = resolver.tree_for(module)
    if tree is None:
        return HookSource(name, "", UNAVAILABLE, f"{module.split('.', 1)[0]} not available")
    label = tree.label
    if resolver.parsed(module) is None:
        return HookSource(name, label, MISSING_MODULE, f"no module {module}")
    owner_name, _, attr = target.rpartition(".")
    if owner_name:
        owner = resolver.lookup(module, owner_name)
        if owner is None:
            return HookSource(name, label, MISSING_TARGET, f"no class {owner_name} in {module}")
        if not isinstance(owner.node, ast.ClassDef):
            return HookSource(name, label, UNVERIFIED, f"{owner_name} is not a class statement here", where=owner.where)
        found, unread = resolver.member(owner, attr)
        if found is None:
            if unread:
                return HookSource(name, label, UNVERIFIED,
                                  f"{target} not defined in {owner_name}; may come from {', '.join(unread)} (not readable)",
                                  where=owner.where)
            return HookSource(name, label, MISSING_METHOD, f"{owner_name} has no method {attr}", where=owner.where)
    else:
        found = resolver.lookup(module, attr)
        if found is None:
            return HookSource(name, label, MISSING_TARGET, f"no function {attr} in {module}")
    if not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return HookSource(name, label, UNVERIFIED, f"{target} is bound by a {type(found.node).__name__}, not a def",
                          where=found.where)
    names, takes_kwargs = parameters(found.node)
    missing = tuple(p for p in params if p not in names)
    if missing:
        # Stricter than the run-time check, which lets **kwargs stand in: a parameter the
        # signature no longer names most likely was renamed, and the wrapper would read None.
        detail = f"{target} has no parameter {', '.join(missing)}"
        return HookSource(name, label, MISSING_PARAMETER, detail + (" (only its **kwargs could carry it)" if takes_kwargs else ""),
                          missing, found.where)
    return HookSource(name, label, FOUND, where=found.where)


def check_hooks(hook_specs: Iterable[Tuple[str, str, Sequence[str]]], trees: Sequence[SourceTree]) -> List[HookSource]:
    """:func:`check_hook` for each ``(module, target, params)``, sharing parsed files."""
    resolver = _Resolver(trees)
    return [check_hook(m, t, p, trees, resolver) for m, t, p in hook_specs]


def hook_specs(packages: Optional[Set[str]] = None) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """``(module, target, params)`` of every hook the instrumentation installs (those in
    ``packages``' top-level packages when given), straight from the hook table."""
    from otel_verl.instrumentation import all_hooks

    specs = [(h.module, h.target, tuple(h.params)) for h in all_hooks()]
    return [s for s in specs if packages is None or s[0].split(".", 1)[0] in packages]


# --------------------------------------------------------------------------- sglang meta_info keys


def server_meta_keys() -> Tuple[str, ...]:
    """The sglang ``meta_info`` keys the trajectory file's server timings read, taken from
    the exporter's own code, so this check follows any change there: each ``meta.get(K)``,
    ``meta[K]`` on the function's ``meta`` parameter, where ``K`` is a string, a constant
    (or a tuple of them a loop walks), in that function and in the functions of otel_verl
    it hands ``meta`` to."""
    from otel_verl.legacy import trajectory_jsonl

    keys: List[str] = []
    _keys_read(trajectory_jsonl._server_timings, None, keys, set())
    return tuple(keys)


def _keys_read(func: Any, param: Optional[str], keys: List[str], seen: Set[Any]) -> None:
    if func in seen or not getattr(func, "__module__", "").startswith("otel_verl"):
        return
    seen.add(func)
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    except (OSError, TypeError, SyntaxError):
        return
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return
    names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    param = param or (names[0] if names else None)
    namespace = func.__globals__
    loops = {n.target.id: n.iter for n in ast.walk(node) if isinstance(n, (ast.For, ast.comprehension))
             and isinstance(n.target, ast.Name)}

    def strings(expr: ast.AST, depth: int = 0) -> Tuple[str, ...]:
        if isinstance(expr, ast.Constant):
            return (expr.value,) if isinstance(expr.value, str) else ()
        if isinstance(expr, (ast.Tuple, ast.List)):
            return tuple(k for e in expr.elts for k in strings(e, depth))
        if isinstance(expr, ast.Name) and expr.id in loops and depth < 5:
            return strings(loops[expr.id], depth + 1)
        value = _resolve(expr, namespace)
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        return ()

    def is_meta(expr: ast.AST) -> bool:
        return isinstance(expr, ast.Name) and expr.id == param

    for sub in ast.walk(node):
        found: Tuple[str, ...] = ()
        if isinstance(sub, ast.Subscript) and is_meta(sub.value):
            found = strings(sub.slice)
        elif isinstance(sub, ast.Call):
            if isinstance(sub.func, ast.Attribute) and sub.func.attr == "get" and is_meta(sub.func.value) and sub.args:
                found = strings(sub.args[0])
            else:  # meta handed to another function: what it reads counts
                callee = _resolve(sub.func, namespace)
                for index, arg in enumerate(sub.args):
                    if is_meta(arg) and callable(callee):
                        _keys_read(callee, _parameter_at(callee, index), keys, seen)
                for keyword in sub.keywords:
                    if is_meta(keyword.value) and callable(callee):
                        _keys_read(callee, keyword.arg, keys, seen)
        keys.extend(k for k in found if k not in keys)


def _resolve(expr: ast.AST, namespace: Dict[str, Any]) -> Any:
    """The object a ``name`` / ``name.attr...`` expression names in ``namespace`` (or None)."""
    if isinstance(expr, ast.Name):
        return namespace.get(expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(expr.value, namespace)
        return getattr(owner, expr.attr, None) if owner is not None else None
    return None


def _parameter_at(func: Any, index: int) -> Optional[str]:
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names[index] if index < len(names) else None


def string_literals(tree: SourceTree, modules: Sequence[str] = SGLANG_META_MODULES) -> Tuple[Set[str], List[str]]:
    """``(every string literal in modules, the modules the tree lacks)``."""
    literals: Set[str] = set()
    absent: List[str] = []
    for module in modules:
        found = tree.read(module)
        if found is None:
            absent.append(module)
            continue
        for node in ast.walk(ast.parse(found[1])):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
    return literals, absent


@dataclass(frozen=True)
class MetaKeys:
    source: str
    written: Tuple[str, ...]  # keys read by the exporter that sglang's source writes
    absent: Tuple[str, ...]  # keys read by the exporter that it does not
    missing_modules: Tuple[str, ...] = ()
    null_fields: Tuple[str, ...] = ()  # trajectory fields the written keys leave null


def check_meta_keys(tree: SourceTree, keys: Optional[Sequence[str]] = None) -> MetaKeys:
    """Which keys the trajectory timings read (``keys``: :func:`server_meta_keys`) this
    sglang writes, and which timing fields stay null with only those."""
    from otel_verl.legacy import trajectory_jsonl

    keys = tuple(server_meta_keys() if keys is None else keys)
    literals, absent_modules = string_literals(tree)
    written = tuple(k for k in keys if k in literals)
    timings = trajectory_jsonl._server_timings({k: 1.0 for k in written})
    return MetaKeys(tree.label, written, tuple(k for k in keys if k not in literals), tuple(absent_modules),
                    tuple(field for field, value in timings.items() if value is None))
