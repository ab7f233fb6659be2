"""EmbeddedDevice: the host thread, commands run inline in the caller's thread, errors and
teardown."""

import dataclasses
import errno
import logging
import struct
import threading
import time

import pytest

from apir.codec.atomics import load_acquire_u32
from apir.codec.constants import (
    VENUS_COMMAND_TYPE_LENGTH,
    ApirBackendCommandType as F,
    ApirCommandType as T,
    ApirExtensionCommandType as X,
    ApirForwardReturnCode,
)
from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS
from apir.guest.errors import DeviceError, IoctlError
from apir.host import HostContext
from apir.local.embedded import EmbeddedDevice
from tests.local.localkit import EchoContext

HOST_THREAD = "apir-embedded-host"


@pytest.mark.parametrize("exec_wait_s", [0.0, 1.0])
def test_a_command_without_an_apir_header_runs_on_the_host_thread(exec_wait_s):
    """The echo command (8 bytes) is too short for an APIR header: it may run long
    (apir.host.component.context.may_run_long), so the host thread runs it, waited for or not."""
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
        assert seen == [HOST_THREAD]
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


class RecordingContext(HostContext):
    """A HostContext that records (thread name, command type as sent, flags) of each command."""

    def __init__(self, ctx_id, capset_id, config):
        super().__init__(ctx_id, config, capset_id=capset_id)
        self.seen = []

    def submit(self, command):
        cmd_type, flags = struct.unpack_from("<II", command)
        self.seen.append((threading.current_thread().name, cmd_type, flags))
        super().submit(command)


@pytest.mark.parametrize("exec_wait_s", [0.0, 1.0])
def test_bounded_commands_run_in_the_callers_thread_and_long_ones_on_the_host_thread(exec_wait_s):
    """exec_wait_s > 0: HandShake and Forward device_get_type run in the caller's thread,
    and so does the extensions' query; LoadLibrary and Forward backend_graph_compute on the host
    thread (the graph is refused
    there: no arguments). exec_wait_s 0: every command on the host thread."""
    from apir.guest.client import ApirClient

    me = threading.current_thread().name
    inline = me if exec_wait_s else HOST_THREAD
    dev = EmbeddedDevice(context_factory=RecordingContext, exec_wait_s=exec_wait_s)
    with ApirClient.connect(dev) as client:
        lib = dev.kernel.ctx._library
        assert client.device_get_type() == lib.g.ggml_backend_dev_type(lib.dev)
        ret, _ = client.remote.call(T.FORWARD, F.BACKEND_GRAPH_COMPUTE)
        assert ret != ApirForwardReturnCode.SUCCESS  # refused: no graph named
        assert client.device_get_type() == lib.g.ggml_backend_dev_type(lib.dev)
        assert dev.kernel.ctx.seen == [
            (inline, T.HANDSHAKE, 0),
            (HOST_THREAD, T.LOADLIBRARY, 0),
            (inline, T.FORWARD, X.EXT_QUERY),
            (inline, T.FORWARD, F.DEVICE_GET_TYPE),
            (HOST_THREAD, T.FORWARD, F.BACKEND_GRAPH_COMPUTE),
            (inline, T.FORWARD, F.DEVICE_GET_TYPE),
        ]


