"""The devices extension over two different backends: an apir host serving `cpu,vulkan:0`
(lavapipe), ggml's scheduler splitting a graph over the two apir devices, computing what the
same split over local ggml CPU and ggml Vulkan computes, byte for byte (also when the guest
replays the split graphs by id)."""

import subprocess
import sys

import pytest

from tests.backends.conftest import REPO, base_env

pytestmark = pytest.mark.vulkan


def test_a_split_over_cpu_and_vulkan_devices_equals_the_local_split(backends_build):
    run = subprocess.run([sys.executable, "tests/backends/devices_run.py"], env=base_env(backends_build, True),
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines()]
    local = [x for x in lines if x[0] == "local"]
    apir = [x for x in lines if x[0] == "apir"]
    devices = [x for x in lines if x[0] == "devices"]
    assert devices[0][1] == "2" and "llvmpipe" in " ".join(devices[0])
    assert len(local) == 1 and len(apir) == 2 and int(local[0][1]) >= 2  # (split locally too)
    assert all(a[2] == local[0][2] for a in apir) and int(apir[0][1]) >= 2
