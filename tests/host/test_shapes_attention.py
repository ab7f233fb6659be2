"""apir.host.shapes.attention: each op, built with ggml's own constructor, computes through the
host to ggml CPU's own bytes; a lying shape, type or op_param is refused by that op's rule, and
the host serves on."""

import logging

import numpy as np
import pytest

from apir.host.shapes import op_enums
from tests.host.shapekit import ERROR, Case, Remote, _direct, _in, _ints, case_tests, ctor


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

CASES = [
    Case("FLASH_ATTN_EXT", _fa(), lie=(0, 2, -1)),  # 3 heads of q for 2 of k
    Case("FLASH_ATTN_EXT", _fa(sinks=True, max_bias=8.0), lie=(3, 0, -1)),  # mask shorter than kv
    Case("FLASH_ATTN_EXT", _fa(type_k="F32", type_v="F32", mask=False, softcap=10.0, prec=0), lie=(-1, 0, -1)),
    Case("FLASH_ATTN_EXT", _fa(type_k="BF16", type_v="BF16", heads=2, kv_heads=1, n=2), lie=(-1, 1, -1),
         data={1: _bf16, 2: _bf16}),
    Case("FLASH_ATTN_EXT", _fa(type_k="Q8_0", type_v="Q8_0"), lie=(2, 2, 1),  # v of 3 heads for q of 4
         data={1: _Q8, 2: _Q8}),
    Case("FLASH_ATTN_EXT", _fa(type_k="Q4_0", type_v="F16", permute=True, sinks=True), lie=(3, 1, -1),  # mask rows < q rows
         data={1: _Q4}),
    Case("FLASH_ATTN_EXT", _fa(dk=64, dv=32, permute=True), lie=(-1, 2, -1)),
    Case("RWKV_WKV6", _linear("ggml_rwkv_wkv6", 4, tf=True), lie=(0, 2, -1)),  # k of 3 tokens
    Case("RWKV_WKV6", _linear("ggml_rwkv_wkv6", 4, tf=True, n_seqs=1, t=3), lie=(3, 0, -1)),  # time_faaaa short
    Case("GATED_LINEAR_ATTN", _linear("ggml_gated_linear_attn", 4, scale=0.5), lie=(-1, 1, -1)),
    Case("RWKV_WKV7", _linear("ggml_rwkv_wkv7", 6, s_=64), lie=(6, 1, -1)),  # state of 1 sequence
    Case("SSM_CONV", _ssm_conv(), lie=(1, 0, -1)),
    Case("SSM_CONV", _ssm_conv(d_conv=3, n_t=1, n_s=1), lie=(0, 1, -1)),
    Case("GATED_DELTA_NET", _gdn(), lie=(4, 0, 1), data=_SMALL),  # beta of 2 per head
    Case("GATED_DELTA_NET", _gdn(kda=True, snapshots=3, v_repeat=2), lie=(1, 0, -1), data=_SMALL),
    Case("GATED_DELTA_NET", _gdn(permuted=True, snapshots=2), lie=(-1, 1, -1), data=_SMALL),
    Case("SSM_SCAN", _ssm_scan(snapshots=2), lie=(1, 1, -1), data={6: _ints(3)}),  # x of 3 heads
    Case("SSM_SCAN", _ssm_scan(mamba1=True), lie=(4, 1, 1), data={6: _ints(3)}),  # 3 groups
    Case("LIGHTNING_INDEXER", _indexer(), lie=(3, 0, -1)),  # mask shorter than kv
    Case("LIGHTNING_INDEXER", _indexer(type_k="Q8_0"), lie=(-1, 0, -1), data={1: _Q8}),
    Case("LIGHTNING_INDEXER", _indexer(type_k="F16"), lie=(2, 0, -1)),
    Case("DSV4_HC_COMB", _hc_comb, lie=(0, 0, -4)),  # hc = 3 has no kernel
    Case("DSV4_HC_PRE", _hc_pre, lie=(1, 1, -1)),
    Case("DSV4_HC_POST", _hc_post, lie=(3, 2, -1)),
]
IDS = [f"{c.op}-{i}" for i, c in enumerate(CASES)]
remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused = case_tests(CASES, IDS)


def _lie(remote, ggml, caplog, t, field, index, value, dtype=np.int32):
    """Sets `field`[index] of tensor t's record (op_params as raw int32 words) and computes."""
    recs = remote.recs.copy()
    i = remote.index(t)
    if field == "op_params":
        recs["op_params"][i][index] = np.array([value]).astype(dtype).view(np.int32)[0]
    elif field == "type":
        recs["type"][i] = ggml.types[value]
    else:
        recs[field][i][index] = value
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = remote.compute(recs)
    return rc


