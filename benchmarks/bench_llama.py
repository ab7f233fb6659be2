"""llama.cpp's llama-bench through apir's host next to local ggml, same build, same device.

Theory of operation: the llama.cpp build of scripts/build-llama-cpp.sh (tests/llama/build.py)
and SmolLM2-135M-Instruct Q4_1. For each repeat, in alternation (drift on a shared machine hits
both alike):

  local  llama-bench without the shim: ggml-virtgpu finds no device, llama.cpp computes on
         ggml CPU in-process (-t THREADS);
  apir   llama-bench with tests/interop's C shim preloaded (-ngl 99, every layer on the
         "[virtgpu] CPU" device) against `apir host serve` (apir's Python dispatcher on the
         same build's ggml CPU, apir.host.n_threads THREADS, device type gpu).

On Vulkan (`--backend vulkan[:N]`; the build of tests/llama/build.py's build_vulkan(), the same
tree with GGML_VULKAN=ON as well, so the guest's and the host's libggml both hold ggml-vulkan):

  local  llama-bench -dev VulkanN -ngl 99: llama.cpp's own Vulkan device N, in-process;
  apir   the host serves `--backend vulkan:N` (apir's dispatcher on that build's ggml-vulkan);
         llama-bench -dev "[virtgpu] ..." (the device name `llama-bench --list-devices` prints
         through the shim) with GGML_VK_VISIBLE_DEVICES="" (ggml-vulkan then opens no device
         in the guest), so every layer runs on the host's Vulkan device and none on a local one.
Vulkan's driver comes from the environment (VK_DRIVER_FILES, ...; on an NVIDIA machine its
ICD); `--lavapipe` takes Mesa's lavapipe from tests/ggml_backends.py's build instead (and makes
that CPU-type device visible: GGML_VK_VISIBLE_DEVICES=0 for the host and the local run).
The report gives each side's llama-bench `backends` (registrations), `gpu_info` (GPU devices
the process saw) and `devices` (the -dev it ran on). `--tokens N` adds a check that greedy
generation (tests/llama/llama_tokens.cpp, N tokens) gives the same tokens on both sides.

Both runs pass llama-bench `--poll 0` (`--poll N` to change it): ggml's default, 50, keeps the
guest's idle CPU workers spinning for their next graph, and on a machine where the guest and
the host share cores they take the cores the host computes on (the guest computes almost
nothing: every layer is offloaded). Locally the flag made no difference (151 vs 141 t/s tg32,
2 threads), so both runs use it and the comparison stays same-flags.

llama-bench runs pp (prompt processing, default 64 tokens) and tg (generation, 32 tokens) with
-r REPS and reports the mean tokens/s of each; the ratios are local t/s / apir t/s, i.e. apir's
time over local time (targets: pp <= 1.05, tg <= 1.15). The timed host runs untraced (a trace
parses every graph a second time); after the timed rounds, one more apir llama-bench of tg
alone (-p 0 -r 1) against a host with --trace gives graph computes per generated token
(backend_graph_compute commands over the TG + 1 tokens it decodes: its warm-up decodes one)
and the host's time per decode compute (mean and median host_us, tracing included), next to
the other commands per token (set / get tensor round trips). A test given 0 tokens (--pp 0
or --tg 0) is not run.

Run: PYTHONPATH=. python benchmarks/bench_llama.py [--threads 2] [--reps 3] [--pp 64] [--tg 32] [--json]
         [--backend cpu|vulkan[:N]] [--lavapipe] [--tokens N]
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
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apir.host.component.trace import read_trace  # noqa: E402
from tests.interop.harness import build_shim, guest_env  # noqa: E402
from tests.llama.build import build, build_vulkan, is_built, is_built_vulkan, model  # noqa: E402
from tests.llama.runner import generate  # noqa: E402

PROMPT = "The capital of France is"


def llama_bench(paths: dict, gguf: Path, env: dict, threads: int, pp: int, tg: int, reps: int, poll: int,
                device: Optional[str] = None) -> dict:
    """One llama-bench run: {"pp": t/s, "tg": t/s} (means over `reps`), and each test's
    `backends`, `gpu_info` and `devices` fields. `device`: llama-bench -dev (default: auto)."""
    cmd = [paths["LLAMA_BENCH"], "-m", str(gguf), "-p", str(pp), "-n", str(tg), "-ngl", "99", "-t", str(threads),
           "-r", str(reps), "--poll", str(poll), "-o", "json", *(["-dev", device] if device else [])]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({run.returncode}): {run.stderr[-3000:]}")
    out = {}
    for test in json.loads(run.stdout):
        key = "pp" if test["n_prompt"] and not test["n_gen"] else "tg"
        out[key] = float(test["avg_ts"])
        out[key + "_backend"] = test.get("backends", "")
        out[key + "_gpu_info"] = test.get("gpu_info", "")
        out[key + "_devices"] = test.get("devices", "")
    return out


def list_devices(paths: dict, env: dict) -> List[str]:
    """The non-CPU device names llama.cpp sees in `env` (`llama-bench --list-devices`, common/arg.cpp
    common_print_available_devices: "  NAME: DESCRIPTION (... MiB, ... MiB free)")."""
    run = subprocess.run([paths["LLAMA_BENCH"], "--list-devices"], env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench --list-devices failed ({run.returncode}): {run.stderr[-3000:]}")
    return [line.strip().split(": ", 1)[0] for line in run.stdout.splitlines()
            if line.startswith("  ") and ": " in line]


def vulkan_index(backend: str) -> Optional[int]:
    """N of `vulkan[:N]`, None for `cpu`; ValueError for any other spec (no other backend is built
    into the llama.cpp tree)."""
    head, sep, rest = backend.strip().lower().partition(":")
    if head == "cpu" and not sep:
        return None
    if head == "vulkan" and (not sep or rest.isdigit()):
        return int(rest) if sep else 0
    raise ValueError(f"--backend {backend!r}: expected cpu or vulkan[:N]")


class Host:
    """`apir host serve --backend BACKEND` on the build's ggml, traced into `trace` when given;
    `env`: variables over os.environ (the Vulkan driver's); `config`: more --config KEY=VALUE."""

    def __init__(self, paths: dict, workdir: Path, threads: int, trace: Optional[Path] = None,
                 backend: str = "cpu", env: Optional[dict] = None, config: Optional[dict] = None):
        self.socket = workdir / "apir.sock"
        env = dict(os.environ, **(env or {}), APIR_GGML_LIB_DIR=paths["GGML_LIB_DIR"],
                   APIR_GGML_INCLUDE_DIR=paths["GGML_INCLUDE"], PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "apir", "host", "serve", "--socket", str(self.socket), "--backend", backend,
               *(["--trace", str(trace)] if trace else []),
               "--config", f"apir.host.n_threads={threads}", "--config", "apir.host.device_type=gpu",
               "--config", "apir.local.max_blobs=16384",
               *[arg for k, v in (config or {}).items() for arg in ("--config", f"{k}={v}")]]
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
    ap.add_argument("--backend", default="cpu",
                    help="cpu (default) or vulkan[:N]: the host's --backend and the local run's device")
    ap.add_argument("--lavapipe", action="store_true",
                    help="Vulkan on Mesa's lavapipe (tests/ggml_backends.py's build), not the environment's driver")
    ap.add_argument("--tokens", type=int, default=0,
                    help="also generate N tokens greedily on both sides and compare them (0: no check)")
    args = ap.parse_args(argv)
    try:
        vk_index = vulkan_index(args.backend)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not (is_built() if vk_index is None else is_built_vulkan()):
        print("llama.cpp is not built: python -m tests.llama.build" + (" vulkan" if vk_index is not None else ""),
              file=sys.stderr)
        return 2
    paths, gguf = (build() if vk_index is None else build_vulkan()), model()
    vk_env: dict = {}
    if args.lavapipe:
        from tests import ggml_backends

        vk_env = ggml_backends.lavapipe_env(ggml_backends.build())
    local_env = dict(os.environ, **vk_env, LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
    local_env.pop("LD_PRELOAD", None)
    local_device = None if vk_index is None else f"Vulkan{vk_index}"
    backend = "cpu" if vk_index is None else f"vulkan:{vk_index}"

    def guest(shim: Path, host: Host) -> dict:
        env = dict(guest_env(paths, shim, str(host.socket)), **vk_env, LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
        if vk_index is not None:
            env["GGML_VK_VISIBLE_DEVICES"] = ""  # ggml-vulkan opens no device in the guest
        return env

    results = {"local": [], "apir": []}
    tokens = None
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as tmp:
        timed, traced = Path(tmp) / "timed", Path(tmp) / "traced"
        timed.mkdir()
        traced.mkdir()
        shim = build_shim(paths)
        host = Host(paths, timed, args.threads, backend=backend, env=vk_env)
        try:
            apir_env = guest(shim, host)
            apir_device = None
            if vk_index is not None:
                names = [n for n in list_devices(paths, apir_env) if n.startswith("[virtgpu]")]
                if len(names) != 1:
                    raise RuntimeError(f"expected one [virtgpu] device through the shim, llama.cpp sees {names}")
                apir_device = names[0]
            for _ in range(args.rounds):
                results["local"].append(llama_bench(paths, gguf, local_env, args.threads, args.pp, args.tg, args.reps,
                                                    args.poll, local_device))
                results["apir"].append(llama_bench(paths, gguf, apir_env, args.threads, args.pp, args.tg, args.reps,
                                                   args.poll, apir_device))
            if args.tokens:
                gens = [generate(paths, gguf, PROMPT, env, n_predict=args.tokens, threads=args.threads)
                        for env in (local_env, apir_env)]
                tokens = {"prompt": PROMPT, "n": args.tokens, "identical": gens[0].generated == gens[1].generated,
                          "local": gens[0].generated, "apir": gens[1].generated, "local_text": gens[0].text}
        finally:
            host.stop()
        stats = None
        if args.tg:
            host = Host(paths, traced, args.threads, trace=traced / "trace.jsonl", backend=backend, env=vk_env)
            try:
                llama_bench(paths, gguf, guest(shim, host), args.threads, 0, args.tg, 1, args.poll, apir_device)
            finally:
                host.stop()
            # llama-bench's warm-up of a tg test decodes one token, then -r 1 decodes TG
            stats = trace_stats(traced / "trace.jsonl", args.tg + 1)
    summary = {}
    for key in [k for k in ("pp", "tg") if k in results["local"][0]]:
        local = statistics.mean(r[key] for r in results["local"])
        remote = statistics.mean(r[key] for r in results["apir"])
        summary[key] = {"local_tps": local, "apir_tps": remote, "ratio": local / remote}
    test = "tg" if args.tg else "pp"
    sides = {side: {f: results[side][0].get(f"{test}_{f}", "") for f in ("backend", "gpu_info", "devices")}
             for side in ("local", "apir")}
    report = {"backend": backend, "lavapipe": args.lavapipe, "threads": args.threads, "poll": args.poll,
              "reps": args.reps, "rounds": args.rounds, "pp": args.pp, "tg": args.tg, "summary": summary,
              "devices": sides, "tokens": tokens, "host": stats, "runs": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"llama-bench SmolLM2-135M Q4_1, host --backend {backend}{' (lavapipe)' if args.lavapipe else ''}, "
          f"{args.threads} threads, --poll {args.poll}, {args.rounds} rounds x -r {args.reps}")
    for side, f in sides.items():
        print(f"  {side}: backends {f['backend']!r}, gpu_info {f['gpu_info']!r}, devices {f['devices']!r}")
    print(f"{'test':<8}{'local t/s':>12}{'apir t/s':>12}{'time ratio':>12}{'target':>8}")
    for key, target in (("pp", 1.05), ("tg", 1.15)):
        if key not in summary:
            continue
        s = summary[key]
        n = args.pp if key == "pp" else args.tg
        print(f"{key}{n:<6}{s['local_tps']:>12.1f}{s['apir_tps']:>12.1f}{s['ratio']:>12.3f}{target:>8.2f}")
    if stats is not None:
        print(f"host (one more tg run, traced, -r 1): {stats['graph_computes']} graph computes, "
              f"{stats['computes_per_token']:.3f} per generated token, "
              f"{stats['host_ms_per_compute']:.2f} ms host time per compute (median "
              f"{stats['host_ms_per_compute_median']:.2f}), {stats['forwards_per_token']:.2f} commands per token, "
              f"{stats['errors']} errors")
        print("commands:", ", ".join(f"{k} {v}" for k, v in stats["by_function"].items()))
        print("graph nodes by op:", ", ".join(f"{k} {v}" for k, v in stats["graph_nodes_by_op"].items()))
    if tokens is not None:
        print(f"greedy tokens ({tokens['n']}, {PROMPT!r}): {'identical' if tokens['identical'] else 'DIFFERENT'}"
              f" (local {tokens['local']}, apir {tokens['apir']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
