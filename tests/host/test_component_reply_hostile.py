"""The reply Encoder a reply resource keeps (apir.host.component: Resource.reply_encoder,
reset for each command, dropped by Resource.release): no state of one command reaches the next
reply (pos, fatal), a removed and re-added res_id gets an encoder over its new memory, removal
leaves the old mapping closable, tiny reply resources, several threads on one context and
several contexts over one shared reply mapping. (The guest's side, its Remote's one reply
Decoder: tests/guest/test_remote_hostile.py.)
"""

from __future__ import annotations

import mmap
import struct
import threading

import pytest

from apir.codec.constants import (
    APIR_HANDSHAKE_MAGIC, ApirBackendCommandType as Cmd, ApirCommandType as T,
    ApirLoadLibraryReturnCode,
)
from apir.host import HostContext
from apir.host.component.context import COMMAND_MALFORMED
from tests.host.hostkit import DATA_RES, REPLY_RES, Guest

FORWARD_OK = 4  # ApirForwardReturnCode.BASE_INDEX + BACKEND_RC_OK


class Recorder:
    """A tracer that keeps, for every command, (thread id, first u32 of the command, result)."""

    def __init__(self):
        self.results = []

    def describe(self, ctx, command):
        return (threading.get_ident(), struct.unpack_from("<I", command, 0)[0] if len(command) >= 4 else None)

    def finish(self, record, result, host_seconds):
        self.results.append((*record, result))


@pytest.fixture
def guest():
    g = Guest()
    yield g
    g.close()


def _cmd(cmd_type, flags, reply_res, payload=b""):
    return struct.pack("<III", cmd_type, flags, reply_res) + payload


def _submit(ctx, memory, command):
    memory[0:4] = bytes(4)
    ctx.submit(command)
    return struct.unpack_from("<I", memory, 0)[0] - 1


HANDSHAKE = _cmd(T.HANDSHAKE, 0, REPLY_RES, struct.pack("<II", 0, 2))


def test_reply_byte_counts_do_not_carry_over(guest):
    """The reply length reported per command is this command's only: a long reply (HandShake,
    8 bytes) then an empty one (LoadLibrary) then a 4-byte one (device_get_type)."""
    rec = guest.ctx.tracer = Recorder()
    guest.reply[4:64] = b"\xee" * 60
    assert _submit(guest.ctx, guest.reply, HANDSHAKE) == APIR_HANDSHAKE_MAGIC
    assert struct.unpack_from("<II", guest.reply, 4) == (0, 2)
    assert _submit(guest.ctx, guest.reply, _cmd(T.LOADLIBRARY, 0, REPLY_RES)) == ApirLoadLibraryReturnCode.ALREADY_LOADED
    assert _submit(guest.ctx, guest.reply, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), REPLY_RES)) == FORWARD_OK
    dev_type = struct.unpack_from("<I", guest.reply, 4)[0]
    assert _submit(guest.ctx, guest.reply, HANDSHAKE) == APIR_HANDSHAKE_MAGIC
    assert [r[2] for r in rec.results] == [
        (APIR_HANDSHAKE_MAGIC, 8), (ApirLoadLibraryReturnCode.ALREADY_LOADED, 0), (FORWARD_OK, 4),
        (APIR_HANDSHAKE_MAGIC, 8),
    ]
    assert dev_type == guest.forward(Cmd.DEVICE_GET_TYPE)[1].u32()
    # the reply starts at byte 4 every time: the second HandShake did not land after the type
    assert struct.unpack_from("<II", guest.reply, 4) == (0, 2)


def test_overflow_does_not_poison_the_next_commands(guest):
    """A reply that did not fit (fatal) in an 8-byte resource, then: a command with no payload
    (LoadLibrary) is not answered MALFORMED, an invalid command type is, and a fitting
    Forward gets its value, all through the same resource; a HandShake overflows again."""
    tiny = mmap.mmap(-1, 8)
    guest.ctx.add_resource(61, tiny)
    rec = guest.ctx.tracer = Recorder()
    hs = _cmd(T.HANDSHAKE, 0, 61, struct.pack("<II", 0, 2))
    assert _submit(guest.ctx, tiny, hs) == COMMAND_MALFORMED
    assert _submit(guest.ctx, tiny, _cmd(T.LOADLIBRARY, 0, 61)) == ApirLoadLibraryReturnCode.ALREADY_LOADED
    assert _submit(guest.ctx, tiny, _cmd(99, 0, 61)) == COMMAND_MALFORMED
    assert _submit(guest.ctx, tiny, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), 61)) == FORWARD_OK
    assert struct.unpack_from("<I", tiny, 4)[0] == guest.forward(Cmd.DEVICE_GET_TYPE)[1].u32()
    assert _submit(guest.ctx, tiny, hs) == COMMAND_MALFORMED
    assert [r[2] for r in rec.results[:5]] == [
        (COMMAND_MALFORMED, 0), (ApirLoadLibraryReturnCode.ALREADY_LOADED, 0), (COMMAND_MALFORMED, 0),
        (FORWARD_OK, 4), (FORWARD_OK, 4),
    ]
    guest.ctx.remove_resource(61)
    tiny.close()


