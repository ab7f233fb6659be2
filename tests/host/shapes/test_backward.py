"""apir.host.graph.shapes.backward: the training ops (SILU_BACK, RMS_NORM_BACK, SOFT_MAX_BACK,
CROSS_ENTROPY_LOSS[_BACK], OPT_STEP_ADAMW / _SGD) in the forms test-backend-ops builds. Each
case, built with ggml's own constructor, computes through the host to ggml CPU's own bytes; a
lying shape or parameter is refused by that op's rule (asserted on the refusal's node, op,
rule and reason), and the host serves on."""

import numpy as np
import pytest

from tests.host.shapekit import (
    Case,
    Remote,
    _in,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    lie_refusal,
    refusal,
    with_op_params,
)


def _same(fn, n, type_name="F32", ne=(8, 3, 2)):
    """A case of `n` sources of one type and shape through `fn(g, ctx, *srcs)`."""

    def build(g, ctx):
        srcs = [_in(g, ctx, type_name, *ne) for _ in range(n)]
        return fn(g, ctx, *srcs), srcs

    return build


def _param(g, ctx, *ne):
    t = _in(g, ctx, "F32", *ne)
    g.ggml_set_param(t)  # ggml_opt_step_* GGML_ASSERT the weights are a parameter
    return t


def _adamw(g, ctx):
    w = _param(g, ctx, 8, 3, 2)
    grad, m, v = (_in(g, ctx, "F32", 8, 3, 2) for _ in range(3))
    p = _in(g, ctx, "F32", 7)
    return g.ggml_opt_step_adamw(ctx, w, grad, m, v, p), [w, grad, m, v, p]


def _sgd(g, ctx):
    w, grad, p = _param(g, ctx, 8, 3, 2), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "F32", 2)
    return g.ggml_opt_step_sgd(ctx, w, grad, p), [w, grad, p]


def _ce_back(g, ctx):
    d, a, b = _in(g, ctx, "F32", 1), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "F32", 8, 3, 2)
    return g.ggml_cross_entropy_loss_back(ctx, d, a, b), [d, a, b]


def _positive(n, r):
    return r.random(n).astype(np.float32) + 0.1


def _adamw_params(n, r):  # alpha, beta1, beta2, eps, weight decay, beta1h, beta2h
    return np.array([1e-2, 0.9, 0.999, 1e-8, 1e-2, 10.0, 1000.0], np.float32)


SILU_BACK = Case("SILU_BACK", _same(lambda g, c, a, b: g.ggml_silu_back(c, a, b), 2), lie=(1, 0, -1), name="f32")
RMS_NORM_BACK = Case(
    "RMS_NORM_BACK", _same(lambda g, c, a, b: g.ggml_rms_norm_back(c, a, b, 1e-6), 2), lie=(1, 1, -1), name="f32"
)
SOFT_MAX_BACK = Case(
    "SOFT_MAX_BACK",
    _same(lambda g, c, a, b: g.ggml_soft_max_ext_back(c, a, b, 0.5, 0.0), 2),
    data={1: _positive},
    name="scale-0.5",
)
OPT_STEP_ADAMW = Case(
    "OPT_STEP_ADAMW", _adamw, lie=(4, 0, -1), data={3: _positive, 4: _adamw_params}, name="params-short"
)

CASES = [
    SILU_BACK,
    Case(
        "SILU_BACK", _same(lambda g, c, a, b: g.ggml_silu_back(c, a, b), 2, "F16"), lie=(0, 1, -1), name="f16"
    ),
    RMS_NORM_BACK,
    SOFT_MAX_BACK,
    Case(
        "CROSS_ENTROPY_LOSS",
        _same(lambda g, c, a, b: g.ggml_cross_entropy_loss(c, a, b), 2),
        lie=(1, 0, -1),
        data={1: _positive},
        name="f32",
    ),
    Case("CROSS_ENTROPY_LOSS_BACK", _ce_back, lie=(2, 1, -1), data={2: _positive}, name="f32"),
    OPT_STEP_ADAMW,
    Case(
        "OPT_STEP_SGD",
        _sgd,
        lie=(1, 1, -1),
        data={2: lambda n, r: np.array([1e-2, 1e-3], np.float32)},
        name="grad-short",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    lie_refusal(guest, ggml, case)


@pytest.mark.parametrize(
    "value,reason",
    [
        pytest.param(np.float32(0.5), "max_bias 0.5 is not 0", id="SOFT_MAX_BACK-max_bias-0.5"),  # the kernel GGML_ASSERTs 0
        pytest.param(np.float32(np.nan), "max_bias nan is not 0", id="SOFT_MAX_BACK-max_bias-nan"),
    ],
)
def test_bad_op_params_are_refused(guest, ggml, value, reason):
    r = Remote(guest, ggml, SOFT_MAX_BACK)
    got = refusal(r, with_op_params(r, 1, value))
    assert_refused_by_rule(got, "SOFT_MAX_BACK", r.index(r.out), reason)
    r.close()


def test_opt_step_state_laid_out_otherwise_is_refused(guest, ggml):
    """OPT_STEP_ADAMW reads and writes m and v at src0's row offsets: a moment tensor of the
    same shape but other strides (its rows transposed) would be walked off its extent."""
    r = Remote(guest, ggml, OPT_STEP_ADAMW)
    recs = r.recs.copy()
    i = r.index(r.inputs[2])
    recs["nb"][i][1], recs["nb"][i][2] = recs["nb"][i][2], recs["nb"][i][1]
    assert_refused_by_rule(refusal(r, recs), "OPT_STEP_ADAMW", r.index(r.out), "src2 F32")
    r.close()


