"""A one-token decode graph of a Llama-like model (SmolLM2-135M's shape by default), built with
ggml's constructors, for chunked-compute tests and benchmarks/bench_compute_chunks.py.

Per layer: RMS_NORM, MUL, three MUL_MAT (q, k, v), ROPE of q and k, attention over a KV cache
of `kv_len` positions (grouped heads: MUL_MAT broadcast over heads, SOFT_MAX_EXT), the
heads merged (PERMUTE, CONT, RESHAPE), the output MUL_MAT and ADD; then the SiLU-gated FFN
(RMS_NORM, MUL, two MUL_MAT, SILU, MUL, MUL_MAT, ADD). The logits: RMS_NORM, MUL, MUL_MAT.
Weights F16 (`wtype`), everything else F32; ~29 nodes a layer."""

from __future__ import annotations

from typing import List, NamedTuple

import numpy as np

from apir.ggml.lib import InitParams


class Decode(NamedTuple):
    ctx: int
    graph: int
    inputs: List[int]  # every leaf the graph reads, to fill
    out: int  # the logits


SMOLLM2 = dict(layers=30, n_embd=576, n_ff=1536, n_head=9, n_kv_head=3, kv_len=128, vocab=8192)


def decode_graph(g, layers=2, n_embd=128, n_ff=256, n_head=4, n_kv_head=2, kv_len=32, vocab=512, wtype="F16"):
    """The graph, unallocated (no_alloc context): allocate with ggml_backend_alloc_ctx_tensors."""
    head = n_embd // n_head
    n_nodes = 40 * layers + 16
    size = g.ggml_tensor_overhead() * (n_nodes * 2 + 16 * layers + 16) + g.ggml_graph_overhead_custom(n_nodes, False)
    ctx = g.ggml_init(InitParams(size, None, True))
    f32, wt, i32 = g.types["F32"], g.types[wtype], g.types["I32"]
    inputs: List[int] = []

    def leaf(t, *ne):
        x = getattr(g, f"ggml_new_tensor_{len(ne)}d")(ctx, t, *ne)
        g.ggml_set_input(x)
        inputs.append(x)
        return x

    x = leaf(f32, n_embd, 1)
    pos = leaf(i32, 1)

    def norm(h):
        return g.ggml_mul(ctx, g.ggml_rms_norm(ctx, h, 1e-5), leaf(f32, n_embd, 1))

    graph = g.ggml_new_graph_custom(ctx, n_nodes, False)
    for _ in range(layers):
        h = norm(x)
        q = g.ggml_reshape_3d(ctx, g.ggml_mul_mat(ctx, leaf(wt, n_embd, n_embd), h), head, n_head, 1)
        k = g.ggml_reshape_3d(ctx, g.ggml_mul_mat(ctx, leaf(wt, n_embd, head * n_kv_head), h), head, n_kv_head, 1)
        v = g.ggml_mul_mat(ctx, leaf(wt, n_embd, head * n_kv_head), h)
        q = g.ggml_rope_ext(ctx, q, pos, None, head, 0, 0, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0)
        k = g.ggml_rope_ext(ctx, k, pos, None, head, 0, 0, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0)
        # this token's k and v stored at position POS of the caches, before attention reads them
        k_cache, v_cache = leaf(f32, head, kv_len, n_kv_head), leaf(f32, kv_len, head, n_kv_head)
        kn, vn = _nb(g, k_cache), _nb(g, v_cache)
        k_at = g.ggml_view_3d(ctx, k_cache, head, 1, n_kv_head, kn[1], kn[2], POS * kn[1])
        v_at = g.ggml_view_3d(ctx, v_cache, 1, head, n_kv_head, vn[1], vn[2], POS * vn[0])
        g.ggml_build_forward_expand(graph, g.ggml_cpy(ctx, g.ggml_reshape_3d(ctx, k, head, 1, n_kv_head), k_at))
        g.ggml_build_forward_expand(graph, g.ggml_cpy(ctx, g.ggml_reshape_3d(ctx, v, 1, head, n_kv_head), v_at))
        kq = g.ggml_mul_mat(ctx, k_cache, g.ggml_permute(ctx, q, 0, 2, 1, 3))  # [kv_len, 1, n_head]
        kq = g.ggml_soft_max_ext(ctx, kq, None, float(1.0 / np.sqrt(head)), 0.0)
        kqv = g.ggml_mul_mat(ctx, v_cache, kq)  # [head, 1, n_head]
        merged = g.ggml_reshape_2d(ctx, g.ggml_cont(ctx, g.ggml_permute(ctx, kqv, 0, 2, 1, 3)), n_embd, 1)
        x = g.ggml_add(ctx, x, g.ggml_mul_mat(ctx, leaf(wt, n_embd, n_embd), merged))
        x = g.ggml_add(ctx, x, _ffn(g, ctx, leaf, norm(x), n_embd, n_ff, wt))
    out = g.ggml_mul_mat(ctx, leaf(wt, n_embd, vocab), norm(x))
    g.ggml_set_output(out)
    g.ggml_build_forward_expand(graph, out)
    return Decode(ctx, graph, inputs, out)


POS = 3  # the token's position


def _nb(g, t) -> List[int]:
    from apir.ggml.layout import tensor_record

    return [int(v) for v in tensor_record(t, g.tensor_dtype)["nb"]]


def _ffn(g, ctx, leaf, h, n_embd, n_ff, wt):
    gate = g.ggml_mul_mat(ctx, leaf(wt, n_embd, n_ff), h)
    up = g.ggml_mul_mat(ctx, leaf(wt, n_embd, n_ff), h)
    return g.ggml_mul_mat(ctx, leaf(wt, n_ff, n_embd), g.ggml_mul(ctx, g.ggml_silu(ctx, gate), up))


def fill(g, d: Decode, seed: int = 1) -> None:
    """Every input of `d` (allocated) set: weights and activations small random values, the
    position POS."""
    rng = np.random.default_rng(seed)
    for t in d.inputs:
        n, type_name = int(g.ggml_nelements(t)), g.type_names[int(_type(g, t))]
        if type_name == "I32":
            data = np.full(n, POS, np.int32)
        else:
            data = (rng.standard_normal(n) * 0.05).astype(np.float16 if type_name == "F16" else np.float32)
        g.ggml_backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)


def _type(g, t) -> int:
    from apir.ggml.layout import tensor_record

    return int(tensor_record(t, g.tensor_dtype)["type"])
