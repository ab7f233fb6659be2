"""Pipelined tensor transfers (apir.guest.client_buffer, Remote.transfer_windows and
Remote.call's `meanwhile`): a transfer larger than one chunk alternates between two windows,
and the guest's copy of one chunk happens while the host serves the previous one.

- Byte-exact round trips of sizes around the chunk and window boundaries, at an odd offset,
  with the bytes around them untouched, against the C reference host (byte compatibility),
  apir's HostContext, an embedded host thread and a socket host process.
- The overlap itself, on a device that runs a command only once the guest waits for it: by
  then the next chunk is already in the other window (upload), the previous chunk already in
  the caller's buffer (download).
- A chunk the host refuses in the middle: its error is the call's, no later chunk reaches the
  host (upload) or the caller's buffer (download), and the client stays usable.
- A host that dies mid-transfer: an error at once, no later chunk sent (socket host killed).
"""

import signal
import threading
import time

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as F
from apir.local.wire import Op
from apir.codec.records import RPC_TENSOR_DTYPE
from apir.codec.wire import Decoder
from apir.guest.errors import BackendFunctionError, DeviceError
from apir.guest.local import HostConnectionLost, LocalDevice
from apir.guest.remote import Remote
from apir.local.embedded import EmbeddedDevice
from tests.guest.hosts import CHostContext, SyncDevice, connect, shared_c_host
from tests.local.hostproc import HostProcess

CHUNK = 16 * 1024  # the transfer chunk (one blob alignment)
WINDOW = 4 * CHUNK  # the data window: larger, so the one-window path is a different size
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, WINDOW, WINDOW + 1, 9 * CHUNK + 5]
OFFSET = 3  # odd: chunks start off any alignment
TENSOR = 10 * CHUNK + 64  # bytes of the I8 tensor every transfer goes to


@pytest.fixture(scope="module")
def g():
    import apir.ggml

    return apir.ggml.load()


def _host_context(request, kind):
    if kind == "c-host":
        return shared_c_host(request.getfixturevalue("cref_020"))
    from apir.host.component.context import HostContext

    return HostContext(11)


def _connect(device):
    return connect(device, data_size=WINDOW, transfer_chunk=CHUNK, forward_timeout_s=30)


def rpc(g, buffer, n=TENSOR):
    """An I8 vector of `n` bytes at the start of `buffer`, as an apir_rpc_tensor record."""
    rec = np.zeros((), RPC_TENSOR_DTYPE)
    rec["id"], rec["type"], rec["buffer"] = 0x77, g.types["I8"], buffer
    rec["ne"] = [n, 1, 1, 1]
    rec["nb"] = [1, n, n, n]
    return rec


def _alloc(client, size=TENSOR):
    return client.buffer_type_alloc_buffer(client.device_get_buffer_type(), size)


def _bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _chunks(data, step=CHUNK):
    return [data[k : k + step] for k in range(0, len(data), step)]


@pytest.fixture(scope="module", params=["c-host", "apir-host", "embedded", "socket"])
def client(request, tmp_path_factory):
    host = None
    if request.param == "embedded":
        device = EmbeddedDevice()
    elif request.param == "socket":
        host = HostProcess(tmp_path_factory.mktemp("pipe") / "apir.sock")
        device = LocalDevice(host.path)
    else:
        device = SyncDevice(_host_context(request, request.param), owns_host=False)
    c = _connect(device)
    yield c
    c.close()
    if host is not None:
        host.stop()


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_byte_exact_around_chunk_and_window_sizes(client, g, size):
    buffer = _alloc(client)
    try:
        t = rpc(g, buffer)
        background = _bytes(TENSOR, 1)
        client.buffer_set_tensor(buffer, t, 0, background)
        data = _bytes(size, size)
        client.buffer_set_tensor(buffer, t, OFFSET, data)
        out = np.full(size, 0xA5, np.uint8)
        client.buffer_get_tensor(buffer, t, OFFSET, out)
        assert np.array_equal(out, data)
        whole = np.empty(TENSOR, np.uint8)
        client.buffer_get_tensor(buffer, t, 0, whole)
        expect = background.copy()
        expect[OFFSET : OFFSET + size] = data
        assert np.array_equal(whole, expect)  # nothing before or past the transfer touched
        windows = client.remote.transfer_windows(size)
        assert len(windows) == (2 if size > CHUNK else 1)
        assert [w.size for _, w in windows] == ([CHUNK, CHUNK] if size > CHUNK else [WINDOW])
    finally:
        client.buffer_free_buffer(buffer)


