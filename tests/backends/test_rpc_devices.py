"""The devices extension over two ggml-rpc servers (`rpc:H:P,rpc:H:P`, ggml CPU behind each):
ggml's scheduler splits a graph over the two apir devices, computing what ggml CPU computes
for the whole graph, byte for byte (also when the guest replays the split graphs by id)."""

import subprocess
import sys

import pytest

from tests.backends.conftest import REPO, base_env, rpc_server
from tests.ggml_backends import free_port

pytestmark = pytest.mark.rpc


def test_a_split_over_two_rpc_server_devices_equals_local_cpu(backends_build, tmp_path):
    ports = [free_port(), free_port()]
    servers = [rpc_server(backends_build, p, tmp_path / f"rpc{i}.log") for i, p in enumerate(ports)]
    try:
        spec = ",".join(f"rpc:127.0.0.1:{p}" for p in ports)
        run = subprocess.run([sys.executable, "tests/backends/devices_run.py", spec],
                             env=base_env(backends_build, False), cwd=REPO, capture_output=True, text=True,
                             timeout=600)
    finally:
        for s in servers:
            s.close()
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines()]
    local = [x for x in lines if x[0] == "local"]
    apir = [x for x in lines if x[0] == "apir"]
    assert [x[1] for x in lines if x[0] == "devices"] == ["2"]
    assert len(apir) == 2 and int(apir[0][1]) >= 2
    assert all(a[2] == local[0][2] for a in apir)
