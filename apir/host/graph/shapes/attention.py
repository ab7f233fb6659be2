"""Rules of the attention and recurrent-state ops: FLASH_ATTN_EXT, SSM_CONV, SSM_SCAN,
RWKV_WKV6, RWKV_WKV7, GATED_LINEAR_ATTN, GATED_DELTA_NET, and ggml 0.20's LIGHTNING_INDEXER,
DSV4_HC_COMB, DSV4_HC_PRE, DSV4_HC_POST. (FLASH_ATTN_BACK has none: ggml_flash_attn_back
aborts in both ggml versions, "TODO: adapt to ggml_flash_attn_ext() changes", and
test-backend-ops has no case of it.)"""

from __future__ import annotations

from apir.ggml.features import Feature
from apir.host.graph.shapes.base import (
    INT_MAX,
    check_row_ids,
    dst_contiguous,
    fail,
    int_counted_rules,
    need,
    param_f32,
    param_i32,
)

_PREC = (0, 10)  # GGML_PREC_DEFAULT, GGML_PREC_F32: any other makes the CPU kernel abort


def _divides(a: int, b: int) -> bool:
    """a > 0 and a divides b (a broadcast the kernels compute as b / a, then index / that)."""
    return a > 0 and b % a == 0


def _packed(t) -> bool:
    """nb exactly what ggml_new_tensor gives (every dimension's, also those of ne 1, which
    contiguous() lets be anything): for kernels that use one tensor's stride to step another
    dimension, or copy a stride's worth of bytes."""
    expect = t.type_size
    for i in range(4):
        if t.nb[i] != expect:
            return False
        expect *= t.ne[i] // t.blck_size if i == 0 else t.ne[i]
    return True


def _flash_attn_ext(node, srcs, enums):
    """FLASH_ATTN_EXT (ggml_flash_attn_ext, _add_sinks, _set_prec; the CPU's
    ggml_compute_forward_flash_attn_ext_f16 and its one_chunk / tiled / split-KV paths, the
    same in ggml 0.10 and 0.20).

    q [DK, N, H, S] F32 is read as F32 rows, k [DK, KV, H/rk, S] rows are dotted with q's rows
    converted to k's vec_dot_type, v [DV, >=KV, H/rv, S] rows converted to F32 (F32, F16 or
    to_float); head h reads k's head h / (H / nek2) and v's h / (H / nev2), so both must
    divide H (a zero divisor traps). The mask (F16, contiguous) is read at row iq1 of head
    h % ne2, entries [0, KV); sinks one F32 per head. The result [DV, H, N, S] F32 is written
    as whole rows of DV floats at (i3*ne2*ne1 + i2 + i1*ne1) * nb1: it must be packed.
    The kernel's paths differ in speed, not in what they read (each stays in these rows)."""
    q, k, v = need(node, srcs, 3)
    mask = srcs[3] if len(srcs) > 3 else None
    sinks = srcs[4] if len(srcs) > 4 else None
    dk, dv = k.ne[0], v.ne[0]
    if q.ne[0] != dk or not _divides(k.ne[2], q.ne[2]) or not _divides(k.ne[3], q.ne[3]):
        fail(node, f"k {k.ne} cannot be multiplied with q {q.ne}")
    if q.ne[3] != k.ne[3] or q.ne[3] != v.ne[3]:
        fail(node, f"ne[3] of q {q.ne[3]}, k {k.ne[3]} and v {v.ne[3]} differ")
    if not _divides(v.ne[2], q.ne[2]) or v.ne[1] < k.ne[1]:
        fail(node, f"v {v.ne} does not cover k {k.ne} for q {q.ne}")
    want = [dv, q.ne[2], q.ne[1], q.ne[3]]
    if node.ne != want:
        fail(node, f"shape {node.ne}, flash_attn_ext gives {want}")
    if q.type_name != "F32" or node.type_name != "F32":
        fail(node, f"q {q.type_name} and result {node.type_name} must be F32")
    row = enums.vec_dot_row.get(k.type_name)
    if row is None or dk % row:
        fail(node, f"k type {k.type_name} has no CPU dot product for rows of {dk}")
    if not (v.type_name in ("F32", "F16", "BF16") or v.type_name in enums.to_float) or dv % v.blck_size:
        fail(node, f"v type {v.type_name} has no conversion to F32 for rows of {dv}")
    if not (q.rows_contiguous() and k.rows_contiguous() and v.rows_contiguous()):
        fail(node, "rows of q, k or v are not contiguous")
    if mask is not None:
        if mask.type_name != "F16" or not mask.contiguous():
            fail(node, f"mask must be contiguous F16, not {mask.type_name} nb {mask.nb}")
        if (
            mask.ne[0] < k.ne[1]
            or mask.ne[1] < q.ne[1]
            or not _divides(mask.ne[2], q.ne[2])
            or not _divides(mask.ne[3], q.ne[3])
        ):
            fail(node, f"mask {mask.ne} does not cover kv {k.ne[1]} for q {q.ne}")
    elif param_f32(node, 1) > 0.0:
        fail(node, "max_bias needs a mask")
    if sinks is not None:
        # read as a plain array of one F32 per head
        if sinks.type_name != "F32" or sinks.ne[0] != q.ne[2] or not sinks.rows_contiguous():
            fail(node, f"sinks {sinks.type_name} {sinks.ne} do not fit {q.ne[2]} heads")
    if param_i32(node, 3) not in _PREC:
        fail(node, f"precision {param_i32(node, 3)} unknown")
    # rows land at (i3*ne2*ne1 + i2 + i1*ne1) * nb[1], nb[1] bytes each, and the kernel
    # GGML_ASSERTs nb0 <= nb1 <= nb2 <= nb3: every stride must be the packed one.
    if not _packed(node):
        fail(node, f"result is not packed (nb {node.nb})")


