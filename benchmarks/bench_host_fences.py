"""Waits per generated token on apir's host: ggml_backend_synchronize and synchronous
tensor_set / tensor_get calls (each waits for the device on a GPU backend), per token of
llama.cpp's decode through apir.

Theory of operation: the llama.cpp build and model of benchmarks/bench_llama.py. Two
`llama-bench -p 0 -n N -r 1` runs (N = --tokens-a, then --tokens-b) each against a fresh
`apir host serve` started through this script's `--host` mode, which wraps those ggml functions
(and tensor_set_async / get_async, graph_compute) with counters and writes them to a file when
the host stops. The difference of the two runs' counts over the difference of their tokens is
what one more generated token costs (model load and warm-up cancel out). The host's
environment passes through, so `APIR_HOST_ASYNC_TRANSFERS=off` measures the synchronous copies
(apir.host.backend.transfers) against the default.

Run: PYTHONPATH=. python benchmarks/bench_host_fences.py [--backend vulkan:0] [--lavapipe]
         [--tokens-a 2] [--tokens-b 10] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COUNTED = ("ggml_backend_synchronize", "ggml_backend_tensor_set", "ggml_backend_tensor_get",
           "ggml_backend_tensor_set_async", "ggml_backend_tensor_get_async", "ggml_backend_graph_compute")


def _counted(fn, name: str, counts: dict):
    def call(*args):
        counts[name] += 1
        return fn(*args)

    return call


def host_main(out: str, argv: list) -> int:
    """`apir host ARGV...` with COUNTED wrapped; their counts go to `out` at exit (SIGTERM too)."""
    import atexit

    import apir.ggml
    from apir.cli import main

    g = apir.ggml.load()
    counts = {}
    for name in COUNTED:
        if not g.has(name):
            continue
        counts[name] = 0
        setattr(g, name, _counted(getattr(g, name), name, counts))

    def write() -> None:
        Path(out).write_text(json.dumps(counts))

    def stop(*_) -> None:
        write()
        os._exit(0)

    atexit.register(write)
    signal.signal(signal.SIGTERM, stop)
    return main(argv)


def run(paths: dict, gguf: Path, shim: Path, backend: str, vk_env: dict, threads: int, tokens: int) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_llama
    from tests.interop.harness import guest_env

    with tempfile.TemporaryDirectory(prefix="bench-fences-") as tmp:
        sock, out = Path(tmp) / "apir.sock", Path(tmp) / "counts.json"
        env = dict(os.environ, **vk_env, APIR_GGML_LIB_DIR=paths["GGML_LIB_DIR"],
                   APIR_GGML_INCLUDE_DIR=paths["GGML_INCLUDE"], PYTHONPATH=str(REPO))
        cmd = [sys.executable, __file__, "--host", str(out), "host", "serve", "--socket", str(sock),
               "--backend", backend, "--config", f"apir.host.n_threads={threads}",
               "--config", "apir.host.device_type=gpu", "--config", "apir.local.max_blobs=16384"]
        with open(Path(tmp) / "host.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                for _ in range(600):
                    if sock.exists() or proc.poll() is not None:
                        break
                    time.sleep(0.1)
                genv = dict(guest_env(paths, shim, str(sock)), **vk_env, LD_LIBRARY_PATH=paths["GGML_LIB_DIR"])
                device = None
                if backend != "cpu":
                    genv["GGML_VK_VISIBLE_DEVICES"] = ""  # no Vulkan device in the guest
                    device = next(n for n in bench_llama.list_devices(paths, genv) if n.startswith("[virtgpu]"))
                bench_llama.llama_bench(paths, gguf, genv, threads, 0, tokens, 1, 0, device)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--host"]:
        return host_main(argv[1], argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="vulkan:0", help="cpu or vulkan[:N]")
    ap.add_argument("--lavapipe", action="store_true", help="Mesa's lavapipe (tests/ggml_backends.py)")
    ap.add_argument("--tokens-a", type=int, default=2)
    ap.add_argument("--tokens-b", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.interop.harness import build_shim
    from tests.llama.build import build, build_vulkan, model

    vulkan = args.backend != "cpu"
    paths, gguf = (build_vulkan() if vulkan else build()), model()
    vk_env: dict = {}
    if args.lavapipe:
        from tests import ggml_backends

        vk_env = ggml_backends.lavapipe_env(ggml_backends.build())
    shim = build_shim(paths)
    a, b = (run(paths, gguf, shim, args.backend, vk_env, args.threads, n) for n in (args.tokens_a, args.tokens_b))
    per_token = {k.replace("ggml_backend_", ""): (b[k] - a[k]) / (args.tokens_b - args.tokens_a) for k in a}
    waits = per_token["synchronize"] + per_token["tensor_set"] + per_token["tensor_get"]
    report = {"backend": args.backend, "lavapipe": args.lavapipe,
              "async_transfers": os.environ.get("APIR_HOST_ASYNC_TRANSFERS", "on"),
              "per_token": per_token, "waits_per_token": waits}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"host on {args.backend}{' (lavapipe)' if args.lavapipe else ''}, "
              f"async transfers {report['async_transfers']}: per generated token")
        for k, v in per_token.items():
            print(f"  {k:<20}{v:8.2f}")
        print(f"  {'waits (sync+set+get)':<20}{waits:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
