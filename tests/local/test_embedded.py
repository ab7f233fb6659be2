"""EmbeddedDevice: the host thread, errors, teardown and open_device's choice."""

import errno
import struct

import pytest

from apir.guest.connect import device_kind, open_device
from apir.guest.embedded import EmbeddedDevice
from apir.guest.errors import DeviceError, IoctlError
from tests.local.test_local_server import EchoContext


@pytest.mark.parametrize("exec_wait_s", [0.0, 1.0])
def test_commands_run_on_the_host_thread(exec_wait_s):
    seen = []

    class Ctx(EchoContext):
        def submit(self, command):
            import threading
            seen.append(threading.current_thread().name)
            super().submit(command)

    dev = EmbeddedDevice(context_factory=Ctx, exec_wait_s=exec_wait_s)
    try:
        dev.context_init(10)
        a, b = dev.create_blob(10), dev.create_blob(10)
        a.memory[0:4] = b"ping"
        dev.execbuffer(struct.pack("<II", a.res_id, b.res_id))
        for _ in range(2000):  # exec_wait_s 0 returns before the command ran
            if b.memory[0]:
                break
            dev.stats()  # a job queued behind the command: it has run once this returns
        assert bytes(b.memory[0:8]) == b"\x01\0\0\0ping"
        assert seen == ["apir-embedded-host"]
        assert dev.stats()["blobs"] == 2
    finally:
        dev.close()
    assert dev.kernel.closed and dev.kernel.memfile.blob_count == 0
    with pytest.raises(DeviceError):
        dev.get_param(1)


def test_refusals_are_ioctl_errors():
    with EmbeddedDevice(context_factory=EchoContext) as dev:
        with pytest.raises(IoctlError) as info:
            dev.execbuffer(b"12345678")
        assert info.value.errno == errno.EINVAL  # no context yet
        assert dev.get_param(12345) == 0
        dev.context_init(10)
        with pytest.raises(IoctlError) as info:
            dev.context_init(10)
        assert info.value.errno == errno.EEXIST


def test_open_device_picks_embedded_by_default(tmp_path):
    assert device_kind() == "embedded"
    assert device_kind(socket="s") == "socket" and device_kind(drm="/dev/dri/renderD128") == "drm"
    with pytest.raises(ValueError):
        device_kind(socket="s", drm="d")
    dev = open_device()
    try:
        assert isinstance(dev, EmbeddedDevice)
    finally:
        dev.close()
    with pytest.raises(DeviceError, match="no apir host"):
        open_device(socket=str(tmp_path / "nobody.sock"))