def _f32_contiguous(node, tensors, what):
    for name, t in zip(what, tensors):
        if t.type_name != "F32" or not t.contiguous():
            fail(node, f"{name} must be contiguous F32, not {t.type_name} nb {t.nb}")


def _linear_attn(node, srcs, n_tokens_srcs, key, extra, state_at):
    """RWKV_WKV6, GATED_LINEAR_ATTN, RWKV_WKV7 (ggml_rwkv_wkv6, ggml_gated_linear_attn,
    ggml_rwkv_wkv7; their CPU kernels, the same in ggml 0.10 and 0.20): every source is read
    as a flat F32 array. The per-token sources are [S, H, T] (S, H, T of src `key`, the
    kernel's T and H are src1's), the state S*S*H*n_seqs with n_seqs = its ne[1]; token t uses
    state t / (T / n_seqs), so n_seqs must divide T (T < n_seqs would divide by zero). The
    result, [S*H, T + S*n_seqs] F32, holds the outputs then the new states."""
    got = need(node, srcs, state_at + 1)
    k, state = got[key], got[state_at]
    s_, h, t = k.ne[0], k.ne[1], k.ne[2]
    _f32_contiguous(node, got, [f"src{i}" for i in range(len(got))])
    if s_ < 1 or h < 1:
        fail(node, f"head size {s_} and heads {h} must be >= 1")
    for i in n_tokens_srcs:
        if got[i].ne[:3] != [s_, h, t] or got[i].ne[3] < 1:
            fail(node, f"src{i} {got[i].ne} is not [{s_}, {h}, {t}]")
    for i in extra:  # RWKV_WKV6's time_faaaa: one F32 per channel of a head
        if got[i].nelements() < s_ * h:
            fail(node, f"src{i} {got[i].ne} has fewer than {s_ * h} elements")
    n_seqs = state.ne[1]
    if n_seqs < 1 or t % n_seqs or state.nelements() != s_ * s_ * h * n_seqs:
        fail(node, f"state {state.ne} is not {s_}*{s_}*{h} per sequence of {t} tokens")
    want = [s_ * h, t + s_ * n_seqs, 1, 1]
    if node.ne != want or node.type_name != "F32":
        fail(node, f"shape {node.type_name} {node.ne}, the op gives F32 {want}")
    dst_contiguous(node)


def _rwkv_wkv6(node, srcs, _enums=None):
    """k, v, r, time_faaaa, time_decay, state."""
    _linear_attn(node, srcs, (0, 1, 2, 4), 0, (3,), 5)


def _gated_linear_attn(node, srcs, _enums=None):
    """k, v, q, g, state; op_params[0] the scale (any float)."""
    _linear_attn(node, srcs, (0, 1, 2, 3), 0, (), 4)


