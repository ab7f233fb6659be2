"""What ggml's abort callback costs per node: none, apir's compiled callback, a ctypes one.

Theory of operation: ggml's CPU backend calls the abort callback from its compute thread after
every node (ggml-cpu.c, ggml_graph_compute_thread). apir installs a compiled callback that reads
one u32 without the GIL (apir.codec.atomics.nonzero_u32_callback, used by
apir.host.backend.compute_abort). A ctypes CFUNCTYPE callback would take the GIL for each node instead,
and when another thread runs Python it waits for the GIL too (up to the switch interval, 5 ms).
This times ggml_backend_graph_compute directly (no transport) on a chain of small in-place ADD
nodes (--elements F32 each), so the per-node cost is what shows, for each callback (none, apir's
compiled one, a CFUNCTYPE Python one), with this process otherwise idle and with another Python
thread spinning (a socket host busy with another guest's commands holds the GIL that way).

Prints the median per-graph time and per-node time over --repeats runs.

Run: PYTHONPATH=. python benchmarks/bench_abort_callback.py [--nodes N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time

import numpy as np

import apir.ggml
from apir.codec.atomics import nonzero_u32_callback
from apir.ggml.lib import InitParams
from apir.host.backend.compute_abort import SET_ABORT_CALLBACK, _SET_ABORT_CALLBACK_T

_CALLBACK_T = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


def build(g, n_nodes: int, n_elements: int):
    ctx = g.ggml_init(InitParams(g.ggml_tensor_overhead() * (n_nodes + 8) + g.ggml_graph_overhead_custom(
        n_nodes + 8, False), None, True))
    f32 = g.types["F32"]
    acc, one = g.ggml_new_tensor_1d(ctx, f32, n_elements), g.ggml_new_tensor_1d(ctx, f32, 1)
    y = acc
    for _ in range(n_nodes):
        y = g.ggml_add_inplace(ctx, y, one)
    graph = g.ggml_new_graph_custom(ctx, n_nodes + 8, False)
    g.ggml_build_forward_expand(graph, y)
    dev = g.ggml_backend_dev_by_type(0)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_dev_buffer_type(dev))
    return ctx, graph, buf


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--elements", type=int, default=1 << 14)
    args = p.parse_args(argv)
    g = apir.ggml.load()
    ctx, graph, buf = build(g, args.nodes, args.elements)
    dev = g.ggml_backend_dev_by_type(0)
    reg = g.ggml_backend_dev_backend_reg(dev)
    backend = g.ggml_backend_dev_init(dev, None)
    g.ggml_backend_cpu_set_n_threads(backend, args.threads)
    set_abort = _SET_ABORT_CALLBACK_T(g.ggml_backend_reg_get_proc_address(reg, SET_ABORT_CALLBACK))
    flag = np.zeros(1, dtype=np.uint32)
    py_callback = _CALLBACK_T(lambda data: flag[0] != 0)
    compiled = nonzero_u32_callback()
    stop = threading.Event()

    def busy():
        n = 0
        while not stop.is_set():
            n += 1

    def run(callback, busy_gil: bool) -> float:
        set_abort(backend, callback, flag.ctypes.data if callback else None)
        spinner = threading.Thread(target=busy, daemon=True) if busy_gil else None
        if spinner:
            stop.clear()
            spinner.start()
            time.sleep(0.05)  # spinning before the first compute
        times = []
        try:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                assert g.ggml_backend_graph_compute(backend, graph) == 0
                times.append(time.perf_counter() - t0)
        finally:
            if spinner:
                stop.set()
                spinner.join()
        return statistics.median(times)

    py_address = ctypes.cast(py_callback, ctypes.c_void_p).value
    cases = [(f"{name}{', GIL busy' if busy_gil else ''}", cb, busy_gil)
             for busy_gil in (False, True) for name, cb in (("none", None), ("compiled", compiled),
                                                           ("ctypes", py_address))]
    run(None, False)  # warm-up
    print(f"ggml_backend_graph_compute, {args.nodes} ADD nodes of {args.elements} F32, {args.threads} "
          f"thread(s), median of {args.repeats}")
    base = {}
    for name, cb, busy_gil in cases:
        t = run(cb, busy_gil)
        base.setdefault(busy_gil, t)
        print(f"  {name:20} {t * 1e3:9.2f} ms/graph  {t / args.nodes * 1e6:7.2f} us/node  "
              f"({(t - base[busy_gil]) / args.nodes * 1e6:+6.2f} us/node vs none)")
    set_abort(backend, None, None)
    g.ggml_backend_free(backend)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
