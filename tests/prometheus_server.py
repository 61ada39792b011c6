"""A real Prometheus for the tests, and its HTTP API.

The binary is Debian's ``prometheus`` package (``/usr/bin/prometheus``; else one on
PATH), which scripts/setup-prometheus.sh installs and .ci/run runs. When it is missing,
the tests that need it fail under CI=true and are skipped elsewhere
(``require_prometheus``, as ``otel_binaries.require_binary`` does for Jaeger and
otelcol). ``start_prometheus`` runs one on a free loopback port with its config and
TSDB in a temporary directory; ``scrape_config`` is the shipped
``collector-config/prometheus.yaml`` aimed at other targets.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import yaml

import otel_binaries as ob

SETUP_SCRIPT = ob.REPO_ROOT / "scripts" / "setup-prometheus.sh"
SHIPPED_CONFIG = ob.CONFIG_DIR / "prometheus.yaml"
DEBIAN_BINARY = Path("/usr/bin/prometheus")


def find_prometheus() -> Tuple[Optional[str], str]:
    """Return (path, "") or (None, reason it is unavailable)."""
    for candidate in (str(DEBIAN_BINARY), shutil.which("prometheus")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate, ""
    return None, (f"{DEBIAN_BINARY} missing and no prometheus on PATH; run {SETUP_SCRIPT.relative_to(ob.REPO_ROOT)} "
                  "(apt-get install prometheus)")


def require_prometheus() -> str:
    """Path of the prometheus binary; pytest.fail under CI, pytest.skip elsewhere."""
    path, reason = find_prometheus()
    if path is None:
        if ob.in_ci():
            pytest.fail(f"prometheus unavailable: {reason}", pytrace=False)
        pytest.skip(f"prometheus unavailable: {reason}")
    return path


def scrape_config(targets: Sequence[str], scrape_interval: str) -> Dict[str, Any]:
    """The shipped config's otelcol scrape job (its honor_labels and all) with ``targets``,
    every ``scrape_interval``; its other jobs are left out."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "otelcol"]
    job["static_configs"] = [{"targets": list(targets)}]
    config["global"].update(scrape_interval=scrape_interval, evaluation_interval=scrape_interval)
    config["scrape_configs"] = [job]
    return config


class PrometheusAPIError(AssertionError):
    pass


@dataclass
class PrometheusServer:
    process: ob.ManagedProcess
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def api(self, path: str, params: Sequence[Tuple[str, str]] = ()) -> Any:
        """GET /api/v1/{path}; its ``data``, or PrometheusAPIError with Prometheus' error."""
        self.process.check_alive()
        query = urllib.parse.urlencode(list(params))
        status, body = ob.http_get(f"{self.url}/api/v1/{path}?{query}", timeout=30)
        try:
            answer = json.loads(body)
        except ValueError:
            raise PrometheusAPIError(f"/api/v1/{path} {dict(params)}: HTTP {status} {body[:300]!r}") from None
        if status != 200 or answer.get("status") != "success":
            raise PrometheusAPIError(f"/api/v1/{path} {dict(params)}: HTTP {status} "
                                     f"{answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str, at: float) -> List[dict]:
        """Instant query: ``[{"metric": {...}, "value": [t, "v"]}]`` (a vector)."""
        data = self.api("query", [("query", expr), ("time", _ts(at))])
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> List[dict]:
        """Range query: ``[{"metric": {...}, "values": [[t, "v"], ...]}]`` (a matrix)."""
        data = self.api("query_range", [("query", expr), ("start", _ts(start)), ("end", _ts(end)),
                                        ("step", f"{step_s:g}")])
        assert data["resultType"] == "matrix", (expr, data["resultType"])
        return data["result"]

    def label_values(self, label: str, match: Optional[str], start: float, end: float) -> List[str]:
        params = [("start", _ts(start)), ("end", _ts(end))]
        if match:
            params.append(("match[]", match))
        return self.api(f"label/{urllib.parse.quote(label)}/values", params)

    def last_scrape(self, at: float) -> float:
        """Unix time of the latest successful scrape as of ``at`` (0 when none): the
        timestamp of the newest ``up`` sample equal to 1."""
        result = self.query("max(timestamp(up == 1))", at)
        return float(result[0]["value"][1]) if result else 0.0


def _ts(t: float) -> str:
    return f"{t:.3f}"


def start_prometheus(workdir: Path, config: Dict[str, Any]) -> PrometheusServer:
    """Prometheus with ``config`` on a free loopback port, its TSDB under ``workdir``;
    waits until it is ready."""
    binary = require_prometheus()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = ob.free_port()
    proc = ob.ManagedProcess([
        binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ], workdir / "prometheus.log").start()
    server = PrometheusServer(proc, port)
    try:
        ob.wait_for_http(f"{server.url}/-/ready", timeout=60, proc=proc)
    except BaseException:
        proc.stop()
        raise
    return server
