"""llama-bench through apir with the extended C guest next to the unpatched one (and local ggml).

Theory of operation: the llama.cpp build of scripts/build-llama-cpp.sh and its extended C guest
(--extensions: patches/ggml-virtgpu-extensions.patch, whose libggml-virtgpu the same
llama-bench loads when its folder comes first in LD_LIBRARY_PATH), SmolLM2-135M-Instruct Q4_1,
one `apir host serve` (bench_llama.Host: apir's dispatcher on the build's ggml CPU, extensions
on). For each round, in alternation: local llama-bench, through apir with the unpatched guest,
through apir with the extended guest (graph replay agreed). The ratios are times over the
unpatched guest's (unpatched t/s over extended t/s: below 1 is faster) and over local.

Then one traced tg run (-p 0 -r 1) per guest against a host with --trace: Forward commands
(round trips: EXECBUFFERs waited for) and posted commands per generated token, graph commands
by function, the graph bytes that crossed per token and the host's time per graph command
(mean, median), over the TG + 1 tokens decoded (llama-bench's warm-up decodes one).

--no-host-ptr: the host offers no device_buffer_from_ptr (apir.host.import_host_memory=0), so
both guests allocate device buffers and send every tensor, as to a GPU: where the extended
guest's posted sets (ASYNC) show. (On ggml CPU with it, llama.cpp's tensors are the guest's
memory and a decode token is one round trip for either guest.)

On Vulkan (`--backend vulkan[:N]`): the host serves the Vulkan build's ggml-vulkan
(scripts/get-llama-cpp.sh vulkan), local llama-bench runs on Vulkan N, and the guests open no
Vulkan device of their own (GGML_VK_VISIBLE_DEVICES=""), as in bench_llama.

Run: PYTHONPATH=. python benchmarks/bench_llama_extensions.py [--threads 1] [--reps 3] [--rounds 2]
         [--pp 64] [--tg 32] [--backend cpu|vulkan[:N]] [--no-host-ptr] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apir.host.component.trace import read_trace  # noqa: E402
from benchmarks.bench_llama import Host, list_devices, llama_bench, vulkan_index  # noqa: E402
from tests.interop.harness import build_shim, guest_env  # noqa: E402
from tests.llama.build import build, build_extensions, build_vulkan, is_built, is_built_vulkan, model  # noqa: E402

GRAPH_FUNCTIONS = ("backend_graph_compute", "graph_compute_keep", "graph_recompute")


def trace_stats(path: Path, tokens: int) -> dict:
    """Per generated token: Forward commands waited for, posted commands, graph bytes; graph
    commands by function and the host's time per graph command."""
    records = [r for r in read_trace(str(path)) if r.get("type") == "Forward"]
    graphs = [r for r in records if r.get("function") in GRAPH_FUNCTIONS]
    host_us = [r["host_us"] for r in graphs if r.get("host_us") is not None]
    return {
        "forwards_per_token": len(records) / tokens,
        "posted_per_token": sum(r.get("posted", 0) for r in read_trace(str(path))) / tokens,
        "graph_commands": dict(Counter(r["function"] for r in graphs)),
        "graph_bytes_per_token": sum(r.get("graph_bytes", 0) for r in graphs) / tokens,
        "host_ms_per_graph": statistics.mean(host_us) / 1000,
        "host_ms_per_graph_median": statistics.median(host_us) / 1000,
        "errors": sum(r.get("status") != "ok" for r in records),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--no-host-ptr", action="store_true", help="host: apir.host.import_host_memory=0")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--backend", default="cpu",
                    help="cpu (default) or vulkan[:N]: the host's --backend and the local run's device")
    args = ap.parse_args(argv)
    try:
        vk_index = vulkan_index(args.backend)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not (is_built() if vk_index is None else is_built_vulkan()):
        print("llama.cpp is not built: scripts/get-llama-cpp.sh" + (" vulkan" if vk_index is not None else ""),
              file=sys.stderr)
        return 2
    paths, ext, gguf = (build() if vk_index is None else build_vulkan()), build_extensions(), model()
    backend = "cpu" if vk_index is None else f"vulkan:{vk_index}"
    devices = {"local": None if vk_index is None else f"Vulkan{vk_index}"}
    local_env = dict(os.environ, LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
    local_env.pop("LD_PRELOAD", None)

    def guest(shim: Path, host: Host, extended: bool) -> dict:
        # the extended guest's libggml-virtgpu first; ggml itself from the build measured
        lib_path = f"{ext['GGML_LIB_DIR']}:{paths['GGML_LIB_DIR']}" if extended else paths["GGML_LIB_DIR"]
        env = dict(guest_env(paths, shim, str(host.socket)), LD_LIBRARY_PATH=lib_path)
        if vk_index is not None:
            env["GGML_VK_VISIBLE_DEVICES"] = ""  # ggml-vulkan opens no device in the guest
        return env

    config = {"apir.host.import_host_memory": "0"} if args.no_host_ptr else {}
    sides = ("local", "unpatched", "extended")
    results: dict = {side: [] for side in sides}
    stats = {}
    with tempfile.TemporaryDirectory(prefix="bench-llama-ext-") as tmp:
        shim = build_shim(paths)
        (Path(tmp) / "timed").mkdir()
        host = Host(paths, Path(tmp) / "timed", args.threads, backend=backend, config=config)
        try:
            envs = {"local": local_env, "unpatched": guest(shim, host, False), "extended": guest(shim, host, True)}
            for side in ("unpatched", "extended") if vk_index is not None else ():
                names = [n for n in list_devices(paths, envs[side]) if n.startswith("[virtgpu]")]
                if len(names) != 1:
                    raise RuntimeError(f"{side}: expected one [virtgpu] device, llama.cpp sees {names}")
                devices[side] = names[0]
            for _ in range(args.rounds):
                for side in sides:
                    results[side].append(llama_bench(paths, gguf, envs[side], args.threads, args.pp, args.tg,
                                                     args.reps, 0, devices.get(side)))
        finally:
            host.stop()
        for side in ("unpatched", "extended") if args.tg else ():
            workdir = Path(tmp) / side
            workdir.mkdir()
            host = Host(paths, workdir, args.threads, trace=workdir / "trace.jsonl", backend=backend, config=config)
            try:
                llama_bench(paths, gguf, guest(shim, host, side == "extended"), args.threads, 0, args.tg, 1, 0,
                            devices.get(side))
            finally:
                host.stop()
            stats[side] = trace_stats(workdir / "trace.jsonl", args.tg + 1)
    summary = {}
    for key in [k for k in ("pp", "tg") if k in results["local"][0]]:
        tps = {side: statistics.mean(r[key] for r in results[side]) for side in sides}
        summary[key] = {**{f"{side}_tps": tps[side] for side in sides},
                        "extended_over_unpatched": tps["unpatched"] / tps["extended"],
                        "unpatched_over_local": tps["local"] / tps["unpatched"],
                        "extended_over_local": tps["local"] / tps["extended"]}
    test = "tg" if args.tg else "pp"
    seen = {side: {f: results[side][0].get(f"{test}_{f}", "") for f in ("backend", "gpu_info", "devices")}
            for side in sides}
    report = {"backend": backend, "sides": seen, "threads": args.threads, "reps": args.reps, "rounds": args.rounds,
              "pp": args.pp, "tg": args.tg, "no_host_ptr": args.no_host_ptr,
              "summary": summary, "traced": stats, "runs": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"llama-bench SmolLM2-135M Q4_1, host --backend {backend}"
          f"{' (no buffer_from_ptr)' if args.no_host_ptr else ''}, {args.threads} threads, "
          f"{args.rounds} rounds x -r {args.reps}")
    for side, f in seen.items():
        print(f"  {side}: backends {f['backend']!r}, gpu_info {f['gpu_info']!r}, devices {f['devices']!r}")
    print(f"{'test':<8}{'local t/s':>11}{'0.2 t/s':>10}{'ext t/s':>10}{'ext/0.2':>9}{'0.2/local':>11}{'ext/local':>11}")
    for key, s in summary.items():
        n = args.pp if key == "pp" else args.tg
        print(f"{key}{n:<6}{s['local_tps']:>11.1f}{s['unpatched_tps']:>10.1f}{s['extended_tps']:>10.1f}"
              f"{s['extended_over_unpatched']:>9.3f}{s['unpatched_over_local']:>11.3f}{s['extended_over_local']:>11.3f}")
    for side, st in stats.items():
        print(f"{side} (traced tg{args.tg}, -r 1): {st['forwards_per_token']:.2f} round trips and "
              f"{st['posted_per_token']:.2f} posted commands per token, "
              f"{st['graph_bytes_per_token']:.0f} graph bytes per token, host {st['host_ms_per_graph']:.2f} ms "
              f"per graph (median {st['host_ms_per_graph_median']:.2f}), {st['errors']} errors; "
              + ", ".join(f"{k} {v}" for k, v in st["graph_commands"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