class _GpuLikeLibrary:
    """The built-in backend library as the host would see a GPU's or ggml-rpc's: a profile
    whose kernels do not work in host memory."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def profile(self):
        return dataclasses.replace(self._inner.profile, host_addressable=False)

    @property
    def commands_bounded_in_time(self):
        from apir.host.backend.library import PythonBackendLibrary

        return PythonBackendLibrary.commands_bounded_in_time.fget(self)  # (from the profile above)


def test_a_backend_off_host_memory_runs_every_command_on_the_host_thread(monkeypatch):
    """After LoadLibrary of a backend that is not ggml-cpu (a GPU's or ggml-rpc's copies may
    wait forever on a device or a server), nothing runs inline: the guest's wait keeps its
    limit. HandShake, before LoadLibrary, still runs inline."""
    from apir.guest.client import ApirClient
    from apir.host.component import context as component

    real = component._builtin_library

    def gpu_like():
        return _GpuLikeLibrary(real())

    monkeypatch.setattr(component, "_builtin_library", gpu_like)
    me = threading.current_thread().name
    dev = EmbeddedDevice(context_factory=RecordingContext)
    with ApirClient.connect(dev) as client:
        ctx = dev.kernel.ctx
        assert ctx.commands_bounded_in_time is False
        lib = ctx._library
        assert client.device_get_type() == lib.g.ggml_backend_dev_type(lib.dev)
        assert ctx.seen == [
            (me, T.HANDSHAKE, 0),
            (HOST_THREAD, T.LOADLIBRARY, 0),
            (HOST_THREAD, T.FORWARD, X.EXT_QUERY),
            (HOST_THREAD, T.FORWARD, F.DEVICE_GET_TYPE),
        ]
    monkeypatch.setattr(component, "_builtin_library", real)
    with ApirClient.connect(EmbeddedDevice(context_factory=RecordingContext)) as client:
        assert client.remote.device.kernel.ctx.commands_bounded_in_time is True  # ggml-cpu


@pytest.mark.parametrize("capset_id", [VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS])
def test_the_header_is_read_as_the_context_reads_it(capset_id):
    """Over the Venus capset the command types carry 331 more; the reply of an inline command
    is in the reply word when execbuffer returns (Forward without a library: NO_DISPATCH_FCT)."""
    offset = VENUS_COMMAND_TYPE_LENGTH if capset_id == VIRTGPU_DRM_CAPSET_VENUS else 0
    me = threading.current_thread().name
    with EmbeddedDevice(context_factory=RecordingContext) as dev:
        dev.context_init(capset_id)
        reply = dev.create_blob(4096)
        dev.execbuffer(struct.pack("<III", T.FORWARD + offset, F.DEVICE_GET_NAME, reply.res_id))
        assert load_acquire_u32(reply.memory, 0) == ApirForwardReturnCode.NO_DISPATCH_FCT + 1
        # a type the context does not know (Forward + 331 over APIR, 330 over Venus): host thread
        unknown = T.FORWARD + VENUS_COMMAND_TYPE_LENGTH if not offset else VENUS_COMMAND_TYPE_LENGTH - 1
        dev.execbuffer(struct.pack("<III", unknown, F.DEVICE_GET_NAME, reply.res_id))
        assert [thread for thread, _, _ in dev.kernel.ctx.seen] == [me, HOST_THREAD]
        dev.destroy_blob(reply)


class OrderContext:
    """A context stand-in of APIR headers that defers its notification as HostContext does:
    Forward buffer_clear takes `slow_s`; each command's reply word gets 1 + its place in
    `seen`, a list of (flags, thread name, start, end)."""

    slow_s = 0.2

    def __init__(self, ctx_id, capset_id, config):
        self.res = {}
        self.seen = []
        self.defer_notification = False
        self._pending = None

    def add_resource(self, res_id, memory):
        self.res[res_id] = memory

    def remove_resource(self, res_id):
        self.res.pop(res_id, None)

    def submit(self, command):
        _, flags, reply_id = struct.unpack_from("<III", command)
        start = time.monotonic()
        if flags == F.BUFFER_CLEAR:
            time.sleep(self.slow_s)
        self.seen.append((flags, threading.current_thread().name, start, time.monotonic()))
        from apir.codec.atomics import Word

        note = (Word(self.res[reply_id], 0), len(self.seen) + 1)
        if self.defer_notification:
            self._pending = note
        else:
            note[0].store_release(note[1])

    def take_notification(self):
        note, self._pending = self._pending, None
        return note

    def close(self):
        pass


def _forward(flags, reply):
    return struct.pack("<III", T.FORWARD, flags, reply.res_id)


def test_an_inline_run_waits_for_an_outstanding_nowait_job_and_keeps_order():
    """A bounded command sent while a slow one queued with execbuffer_nowait still runs runs
    after it, on the host thread, and both replies are stored when execbuffer returns; once
    the host thread is idle, the next runs in the caller's thread again, queueing nothing."""
    me = threading.current_thread().name
    with EmbeddedDevice(context_factory=OrderContext, exec_wait_s=5.0) as dev:
        dev.context_init(10)
        slow_reply, reply = dev.create_blob(4096), dev.create_blob(4096)
        dev.execbuffer_nowait(_forward(F.BUFFER_CLEAR, slow_reply))
        dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply))
        seen = dev.kernel.ctx.seen
        assert [(flags, thread) for flags, thread, _, _ in seen] == [
            (F.BUFFER_CLEAR, HOST_THREAD),
            (F.DEVICE_GET_TYPE, HOST_THREAD),
        ]
        assert seen[1][2] >= seen[0][3]  # started after the slow one ended
        assert load_acquire_u32(slow_reply.memory, 0) == 2 and load_acquire_u32(reply.memory, 0) == 3
        queued = dev._queued
        for n in range(3):
            reply.memory[0:4] = bytes(4)
            dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply))
            assert seen[-1][:2] == (F.DEVICE_GET_TYPE, me)
            assert load_acquire_u32(reply.memory, 0) == 4 + n
        assert dev._queued == queued  # nothing was queued: the host thread had nothing to wake for
        # a nowait job then a waited one, again in order; the host thread's reply store of the
        # first comes before the second's
        dev.execbuffer_nowait(_forward(F.BUFFER_CLEAR, slow_reply))
        dev.execbuffer(_forward(F.DEVICE_GET_NAME, reply))
        assert [flags for flags, _, _, _ in seen[-2:]] == [F.BUFFER_CLEAR, F.DEVICE_GET_NAME]
        assert load_acquire_u32(slow_reply.memory, 0) == 7 and load_acquire_u32(reply.memory, 0) == 8


