"""apir.host.graph.shapes.layout: the ops that move, copy or reduce elements without arithmetic on
them (CPY, CONT, DUP, CONCAT, PAD, REPEAT[_BACK], the views NONE / VIEW / RESHAPE / PERMUTE /
TRANSPOSE), the reductions and index ops (SUM, SUM_ROWS, MEAN, ARGMAX, COUNT_EQUAL, ARGSORT,
TOP_K) and the generators (ARANGE, TIMESTEP_EMBEDDING), in the forms test-backend-ops builds
(permuted, views with gaps, quantized rows). Each case, built with ggml's own constructor,
computes through the host to ggml CPU's own bytes; a lying shape, type or op_param is refused
by that op's rule (asserted on the refusal's node, op, rule and reason), and the host serves
on."""

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
    _direct,
    _in,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    g_nb,
    info,
    infos_check,
    lie_refusal,
    random_blocks,
    refusal,
    with_op_params,
    zero_blocks,
)


def _one(fn):
    """A case of one F32 [8, 3, 2] source through `fn(g, ctx, a)`."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 8, 3, 2)
        return fn(g, ctx, a), [a]
    return build


def _two(fn, ne_b=(8, 3, 2), type_name="F32"):
    def build(g, ctx):
        a, b = _in(g, ctx, type_name, 8, 3, 2), _in(g, ctx, type_name, *ne_b)
        return fn(g, ctx, a, b), [a, b]
    return build


def _cpy_permuted_to(type_name):
    """F32 source permuted (0, 2, 1, 3) (rows still of elements) into a quantized tensor."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 64, 3, 2)
        dst = _in(g, ctx, type_name, 64, 2, 3)
        return g.ggml_cpy(ctx, g.ggml_permute(ctx, a, 0, 2, 1, 3), dst), [a, dst]
    return build


def _cpy_quantized_to_f32(g, ctx):
    """Q8_0 blocks dequantized into an F32 tensor of another shape (dup_from_q)."""
    a, dst = _in(g, ctx, "Q8_0", 64, 3), _in(g, ctx, "F32", 32, 6)
    return g.ggml_cpy(ctx, a, dst), [a, dst]


def _cont_of_view(type_name):
    """CONT of a column slice (rows with gaps): a same-type copy (dup_bytes)."""
    def build(g, ctx):
        a = _in(g, ctx, type_name, 12, 5, 2)
        v = g.ggml_view_3d(ctx, a, 7, 5, 2, g_nb(g, a, 1), g_nb(g, a, 2), 2 * g_nb(g, a, 0))
        return g.ggml_cont(ctx, v), [a]
    return build


def _cpy(t_src, t_dst, perm=(0, 1, 2, 3), dst_perm=None, ne=(64, 2, 3, 1)):
    """test-backend-ops' cpy: src made so that its permutation has shape ne; dst of shape ne,
    or made so that its permutation dst_perm has shape ne (a non-contiguous result)."""
    def made(g, ctx, type_name, p):
        inv = [0] * 4
        for i, j in enumerate(p):
            inv[j] = i
        t = _in(g, ctx, type_name, *(ne[inv[k]] for k in range(4)))
        return t, g.ggml_permute(ctx, t, *p)

    def build(g, ctx):
        src, sp = made(g, ctx, t_src, perm)
        if dst_perm is None:
            dst = dp = _in(g, ctx, t_dst, *ne)
        else:
            dst, dp = made(g, ctx, t_dst, dst_perm)
        return g.ggml_cpy(ctx, sp, dp), [src, dst]
    return build


