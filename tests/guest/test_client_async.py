"""apir.guest.client_async: with ASYNC agreed, small sets are posted (no reply waited for) and
a get after them sees their bytes; a posted failure surfaces at the next synchronization
point with its code and the command named; the guest never has more than APIR_MAX_POSTED in
flight nor more than the post window's bytes; with ASYNC off on either side, the guest sends
exactly what it sends as an APIR 0.2 guest."""

import numpy as np
import pytest

from apir.codec.constants import (
    APIR_FORWARD_POSTED,
    APIR_MAX_POSTED,
    ApirBackendCommandType as Cmd,
    ApirExtension,
    ApirExtensionCommandType as X,
)
from apir.guest.client import ApirClient
from apir.guest.errors import PostedCommandError
from apir.guest.remote import POST_WINDOW_SIZE
from apir.local.embedded import EmbeddedDevice
from tests.local.localkit import record_execbuffers


def _commands(payloads):
    """(function id, posted) of each command in the EXECBUFFER `payloads`: posted commands
    first in a payload, each its length long (its third header word), then at most one other."""
    out = []
    for payload in payloads:
        pos = 0
        while pos < len(payload):
            flags, length = (int.from_bytes(payload[pos + k : pos + k + 4], "little") for k in (4, 8))
            posted = bool(flags & APIR_FORWARD_POSTED)
            out.append((flags & ~APIR_FORWARD_POSTED, posted))
            if not posted:
                break
            pos += length
    return out


def _tensor(client, n_floats):
    """A buffer and the rpc record of an F32 tensor of `n_floats` at its start."""
    handle = client.buffer_type_alloc_buffer(client.device_get_buffer_type(), 4 * n_floats)
    rec = np.zeros(1, dtype=client.rpc_dtype)[0]
    rec["id"], rec["type"], rec["buffer"] = 1, 0, handle  # GGML_TYPE_F32 is 0 in every ggml
    rec["ne"] = [n_floats, 1, 1, 1]
    rec["nb"] = [4, 4 * n_floats, 4 * n_floats, 4 * n_floats]
    return handle, rec


def _connect(config=None, extensions=None):
    return ApirClient.connect(EmbeddedDevice(config=config), extensions=extensions)


def test_posted_sets_then_a_get_see_the_data():
    client = _connect()
    try:
        assert client.extensions & ApirExtension.ASYNC and client.posting
        handle, rec = _tensor(client, 1024)
        waited, posted = client.remote.waited, client.remote.posted
        parts = [np.full(256, k, dtype=np.float32) for k in range(4)]
        for k, part in enumerate(parts):
            client.buffer_set_tensor(handle, rec, 1024 * k, part)
        assert (client.remote.posted - posted, client.remote.waited - waited) == (4, 0)
        assert client.in_flight == 4
        out = np.zeros(1024, dtype=np.float32)
        client.buffer_get_tensor(handle, rec, 0, out)
        np.testing.assert_array_equal(out, np.concatenate(parts))
        assert client.in_flight == 0 and client.remote.waited - waited == 1
        client.synchronize()  # nothing in flight: nothing sent
        assert client.remote.waited - waited == 1
    finally:
        client.close()


def test_a_posted_failure_surfaces_at_the_next_synchronize_naming_it():
    client = _connect()
    try:
        handle, rec = _tensor(client, 64)
        client.buffer_set_tensor(handle, rec, 0, np.ones(64, dtype=np.float32))
        client.buffer_clear(handle + 1000, 0)  # no such buffer
        client.buffer_set_tensor(handle, rec, 0, np.zeros(64, dtype=np.float32))  # skipped
        with pytest.raises(PostedCommandError) as info:
            client.synchronize()
        error = info.value
        assert (error.function, error.code, error.function_code, error.index) == ("buffer_clear", 5, 1, 1)
        assert error.posted == f"buffer_clear(buffer {handle + 1000:#x}, 0)"
        out = np.zeros(64, dtype=np.float32)
        client.buffer_get_tensor(handle, rec, 0, out)  # the failure was reported: runs again
        np.testing.assert_array_equal(out, np.ones(64, dtype=np.float32))
    finally:
        client.close()


