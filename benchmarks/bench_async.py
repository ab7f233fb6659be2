"""Round trips with and without the ASYNC extension (docs/protocol.md 12.7), in one run.

Theory of operation: two apir guests in this process, each over its own host on ggml CPU
(embedded, or with --socket an `apir host serve` each), one agreeing on every extension
("async") and one on every extension but ASYNC ("sync": APIR 0.2's waits). Both run two
workloads, alternating rounds so drift hits both alike:

  minilm   one all-MiniLM-L6-v2 batch (`MiniLM.embed_tokens`, 8 sentences): 5 input sets,
           a graph compute, the output's get;
  decode   a decode-like step: --sets small inputs set with ggml_backend_tensor_set_async
           (llama.cpp sets ~14 a token), a small graph computed (GRAPH_RECOMPUTE after the
           first), the logits read.

Per step it reports the calls waited for and the commands posted (`Remote.waited` / `posted`,
exact counts), the EXECBUFFERs sent, and the median step time with the median of the
per-round ratios async / sync and its 95% interval (benchmarks/paired_stats.py). Buffers are
host-only (buffer_type_alloc_buffer), as on a GPU host; --zero-copy takes the guest-mapped
buffers ggml CPU offers, whose sets are the guest's memmove in both modes.

Measured (2-core machine shared with other helpers' work, 30 rounds, --sets 14), round trips:
  minilm  waited 7 -> 2 per batch (5 posted), EXECBUFFERs 7 -> 2
  decode  waited 16 -> 2 per step (14 posted), EXECBUFFERs 16 -> 2
Time, at load ~6 (two runs, one per host): embedded host (a bounded command runs inline in
the guest's thread, so a round trip costs little there) minilm 34.1 vs 34.0 ms, ratio 1.00
[0.99, 1.01], decode 1.46 vs 1.16 ms, ratio 0.79 [0.76, 0.85]; socket host (exec ring) minilm
34.8 vs 34.0 ms, 0.98 [0.96, 1.00], decode 1.31 vs 1.03 ms, 0.83 [0.52, 1.11]. At load 9-12:
embedded decode 1.10 vs 0.91 ms, 0.83 [0.78, 0.88]; socket decode 0.80 [0.13, 1.09]; MiniLM's
batch (0.5-0.9 s there) within noise. A VM pays a vCPU exit and a host thread's wake-up per
waited EXECBUFFER, where the removed round trips weigh more: not measured here.

Run: PYTHONPATH=. python benchmarks/bench_async.py [--rounds 30] [--sets 14] [--socket]
         [--zero-copy] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired_stats import median_interval  # noqa: E402

from apir.codec.constants import APIR_EXTENSIONS_ALL, ApirExtension  # noqa: E402
from apir.ggml.lib import InitParams  # noqa: E402
from apir.guest.backend import ApirBackend  # noqa: E402
from apir.guest.client import ApirClient  # noqa: E402
from apir.local.embedded import EmbeddedDevice  # noqa: E402

MODES = {"sync": APIR_EXTENSIONS_ALL & ~ApirExtension.ASYNC, "async": APIR_EXTENSIONS_ALL}
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue today."] * 3


class Guest:
    """One client + ApirBackend over its own embedded host, with the workloads on it."""

    def __init__(self, g, device, extensions: int, zero_copy, n_sets: int, assets):
        from apir.models.minilm import MiniLM

        self.g = g
        self.client = ApirClient.connect(device, extensions=extensions)
        self.backend = ApirBackend(self.client, g, zero_copy=zero_copy)
        self.minilm = MiniLM(self.backend.backend, self.backend.buffer_type, assets=assets, ggml=g)
        self.batch = self.minilm.tokenize(SENTENCES[:8])
        self._decode_setup(n_sets)

    def _decode_setup(self, n_sets: int) -> None:
        g = self.g
        f32, i32 = g.types["F32"], g.types["I32"]
        size = (2 * n_sets + 16) * g.ggml_tensor_overhead() + g.ggml_graph_overhead()
        self.ctx = g.ggml_init(InitParams(size, None, True))
        w = g.ggml_new_tensor_2d(self.ctx, f32, 64, 64)
        self.inputs = [g.ggml_new_tensor_1d(self.ctx, i32 if k % 2 else f32, 64) for k in range(n_sets)]
        x = self.inputs[0]
        for t in self.inputs[2::2]:
            x = g.ggml_add(self.ctx, x, t)
        self.logits = g.ggml_mul_mat(self.ctx, w, g.ggml_reshape_2d(self.ctx, x, 64, 1))
        self.graph = g.ggml_new_graph(self.ctx)
        g.ggml_build_forward_expand(self.graph, self.logits)
        self.buf = g.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, self.backend.buffer_type)
        weight = np.full(64 * 64, 0.01, dtype=np.float32)
        g.ggml_backend_tensor_set(w, weight.ctypes.data, 0, weight.nbytes)
        self.values = [np.arange(64, dtype=np.int32 if k % 2 else np.float32) for k in range(n_sets)]
        self.out = np.zeros(64, dtype=np.float32)

    def minilm_step(self) -> None:
        self.minilm.embed_tokens(self.batch)

    def decode_step(self) -> None:
        g, backend = self.g, self.backend.backend
        for t, v in zip(self.inputs, self.values):
            g.ggml_backend_tensor_set_async(backend, t, v.ctypes.data, 0, v.nbytes)
        if g.ggml_backend_graph_compute(backend, self.graph) != 0:
            raise RuntimeError("decode graph failed")
        g.ggml_backend_tensor_get(self.logits, self.out.ctypes.data, 0, self.out.nbytes)

    def timed(self, step):
        remote = self.client.remote
        waited, posted, execbuffers = remote.waited, remote.posted, remote.execbuffers
        t0 = time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
        return seconds, (remote.waited - waited, remote.posted - posted, remote.execbuffers - execbuffers)

    def close(self) -> None:
        self.minilm.close()
        self.g.ggml_backend_buffer_free(self.buf)
        self.g.ggml_free(self.ctx)
        self.backend.close()
        self.client.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--sets", type=int, default=14, help="input sets per decode step")
    p.add_argument("--zero-copy", action="store_true", help="guest-mapped buffers where the host offers them")
    p.add_argument("--socket", action="store_true", help="each guest over an `apir host serve` of its own")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        return _run(args, stack)


def _socket_device(stack: contextlib.ExitStack, name: str):
    """A LocalDevice over an `apir host serve` of its own (one connection: it spins after replies)."""
    from apir.guest.local import LocalDevice

    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    path = os.path.join(tmp, f"{name}.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "apir.cli", "host", "serve", "--socket", path], stderr=subprocess.DEVNULL
    )
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"apir host serve did not start on {path}")
        time.sleep(0.05)
    time.sleep(0.2)
    return LocalDevice(path)


def _run(args, stack: contextlib.ExitStack) -> int:
    import apir.ggml
    from apir.models.assets import load_assets

    g = apir.ggml.load()
    assets = load_assets()
    zero_copy = None if args.zero_copy else False

    def device(mode):
        return _socket_device(stack, mode) if args.socket else EmbeddedDevice()

    guests = {mode: Guest(g, device(mode), bits, zero_copy, args.sets, assets) for mode, bits in MODES.items()}
    results = {}
    try:
        for work in ("minilm", "decode"):
            times = {m: [] for m in MODES}
            counts = {}
            order = list(MODES)
            for mode in order:  # a warm-up step each (graph caches, replay ids)
                getattr(guests[mode], f"{work}_step")()
            for r in range(args.rounds):
                for mode in order if r % 2 == 0 else order[::-1]:
                    seconds, counts[mode] = guests[mode].timed(getattr(guests[mode], f"{work}_step"))
                    times[mode].append(seconds)
            ratios = [a / s for a, s in zip(times["async"], times["sync"])]
            med, lo, hi = median_interval(ratios)
            results[work] = {
                mode: {
                    "waited": counts[mode][0],
                    "posted": counts[mode][1],
                    "execbuffers": counts[mode][2],
                    "median_s": statistics.median(times[mode]),
                }
                for mode in MODES
            }
            results[work]["ratio"] = {"median": med, "low": lo, "high": hi}
    finally:
        for guest in guests.values():
            guest.close()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    for work, r in results.items():
        s, a, q = r["sync"], r["async"], r["ratio"]
        print(
            f"{work:7s} waited/step {s['waited']} -> {a['waited']} ({a['posted']} posted), "
            f"EXECBUFFERs {s['execbuffers']} -> {a['execbuffers']}, "
            f"sync {s['median_s'] * 1e3:.2f} ms, async {a['median_s'] * 1e3:.2f} ms, "
            f"ratio {q['median']:.2f} [{q['low']:.2f}, {q['high']:.2f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
