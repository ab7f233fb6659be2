"""ggml's own C guest in the VM: libggml-virtgpu (linked into the C reference build's
test-backend-ops) on the guest's /dev/dri/renderD128, against apir's device. For a subset of
ops (session.C_GUEST_OPS), every case that passes on ggml CPU (the same binary on the host,
`-b CPU`) passes on "[virtgpu] CPU" in the VM."""

import pytest

from tests.interop import backend_ops as bo
from tests.vm.session import C_GUEST_OPS

pytestmark = pytest.mark.vm


@pytest.fixture(scope="session")
def cpu_cases(cref_020):
    """{op: [(case, status)]} of C_GUEST_OPS on ggml CPU, on the host."""
    out = {}
    for op, params in C_GUEST_OPS:
        cases, rc, err = bo.run_cases(cref_020["TEST_BACKEND_OPS"], "CPU", op, None, 600, params)
        assert rc == 0, err
        out[op] = cases
    return out


@pytest.mark.parametrize("op", [op for op, _ in C_GUEST_OPS])
def test_c_guest_passes_every_case_that_passes_on_cpu(guest, cpu_cases, op):
    run = next(r for r in guest.check("c_guest") if r["op"] == op)
    vm_cases = dict(bo.parse(run["stdout"]))
    passed_on_cpu = [case for case, status in cpu_cases[op] if status == bo.OK]
    assert passed_on_cpu, f"no {op} case passed on CPU"
    failing = {case: vm_cases.get(case, "not run") for case in passed_on_cpu if vm_cases.get(case) != bo.OK}
    assert not failing, f"rc {run['rc']}, stderr {run['stderr']}"
    assert run["rc"] == 0
