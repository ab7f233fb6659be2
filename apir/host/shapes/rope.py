"""Rule of ROPE."""

from __future__ import annotations

from apir.host.shapes.base import fail, need, param_i32, same_shape


def _rope(node, srcs, enums):
    """ROPE (ggml_rope_impl and the CPU's rope_flt): src0 F32/F16 with the result's shape,
    positions I32 (4 per row of ne[2] for the multi-section modes), optional F32 frequency
    factors. The kernel rotates pairs inside the first n_dims (or, in vision mode, both
    halves), copies the rest two at a time, and reads one frequency factor per pair of ne[0]."""
    a, pos = need(node, srcs, 2)
    ff = srcs[2] if len(srcs) > 2 else None
    modes = enums.rope
    n_dims, mode = param_i32(node, 1), param_i32(node, 2)
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
    # Odd ne[0] would make the pairwise copy past n_dims read one element past the row.
    if ne0 % 2 or not 0 < n_dims <= ne0 or n_dims % 2 or (vision and n_dims != ne0 // 2):
        fail(node, f"n_dims {n_dims} does not fit ne[0] {ne0} (mode {mode})")
    want = a.ne[2] * (4 if multi else 1)
    if pos.type_name != "I32" or pos.ne != [want, 1, 1, 1] or not pos.contiguous():
        fail(node, f"positions {pos.type_name} {pos.ne}: need I32 [{want}]")
    if multi:
        sections = [param_i32(node, 11 + i) for i in range(4)]
        if any(not 0 <= x <= ne0 for x in sections) or not 0 < sum(sections) <= ne0 or not any(sections[:3]):
            fail(node, f"sections {sections} do not fit ne[0] {ne0}")
    if ff is not None:
        # ggml asserts ne[0] >= n_dims / 2, but the cache reads one factor per pair of ne[0].
        if ff.type_name != "F32" or ff.ne[0] < (ne0 + 1) // 2 or not ff.contiguous():
            fail(node, f"frequency factors {ff.type_name} {ff.ne} do not cover ne[0] {ne0}")


# Destination types with a CPU from_float.


RULES = {
    "ROPE": _rope,
}