# --- the overlap, on a device that runs a command only when the guest waits for it ---------------


class DeferredDevice(SyncDevice):
    """A SyncDevice whose `execbuffer_nowait` leaves the command for `watch` (the guest's wait
    on the reply word) to run, so whatever the guest does in between happens strictly while
    the command is in flight. `before_run(command) -> command` sees (and may change) each
    command just before the host runs it; `gone_at`: the command index at which `watch`
    raises DeviceError instead (a dead host)."""

    def __init__(self, ctx, before_run=None, gone_at=None):
        super().__init__(ctx, owns_host=False)
        self.before_run = before_run
        self.gone_at = gone_at
        self.pending = None
        self.ran = []  # every command run, as sent
        self.nowait = 0

    def execbuffer(self, payload, ring_idx=0):
        assert self.pending is None, "a command was sent while another was in flight"
        self._run(bytes(payload))

    def execbuffer_nowait(self, payload, ring_idx=0):
        assert self.pending is None, "a command was sent while another was in flight"
        self.nowait += 1
        self.pending = bytes(payload)

    def watch(self, timeout_s):
        if self.pending is not None:
            command, self.pending = self.pending, None
            if self.gone_at is not None and len(self.ran) == self.gone_at:
                raise DeviceError("deferred: the host is gone")
            self._run(command)

    def _run(self, command):
        if self.before_run is not None:
            command = self.before_run(command)
        self.ran.append(command)
        self.submitted += 1
        self.ctx.submit(command)


def transfer_args(command):
    """(function, window res_id, tensor offset, size, byte offset of the res_id) of a
    buffer_set/get_tensor command; None for any other command."""
    dec = Decoder(command, 0)
    _cmd_type, flags, _reply = dec.i32(), dec.i32(), dec.u32()
    if flags not in (F.BUFFER_SET_TENSOR, F.BUFFER_GET_TENSOR):
        return None
    dec.handle()
    dec.blob(RPC_TENSOR_DTYPE.itemsize)
    at = dec.pos
    return F(flags), dec.u32(), dec.size_t(), dec.size_t(), at


@pytest.fixture(params=["c-host", "apir-host"])
def host(request):
    ctx = _host_context(request, request.param)
    yield ctx
    if not isinstance(ctx, CHostContext):
        ctx.close()


def test_upload_copies_the_next_chunk_while_the_host_takes_this_one(host, g):
    seen = []
    client = None

    def before_run(command):
        args = transfer_args(command)
        if args is not None and args[0] == F.BUFFER_SET_TENSOR:
            _, res_id, offset, size, _ = args
            k = offset // CHUNK
            nxt = data[(k + 1) * CHUNK : (k + 2) * CHUNK]
            # the other window, as the guest left it before waiting for this command
            other = [view for rid, view in client.remote.transfer_windows(len(data)) if rid != res_id][0]
            seen.append((res_id, offset, size, bool(np.array_equal(other[: nxt.size], nxt))))
        return command

    device = DeferredDevice(host, before_run)
    client = _connect(device)
    try:
        buffer = _alloc(client)
        data = _bytes(5 * CHUNK + 7, 2)
        client.buffer_set_tensor(buffer, rpc(g, buffer), 0, data)
        windows = [rid for rid, _ in client.remote.transfer_windows(len(data))]
        assert [s[:3] for s in seen] == [
            (windows[k % 2], k * CHUNK, min(CHUNK, len(data) - k * CHUNK)) for k in range(6)
        ]
        assert [s[3] for s in seen[:-1]] == [True] * 5  # chunk k+1 was in place while k ran
        assert device.nowait == 5  # the last chunk has nothing to overlap: a plain execbuffer
        out = np.empty(len(data), np.uint8)
        client.buffer_get_tensor(buffer, rpc(g, buffer), 0, out)
        assert np.array_equal(out, data)
        client.buffer_free_buffer(buffer)
    finally:
        client.close()


def test_download_copies_the_previous_chunk_out_while_the_host_fills_this_one(host, g):
    seen = []
    out = None

    def before_run(command):
        args = transfer_args(command)
        if args is not None and args[0] == F.BUFFER_GET_TENSOR:
            _, res_id, offset, size, _ = args
            k = offset // CHUNK
            done = bool(np.array_equal(out[: k * CHUNK], data[: k * CHUNK]))  # chunks before k
            rest = bool((out[k * CHUNK :] == 0xA5).all())  # none from k on
            seen.append((offset, done, rest))
        return command

    device = DeferredDevice(host, before_run)
    client = _connect(device)
    try:
        buffer = _alloc(client)
        data = _bytes(5 * CHUNK + 7, 3)
        client.buffer_set_tensor(buffer, rpc(g, buffer), 0, data)
        out = np.full(len(data), 0xA5, np.uint8)
        before = device.nowait
        client.buffer_get_tensor(buffer, rpc(g, buffer), 0, out)
        assert np.array_equal(out, data)
        # when chunk k ran, chunks 0..k-1 were already in `out` (k-1 copied out meanwhile)
        assert seen == [(k * CHUNK, True, True) for k in range(6)]
        assert device.nowait - before == 5  # every chunk but the first overlaps a copy-out
        client.buffer_free_buffer(buffer)
    finally:
        client.close()


