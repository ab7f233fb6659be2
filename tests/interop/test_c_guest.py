"""The unmodified C guest (libggml-virtgpu.so) against apir's host, through apir_drm_shim.so."""

import subprocess

import numpy as np
import pytest

from tests.interop.harness import HostProcess, build_program, build_shim, expected_matmul, guest_env, parse


@pytest.mark.parametrize("c_library", [False, True], ids=["apir-dispatcher", "C-backend-library"])
def test_matmul_program_runs_on_apir_host(cref_paths, c_library, tmp_path):
    shim, prog = build_shim(cref_paths), build_program(cref_paths, "virtgpu_matmul")
    K, M, N = 64, 16, 8
    with HostProcess(cref_paths, tmp_path / "host.sock", c_library=c_library) as host:
        run = subprocess.run([str(prog), str(K), str(M), str(N)], env=guest_env(cref_paths, shim, host.socket_path),
                             capture_output=True, text=True, timeout=120)
        assert host.alive(), host.log
    r = parse(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert r["reg_name"] == "ggml-virtgpu"
    assert r["reg_dev_count"] == "1"
    # the C guest prefixes the host device's and buffer type's names
    assert r["dev_name"] == "[virtgpu] CPU"
    assert r["buft_name"] == "[virtgpu] CPU"
    assert r["backend_name"] == "API Remoting backend"
    assert int(r["dev_memory_total"]) > 0
    assert int(r["buft_alignment"]) >= 1
    assert r["roundtrip_equal"] == "1"
    assert r["graph_compute_status"] == "0"
    got = np.array([float.fromhex(v) for v in r["out_virtgpu"].split()])
    cpu = np.array([float.fromhex(v) for v in r["out_cpu"].split()])
    np.testing.assert_array_equal(got, expected_matmul(K, M, N))
    np.testing.assert_array_equal(got, cpu)
    assert r["bitwise_equal"] == "1"


def test_no_host_fails_cleanly(cref_paths, tmp_path):
    """Without a host behind the socket, opening the node fails and the C guest aborts at once
    (GGML_ABORT in virtgpu_open_device): a prompt failure, not a hang."""
    shim, prog = build_shim(cref_paths), build_program(cref_paths, "virtgpu_matmul")
    run = subprocess.run([str(prog)], env=guest_env(cref_paths, shim, tmp_path / "nobody.sock"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == -6  # SIGABRT
    assert "failed to open /dev/dri/apir-local-renderD128" in run.stderr
