"""Real ggml graphs for the codec's tests and benchmark, built with libggml through ctypes.

`build_graph` makes a transformer-ish graph (mul_mat, add, soft_max, views, permute, cont,
reshape, get_rows, scale) in a no_alloc context, then places most tensors in fake remote
buffers by writing `buffer` / `data` into ggml's structs, as ggml-alloc would: views share
their source's buffer at data = source data + view_offs; a few tensors stay unallocated.
Data addresses are never dereferenced, so the buffers' bases are made-up addresses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apir.codec.graph import BufferTable
from apir.ggml import InitParams
from apir.ggml.layout import tensor_record


LONG_NAME = b"blk.%d.attn_qkv.weight-with-a-name-longer-than-ggml-max-name-allows-it-to-be"


@dataclass
class BuiltGraph:
    ctx: int
    cgraph: int
    buffers: BufferTable
    tensors: list = field(default_factory=list)  # every tensor address of the context
    buffers_used: list = field(default_factory=list)  # (pointer, base, bytes placed) per fake buffer

    def free(self, g):
        g.ggml_free(self.ctx)


def _tensors(g, ctx):
    out = []
    t = g.ggml_get_first_tensor(ctx)
    while t:
        out.append(t)
        t = g.ggml_get_next_tensor(ctx, t)
    return out


def build_graph(g, n_layers: int, make_buffer=None, n_buffers: int = 3, graph_size: int = 2048,
                only_last_node: bool = False, all_allocated: bool = False) -> BuiltGraph:
    """A graph of 20 nodes per layer (plus one). `make_buffer(handle, base) -> pointer` gives
    each fake remote buffer its ggml_backend_buffer pointer (default: made-up pointers, for
    serializers that never dereference them). With `only_last_node` the cgraph holds only
    the final tensor as its node (so the tensors far outnumber the nodes). With `all_allocated`
    every tensor gets data (a host checks that every graph tensor has); `buffers_used` says how
    many bytes of each buffer the tensors take."""
    ctx = g.ggml_init(InitParams(g.ggml_tensor_overhead() * (32 * n_layers + 64)
                                 + g.ggml_graph_overhead_custom(graph_size, False), None, True))
    f32, f16, i32 = g.types["F32"], g.types["F16"], g.types["I32"]
    d, n_tok = 64, 8
    emb = g.ggml_new_tensor_2d(ctx, f16, d, 100)
    g.ggml_set_name(emb, b"token_embd.weight")
    ids = g.ggml_new_tensor_1d(ctx, i32, n_tok)
    g.ggml_set_name(ids, b"inp_tokens")
    x = g.ggml_get_rows(ctx, emb, ids)
    for layer in range(n_layers):
        # (F32 when every tensor is allocated: the graph then goes to a host's checks, and ggml
        # CPU's MUL_MAT(x, w) takes no F16 src1 next to an F32 src0)
        w = g.ggml_new_tensor_2d(ctx, f32 if all_allocated else f16, d, d)
        g.ggml_set_name(w, LONG_NAME % layer)  # ggml keeps its first 63 bytes
        b = g.ggml_new_tensor_1d(ctx, f32, d)
        h = g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, x), b)
        q = g.ggml_view_2d(ctx, h, d // 2, n_tok, g.ggml_row_size(f32, d), 0)
        k = g.ggml_view_2d(ctx, h, d // 2, n_tok, g.ggml_row_size(f32, d), g.ggml_row_size(f32, d // 2))
        qp = g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, g.ggml_cont(ctx, q), 8, 4, n_tok), 0, 2, 1, 3)
        kp = g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, g.ggml_cont(ctx, k), 8, 4, n_tok), 0, 2, 1, 3)
        att = g.ggml_soft_max(ctx, g.ggml_scale(ctx, g.ggml_mul_mat(ctx, kp, qp), 0.125))
        x = g.ggml_add(ctx, x, g.ggml_cont(ctx, g.ggml_transpose(ctx, g.ggml_mul_mat(ctx, x, w))))
        x = g.ggml_add(ctx, x, g.ggml_reshape_2d(ctx, g.ggml_cont(ctx, att), d, n_tok * n_tok * 4 // d))
    g.ggml_set_name(x, b"result_output")
    g.ggml_set_output(x)
    cgraph = g.ggml_new_graph_custom(ctx, graph_size, False)
    if only_last_node:
        g.ggml_graph_add_node(cgraph, x)
    else:
        g.ggml_build_forward_expand(cgraph, x)

    table = BufferTable()
    tensors = _tensors(g, ctx)
    ptrs = []
    for k in range(n_buffers):
        handle, base = 0xC0DE0000_0000 + 0x100 * k, 0x7E00_0000_0000 + (k << 32)
        ptr = make_buffer(handle, base) if make_buffer else 0x5A00_0000_0000 + 0x1000 * k
        table.register(ptr, handle, base)
        ptrs.append((ptr, base))
    dtype = g.tensor_dtype
    offsets = [0] * n_buffers
    for i, t in enumerate(tensors):  # creation order: a view's source comes first
        rec = tensor_record(t, dtype)
        if rec["view_src"]:
            src = tensor_record(int(rec["view_src"]), dtype)
            rec["buffer"] = src["buffer"]
            rec["data"] = src["data"] + rec["view_offs"] if src["data"] else 0
        elif all_allocated or i % 7 != 3:  # else every 7th tensor stays unallocated
            k = i % n_buffers
            rec["buffer"] = ptrs[k][0]
            rec["data"] = ptrs[k][1] + offsets[k]
            offsets[k] += (g.ggml_nbytes(t) + 31) & ~31
    used = [(ptr, base, offsets[k]) for k, (ptr, base) in enumerate(ptrs)]
    return BuiltGraph(ctx, cgraph, table, tensors, used)
