"""The span store against run length: loads, size on disk, queries, memory.

    python benchmarks/bench_report_scale.py [--steps 10,50,100] [--prompts 1024] [--n 16]
                                            [--turns 1] [--quick]
                                            [--json PATH] [--work DIR]

Grows one generated run (``bench_perfetto``'s step: ``--prompts`` x ``--n`` trajectories,
89,099 spans and 52 MB of OTLP-JSON for 1024 x 16 single-turn) step by step to each size
of ``--steps`` and, at each size, each measure in a fresh process of its own:

- a first load of the whole run into a new embedded store (``Store.load``): spans/s, peak RSS;
- the store's size on disk against the OTLP-JSON files' bytes;
- queries on the views: a whole-run summary (per step: trajectories and their p50/p99
  duration over ``trajectories``, stage times over ``stages``) and the same for one step
  (``WHERE step = k``), each the first time in the process and the median of 5 more;
  peak RSS of that process;
- one step's Perfetto trace from the store (``report --steps k-k --perfetto``): time, RSS;
- one more step appended and loaded into the same store: only the new step is read.

Peak RSS is each process's ``ru_maxrss`` (chDB runs in the process). The run is written
under a temporary directory (``--work``: under that one) and deleted at the end; the
default sizes need about 5.3 GB of disk and 10-15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import bench_perfetto  # noqa: E402

REPEATS = 5  # warm runs of each query after its first
REPORT_REPEATS = 2  # of the store's report (several queries)
GOAL_RATIO = 1 / 5  # store bytes / OTLP-JSON bytes
GOAL_RSS_MB = 1024
GOAL_SPANS_PER_S = 150_000  # a load, on 2 cores

# per step: trajectories and their duration quantiles; per step and stage: its time
RUN_QUERIES = {
    "trajectories": "SELECT step, count() AS trajectories, quantileExact(0.5)(duration_s) AS p50_s, "
                    "quantileExact(0.99)(duration_s) AS p99_s FROM trajectories GROUP BY step ORDER BY step",
    "stages": "SELECT step, stage, sum(duration_s) AS seconds FROM stages GROUP BY step, stage ORDER BY step, stage",
}
STEP_QUERIES = {
    "trajectories": "SELECT step, count() AS trajectories, quantileExact(0.5)(duration_s) AS p50_s, "
                    "quantileExact(0.99)(duration_s) AS p99_s FROM trajectories WHERE step = {step:Int64} "
                    "GROUP BY step",
    "stages": "SELECT step, stage, sum(duration_s) AS seconds FROM stages WHERE step = {step:Int64} "
              "GROUP BY step, stage ORDER BY stage",
}
ACTIVE_PARTS = ("SELECT countIf(table = 'otel_traces'), sum(bytes_on_disk) FROM system.parts "
                "WHERE active AND database = currentDatabase()")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _otlp_files(trace_dir: str) -> List[str]:
    return sorted(glob.glob(os.path.join(trace_dir, "otlp", "*.jsonl")))


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


# --------------------------------------------------------------------------- measures, each in its own process


def measure_load(trace_dir: str) -> Dict[str, Any]:
    """Loads what the run's files gained into its store (a first load when there is none)."""
    from otel_verl.tools.store.store import Store, embedded_path

    path = embedded_path([trace_dir])
    started = time.perf_counter()
    with Store.embedded(path) as store:
        opened = time.perf_counter()
        loaded = store.load(_otlp_files(trace_dir))
        seconds = time.perf_counter() - opened
        rows = store.query("SELECT count() FROM otel_traces")[1][0][0]
        # the directory also holds parts a merge replaced, until the engine deletes them
        parts, parts_bytes = store.query(ACTIVE_PARTS)[1][0]
    return {"spans": loaded.spans, "bytes": loaded.bytes, "rows": rows, "open_s": opened - started,
            "seconds": seconds, "spans_per_s": loaded.spans / seconds, "rss_mb": _peak_rss_mb(),
            "store_bytes": _tree_bytes(path), "parts": parts, "parts_bytes": parts_bytes}


def measure_queries(trace_dir: str, step: int) -> Dict[str, Any]:
    """The whole-run and one-step queries and reports on the run's loaded store: first and
    warm times."""
    from otel_verl.tools.store import report as store_report
    from otel_verl.tools.store.store import Store, embedded_path

    started = time.perf_counter()
    store = Store.embedded(embedded_path([trace_dir]))
    out: Dict[str, Any] = {"open_s": time.perf_counter() - started, "queries": {}}
    with store:
        for scope, queries in (("run", RUN_QUERIES), ("step", STEP_QUERIES)):
            for name, sql in queries.items():
                times, rows = [], []
                for _ in range(1 + REPEATS):
                    started = time.perf_counter()
                    rows = store.query(sql, {"step": step})[1]
                    times.append(time.perf_counter() - started)
                out["queries"][f"{scope}/{name}"] = {"first_s": times[0], "median_s": statistics.median(times[1:]),
                                                     "rows": [list(row) for row in rows]}
        # otel-verl report --steps: the store's report of the run, and of one step
        for scope, steps in (("run", None), ("step", (step, step))):
            times, report = [], {}
            for _ in range(1 + REPORT_REPEATS):
                started = time.perf_counter()
                report = store_report.build(store, steps=steps)
                times.append(time.perf_counter() - started)
            out["queries"][f"{scope}/report"] = {"first_s": times[0], "median_s": statistics.median(times[1:]),
                                                 "rows": [[r["step"]] for r in report["steps"]]}
    out["rss_mb"] = _peak_rss_mb()
    return out


