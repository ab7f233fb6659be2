"""A Python user's path: llama-cpp-python==0.3.36 built with
CMAKE_ARGS="-DGGML_VIRTGPU=ON" (scripts/build-llama-cpp-python.sh, its own venv), and
`Llama(model_path=..., n_gpu_layers=-1)` generating through apir's host -- the C shim of
tests/interop preloaded into the venv's python as its DRM device -- the same 64 greedy tokens as
the same llama-cpp-python on local ggml CPU (no shim: ggml-virtgpu finds no device), the prompt's
logits within LOGITS_ATOL, and no refusal or failure in the host's log.

The host loads the wheel's own ggml (llama_cpp/lib: libggml-base, libggml-cpu, libggml), not the
llama.cpp build of tests/llama/build.py: apir reads the op and type numbers and the layouts from
the ggml it loads, and these must be the guest's (the same 0.25.3 source gives the same numbers),
and the host computes with the same CPU kernels as the local reference only if it loads the
same compiled kernels: the wheel is built with llama-cpp-python's defaults (GGML_NATIVE=ON,
OpenMP), the llama.cpp build with GGML_NATIVE=OFF, so their kernels may round differently.

Marker `llamapy`: the first build takes about 25 minutes, so CI (tox py311) leaves it out; run
it with `python -m pytest -m llamapy tests/llama/test_python.py` (docs/llama.md). It skips when
the build is missing, unless APIR_REQUIRE_SYSTEM_TESTS=1, which builds it on first use."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests import prereq
from tests.cref import BuildFailed
from tests.interop.harness import HostProcess, build_shim
from tests.llama import build_python
from tests.llama.runner import HOST_ERROR, LOGITS_ATOL, local_env

pytestmark = pytest.mark.llamapy

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "llamapy_generate.py"
N_PREDICT = 64
PROMPT = "The capital of France is"
# as tests/llama/test_generate.py: the same kernels on the same data, bit-identical in practice


@pytest.fixture(scope="session")
def llamapy_paths():
    """paths.env of scripts/build-llama-cpp-python.sh's build; built on first use only when
    APIR_REQUIRE_SYSTEM_TESTS=1, otherwise a missing build skips."""
    if not build_python.is_built() and not prereq.required():
        prereq.missing("llama-cpp-python is not built: run `python -m tests.llama.build_python` (about 25 minutes)")
    try:
        paths = build_python.build()
    except (BuildFailed, OSError) as exc:
        prereq.missing(f"llama-cpp-python build failed: {exc}")
    # what tests/interop/harness needs of a build: its cache key and the shim's UAPI header
    return {**paths, "GGML_BUILD": str(build_python.build_dir() / "build")}


def _run(paths, model, env, tmp_path, name):
    """The program's process (not checked yet) and where it writes the prompt's logits."""
    logits = tmp_path / f"{name}.npy"
    run = subprocess.run([paths["PYTHON"], str(PROGRAM), str(model), str(N_PREDICT), PROMPT, str(logits)],
                         env=env, capture_output=True, text=True, timeout=900)
    return run, logits


def _result(run, logits):
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout)
    out["logits"] = np.load(logits)
    out["stderr"] = run.stderr
    return out


def test_llama_cpp_python_same_tokens_as_local_cpu(llamapy_paths, smollm2, tmp_path):
    local = _result(*_run(llamapy_paths, smollm2, local_env(llamapy_paths), tmp_path, "local"))
    sock = tmp_path / "apir.sock"
    # presented as a GPU: a remote device of type CPU is taken by llama.cpp for its own CPU
    # (docs/llama.md)
    with HostProcess(llamapy_paths, sock, n_threads=1, device_type="gpu") as host:
        env = {**local_env(llamapy_paths), "LD_PRELOAD": str(build_shim(llamapy_paths)), "APIR_SHIM_SOCKET": str(sock)}
        try:
            run = _run(llamapy_paths, smollm2, env, tmp_path, "apir")
        finally:
            host.stop()
        errors = [line for line in host.log.splitlines() if HOST_ERROR.search(line)]
    # first: a refusal also ends the guest (ggml-virtgpu aborts on a failed command), and the
    # host's line names the cause
    assert errors == [], "the host refused or failed commands"
    remote = _result(*run)
    # the guest really used the host: llama.cpp names the device it offloaded the layers to
    assert "[virtgpu] CPU" in remote["stderr"]
    assert "[virtgpu]" not in local["stderr"]
    # llama_supports_gpu_offload(): a GPU device is registered -- the virtgpu one, only with the shim
    assert remote["gpu_offload"] and not local["gpu_offload"]
    assert remote["prompt"] == local["prompt"]
    assert len(local["generated"]) == N_PREDICT  # no end-of-generation token in the first 64
    assert remote["generated"] == local["generated"], (local["text"], remote["text"])
    assert remote["logits"].shape == local["logits"].shape == (len(local["prompt"]), local["logits"].shape[1])
    assert np.abs(remote["logits"] - local["logits"]).max() <= LOGITS_ATOL
