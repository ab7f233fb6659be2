"""What the device-set tests share: a graph whose two weights live on two devices, computed
by ggml's own scheduler (ggml_backend_sched, declared here: apir does not use it itself)."""

import ctypes

import numpy as np

from apir.ggml.lib import InitParams
from apir.guest.backend import tensor_get, tensor_set


def sched_functions(g):
    lib = g.cdlls[-1]
    p, i, z, b = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_bool
    fns = {
        "ggml_backend_sched_new": (p, [p, p, i, z, b, b]),
        "ggml_backend_sched_free": (None, [p]),
        "ggml_backend_sched_alloc_graph": (b, [p, p]),
        "ggml_backend_sched_graph_compute": (i, [p, p]),
        "ggml_backend_sched_get_n_splits": (i, [p]),
        "ggml_backend_sched_get_tensor_backend": (p, [p, p]),
    }
    out = {}
    for name, (res, args) in fns.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
        out[name] = fn
    return out


def values(seed: int = 5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((3, 8), dtype=np.float32)] + [
        rng.standard_normal((8, 8), dtype=np.float32) for _ in range(2)
    ]


def split_compute(g, bufts, backends, data, times: int = 2):
    """x -> mul_mat(w0) -> add x -> mul_mat(w1) -> rms_norm, with w0 in a buffer of bufts[0]
    and w1 of bufts[1] (weights: the scheduler runs their ops there), computed `times` times
    by a scheduler over `backends` (the last one ggml's CPU). Returns (outputs, n_splits, the
    backends the nodes ran on)."""
    sched_fns = sched_functions(g)
    xv, w0v, w1v = data
    size = 64 * g.ggml_tensor_overhead() + g.ggml_graph_overhead()
    wctx = [g.ggml_init(InitParams(size, None, True)) for _ in range(2)]
    cctx = g.ggml_init(InitParams(size, None, True))
    f32 = g.types["F32"]
    sched, wbufs = None, []
    try:
        w0 = g.ggml_new_tensor_2d(wctx[0], f32, 8, 8)
        w1 = g.ggml_new_tensor_2d(wctx[1], f32, 8, 8)
        wbufs = [g.ggml_backend_alloc_ctx_tensors_from_buft(c, b) for c, b in zip(wctx, bufts)]
        for b in wbufs:
            g.ggml_backend_buffer_set_usage(b, 1)  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS
        tensor_set(g, w0, w0v)
        tensor_set(g, w1, w1v)
        x = g.ggml_new_tensor_2d(cctx, f32, 8, 3)
        g.ggml_set_input(x)
        h = g.ggml_add(cctx, g.ggml_mul_mat(cctx, w0, x), x)
        out = g.ggml_rms_norm(cctx, g.ggml_mul_mat(cctx, w1, h), 1e-5)
        g.ggml_set_output(out)
        gf = g.ggml_new_graph(cctx)
        g.ggml_build_forward_expand(gf, out)
        array = (ctypes.c_void_p * len(backends))(*backends)
        sched = sched_fns["ggml_backend_sched_new"](array, None, len(backends), 2048, False, True)
        assert sched_fns["ggml_backend_sched_alloc_graph"](sched, gf)
        n_splits = sched_fns["ggml_backend_sched_get_n_splits"](sched)
        placed = {
            sched_fns["ggml_backend_sched_get_tensor_backend"](sched, g.ggml_graph_node(gf, i))
            for i in range(g.ggml_graph_n_nodes(gf))
        }
        outs = []
        for _ in range(times):
            tensor_set(g, x, xv)
            assert sched_fns["ggml_backend_sched_graph_compute"](sched, gf) == 0
            outs.append(tensor_get(g, out))
        return outs, n_splits, placed
    finally:
        if sched:
            sched_fns["ggml_backend_sched_free"](sched)
        for b in wbufs:
            if b:
                g.ggml_backend_buffer_free(b)
        for c in wctx + [cctx]:
            g.ggml_free(c)