def test_a_posted_failure_surfaces_at_the_next_waited_command():
    client = _connect()
    try:
        handle, rec = _tensor(client, 64)
        client.buffer_set_tensor(handle, rec, 0, np.ones(128, dtype=np.float32))  # past the tensor
        out = np.full(64, 5, dtype=np.float32)
        with pytest.raises(PostedCommandError) as info:
            client.buffer_get_tensor(handle, rec, 0, out)
        assert (info.value.function, info.value.index) == ("buffer_set_tensor_at", 0)
        assert "512 bytes" in str(info.value)
        np.testing.assert_array_equal(out, np.full(64, 5, dtype=np.float32))  # nothing delivered
        assert client.in_flight == 0
        client.buffer_get_tensor(handle, rec, 0, out)
        np.testing.assert_array_equal(out, np.zeros(64, dtype=np.float32))
    finally:
        client.close()


def test_the_guest_keeps_to_the_bound_and_the_window():
    client = _connect()
    try:
        handle, rec = _tensor(client, 64)
        sent = record_execbuffers(client.remote.device)
        for _ in range(APIR_MAX_POSTED + 1):
            client.buffer_clear(handle, 3)
        clear = int(Cmd.BUFFER_CLEAR)
        # docs/protocol.md 12.7's posted buffer_clear, the guest's handle in it
        spec = bytes.fromhex("02000000" "14000080" "18000000") + handle.to_bytes(8, "little") + bytes.fromhex("03000000")
        assert sent[0][:24] == spec
        assert _commands(sent) == [(clear, True)] * APIR_MAX_POSTED + [(clear, False)]  # the last waited for
        assert len(sent) == 1  # 256 clears fit one batch: they went with the call
        assert client.in_flight == 0
        big = np.zeros(POST_WINDOW_SIZE // 4 + 1, dtype=np.float32)
        big_handle, big_rec = _tensor(client, big.size)
        del sent[:]
        client.buffer_set_tensor(big_handle, big_rec, 0, big[: big.size // 2])
        client.buffer_set_tensor(big_handle, big_rec, 0, big)  # would overflow the window
        assert _commands(sent) == [(int(X.BUFFER_SET_TENSOR_AT), True), (int(Cmd.BUFFER_SET_TENSOR), False)]
        assert len(sent) == 1  # the post went with the call
    finally:
        client.close()


@pytest.mark.parametrize(
    "host, guest", [({"apir.host.extensions": "off"}, None), ({}, 0)], ids=["0.2-host", "0.2-guest"]
)
def test_without_async_on_either_side_every_byte_is_apir_0_2(host, guest):
    """An extended guest of a 0.2 host (extensions off) sends what a 0.2 guest (extensions 0)
    of the extended host sends: the same commands, each waited for, after the query the
    extended guest asks."""
    runs = []
    for config, extensions in ((host, guest), ({"apir.host.extensions": "off"}, 0)):
        client = _connect(config, extensions)
        try:
            assert not client.posting
            handle, rec = _tensor(client, 64)
            sent = record_execbuffers(client.remote.device)
            waited = client.remote.waited
            client.buffer_set_tensor(handle, rec, 0, np.ones(64, dtype=np.float32))
            client.buffer_clear(handle, 1)
            client.synchronize()
            out = np.zeros(64, dtype=np.float32)
            client.buffer_get_tensor(handle, rec, 0, out)
            assert client.remote.waited - waited == len(sent) == 3 and client.remote.posted == 0
            runs.append([c[:4] + c[4:8] + c[12:] for c in sent])  # (reply res ids may differ)
            assert out.tobytes() == b"\1" * 256  # the clear's bytes
        finally:
            client.close()
    assert runs[0] == runs[1]
