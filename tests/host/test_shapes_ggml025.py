"""The host's shape rules for what ggml 0.25 (llama.cpp's, scripts/build-llama-cpp.sh) added to
its ops and CPU kernels: SWIGLU_CLAMP, BF16 kernels of UNARY / GLU / SCALE, ROPE's offset
(op_params[15]), CONCAT by whole rows, MUL_MAT's widened F16 / BF16 src1 and F16 Hadamard rows,
the tiled matmul's packed Q8_K rows, DSV4_HC_PRE's gate and DSV4_HC_POST without comb. Each
computes through the host to ggml CPU's bytes and a lie or a graph the kernel would abort on
(or hang in) is refused by the op's rule, the host serving on.

Runs on a ggml >= 0.25 only (APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR at the llama.cpp build;
tests/llama/test_host_ggml025.py does so in CI); skipped on the default ggml 0.20."""

import numpy as np
import pytest

from apir.host.shapes import op_enums
from tests.host.shapekit import (
    Case,
    Remote,
    _in,
    _ints,
    assert_computes_like_cpu,
    assert_matches_ggml_cpu,
    ctor,
    lie_refusal,
    refusal,
)


def _f16_blocks(block_bytes, blck=32):
    """Blocks whose leading F16 scale is a small finite number (Q4_0), the rest random."""
    def make(n, rng):
        raw = rng.integers(0, 256, (n // blck, block_bytes)).astype(np.uint8)
        raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return raw.ravel()
    return make


def _bf16(n, rng):
    return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


Q4_0 = _f16_blocks(18)


def _mul_mat(ta, tb, ne_a=(64, 5, 2, 1), ne_b=(64, 3, 4, 1)):
    def build(g, ctx):
        a, b = _in(g, ctx, ta, *ne_a), _in(g, ctx, tb, *ne_b)
        return g.ggml_mul_mat(ctx, a, b), [a, b]
    return build


@pytest.fixture(autouse=True)
def _ggml025(ggml):
    if op_enums(ggml).version < (0, 25, 0):
        pytest.skip(f"ggml {ggml.version}: these rules are for ggml >= 0.25 (run under the llama.cpp build)")


def _glu(op, t, limit=None):
    def build(g, ctx):
        a, b = _in(g, ctx, t, 16, 3, 2), _in(g, ctx, t, 16, 3, 2)
        if limit is not None:
            return ctor(g, "ggml_swiglu_clamp")(ctx, a, b, limit), [a, b]
        return g.ggml_glu_split(ctx, a, b, g_glu(g, op)), [a, b]
    return build


def g_glu(g, name):
    from apir.host.shapes.base import op_enums as enums_of

    return enums_of(g).glu[name]


def _unary(fn, t):
    def build(g, ctx):
        a = _in(g, ctx, t, 10, 3, 2)
        return getattr(g, fn)(ctx, a), [a]
    return build


def _scale(t):
    def build(g, ctx):
        a = _in(g, ctx, t, 10, 3, 2)
        return g.ggml_scale(ctx, a, 0.5), [a]
    return build


def _rope(n_dims, n_offs, mode=2, ne0=16):
    """rope_ext (NEOX by default) of [ne0, 3 heads, 4 tokens] with n_dims rotated from n_offs."""
    def build(g, ctx):
        a, pos = _in(g, ctx, "F32", ne0, 3, 4), _in(g, ctx, "I32", 4)
        out = g.ggml_rope_ext(ctx, a, pos, None, n_dims, mode, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        return ctor(g, "ggml_rope_set_offset")(out, n_offs), [a, pos]
    return build


def _concat_i64(permute_a=False):
    def build(g, ctx):
        if permute_a:
            a = _in(g, ctx, "I64", 4, 3, 2)
            ap = g.ggml_permute(ctx, a, 1, 0, 2, 3)  # [3, 4, 2], nb[0] 32
        else:
            a = ap = _in(g, ctx, "I64", 3, 4, 2)
        b = _in(g, ctx, "I64", 3, 4, 1)
        return g.ggml_concat(ctx, ap, b, 2), [a, b]
    return build


def _hc_pre_gated(g, ctx):
    x, gate = _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 8, 4, 3)
    return ctor(g, "ggml_dsv4_hc_pre_gated")(ctx, x, gate, 0.5), [x, gate]


def _hc_post_no_comb(g, ctx):
    x, res, post = _in(g, ctx, "F32", 8, 3), _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 4, 3)
    return ctor(g, "ggml_dsv4_hc_post")(ctx, x, res, post, None), [x, res, post]


def _hadamard_f16(g, ctx):
    out, ins = _mul_mat("F32", "F16", ne_a=(64, 64, 1, 1), ne_b=(64, 3, 2, 1))(g, ctx)
    g.ggml_mul_mat_set_hint(out, 1)
    return out, ins


def _i64(n, rng):
    return rng.integers(-(2**40), 2**40, n).astype(np.int64)


BF16 = {0: _bf16, 1: _bf16}
CASES = [
    Case("GLU", _glu("SWIGLU_CLAMP", "F32", limit=0.7), lie=(1, 0, -1)),
    Case("GLU", _glu("SWIGLU_CLAMP", "F16", limit=0.7), lie=(0, 1, -1)),
    Case("GLU", _glu("SWIGLU", "BF16"), lie=(1, 1, -1), data=BF16),
    Case("GLU", _glu("GEGLU_QUICK", "BF16"), data=BF16),
    Case("UNARY", _unary("ggml_gelu", "BF16"), data=BF16),
    Case("UNARY", _unary("ggml_silu", "BF16"), lie=(-1, 2, -1), data=BF16),
    Case("SCALE", _scale("BF16"), data=BF16),
    Case("ROPE", _rope(8, 2)),
    Case("ROPE", _rope(4, 12, mode=0), lie=(-1, 1, -1)),
    Case("CONCAT", _concat_i64(), data={0: _i64, 1: _i64}),
    Case("MUL_MAT", _mul_mat("F32", "F16"), lie=(1, 0, -1)),
    Case("MUL_MAT", _mul_mat("F32", "BF16", ne_a=(64, 5, 1, 1), ne_b=(64, 3, 2, 2)), data={1: _bf16}),
    Case("MUL_MAT", _hadamard_f16),
    Case("DSV4_HC_PRE", _hc_pre_gated, lie=(1, 0, -1)),
    Case("DSV4_HC_POST", _hc_post_no_comb, lie=(1, 1, -1)),
]
IDS = [f"{c.op}-{i}" for i, c in enumerate(CASES)]



@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_matches_ggml_cpu(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_lying_shape_is_refused(guest, ggml, case):
    lie_refusal(guest, ggml, case)


def _refused(guest, ggml, case, message, caplog, edit=None, then=None):
    """`case` (its records edited by `edit(r, recs)`, if given) is refused by its op's rule with
    a reason containing `message`, and the host then computes the next graph: the unedited one,
    or case `then` (for a `case` ggml's constructor builds as it is refused)."""
    r = Remote(guest, ggml, case)
    try:
        recs = r.recs.copy()
        if edit is not None:
            edit(r, recs)
        got = refusal(r, recs, serves_next=then is None)
        assert got is not None and got.op == case.op, got
        assert message in str(got), str(got)
    finally:
        r.close()
    if then is not None:
        assert_computes_like_cpu(guest, ggml, then)


def _param(i, value, t=None):
    def edit(r, recs):
        recs["op_params"][r.index(r.out if t is None else t)][i] = value
    return edit


@pytest.mark.parametrize(
    "n_dims, n_offs, mode, message",
    [
        (8, 3, 2, "n_offs 3 with n_dims 8 does not fit"),  # odd: GGML_ASSERTed
        (8, 10, 2, "n_offs 10 with n_dims 8 does not fit"),  # past ne[0] 16: GGML_ASSERTed
        (8, -2, 0, "n_offs -2 with n_dims 8 does not fit"),
        (0, 4, 2, "n_dims 0 at n_offs 4"),  # the copy loop would step back forever
        (0, 0, 0, "n_dims 0 at n_offs 0"),
    ],
)
def test_rope_offset_out_of_the_row_is_refused(guest, ggml, caplog, n_dims, n_offs, mode, message):
    """rope_flt GGML_ASSERTs 0 <= n_offs, n_offs even and n_offs + n_dims <= ne[0]; its copy of
    the unrotated channels never ends with n_dims 0 at an offset inside the row."""
    def edit(r, recs):
        _param(1, n_dims)(r, recs)
        _param(15, n_offs)(r, recs)

    _refused(guest, ggml, Case("ROPE", _rope(8, 2, mode=mode)), message, caplog, edit)


def test_rope_vision_with_an_offset_is_refused(guest, ggml, caplog):
    """The vision mode (24) GGML_ASSERTs n_offs == 0 (and ggml_rope_set_offset refuses it)."""
    def build(g, ctx):
        a, pos = _in(g, ctx, "F32", 16, 3, 4), _in(g, ctx, "I32", 16)
        sections = (__import__("ctypes").c_int * 4)(2, 2, 2, 2)
        out = g.ggml_rope_multi(ctx, a, pos, None, 8, sections, 24, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        return out, [a, pos]

    case = Case("ROPE", build, data={1: _ints(100)})
    assert_computes_like_cpu(guest, ggml, case)
    _refused(guest, ggml, case, "n_offs 2 with the vision mode", caplog, _param(15, 2))


def test_swiglu_clamp_bf16_is_refused(guest, ggml, caplog):
    """SWIGLU_CLAMP's kernels are F32 and F16 (BF16 GGML_ABORTs)."""
    def edit(r, recs):
        for t in (r.out, *r.inputs):
            k = r.index(t)
            recs["type"][k] = ggml.types["BF16"]
            recs["nb"][k] = [n // 2 for n in recs["nb"][k]]

    _refused(guest, ggml, Case("GLU", _glu("SWIGLU_CLAMP", "F32", limit=0.7)), "types BF16 -> BF16", caplog, edit)


def test_scale_f16_is_refused(guest, ggml, caplog):
    """SCALE computes F32 and (ggml 0.25) BF16; F16 GGML_ABORTs."""
    def edit(r, recs):
        for t in (r.out, r.inputs[0]):
            recs["type"][r.index(t)] = ggml.types["F16"]

    _refused(guest, ggml, Case("SCALE", _scale("BF16"), data=BF16), "types F16 -> F16", caplog, edit)


def test_concat_of_rows_that_are_not_contiguous_is_refused(guest, ggml, caplog):
    """ggml 0.25's concat_any (I64 here) GGML_ASSERTs both sources' rows contiguous (0.20's
    walked elements): a permuted src0 would abort the host."""
    case = Case("CONCAT", _concat_i64(permute_a=True), data={0: _i64, 1: _i64})
    ok = Case("CONCAT", _concat_i64(), data={0: _i64, 1: _i64})
    _refused(guest, ggml, case, "sources' rows are not contiguous", caplog, then=ok)


def test_mul_mat_widening_needs_an_f32_dot_type(guest, ggml, caplog):
    """The widening of F16 / BF16 src1 is for src0 whose vec_dot_type is F32 (GGML_ASSERTed):
    BF16 src1 with Q4_0 src0 (dot type Q8_0) is refused."""
    def edit(r, recs):
        i = r.index(r.inputs[1])
        recs["type"][i] = ggml.types["BF16"]
        recs["nb"][i] = [n // 2 for n in recs["nb"][i]]

    case = Case("MUL_MAT", _mul_mat("Q4_0", "F32"), data={0: Q4_0})
    _refused(guest, ggml, case, "src1 BF16 is neither F32 nor Q8_0", caplog, edit)


def test_mul_mat_q8_k_rows_not_packed_are_refused(guest, ggml, caplog):
    """The tiled matmul reads Q8_K src1 rows as r * nb[1] over all rows: a permuted Q8_K src1
    (batches not at ne[1] * nb[1]) would be read past its extent."""
    def build(g, ctx):
        a = _in(g, ctx, "Q4_K", 256, 4, 2)
        b = _in(g, ctx, "Q8_K", 256, 2, 8)
        return g.ggml_mul_mat(ctx, a, g.ggml_permute(ctx, b, 0, 2, 1, 3)), [a, b]

    zeros = {0: lambda n, rng: np.zeros(n // 256 * 144, np.uint8), 1: lambda n, rng: np.zeros(n // 256 * 292, np.uint8)}
    _refused(guest, ggml, Case("MUL_MAT", build, data=zeros), "src1 Q8_K rows are not packed", caplog,
             then=CASES[IDS.index("MUL_MAT-10")])


def test_hc_pre_gate_of_the_weights_shape_is_refused(guest, ggml, caplog):
    """Gated (op_params[1] = 1), the second source is read as [n_embd, hc, n_tokens]: a gate of
    the ungated weights' shape [hc, n_tokens] is refused."""
    def build(g, ctx):
        x, w = _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 4, 3)
        return ctor(g, "ggml_dsv4_hc_pre")(ctx, x, w), [x, w]

    case = Case("DSV4_HC_PRE", build)
    assert_computes_like_cpu(guest, ggml, case)
    _refused(guest, ggml, case, "x [8, 4, 3, 1] and gate [4, 3, 1, 1] do not fit", caplog, _param(1, 1))
