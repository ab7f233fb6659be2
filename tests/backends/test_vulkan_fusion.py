"""Use counts on ggml Vulkan (lavapipe): a graph through apir's host runs the fused kernels
local ggml-vulkan runs for it (GGML_VK_PERF_LOGGER's "RMS_NORM_MUL"), with the same bytes;
with apir.host.use_counts=off it runs RMS_NORM and MUL apart, as the host did before."""

import subprocess
import sys

import pytest

from tests.backends.conftest import REPO, base_env

pytestmark = pytest.mark.vulkan


def _run(paths, use_counts: str):
    env = {**base_env(paths, True), "GGML_VK_PERF_LOGGER": "1"}
    run = subprocess.run([sys.executable, "tests/backends/fusion_run.py", use_counts], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    local, _, remote = run.stdout.partition("=== through apir")
    outputs = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("local ", "apir ")))
    return local, remote, outputs


@pytest.mark.parametrize("use_counts", ["on", "off"])
def test_apir_fuses_as_local_vulkan(backends_build, use_counts):
    local, remote, outputs = _run(backends_build, use_counts)
    assert "RMS_NORM_MUL" in local
    if use_counts == "on":
        assert "RMS_NORM_MUL" in remote and "\nMUL:" not in remote
        assert outputs["apir"] == outputs["local"]  # fusion changes bytes exactly as locally
    else:
        assert "RMS_NORM_MUL" not in remote and "\nMUL:" in remote
