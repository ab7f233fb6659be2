"""Fixtures of the VM tests (marker `vm`): the provisioned QEMU and kernels, and one guest
session per kernel whose results every test of tests/vm/test_guest.py reads.

Kernels: APIR_VM_KERNELS=bookworm,trixie (comma-separated); default bookworm (6.1) only,
which keeps CI's share to a few minutes. Nothing provisioned and no way to provision (not root,
no debootstrap): the tests skip, saying why -- unless APIR_REQUIRE_SYSTEM_TESTS=1 (CI), where
that is a failure. Each VM's console, the guest program's log and the device's log are
attached to the test report (shown for failures, or always with -rA).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from apir.vm import machine, provision
from tests.cref import REPO
from tests.prereq import missing
from tests.vm.session import C_GUEST_OPS, GUEST_PROGRAM, GuestSession, guest_env, run_guest

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue today."]


def pytest_generate_tests(metafunc):
    if "kernel_suite" in metafunc.fixturenames:
        suites = [s for s in os.environ.get("APIR_VM_KERNELS", "bookworm").split(",") if s]
        metafunc.parametrize("kernel_suite", suites, scope="session")


@pytest.fixture(scope="session")
def provisioned() -> machine.Provisioned:
    """`apir vm provision`'s cache, provisioned on first use."""
    out = provision.cache_dir()
    if not (out / ".complete").exists():
        if os.geteuid() != 0 or not shutil.which("debootstrap"):
            missing(f"no VM provisioned in {out} and provisioning needs root and debootstrap "
                    f"(run `{provision.provision_command(out)}`)")
        out.mkdir(parents=True, exist_ok=True)
        try:
            with open(out / "provision.log", "w") as log:
                provision.provision(out, log=log)
        except machine.NotProvisioned as exc:
            missing(str(exc))
    return provision.find(out)


@pytest.fixture(scope="session")
def vm_kernel(provisioned, kernel_suite) -> machine.Kernel:
    try:
        return provisioned.kernel(kernel_suite)
    except machine.NotProvisioned as exc:
        missing(str(exc))


@pytest.fixture(scope="session")
def vm_work():
    root = Path(tempfile.mkdtemp(prefix="apir-vm-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_embeddings(vm_work):
    """`apir embed --json SENTENCES` in embedded mode on the host, with the guest's Numba
    settings (it also fills the Numba cache the guests load)."""
    work = vm_work / "embedded"
    work.mkdir()
    p = subprocess.run([sys.executable, "-m", "apir", "embed", "--json", *SENTENCES], capture_output=True, text=True,
                       env=dict(os.environ, **guest_env(vm_work)), cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    warm = subprocess.run([sys.executable, str(GUEST_PROGRAM), str(work / "warm.json"), "client", "backend"],
                          capture_output=True, text=True, cwd=work, timeout=600,
                          env=dict(os.environ, **guest_env(vm_work), APIR_VM_GUEST_DEVICE="embedded"))
    assert warm.returncode == 0 and json.loads((work / "warm.json").read_text())["checks"]["backend"]["ok"], (
        warm.stdout + warm.stderr)[-3000:]
    return json.loads(p.stdout)


@pytest.fixture(scope="session")
def guest(provisioned, vm_kernel, vm_work, embedded_embeddings, cref_020) -> GuestSession:
    """apir's guest program in one boot of `vm_kernel`: every check, ggml's C guest
    (test-backend-ops on C_GUEST_OPS), the device killed last."""
    work = vm_work / vm_kernel.suite
    work.mkdir()
    shutil.copytree(vm_work / "numba", work / "numba", dirs_exist_ok=True)
    session = run_guest(provisioned, vm_kernel, work,
                        ["params", "client", "info", "embed", "threads", "backend", "c_guest", "kill"],
                        kill_device=True, name=vm_kernel.suite,
                        extra_env={"APIR_VM_C_GUEST_OPS": json.dumps(C_GUEST_OPS),
                                   "APIR_VM_TEST_BACKEND_OPS": cref_020["TEST_BACKEND_OPS"]})
    return session


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Puts the console and logs of every VM a test used into its report (pytest shows them
    for failures, and for every test with -rA)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call":
        return
    for value in getattr(item, "funcargs", {}).values():
        for session in value.values() if isinstance(value, dict) else [value]:
            if isinstance(session, GuestSession):
                for title, text in session.logs.items():
                    report.sections.append((title, text[-20000:]))
