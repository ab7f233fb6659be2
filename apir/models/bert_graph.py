"""The BERT encoder of all-MiniLM-L6-v2 as a ggml compute graph, mean pooling and L2 norm included.

Theory of operation: `build_graph` only creates tensors and ops in a no_alloc ggml context; it
touches no data and no backend, so the same graph runs on any ggml backend (local CPU, or the
host's device through APIR). The caller allocates it (ggml_gallocr), fills the inputs, computes.
ggml's ne0 is the innermost (fastest) dimension, the reverse of numpy's shape: a PyTorch linear
weight (out_features, in_features) is a ggml [in, out] tensor and `ggml_mul_mat(W, x)` with
x [in, n] gives [out, n] = (x @ W.T). H the hidden size, T the padded length, B the sentences:

    inputs   ids, type_ids  I32 [T*B]       token ids and token-type ids, sentence-major
             pos            I32 [T]         0 .. T-1
             kq_mask        F32 [T, T, 1, B] 0 for a real key token, -inf for a padded one
             pool           F32 [T, 1, B]   mask / (number of real tokens): mean-pool weights
    embed    x = LayerNorm(word[ids] + type[type_ids] + position[pos])        [H, T, B]
    layer    (6x, post-LN) a = softmax(Q K^T / sqrt(d) + mask) V, per head of d = H / heads
             x = LayerNorm(x + a Wo + bo); x = LayerNorm(x + GELU(x Wi + bi) Wo2 + bo2)
             GELU is ggml_gelu_erf (the exact erf form, BERT's "gelu"), not ggml_gelu's tanh approximation
    pool     p = sum_t x[:, t, b] * pool[t, b] (a mul_mat over t)             [H, B]
    output   p / max(||p||, 1e-12)    (ggml_l2_norm, like torch.nn.functional.normalize)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

from apir.models.assets import BertConfig

__all__ = ["GRAPH_SIZE", "L2_EPS", "GraphInputs", "BertGraph", "weight_ne", "build_graph"]

# Nodes per graph: about 30 per layer; this leaves room for deeper BERTs of the same shape.
GRAPH_SIZE = 1024
L2_EPS = 1e-12  # sentence-transformers' Normalize: F.normalize(p=2, eps=1e-12)


def weight_ne(shape) -> tuple:
    """ggml ne of a weight stored in numpy/PyTorch `shape` (the reverse order)."""
    return tuple(int(n) for n in reversed(shape))


@dataclass
class GraphInputs:
    """The input tensors (ggml_tensor pointers as ints) to fill before each compute."""

    ids: int
    type_ids: int
    pos: int
    kq_mask: int
    pool: int


@dataclass
class BertGraph:
    graph: int  # ggml_cgraph *
    inputs: GraphInputs
    output: int  # ggml_tensor * F32 [H, B]: the normalized sentence embeddings
    n_seq: int
    n_tokens: int


def build_graph(g, ctx: int, w: Dict[str, int], cfg: BertConfig, n_seq: int, n_tokens: int) -> BertGraph:
    """The forward graph for `n_seq` sentences padded to `n_tokens` tokens, in ggml context `ctx`
    (no_alloc, room for GRAPH_SIZE tensors and a graph of that size). `w` maps safetensors weight
    names to ggml tensors of shape `weight_ne(numpy shape)`. Raises ValueError on a bad size."""
    if not 1 <= n_tokens <= cfg.max_position_embeddings or n_seq < 1:
        raise ValueError(f"n_tokens {n_tokens} not in 1..{cfg.max_position_embeddings} or n_seq {n_seq} < 1")
    H, T, B = cfg.hidden_size, n_tokens, n_seq
    heads, d = cfg.num_attention_heads, cfg.head_dim
    eps = cfg.layer_norm_eps
    f32, i32 = g.types["F32"], g.types["I32"]

    def named(t, name):
        g.ggml_set_name(t, name.encode())
        return t

    def inp(t, name):
        g.ggml_set_input(t)
        return named(t, name)

    def linear(x, prefix):  # x [in, n] -> [out, n]
        return g.ggml_add(ctx, g.ggml_mul_mat(ctx, w[prefix + ".weight"], x), w[prefix + ".bias"])

    def layer_norm(x, prefix):  # normalize over ne0, then the per-feature affine map
        x = g.ggml_norm(ctx, x, eps)
        return g.ggml_add(ctx, g.ggml_mul(ctx, x, w[prefix + ".weight"]), w[prefix + ".bias"])

    ins = GraphInputs(
        ids=inp(g.ggml_new_tensor_1d(ctx, i32, T * B), "inp_ids"),
        type_ids=inp(g.ggml_new_tensor_1d(ctx, i32, T * B), "inp_type_ids"),
        pos=inp(g.ggml_new_tensor_1d(ctx, i32, T), "inp_pos"),
        kq_mask=inp(g.ggml_new_tensor_4d(ctx, f32, T, T, 1, B), "inp_kq_mask"),
        pool=inp(g.ggml_new_tensor_3d(ctx, f32, T, 1, B), "inp_pool"),
    )

    x = g.ggml_get_rows(ctx, w["embeddings.word_embeddings.weight"], ins.ids)  # [H, T*B]
    x = g.ggml_add(ctx, x, g.ggml_get_rows(ctx, w["embeddings.token_type_embeddings.weight"], ins.type_ids))
    x = g.ggml_reshape_3d(ctx, x, H, T, B)
    # [H, T] positions broadcast over the B sentences (ggml_add repeats b along ne2).
    x = g.ggml_add(ctx, x, g.ggml_get_rows(ctx, w["embeddings.position_embeddings.weight"], ins.pos))
    x = layer_norm(g.ggml_reshape_2d(ctx, x, H, T * B), "embeddings.LayerNorm")  # [H, T*B]

    scale = 1.0 / math.sqrt(d)
    for il in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{il}."
        q = g.ggml_reshape_4d(ctx, linear(x, p + "attention.self.query"), d, heads, T, B)
        k = g.ggml_reshape_4d(ctx, linear(x, p + "attention.self.key"), d, heads, T, B)
        v = g.ggml_reshape_4d(ctx, linear(x, p + "attention.self.value"), d, heads, T, B)
        q = g.ggml_permute(ctx, q, 0, 2, 1, 3)  # [d, T, heads, B]
        k = g.ggml_permute(ctx, k, 0, 2, 1, 3)  # [d, T, heads, B]
        v = g.ggml_cont(ctx, g.ggml_permute(ctx, v, 1, 2, 0, 3))  # [T, d, heads, B]: V^T per head
        kq = g.ggml_mul_mat(ctx, k, q)  # [T_key, T_query, heads, B]
        kq = g.ggml_soft_max_ext(ctx, kq, ins.kq_mask, scale, 0.0)
        a = g.ggml_mul_mat(ctx, v, kq)  # [d, T, heads, B]
        a = g.ggml_cont(ctx, g.ggml_permute(ctx, a, 0, 2, 1, 3))  # [d, heads, T, B]
        a = linear(g.ggml_reshape_2d(ctx, a, H, T * B), p + "attention.output.dense")
        x = layer_norm(g.ggml_add(ctx, a, x), p + "attention.output.LayerNorm")
        f = g.ggml_gelu_erf(ctx, linear(x, p + "intermediate.dense"))  # [I, T*B]
        f = linear(f, p + "output.dense")
        x = layer_norm(g.ggml_add(ctx, f, x), p + "output.LayerNorm")

    # Mean pooling as a weighted sum over tokens: x^T [T, H, B] times pool [T, 1, B].
    xt = g.ggml_cont(ctx, g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, x, H, T, B), 1, 0, 2, 3))
    pooled = g.ggml_reshape_2d(ctx, g.ggml_mul_mat(ctx, xt, ins.pool), H, B)
    out = named(g.ggml_l2_norm(ctx, pooled, L2_EPS), "sentence_embedding")
    g.ggml_set_output(out)

    graph = g.ggml_new_graph_custom(ctx, GRAPH_SIZE, False)
    g.ggml_build_forward_expand(graph, out)
    return BertGraph(graph, ins, out, n_seq, n_tokens)
