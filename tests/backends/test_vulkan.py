"""apir's host computing on ggml's Vulkan backend (Mesa's lavapipe: Vulkan on the CPU), next to
ggml Vulkan directly. Needs scripts/build-ggml-backends.sh's build (made on first use, about 6
minutes on 2 cores; skipped without its prerequisites, failed under APIR_REQUIRE_SYSTEM_TESTS=1)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests import prereq
from tests.backends.conftest import (
    REPO,
    base_env,
    check_compute_bound_report,
    check_graph_cache_report,
    graph_cache_run,
    host_serve,
    minilm,
)

pytestmark = pytest.mark.vulkan


@pytest.fixture(scope="module")
def vk(backends_build):
    """The build, once its Vulkan device (lavapipe) is seen: ggml prints `ggml_vulkan: 0 = ...`."""
    probe = subprocess.run(
        [sys.executable, "-c", "import apir.ggml, apir.ggml.backend_spec as s; g = apir.ggml.load(); "
         "d = s.resolve(g, 'vulkan:0').devices[0]; print(g.ggml_backend_dev_description(d).decode())"],
        env=base_env(backends_build, True), cwd=REPO, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0 or "ggml_vulkan: 0 = " not in probe.stderr + probe.stdout:
        prereq.missing(f"no ggml Vulkan device on lavapipe: {(probe.stderr + probe.stdout)[-1500:]}")
    assert "llvmpipe" in probe.stdout, probe.stdout
    return backends_build


def test_info_names_the_vulkan_device(vk, tmp_path):
    sock = tmp_path / "host.sock"
    host = host_serve(vk, sock, "vulkan:0", True, tmp_path / "host.log")
    try:
        out = subprocess.run([sys.executable, "-m", "apir", "info", "--socket", str(sock), "--json"],
                             env=base_env(vk, True), cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert info["device"]["name"] == "Vulkan0"
        assert "llvmpipe" in info["device"]["description"]
        assert info["buffer_type"]["name"] == "Vulkan0"
        assert "backend Vulkan" in host.log()
    finally:
        host.close()


def test_minilm_through_apir_is_byte_identical_to_local_vulkan(vk, tmp_path):
    local = minilm(vk, "vulkan:0", tmp_path / "local.npy", True)
    assert local.returncode == 0, local.stderr[-3000:]
    assert "Vulkan0" in local.stdout and "not through APIR" in local.stdout
    sock = tmp_path / "host.sock"
    host = host_serve(vk, sock, "vulkan:0", True, tmp_path / "host.log")
    try:
        remote = minilm(vk, "vulkan:0", tmp_path / "remote.npy", True, device=f"unix:{sock}")
        assert remote.returncode == 0, remote.stderr[-3000:] + host.log()[-3000:]
    finally:
        host.close()
    assert "Vulkan0 through APIR" in remote.stdout
    a, b = np.load(tmp_path / "local.npy"), np.load(tmp_path / "remote.npy")
    assert a.shape == (4, 384) and np.isfinite(a).all()
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # and it is Vulkan's result, not the CPU's: lavapipe's sums differ in the last bits
    cpu = minilm(vk, "cpu", tmp_path / "cpu.npy", False)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    c = np.load(tmp_path / "cpu.npy")
    assert np.abs(a - c).max() < 1e-3


# A subset that keeps CI within a few minutes once lavapipe's shader cache is warm: an
# elementwise op and a unary one. Not GET_ROWS: its 4 cases lavapipe does not support abort the
# C guest, and the runner then re-runs the rest one process per case (over 12 minutes on a
# loaded 2-core machine). Row gathers on Vulkan (the row-id copies on the device) are in the
# MiniLM test above: three GET_ROWS a batch, byte-identical to local ggml Vulkan.
TBO_OPS = "ADD,SCALE"


def test_backend_ops_through_apir_pass_where_vulkan_passes(vk, tmp_path):
    out = tmp_path / "tbo.json"
    done = subprocess.run(
        [sys.executable, "scripts/run-test-backend-ops.py", "--backend", "vulkan:0", "--lavapipe",
         "--ops", TBO_OPS, "--json", str(out), "--host-threads", "1", "--timeout", "900"],
        env=base_env(vk, False), cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    direct, apir = summary["cpu"], summary["apir"]  # "cpu": the baseline, here Vulkan0 directly
    print(done.stdout[-2500:])
    assert direct["ok"] > 50, summary
    assert summary["regressions"] == [], summary["regressions"][:20]
    assert apir["ok"] >= direct["ok"]
    assert done.returncode == 0, done.stdout[-3000:]


def test_repeated_graph_hits_the_cache_with_the_rechecked_row_ids(vk, tmp_path):
    """apir.host.graph.cache on Vulkan: a hit uploads its re-checked row ids into the device
    copy (tests/backends/graph_cache_run.py)."""
    report = graph_cache_run(vk, "vulkan:0", tmp_path / "report.json", True)
    assert report["backend"] == "Vulkan0"
    check_graph_cache_report(report)


def test_deferred_uploads_land_before_every_command_that_sees_them(vk, tmp_path):
    """apir.host.backend.transfers on Vulkan: a set_tensor into a device buffer is queued (ggml-vulkan's
    set_tensor_async from pinned staging), and the guest gets exactly the bytes it set from
    each command after it: compute, get, cpy_tensor, clear, free (a new buffer reads zeros);
    sets past a small staging keep it within its bound; a cached graph's hits read their two
    row-id tensors in one batch, and an id out of range is refused on a hit
    (tests/backends/transfers_run.py). Without the flush before other commands, the get after
    a set reads the old bytes on lavapipe."""
    report = graph_cache_run(vk, "vulkan:0", tmp_path / "report.json", True, script="transfers_run")
    print(json.dumps(report["step_counts"]))
    assert report["backend"] == "Vulkan" and report["deferred"] is True
    for scenario in ("set_set_compute_get", "set_then_get", "set_then_cpy_tensor", "set_then_clear",
                     "set_then_free", "bounded_sets", "row_ids_on_hits", "row_id_out_of_range_refused_on_hit",
                     "after_refusal"):
        assert report[scenario] is True, (scenario, report)
    assert 0 < report["staging_most"] <= report["staging_capacity"]
    deferred, synchronous = report["step_counts"]["deferred"], report["step_counts"]["synchronous"]
    assert deferred["ok"] and synchronous["ok"]
    # a step of 4 sets, a hit reading 2 row-id tensors, a get: the sets and the reads are queued
    assert (deferred["tensor_set_async"], deferred["tensor_get_async"]) == (4, 2)
    assert (synchronous["tensor_set_async"], synchronous["tensor_get_async"]) == (0, 0)
    fences = {k: c["synchronize"] + c["tensor_set"] + c["tensor_get"] for k, c in report["step_counts"].items()}
    assert fences["deferred"] < fences["synchronous"], fences


def test_info_without_a_driver_or_a_device_names_what_is_missing(vk):
    """`apir info --backend vulkan:0` on the Vulkan build with no Vulkan driver said the build had
    no Vulkan (and to build one); now it names the driver, VK_ICD_FILENAMES and docs/gpu.md. With
    lavapipe only, which ggml-vulkan skips unless named: GGML_VK_VISIBLE_DEVICES."""
    def info(**env):
        full = {**base_env(vk, True), **env}
        return subprocess.run([sys.executable, "-m", "apir", "info", "--backend", "vulkan:0"], env=full, cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    none = info(VK_ICD_FILENAMES="/nonexistent/icd.json", VK_DRIVER_FILES="/nonexistent/icd.json")
    assert none.returncode == 1, none.stderr
    assert "this ggml has no backend 'vulkan'" in none.stderr and "/libggml-vulkan.so" in none.stderr
    assert "the Vulkan loader found no driver: install the GPU's Vulkan driver (ICD) or point VK_ICD_FILENAMES" \
        in none.stderr and "(docs/gpu.md)" in none.stderr
    assert "scripts/build-ggml-backends.sh builds one" not in none.stderr
    skipped = info(GGML_VK_VISIBLE_DEVICES="")
    assert skipped.returncode == 1, skipped.stderr
    assert "backend vulkan has 0 device(s); " in skipped.stderr and "GGML_VK_VISIBLE_DEVICES names them" in skipped.stderr
    seen = info()
    assert seen.returncode == 0, seen.stderr
    assert "served by:          Vulkan0 (llvmpipe" in seen.stdout


def test_the_time_limit_and_a_hang_up_stop_a_graph_on_vulkan(vk, tmp_path):
    """ggml-vulkan has no abort callback: the host computes in ranges of nodes and looks at
    the abort flag between them (apir.host.backend.compute_abort): a long graph on lavapipe
    stops at its time limit (GGML_STATUS_ABORTED) and the context serves the next; a guest
    hanging up mid-compute stops it; ranges compute the whole graph's bytes
    (tests/backends/compute_bound_run.py)."""
    report = graph_cache_run(vk, "vulkan:0", tmp_path / "report.json", True, script="compute_bound_run")
    check_compute_bound_report(report)