def measure_perfetto(trace_dir: str, step: int) -> Dict[str, Any]:
    """``otel-verl report --steps k-k --perfetto``: one step's spans read from the store and
    written as a Perfetto trace."""
    from otel_verl.tools.report import perfetto
    from otel_verl.tools.store import report as store_report
    from otel_verl.tools.store import spans
    from otel_verl.tools.store.store import Store, embedded_path

    with tempfile.TemporaryDirectory() as out, Store.embedded(embedded_path([trace_dir])) as store:
        started = time.perf_counter()
        selected = spans.of_steps(store, store_report.pick_run(store, None), (step, step))
        read_s = time.perf_counter() - started
        written = perfetto.write_spans(selected, os.path.join(out, "step.pftrace"))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "read_s": read_s, "spans": len(selected), "slices": written.slices,
            "bytes": written.bytes, "rss_mb": _peak_rss_mb()}


MEASURES = {"load": measure_load, "queries": measure_queries, "perfetto": measure_perfetto}


def _in_child(measure: str, *args: Any) -> Dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", measure, *map(str, args)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{measure} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the run


class Run:
    """One generated run under ``trace_dir``, grown a step at a time."""

    def __init__(self, trace_dir: str, prompts: int, n: int, turns: int) -> None:
        self.trace_dir, self.prompts, self.n, self.turns = trace_dir, prompts, n, turns
        self.steps = 0
        self.spans = 0
        self.generate_s = 0.0

    def grow(self, steps: int) -> int:
        """Appends steps up to ``steps``; returns the spans they added."""
        added = 0
        started = time.perf_counter()
        while self.steps < steps:
            self.steps += 1
            added += bench_perfetto.generate(self.trace_dir, self.prompts, self.n, self.turns, seed=self.steps,
                                             step=self.steps)
        self.generate_s += time.perf_counter() - started
        self.spans += added
        return added

    def json_bytes(self) -> int:
        return sum(os.path.getsize(path) for path in _otlp_files(self.trace_dir))

    def drop_store(self) -> None:
        from otel_verl.tools.store.store import embedded_path, remove

        remove(embedded_path([self.trace_dir]))


def measure_size(run: Run, steps: int) -> Dict[str, Any]:
    run.grow(steps)
    row: Dict[str, Any] = {"steps": steps, "spans": run.spans, "json_bytes": run.json_bytes()}
    run.drop_store()
    row["first_load"] = _in_child("load", run.trace_dir)
    row["store_bytes"] = row["first_load"]["store_bytes"]
    row["ratio"] = row["store_bytes"] / row["json_bytes"]
    row["one_step"] = (steps + 1) // 2
    row["queries"] = _in_child("queries", run.trace_dir, row["one_step"])
    row["perfetto"] = _in_child("perfetto", run.trace_dir, row["one_step"])
    row["appended_spans"] = run.grow(steps + 1)
    row["second_load"] = _in_child("load", run.trace_dir)
    return row


def check_disk(work: str, step_bytes: int, steps: int) -> None:
    free = shutil.disk_usage(work).free
    need = step_bytes * (steps + 1) * 1.3  # the files and the store
    if free < need:
        sys.exit(f"bench_report_scale: {steps + 1} steps need about {need / 1e9:.1f} GB under {work}, "
                 f"{free / 1e9:.1f} GB free (use --work or smaller --steps)")


# --------------------------------------------------------------------------- output


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _rate(load: Dict[str, Any]) -> str:
    return f"{load['seconds']:.1f} s, {load['spans_per_s']:,.0f} spans/s, {load['rss_mb']:,.0f} MB"


