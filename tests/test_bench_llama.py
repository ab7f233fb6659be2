"""benchmarks/bench_llama.py's choice of backend and device, and tests/llama/build.py's Vulkan
build marker, without llama.cpp (the benchmark itself runs in benchmarks/, never in tests)."""

import stat
from pathlib import Path

import pytest

from tests.benchkit import load_benchmark
from tests.llama import build as llama_build


def _bench():
    return load_benchmark("bench_llama")


def test_vulkan_index_takes_cpu_and_vulkan_devices_only():
    bench = _bench()
    assert bench.vulkan_index("cpu") is None
    assert bench.vulkan_index("vulkan") == 0
    assert bench.vulkan_index("Vulkan:1") == 1
    for bad in ("rpc:127.0.0.1:50052", "vulkan:x", "vulkan:", "cpu:0", "cuda:0"):
        with pytest.raises(ValueError):
            bench.vulkan_index(bad)


def _fake_llama_bench(tmp_path: Path, listing: str) -> dict:
    prog = tmp_path / "llama-bench"
    prog.write_text(f"#!/bin/sh\n[ \"$1\" = --list-devices ] || exit 9\nprintf '%s' '{listing}'\n")
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    return {"LLAMA_BENCH": str(prog)}


def test_list_devices_reads_the_names_llama_cpp_prints(tmp_path):
    bench = _bench()
    listing = ("Available devices:\n  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (7945 MiB, 7945 MiB free)\n"
               "  [virtgpu] Vulkan0: NVIDIA H200 (143771 MiB, 142000 MiB free)\n")
    paths = _fake_llama_bench(tmp_path, listing)
    assert bench.list_devices(paths, {}) == ["Vulkan0", "[virtgpu] Vulkan0"]
    paths = _fake_llama_bench(tmp_path, "Available devices:\n  (none)\n")
    assert bench.list_devices(paths, {}) == []


def test_is_built_vulkan_needs_its_own_marker_and_paths_env(monkeypatch, tmp_path):
    monkeypatch.setenv("APIR_CACHE_DIR", str(tmp_path))
    out = llama_build.build_dir()
    assert out == tmp_path / "llama-cpp" / llama_build.LLAMA_VERSION
    (out / "build-vulkan").mkdir(parents=True)
    (out / "build-vulkan" / "paths.env").write_text("GGML_LIB_DIR=/x\n")
    assert not llama_build.is_built_vulkan()  # stopped half-way: paths.env without the marker
    (out / ".complete").touch()  # the CPU build's marker is not the Vulkan build's
    assert not llama_build.is_built_vulkan()
    (out / ".complete-vulkan").touch()
    assert llama_build.is_built_vulkan()
    assert not llama_build.is_built()  # and the other way round: no build/paths.env