class FailingContext(OrderContext):
    """Forward device_get_name raises in submit (a host bug); Forward device_get_description
    leaves a notification whose hand-over raises."""

    def submit(self, command):
        _, flags, _ = struct.unpack_from("<III", command)
        if flags == F.DEVICE_GET_NAME:
            raise RuntimeError("host bug in submit")
        super().submit(command)
        if flags == F.DEVICE_GET_DESCRIPTION:
            self._pending = "not a notification"

    def take_notification(self):
        note, self._pending = self._pending, None
        if note == "not a notification":
            raise RuntimeError("host bug in take_notification")
        return note


def test_errors_of_an_inline_run_surface_as_on_the_host_thread(caplog):
    """submit raising: IoctlError(EIO) from the kernel stand-in, as a waited-for job on the
    host thread gives; any other failure: DeviceError, logged. The device serves on."""
    me = threading.current_thread().name
    with EmbeddedDevice(context_factory=FailingContext) as dev:
        dev.context_init(10)
        reply = dev.create_blob(4096)
        for cmd_type in (T.FORWARD, T.LOADLIBRARY):  # inline, then on the host thread
            with pytest.raises(IoctlError) as info:
                dev.execbuffer(struct.pack("<III", cmd_type, F.DEVICE_GET_NAME, reply.res_id))
            assert info.value.errno == errno.EIO
        with caplog.at_level(logging.ERROR, logger="apir.local.embedded"):
            with pytest.raises(DeviceError, match="host bug in take_notification"):
                dev.execbuffer(_forward(F.DEVICE_GET_DESCRIPTION, reply))
        assert "host bug in take_notification" in caplog.text
        assert dev.kernel.ctx.seen[-1][:2] == (F.DEVICE_GET_DESCRIPTION, me)
        dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply))
        assert dev.kernel.ctx.seen[-1][:2] == (F.DEVICE_GET_TYPE, me)
        assert load_acquire_u32(reply.memory, 0) == len(dev.kernel.ctx.seen) + 1