def tables(rows: List[Dict[str, Any]]) -> str:
    """Loads and size; queries and memory."""
    lines = ["| steps | spans | OTLP-JSON | store (its live parts) | store / JSON | first load (peak RSS) "
             "| next step loaded (peak RSS) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        first = row["first_load"]
        lines.append(f"| {row['steps']} | {row['spans']:,} | {row['json_bytes'] / 1e6:,.0f} MB | "
                     f"{row['store_bytes'] / 1e6:,.1f} MB ({first['parts_bytes'] / 1e6:,.1f} MB in {first['parts']} "
                     f"parts) | 1/{1 / row['ratio']:.1f} | {_rate(first)} | "
                     f"{_rate(row['second_load'])} ({row['second_load']['spans']:,} spans) |")
    lines += ["", "| steps | whole run: trajectories | stages | report | one step: trajectories | stages | report "
              "| peak RSS | one step's Perfetto trace (peak RSS) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        q = row["queries"]["queries"]
        cells = [f"{_ms(q[key]['first_s'])} / {_ms(q[key]['median_s'])}"
                 for key in ("run/trajectories", "run/stages", "run/report", "step/trajectories", "step/stages",
                             "step/report")]
        trace = row["perfetto"]
        lines.append(f"| {row['steps']} | " + " | ".join(cells) + f" | {row['queries']['rss_mb']:,.0f} MB | "
                     f"{trace['seconds']:.1f} s, of it reading {trace['read_s']:.1f} s ({trace['rss_mb']:,.0f} MB) |")
    lines.append(f"(queries: the first in a fresh process / the median of {REPEATS} more ({REPORT_REPEATS} for the "
                 "report: otel-verl report --steps); the store opened in "
                 + ", ".join(_ms(row["queries"]["open_s"]) for row in rows) + ")")
    return "\n".join(lines)


def goals(rows: List[Dict[str, Any]]) -> List[str]:
    worst_ratio = max(row["ratio"] for row in rows)
    worst_rss = max(max(row["first_load"]["rss_mb"], row["second_load"]["rss_mb"], row["queries"]["rss_mb"],
                        row["perfetto"]["rss_mb"]) for row in rows)
    slowest = min(min(row["first_load"]["spans_per_s"], row["second_load"]["spans_per_s"]) for row in rows)
    out = [f"load rate: at least {slowest:,.0f} spans/s (goal {GOAL_SPANS_PER_S:,}): "
           f"{'met' if slowest >= GOAL_SPANS_PER_S else 'MISSED'}",
           f"store / JSON: at most 1/{1 / worst_ratio:.1f} (goal 1/{1 / GOAL_RATIO:.0f}): "
           f"{'met' if worst_ratio <= GOAL_RATIO else 'MISSED'}",
           f"peak RSS of a load, the queries or a step's trace: at most {worst_rss:,.0f} MB (goal {GOAL_RSS_MB:,} MB): "
           f"{'met' if worst_rss <= GOAL_RSS_MB else 'MISSED'}"]
    if len(rows) > 1:
        small, big = rows[0], rows[-1]
        for name in (*RUN_QUERIES, "report"):
            for scope in ("step", "run"):
                a = small["queries"]["queries"][f"{scope}/{name}"]["median_s"]
                b = big["queries"]["queries"][f"{scope}/{name}"]["median_s"]
                what = "one step" if scope == "step" else "whole run"
                out.append(f"{what}, {name} (warm): {big['steps']} steps / {small['steps']} steps = {b / a:.2f}x")
    return out


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="10,50,100", help="run lengths, comma-separated, ascending")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--n", type=int, default=16, help="trajectories per prompt")
    parser.add_argument("--turns", type=int, default=1, help="LLM turns per trajectory (a tool call between two)")
    parser.add_argument("--quick", action="store_true", help="2 and 4 steps of 16 prompts x 4: checks that it works")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--work", help="write the run under this directory (default: the system's temp dir)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        measure, *rest = args.child
        print(json.dumps(MEASURES[measure](rest[0], *map(int, rest[1:]))))
        return 0
    if args.quick:
        sizes, prompts, n, turns = [2, 4], 16, 4, 1
    else:
        try:
            sizes = [int(s) for s in args.steps.split(",")]
        except ValueError:
            parser.error(f"--steps: comma-separated step counts, not {args.steps!r}")
        prompts, n, turns = args.prompts, args.n, args.turns
    if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
        parser.error(f"--steps: ascending positive step counts, not {args.steps!r}")
    work = tempfile.mkdtemp(prefix="bench-report-scale-", dir=args.work)
    rows = []
    try:
        run = Run(os.path.join(work, "trace"), prompts, n, turns)
        run.grow(1)
        check_disk(work, run.json_bytes(), sizes[-1])
        print(f"{prompts} prompts x {n} trajectories, {turns} turn(s): {run.spans:,} spans, "
              f"{run.json_bytes() / 1e6:.1f} MB of OTLP-JSON a step", flush=True)
        for steps in sizes:
            rows.append(measure_size(run, steps))
            row = rows[-1]
            print(f"{steps} steps: first load {row['first_load']['seconds']:.1f} s, "
                  f"store 1/{1 / row['ratio']:.1f} of the JSON, queries and the next step measured", flush=True)
        generate_s = run.generate_s
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(tables(rows))
    print()
    for line in goals(rows):
        print(line)
    print(f"(generating the run took {generate_s:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"prompts": prompts, "n": n, "turns": turns, "step_spans": rows[0]["appended_spans"],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
