"""apir.host.graph.shapes.elementwise: the element-wise ops (unary math, UNARY, GLU, ADD / SUB / MUL /
DIV / ADD1 with broadcast, casts and quantized rows, SCALE, CLAMP, LEAKY_RELU), the norms
(NORM, RMS_NORM, L2_NORM, GROUP_NORM), SOFT_MAX and DIAG_MASK_INF / _ZERO, in the forms
test-backend-ops builds (permuted, in place, views with gaps). Each case, built with ggml's own
constructor, computes through the host to ggml CPU's own bytes; a lying shape, type or
op_param is refused by that op's rule (asserted on the refusal's node, op, rule and reason),
and the host serves on. Inputs that would hang or abort a host without the rule run in a
child process (tests/host/childkit.py)."""

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host.graph.shapes import base, op_enums
from tests.host.childkit import refusal_in_child
from apir.ggml.features import Feature
from tests.host.shapekit import (
    edited_refusal,
    Case,
    Remote,
    _in,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    ctor,
    g_nb,
    info,
    infos_check,
    lie_refusal,
    refusal,
    with_op_params,
)

INT32_MAX = 2**31 - 1


def _one(fn, ne=(8, 3, 2)):
    """A case of one F32 source of `ne` through `fn(g, ctx, a)`."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", *ne)
        return fn(g, ctx, a), [a]
    return build


def _two(fn, ne_b=(8, 3, 2), type_name="F32"):
    def build(g, ctx):
        a, b = _in(g, ctx, type_name, 8, 3, 2), _in(g, ctx, type_name, *ne_b)
        return fn(g, ctx, a, b), [a, b]
    return build


def _glu(name, split=False, swapped=False):
    def build(g, ctx):
        op = op_enums(g).glu[name]
        a = _in(g, ctx, "F32", 8, 3)
        if split:
            b = _in(g, ctx, "F32", 8, 3)
            return g.ggml_glu_split(ctx, a, b, op), [a, b]
        return g.ggml_glu(ctx, a, op, swapped), [a]
    return build


def _sinks(g, ctx):
    a, mask, sinks = _in(g, ctx, "F32", 6, 4, 3), _in(g, ctx, "F16", 6, 4), _in(g, ctx, "F32", 3)
    out = g.ggml_soft_max_ext(ctx, a, mask, 0.5, 0.0)
    g.ggml_soft_max_add_sinks(out, sinks)
    return out, [a, mask, sinks]


def _permuted(g, ctx, type_name, *ne):
    """An input of ne (8, 3, 2) permuted (1, 2, 0, 3) to [2, 8, 3]: nb[0] is not the element size."""
    t = _in(g, ctx, type_name, *ne)
    return t, g.ggml_permute(ctx, t, 1, 2, 0, 3)


def _bin_permuted(name):
    """src1 permuted (test-backend-ops' perm1=1): read at i10 * nb10."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 2, 8, 3)
        b, bp = _permuted(g, ctx, "F32", 8, 3, 2)
        return getattr(g, name)(ctx, a, bp), [a, b]
    return build


def _gelu_of_view(g, ctx):
    """A unary op on a view with gaps between rows (test-backend-ops' v=1)."""
    a = _in(g, ctx, "F32", 12, 6, 2)
    v = g.ggml_view_3d(ctx, a, 8, 3, 2, g_nb(g, a, 1), g_nb(g, a, 2), 0)
    return g.ggml_gelu(ctx, v), [a]


def _bf16(n, rng):
    """BF16 bits of standard normal values (the top half of their F32 bits)."""
    return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _unary_op(name, type_name="F32", inplace_permuted=False):
    """ggml_unary(name) of [8, 3, 2]; or in place into src0 permuted (0, 2, 1, 3): the result
    is a view whose rows are not in order (test-backend-ops' in-place / permuted cases)."""
    def build(g, ctx):
        op = op_enums(g).unary[name]
        a = _in(g, ctx, type_name, 8, 3, 2)
        if inplace_permuted:
            return ctor(g, "ggml_unary_inplace")(ctx, g.ggml_permute(ctx, a, 0, 2, 1, 3), op), [a]
        return ctor(g, "ggml_unary")(ctx, a, op), [a]
    return build


def _xielu_of_view(g, ctx):
    """XIELU of a view with gaps between rows (ggml_is_contiguous_1 still holds)."""
    a = _in(g, ctx, "F32", 10, 3, 2)
    v = g.ggml_view_3d(ctx, a, 8, 3, 2, g_nb(g, a, 1), g_nb(g, a, 2), 0)
    return ctor(g, "ggml_xielu")(ctx, v, 4.0, 20.0, 0.5, 1e-7), [a]


def _binary_inplace_permuted(name):
    """src0 permuted (0, 2, 1, 3), the op in place into it, src1 broadcast along dim 1."""
    def build(g, ctx):
        a, b = _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "F32", 8, 1, 3)
        return ctor(g, name)(ctx, g.ggml_permute(ctx, a, 0, 2, 1, 3), b), [a, b]
    return build