# The largest GGML_F32_STEP of ggml-cpu's simd-mappings.h (AVX-512; 32 on AVX, 16 on NEON).
_F32_STEP_MAX = 64


def _rwkv_wkv7(node, srcs, _enums=None):
    """r, w, k, v, a, b, state. The GGML_SIMD kernel walks each head in whole steps of
    GGML_F32_STEP floats with no tail for the loads and stores: a head size that is not a
    multiple of it would run past r, w, k, a, b and the state, so it must be one of the
    largest step of any build."""
    _linear_attn(node, srcs, (0, 1, 2, 3, 4, 5), 2, (), 6)
    if srcs[2].ne[0] % _F32_STEP_MAX:
        fail(node, f"head size {srcs[2].ne[0]} is not a multiple of {_F32_STEP_MAX}")


def _ssm_conv(node, srcs, _enums=None):
    """SSM_CONV (ggml_ssm_conv; ggml_compute_forward_ssm_conv_f32, the same in 0.10 and 0.20):
    sx [d_conv - 1 + n_t, d_inner, n_s] F32 with packed rows (read as a sliding window of
    d_conv over its row), c [d_conv, d_inner] F32 read as one packed array, the result
    [d_inner, n_t, n_s] F32 written element by element (nb[0] of 4)."""
    sx, c = need(node, srcs, 2)
    if sx.ne[3] != 1 or c.ne[2] != 1 or c.ne[3] != 1:
        fail(node, f"sx {sx.ne} must be 3d and c {c.ne} a matrix")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    if n_t < 0 or sx.ne[1] != d_inner:
        fail(node, f"sx {sx.ne} does not fit c {c.ne}")
    want = [d_inner, n_t, sx.ne[2], 1]
    if node.ne != want or node.type_name != "F32":
        fail(node, f"shape {node.type_name} {node.ne}, ssm_conv gives F32 {want}")
    if sx.type_name != "F32" or c.type_name != "F32":
        fail(node, f"types {sx.type_name}, {c.type_name}: F32 only")
    if sx.nb[0] != 4 or sx.nb[1] != sx.ne[0] * 4 or not c.contiguous():
        fail(node, f"sx nb {sx.nb} rows not packed or c nb {c.nb} not contiguous")
    # the kernel indexes a sequence's window and c as `int` (s[i0 + i1*ncs], c[i0 + i1*nc])
    if sx.ne[0] * sx.ne[1] > INT_MAX or c.ne[0] * c.ne[1] > INT_MAX:
        fail(node, f"sx {sx.ne} or c {c.ne} too large for the kernel's int indices")
    dst_contiguous(node)


# ggml 0.20 added SSM_SCAN's K state snapshots (op_params[0]).
# (Feature.SSM_SCAN_SNAPSHOTS, apir.ggml.features)


