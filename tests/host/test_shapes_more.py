"""apir.host.shapes, the rules beyond the first transformer ops: each op, built with ggml's
own constructor, computes through the host to ggml CPU's own bytes; a lying shape (the
node's or a source's ne) is refused by that op's rule, and the host serves on."""

import ctypes
import logging

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host.shapes import op_enums
from tests.host.hostkit import DATA_RES, RemoteGraph, cpu_compute
from tests.host.shapekit import (
    ERROR,
    Case,
    Remote,
    _direct,
    _in,
    _ints,
    case_tests,
    g_nb,
    random_blocks,
    zero_blocks,
)


def _one(fn):
    """A case of one F32 [8, 3, 2] source through `fn(g, ctx, a)`."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 8, 3, 2)
        return fn(g, ctx, a), [a]
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


def _two(fn, ne_b=(8, 3, 2), type_name="F32"):
    def build(g, ctx):
        a, b = _in(g, ctx, type_name, 8, 3, 2), _in(g, ctx, type_name, *ne_b)
        return fn(g, ctx, a, b), [a, b]
    return build


def _set_rows(g, ctx):
    dst, src, ids = _in(g, ctx, "F16", 8, 10, 2), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "I64", 3, 2)
    return g.ggml_set_rows(ctx, dst, src, ids), [dst, src, ids]


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


# ggml >= 0.20 (the default ggml here): norms of strided rows (0.10's kernels assume packed rows)
STRIDED_NORMS = [
    Case("L2_NORM", _one(lambda g, c, a: g.ggml_l2_norm(c, g.ggml_permute(c, a, 1, 0, 2, 3), 1e-6))),
    Case("NORM", _one(lambda g, c, a: g.ggml_norm(c, g.ggml_permute(c, a, 1, 0, 2, 3), 1e-6))),
]


def _too_old(g, case):
    if case in STRIDED_NORMS and op_enums(g).version < (0, 20, 0):
        return "ggml 0.10's norms take packed rows only (the host refuses strided ones there)"
    return None


CASES = [
    Case("SQR", _one(lambda g, c, a: g.ggml_sqr(c, a))),
    Case("SQRT", _one(lambda g, c, a: g.ggml_sqrt(c, a)), data={0: lambda n, r: r.random(n).astype(np.float32)}),
    Case("LOG", _one(lambda g, c, a: g.ggml_log(c, a)), data={0: lambda n, r: r.random(n).astype(np.float32) + 0.1}),
    Case("SIN", _one(lambda g, c, a: g.ggml_sin(c, a))),
    Case("COS", _one(lambda g, c, a: g.ggml_cos(c, a))),
    Case("CLAMP", _one(lambda g, c, a: g.ggml_clamp(c, a, -0.5, 0.5))),
    Case("LEAKY_RELU", _one(lambda g, c, a: g.ggml_leaky_relu(c, a, 0.1, False))),
    Case("L2_NORM", _one(lambda g, c, a: g.ggml_l2_norm(c, a, 1e-6))),
    Case("GROUP_NORM", _one(lambda g, c, a: g.ggml_group_norm(c, a, 2, 1e-6)), lie=(-1, 1, -1)),
    Case("ADD1", _two(lambda g, c, a, b: g.ggml_add1(c, a, b), ne_b=(1,))),
    Case("DIAG_MASK_INF", _one(lambda g, c, a: g.ggml_diag_mask_inf(c, a, 2))),
    Case("DIAG_MASK_ZERO", _one(lambda g, c, a: g.ggml_diag_mask_zero(c, a, 1))),
    Case("SOFT_MAX", _sinks, lie=(2, 0, -1)),
    Case("GLU", _glu("SWIGLU")),
    Case("GLU", _glu("GEGLU", swapped=True)),
    Case("GLU", _glu("REGLU", split=True), lie=(1, 1, -1)),
    Case("SUM", _one(lambda g, c, a: g.ggml_sum(c, a))),
    Case("SUM_ROWS", _one(lambda g, c, a: g.ggml_sum_rows(c, a)), lie=(-1, 1, -1)),
    Case("MEAN", _one(lambda g, c, a: g.ggml_mean(c, a)), lie=(-1, 2, -1)),
    Case("ARGMAX", lambda g, c: (lambda a: (g.ggml_argmax(c, a), [a]))(_in(g, c, "F32", 8, 5))),
    Case("COUNT_EQUAL", lambda g, c: (lambda a, b: (g.ggml_count_equal(c, a, b), [a, b]))(
        _in(g, c, "I32", 50, 4), _in(g, c, "I32", 50, 4)), lie=(1, 0, -1),
        data={0: lambda n, r: r.integers(0, 3, n).astype(np.int32), 1: lambda n, r: r.integers(0, 3, n).astype(np.int32)}),
    Case("REPEAT", _two(lambda g, c, a, b: g.ggml_repeat(c, b, a), ne_b=(4, 1, 2))),
    Case("REPEAT_BACK", _two(lambda g, c, a, b: g.ggml_repeat_back(c, a, b), ne_b=(4, 3, 1))),
    Case("CONCAT", _two(lambda g, c, a, b: g.ggml_concat(c, a, b, 1), ne_b=(8, 5, 2)), lie=(-1, 1, -1)),
    Case("CONCAT", _two(lambda g, c, a, b: g.ggml_concat(c, a, b, 0), ne_b=(3, 3, 2), type_name="F16")),
    Case("PAD", _one(lambda g, c, a: g.ggml_pad_ext(c, a, 1, 2, 0, 1, 2, 0, 0, 1))),
    Case("ARANGE", lambda g, c: (g.ggml_arange(c, 1.5, 9.0, 0.75), [])),
    Case("TIMESTEP_EMBEDDING", lambda g, c: (lambda t: (g.ggml_timestep_embedding(c, t, 7, 1000), [t]))(
        _in(g, c, "F32", 5))),
    Case("ARGSORT", _one(lambda g, c, a: g.ggml_argsort(c, a, 1))),
    Case("TOP_K", _one(lambda g, c, a: g.ggml_top_k(c, a, 3)), lie=(-1, 1, -1)),
    Case("SET_ROWS", _set_rows, lie=(-1, 1, -1), data={2: _ints(10, np.int64)}),
    Case("ADD", _bin_permuted("ggml_add")),
    Case("MUL", _bin_permuted("ggml_mul")),
    Case("UNARY", _gelu_of_view),
    Case("CPY", _cpy_permuted_to("Q8_0"), lie=(-1, 1, -1), data={1: zero_blocks(34)}),
    Case("CPY", _cpy_permuted_to("Q5_1"), lie=(-1, 2, -1), data={1: zero_blocks(24)}),
    Case("CPY", _cpy_quantized_to_f32, lie=(-1, 1, -1), data={0: random_blocks(34), 1: zero_blocks(4, 1)}),
    Case("CONT", _cont_of_view("I32"), lie=(-1, 1, -1), data={0: lambda n, r: r.integers(-9, 9, n).astype(np.int32)}),
    Case("CONT", _cont_of_view("F16")),
    *STRIDED_NORMS,
    Case("SUM", _one(lambda g, c, a: g.ggml_sum(c, g.ggml_permute(c, a, 1, 0, 2, 3)))),
]
IDS = [f"{c.op}-{i}" for i, c in enumerate(CASES)]
remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused = case_tests(CASES, IDS, skip=_too_old)


def _ids_case(op, build, ids_index, bad):
    return Case(op, build, data={ids_index: lambda n, r: np.array(bad, dtype=np.int64)[:n]})


@pytest.mark.parametrize("bad", [[0, 10, 1, 2, 3, 4], [0, -1, 1, 2, 3, 4]])
def test_set_rows_ids_out_of_range(guest, ggml, bad, caplog):
    r = Remote(guest, ggml, _ids_case("SET_ROWS", _set_rows, 2, bad))
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute()
    assert rc == ERROR and "row id out of [0, 10)" in caplog.text
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0
    r.close()


@pytest.mark.parametrize("op_param,value", [
    ("L2_NORM", np.float32(np.nan)), ("L2_NORM", np.float32(-1.0)), ("GROUP_NORM", 0),
    ("ARGSORT", 2), ("DIAG_MASK_INF", -1), ("GLU", 99), ("CONCAT", 4), ("PAD", -1),
])
def test_bad_op_params_are_refused(guest, ggml, op_param, value, caplog):
    """op_params a kernel GGML_ASSERTs or aborts on (eps >= 0, group count, sort order,
    n_past >= 0, glu op, dim) or that would walk it off its tensors (negative padding)."""
    case = next(c for c in CASES if c.op == op_param)
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    i = r.index(r.out)
    slot = 1 if op_param == "PAD" else 0
    recs["op_params"][i][slot] = np.array([value]).astype(np.float32 if isinstance(value, np.floating) else np.int32).view(np.int32)[0]
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR and f"({op_param})" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    r.close()


def test_cpy_to_quantized_with_longer_source_rows_is_refused(guest, ggml, caplog):
    """ggml_cpy only checks element counts, but the CPU converts each source row in a work
    buffer sized by the result's ne[0]: F32 rows of 64 into Q8_0 rows of 32 would overrun it."""
    def build(g, ctx):
        a, dst = _in(g, ctx, "F32", 64, 2), _in(g, ctx, "Q8_0", 32, 4)
        return g.ggml_cpy(ctx, a, dst), [a, dst]

    r = Remote(guest, ggml, Case("CPY", build, data={1: zero_blocks(34)}))
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute()
    assert rc == ERROR and "(CPY): src0 rows of 64 do not fit Q8_0 rows of 32" in caplog.text, caplog.text
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0
    r.close()