class DyingContext(OrderContext):
    """LoadLibrary's notification hand-over kills the host thread (a host bug there)."""

    def take_notification(self):
        if threading.current_thread().name == HOST_THREAD:
            raise RuntimeError("host bug: the host thread dies here")
        return super().take_notification()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_closed_device_or_a_dead_host_thread_runs_nothing_inline():
    with EmbeddedDevice(context_factory=DyingContext, exec_wait_s=5.0, io_timeout_s=5.0) as dev:
        dev.context_init(10)
        reply = dev.create_blob(4096)
        dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply))
        with pytest.raises(DeviceError, match="host thread is gone"):  # the waited-for job's
            dev.execbuffer(struct.pack("<III", T.LOADLIBRARY, 0, reply.res_id))
        assert not dev._thread.is_alive()
        with pytest.raises(DeviceError, match="host thread is gone"):
            dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply))
    assert len(dev.kernel.ctx.seen) == 2
    with EmbeddedDevice(context_factory=OrderContext) as dev:
        dev.context_init(10)
        reply = dev.create_blob(4096)
        dev.close()
        with pytest.raises(DeviceError, match="closed"):
            dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply))
        assert dev.kernel.ctx.seen == []


def test_close_waits_for_an_inline_run_in_another_thread():
    """close() from another thread while a bounded command runs inline: the command ends,
    then the host thread closes the context (not under the running command)."""

    class SlowInline(OrderContext):
        closed_during_submit = None

        def submit(self, command):
            _, flags, _ = struct.unpack_from("<III", command)
            if flags == F.DEVICE_GET_MEMORY:
                started.set()
                time.sleep(0.2)
                self.closed_during_submit = self.closed
            super().submit(command)

        closed = False

        def close(self):
            self.closed = True

    started = threading.Event()
    dev = EmbeddedDevice(context_factory=SlowInline)
    dev.context_init(10)
    reply = dev.create_blob(4096)
    t = threading.Thread(target=dev.execbuffer, args=(_forward(F.DEVICE_GET_MEMORY, reply),), daemon=True)
    t.start()
    assert started.wait(10)
    dev.close()
    t.join(10)
    assert not t.is_alive()
    ctx = dev.kernel.ctx
    assert ctx.seen[-1][:2] == (F.DEVICE_GET_MEMORY, t.name)
    assert ctx.closed_during_submit is False and ctx.closed and dev.kernel.closed


def _ends_within(fn, limit_s):
    """fn() in a thread of its own: (returned in time, its exception or None); a call still
    blocked after `limit_s` is left behind (daemon)."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        out["done"] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    return out.get("done", False), out.get("error")


def test_an_inline_run_that_hangs_blocks_no_other_call_past_io_timeout_s():
    """A bounded command that never ends inline (a hung backend call) holds the device's
    lock: every other thread's call still ends within io_timeout_s (DeviceError), as it did
    when each call was a host-thread job; after close() (which gives up on the run after
    io_timeout_s), calls fail at once as on any closed device."""

    class HangingInline(OrderContext):
        def submit(self, command):
            _, flags, _ = struct.unpack_from("<III", command)
            if flags == F.DEVICE_GET_MEMORY:
                started.set()
                release.wait(30)
            super().submit(command)

    started, release = threading.Event(), threading.Event()
    dev = EmbeddedDevice(context_factory=HangingInline, io_timeout_s=0.3)
    try:
        dev.context_init(10)
        hung, reply = dev.create_blob(4096), dev.create_blob(4096)
        # (its end, once released, is left to the closed device: the stand-in's memory is gone)
        hang = lambda: dev.execbuffer(_forward(F.DEVICE_GET_MEMORY, hung))  # noqa: E731
        t = threading.Thread(target=_ends_within, args=(hang, 60))
        t.start()
        assert started.wait(10)
        for call in (
            dev.stats,
            lambda: dev.create_blob(4096),
            lambda: dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply)),
            lambda: dev.execbuffer_nowait(_forward(F.DEVICE_GET_TYPE, reply)),
        ):
            done, error = _ends_within(call, 5)
            assert done and isinstance(error, DeviceError), error
        dev.close()  # gives up on the inline run after io_timeout_s
        done, error = _ends_within(lambda: dev.execbuffer(_forward(F.DEVICE_GET_TYPE, reply)), 5)
        assert done and isinstance(error, DeviceError) and "closed" in str(error), error
    finally:
        release.set()
    t.join(10)
    assert not t.is_alive()