def _ssm_scan(node, srcs, enums):
    """SSM_SCAN (ggml_ssm_scan; ggml_compute_forward_ssm_scan_f32), all F32:
    s {d_state, head_dim, n_head, >= 1} contiguous, the initial state of sequence i read at
    ids[i] * nb[3] (ids I32 [n_seqs], read here: each in [0, s->ne[3])); x {head_dim, n_head,
    n_seq_tokens, n_seqs} and B, C {d_state, n_group, n_seq_tokens, n_seqs} with packed rows
    (read as x[i1 + h*head_dim] and B[i0 + g*d_state]); dt {n_head, n_seq_tokens, n_seqs}
    and A {1 or d_state, n_head} contiguous. The result is 1d: y (x's elements) then K states
    of s's layout per sequence (ggml 0.20's op_params[0]; K = 1 in ggml 0.10)."""
    s, x, dt, a, b, c, ids = need(node, srcs, 7)
    _f32_contiguous(node, [dt, a], ["dt", "A"])
    # s's nb[3] places each sequence's states in the result and nb[2] is the byte count of
    # a head's snapshot copy, whatever ne[3] and ne[2] are
    if s.type_name != "F32" or not _packed(s):
        fail(node, f"s must be packed F32, not {s.type_name} nb {s.nb}")
    for name, t in (("x", x), ("B", b), ("C", c)):
        if t.type_name != "F32" or t.nb[0] != 4 or t.nb[1] != t.ne[0] * 4:
            fail(node, f"{name} must be F32 with packed rows, not {t.type_name} nb {t.nb}")
    d_state, head_dim, n_head, n_tokens, n_seqs = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3]
    if s.ne[1] != head_dim or s.ne[2] != n_head or s.ne[3] < 1:
        fail(node, f"s {s.ne} does not fit x {x.ne}")
    if dt.ne != [n_head, n_tokens, n_seqs, 1]:
        fail(node, f"dt {dt.ne} does not fit x {x.ne}")
    if b.ne != c.ne or b.ne[0] != d_state or b.ne[2] != n_tokens or b.ne[3] != n_seqs:
        fail(node, f"B {b.ne} and C {c.ne} do not fit s {s.ne} and x {x.ne}")
    if not _divides(b.ne[1], n_head):  # the kernel asserts n_head % n_group == 0
        fail(node, f"{b.ne[1]} groups do not divide {n_head} heads")
    if a.ne[1] != n_head or a.ne[2] != 1 or a.ne[3] != 1 or a.ne[0] not in (1, d_state):
        fail(node, f"A {a.ne} is not [1 or {d_state}, {n_head}]")
    if ids.ne != [n_seqs, 1, 1, 1]:
        fail(node, f"ids {ids.ne} are not [{n_seqs}]")
    if ids.type_name != "I32" or ids.nb[0] != 4:  # the kernel GGML_ASSERTs nb[0] == 4
        fail(node, f"ids {ids.type_name} nb {ids.nb} are not packed I32")
    check_row_ids(node, ids, s.ne[3])
    snapshots = param_i32(node, 0) if Feature.SSM_SCAN_SNAPSHOTS in enums.features else 1
    if snapshots < 1 or (a.ne[0] != 1 and snapshots != 1):
        fail(node, f"snapshot count {snapshots} (A {a.ne})")
    want = [x.nelements() + snapshots * d_state * head_dim * n_head * n_seqs, 1, 1, 1]
    if node.ne != want or node.type_name != "F32":
        fail(node, f"shape {node.type_name} {node.ne}, ssm_scan gives F32 {want}")
    dst_contiguous(node)


# ggml 0.20 added GATED_DELTA_NET's K snapshot slots (op_params[0]) and its 4d state.
# (Feature.GATED_DELTA_NET_SNAPSHOTS, apir.ggml.features)


def _gated_delta_net(node, srcs, enums):
    """GATED_DELTA_NET (ggml_gated_delta_net; ggml_compute_forward_gated_delta_net_one_chunk):
    v [S_v, H, T, n_seqs] walks the heads and tokens; q and k rows (S_v floats, packed) are
    read at head h % ne[1], token t, sequence s / (n_seqs / ne[3]) by their own strides;
    g [1 or S_v, H, T, n_seqs] and beta [1, H, T, n_seqs] contiguous. ggml 0.20: the state is
    [S_v, S_v, H, n_seqs], and K >= 1 snapshots of it follow the outputs in the result; ggml
    0.10: the state is S_v*S_v*H*n_seqs packed floats, one snapshot (op_params unused)."""
    q, k, v, g, beta, state = need(node, srcs, 6)
    s_v, h, t, n_seqs = v.ne
    _f32_contiguous(node, [g, beta, state], ["g", "beta", "state"])
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.type_name != "F32" or not (x.nb[0] == 4 or x.ne[0] == 1):
            fail(node, f"{name} must be F32 with packed rows, not {x.type_name} nb {x.nb}")
    for name, x in (("q", q), ("k", k)):
        # rows of S_v floats, heads modulo ne[1], sequences broadcast by ne[3]
        if x.ne[0] != s_v or x.ne[1] < 1 or x.ne[2] < t or not _divides(x.ne[3], n_seqs):
            fail(node, f"{name} {x.ne} does not fit v {v.ne}")
    if g.ne[0] not in (1, s_v) or g.ne[1:] != [h, t, n_seqs]:
        fail(node, f"g {g.ne} does not fit v {v.ne}")
    if beta.ne != [1, h, t, n_seqs]:
        fail(node, f"beta {beta.ne} does not fit v {v.ne}")
    if Feature.GATED_DELTA_NET_SNAPSHOTS in enums.features:
        snapshots = param_i32(node, 0)
        if snapshots < 1:
            fail(node, f"snapshot count {snapshots} is not >= 1")
        if state.ne != [s_v, s_v, h, n_seqs]:
            fail(node, f"state {state.ne} is not [{s_v}, {s_v}, {h}, {n_seqs}]")
    else:
        snapshots = 1
        if state.nelements() != s_v * s_v * h * n_seqs:
            fail(node, f"state {state.ne} does not hold {s_v}*{s_v}*{h}*{n_seqs} floats")
    want = [s_v * h, t * n_seqs + snapshots * s_v * n_seqs, 1, 1]
    if node.ne != want or node.type_name != "F32":
        fail(node, f"shape {node.type_name} {node.ne}, gated_delta_net gives F32 {want}")
    dst_contiguous(node)


