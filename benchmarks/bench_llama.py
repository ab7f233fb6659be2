"""llama.cpp's llama-bench through apir's host next to local ggml CPU, same build, same run.

Theory of operation: the llama.cpp build of scripts/build-llama-cpp.sh (tests/llama/build.py)
and SmolLM2-135M-Instruct Q4_1. For each repeat, in alternation (drift on a shared machine hits
both alike):

  local  llama-bench without the shim: ggml-virtgpu finds no device, llama.cpp computes on
         ggml CPU in-process (-t THREADS);
  apir   llama-bench with tests/interop's C shim preloaded (-ngl 99, every layer on the
         "[virtgpu] CPU" device) against `apir host serve` (apir's Python dispatcher on the
         same build's ggml CPU, apir.host.n_threads THREADS, device type gpu).

Both runs pass llama-bench `--poll 0` (`--poll N` to change it): ggml's default, 50, keeps the
guest's idle CPU workers spinning for their next graph, and on a machine where the guest and
the host share cores they take the cores the host computes on (the guest computes almost
nothing: every layer is offloaded). Locally the flag made no difference (151 vs 141 t/s tg32,
2 threads), so both runs use it and the comparison stays same-flags.

llama-bench runs pp (prompt processing, default 64 tokens) and tg (generation, 32 tokens) with
-r REPS and reports the mean tokens/s of each; the ratios are local t/s / apir t/s, i.e. apir's
time over local time (targets: pp <= 1.05, tg <= 1.15). The timed host runs untraced (a trace
parses every graph a second time); after the timed rounds, one more apir llama-bench (-r 1)
against a host with --trace gives graph computes
per token (backend_graph_compute commands over the tokens llama-bench processed through apir,
warm-up runs included) and the host's time per compute (mean host_us), next to the other
commands per token (set / get tensor round trips).

Run: PYTHONPATH=. python benchmarks/bench_llama.py [--threads 2] [--reps 3] [--pp 64] [--tg 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apir.host.trace import read_trace  # noqa: E402
from tests.interop.harness import build_shim, guest_env  # noqa: E402
from tests.llama.build import build, is_built, model  # noqa: E402


def llama_bench(paths: dict, gguf: Path, env: dict, threads: int, pp: int, tg: int, reps: int, poll: int) -> dict:
    """One llama-bench run: {"pp": t/s, "tg": t/s} (means over `reps`)."""
    cmd = [paths["LLAMA_BENCH"], "-m", str(gguf), "-p", str(pp), "-n", str(tg), "-ngl", "99", "-t", str(threads),
           "-r", str(reps), "--poll", str(poll), "-o", "json"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({run.returncode}): {run.stderr[-3000:]}")
    out = {}
    for test in json.loads(run.stdout):
        key = "pp" if test["n_prompt"] and not test["n_gen"] else "tg"
        out[key] = float(test["avg_ts"])
        out[key + "_backend"] = test.get("backends", "")
    return out


class Host:
    """`apir host serve` on the build's ggml, traced into `trace` when given."""

    def __init__(self, paths: dict, workdir: Path, threads: int, trace: Optional[Path] = None):
        self.socket = workdir / "apir.sock"
        env = dict(os.environ, APIR_GGML_LIB_DIR=paths["GGML_LIB_DIR"], APIR_GGML_INCLUDE_DIR=paths["GGML_INCLUDE"],
                   PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "apir", "host", "serve", "--socket", str(self.socket),
               *(["--trace", str(trace)] if trace else []),
               "--config", f"apir.host.n_threads={threads}", "--config", "apir.host.device_type=gpu",
               "--config", "apir.local.max_blobs=16384"]
        self.log = open(workdir / "host.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            if self.socket.exists():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"apir host did not start; see {workdir / 'host.log'}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()


def trace_stats(path: Path, tokens: int) -> dict:
    records = [r for r in read_trace(path) if r.get("type") == "Forward"]
    by_fn = Counter(r.get("function") for r in records)
    computes = [r for r in records if r.get("function") == "backend_graph_compute"]
    host_us = [r["host_us"] for r in computes if r.get("host_us") is not None]
    errors = [r for r in records if r.get("status") != "ok"]
    ops: Counter = Counter()
    for r in computes:
        ops.update(r.get("ops") or {})
    return {
        "graph_computes": len(computes),
        "computes_per_token": len(computes) / tokens if tokens else None,
        "host_ms_per_compute": statistics.mean(host_us) / 1000 if host_us else None,
        "host_ms_per_compute_median": statistics.median(host_us) / 1000 if host_us else None,
        "forwards_per_token": len(records) / tokens if tokens else None,
        "by_function": dict(by_fn.most_common()),
        "errors": len(errors),
        "graph_nodes_by_op": dict(ops.most_common()),  # every op llama.cpp sent, over all computes
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--rounds", type=int, default=2, help="alternating local / apir llama-bench runs")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--poll", type=int, default=0, help="llama-bench --poll, both runs (see the module docstring)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not is_built():
        print("llama.cpp is not built: python -m tests.llama.build", file=sys.stderr)
        return 2
    paths, gguf = build(), model()
    local_env = dict(os.environ, LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
    local_env.pop("LD_PRELOAD", None)
    results = {"local": [], "apir": []}
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as tmp:
        timed, traced = Path(tmp) / "timed", Path(tmp) / "traced"
        timed.mkdir()
        traced.mkdir()
        shim = build_shim(paths)
        host = Host(paths, timed, args.threads)
        try:
            apir_env = dict(guest_env(paths, shim, str(host.socket)), LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
            for _ in range(args.rounds):
                results["local"].append(
                    llama_bench(paths, gguf, local_env, args.threads, args.pp, args.tg, args.reps, args.poll))
                results["apir"].append(
                    llama_bench(paths, gguf, apir_env, args.threads, args.pp, args.tg, args.reps, args.poll))
        finally:
            host.stop()
        host = Host(paths, traced, args.threads, trace=traced / "trace.jsonl")
        try:
            traced_env = dict(guest_env(paths, shim, str(host.socket)), LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
            llama_bench(paths, gguf, traced_env, args.threads, args.pp, args.tg, 1, args.poll)
        finally:
            host.stop()
        # llama-bench runs one warm-up of each test, then -r repetitions
        stats = trace_stats(traced / "trace.jsonl", 2 * (args.pp + args.tg))
    summary = {}
    for key in ("pp", "tg"):
        local = statistics.mean(r[key] for r in results["local"])
        remote = statistics.mean(r[key] for r in results["apir"])
        summary[key] = {"local_tps": local, "apir_tps": remote, "ratio": local / remote}
    report = {"threads": args.threads, "poll": args.poll, "reps": args.reps, "rounds": args.rounds, "pp": args.pp,
              "tg": args.tg, "summary": summary, "host": stats, "runs": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"llama-bench SmolLM2-135M Q4_1, {args.threads} threads, --poll {args.poll}, "
          f"{args.rounds} rounds x -r {args.reps}")
    print(f"{'test':<8}{'local t/s':>12}{'apir t/s':>12}{'time ratio':>12}{'target':>8}")
    for key, target in (("pp", 1.05), ("tg", 1.15)):
        s = summary[key]
        n = args.pp if key == "pp" else args.tg
        print(f"{key}{n:<6}{s['local_tps']:>12.1f}{s['apir_tps']:>12.1f}{s['ratio']:>12.3f}{target:>8.2f}")
    print(f"host (one more run, traced, -r 1): {stats['graph_computes']} graph computes, "
          f"{stats['computes_per_token']:.3f} per token, "
          f"{stats['host_ms_per_compute']:.2f} ms host time per compute (median "
          f"{stats['host_ms_per_compute_median']:.2f}), {stats['forwards_per_token']:.2f} commands per token, "
          f"{stats['errors']} errors")
    print("commands:", ", ".join(f"{k} {v}" for k, v in stats["by_function"].items()))
    print("graph nodes by op:", ", ".join(f"{k} {v}" for k, v in stats["graph_nodes_by_op"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