@pytest.mark.parametrize("dim", [0, 1])
def test_concat_quantized(guest, ggml, dim):
    """ggml 0.20 concatenates quantized rows block by block: computed, to ggml CPU's bytes;
    ggml 0.10 would walk them as elements: refused."""
    def build(g, ctx):
        a, b = _in(g, ctx, "Q8_0", 64, 3, 2), _in(g, ctx, "Q8_0", *((32, 3, 2) if dim == 0 else (64, 2, 2)))
        return g.ggml_concat(ctx, a, b, dim), [a, b]

    case = Case("CONCAT", build, data={0: random_blocks(34), 1: random_blocks(34)})
    r = Remote(guest, ggml, case)
    rc, dec = r.compute()
    if op_enums(ggml).version < (0, 20, 0):
        assert rc == ERROR
    else:
        assert rc == 0 and dec.i32() == 0
        assert r.result() == _direct(ggml, case)
    r.close()


def test_quantized_copy_walked_as_elements_is_refused(guest, ggml, caplog):
    """dup_bytes copies ne[0] * type_size bytes per row into a contiguous result when the
    source is not contiguous and the shapes differ: blck_size times a Q8_0 row."""
    def build(g, ctx):
        a = _in(g, ctx, "Q8_0", 64, 4)
        v = g.ggml_view_2d(ctx, a, 32, 4, g_nb(g, a, 1), 0)
        return g.ggml_cpy(ctx, v, _in(g, ctx, "Q8_0", 64, 2)), [a]

    r = Remote(guest, ggml, Case("CPY", build, data={0: zero_blocks(34)}))
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute()
    assert rc == ERROR and "Q8_0 copy of a non-contiguous source into a contiguous result" in caplog.text
    r.close()