def _f32(node, tensors, names):
    for name, t in zip(names, tensors):
        if t.type_name != "F32":
            fail(node, f"{name} must be F32, not {t.type_name}")


def _lightning_indexer(node, srcs, enums):
    """LIGHTNING_INDEXER (ggml 0.20: ggml_lightning_indexer; ggml_compute_forward_lightning_indexer):
    q [n_embd, n_head, n_tokens, n_stream] F32, k [n_embd, 1, n_kv, n_stream] (F32 or a type
    with to_float; rows converted n_embd at a time), weights [n_head, n_tokens, 1, n_stream]
    F32, mask [n_kv, n_tokens, 1, n_stream / r] F16; every row read with nb[0] its element
    size (the kernel GGML_ASSERTs it), the result [n_kv, n_tokens, 1, n_stream] F32 too."""
    q, k, w, m = need(node, srcs, 4)
    _f32(node, [q, w], ["q", "weights"])
    if m.type_name != "F16":
        fail(node, f"mask must be F16, not {m.type_name}")
    if not (k.type_name in ("F32", "F16", "BF16") or k.type_name in enums.to_float) or k.ne[0] % k.blck_size:
        fail(node, f"k type {k.type_name} has no conversion to F32 for rows of {k.ne[0]}")
    if (
        q.ne[0] != k.ne[0]
        or m.ne[0] != k.ne[2]
        or q.ne[1] != w.ne[0]
        or k.ne[1] != 1
        or m.ne[1] != q.ne[2]
        or q.ne[2] != w.ne[1]
        or w.ne[2] != 1
        or m.ne[2] != 1
        or q.ne[3] != k.ne[3]
        or k.ne[3] != w.ne[3]
        or not _divides(m.ne[3], w.ne[3])
    ):
        fail(node, f"q {q.ne}, k {k.ne}, weights {w.ne} and mask {m.ne} do not fit")
    want = [k.ne[2], q.ne[2], 1, q.ne[3]]
    if node.ne != want or node.type_name != "F32":
        fail(node, f"shape {node.type_name} {node.ne}, lightning_indexer gives F32 {want}")
    if not all(t.rows_contiguous() for t in (node, q, k, w, m)):
        fail(node, "rows are not contiguous")


_HC = 4  # the only hyper-connection count the CPU kernel has (a constexpr)
# Bound of DSV4_HC_COMB's Sinkhorn iteration count (op_params[1]). ggml bounds it by nothing
# (GGML_ASSERT(n_iter > 0)), so at INT32_MAX a 1 KiB graph keeps a thread busy for minutes per
# token. DeepSeek-V4 uses 20, test-backend-ops at most 20; 1024 keeps the work per token
# (~100 flops per iteration) below what a MUL_MAT of the same bytes may cost.
_HC_COMB_ITER_MAX = 1024


def _dsv4_hc_comb(node, srcs, _enums=None):
    """DSV4_HC_COMB (ggml 0.20: ggml_dsv4_hc_comb; its CPU kernel): mixes [(2 + hc)*hc,
    n_tokens], scale [>= 3], base [(2 + hc)*hc], all F32 and walked by their own strides;
    hc = 4; op_params: eps, n_iter > 0 (GGML_ASSERTed) and <= _HC_COMB_ITER_MAX (the kernel
    loops n_iter times per token). Result [hc, hc, n_tokens] F32."""
    mixes, scale, base = need(node, srcs, 3)
    _f32(node, [mixes, scale, base, node], ["mixes", "scale", "base", "result"])
    mix = (2 + _HC) * _HC
    if mixes.ne[0] != mix or mixes.ne[2:] != [1, 1]:
        fail(node, f"mixes {mixes.ne} are not [{mix}, n_tokens]")
    if scale.ne[0] < 3 or scale.ne[1:] != [1, 1, 1] or base.ne != [mix, 1, 1, 1]:
        fail(node, f"scale {scale.ne} or base {base.ne} do not fit")
    if not 1 <= param_i32(node, 1) <= _HC_COMB_ITER_MAX:
        fail(node, f"n_iter {param_i32(node, 1)} is not in [1, {_HC_COMB_ITER_MAX}]")
    want = [_HC, _HC, mixes.ne[1], 1]
    if node.ne != want:
        fail(node, f"shape {node.ne}, dsv4_hc_comb gives {want}")


