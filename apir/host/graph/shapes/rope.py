"""Rules of ROPE and ROPE_BACK (one CPU kernel, ggml_compute_forward_rope_flt; the same in
ggml 0.10 and 0.20, ggml 0.25 adds the offset of the rotated channels, op_params[15])."""

from __future__ import annotations

from apir.ggml.features import Feature

from apir.host.graph.shapes.base import fail, int_counted_rules, need, param_i32, same_shape


# ggml 0.25: ggml_rope_set_offset stores n_offs in op_params[15]; rope_flt rotates the n_dims
# channels from n_offs and copies the others, skipping the rotated ones.


def _rope_offset(node, n_dims: int, ne0: int, vision: bool) -> None:
    """ggml 0.25's n_offs (op_params[15]): rope_flt GGML_ASSERTs n_offs >= 0, even, n_offs +
    n_dims <= ne[0], and 0 for vision (an abort of the host otherwise). Its copy of the
    unrotated channels steps i0 by 2 and, at i0 == n_offs, jumps n_dims - 2 ahead: with n_dims
    0 that jump goes back 2 and the loop never ends (a hang), so n_dims 0 is refused wherever
    i0 reaches n_offs (n_offs < ne[0])."""
    n_offs = param_i32(node, 15)
    if vision:
        if n_offs != 0:
            fail(node, f"n_offs {n_offs} with the vision mode")
        return
    if n_offs < 0 or n_offs % 2 or n_offs + n_dims > ne0:
        fail(node, f"n_offs {n_offs} with n_dims {n_dims} does not fit ne[0] {ne0}")
    if n_dims == 0 and n_offs < ne0:
        fail(node, f"n_dims 0 at n_offs {n_offs}: the copy of the other channels would not end")


def _rope(node, srcs, enums):
    """ROPE and ROPE_BACK (ggml_rope_impl, which ggml_rope_ext_back / ggml_rope_multi_back
    reuse, and the CPU's rope_flt): src0 F32/F16 with the result's shape and type, rows of
    elements (GGML_ASSERT nb0 == nb00 == sizeof(T)), each tensor walked within its own ne
    and nb (views allowed); positions I32, a vector of ne[2] (4 per ne[2] for the
    multi-section modes, vision included), read as a flat array; optional F32 frequency
    factors. Per row the kernel rotates pairs inside the first n_dims (vision: all ne[0],
    paired at n_dims apart) and copies the rest two at a time; ggml 0.25 rotates from n_offs
    (`_rope_offset`)."""
    a, pos = need(node, srcs, 2)
    ff = srcs[2] if len(srcs) > 2 else None
    modes = enums.rope
    n_dims, mode = param_i32(node, 1), param_i32(node, 2)
    # rope_flt's switch aborts on any other mode
    if not modes or mode not in modes.values():
        fail(node, f"rope mode {mode} unknown")
    multi = bool(mode & modes.get("MROPE", 0))
    vision = mode == modes.get("VISION")
    same_shape(node, a, "src0")
    if a.type_name not in ("F32", "F16") or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")
    ne0 = a.ne[0]
    # The kernel GGML_ASSERTs n_dims <= ne[0] and even (vision: n_dims == ne[0] / 2); a
    # negative n_dims would start the copy of the rest before the row. Odd ne[0] would make
    # that pairwise copy read and write one element past the row (vision has no such copy:
    # its pairs (i, i + n_dims) for i <= (ne[0] - 1) / 2 stay in the row).
    if (ne0 % 2 and not vision) or not 0 <= n_dims <= ne0 or n_dims % 2 or (vision and n_dims != ne0 // 2):
        fail(node, f"n_dims {n_dims} does not fit ne[0] {ne0} (mode {mode})")
    if Feature.ROPE_OFFSET in enums.features:
        _rope_offset(node, n_dims, ne0, vision)
    want = a.ne[2] * (4 if multi else 1)
    if pos.type_name != "I32" or pos.ne != [want, 1, 1, 1] or not pos.contiguous():
        fail(node, f"positions {pos.type_name} {pos.ne}: need I32 [{want}]")
    if multi:
        # ggml_mrope_cache_init takes (i0 / 2) % (sum of sections) and GGML_ASSERTs the sum
        # is <= ne[0]; rope_flt GGML_ASSERTs one of the first three is > 0.
        sections = [param_i32(node, 11 + i) for i in range(4)]
        if any(not 0 <= x <= ne0 for x in sections) or not 0 < sum(sections) <= ne0 or not any(sections[:3]):
            fail(node, f"sections {sections} do not fit ne[0] {ne0}")
    if ff is not None:
        # ggml (constructor and kernel) GGML_ASSERTs ne[0] >= n_dims / 2, but the cache
        # reads one factor per pair of ne[0], as a flat array from its data: past the
        # tensor when n_dims < ne[0] (test-backend-ops' own cases do so; those factors only
        # feed cache entries the rotation does not use). Such a read must stay in its buffer.
        if ff.type_name != "F32" or ff.nb[0] != 4 or ff.ne[0] < n_dims // 2:
            fail(node, f"frequency factors {ff.type_name} {ff.ne} do not cover n_dims {n_dims}")
        read = 4 * ((ne0 + 1) // 2)
        if ff.ne[0] < (ne0 + 1) // 2 and ff.room is not None and ff.room < read:
            fail(node, f"frequency factors: {read} bytes read past the end of their buffer ({ff.room} bytes left)")


# Every kernel here counts rows (and most elements) in C `int` (base.int_counted).
RULES = int_counted_rules(
    {
        "ROPE": _rope,
        "ROPE_BACK": _rope,
    }
)