def _minilm_graph(g, ctx):
    """A 2-layer, 64-wide BERT through apir.models.bert_graph (the MiniLM graph's ops)."""
    from apir.models.assets import BertConfig
    from apir.models.bert_graph import build_graph, weight_ne
    from tests.models.reference import tiny_weights

    cfg = BertConfig(50, 64, 2, 4, 96, 40, 2, 1e-12, "gelu", 40)
    w = tiny_weights(np.random.default_rng(1), 64, 96, 2, 50, 40)
    tensors = {}
    for name, arr in w.items():
        ne = weight_ne(arr.shape)
        tensors[name] = g.ggml_new_tensor(ctx, g.types["F32"], len(ne), (ctypes.c_int64 * len(ne))(*ne))
    bg = build_graph(g, ctx, tensors, cfg, 3, 17)
    data = [(tensors[k], v.tobytes()) for k, v in w.items()]
    rng = np.random.default_rng(2)
    for t in vars(bg.inputs).values():
        n = g.ggml_nelements(t)
        type_name = g.type_names[int(np.frombuffer(ctypes.string_at(t, 4), np.uint32)[0])]
        arr = {"I32": lambda: rng.integers(0, 2, n).astype(np.int32),  # valid ids, types, positions
               "F16": lambda: rng.random(n).astype(np.float16)}.get(type_name, lambda: rng.random(n).astype(np.float32))()
        data.append((t, arr.tobytes()))
    return bg, data


def test_minilm_graph_matches_ggml_cpu(guest, ggml):
    from apir.ggml import InitParams
    from apir.models.bert_graph import GRAPH_SIZE

    g = ggml
    size = g.ggml_tensor_overhead() * (GRAPH_SIZE + 200) + g.ggml_graph_overhead_custom(GRAPH_SIZE, False)
    outs = []
    for through_host in (False, True):
        ctx = g.ggml_init(InitParams(size, None, True))
        bg, data = _minilm_graph(g, ctx)
        nbytes = g.ggml_nbytes(bg.output)
        if through_host:
            remote = RemoteGraph(guest, g, ctx, bg.graph)
            for t, d in data:
                assert guest.set_tensor(remote.handle, remote.rpc(t), d) == 0
            wire = remote.wire
            guest.data[: len(wire)] = wire
            rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
            assert rc == 0 and dec.i32() == 0
            rc, got = guest.get_tensor(remote.handle, remote.rpc(bg.output), nbytes)
            assert rc == 0
            remote.close()
        else:
            got = cpu_compute(g, ctx, bg.graph, data, bg.output)
        g.ggml_free(ctx)
        outs.append(got)
    assert outs[1] == outs[0]
    emb = np.frombuffer(outs[0], np.float32).reshape(3, 64)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)  # L2_NORM ran


def test_soft_max_empty_sinks_are_refused(guest, ggml):
    """sinks [ne[2], 0] (issue 13 class 1): the kernel still reads sinks[i02]; refused before
    the rule, by the empty-source check."""
    from apir.host.shapes import base
    from tests.host.shapekit import assert_refused_by_rule, refusal

    r = Remote(guest, ggml, Case("SOFT_MAX", _sinks))
    recs = r.recs.copy()
    recs["ne"][r.index(r.inputs[2])][1] = 0
    assert_refused_by_rule(refusal(r, recs), "SOFT_MAX", r.index(r.out), "src2 [3, 0, 1, 1] has no elements",
                           rule=base.check_empty_sources)
    r.close()