# ggml 0.25: ggml_dsv4_hc_pre_gated (op_params[1] != 0: the weights are a per-element gate
# [n_embd, hc, n_tokens], read at i0, ih, it) and ggml_dsv4_hc_post without comb (src[3] NULL).


def _dsv4_hc_pre(node, srcs, enums):
    """DSV4_HC_PRE (ggml 0.20: ggml_dsv4_hc_pre; its CPU kernel): x [n_embd, hc, n_tokens],
    weights [hc, n_tokens] (ggml 0.25, gated by op_params[1]: a gate [n_embd, hc, n_tokens]),
    all F32 walked by their own strides; result [n_embd, n_tokens]."""
    x, w = need(node, srcs, 2)
    _f32(node, [x, w, node], ["x", "weights", "result"])
    gated = Feature.HC_GATED in enums.features and param_i32(node, 1) != 0
    want_w = [x.ne[0], x.ne[1], x.ne[2], 1] if gated else [x.ne[1], x.ne[2], 1, 1]
    if x.ne[1] < 1 or x.ne[3] != 1 or w.ne != want_w:
        fail(node, f"x {x.ne} and {'gate' if gated else 'weights'} {w.ne} do not fit")
    want = [x.ne[0], x.ne[2], 1, 1]
    if node.ne != want:
        fail(node, f"shape {node.ne}, dsv4_hc_pre gives {want}")


def _dsv4_hc_post(node, srcs, enums):
    """DSV4_HC_POST (ggml 0.20: ggml_dsv4_hc_post; its CPU kernel): x [n_embd, n_tokens],
    residual [n_embd, hc, n_tokens], post [hc, n_tokens], comb [hc, hc, n_tokens] (optional
    since ggml 0.25: without it the identity, residual read at [i0, idst, it]), all F32 walked
    by their own strides; result [n_embd, hc, n_tokens]."""
    optional_comb = Feature.HC_GATED in enums.features
    x, res, post = need(node, srcs, 3)
    comb = srcs[3] if len(srcs) > 3 else None
    if comb is None and not optional_comb:
        fail(node, "comb is missing")
    named = [(x, "x"), (res, "residual"), (post, "post"), (comb, "comb"), (node, "result")]
    _f32(node, [t for t, _ in named if t is not None], [n for t, n in named if t is not None])
    n_embd, n_tokens, hc = x.ne[0], x.ne[1], res.ne[1]
    if (
        hc < 1
        or x.ne[2:] != [1, 1]
        or res.ne != [n_embd, hc, n_tokens, 1]
        or post.ne != [hc, n_tokens, 1, 1]
        or (comb is not None and comb.ne != [hc, hc, n_tokens, 1])
    ):
        fail(node, f"x {x.ne}, residual {res.ne}, post {post.ne} and comb {comb and comb.ne} do not fit")
    want = [n_embd, hc, n_tokens, 1]
    if node.ne != want:
        fail(node, f"shape {node.ne}, dsv4_hc_post gives {want}")


# Every kernel here counts rows, heads or tokens in C `int` (base.int_counted).
RULES = int_counted_rules(
    {
        "FLASH_ATTN_EXT": _flash_attn_ext,
        "RWKV_WKV6": _rwkv_wkv6,
        "GATED_LINEAR_ATTN": _gated_linear_attn,
        "RWKV_WKV7": _rwkv_wkv7,
        "SSM_CONV": _ssm_conv,
        "GATED_DELTA_NET": _gated_delta_net,
        "SSM_SCAN": _ssm_scan,
        "LIGHTNING_INDEXER": _lightning_indexer,
        "DSV4_HC_COMB": _dsv4_hc_comb,
        "DSV4_HC_PRE": _dsv4_hc_pre,
        "DSV4_HC_POST": _dsv4_hc_post,
    }
)
