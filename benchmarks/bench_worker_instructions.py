"""Instructions the rollout worker spends on tracing, counted by valgrind's callgrind: the
repeatable twin of ``bench_worker_wrappers`` for comparing two versions of otel_verl.

    python benchmarks/bench_worker_instructions.py            # 1024 trajectories a round
    python benchmarks/bench_worker_instructions.py --quick    # 64: only checks that it works

CPU time on shared cores spreads ~25% from round to round, more than most changes
to the hot path move it; an instruction count of the same work repeats to ~1-2%. Each
configuration (stock or traced, single-turn or 4 LLM turns) runs in a worker process of
its own under callgrind: ``bench_worker_wrappers.Workload`` (the real wrappers on the verl
stand-ins, outputs via the export process, OTLP/HTTP to a loopback sink), one warm-up
round, then one measured round; ``callgrind_control`` switches counting on and off around
it, so start-up and warm-up are not counted. Every thread of the worker process counts
(event loop and the export process's sender); the export process itself runs outside
valgrind. Added = traced - stock: per single-turn trajectory, per extra LLM turn. The
stub tokenizer keeps transformers out of the process (the worker only hands a
tokenizer's functions to the export process).

Instructions are not time (a tight C loop retires several a cycle, the cyclic GC's
pointer chasing far fewer): the goals stay in CPU time (bench_worker_wrappers).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_worker_wrappers import TURNS  # noqa: E402

AGENTS = ("single", "llm4")


def child(agent: str, traced: bool, n: int, endpoint: str, signals: str) -> None:
    """Runs under callgrind: warm up, say ready, wait for counting, one round, say done."""
    from bench_worker_wrappers import Workload

    workload = Workload(n, "1", endpoint, signals, tokenizer="stub")
    workload.traced(traced)
    workload.run(agent, traced)
    _touch(os.path.join(signals, "ready"), str(os.getpid()))
    _wait_for(os.path.join(signals, "go"))
    workload.run(agent, traced)
    _touch(os.path.join(signals, "done"))
    _wait_for(os.path.join(signals, "stop"))
    workload.close()


def count(agent: str, traced: bool, n: int, endpoint: str, timeout_s: float = 1800.0) -> int:
    """Instructions of one measured round of ``n`` trajectories (the worker process's threads)."""
    signals = tempfile.mkdtemp(prefix="bench_worker_instructions_")
    out = os.path.join(signals, "callgrind.out")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           sys.executable, os.path.abspath(__file__), "--child", agent, "--traced", str(int(traced)),
           "--trajectories", str(n), "--endpoint", endpoint, "--signals", signals]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        pid = _wait_for(os.path.join(signals, "ready"), deadline, proc)
        _control(pid, "on")
        _touch(os.path.join(signals, "go"))
        _wait_for(os.path.join(signals, "done"), deadline, proc)
        _control(pid, "off")
        _touch(os.path.join(signals, "stop"))
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"{agent} traced={traced} failed ({proc.returncode}):\n{err[-4000:]}")
        return _totals(out)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(signals, ignore_errors=True)


def _control(pid: str, state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, pid], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=120)


def _totals(out: str) -> int:
    with open(out) as f:
        for line in f:
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def _touch(path: str, text: str = "") -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, deadline: Optional[float] = None, proc: Optional[subprocess.Popen] = None) -> str:
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the worker under callgrind exited ({proc.returncode}):\n{proc.stderr.read()[-4000:]}")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no {os.path.basename(path)} from the worker under callgrind")
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


def added(counts: Dict[Tuple[str, bool], int], n: int) -> Dict[str, float]:
    """Traced minus stock: per single-turn trajectory, per extra LLM turn (as bench_worker_wrappers)."""
    d = {agent: (counts[(agent, True)] - counts[(agent, False)]) / n for agent in AGENTS}
    return {"trajectory": d["single"], "llm_turn": (d["llm4"] - d["single"]) / (TURNS - 1)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 trajectories: checks that it works")
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--child", choices=AGENTS, help=argparse.SUPPRESS)
    parser.add_argument("--traced", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--signals", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n = 64 if args.quick else args.trajectories
    if args.child:
        child(args.child, bool(args.traced), n, args.endpoint, args.signals)
        return 0
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"bench_worker_instructions: {tool} not found (Debian package valgrind)", file=sys.stderr)
            return 2

    from bench_worker_overhead import SpanSink

    sink = SpanSink()
    try:
        configs = [(agent, traced) for agent in AGENTS for traced in (False, True)]
        with ThreadPoolExecutor(max_workers=2) as pool:  # counts do not depend on what else runs
            counts = dict(zip(configs, pool.map(lambda c: count(c[0], c[1], n, sink.endpoint), configs)))
    finally:
        sink.close()
    a = added(counts, n)
    print(f"Instructions added by tracing in the worker process (callgrind, one round of {n} trajectories, "
          "traced - stock):")
    print(f"  per single-turn trajectory: {a['trajectory'] / 1000:.0f}k")
    print(f"  per extra LLM turn:         {a['llm_turn'] / 1000:.0f}k")
    for (agent, traced), total in counts.items():
        print(f"  ({agent}, {'traced' if traced else 'stock'}): {total / n / 1000:.0f}k a trajectory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
