"""A hostile guest against ggml-vulkan's fused MoE router (TOPK_MOE_EARLY_SOFTMAX), which the
host's use counts (apir.ggml.cgraph) would let run: the fused kernel writes only the top-k view
of its ARGSORT, so ids a second reader takes from the rest of it (through a view that names
another tensor as its src, hiding the use) were whatever the guest left there, out of range
for its GET_ROWS; and it GGML_ASSERTs the view's row stride, which no op's rule asks, aborting
the host process. The host never lets an ids writer be fused away
(tests/backends/topk_fusion_run.py is the guest)."""

import subprocess
import sys

import pytest

from tests.backends.conftest import REPO, base_env

pytestmark = pytest.mark.vulkan


def _run(paths, *args):
    env = {**base_env(paths, True), "GGML_VK_PERF_LOGGER": "1"}
    run = subprocess.run([sys.executable, "tests/backends/topk_fusion_run.py", *map(str, args)], env=env,
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    out = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("rc ", "apir ", "cpu ")))
    return run.stdout, out


def test_ids_past_the_top_k_are_computed_not_left_by_the_guest(backends_build):
    log, out = _run(backends_build, 200000000)
    assert "TOPK_MOE" not in log
    assert out["rc"] == "0 status 0"
    assert out["apir"] == out["cpu"]


def test_a_top_k_view_of_another_row_stride_does_not_abort_the_host(backends_build):
    log, out = _run(backends_build, 5, 3)
    assert out["rc"] == "0 status 0"
    assert out["apir"] == out["cpu"]


def test_top_k_ids_out_of_range_never_reach_a_reader(backends_build):
    """ggml-vulkan's TOP_K is no ids writer (apir.host.graph.profiles): ids it computes are
    read before compute like any others, so its GET_ROWS is refused rather than given the
    padding's id ne00 (one row past its table)."""
    env = base_env(backends_build, True)
    run = subprocess.run([sys.executable, "tests/backends/topk_nan_run.py"], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    out = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("rc ", "ids ")))
    ids = [int(i) for i in out["ids"].split()]
    assert out["rc"] == "1 status None" or all(0 <= i < 100 for i in ids), out