def _f16_blocks(block_bytes, blck=32):
    """Blocks whose leading F16 scale is a small finite number (Q8_0, Q4_0), the rest random."""
    def make(n, rng):
        raw = rng.integers(0, 256, (n // blck, block_bytes)).astype(np.uint8)
        raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return raw.ravel()
    return make


def _bf16(n, rng):
    return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


Q8_0, Q4_0 = _f16_blocks(34), _f16_blocks(18)


def _timestep_embedding(g, c):
    t = _in(g, c, "F32", 5)
    return g.ggml_timestep_embedding(c, t, 7, 1000), [t]


def _cont_f32(g, ctx):
    a = _in(g, ctx, "F32", 64, 2)
    return g.ggml_cont(ctx, a), [a]


def _param_leaf(g, ctx):
    """A parameter: a tensor of op NONE that ggml_build_forward_expand makes a graph node (not
    a leaf), computed as nothing."""
    a = _in(g, ctx, "F32", 8, 3, 2)
    g.ggml_set_param(a)
    return a, [a]


# The views: graph nodes whose data lies in their source (graph.py checks it there); their
# rule only asks for the source (a lie about ne is the extent checks' to refuse).
VIEWS = [
    Case("VIEW", _one(lambda g, c, a: g.ggml_view_2d(c, a, 4, 5, g_nb(g, a, 1), 2 * g_nb(g, a, 0))), lie=None,
         name="2d-columns"),
    Case("PERMUTE", _one(lambda g, c, a: g.ggml_permute(c, a, 2, 0, 1, 3)), lie=None, name="2-0-1"),
    Case("TRANSPOSE", _one(lambda g, c, a: g.ggml_transpose(c, a)), lie=None, name="f32"),
]


# A case a child process builds (module level: the child imports it by name)
CONT_F32 = Case("CONT", _cont_f32, name="f32")

ARGSORT = Case("ARGSORT", _one(lambda g, c, a: g.ggml_argsort(c, a, 1)), name="desc")
CONCAT = Case("CONCAT", _two(lambda g, c, a, b: g.ggml_concat(c, a, b, 1), ne_b=(8, 5, 2)), lie=(-1, 1, -1),
              name="dim1")
PAD = Case("PAD", _one(lambda g, c, a: g.ggml_pad_ext(c, a, 1, 2, 0, 1, 2, 0, 0, 1)), name="ext")

CASES = [
    Case("SUM", _one(lambda g, c, a: g.ggml_sum(c, a)), name="f32"),
    Case("SUM_ROWS", _one(lambda g, c, a: g.ggml_sum_rows(c, a)), lie=(-1, 1, -1), name="f32"),
    Case("MEAN", _one(lambda g, c, a: g.ggml_mean(c, a)), lie=(-1, 2, -1), name="f32"),
    Case("ARGMAX", lambda g, c: (lambda a: (g.ggml_argmax(c, a), [a]))(_in(g, c, "F32", 8, 5)), name="f32"),
    Case("COUNT_EQUAL", lambda g, c: (lambda a, b: (g.ggml_count_equal(c, a, b), [a, b]))(
        _in(g, c, "I32", 50, 4), _in(g, c, "I32", 50, 4)), lie=(1, 0, -1),
        data={0: lambda n, r: r.integers(0, 3, n).astype(np.int32), 1: lambda n, r: r.integers(0, 3, n).astype(np.int32)},
        name="i32"),
    Case("REPEAT", _two(lambda g, c, a, b: g.ggml_repeat(c, b, a), ne_b=(4, 1, 2)), name="f32"),
    Case("REPEAT_BACK", _two(lambda g, c, a, b: g.ggml_repeat_back(c, a, b), ne_b=(4, 3, 1)), name="f32"),
    CONCAT,
    Case("CONCAT", _two(lambda g, c, a, b: g.ggml_concat(c, a, b, 0), ne_b=(3, 3, 2), type_name="F16"),
         name="dim0-f16"),
    PAD,
    Case("ARANGE", lambda g, c: (g.ggml_arange(c, 1.5, 9.0, 0.75), []), name="f32"),
    Case("TIMESTEP_EMBEDDING", _timestep_embedding, name="dim7"),
    ARGSORT,
    Case("TOP_K", _one(lambda g, c, a: g.ggml_top_k(c, a, 3)), lie=(-1, 1, -1), name="k3"),
    Case("CPY", _cpy_permuted_to("Q8_0"), lie=(-1, 1, -1), data={1: zero_blocks(34)}, name="f32-permuted-to-q8_0"),
    Case("CPY", _cpy_permuted_to("Q5_1"), lie=(-1, 2, -1), data={1: zero_blocks(24)}, name="f32-permuted-to-q5_1"),
    Case("CPY", _cpy_quantized_to_f32, lie=(-1, 1, -1), data={0: random_blocks(34), 1: zero_blocks(4, 1)},
         name="q8_0-to-f32-reshaped"),
    Case("CONT", _cont_of_view("I32"), lie=(-1, 1, -1), data={0: lambda n, r: r.integers(-9, 9, n).astype(np.int32)},
         name="i32-of-view"),
    Case("CONT", _cont_of_view("F16"), name="f16-of-view"),
    Case("SUM", _one(lambda g, c, a: g.ggml_sum(c, g.ggml_permute(c, a, 1, 0, 2, 3))), name="permuted"),
    # CPY / CONT in test-backend-ops' layouts
    Case("CPY", _cpy("F16", "BF16", (1, 0, 2, 3)), lie=(-1, 1, -1), data={1: _bf16}, name="f16-transposed-to-bf16"),
    Case("CPY", _cpy("F32", "I32", (0, 2, 1, 3)),
         data={0: lambda n, r: r.integers(-99, 99, n).astype(np.float32)}, name="f32-permuted-to-i32"),
    Case("CPY", _cpy("Q4_0", "Q4_0", (0, 2, 1, 3), dst_perm=(0, 2, 1, 3)), lie=(-1, 1, -1),
         data={0: Q4_0, 1: Q4_0}, name="q4_0-permuted-both"),
    Case("CPY", _cpy("Q4_0", "F32"), data={0: Q4_0}, name="q4_0-to-f32"),
    Case("CPY", _cpy("BF16", "Q8_0"), lie=(-1, 1, -1), data={0: _bf16, 1: Q8_0}, name="bf16-to-q8_0"),
    Case("CONT", lambda g, c: (lambda a: (g.ggml_cont(c, g.ggml_transpose(c, a)), [a]))(_in(g, c, "BF16", 8, 6)),
         data={0: _bf16}, name="bf16-transposed"),
    # ops the coverage check (test_checked_ops.py) found without a case here
    Case("DUP", _one(lambda g, c, a: g.ggml_dup(c, a)), name="f32"),
    Case("RESHAPE", _one(lambda g, c, a: g.ggml_reshape_2d(c, a, 24, 2)), name="to-2d"),
    *VIEWS,
    Case("NONE", _param_leaf, lie=None, name="param"),
]
LIES = [c for c in CASES if c.lie is not None]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", LIES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    lie_refusal(guest, ggml, case)


@pytest.mark.parametrize("case", VIEWS, ids=case_id)
def test_view_without_its_source_is_refused(guest, ggml, case):
    """A view node whose src[0] is missing: its rule wants the source it views."""
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    recs["src"][r.index(r.out)][0] = 0
    assert_refused_by_rule(refusal(r, recs), case.op, r.index(r.out), "needs 1 sources")
    r.close()


def test_a_param_node_is_computed_as_nothing_whatever_its_shape(guest, ggml):
    """NONE's rule checks nothing (it is the one checked op with no refused case, named in
    test_checked_ops.py): a parameter node is not computed, and its ne and nb are the tensor
    checks' (extent within its buffer) like a leaf's. A lie that stays inside the buffer is
    accepted; one past it is refused by the tensor checks, not by a rule."""
    r = Remote(guest, ggml, CASES[-1])
    recs = r.recs.copy()
    recs["ne"][r.index(r.out)][0] = 7
    rc, dec = r.compute(recs)
    assert rc == 0 and dec.i32() == 0
    recs["ne"][r.index(r.out)][0] = 9
    got = refusal(r, recs)
    assert got.rule is None, got.rule  # not a shape rule: the tensor checks
    r.close()


@pytest.mark.parametrize("case,slot,value", [
    pytest.param(ARGSORT, 0, 2, id="ARGSORT-order-2"),
    pytest.param(CONCAT, 0, 4, id="CONCAT-dim-4"),
    pytest.param(PAD, 1, -1, id="PAD-negative"),  # would walk the kernel off its tensors
])
def test_bad_op_params_are_refused(guest, ggml, case, slot, value):
    """op_params a kernel aborts on (sort order, dim) or that would walk it off its tensors."""
    r = Remote(guest, ggml, case)
    assert_refused_by_rule(refusal(r, with_op_params(r, slot, value)), case.op, r.index(r.out))
    r.close()


def _refused_as_built(guest, ggml, case, reason):
    """`case`, as ggml builds it, refused by its op's rule; the host serves on."""
    r = Remote(guest, ggml, case)
    got = refusal(r, serves_next=False)
    assert_refused_by_rule(got, case.op, r.index(r.out))
    assert reason in got.reason, got.reason
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0  # the host serves on
    r.close()


def test_cpy_to_quantized_with_longer_source_rows_is_refused(guest, ggml):
    """ggml_cpy only checks element counts, but the CPU converts each source row in a work
    buffer sized by the result's ne[0]: F32 rows of 64 into Q8_0 rows of 32 would overrun it."""
    def build(g, ctx):
        a, dst = _in(g, ctx, "F32", 64, 2), _in(g, ctx, "Q8_0", 32, 4)
        return g.ggml_cpy(ctx, a, dst), [a, dst]
    _refused_as_built(guest, ggml, Case("CPY", build, data={1: zero_blocks(34)}),
                      "src0 rows of 64 do not fit Q8_0 rows of 32")


def test_quantized_copy_walked_as_elements_is_refused(guest, ggml):
    """dup_bytes copies ne[0] * type_size bytes per row into a contiguous result when the
    source is not contiguous and the shapes differ: blck_size times a Q8_0 row."""
    def build(g, ctx):
        a = _in(g, ctx, "Q8_0", 64, 4)
        v = g.ggml_view_2d(ctx, a, 32, 4, g_nb(g, a, 1), 0)
        return g.ggml_cpy(ctx, v, _in(g, ctx, "Q8_0", 64, 2)), [a]
    r = Remote(guest, ggml, Case("CPY", build, data={0: zero_blocks(34)}))
    got = refusal(r, serves_next=False)
    assert_refused_by_rule(got, "CPY", r.index(r.out))
    assert "Q8_0 copy of a non-contiguous source into a contiguous result" in got.reason, got.reason
    r.close()


@pytest.mark.parametrize("dim", [0, 1], ids=lambda d: f"CONCAT-q8_0-dim{d}")
def test_concat_quantized(guest, ggml, dim):
    """ggml 0.20 concatenates quantized rows block by block: computed, to ggml CPU's bytes;
    ggml 0.10 would walk them as elements: refused by the concat rule."""
    def build(g, ctx):
        a, b = _in(g, ctx, "Q8_0", 64, 3, 2), _in(g, ctx, "Q8_0", *((32, 3, 2) if dim == 0 else (64, 2, 2)))
        return g.ggml_concat(ctx, a, b, dim), [a, b]

    case = Case("CONCAT", build, data={0: random_blocks(34), 1: random_blocks(34)})
    r = Remote(guest, ggml, case)
    if op_enums(ggml).version < (0, 20, 0):
        assert_refused_by_rule(refusal(r, serves_next=False), "CONCAT", r.index(r.out))
    else:
        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        assert r.result() == _direct(ggml, case)
    r.close()


def test_cont_into_another_type_is_refused(ggml):
    """CONT F32 -> Q8_0 (ggml_cont keeps the type): the kernel (dup_to_q) converts each row
    in a work buffer that ggml_graph_plan never sizes for CONT: a write through NULL (in a
    child process: a regression crashes that host)."""
    q8 = [34, 68, 136, 136]  # two rows of two Q8_0 blocks, inside the F32 result's 512 bytes
    edits = [(-1, "type", 0, "Q8_0", None)] + [(-1, "nb", i, q8[i], np.int64) for i in range(4)]
    got, node = refusal_in_child((__name__, "CONT_F32"), edits)
    assert_refused_by_rule(got, "CONT", node)
    assert "keeps its type" in got.reason, got.reason


def test_timestep_embedding_empty_timesteps_are_refused(guest, ggml):
    """timesteps [5, 0]: the kernel still reads 5 floats (one per row of
    the result); refused before the rule, by the empty-source check."""
    r = Remote(guest, ggml, Case("TIMESTEP_EMBEDDING", _timestep_embedding))
    recs = r.recs.copy()
    recs["ne"][r.index(r.inputs[0])][1] = 0
    assert_refused_by_rule(refusal(r, recs), "TIMESTEP_EMBEDDING", r.index(r.out), "src0 [5, 0, 1, 1] has no elements",
                           rule=base.check_empty_sources)
    r.close()


# --- C int counts and indices (shown on the rules: the tensors are gigabytes)
def test_concat_dimension_past_int_is_refused(ggml):
    """concat's loops are `for (int i3 = 0; i3 < ne3; i3++)`: ne[3] = 2^31 (2 GiB of I8)."""
    a, b = info(0, "F32", [1, 1, 1, 2**30]), info(1, "F32", [1, 1, 1, 2**30])
    node = info(2, "F32", [1, 1, 1, 2**31], op="CONCAT", op_params=[3])
    assert_refused_by_rule(infos_check(ggml, node, [a, b]), "CONCAT", 2,
                           "tensor 2 [1, 1, 1, 2147483648] is too large for the kernel's int counts",
                           rule=base.int_counted)


def test_cpy_from_quantized_past_uint32_index_is_refused(ggml):
    """ggml_compute_forward_dup_from_q keeps each block's flat element index in a uint32_t."""
    q = info(0, "Q8_0", [2**16, 2**16 + 64, 1, 1], type_size=34, blck_size=32,
             nb=[34, 34 * 2**11, 34 * 2**11 * (2**16 + 64), 34 * 2**11 * (2**16 + 64)])
    dst = info(1, "F32", [2**16, 2**16 + 64, 1, 1])
    node = info(2, "F32", dst.ne, op="CPY", nb=dst.nb)
    got = infos_check(ggml, node, [q, dst])
    assert_refused_by_rule(got, "CPY", 2)
    assert "32-bit element index" in got.reason, got.reason


# ggml >= 0.25 (llama.cpp's build; tests/llama/test_host_ggml025.py runs this folder on it):
# CONCAT of a type without its own kernel copies whole rows (Feature.CONCAT_ROWS).
def _i64(n, rng):
    return rng.integers(-(2**40), 2**40, n).astype(np.int64)


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


CONCAT_I64 = Case("CONCAT", _concat_i64(), data={0: _i64, 1: _i64}, name="i64-rows", feature=Feature.CONCAT_ROWS)


def test_concat_rows_matches_ggml_cpu(guest, ggml):
    assert_matches_ggml_cpu(guest, ggml, CONCAT_I64)


def test_concat_rows_lying_shape_is_refused(guest, ggml):
    lie_refusal(guest, ggml, CONCAT_I64)


def test_concat_of_rows_that_are_not_contiguous_is_refused(guest, ggml):
    """ggml 0.25's concat_any (I64 here) GGML_ASSERTs both sources' rows contiguous (0.20's
    walked elements): a permuted src0 would abort the host."""
    case = Case("CONCAT", _concat_i64(permute_a=True), data={0: _i64, 1: _i64}, feature=Feature.CONCAT_ROWS)
    edited_refusal(guest, ggml, case, "sources' rows are not contiguous", then=CONCAT_I64)