# --- a refused chunk in the middle ------------------------------------------------------------


REFUSED = 2  # the third chunk of five


def _refusing(bad_res_id, function):
    """before_run that sends the REFUSED-th chunk of `function` to an unknown window."""
    count = [0]

    def before_run(command):
        args = transfer_args(command)
        if args is None or args[0] != function:
            return command
        count[0] += 1
        if count[0] - 1 != REFUSED:
            return command
        at = args[4]
        return command[:at] + bad_res_id.to_bytes(4, "little") + command[at + 4 :]

    return before_run


def test_a_refused_middle_chunk_fails_the_upload_and_nothing_after_it_is_written(host, g):
    device = DeferredDevice(host, _refusing(0xBAD1D, F.BUFFER_SET_TENSOR))
    client = _connect(device)
    try:
        buffer = _alloc(client)
        t = rpc(g, buffer)
        old = _bytes(TENSOR, 4)
        device.before_run, refuse = None, device.before_run
        client.buffer_set_tensor(buffer, t, 0, old)  # not counted among the chunks below
        device.before_run = refuse
        new = _bytes(5 * CHUNK, 5)
        sent = len(device.ran)
        with pytest.raises(BackendFunctionError) as info:
            client.buffer_set_tensor(buffer, t, 0, new)
        assert info.value.function == "buffer_set_tensor"
        assert len(device.ran) - sent == REFUSED + 1  # no chunk sent after the refused one
        device.before_run = None
        whole = np.empty(TENSOR, np.uint8)
        client.buffer_get_tensor(buffer, t, 0, whole)  # the client is still usable
        edge = REFUSED * CHUNK
        assert np.array_equal(whole[:edge], new[:edge])  # the chunks before it landed
        assert np.array_equal(whole[edge:], old[edge:])  # nothing from it on
        client.buffer_free_buffer(buffer)
    finally:
        client.close()


def test_a_refused_middle_chunk_fails_the_download_and_nothing_after_it_is_copied_out(host, g):
    device = DeferredDevice(host, _refusing(0xBAD1D, F.BUFFER_GET_TENSOR))
    client = _connect(device)
    try:
        buffer = _alloc(client)
        t = rpc(g, buffer)
        data = _bytes(TENSOR, 6)
        client.buffer_set_tensor(buffer, t, 0, data)
        out = np.full(5 * CHUNK, 0xA5, np.uint8)
        sent = len(device.ran)
        with pytest.raises(BackendFunctionError) as info:
            client.buffer_get_tensor(buffer, t, 0, out)
        assert info.value.function == "buffer_get_tensor"
        assert len(device.ran) - sent == REFUSED + 1
        edge = REFUSED * CHUNK
        assert np.array_equal(out[:edge], data[:edge])
        assert (out[edge:] == 0xA5).all()  # not even the refused chunk's window is copied out
        device.before_run = None
        out[:] = 0
        client.buffer_get_tensor(buffer, t, 0, out)
        assert np.array_equal(out, data[: out.size])
        client.buffer_free_buffer(buffer)
    finally:
        client.close()


def test_a_host_gone_mid_transfer_ends_it_with_no_chunk_sent_after(g):
    from apir.host.component.context import HostContext

    device = DeferredDevice(HostContext(12))
    client = _connect(device)
    try:
        buffer = _alloc(client)
        device.gone_at = len(device.ran) + 2  # the third chunk's wait finds the host gone
        with pytest.raises(DeviceError, match="host is gone"):
            client.buffer_set_tensor(buffer, rpc(g, buffer), 0, _bytes(5 * CHUNK, 7))
        assert len(device.ran) == device.gone_at and device.pending is None
    finally:
        device.gone_at = None
        client.close()
        device.ctx.close()


