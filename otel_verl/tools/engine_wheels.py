"""The inference engines' released wheels, kept in a local cache to read their source.

sglang and vLLM need a GPU to import, so :mod:`otel_verl.tools.hookcheck` reads their source
from the wheels instead. The versions worth checking are the ones the installed verl
pins in its extras (``verl[sglang]``, ``verl[vllm]``) and the newest on the registry.

Cache: ``$OTEL_VERL_WHEEL_CACHE`` or ``~/.cache/otel_verl/wheels``: the wheels, and under
``src/<wheel name>/`` the few Python files read from each. Only :func:`fetch` and
:func:`newest_version` reach the registry (through pip, so pip's index settings apply).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from otel_verl.tools.hookcheck import WheelTree, wheel_name_version

ENGINES = ("sglang", "vllm")
CACHE_ENV = "OTEL_VERL_WHEEL_CACHE"
PIP_TIMEOUT_S = 600


class RegistryUnavailable(RuntimeError):
    """pip could not reach the package registry (or it has no such version)."""


def cache_dir() -> str:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "otel_verl", "wheels")


def _normalized(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def pinned_versions(dist: str = "verl") -> Dict[str, str]:
    """``{engine: version}`` that the installed ``dist`` pins with ``==`` in its extras
    (empty when it is not installed)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return {}
    pins: Dict[str, str] = {}
    for line in requires:
        try:
            req = Requirement(line)
        except Exception:
            continue
        name = req.name.lower()
        specs = list(req.specifier)
        if name in ENGINES and len(specs) == 1 and specs[0].operator == "==":
            pins.setdefault(name, specs[0].version)
    return pins


def cached_wheel(dist: str, version: str, directory: Optional[str] = None) -> Optional[str]:
    """The cached wheel of ``dist`` ``version`` (any platform tag), or ``None``."""
    directory = directory or cache_dir()
    matches = sorted(glob.glob(os.path.join(directory, f"{_normalized(dist)}-{version}-*.whl")))
    return matches[-1] if matches else None


def cached_wheels(directory: Optional[str] = None) -> List[str]:
    """Every cached engine wheel, by engine then file name."""
    directory = directory or cache_dir()
    return sorted(p for engine in ENGINES for p in glob.glob(os.path.join(directory, f"{engine}-*.whl")))


def source_tree(wheel: str) -> WheelTree:
    """The wheel's source, with the files read kept under the cache's ``src/``."""
    stem = os.path.basename(wheel)[: -len(".whl")]
    return WheelTree(wheel, os.path.join(os.path.dirname(os.path.abspath(wheel)), "src", stem))


def _pip(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                              timeout=PIP_TIMEOUT_S, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except subprocess.TimeoutExpired as exc:
        raise RegistryUnavailable(f"pip {args[0]} took more than {PIP_TIMEOUT_S}s") from exc


def _last_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in (result.stderr or result.stdout or "").splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line] or lines
    return errors[-1].strip() if errors else f"pip exited with {result.returncode}"


def newest_version(dist: str) -> str:
    """The newest release of ``dist`` on the registry pip is configured with."""
    result = _pip("index", "versions", dist)
    match = re.search(rf"^{re.escape(dist)} \(([^)]+)\)", result.stdout or "", re.MULTILINE | re.IGNORECASE)
    if result.returncode != 0 or not match:
        raise RegistryUnavailable(f"pip index versions {dist}: {_last_error(result)}")
    return match.group(1)


def fetch(dist: str, version: str, directory: Optional[str] = None) -> str:
    """The wheel of ``dist`` ``version`` (no dependencies), downloaded into the cache
    unless it is there already."""
    directory = directory or cache_dir()
    found = cached_wheel(dist, version, directory)
    if found:
        return found
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        result = _pip("download", "--no-deps", "--only-binary", ":all:", "--dest", tmp, f"{dist}=={version}")
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if result.returncode != 0 or not wheels:
            raise RegistryUnavailable(f"pip download {dist}=={version}: {_last_error(result)}")
        target = os.path.join(directory, os.path.basename(wheels[0]))
        shutil.move(wheels[0], target)  # same file system: a rename, so readers never see half a wheel
    wheel_name_version(target)
    return target
