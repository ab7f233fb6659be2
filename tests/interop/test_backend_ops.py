"""A representative subset of ggml's test-backend-ops on the virtgpu device served by apir's
host (Python dispatcher), against the same cases on ggml CPU directly. The whole suite:
scripts/run-test-backend-ops.py."""

import pytest

from tests.interop import backend_ops as bo
from tests.interop.harness import HostProcess, build_shim, guest_env

# (op, parameter regex or None): unary and binary element-wise ops, reductions/normalisation,
# data movement, and mat-mul over float and quantized types — a cross-section of what a model
# graph uses, chosen to run in about a minute per ggml version.
SUBSET = [
    ("ABS", None),
    ("GELU", None),
    ("SILU", None),
    ("SCALE", None),
    ("ADD", r"type=f32,"),
    ("MUL", r"type=f32,ne=\[10,5,4,3\],"),
    ("SOFT_MAX", r"type=f32,ne=\[16,2,32,1\],mask=[01],sinks=0"),
    ("RMS_NORM", r"type=f32,ne=\[64,5,4,3\]"),
    ("GET_ROWS", r"type=(f32|f16|q4_0),n=256,m=5,r=4,be1=1,be2=1,v=0"),
    ("CPY", r"type_src=f32,type_dst=(f16|q4_0|q8_0),ne(_src)?=\[256,4,4,4\]|type_src=f32,type_dst=f16,ne(_src)?=\[256,2,3,4\]"),
    ("MUL_MAT", r"type_a=(f32|f16|q4_0|q8_0),type_b=f32,m=16,n=1,k=256,bs=\[1,1\],nr=\[1,1\]"),
]


@pytest.fixture(scope="module")
def apir_host(cref_paths, tmp_path_factory):
    with HostProcess(cref_paths, tmp_path_factory.mktemp("tbo") / "host.sock") as host:
        yield host


def run_both(paths, host, op, params):
    tbo = paths["TEST_BACKEND_OPS"]
    cpu = bo.run_op(tbo, op, "CPU", None, params=params, max_resume=0, timeout=300)
    env = guest_env(paths, build_shim(paths), host.socket_path)
    apir = bo.run_op(tbo, op, bo.VIRTGPU_DEVICE, env, expected=cpu.passed_runs(), params=params, timeout=300)
    return cpu, apir


@pytest.mark.parametrize("op,params", SUBSET, ids=[op for op, _ in SUBSET])
def test_op_through_apir_matches_cpu(cref_paths, apir_host, op, params):
    cpu, apir = run_both(cref_paths, apir_host, op, params)
    assert cpu.count(bo.OK) > 0, f"no {op} case ran on CPU: the subset's filter matches nothing"
    bad = bo.regressions({op: cpu}, {op: apir})
    assert not bad, "\n".join(bad + apir.notes[:3])
    assert apir.count(bo.OK) >= cpu.count(bo.OK)
    assert apir.count(bo.FAIL) == apir.count(bo.CRASHED) == 0
    assert apir_host.alive(), apir_host.log


# Cases that were gaps of apir's host (refused in backend_graph_compute while device_supports_op
# said yes, so the C guest aborted), found by this suite.
def test_add_with_permuted_source(cref_paths, apir_host):
    """ADD with src1 permuted (nb[0] is not the element size)."""
    cpu, apir = run_both(cref_paths, apir_host, "ADD", r"type=f32,ne=\[10,5,4,3\],nr=\[1,1,1,1\],nf=1,perm1=1")
    assert cpu.count(bo.OK) == 1
    assert not bo.regressions({"ADD": cpu}, {"ADD": apir})
    assert apir.count(bo.OK) == 1


def test_soft_max_with_sinks(cref_paths, apir_host):
    cpu, apir = run_both(cref_paths, apir_host, "SOFT_MAX",
                         r"type=f32,ne=\[16,2,32,1\],mask=0,sinks=1,m_prec=f32,nr23=\[1,1\],scale=0.1.*inplace=0")
    assert cpu.count(bo.OK) == 1
    assert not bo.regressions({"SOFT_MAX": cpu}, {"SOFT_MAX": apir})
    assert apir.count(bo.OK) == 1


def test_cpy_permuted_to_quantized(cref_paths, apir_host):
    cpu, apir = run_both(cref_paths, apir_host, "CPY",
                         r"type_src=f32,type_dst=q8_0,ne(_src)?=\[256,2,3,4\],permute(_src)?=\[0,2,1,3\]")
    assert cpu.count(bo.OK) == 1
    assert not bo.regressions({"CPY": cpu}, {"CPY": apir})
    assert apir.count(bo.OK) == 1


def test_glu_ops(cref_paths, apir_host):
    """GEGLU / REGLU / SWIGLU, fused and split, on f32 and f16."""
    for op in ("GEGLU", "REGLU", "SWIGLU"):
        cpu, apir = run_both(cref_paths, apir_host, op, r"type=f(32|16),ne_a=\[128,2,2,2\]")
        assert cpu.count(bo.OK) > 0, op
        assert not bo.regressions({op: cpu}, {op: apir}), (op, apir.notes[:3])
        assert apir.count(bo.OK) == cpu.count(bo.OK)


# ggml's own cases of the ops of apir/host/graph/shapes/tensor_ops.py (refused for want of a rule
# before): ACC and SET place src1 by op_params, FILL in place or not, TRI's four types, ...
TENSOR_OPS = [
    ("ACC", None),
    ("SET", None),
    ("CUMSUM", r"ne=\[(10|127|128),5,4,3\]"),
    ("FILL", r"ne=\[10,10,4,3\]"),
    ("DIAG", None),
    ("TRI", r"ne=\[10,10,4,3\]"),
    ("SOLVE_TRI", r"ne_lhs=\[(10|11|17|30|42),"),
]


@pytest.mark.parametrize("op,params", TENSOR_OPS, ids=[op for op, _ in TENSOR_OPS])
def test_tensor_ops(cref_paths, apir_host, op, params):
    cpu, apir = run_both(cref_paths, apir_host, op, params)
    assert cpu.count(bo.OK) > 0, f"no {op} case ran on CPU: the filter matches nothing"
    assert not bo.regressions({op: cpu}, {op: apir}), apir.notes[:3]
    assert apir.count(bo.OK) == cpu.count(bo.OK)
    assert apir_host.alive(), apir_host.log
