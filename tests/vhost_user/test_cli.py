"""`apir host vhost-user`: a real process serving the fake front-end, and its usage errors."""

import json
import os
import signal
import subprocess
import sys

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.guest.client import ApirClient
from apir.host.component.trace import read_trace

from .conftest import wait_for

from .frontend import FakeFrontend, hdr, resp_type
from .gpu import ctx_create
from .guest_driver import FrontendDriver


def read_stats(path):
    try:
        return json.loads(path.read_text())["sockets"]
    except (OSError, ValueError):
        return {}


def start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "apir", "host", "vhost-user", *args],
        stderr=subprocess.PIPE,
        text=True,
    )


def test_serves_two_sockets_and_stops_on_sigterm(tmp_path):
    paths = [str(tmp_path / "a.sock"), str(tmp_path / "b.sock")]
    trace, stats = tmp_path / "trace.jsonl", tmp_path / "stats.json"
    proc = start(
        "--socket", paths[0], "--socket", paths[1], "--shm-size", "64M", "--venus",
        "--trace", str(trace), "--stats", str(stats),
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        assert "virtio-gpu vhost-user device on" in line, line
        for path in paths:
            assert os.stat(path).st_mode & 0o777 == 0o600
            fe = FakeFrontend.connect(path)
            try:
                assert fe.shmem_config[8:16] == bytes(8)  # region 0 unused
                assert int.from_bytes(fe.shmem_config[16:24], "little") == 64 << 20
                assert resp_type(fe.command(ctx_create(1, capset=4))) == T.RESP_OK_NODATA
                assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO))) == T.RESP_OK_DISPLAY_INFO
                wait_for(lambda p=path: read_stats(stats).get(p, {}).get("contexts") == 1, timeout=30)
                if path == paths[0]:  # an APIR HandShake through the process, traced
                    client = ApirClient.connect(FrontendDriver(fe, ctx_id=2, first_res_id=10), handshake_timeout_s=60)
                    client.close()
            finally:
                fe.close()
            wait_for(lambda p=path: read_stats(stats)[p]["sessions_served"] == 1, timeout=30)
            assert read_stats(stats)[path]["contexts"] == 0 and read_stats(stats)[path]["blobs"] == 0
        assert [r["type"] for r in read_trace(str(trace))][:2] == ["HandShake", "LoadLibrary"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0  # generous: a loaded 2-core CI machine
        assert not any(os.path.exists(p) for p in paths)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("shm", ["0", "1000", "12X", "-4096"])
def test_bad_shm_size_is_a_usage_error(tmp_path, shm):
    proc = start("--socket", str(tmp_path / "s.sock"), f"--shm-size={shm}")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "shm-size" in err
    assert not os.path.exists(tmp_path / "s.sock")


def test_a_socket_path_in_use_is_refused(tmp_path):
    path = str(tmp_path / "s.sock")
    first = start("--socket", path)
    try:
        assert "device on" in first.stderr.readline()
        second = start("--socket", path)
        _, err = second.communicate(timeout=60)
        assert second.returncode != 0 and path in err
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
