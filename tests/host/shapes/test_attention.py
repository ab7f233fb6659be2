"""apir.host.graph.shapes.attention: FLASH_ATTN_EXT, the linear-attention and state-space ops
(RWKV_WKV6/7, GATED_LINEAR_ATTN, SSM_CONV, SSM_SCAN, GATED_DELTA_NET), LIGHTNING_INDEXER and
the DSV4 hyper-connection ops, in the forms test-backend-ops builds. Each case, built with
ggml's own constructor, computes through the host to ggml CPU's own bytes; a lying shape,
type, stride or op_param is refused by that op's rule (asserted on the refusal's node, op,
rule and reason), and the host serves on. Inputs that would hang or abort a host without the
rule run in a child process (tests/host/childkit.py); `int` bounds that need tensors of
gigabytes are shown on the rules themselves (`infos_check`)."""

import numpy as np
import pytest

from apir.host.graph.shapes import base, op_enums
from tests.host.childkit import refusal_in_child
from apir.ggml.features import Feature
from tests.host.shapekit import (
    edited_refusal,
    assert_computes_like_cpu,
    op_param_edit,
    Case,
    Remote,
    _direct,
    _in,
    _ints,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    ctor,
    info,
    infos_check,
    lie_refusal,
    refusal,
)

INT32_MAX = 2**31 - 1