def test_rwkv_wkv7_head_size_off_the_simd_step_is_refused(guest, ggml, caplog):
    """The SIMD kernel would load and store a whole GGML_F32_STEP past a head of 8 floats."""
    r = Remote(guest, ggml, Case("RWKV_WKV7", _linear("ggml_rwkv_wkv7", 6)))
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute()
    assert rc == ERROR and "head size 8 is not a multiple of 64" in caplog.text, caplog.text
    r.close()


@pytest.mark.parametrize("bad", [[0, 3], [-1, 1]])
def test_ssm_scan_state_ids_out_of_range(guest, ggml, caplog, bad):
    """ids pick the initial state of each sequence (s + ids[i] * nb[3]): s has 3."""
    case = Case("SSM_SCAN", _ssm_scan(), data={6: lambda n, r: np.array(bad, np.int32)})
    r = Remote(guest, ggml, case)
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute()
    assert rc == ERROR and "(SSM_SCAN): row id out of [0, 3)" in caplog.text, caplog.text
    r.close()


@pytest.mark.parametrize("op,build,which", [
    ("FLASH_ATTN_EXT", _fa(heads=1, kv_heads=1), -1),  # the result's rows step by nb[1]
    ("SSM_SCAN", _ssm_scan(n_head=1, n_group=1, snapshots=2), 0),  # s's nb[2]: bytes of a snapshot copy
])
def test_stride_of_a_dimension_of_one_is_checked(guest, ggml, caplog, op, build, which):
    """ggml_is_contiguous ignores the stride of a dimension of ne 1 (and so does the extent
    check), but these kernels use it for another dimension: a large one would write far
    outside the result."""
    case = Case(op, build, data={6: _ints(3)} if op == "SSM_SCAN" else None)
    r = Remote(guest, ggml, case)
    t = r.out if which < 0 else r.inputs[which]
    dim = 1 if which < 0 else 2
    assert int(r.recs["ne"][r.index(t)][dim]) == 1
    assert _lie(r, ggml, caplog, t, "nb", dim, 1 << 30) == ERROR
    assert f"({op})" in caplog.text and "packed" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    assert r.result() == _direct(ggml, case)
    r.close()


@pytest.mark.parametrize("n_iter", [0, -3])
def test_dsv4_hc_comb_n_iter(guest, ggml, caplog, n_iter):
    """The kernel GGML_ASSERTs n_iter > 0."""
    r = Remote(guest, ggml, next(c for c in CASES if c.op == "DSV4_HC_COMB"))
    assert _lie(r, ggml, caplog, r.out, "op_params", 1, n_iter) == ERROR
    assert "(DSV4_HC_COMB): n_iter" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    r.close()


@pytest.mark.parametrize("snapshots", [0, -1, 2])
def test_gated_delta_net_snapshot_count(guest, ggml, caplog, snapshots):
    """K < 1 (the kernel GGML_ASSERTs K >= 1) or a K the result has no rows for is refused."""
    if op_enums(ggml).version < (0, 20, 0):
        pytest.skip("ggml 0.10's gated_delta_net has no snapshot count")
    r = Remote(guest, ggml, next(c for c in CASES if c.op == "GATED_DELTA_NET"))  # K = 1
    assert _lie(r, ggml, caplog, r.out, "op_params", 0, snapshots) == ERROR
    assert "(GATED_DELTA_NET)" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    r.close()


@pytest.mark.parametrize("field,index,value,dtype", [
    ("op_params", 3, 5, np.int32),  # precision the kernel aborts on
    ("op_params", 1, 8.0, np.float32),  # max_bias without a mask
])
def test_flash_attn_ext_bad_op_params(guest, ggml, caplog, field, index, value, dtype):
    r = Remote(guest, ggml, CASES[2])
    assert _lie(r, ggml, caplog, r.out, field, index, value, dtype) == ERROR
    assert "(FLASH_ATTN_EXT)" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    r.close()


@pytest.mark.parametrize("which,field,index,value", [
    (0, "type", 0, "F16"),  # q read as F32 rows
    (3, "type", 0, "F32"),  # the mask is F16
    (-1, "nb", 2, 0),  # result rows written at (i2 + i1*ne1) * nb[1]: not contiguous
    (0, "nb", 0, 8),  # q rows not contiguous
    (4, "nb", 0, 8),  # sinks read as a plain array
])
def test_flash_attn_ext_bad_types_and_strides(guest, ggml, caplog, which, field, index, value):
    r = Remote(guest, ggml, CASES[1])
    t = r.out if which < 0 else r.inputs[which]
    if field == "nb" and value == 0:
        value = int(r.recs["nb"][r.index(t)][1])
    rc = _lie(r, ggml, caplog, t, field, index, value)
    assert rc == ERROR
    assert "(FLASH_ATTN_EXT)" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    r.close()