@pytest.mark.parametrize("size", [4, 6, 7])
def test_reply_resource_with_no_or_partial_room(guest, size):
    """A reply resource of 4 bytes has a 0-byte window, 6 or 7 bytes a window smaller than one
    u32: empty replies are served, any payload is MALFORMED, and nothing is written past the
    resource (the mapping's page tail stays zero)."""
    mm = mmap.mmap(-1, 4096)
    view = memoryview(mm)[:size]
    guest.ctx.add_resource(70, view)
    assert _submit(guest.ctx, view, _cmd(T.LOADLIBRARY, 0, 70)) == ApirLoadLibraryReturnCode.ALREADY_LOADED
    assert _submit(guest.ctx, view, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), 70)) == COMMAND_MALFORMED
    assert _submit(guest.ctx, view, _cmd(T.HANDSHAKE, 0, 70, struct.pack("<II", 0, 2))) == COMMAND_MALFORMED
    assert _submit(guest.ctx, view, _cmd(T.LOADLIBRARY, 0, 70)) == ApirLoadLibraryReturnCode.ALREADY_LOADED
    assert mm[size:4096] == bytes(4096 - size)
    assert mm[4:size] == bytes(size - 4)
    guest.ctx.remove_resource(70)
    view.release()
    mm.close()  # no view left


def test_readded_res_id_gets_an_encoder_over_its_new_memory(guest):
    """res 61: a 16 KiB mapping used for replies, removed (the mapping can be closed at once),
    then re-added as 8 bytes: a HandShake no longer fits (an encoder kept from the old
    resource would have had 16 KiB of room); removed again and re-added as a fresh 4 KiB
    mapping: the reply lands there, and the first small one is untouched."""
    big = mmap.mmap(-1, 16384)
    guest.ctx.add_resource(61, big)
    hs = _cmd(T.HANDSHAKE, 0, 61, struct.pack("<II", 0, 2))
    assert _submit(guest.ctx, big, hs) == APIR_HANDSHAKE_MAGIC
    guest.ctx.remove_resource(61)
    big.close()  # BufferError if the kept encoder (or anything) still viewed it
    small = mmap.mmap(-1, 8)
    guest.ctx.add_resource(61, small)
    assert _submit(guest.ctx, small, hs) == COMMAND_MALFORMED
    assert small[4:8] == bytes(4)
    guest.ctx.remove_resource(61)
    again = mmap.mmap(-1, 4096)
    guest.ctx.add_resource(61, again)
    small[:] = b"\x55" * 8
    assert _submit(guest.ctx, again, hs) == APIR_HANDSHAKE_MAGIC
    assert struct.unpack_from("<II", again, 4) == (0, 2)
    assert small[:] == b"\x55" * 8
    small.close()
    guest.ctx.remove_resource(61)
    again.close()


def test_reply_resource_removed_after_a_malformed_reply_and_context_close(guest):
    """The last reply resource is the target of a header-less command's MALFORMED reply;
    once it is removed that command gets no reply, and every mapping can be closed after
    the context is (its kept encoders and words go with it)."""
    extra = mmap.mmap(-1, 4096)
    guest.ctx.add_resource(62, extra)
    assert _submit(guest.ctx, extra, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), 62)) == FORWARD_OK
    assert _submit(guest.ctx, extra, b"\x01\x02") == COMMAND_MALFORMED  # truncated header
    guest.ctx.remove_resource(62)
    extra[0:4] = bytes(4)
    guest.ctx.submit(b"\x01\x02")
    assert extra[0:4] == bytes(4)  # no reply: the removed resource is not written
    extra.close()
    assert guest.raw(_cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), REPLY_RES)) == FORWARD_OK
    guest.ctx.close()
    guest.reply.close()
    guest.data.close()