def _blocks(block_bytes, scale_bytes=2, blck=32):
    """Quantized blocks with a small F16 scale (random bytes would make NaN or inf scales)."""
    def make(n, rng):
        b = rng.integers(0, 256, (n // blck, block_bytes)).astype(np.uint8)
        scales = rng.uniform(0.002, 0.02, (n // blck, scale_bytes // 2)).astype(np.float16)
        b[:, :scale_bytes] = scales.view(np.uint8).reshape(n // blck, scale_bytes)
        return b
    return make


def _bf16(n, rng):
    return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _fa(type_k="F16", type_v="F16", mask=True, sinks=False, heads=4, kv_heads=2, dk=64, dv=64,
        n=3, kv=7, permute=False, max_bias=0.0, softcap=0.0, prec=10):
    """test-backend-ops' test_flash_attn_ext, small: q [dk, n, heads] F32, k and v of kv_heads
    (GQA broadcast), mask [kv, n], sinks [heads]; `permute`: q, k, v built [dk, heads, n] and
    permuted (0, 2, 1, 3)."""
    def build(g, ctx):
        def make(type_name, ne0, ne1, ne2):
            if not permute:
                t = _in(g, ctx, type_name, ne0, ne1, ne2, 1)
                return t, t
            t = _in(g, ctx, type_name, ne0, ne2, ne1, 1)
            return t, ctor(g, "ggml_permute")(ctx, t, 0, 2, 1, 3)

        q, qv = make("F32", dk, n, heads)
        k, kv_ = make(type_k, dk, kv, kv_heads)
        v, vv = make(type_v, dv, kv, kv_heads)
        ins = [q, k, v]
        m = _in(g, ctx, "F16", kv, n, 1, 1) if mask else None
        s = _in(g, ctx, "F32", heads) if sinks else None
        ins += [t for t in (m, s) if t is not None]
        out = ctor(g, "ggml_flash_attn_ext")(ctx, qv, kv_, vv, m, 1.0 / np.sqrt(dk), max_bias, softcap)
        if s is not None:
            ctor(g, "ggml_flash_attn_ext_add_sinks")(out, s)
        ctor(g, "ggml_flash_attn_ext_set_prec")(out, prec)
        return out, ins
    return build


def _linear(name, n_token_srcs, tf=False, s_=8, h=2, t=4, n_seqs=2, scale=None):
    """test-backend-ops' test_rwkv_wkv6 / test_gla / test_rwkv_wkv7, small: per-token sources
    [s_, h, t] (time_faaaa [s_, h] third when `tf`), the state [s_*s_*h, n_seqs] last."""
    def build(g, ctx):
        ins = [_in(g, ctx, "F32", s_, h, t) for _ in range(n_token_srcs)]
        if tf:
            ins.insert(3, _in(g, ctx, "F32", s_, h))
        ins.append(_in(g, ctx, "F32", s_ * s_ * h, n_seqs))
        args = (ins + [scale]) if scale is not None else ins
        return ctor(g, name)(ctx, *args), ins
    return build


def _ssm_conv(d_conv=4, d_inner=6, n_t=3, n_s=2):
    def build(g, ctx):
        sx, c = _in(g, ctx, "F32", d_conv - 1 + n_t, d_inner, n_s), _in(g, ctx, "F32", d_conv, d_inner)
        return ctor(g, "ggml_ssm_conv")(ctx, sx, c), [sx, c]
    return build


def _gdn(kda=False, snapshots=1, permuted=False, s_v=8, h=2, t=3, n_seqs=2, v_repeat=1):
    """test-backend-ops' test_gated_delta_net, small (ggml 0.20's constructor, with K)."""
    def build(g, ctx):
        ins = []

        def qkv(heads):
            if permuted:
                x = _in(g, ctx, "F32", s_v, t, heads, n_seqs)
                ins.append(x)
                return ctor(g, "ggml_permute")(ctx, x, 0, 2, 1, 3)
            x = _in(g, ctx, "F32", s_v, heads, t, n_seqs)
            ins.append(x)
            return x

        q, k, v = qkv(h), qkv(h), qkv(h * v_repeat)
        gate = _in(g, ctx, "F32", s_v if kda else 1, h * v_repeat, t, n_seqs)
        beta = _in(g, ctx, "F32", 1, h * v_repeat, t, n_seqs)
        state = _in(g, ctx, "F32", s_v, s_v, h * v_repeat, n_seqs)
        ins += [gate, beta, state]
        return ctor(g, "ggml_gated_delta_net")(ctx, q, k, v, gate, beta, state, snapshots), ins
    return build


def _ssm_scan(mamba1=False, snapshots=1, d_state=16, head_dim=4, n_head=4, n_group=2, n_tokens=3, n_seqs=2):
    """test-backend-ops' test_ssm_scan, small (ggml 0.20's constructor, with K): the states of
    n_seqs + 1 sequences, picked by ids."""
    def build(g, ctx):
        st = _in(g, ctx, "F32", d_state, head_dim, n_head, n_seqs + 1)
        x = _in(g, ctx, "F32", head_dim, n_head, n_tokens, n_seqs)
        dt = _in(g, ctx, "F32", n_head, n_tokens, n_seqs)
        a = _in(g, ctx, "F32", d_state if mamba1 else 1, n_head)
        b = _in(g, ctx, "F32", d_state, n_group, n_tokens, n_seqs)
        c = _in(g, ctx, "F32", d_state, n_group, n_tokens, n_seqs)
        ids = _in(g, ctx, "I32", n_seqs)
        ins = [st, x, dt, a, b, c, ids]
        return ctor(g, "ggml_ssm_scan")(ctx, *ins, snapshots), ins
    return build


def _indexer(type_k="F32", n_embd=32, n_head=3, n_tokens=2, n_kv=5, n_stream=2):
    """test-backend-ops' test_lightning_indexer, small (ggml 0.20); the mask shared by streams."""
    def build(g, ctx):
        q = _in(g, ctx, "F32", n_embd, n_head, n_tokens, n_stream)
        k = _in(g, ctx, type_k, n_embd, 1, n_kv, n_stream)
        w = _in(g, ctx, "F32", n_head, n_tokens, 1, n_stream)
        m = _in(g, ctx, "F16", n_kv, n_tokens, 1, 1)
        return ctor(g, "ggml_lightning_indexer")(ctx, q, k, w, m), [q, k, w, m]
    return build


def _hc_comb(g, ctx):
    mixes, scale, base = _in(g, ctx, "F32", 24, 3), _in(g, ctx, "F32", 3), _in(g, ctx, "F32", 24)
    return ctor(g, "ggml_dsv4_hc_comb")(ctx, mixes, scale, base, 1e-6, 3), [mixes, scale, base]


def _hc_pre(g, ctx):
    x, w = _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 4, 3)
    return ctor(g, "ggml_dsv4_hc_pre")(ctx, x, w), [x, w]


def _hc_post(g, ctx):
    """residual permuted: the kernel walks every source by its own strides."""
    x, post, comb = _in(g, ctx, "F32", 8, 3), _in(g, ctx, "F32", 4, 3), _in(g, ctx, "F32", 4, 4, 3)
    res = _in(g, ctx, "F32", 8, 3, 4)
    rp = ctor(g, "ggml_permute")(ctx, res, 0, 2, 1, 3)
    return ctor(g, "ggml_dsv4_hc_post")(ctx, x, rp, post, comb), [x, res, post, comb]


_SMALL = {3: lambda n, r: (r.random(n) * -0.5).astype(np.float32),  # log-decay gates
          4: lambda n, r: r.random(n).astype(np.float32)}  # beta in [0, 1)


_Q8 = _blocks(34)
_Q4 = _blocks(18)

FA = Case("FLASH_ATTN_EXT", _fa(), lie=(0, 2, -1), name="f16-gqa")  # lie: 3 heads of q for 2 of k
FA_SINKS = Case("FLASH_ATTN_EXT", _fa(sinks=True, max_bias=8.0), lie=(3, 0, -1),
                name="sinks-alibi")  # lie: mask shorter than kv
FA_NO_MASK = Case("FLASH_ATTN_EXT", _fa(type_k="F32", type_v="F32", mask=False, softcap=10.0, prec=0),
                  lie=(-1, 0, -1), name="f32-no-mask-softcap")
GATED_DELTA_NET = Case("GATED_DELTA_NET", _gdn(), lie=(4, 0, 1), data=_SMALL, name="gda")  # lie: beta of 2 per head
HC_COMB = Case("DSV4_HC_COMB", _hc_comb, lie=(0, 0, -4), name="hc3")  # lie: hc = 3 has no kernel
SSM_SCAN_ONE_SEQ = Case("SSM_SCAN", _ssm_scan(n_seqs=1), data={6: _ints(2)}, name="one-seq")

CASES = [
    FA,
    FA_SINKS,
    FA_NO_MASK,
    Case("FLASH_ATTN_EXT", _fa(type_k="BF16", type_v="BF16", heads=2, kv_heads=1, n=2), lie=(-1, 1, -1),
         data={1: _bf16, 2: _bf16}, name="bf16"),
    Case("FLASH_ATTN_EXT", _fa(type_k="Q8_0", type_v="Q8_0"), lie=(2, 2, 1),  # lie: v of 3 heads for q of 4
         data={1: _Q8, 2: _Q8}, name="q8_0"),
    Case("FLASH_ATTN_EXT", _fa(type_k="Q4_0", type_v="F16", permute=True, sinks=True),
         lie=(3, 1, -1), data={1: _Q4}, name="q4_0-permuted-sinks"),  # lie: mask rows < q rows
    Case("FLASH_ATTN_EXT", _fa(dk=64, dv=32, permute=True), lie=(-1, 2, -1), name="dv32-permuted"),
    Case("RWKV_WKV6", _linear("ggml_rwkv_wkv6", 4, tf=True), lie=(0, 2, -1), name="two-seqs"),  # lie: k of 3 tokens
    Case("RWKV_WKV6", _linear("ggml_rwkv_wkv6", 4, tf=True, n_seqs=1, t=3), lie=(3, 0, -1),
         name="one-seq"),  # lie: time_faaaa short
    Case("GATED_LINEAR_ATTN", _linear("ggml_gated_linear_attn", 4, scale=0.5), lie=(-1, 1, -1), name="scale-0.5"),
    Case("RWKV_WKV7", _linear("ggml_rwkv_wkv7", 6, s_=64), lie=(6, 1, -1), name="head64"),  # lie: state of 1 sequence
    Case("SSM_CONV", _ssm_conv(), lie=(1, 0, -1), name="d_conv4"),
    Case("SSM_CONV", _ssm_conv(d_conv=3, n_t=1, n_s=1), lie=(0, 1, -1), name="d_conv3-one-token"),
    GATED_DELTA_NET,
    Case("GATED_DELTA_NET", _gdn(kda=True, snapshots=3, v_repeat=2), lie=(1, 0, -1), data=_SMALL,
         name="kda-snapshots3-repeat2"),
    Case("GATED_DELTA_NET", _gdn(permuted=True, snapshots=2), lie=(-1, 1, -1), data=_SMALL,
         name="permuted-snapshots2"),
    Case("SSM_SCAN", _ssm_scan(snapshots=2), lie=(1, 1, -1), data={6: _ints(3)},
         name="mamba2-snapshots2"),  # lie: x of 3 heads
    Case("SSM_SCAN", _ssm_scan(mamba1=True), lie=(4, 1, 1), data={6: _ints(3)}, name="mamba1"),  # lie: 3 groups
    Case("LIGHTNING_INDEXER", _indexer(), lie=(3, 0, -1), name="f32"),  # lie: mask shorter than kv
    Case("LIGHTNING_INDEXER", _indexer(type_k="Q8_0"), lie=(-1, 0, -1), data={1: _Q8}, name="q8_0"),
    Case("LIGHTNING_INDEXER", _indexer(type_k="F16"), lie=(2, 0, -1), name="f16"),
    HC_COMB,
    Case("DSV4_HC_PRE", _hc_pre, lie=(1, 1, -1), name="hc4"),
    Case("DSV4_HC_POST", _hc_post, lie=(3, 2, -1), name="residual-permuted"),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    lie_refusal(guest, ggml, case)


def _edited(remote, ggml, t, field, index, value, dtype=np.int32):
    """A copy of `remote`'s records with `field`[index] of tensor t's record set (op_params
    as raw int32 words, type by name)."""
    recs = remote.recs.copy()
    i = remote.index(t)
    if field == "op_params":
        recs["op_params"][i][index] = np.array([value]).astype(dtype).view(np.int32)[0]
    elif field == "type":
        recs["type"][i] = ggml.types[value]
    else:
        recs[field][i][index] = value
    return recs


def test_rwkv_wkv7_head_size_off_the_simd_step_is_refused(guest, ggml):
    """The SIMD kernel would load and store a whole GGML_F32_STEP past a head of 8 floats."""
    r = Remote(guest, ggml, Case("RWKV_WKV7", _linear("ggml_rwkv_wkv7", 6)))
    got = refusal(r, serves_next=False)  # (the graph itself is the refused one)
    assert_refused_by_rule(got, "RWKV_WKV7", r.index(r.out), "head size 8 is not a multiple of 64")
    r.close()


@pytest.mark.parametrize("bad", [pytest.param([0, 3], id="SSM_SCAN-id-past-states"),
                                 pytest.param([-1, 1], id="SSM_SCAN-id-negative")])
def test_ssm_scan_state_ids_out_of_range(guest, ggml, bad):
    """ids pick the initial state of each sequence (s + ids[i] * nb[3]): s has 3."""
    case = Case("SSM_SCAN", _ssm_scan(), data={6: lambda n, r: np.array(bad, np.int32)})
    r = Remote(guest, ggml, case)
    got = refusal(r, serves_next=False)
    assert_refused_by_rule(got, "SSM_SCAN", r.index(r.out), "row id out of [0, 3)")
    r.close()


@pytest.mark.parametrize("bad", [pytest.param([0, 3], id="SSM_SCAN-id-past-states"),
                                 pytest.param([-1, 1], id="SSM_SCAN-id-negative"),
                                 pytest.param([INT32_MAX, 0], id="SSM_SCAN-id-max")])
def test_ssm_scan_state_ids_out_of_range_on_a_cache_hit(guest, ggml, bad):
    """The same graph again (a graph cache hit: fresh ids checked against the bound the rule
    recorded, apir.host.graph.cache): ids out of range are refused with the rule's reason (the
    kernel would read states from s + ids[i] * nb[3], unchecked), and good ids then computed to
    ggml CPU's bytes."""
    case = Case("SSM_SCAN", _ssm_scan(), data={6: lambda n, r: np.array([2, 0], np.int32)})
    r = Remote(guest, ggml, case)
    try:
        cache = guest.ctx._library.graph_cache

        def write(values):
            ids = np.array(values, np.int32).tobytes()
            assert guest.set_tensor(r.remote.handle, r.remote.rpc(r.inputs[6]), ids) == 0

        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        write(bad)
        got = refusal(r, serves_next=False)
        assert cache.hits == 1  # found, re-checked, refused
        assert_refused_by_rule(got, "SSM_SCAN", r.index(r.out), "row id out of [0, 3)")
        write([2, 0])
        for _ in range(2):  # rebuilt (the refused entry was dropped), then a hit
            rc, dec = r.compute()
            assert rc == 0 and dec.i32() == 0
        assert cache.hits == 2
        assert r.result() == _direct(ggml, case)
    finally:
        r.close()


@pytest.mark.parametrize("op,build,which", [
    pytest.param("FLASH_ATTN_EXT", _fa(heads=1, kv_heads=1), -1,
                 id="FLASH_ATTN_EXT-result-nb1"),  # the result's rows step by nb[1]
    pytest.param("SSM_SCAN", _ssm_scan(n_head=1, n_group=1, snapshots=2), 0,
                 id="SSM_SCAN-state-nb2"),  # s's nb[2]: bytes of a snapshot copy
])
def test_stride_of_a_dimension_of_one_is_checked(guest, ggml, op, build, which):
    """ggml_is_contiguous ignores the stride of a dimension of ne 1 (and so does the extent
    check), but these kernels use it for another dimension: a large one would write far
    outside the result."""
    case = Case(op, build, data={6: _ints(3)} if op == "SSM_SCAN" else None)
    r = Remote(guest, ggml, case)
    t = r.out if which < 0 else r.inputs[which]
    dim = 1 if which < 0 else 2
    assert int(r.recs["ne"][r.index(t)][dim]) == 1
    got = refusal(r, _edited(r, ggml, t, "nb", dim, 1 << 30))
    assert_refused_by_rule(got, op, r.index(r.out))
    assert "packed" in got.reason, got.reason
    assert r.result() == _direct(ggml, case)
    r.close()


@pytest.mark.parametrize("n_iter", [pytest.param(0, id="DSV4_HC_COMB-n_iter-0"),
                                    pytest.param(-3, id="DSV4_HC_COMB-n_iter-negative")])
def test_dsv4_hc_comb_n_iter(guest, ggml, n_iter):
    """The kernel GGML_ASSERTs n_iter > 0."""
    r = Remote(guest, ggml, HC_COMB)
    got = refusal(r, _edited(r, ggml, r.out, "op_params", 1, n_iter))
    assert_refused_by_rule(got, "DSV4_HC_COMB", r.index(r.out), "n_iter")
    r.close()


@pytest.mark.parametrize("n_iter", [pytest.param(INT32_MAX, id="DSV4_HC_COMB-n_iter-int-max"),
                                    pytest.param(1025, id="DSV4_HC_COMB-n_iter-1025")])
def test_dsv4_hc_comb_iteration_count_is_bounded(ggml, n_iter):
    """n_iter Sinkhorn iterations per token: INT32_MAX keeps the host busy for minutes from a
    1 KiB graph; 1024 is the bound (in a child process: a regression hangs that host)."""
    if "DSV4_HC_COMB" not in ggml.ops:
        pytest.skip("ggml 0.20's op")
    got, node = refusal_in_child((__name__, "HC_COMB"), [(-1, "op_params", 1, n_iter, np.int32)])
    assert_refused_by_rule(got, "DSV4_HC_COMB", node, "n_iter")


def test_dsv4_hc_comb_iteration_count_at_the_bound_computes(guest, ggml):
    if "DSV4_HC_COMB" not in ggml.ops:
        pytest.skip("ggml 0.20's op")
    r = Remote(guest, ggml, HC_COMB)
    recs = r.recs.copy()
    recs["op_params"][r.index(r.out)][1] = 1024
    rc, dec = r.compute(recs)
    assert rc == 0 and dec.i32() == 0
    r.close()


@pytest.mark.parametrize("snapshots", [pytest.param(0, id="GATED_DELTA_NET-K-0"),
                                       pytest.param(-1, id="GATED_DELTA_NET-K-negative"),
                                       pytest.param(2, id="GATED_DELTA_NET-K-past-result")])
def test_gated_delta_net_snapshot_count(guest, ggml, snapshots):
    """K < 1 (the kernel GGML_ASSERTs K >= 1) or a K the result has no rows for is refused."""
    if op_enums(ggml).version < (0, 20, 0):
        pytest.skip("ggml 0.10's gated_delta_net has no snapshot count")
    r = Remote(guest, ggml, GATED_DELTA_NET)  # K = 1
    got = refusal(r, _edited(r, ggml, r.out, "op_params", 0, snapshots))
    assert_refused_by_rule(got, "GATED_DELTA_NET", r.index(r.out))
    r.close()


@pytest.mark.parametrize("field,index,value,dtype", [
    pytest.param("op_params", 3, 5, np.int32, id="FLASH_ATTN_EXT-prec-5"),  # precision the kernel aborts on
    pytest.param("op_params", 1, 8.0, np.float32, id="FLASH_ATTN_EXT-max_bias-without-mask"),
])
def test_flash_attn_ext_bad_op_params(guest, ggml, field, index, value, dtype):
    r = Remote(guest, ggml, FA_NO_MASK)
    got = refusal(r, _edited(r, ggml, r.out, field, index, value, dtype))
    assert_refused_by_rule(got, "FLASH_ATTN_EXT", r.index(r.out))
    r.close()


@pytest.mark.parametrize("which,field,index,value", [
    pytest.param(0, "type", 0, "F16", id="FLASH_ATTN_EXT-q-f16"),  # q read as F32 rows
    pytest.param(3, "type", 0, "F32", id="FLASH_ATTN_EXT-mask-f32"),  # the mask is F16
    # result rows written at (i2 + i1*ne1) * nb[1]: not contiguous
    pytest.param(-1, "nb", 2, 0, id="FLASH_ATTN_EXT-result-nb2-of-nb1"),
    pytest.param(0, "nb", 0, 8, id="FLASH_ATTN_EXT-q-nb0-8"),  # q rows not contiguous
    pytest.param(4, "nb", 0, 8, id="FLASH_ATTN_EXT-sinks-nb0-8"),  # sinks read as a plain array
])
def test_flash_attn_ext_bad_types_and_strides(guest, ggml, which, field, index, value):
    r = Remote(guest, ggml, FA_SINKS)
    t = r.out if which < 0 else r.inputs[which]
    if field == "nb" and value == 0:
        value = int(r.recs["nb"][r.index(t)][1])
    got = refusal(r, _edited(r, ggml, t, field, index, value))
    assert_refused_by_rule(got, "FLASH_ATTN_EXT", r.index(r.out))
    r.close()


def test_ssm_scan_ids_not_packed_is_refused(ggml):
    """ggml_compute_forward_ssm_scan_f32 GGML_ASSERTs ids' nb[0] == 4 (one id here: the rule
    reads the same value whatever nb[0] is; in a child process: a regression aborts that
    host)."""
    got, node = refusal_in_child((__name__, "SSM_SCAN_ONE_SEQ"), [(6, "nb", 0, 8, np.int64)])
    assert_refused_by_rule(got, "SSM_SCAN", node)
    assert "ids" in got.reason, got.reason


def test_flash_attn_ext_empty_sinks_are_refused(guest, ggml):
    """sinks [H, 0]: the kernel still reads sinks[h] for every head;
    refused before the rule, by the empty-source check."""
    r = Remote(guest, ggml, Case("FLASH_ATTN_EXT", _fa(sinks=True)))
    recs = r.recs.copy()
    recs["ne"][r.index(r.inputs[4])][1] = 0
    got = refusal(r, recs)
    assert_refused_by_rule(got, "FLASH_ATTN_EXT", r.index(r.out), "src4 [4, 0, 1, 1] has no elements",
                           rule=base.check_empty_sources)
    r.close()


# --- C int counts and indices (shown on the rules: the tensors are gigabytes)
def test_flash_attn_ext_query_rows_past_int_are_refused(ggml):
    """The kernel walks q's rows (N*H*S) with `int ir` and `int iq1 = ...`."""
    q = info(0, "F32", [64, 2**16, 2**15, 1])
    k = info(1, "F16", [64, 7, 1, 1], type_size=2)
    v = info(2, "F16", [64, 7, 1, 1], type_size=2)
    node = info(3, "F32", [64, 2**15, 2**16, 1], op="FLASH_ATTN_EXT", op_params=[0, 0, 0, 10])
    got = infos_check(ggml, node, [q, k, v])
    assert_refused_by_rule(got, "FLASH_ATTN_EXT", 3, 
                           "tensor 3 [64, 32768, 65536, 1] is too large for the kernel's int counts",
                           rule=base.int_counted)


def test_ssm_conv_sequence_past_int_index_is_refused(ggml):
    """s[i0 + i1*ncs] in `int`: a sequence of 2^31 floats (ncs * d_inner) would wrap; one of
    2^30 + ... floats is in range."""
    c = info(1, "F32", [4, 2**15, 1, 1])
    sx = info(0, "F32", [2**16 + 3, 2**15, 1, 1])
    node = info(2, "F32", [2**15, 2**16, 1, 1], op="SSM_CONV")
    got = infos_check(ggml, node, [sx, c])
    assert_refused_by_rule(got, "SSM_CONV", 2)
    assert "int indices" in got.reason, got.reason
    sx = info(0, "F32", [2**15 + 3, 2**15, 1, 1])
    node = info(2, "F32", [2**15, 2**15, 1, 1], op="SSM_CONV")
    assert infos_check(ggml, node, [sx, c]) is None


def test_ssm_scan_state_past_int_index_is_refused(ggml):
    """s0[i0 + (i1 + h*head_dim)*d_state] in `int`: a state of 2^31 floats per sequence (the
    result, which holds it, then has more than INT32_MAX elements in ne[0])."""
    d_state, head_dim, n_head = 2**10, 2**11, 2**10
    s = info(0, "F32", [d_state, head_dim, n_head, 1])
    x = info(1, "F32", [head_dim, n_head, 1, 1])
    dt = info(2, "F32", [n_head, 1, 1, 1])
    a = info(3, "F32", [1, n_head, 1, 1])
    b = info(4, "F32", [d_state, 1, 1, 1])
    c = info(5, "F32", [d_state, 1, 1, 1])
    ids = info(6, "I32", [1, 1, 1, 1])
    n = head_dim * n_head + d_state * head_dim * n_head
    node = info(7, "F32", [n, 1, 1, 1], op="SSM_SCAN", op_params=[1])
    got = infos_check(ggml, node, [s, x, dt, a, b, c, ids])
    assert_refused_by_rule(got, "SSM_SCAN", 7, "tensor 7", rule=base.int_counted)
    assert "int counts" in got.reason, got.reason


# ggml >= 0.25 (llama.cpp's build; tests/llama/test_host_ggml025.py runs this folder on it):
# DSV4_HC_PRE's gate and DSV4_HC_POST without comb (Feature.HC_GATED).
def _hc_pre_gated(g, ctx):
    x, gate = _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 8, 4, 3)
    return ctor(g, "ggml_dsv4_hc_pre_gated")(ctx, x, gate, 0.5), [x, gate]


def _hc_post_no_comb(g, ctx):
    x, res, post = _in(g, ctx, "F32", 8, 3), _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 4, 3)
    return ctor(g, "ggml_dsv4_hc_post")(ctx, x, res, post, None), [x, res, post]


CASES_025 = [
    Case("DSV4_HC_PRE", _hc_pre_gated, lie=(1, 0, -1), name="gated", feature=Feature.HC_GATED),
    Case("DSV4_HC_POST", _hc_post_no_comb, lie=(1, 1, -1), name="no-comb", feature=Feature.HC_GATED),
]


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_op_matches_ggml_cpu_025(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_lying_shape_is_refused_025(guest, ggml, case):
    lie_refusal(guest, ggml, case)


def test_hc_pre_gate_of_the_weights_shape_is_refused(guest, ggml):
    """Gated (op_params[1] = 1), the second source is read as [n_embd, hc, n_tokens]: a gate of
    the ungated weights' shape [hc, n_tokens] is refused."""
    def build(g, ctx):
        x, w = _in(g, ctx, "F32", 8, 4, 3), _in(g, ctx, "F32", 4, 3)
        return ctor(g, "ggml_dsv4_hc_pre")(ctx, x, w), [x, w]

    case = Case("DSV4_HC_PRE", build, name="ungated", feature=Feature.HC_GATED)
    assert_computes_like_cpu(guest, ggml, case)
    edited_refusal(guest, ggml, case, "x [8, 4, 3, 1] and gate [4, 3, 1, 1] do not fit", op_param_edit(1, 1))
