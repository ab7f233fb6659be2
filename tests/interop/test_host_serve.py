"""`apir host serve` with a C backend library named only in its configuration (the default
library factory, apir.host.backend.c_library.c_library_factory), and its refusal to mix two ggml
builds in one process."""

import os
import subprocess
import sys
import time

import numpy as np

from tests.interop.harness import REPO, build_program, build_shim, c_build_env, guest_env
from tests.interop.harness import expected_matmul, parse

# LoadLibrary in a process whose first libggml-base is `base`: the C library binds to it.
_LOAD = r"""
import sys
from apir.codec.constants import ApirCommandType as T, ApirBackendCommandType as Cmd
from apir.host.component.context import HostContext
from tests.host.hostkit import Guest
import apir.ggml
apir.ggml.load()  # this process's ggml comes first: the C library binds its libggml-base
g = Guest(HostContext(1, {"apir.load_library.path": sys.argv[1], "ggml.library.path": sys.argv[2],
                          "ggml.library.reg": "ggml_backend_cpu_reg"}), load=False)
rc, _ = g.command(T.LOADLIBRARY, 0)
print("loadlibrary", rc)
if rc == 0:
    rc, d = g.forward(Cmd.DEVICE_GET_NAME)
    print("device", rc, d.string())
g.close()
"""


def _load_library(paths, env):
    run = subprocess.run([sys.executable, "-c", _LOAD, paths["LIBGGML_VIRTGPU_BACKEND"], paths["LIBGGML_CPU"]],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.split("\n"), run.stderr


def test_default_factory_opens_the_c_library(cref_paths):
    out, _ = _load_library(cref_paths, c_build_env(cref_paths))
    assert out[:2] == ["loadlibrary 0", "device 0 CPU"]


def test_default_factory_refuses_two_ggml_builds(cref_paths):
    """apir's default ggml (the libggml-python wheel) loaded first, the C build's CPU library
    configured: 6 + APIR_BACKEND_INITIALIZE_CANNOT_OPEN_GGML_LIBRARY (4) = 10, which LoadLibrary
    answers as 14 (its ggml-dispatcher codes are offset by 4)."""
    env = dict(os.environ)
    for key in ("APIR_GGML_LIB_DIR", "APIR_GGML_INCLUDE_DIR"):
        env.pop(key, None)
    env["PYTHONPATH"] = str(REPO)
    out, err = _load_library(cref_paths, env)
    assert out[0] == "loadlibrary 14", (out, err)
    assert "two ggml builds would mix" in err


def test_apir_host_serve_with_configured_c_library(cref_paths, tmp_path):
    """`apir host serve --backend-library LIB --ggml-library CPU --ggml-reg SYM` on the C
    build's ggml: the unmodified C guest computes mul_mat + add through the C library."""
    sock = tmp_path / "serve.sock"
    cmd = [sys.executable, "-m", "apir", "host", "serve", "--socket", str(sock),
           "--backend-library", cref_paths["LIBGGML_VIRTGPU_BACKEND"],
           "--ggml-library", cref_paths["LIBGGML_CPU"], "--ggml-reg", "ggml_backend_cpu_reg"]
    host = subprocess.Popen(cmd, env=c_build_env(cref_paths), cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not sock.exists() and host.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert sock.exists(), "apir host serve did not start"
        shim, prog = build_shim(cref_paths), build_program(cref_paths, "virtgpu_matmul")
        K, M, N = 64, 16, 8
        run = subprocess.run([str(prog), str(K), str(M), str(N)], env=guest_env(cref_paths, shim, sock),
                             capture_output=True, text=True, timeout=120)
        assert host.poll() is None
    finally:
        host.terminate()
        _, log = host.communicate(timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr + log
    r = parse(run.stdout)
    assert r["graph_compute_status"] == "0"
    got = np.array([float.fromhex(v) for v in r["out_virtgpu"].split()])
    np.testing.assert_array_equal(got, expected_matmul(K, M, N))
    assert r["bitwise_equal"] == "1"