def test_meanwhile_that_raises_still_waits_for_the_reply(host):
    device = DeferredDevice(host)
    client = _connect(device)
    try:

        def boom():
            raise ValueError("copy failed")

        with pytest.raises(ValueError, match="copy failed"):
            client._call(F.DEVICE_GET_COUNT, meanwhile=boom)
        assert device.pending is None  # the command ran (the wait took its reply) ...
        assert client.device_get_count() == 1  # ... and the next call gets its own
    finally:
        client.close()


class _NoSecondBlob(SyncDevice):
    """Refuses every blob after the reply blob and the data window."""

    def create_blob(self, size):
        if len(self.blobs) >= 2:
            raise DeviceError("no more blobs")
        return super().create_blob(size)


def test_a_refused_second_window_leaves_transfers_one_window_at_a_time(host, g):
    device = _NoSecondBlob(host, owns_host=False)
    client = _connect(device)
    try:
        buffer = _alloc(client)
        data = _bytes(9 * CHUNK + 5, 8)
        client.buffer_set_tensor(buffer, rpc(g, buffer), 0, data)
        out = np.empty(len(data), np.uint8)
        client.buffer_get_tensor(buffer, rpc(g, buffer), 0, out)
        assert np.array_equal(out, data)
        assert [w.size for _, w in client.remote.transfer_windows(len(data))] == [WINDOW]
        client.buffer_free_buffer(buffer)
    finally:
        client.close()
    assert device.blobs == {}


def test_the_second_window_is_made_once_and_destroyed_with_the_remote(host, g):
    device = SyncDevice(host, owns_host=False)
    client = _connect(device)
    buffer = _alloc(client)
    for _ in range(3):
        client.buffer_set_tensor(buffer, rpc(g, buffer), 0, _bytes(3 * CHUNK, 9))
    assert len(device.blobs) == 3  # reply, data window, second window
    client.buffer_free_buffer(buffer)
    client.close()
    assert device.blobs == {}


# --- a socket host killed mid-transfer ----------------------------------------------------------


class _StoppingDevice(LocalDevice):
    """A LocalDevice that stops its host (SIGSTOP, `host.pause`) right after sending the
    `stop_at`-th EXECBUFFER that does not wait (a chunk of a pipelined transfer), and counts
    the EXECBUFFER requests sent."""

    def __init__(self, host, stop_at, *args, **kwargs):
        self.host, self.stop_at = host, stop_at
        self.execs = self.nowaits = 0
        self.stopped_at = None
        super().__init__(host.path, *args, **kwargs)

    def _send(self, op, payload):
        seq = super()._send(op, payload)
        if op == Op.EXECBUFFER:
            self.execs += 1
        return seq

    def execbuffer_nowait(self, payload, ring_idx=0):
        super().execbuffer_nowait(payload, ring_idx)
        self.nowaits += 1
        if self.nowaits == self.stop_at:
            self.host.pause()
            self.stopped_at = self.execs


def test_socket_host_killed_mid_transfer_is_an_error_at_once(tmp_path, g):
    h = HostProcess(tmp_path / "apir.sock")
    try:
        dev = _StoppingDevice(h, 3)
        client = _connect(dev)
        size = 64 * CHUNK
        buffer = _alloc(client, size)
        outcome = {}

        def upload():
            try:
                client.buffer_set_tensor(buffer, rpc(g, buffer, size), 0, np.ones(size, np.uint8))
                outcome["value"] = "done"
            except Exception as exc:  # noqa: BLE001 - handed to the test
                outcome["error"] = exc
            outcome["done"] = time.monotonic()

        t = threading.Thread(target=upload, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while dev.stopped_at is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert dev.stopped_at is not None, outcome
        time.sleep(0.2)
        assert t.is_alive() and outcome == {}, outcome  # a stopped host cannot finish it
        sent = dev.execs
        assert sent - dev.stopped_at <= 1  # at most the chunk after a reply that beat the stop
        killed = time.monotonic()
        h.signal(signal.SIGKILL)
        t.join(10)
        assert not t.is_alive(), "the guest still waits on a dead host"
        assert isinstance(outcome.get("error"), HostConnectionLost), outcome
        assert outcome["done"] - killed < 10
        assert dev.execs == sent  # nothing sent to a dead host
        with pytest.raises(HostConnectionLost):
            client.device_get_count()
    finally:
        h.stop()


def test_remote_transfer_chunk_is_bounded_by_the_window():
    from tests.guest.hosts import SilentHost

    with Remote(SyncDevice(SilentHost()), data_size=WINDOW, transfer_chunk=1 << 30) as remote:
        assert remote.transfer_chunk == WINDOW
    with pytest.raises(ValueError):
        Remote(SyncDevice(SilentHost()), transfer_chunk=0)
