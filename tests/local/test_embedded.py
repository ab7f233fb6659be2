"""EmbeddedDevice: the host thread, errors and teardown."""

import errno
import struct

import pytest

from apir.guest.errors import DeviceError, IoctlError
from apir.local.embedded import EmbeddedDevice
from tests.local.localkit import EchoContext


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


class SlowContext(EchoContext):
    """An echo command that takes `delay_s` (longer than the host thread's spins)."""

    delay_s = 0.02

    def submit(self, command):
        import time
        time.sleep(self.delay_s)
        super().submit(command)


@pytest.mark.parametrize("host_spin_s", [0.0, 200e-6])
def test_execbuffer_waits_past_the_spin_for_a_slow_command(host_spin_s):
    """exec_wait_s 1 s: execbuffer spins, then blocks, and returns once the command ran."""
    with EmbeddedDevice(context_factory=SlowContext, exec_wait_s=1.0, host_spin_s=host_spin_s) as dev:
        dev.context_init(10)
        a, b = dev.create_blob(10), dev.create_blob(10)
        for n in range(3):
            a.memory[0:4] = struct.pack("<I", 0x1000 + n)
            b.memory[0:8] = bytes(8)
            dev.execbuffer(struct.pack("<II", a.res_id, b.res_id))
            assert bytes(b.memory[0:8]) == b"\x01\0\0\0" + struct.pack("<I", 0x1000 + n)


def test_execbuffer_returns_after_exec_wait_s_while_the_command_runs_on():
    """A command longer than exec_wait_s is not an error (late_ok): its reply comes later."""
    import time

    class SlowerContext(SlowContext):
        delay_s = 0.2  # far past exec_wait_s, even on a busy machine

    with EmbeddedDevice(context_factory=SlowerContext, exec_wait_s=0.002) as dev:
        dev.context_init(10)
        a, b = dev.create_blob(10), dev.create_blob(10)
        a.memory[0:4] = b"late"
        dev.execbuffer(struct.pack("<II", a.res_id, b.res_id))
        assert b.memory[0] == 0  # returned before the 200 ms command finished
        deadline = time.monotonic() + 5
        while b.memory[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert bytes(b.memory[0:8]) == b"\x01\0\0\0late"


@pytest.mark.parametrize("exec_wait_s", [0.0, 1.0])
@pytest.mark.parametrize("host_spin_s", [0.0, 200e-6])
def test_client_calls_with_and_without_host_spins(exec_wait_s, host_spin_s):
    """The whole guest path over the embedded host, deferred reply word included: the device
    type matches what the host's ggml reports, call after call."""
    from apir.guest.client import ApirClient

    dev = EmbeddedDevice(exec_wait_s=exec_wait_s, host_spin_s=host_spin_s)
    with ApirClient.connect(dev) as client:
        lib = dev.kernel.ctx._library
        expected = lib.g.ggml_backend_dev_type(lib.dev)
        assert [client.device_get_type() for _ in range(50)] == [expected] * 50
        assert client.device_get_count() >= 1
