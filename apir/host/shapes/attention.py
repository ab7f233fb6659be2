"""Rules of the attention and recurrent-state ops: FLASH_ATTN_EXT, SSM_CONV, SSM_SCAN,
RWKV_WKV6, RWKV_WKV7, GATED_LINEAR_ATTN, GATED_DELTA_NET, ..."""

from __future__ import annotations

from apir.host.shapes.base import dst_contiguous, fail, need, param_f32, param_i32

_PREC = (0, 10)  # GGML_PREC_DEFAULT, GGML_PREC_F32: any other makes the CPU kernel abort


def _divides(a: int, b: int) -> bool:
    """a > 0 and a divides b (a broadcast the kernels compute as b / a, then index / that)."""
    return a > 0 and b % a == 0


def _flash_attn_ext(node, srcs, enums):
    """FLASH_ATTN_EXT (ggml_flash_attn_ext, _add_sinks, _set_prec; the CPU's
    ggml_compute_forward_flash_attn_ext_f16 and its one_chunk / tiled / split-KV paths, the
    same in ggml 0.10 and 0.20).

    q [DK, N, H, S] F32 is read as F32 rows, k [DK, KV, H/rk, S] rows are dotted with q's rows
    converted to k's vec_dot_type, v [DV, >=KV, H/rv, S] rows converted to F32 (F32, F16 or
    to_float); head h reads k's head h / (H / nek2) and v's h / (H / nev2), so both must
    divide H (a zero divisor traps). The mask (F16, contiguous) is read at row iq1 of head
    h % ne2, entries [0, KV); sinks one F32 per head. The result [DV, H, N, S] F32 is written
    as whole rows of DV floats at (i3*ne2*ne1 + i2 + i1*ne1) * nb1: it must be contiguous."""
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
    row = enums.vec_dot.get(k.type_name)
    if row is None or dk % row:
        fail(node, f"k type {k.type_name} has no CPU dot product for rows of {dk}")
    if not (v.type_name in ("F32", "F16", "BF16") or v.type_name in enums.to_float) or dv % v.blck_size:
        fail(node, f"v type {v.type_name} has no conversion to F32 for rows of {dv}")
    if not (q.rows_contiguous() and k.rows_contiguous() and v.rows_contiguous()):
        fail(node, "rows of q, k or v are not contiguous")
    if mask is not None:
        if mask.type_name != "F16" or not mask.contiguous():
            fail(node, f"mask must be contiguous F16, not {mask.type_name} nb {mask.nb}")
        if (mask.ne[0] < k.ne[1] or mask.ne[1] < q.ne[1] or not _divides(mask.ne[2], q.ne[2])
                or not _divides(mask.ne[3], q.ne[3])):
            fail(node, f"mask {mask.ne} does not cover kv {k.ne[1]} for q {q.ne}")
    elif param_f32(node, 1) > 0.0:
        fail(node, "max_bias needs a mask")
    if sinks is not None:
        # read as a plain array of one F32 per head
        if sinks.type_name != "F32" or sinks.ne[0] != q.ne[2] or not sinks.rows_contiguous():
            fail(node, f"sinks {sinks.type_name} {sinks.ne} do not fit {q.ne[2]} heads")
    if param_i32(node, 3) not in _PREC:
        fail(node, f"precision {param_i32(node, 3)} unknown")
    dst_contiguous(node)


RULES = {
    "FLASH_ATTN_EXT": _flash_attn_ext,
}