def _add_cast(type_name):
    """ggml_add_cast: F16 / BF16 src0 plus F32 src1 into an F32 result."""
    def build(g, ctx):
        a, b = _in(g, ctx, type_name, 8, 3, 2), _in(g, ctx, "F32", 8, 3, 1)
        return ctor(g, "ggml_add_cast")(ctx, a, b, g.types["F32"]), [a, b]
    return build


def _q8_0_blocks(n, rng):
    """Valid Q8_0 blocks for n elements: an F16 scale in [0.01, 0.1) and 32 int8 quants each."""
    blocks = np.zeros((n // 32, 34), np.uint8)
    blocks[:, :2] = rng.uniform(0.01, 0.1, (n // 32, 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, (n // 32, 32)).astype(np.int8).view(np.uint8)
    return blocks.reshape(-1)


def _add_quantized(result_type=None):
    """ggml_add of a Q8_0 src0 and an F32 src1 of its shape (a Q8_0 result), or ggml_add_cast
    into `result_type`: the CPU's add_q_f32."""
    def build(g, ctx):
        a, b = _in(g, ctx, "Q8_0", 64, 3, 2), _in(g, ctx, "F32", 64, 3, 2)
        if result_type is None:
            return g.ggml_add(ctx, a, b), [a, b]
        return ctor(g, "ggml_add_cast")(ctx, a, b, g.types[result_type]), [a, b]
    return build


def _group_norm_4k(g, ctx):
    """4 channels, 256 in ne[3]: a 4 KiB tensor."""
    a = _in(g, ctx, "F32", 1, 1, 4, 256)
    return g.ggml_group_norm(ctx, a, 2, 1e-6), [a]


def _diag_mask_zero_2(g, ctx):
    """Two 8 x 3 matrices in ne[2]."""
    a = _in(g, ctx, "F32", 8, 3, 2)
    return g.ggml_diag_mask_zero(ctx, a, 1), [a]


# Cases a child process builds (module level: the child imports them by name)
GROUP_NORM_4K = Case("GROUP_NORM", _group_norm_4k, name="4k")
DIAG_MASK_ZERO_2 = Case("DIAG_MASK_ZERO", _diag_mask_zero_2, name="two-matrices")

L2_NORM = Case("L2_NORM", _one(lambda g, c, a: g.ggml_l2_norm(c, a, 1e-6)), name="f32")
GROUP_NORM = Case("GROUP_NORM", _one(lambda g, c, a: g.ggml_group_norm(c, a, 2, 1e-6)), lie=(-1, 1, -1),
                  name="2-groups")
DIAG_MASK_INF = Case("DIAG_MASK_INF", _one(lambda g, c, a: g.ggml_diag_mask_inf(c, a, 2)), name="n_past-2")
GLU_SWIGLU = Case("GLU", _glu("SWIGLU"), name="swiglu")
ADD_CAST_F16 = Case("ADD", _add_cast("F16"), name="cast-f16-f32")

# ggml >= 0.20 (the default ggml here): norms of strided rows (0.10's kernels assume packed rows)
STRIDED_NORMS = [
    Case("L2_NORM", _one(lambda g, c, a: g.ggml_l2_norm(c, g.ggml_permute(c, a, 1, 0, 2, 3), 1e-6)),
         name="permuted"),
    Case("NORM", _one(lambda g, c, a: g.ggml_norm(c, g.ggml_permute(c, a, 1, 0, 2, 3), 1e-6)), name="permuted"),
]

CASES = [
    Case("SQR", _one(lambda g, c, a: g.ggml_sqr(c, a)), name="f32"),
    Case("SQRT", _one(lambda g, c, a: g.ggml_sqrt(c, a)), data={0: lambda n, r: r.random(n).astype(np.float32)},
         name="f32"),
    Case("LOG", _one(lambda g, c, a: g.ggml_log(c, a)), data={0: lambda n, r: r.random(n).astype(np.float32) + 0.1},
         name="f32"),
    Case("SIN", _one(lambda g, c, a: g.ggml_sin(c, a)), name="f32"),
    Case("COS", _one(lambda g, c, a: g.ggml_cos(c, a)), name="f32"),
    Case("CLAMP", _one(lambda g, c, a: g.ggml_clamp(c, a, -0.5, 0.5)), name="f32"),
    Case("LEAKY_RELU", _one(lambda g, c, a: g.ggml_leaky_relu(c, a, 0.1, False)), name="f32"),
    L2_NORM,
    GROUP_NORM,
    Case("ADD1", _two(lambda g, c, a, b: g.ggml_add1(c, a, b), ne_b=(1,)), name="scalar"),
    DIAG_MASK_INF,
    Case("DIAG_MASK_ZERO", _one(lambda g, c, a: g.ggml_diag_mask_zero(c, a, 1)), name="n_past-1"),
    Case("SOFT_MAX", _sinks, lie=(2, 0, -1), name="mask-sinks"),
    GLU_SWIGLU,
    Case("GLU", _glu("GEGLU", swapped=True), name="geglu-swapped"),
    Case("GLU", _glu("REGLU", split=True), lie=(1, 1, -1), name="reglu-split"),
    Case("ADD", _bin_permuted("ggml_add"), name="src1-permuted"),
    Case("MUL", _bin_permuted("ggml_mul"), name="src1-permuted"),
    Case("UNARY", _gelu_of_view, name="gelu-of-view"),
    *STRIDED_NORMS,
    Case("UNARY", _unary_op("EXP", "BF16"), data={0: _bf16}, name="exp-bf16"),
    Case("UNARY", _unary_op("FLOOR", "BF16"), lie=(0, 1, -1), data={0: _bf16}, name="floor-bf16"),
    Case("UNARY", _unary_op("ABS", inplace_permuted=True), lie=(-1, 2, -1), name="abs-inplace-permuted"),
    Case("UNARY", _unary_op("GELU", "F16", inplace_permuted=True), name="gelu-f16-inplace-permuted"),
    Case("UNARY", _xielu_of_view, name="xielu-of-view"),
    Case("ADD", _binary_inplace_permuted("ggml_add_inplace"), lie=(1, 2, -1), name="inplace-permuted-broadcast"),
    Case("MUL", _binary_inplace_permuted("ggml_mul_inplace"), name="inplace-permuted-broadcast"),
    ADD_CAST_F16,
    Case("ADD", _add_cast("BF16"), lie=(1, 0, -1), data={0: _bf16}, name="cast-bf16-f32"),
    Case("ADD", _add_quantized(), lie=(1, 1, -1), data={0: _q8_0_blocks}, name="q8_0"),
    Case("ADD", _add_quantized("F32"), lie=(-1, 2, -1), data={0: _q8_0_blocks}, name="cast-q8_0-f32"),
    Case("ADD", _add_quantized("F16"), data={0: _q8_0_blocks}, name="cast-q8_0-f16"),
    # ops the coverage check (test_checked_ops.py) found without a case here
    Case("SUB", _two(lambda g, c, a, b: g.ggml_sub(c, a, b)), name="f32"),
    Case("DIV", _two(lambda g, c, a, b: g.ggml_div(c, a, b)), data={1: lambda n, r: r.random(n).astype(np.float32) + 0.5},
         name="f32"),
    Case("SCALE", _one(lambda g, c, a: g.ggml_scale(c, a, 0.5)), name="0.5"),
    Case("RMS_NORM", _one(lambda g, c, a: g.ggml_rms_norm(c, a, 1e-6)), name="f32"),
    # (on ggml 0.10, where the strided NORM case is skipped, the check found NORM without one)
    Case("NORM", _one(lambda g, c, a: g.ggml_norm(c, a, 1e-6)), name="f32"),
]


def _too_old(g, case):
    if case in STRIDED_NORMS and op_enums(g).version < (0, 20, 0):
        return "ggml 0.10's norms take packed rows only (the host refuses strided ones there)"
    return None


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    if _too_old(ggml, case):
        pytest.skip(_too_old(ggml, case))
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    if _too_old(ggml, case):
        pytest.skip(_too_old(ggml, case))
    lie_refusal(guest, ggml, case)


@pytest.mark.parametrize("case,slot,value,reason", [
    pytest.param(L2_NORM, 0, np.float32(np.nan), "eps nan is not >= 0", id="L2_NORM-eps-nan"),
    pytest.param(L2_NORM, 0, np.float32(-1.0), "eps -1.0 is not >= 0", id="L2_NORM-eps-negative"),
    pytest.param(GROUP_NORM, 0, 0, "n_groups 0 is not in", id="GROUP_NORM-n_groups-0"),
    pytest.param(DIAG_MASK_INF, 0, -1, "n_past -1 < 0", id="DIAG_MASK_INF-n_past-negative"),
    pytest.param(GLU_SWIGLU, 0, 99, "glu op 99 out of range", id="GLU-op-99"),
])
def test_bad_op_params_are_refused(guest, ggml, case, slot, value, reason):
    """op_params a kernel GGML_ASSERTs or aborts on (eps >= 0, group count, n_past >= 0, glu op)."""
    r = Remote(guest, ggml, case)
    assert_refused_by_rule(refusal(r, with_op_params(r, slot, value)), case.op, r.index(r.out), reason)
    r.close()


@pytest.mark.parametrize("n_groups", [pytest.param(INT32_MAX, id="GROUP_NORM-n_groups-int-max"),
                                      pytest.param(5, id="GROUP_NORM-n_groups-past-channels")])
def test_group_norm_group_count_is_bounded(ggml, n_groups):
    """(ne[2] + n_groups - 1) / n_groups in C int: INT32_MAX wraps and the kernel loops 2^31
    groups per ne[3] (a hang); more groups than the 4 channels is refused too (in a child
    process: a regression hangs that host)."""
    got, node = refusal_in_child((__name__, "GROUP_NORM_4K"), [(-1, "op_params", 0, n_groups, np.int32)])
    assert_refused_by_rule(got, "GROUP_NORM", node, f"n_groups {n_groups} is not in [1, 4 channels]")


def test_diag_mask_matrices_not_packed_are_refused(ggml):
    """Found by the fuzz campaign (tests/fuzz/reproducers/diag_mask_zero-sigsegv-*.json):
    source and result laid out [8, 3, 1, 2] with nb [4, 32, 192, 96] are contiguous for
    ggml_is_contiguous (a dimension of 1 has any stride) and fit their extents, but
    ggml_compute_forward_diag_mask_f32 walks the ne[2]*ne[3] matrices as k * nb[2]: the
    second one written 96 bytes past the result (past the buffer, in the campaign). In a
    child process: a regression crashes that host."""
    edits = [(w, f, i, v, np.int64) for w in (0, -1) for f, i, v in
             (("ne", 2, 1), ("ne", 3, 2), ("nb", 2, 192), ("nb", 3, 96))]
    got, node = refusal_in_child((__name__, "DIAG_MASK_ZERO_2"), edits)
    assert_refused_by_rule(got, "DIAG_MASK_ZERO", node, "nb[2] 192 is not the 96-byte matrix")


def test_soft_max_empty_sinks_are_refused(guest, ggml):
    """sinks [ne[2], 0]: the kernel still reads sinks[i02]; refused before
    the rule, by the empty-source check."""
    r = Remote(guest, ggml, Case("SOFT_MAX", _sinks))
    recs = r.recs.copy()
    recs["ne"][r.index(r.inputs[2])][1] = 0
    assert_refused_by_rule(refusal(r, recs), "SOFT_MAX", r.index(r.out), "src2 [3, 0, 1, 1] has no elements",
                           rule=base.check_empty_sources)
    r.close()


def _refused_as_built(guest, ggml, case, reason):
    """`case`, as ggml builds it, refused by its op's rule; the host serves on."""
    r = Remote(guest, ggml, case)
    got = refusal(r, serves_next=False)
    assert_refused_by_rule(got, case.op, r.index(r.out))
    assert reason in got.reason, got.reason
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0  # the host serves on
    r.close()


def test_xielu_with_gaps_between_planes_is_refused(guest, ggml):
    """ggml_xielu asserts nothing, but its kernel GGML_ASSERTs ggml_is_contiguous_1: a view
    with a gap between its planes (nb[2] > ne[1] * nb[1]) would abort the host."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 8, 4, 2)
        v = g.ggml_view_3d(ctx, a, 8, 3, 2, g_nb(g, a, 1), g_nb(g, a, 2), 0)
        return ctor(g, "ggml_xielu")(ctx, v, 4.0, 20.0, 0.5, 1e-7), [a]
    _refused_as_built(guest, ggml, Case("UNARY", build), "rows packed")


@pytest.mark.parametrize("name", ["GELU", "GELU_ERF", "GELU_QUICK", "SILU"], ids=lambda n: f"UNARY-{n.lower()}-bf16")
def test_bf16_gelu_is_refused(guest, ggml, name):
    """ggml_unary builds any type, but GELU & co. have F32 and F16 kernels only (BF16 aborts)
    before ggml 0.25 (Feature.BF16_KERNELS; CASES_025 computes them there)."""
    if Feature.BF16_KERNELS in ggml.features:
        pytest.skip(f"ggml {ggml.version} has BF16 kernels of {name}")
    _refused_as_built(guest, ggml, Case("UNARY", _unary_op(name, "BF16"), data={0: _bf16}), "of BF16")


def test_mul_cast_is_refused(guest, ggml):
    """Only ggml_add_cast makes an F32 result of an F16 src0 (binary_op would compute it, but
    no constructor builds such a MUL): the same node as a MUL is refused."""
    r = Remote(guest, ggml, ADD_CAST_F16)
    recs = r.recs.copy()
    recs["op"][r.index(r.out)] = ggml.ops["MUL"]
    assert_refused_by_rule(refusal(r, recs), "MUL", r.index(r.out), "types F16, F32 -> F32")
    r.close()


def test_add_into_a_type_without_from_float_is_refused(guest, ggml):
    """ADD of a quantized src0 whose type the CPU cannot quantize into (IQ2_XXS has no
    from_float): add_q_f32 would memcpy ne0 * nb0 bytes, 256 blocks, into each row of one."""
    def build(g, ctx):
        a, b = _in(g, ctx, "IQ2_XXS", 256, 2), _in(g, ctx, "F32", 256, 2)
        return g.ggml_add(ctx, a, b), [a, b]
    zero = {0: lambda n, rng: np.zeros(n // 256 * 66, np.uint8)}
    _refused_as_built(guest, ggml, Case("ADD", build, data=zero), "cannot convert F32 rows into IQ2_XXS")


def test_rows_past_int_are_refused(ggml):
    """ggml-cpu's kernels count rows in `int` (`const int nr = ggml_nrows(src0)`): 2^31 rows
    of one float (8 GiB) would wrap. The same node with 2^30 rows is accepted (shown on the
    rules: the tensors are gigabytes)."""
    a = info(0, "F32", [1, 2**31, 1, 1])
    node = info(1, "F32", [1, 2**31, 1, 1], op="SQR")
    assert_refused_by_rule(infos_check(ggml, node, [a]), "SQR", 1,
                           "tensor 1 [1, 2147483648, 1, 1] is too large for the kernel's int counts",
                           rule=base.int_counted)
    a = info(0, "F32", [1, 2**30, 1, 1])
    node = info(1, "F32", [1, 2**30, 1, 1], op="SQR")
    assert infos_check(ggml, node, [a]) is None


# ggml >= 0.25 (llama.cpp's build; tests/llama/test_host_ggml025.py runs this folder on it):
# SWIGLU_CLAMP, and the BF16 kernels of UNARY / GLU / SCALE (Feature.BF16_KERNELS).
def _glu_025(name, type_name, limit=None):
    def build(g, ctx):
        a, b = _in(g, ctx, type_name, 16, 3, 2), _in(g, ctx, type_name, 16, 3, 2)
        if limit is not None:
            return ctor(g, "ggml_swiglu_clamp")(ctx, a, b, limit), [a, b]
        return g.ggml_glu_split(ctx, a, b, op_enums(g).glu[name]), [a, b]
    return build


def _of_10x3x2(fn, type_name, *args):
    def build(g, ctx):
        a = _in(g, ctx, type_name, 10, 3, 2)
        return getattr(g, fn)(ctx, a, *args), [a]
    return build


_BF16_2 = {0: _bf16, 1: _bf16}
SWIGLU_CLAMP = Case("GLU", _glu_025("SWIGLU_CLAMP", "F32", limit=0.7), lie=(1, 0, -1), name="swiglu-clamp-f32")
SCALE_BF16 = Case("SCALE", _of_10x3x2("ggml_scale", "BF16", 0.5), data={0: _bf16}, name="bf16",
                  feature=Feature.BF16_KERNELS)
CASES_025 = [
    SWIGLU_CLAMP,
    Case("GLU", _glu_025("SWIGLU_CLAMP", "F16", limit=0.7), lie=(0, 1, -1), name="swiglu-clamp-f16"),
    Case("GLU", _glu_025("SWIGLU", "BF16"), lie=(1, 1, -1), data=_BF16_2, name="swiglu-bf16",
         feature=Feature.BF16_KERNELS),
    Case("GLU", _glu_025("GEGLU_QUICK", "BF16"), data=_BF16_2, name="geglu-quick-bf16", feature=Feature.BF16_KERNELS),
    Case("UNARY", _of_10x3x2("ggml_gelu", "BF16"), data={0: _bf16}, name="gelu-bf16", feature=Feature.BF16_KERNELS),
    Case("UNARY", _of_10x3x2("ggml_silu", "BF16"), lie=(-1, 2, -1), data={0: _bf16}, name="silu-bf16",
         feature=Feature.BF16_KERNELS),
    SCALE_BF16,
]


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_op_matches_ggml_cpu_025(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_lying_shape_is_refused_025(guest, ggml, case):
    lie_refusal(guest, ggml, case)


def _as_type(ggml, type_name, which, halve_nb=False):
    """An `edited_refusal` edit: the records of `which(r)` (tensors) made `type_name`."""
    def edit(r, recs):
        for t in which(r):
            k = r.index(t)
            recs["type"][k] = ggml.types[type_name]
            if halve_nb:
                recs["nb"][k] = [n // 2 for n in recs["nb"][k]]
    return edit


def test_swiglu_clamp_bf16_is_refused(guest, ggml):
    """SWIGLU_CLAMP's kernels are F32 and F16 (BF16 GGML_ABORTs)."""
    edit = _as_type(ggml, "BF16", lambda r: (r.out, *r.inputs), halve_nb=True)
    edited_refusal(guest, ggml, SWIGLU_CLAMP, "types BF16 -> BF16", edit)


def test_scale_f16_is_refused(guest, ggml):
    """SCALE computes F32 and (ggml 0.25) BF16; F16 GGML_ABORTs."""
    edited_refusal(guest, ggml, SCALE_BF16, "types F16 -> F16", _as_type(ggml, "F16", lambda r: (r.out, r.inputs[0])))
