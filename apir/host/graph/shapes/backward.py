"""Rules of the training ops: the backward passes (SILU_BACK, RMS_NORM_BACK, SOFT_MAX_BACK),
the cross-entropy loss and its gradient, and the optimizer steps (OPT_STEP_ADAMW,
OPT_STEP_SGD). Their CPU kernels (ggml-cpu/ops.cpp) are the same in ggml 0.10 and 0.20 but
for RMS_NORM_BACK's arithmetic (not its memory walk)."""

from __future__ import annotations

from apir.host.graph.shapes.base import fail, int_counted_rules, need, param_f32, same_shape


def _types(node, tensors, allowed):
    """All of `tensors` (node included) of one type, one of `allowed`."""
    names = {t.type_name for t in tensors}
    if len(names) != 1 or not names <= set(allowed):
        fail(node, f"types {[t.type_name for t in tensors]}: need all one of {allowed}")


def _silu_back(node, srcs, _enums=None):
    """SILU_BACK (ggml_silu_back: the result is a dup of src0, the gradient; src1 is the
    forward input): F32 or F16, all three of one type (the kernel picks its type from src0
    and reads the others as it); each row walked flat at `i1 * nb[1]` over the rows of src1
    (it only `assert`s contiguous_1 and the shapes), so all three rows packed, same shape."""
    grad, x = need(node, srcs, 2)
    same_shape(node, grad, "src0")
    same_shape(node, x, "src1")
    _types(node, (node, grad, x), ("F32", "F16"))
    if not (node.rows_packed() and grad.rows_packed() and x.rows_packed()):
        fail(node, "rows are not packed")


def _rms_norm_back(node, srcs, _enums=None):
    """RMS_NORM_BACK (ggml_rms_norm_back: a dup of src0, eps in op_params): F32 only;
    GGML_ASSERTs the three shapes equal and nb[0] of src0 and src1 is 4; each tensor walked
    by its own nb[1..3], a row's elements at nb[0] == 4 (the result's too: it writes dx[i])."""
    dz, x = need(node, srcs, 2)
    same_shape(node, dz, "src0")
    same_shape(node, x, "src1")
    _types(node, (node, dz, x), ("F32",))
    if not (node.rows_contiguous() and dz.rows_contiguous() and x.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _soft_max_back(node, srcs, _enums=None):
    """SOFT_MAX_BACK (ggml_soft_max_ext_back[_inplace]: a dup or view of src0; scale and
    max_bias in op_params): F32 only; GGML_ASSERTs all three contiguous, of one shape, and
    max_bias == 0 (a NaN fails it too)."""
    dy, y = need(node, srcs, 2)
    same_shape(node, dy, "src0")
    same_shape(node, y, "src1")
    _types(node, (node, dy, y), ("F32",))
    if not (node.contiguous() and dy.contiguous() and y.contiguous()):
        fail(node, "not contiguous")
    if param_f32(node, 1) != 0.0:
        fail(node, f"max_bias {param_f32(node, 1)} is not 0")


def _cross_entropy_loss(node, srcs, _enums=None):
    """CROSS_ENTROPY_LOSS (ggml_cross_entropy_loss: a 1-element tensor of src0's type):
    the kernel GGML_ASSERTs src0 and src1 F32 of one shape with nb[0] == 4 and the result an
    F32 scalar (the graph plan sizes its work buffer by the result's type size), then walks
    each source's rows flat at `i1 * nb[1]` over all rows: rows packed."""
    a, b = need(node, srcs, 2)
    if a.ne != b.ne:
        fail(node, f"src1 {b.ne} differs from src0 {a.ne}")
    _types(node, (node, a, b), ("F32",))
    if node.ne != [1, 1, 1, 1]:
        fail(node, f"shape {node.ne}, cross_entropy_loss gives [1, 1, 1, 1]")
    if not (a.rows_packed() and b.rows_packed()):
        fail(node, "rows are not packed")


def _cross_entropy_loss_back(node, srcs, _enums=None):
    """CROSS_ENTROPY_LOSS_BACK (ggml_cross_entropy_loss_back: src0 the scalar gradient of the
    loss, src1 and src2 the forward's sources; the result a dup of src1): F32 (the kernel's
    type is src0's, it reads all as float); GGML_ASSERTs all contiguous and src1, src2 and
    the result of one shape; reads src0's first float."""
    d, a, b = need(node, srcs, 3)
    if not d.is_scalar():
        fail(node, f"src0 {d.ne} is not a scalar")
    same_shape(node, a, "src1")
    same_shape(node, b, "src2")
    _types(node, (node, d, a, b), ("F32",))
    if not (node.contiguous() and d.contiguous() and a.contiguous() and b.contiguous()):
        fail(node, "not contiguous")


def _opt_step(node, srcs, n_states, n_params):
    """What OPT_STEP_ADAMW and OPT_STEP_SGD share (ggml_opt_step_adamw / _sgd: the result is
    a view of src0, the weights, which the kernel updates in place; no data of the result
    is touched): F32 (the kernel's type is src0's); the gradient and `n_states` moment
    tensors (src1..), read and written at src0's row offsets `i1*nb01 + i2*nb02 + i3*nb03`
    (GGML_ASSERT nb00 == 4 for src0 only), so each has src0's ne and nb; the parameters
    (the last source) F32, `n_params` of them (GGML_ASSERT nelements), read as a flat array."""
    got = need(node, srcs, 2 + n_states + 1)
    w, params = got[0], got[-1]
    if (
        node.ne != w.ne
        or node.nb != w.nb
        or node.type_name != w.type_name
        or (node.address is not None and node.address != w.address)
    ):
        fail(node, "result is not a view of src0")
    if w.type_name != "F32" or not w.rows_contiguous():
        fail(node, f"src0 {w.type_name} nb {w.nb}: need F32 rows of elements")
    for i, t in enumerate(got[1:-1], start=1):
        if t.ne != w.ne or t.nb != w.nb or t.type_name != "F32":
            fail(node, f"src{i} {t.type_name} {t.ne} nb {t.nb} is not laid out as src0 {w.ne} nb {w.nb}")
    if params.type_name != "F32" or params.nelements() != n_params or not params.contiguous():
        fail(node, f"parameters {params.type_name} {params.ne}: need {n_params} contiguous F32")


def _opt_step_adamw(node, srcs, _enums=None):
    """OPT_STEP_ADAMW: src1 the gradient, src2 and src3 the moments m and v (also updated in
    place), src4 the 7 AdamW parameters."""
    _opt_step(node, srcs, n_states=2, n_params=7)


def _opt_step_sgd(node, srcs, _enums=None):
    """OPT_STEP_SGD: src1 the gradient, src2 the 2 SGD parameters (alpha, weight decay)."""
    _opt_step(node, srcs, n_states=0, n_params=2)


# Every kernel here counts rows (and most elements) in C `int` (base.int_counted).
RULES = int_counted_rules(
    {
        "SILU_BACK": _silu_back,
        "RMS_NORM_BACK": _rms_norm_back,
        "SOFT_MAX_BACK": _soft_max_back,
        "CROSS_ENTROPY_LOSS": _cross_entropy_loss,
        "CROSS_ENTROPY_LOSS_BACK": _cross_entropy_loss_back,
        "OPT_STEP_ADAMW": _opt_step_adamw,
        "OPT_STEP_SGD": _opt_step_sgd,
    }
)
