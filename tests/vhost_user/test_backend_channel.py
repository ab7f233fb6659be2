"""The back-end channel's wait for QEMU's ack is a deadline for the whole answer: an ack
trickled or cut short fails the request (BackendError) in time, and the channel is not used
again."""

import socket
import threading

import pytest

from apir.host.vhost_user import protocol as vu
from apir.host.vhost_user.backend_channel import BackendChannel, BackendError


def _ask(channel: BackendChannel) -> list:
    """shmem_unmap on a thread; [exception or None] once it returns (within 20 s)."""
    result: list = []

    def run():
        try:
            channel.shmem_unmap(1, 0, 4096)
            result.append(None)
        except BackendError as exc:
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert result, "the back-end request is still waiting"
    return result


@pytest.mark.parametrize("sent", [1, vu.HEADER.size, vu.HEADER.size + 4])
def test_an_ack_cut_short_fails_the_request_in_time(sent):
    ours, qemu = socket.socketpair()
    channel = BackendChannel(ours, timeout_s=0.3)
    ack = vu.HEADER.pack(vu.BackendRequest.SHMEM_UNMAP, vu.FLAG_VERSION | vu.FLAG_REPLY, 8) + vu.U64.pack(0)

    def answer():
        qemu.recv(4096)
        qemu.send(ack[:sent])  # and then nothing

    threading.Thread(target=answer, daemon=True).start()
    try:
        (error,) = _ask(channel)
        assert isinstance(error, BackendError)
        with pytest.raises(BackendError, match="failed earlier"):
            channel.shmem_unmap(1, 0, 4096)
    finally:
        channel.close()
        qemu.close()


def test_a_whole_ack_is_taken():
    ours, qemu = socket.socketpair()
    channel = BackendChannel(ours, timeout_s=5)
    ack = vu.HEADER.pack(vu.BackendRequest.SHMEM_UNMAP, vu.FLAG_VERSION | vu.FLAG_REPLY, 8) + vu.U64.pack(0)

    def answer():
        qemu.recv(4096)
        qemu.send(ack)

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert _ask(channel) == [None]
    finally:
        channel.close()
        qemu.close()


def test_a_front_end_that_left_is_told_from_one_that_misbehaves():
    # QEMU powering off closes the channel with unmaps still queued: the device logs those at
    # info (the mappings went with the front-end), a broken ack stays an error
    ours, qemu = socket.socketpair()
    channel = BackendChannel(ours, timeout_s=5)
    qemu.close()
    try:
        (error,) = _ask(channel)
        assert isinstance(error, BackendError) and error.peer_gone
        with pytest.raises(BackendError, match="failed earlier") as again:
            channel.shmem_unmap(1, 0, 4096)
        assert again.value.peer_gone
    finally:
        channel.close()
    ours, qemu = socket.socketpair()
    channel = BackendChannel(ours, timeout_s=5)

    def answer():
        qemu.recv(4096)
        qemu.send(vu.HEADER.pack(vu.BackendRequest.SHMEM_MAP, vu.FLAG_VERSION | vu.FLAG_REPLY, 8) + vu.U64.pack(0))

    threading.Thread(target=answer, daemon=True).start()
    try:
        (error,) = _ask(channel)  # an ack for another request: misbehaving, not gone
        assert isinstance(error, BackendError) and not error.peer_gone
    finally:
        channel.close()
        qemu.close()