def test_data_window_as_reply_resource(guest):
    """The data window named as the reply resource: the reply goes at byte 4 of it, the
    real reply resource is left alone, and the data window's encoder is its own (a long
    HandShake reply there does not move the next reply in the reply resource)."""
    guest.data[0:16] = b"\xaa" * 16
    guest.reply[0:16] = b"\xbb" * 16
    assert _submit(guest.ctx, guest.data, _cmd(T.HANDSHAKE, 0, DATA_RES, struct.pack("<II", 0, 2))) == APIR_HANDSHAKE_MAGIC
    assert struct.unpack_from("<II", guest.data, 4) == (0, 2)
    assert guest.data[12:16] == b"\xaa" * 4
    assert guest.reply[0:16] == b"\xbb" * 16
    assert _submit(guest.ctx, guest.reply, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), REPLY_RES)) == FORWARD_OK
    dev_type = struct.unpack_from("<I", guest.reply, 4)[0]
    assert _submit(guest.ctx, guest.data, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), DATA_RES)) == FORWARD_OK
    assert struct.unpack_from("<II", guest.data, 4) == (dev_type, 2)  # type at 4, old byte 8.. stays
    assert guest.reply[8:16] == b"\xbb" * 8


def test_threads_on_one_context_each_with_its_reply_resource(guest):
    """Three threads submit to one context, each naming its own reply resource, alternating
    HandShake (8 bytes) and device_get_type (4 bytes): every reply is whole and at byte 4,
    and every command's reported length is its own."""
    rec = guest.ctx.tracer = Recorder()
    dev_type = guest.forward(Cmd.DEVICE_GET_TYPE)[1].u32()
    mems = {}
    for t in range(3):
        mems[t] = mmap.mmap(-1, 4096)
        guest.ctx.add_resource(80 + t, mems[t])
    errors = []

    def run(t):
        mem, rid = mems[t], 80 + t
        try:
            for i in range(150):
                if i % 2:
                    assert _submit(guest.ctx, mem, _cmd(T.HANDSHAKE, 0, rid, struct.pack("<II", 0, 2))) == APIR_HANDSHAKE_MAGIC
                    assert struct.unpack_from("<II", mem, 4) == (0, 2)
                else:
                    assert _submit(guest.ctx, mem, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), rid)) == FORWARD_OK
                    assert struct.unpack_from("<I", mem, 4)[0] == dev_type
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    seen = [r for r in rec.results if r[1] in (T.HANDSHAKE, T.FORWARD)][1:]  # after the fixture's get_type
    assert len(seen) == 450
    for _, cmd_type, result in seen:
        assert result == ((APIR_HANDSHAKE_MAGIC, 8) if cmd_type == T.HANDSHAKE else (FORWARD_OK, 4))
    guest.ctx.tracer = None
    for t in range(3):
        guest.ctx.remove_resource(80 + t)
        mems[t].close()


def test_two_contexts_over_one_reply_mapping():
    """Two contexts register the same mapping as their reply resource (same res_id): each
    wraps it in a Resource of its own with its own encoder; removing it from one leaves the
    other serving replies into it, and the mapping closes once both dropped it."""
    a, b = Guest(HostContext(31)), Guest(HostContext(32))
    shared = mmap.mmap(-1, 4096)
    a.ctx.add_resource(90, shared)
    b.ctx.add_resource(90, shared)
    assert a.ctx.get_shmem(90) is not b.ctx.get_shmem(90)
    hs = _cmd(T.HANDSHAKE, 0, 90, struct.pack("<II", 0, 2))
    assert _submit(a.ctx, shared, hs) == APIR_HANDSHAKE_MAGIC
    assert _submit(b.ctx, shared, _cmd(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), 90)) == FORWARD_OK
    dev_type = struct.unpack_from("<I", shared, 4)[0]
    assert dev_type == a.forward(Cmd.DEVICE_GET_TYPE)[1].u32()
    a.ctx.remove_resource(90)
    with pytest.raises(BufferError):
        shared.close()  # b still holds it
    assert _submit(b.ctx, shared, hs) == APIR_HANDSHAKE_MAGIC
    assert struct.unpack_from("<II", shared, 4) == (0, 2)
    b.ctx.remove_resource(90)
    shared.close()
    a.close()
    b.close()
